//! The ext_proc floor of `semlb bench epp`: an ext_proc server that does
//! nothing but answer (`semlb-bench __null-ext-proc`, this binary, a
//! process of its own so that its CPU is measured alone). It is served
//! as semlb's picker is (tonic's server on one current-thread tokio
//! runtime, `TCP_NODELAY`, an answer stream per gRPC stream) and answers
//! the same messages with the picker's own answer builders: the request's
//! headers with the destination header, `content-length` and the dynamic
//! metadata once the body has ended, the body echoed as a streamed body
//! response, the response's headers passed, its body echoed. What it
//! costs per exchange is what gRPC, HTTP/2, tokio and the kernel cost
//! before the picker does any work: the floor under the picker's figures.

use std::pin::Pin;

use anyhow::Result;
use clap::Args;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse, processing_request};
use futures_util::Stream;
use semlb::dispatcher::epp;
use tonic::{Request, Response, Status, Streaming};

/// `semlb-bench __null-ext-proc` flags.
#[derive(Debug, Clone, Args)]
pub struct NullArgs {
    /// Where to listen; the address bound is printed on stdout's first line.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
}

/// The destination every request is given.
const DESTINATION: &str = "127.0.0.1:8000";

/// The service: answers only.
#[derive(Debug, Clone, Copy)]
struct Null;

type Answers = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Null {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let mut inbound = request.into_inner();
        Ok(Response::new(Box::pin(async_stream::stream! {
            while let Ok(Some(message)) = inbound.message().await {
                for answer in answers(message) {
                    yield Ok(answer);
                }
            }
        })))
    }
}

/// The answers to one message, shaped as the picker's (its own
/// builders of them: [`semlb::dispatcher::epp`]).
fn answers(message: ProcessingRequest) -> Vec<ProcessingResponse> {
    use processing_request::Request as R;
    match message.request {
        Some(R::RequestBody(b)) if b.end_of_stream => {
            let mut out = vec![epp::routed_headers(DESTINATION, Some(b.body.len()))];
            out.extend(epp::streamed_body(true, &b.body, true));
            out
        }
        Some(R::ResponseHeaders(_)) => vec![epp::response_headers(None)],
        Some(R::ResponseBody(b)) => epp::streamed_body(false, &b.body, b.end_of_stream),
        _ => Vec::new(),
    }
}

/// Serves until killed.
pub fn run(args: &NullArgs) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(&args.listen).await?;
        println!("{}", listener.local_addr()?);
        let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        tonic::transport::Server::builder()
            .serve_with_incoming(ExternalProcessorServer::new(Null), incoming)
            .await?;
        Ok(())
    })
}
