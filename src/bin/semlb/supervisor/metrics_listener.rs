//! The metrics listener (`[metrics] listen` / `--metrics-listen`): the
//! supervisor serves `GET /metrics` on an address of its own, so that
//! Prometheus scrapes a management address and the gateway's public
//! listener does not expose the gateway's internals (it answers `/metrics`
//! with 404 then). The text is the same as the dispatchers' `/metrics`
//! would give: every process's counters summed and the gauges read from the
//! segment ([`semlb::metrics::Snapshot`]), rendered on a blocking thread
//! from the listener's own mapping of the segment, never on the
//! supervisor's loop.

use std::sync::Arc;

use bytes::Bytes;
use http::{Method, StatusCode, header};
use http_body_util::Full;
use semlb::metrics::Snapshot;
use shm_layout::Segment;
use tokio::net::TcpListener;

/// Connections served at once.
pub const MAX_METRICS_CONNECTIONS: usize = 8;

/// Serves `GET /metrics` from `segment` on `listener` until the task is
/// dropped; `stale_after_ms` as `health.stale_after_ms`.
pub async fn serve(listener: TcpListener, segment: Arc<Segment>, stale_after_ms: u64) {
    crate::supervisor::side_listener::serve(listener, "metrics listener", MAX_METRICS_CONNECTIONS, move |request| {
        let segment = segment.clone();
        async move { answer(request.method(), request.uri().path(), segment, stale_after_ms).await }
    })
    .await;
}

async fn answer(
    method: &Method,
    path: &str,
    segment: Arc<Segment>,
    stale_after_ms: u64,
) -> http::Response<Full<Bytes>> {
    if path != "/metrics" {
        return text(
            StatusCode::NOT_FOUND,
            format!("{path} is not served here; GET /metrics is\n"),
        );
    }
    if method != Method::GET && method != Method::HEAD {
        let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "use GET\n".to_owned());
        r.headers_mut()
            .insert(header::ALLOW, header::HeaderValue::from_static("GET"));
        return r;
    }
    let render = move || Snapshot::text_of(&segment, stale_after_ms);
    match tokio::task::spawn_blocking(render).await {
        Ok(body) => {
            let mut r = text(StatusCode::OK, body);
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            r
        }
        Err(e) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("rendering the metrics failed: {e}\n"),
        ),
    }
}

fn text(status: StatusCode, body: String) -> http::Response<Full<Bytes>> {
    let mut r = http::Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}
