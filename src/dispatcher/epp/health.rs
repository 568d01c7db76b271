//! `grpc.health.v1.Health` beside the picker: liveness (`""`,
//! `liveness`) is always serving; readiness (`readiness`, and the
//! picker's own service name, as Kubernetes' gRPC probes and Envoy's
//! health checks ask) is `NOT_SERVING` until the dispatcher can route,
//! that is while no inference server is up (as the HTTP front's
//! `/health`).

use std::sync::Arc;
use std::time::Duration;

use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::dispatcher::Dispatcher;
use crate::routing::live_candidates;

/// The service names whose status is readiness.
pub const READINESS: [&str; 2] = ["readiness", "envoy.service.ext_proc.v3.ExternalProcessor"];
/// The service names whose status is liveness.
pub const LIVENESS: [&str; 2] = ["", "liveness"];

/// How often readiness is looked at again.
const EVERY: Duration = Duration::from_millis(200);

/// Whether `dispatcher` can route: at least one server is up.
pub fn ready(dispatcher: &Dispatcher) -> bool {
    let mut live = Vec::new();
    live_candidates(&dispatcher.segment().tables(), &mut live);
    !live.is_empty()
}

/// Keeps `reporter`'s statuses up to date (runs until dropped).
pub async fn report(dispatcher: Arc<Dispatcher>, reporter: HealthReporter) {
    for name in LIVENESS {
        reporter.set_service_status(name, ServingStatus::Serving).await;
    }
    let mut last = None;
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now = ready(&dispatcher);
        if last != Some(now) {
            last = Some(now);
            let status = if now {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            for name in READINESS {
                reporter.set_service_status(name, status).await;
            }
        }
    }
}
