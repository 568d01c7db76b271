//! `envoy.service.ext_proc.v3.ExternalProcessor/Process`: each stream's
//! answers are a stream its [`Exchange`] yields into as it reads Envoy's
//! messages. It runs in the task that sends the answers (hyper's, one
//! per HTTP/2 stream): no task and channel of its own, so a message and
//! its answers cost no extra wakeup. The stream's end or Envoy's cancel
//! (hyper drops the answers) drops the exchange, and with it the
//! request's in-flight count and charges (guards).

use std::pin::Pin;
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures_util::Stream;
use tonic::{Request, Response, Status, Streaming};

use super::exchange::Exchange;
use crate::dispatcher::Dispatcher;

/// The picker's ext_proc service.
#[derive(Debug, Clone)]
pub struct Picker {
    dispatcher: Arc<Dispatcher>,
}

impl Picker {
    /// The picker of `dispatcher`.
    pub fn new(dispatcher: Arc<Dispatcher>) -> Self {
        Self { dispatcher }
    }
}

/// The answers of one stream.
type Answers = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        Ok(Response::new(Box::pin(answers(
            self.dispatcher.clone(),
            request.into_inner(),
        ))))
    }
}

/// The answers to the messages of `inbound`, in order, until the exchange
/// is over, Envoy ends the stream, or a message is out of order (a gRPC
/// error, the last answer).
fn answers(
    dispatcher: Arc<Dispatcher>,
    mut inbound: Streaming<ProcessingRequest>,
) -> impl Stream<Item = Result<ProcessingResponse, Status>> + Send {
    async_stream::stream! {
        let mut exchange = Exchange::new(&dispatcher);
        // The stream ended (`None`) or broke: the exchange is dropped.
        while let Ok(Some(message)) = inbound.message().await {
            match exchange.handle(message).await {
                Ok(answers) => {
                    for answer in answers {
                        yield Ok(answer);
                    }
                }
                Err(status) => {
                    yield Err(status);
                    break;
                }
            }
            if exchange.done() {
                break;
            }
        }
    }
}
