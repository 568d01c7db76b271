//! semlb as the Gateway API Inference Extension's endpoint picker (EPP):
//! Envoy's external processing service (`envoy.service.ext_proc.v3`,
//! gRPC) beside the HTTP front, in every dispatcher (`[epp] listen`,
//! `semlb serve --epp-listen`; the supervisor binds the listener and the
//! dispatchers inherit it as they do the HTTP one).
//!
//! Envoy streams each request's headers and body to the picker, which
//! picks the engine with the same parse, tokenizer, prefix hashing,
//! tables and routing policy as the HTTP proxy, and answers with the
//! `x-gateway-destination-endpoint` header (the pick, then fallbacks,
//! comma-separated; the route cache cleared) and the same value in the
//! dynamic metadata (`envoy.lb`). Envoy then streams the engine's answer
//! through the picker, which learns from it as the proxy does. A request
//! the gateway answers itself (no engine: 503; the queue full or a limit
//! reached: 429 with `Retry-After`; a bad body: 400; a cached answer)
//! becomes an immediate response with the HTTP front's body.
//!
//! | file | step |
//! | --- | --- |
//! | [`service`] | the gRPC service: one task per stream |
//! | [`exchange`] | the message order of a stream (headers, body, trailers, each direction) |
//! | [`pick`] | the pick: the fairness id, objective, model rewrite and subset hint, then the HTTP front's stages and the proxy's routing |
//! | [`answer`] | the engine's answer fed to the proxy's relay: learning, usage, charges, in-flight count |
//! | [`health`] | `grpc.health.v1.Health`: liveness, and readiness once a server is up |
//! | [`wire`] | Envoy's messages read and written |
//!
//! The picker supports the body mode the Inference Extension configures
//! (`FULL_DUPLEX_STREAMED`): it answers the request's headers only once
//! its body has ended. In a pool with prefill engines it splits requests
//! as the proxy does ([`crate::dispatcher::proxy`]'s `pd`): it runs (vLLM)
//! or starts (SGLang) the prefill leg itself and hands Envoy the decode
//! leg's body, with a decode engine as the destination.

mod answer;
mod exchange;
mod health;
mod pick;
mod service;
mod wire;

use std::future::Future;
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use tokio::net::TcpListener;
use tonic::body::Body as GrpcBody;
use tonic::codegen::{BoxFuture, Context, Poll, Service};

use super::Dispatcher;

pub use health::{LIVENESS, READINESS};
pub use pick::{FAIRNESS_HEADER, OBJECTIVE_HEADER, REWRITE_HEADER};
pub use wire::{
    DESTINATION_HEADER, LB_NAMESPACE, SUBSET_KEY, SUBSET_NAMESPACE, header_list, response_headers, routed_headers,
    streamed_body,
};

/// Why the picker stopped.
#[derive(Debug, thiserror::Error)]
pub enum EppError {
    /// The gRPC server failed.
    #[error("the endpoint picker's gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Serves the picker and the health service on `listener` until
/// `shutdown` resolves (streams in progress then end with their
/// connections, as tonic's graceful shutdown lets them).
pub async fn serve(
    listener: TcpListener,
    dispatcher: Arc<Dispatcher>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), EppError> {
    let (reporter, health) = tonic_health::server::health_reporter();
    let reporting = tokio::spawn(health::report(dispatcher.clone(), reporter));
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let services = Services {
        picker: ExternalProcessorServer::new(service::Picker::new(dispatcher)),
        health,
    };
    let served = tonic::transport::Server::builder()
        .serve_with_incoming_shutdown(services, incoming, shutdown)
        .await;
    reporting.abort();
    served.map_err(EppError::from)
}

/// The two gRPC services on one listener, by path (tonic's router would
/// bring axum in for two routes).
#[derive(Debug, Clone)]
struct Services<H> {
    picker: ExternalProcessorServer<service::Picker>,
    health: H,
}

/// The path prefix of the health service's methods.
const HEALTH_PATH: &str = "/grpc.health.v1.Health/";

impl<H> Service<http::Request<GrpcBody>> for Services<H>
where
    H: Service<http::Request<GrpcBody>, Response = http::Response<GrpcBody>, Error = std::convert::Infallible>
        + Clone
        + Send
        + 'static,
    H::Future: Send + 'static,
{
    type Response = http::Response<GrpcBody>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Both services are always ready.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<GrpcBody>) -> Self::Future {
        if request.uri().path().starts_with(HEALTH_PATH) {
            Box::pin(self.health.call(request))
        } else {
            Box::pin(self.picker.call(request))
        }
    }
}
