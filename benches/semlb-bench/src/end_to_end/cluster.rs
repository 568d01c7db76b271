//! The processes of a run: simulated engines (`semlb __sim`) and the
//! gateway (`semlb serve`) in front of them, keeping its routing state in
//! shared memory or Redis, started with `semlb-test-support`'s process
//! helpers. Shared with the replay and proxy reports.

use std::time::Duration;

use anyhow::Result;
use semlb::routing::PolicyKind;
use semlb_test_support::gateway::{Gateway, kv_backend_table};
use semlb_test_support::process::{Proc, ProcBuilder, Stderr};

/// A unique name for this run's resources (shm segment, Redis namespace).
pub(crate) fn unique_name(tag: &str) -> String {
    semlb_test_support::process::unique("bench", tag)
}

/// `n` simulated engines (`semlb __sim`) with `time_scale`, serving
/// `/metrics` or not (`--no-metrics`; their own `/sim/metrics` still shows
/// their counters), publishing their KV cache events or not (`kv_events`:
/// on free ports, with a replay socket, as vLLM's `--kv-events-config`).
pub(crate) fn start_engines(
    n: usize,
    time_scale: f64,
    kv_tokens: Option<u64>,
    metrics: bool,
    kv_events: bool,
) -> Result<Vec<Proc>> {
    (0..n)
        .map(|i| {
            let scale = time_scale.to_string();
            let mut args = vec![
                "__sim".to_owned(),
                "--listen".into(),
                "127.0.0.1:0".into(),
                "--time-scale".into(),
                scale,
            ];
            if !metrics {
                args.push("--no-metrics".into());
            }
            if let Some(kv) = kv_tokens {
                args.extend(["--kv-capacity-tokens".to_owned(), kv.to_string()]);
            }
            if kv_events {
                args.extend([
                    "--kv-events-config".to_owned(),
                    r#"{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}"#.to_owned(),
                ]);
            }
            let proc = ProcBuilder::new(args)
                .what(format!("simulated engine {i}"))
                .stderr(Stderr::Tail(40))
                .within(Duration::from_secs(30))
                .try_start()?;
            Ok(proc)
        })
        .collect()
}

/// Where the gateway keeps its routing state.
#[derive(Debug, Clone)]
pub(crate) enum Store {
    /// The shared-memory segment.
    Shm,
    /// A Redis server, under a namespace.
    Redis {
        /// `redis://…` URL.
        url: String,
        /// Key prefix.
        namespace: String,
    },
}

/// What [`start_gateway`] runs.
#[derive(Debug, Clone)]
pub(crate) struct GatewaySpec {
    /// Dispatcher processes.
    pub(crate) dispatchers: usize,
    /// Routing policy (`None`: the default).
    pub(crate) policy: Option<PolicyKind>,
    /// Routing-state store.
    pub(crate) store: Store,
    /// `--shm-size`.
    pub(crate) shm_size: String,
    /// A tag for the shm name.
    pub(crate) tag: String,
    /// A configuration file's TOML text, passed as `--config` (written to a
    /// file of the run's own, removed with the gateway); `None`: no file.
    pub(crate) config: Option<String>,
    /// Follow the engines' KV cache events: the engines are `[[backend]]`
    /// tables of the configuration with their `kv_events` endpoints (the
    /// engines must publish them), not `--backend` flags.
    pub(crate) kv_events: bool,
    /// The admin API on a free loopback port with this token (see
    /// [`Gateway::admin_addr`]).
    pub(crate) admin_token: Option<String>,
}

/// Why [`start_gateway`] failed.
#[derive(Debug)]
pub(crate) enum GatewayError {
    /// `semlb serve` does not know a flag (e.g. `--store` in an older build).
    UnknownFlag(String),
    /// Anything else.
    Other(anyhow::Error),
}

/// Starts the gateway (supervisor, dispatchers, one responder) in front of
/// `engines` and waits until `/health` answers 200; it is stopped with
/// SIGTERM and its segment and files removed when dropped.
pub(crate) fn start_gateway(spec: &GatewaySpec, engines: &[Proc]) -> Result<Gateway, GatewayError> {
    let mut builder = Gateway::builder()
        .shm(&unique_name(&spec.tag))
        .tag(&spec.tag)
        .shm_size(&spec.shm_size)
        .dispatchers(spec.dispatchers)
        .stderr(Stderr::Tail(40))
        .within(Duration::from_secs(60));
    if let Some(token) = &spec.admin_token {
        // The admin API's address is read from the log: keep enough of it.
        builder = builder.stderr(Stderr::Tail(400)).admin(token);
    }
    let mut config = spec.config.clone();
    if spec.kv_events {
        let mut tables = String::new();
        for e in engines {
            let Some(table) = kv_backend_table(e) else {
                return Err(GatewayError::Other(anyhow::anyhow!(
                    "engine {} publishes no KV events ({:?})",
                    e.addr,
                    e.line
                )));
            };
            tables.push_str(&table);
        }
        config = Some(config.unwrap_or_default() + &tables);
    } else {
        builder = builder.backends(&engines.iter().collect::<Vec<_>>());
    }
    if let Some(policy) = spec.policy {
        builder = builder.policy(&policy.to_string());
    }
    if let Some(text) = &config {
        builder = builder.config(text);
    }
    if let Store::Redis { url, namespace } = &spec.store {
        builder = builder.redis(url, namespace);
    }
    builder.try_start().map_err(|e| match e {
        semlb_test_support::Error::NoAddress { stderr, .. } if stderr.contains("unexpected argument") => {
            GatewayError::UnknownFlag(stderr)
        }
        e => GatewayError::Other(e.into()),
    })
}
