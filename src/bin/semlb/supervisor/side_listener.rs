//! The supervisor's own small HTTP/1.1 listeners (the admin API,
//! [`crate::supervisor::admin::http`], and the metrics listener, [`crate::supervisor::metrics_listener`]):
//! an accept loop with a cap on open connections and a header deadline.
//! They share the supervisor's runtime with reaping children and the
//! watchdog, so a flood of connections is closed at accept beyond the cap,
//! and a slow client cannot hold one past the header deadline.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

/// How long a client may take to send a request's headers.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `listener` until the task is dropped, answering each request with
/// `handle`; at most `max_connections` connections at once (`what` names
/// the listener in logs).
pub async fn serve<H, F>(listener: TcpListener, what: &'static str, max_connections: usize, handle: H)
where
    H: Fn(http::Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = http::Response<Full<Bytes>>> + Send + 'static,
{
    let open = Arc::new(tokio::sync::Semaphore::new(max_connections));
    let mut refused_since_warning = false;
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::error!(error = %e, "{what}: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            if !refused_since_warning {
                refused_since_warning = true;
                tracing::warn!("{what}: {max_connections} connections open; closing new ones until one ends");
            }
            drop(stream);
            continue;
        };
        refused_since_warning = false;
        let handle = handle.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let service = service_fn(move |request| {
                let answer = handle(request);
                async move { Ok::<_, Infallible>(answer.await) }
            });
            let mut builder = http1::Builder::new();
            builder.timer(TokioTimer::new()).header_read_timeout(HEADER_TIMEOUT);
            let _ = builder.serve_connection(TokioIo::new(stream), service).await;
        });
    }
}

/// Binds a listener (before the runtime runs, so a taken address stops the
/// start with a clear error).
pub fn bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}
