//! The ext_proc floor of `semlb bench epp`: an ext_proc server that does
//! nothing but answer (`semlb-bench __null-ext-proc`, this binary, a
//! process of its own so that its CPU is measured alone). It is served
//! as semlb's picker is (tonic's server on one current-thread tokio
//! runtime, `TCP_NODELAY`, an answer stream per gRPC stream) and answers
//! the same messages with answers of the same shape: the request's
//! headers with the destination header, `content-length` and the dynamic
//! metadata once the body has ended, the body echoed as a streamed body
//! response, the response's headers passed, its body echoed. What it
//! costs per exchange is what gRPC, HTTP/2, tokio and the kernel cost
//! before the picker does any work: the floor under the picker's figures.

use std::pin::Pin;

use anyhow::Result;
use clap::Args;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ProcessingRequest, ProcessingResponse,
    StreamedBodyResponse, body_mutation, processing_request, processing_response,
};
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use futures_util::Stream;
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

fn header(key: &str, value: &[u8]) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            raw_value: value.to_vec(),
            ..HeaderValue::default()
        }),
        ..HeaderValueOption::default()
    }
}

fn body_answer(request: bool, body: Vec<u8>, end: bool) -> ProcessingResponse {
    let answer = BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(StreamedBodyResponse {
                    body,
                    end_of_stream: end,
                    ..StreamedBodyResponse::default()
                })),
            }),
            ..CommonResponse::default()
        }),
    };
    ProcessingResponse {
        response: Some(if request {
            processing_response::Response::RequestBody(answer)
        } else {
            processing_response::Response::ResponseBody(answer)
        }),
        ..ProcessingResponse::default()
    }
}

/// The answers to one message, shaped as the picker's.
fn answers(message: ProcessingRequest) -> Vec<ProcessingResponse> {
    use processing_request::Request as R;
    match message.request {
        Some(R::RequestBody(b)) if b.end_of_stream => {
            let destination = Struct {
                fields: [(
                    semlb::dispatcher::epp::DESTINATION_HEADER.to_owned(),
                    Value {
                        kind: Some(Kind::StringValue(DESTINATION.to_owned())),
                    },
                )]
                .into(),
            };
            let headers = ProcessingResponse {
                response: Some(processing_response::Response::RequestHeaders(HeadersResponse {
                    response: Some(CommonResponse {
                        header_mutation: Some(HeaderMutation {
                            set_headers: vec![
                                header(semlb::dispatcher::epp::DESTINATION_HEADER, DESTINATION.as_bytes()),
                                header("content-length", b.body.len().to_string().as_bytes()),
                            ],
                            ..HeaderMutation::default()
                        }),
                        clear_route_cache: true,
                        ..CommonResponse::default()
                    }),
                })),
                dynamic_metadata: Some(Struct {
                    fields: [(
                        semlb::dispatcher::epp::LB_NAMESPACE.to_owned(),
                        Value {
                            kind: Some(Kind::StructValue(destination)),
                        },
                    )]
                    .into(),
                }),
                ..ProcessingResponse::default()
            };
            vec![headers, body_answer(true, b.body, true)]
        }
        Some(R::ResponseHeaders(_)) => vec![ProcessingResponse {
            response: Some(processing_response::Response::ResponseHeaders(HeadersResponse {
                response: Some(CommonResponse::default()),
            })),
            ..ProcessingResponse::default()
        }],
        Some(R::ResponseBody(b)) => vec![body_answer(false, b.body, b.end_of_stream)],
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
