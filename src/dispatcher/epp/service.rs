//! `envoy.service.ext_proc.v3.ExternalProcessor/Process`: one task per
//! stream runs its [`Exchange`]; the stream's end or Envoy's cancel drops
//! it, and with it the request's in-flight count and charges (guards).

use std::pin::Pin;
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures_util::Stream;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status, Streaming};

use super::exchange::Exchange;
use crate::dispatcher::Dispatcher;

/// Answers buffered per stream before the exchange waits for Envoy.
const BUFFERED: usize = 16;

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
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(BUFFERED);
        tokio::spawn(run(self.dispatcher.clone(), inbound, tx));
        let answers = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|a| (a, rx)) });
        Ok(Response::new(Box::pin(answers)))
    }
}

/// Runs one stream's exchange until it is over, Envoy ends the stream, or
/// Envoy stops reading the answers (it cancelled).
async fn run(
    dispatcher: Arc<Dispatcher>,
    mut inbound: Streaming<ProcessingRequest>,
    tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
) {
    let mut exchange = Exchange::new(&dispatcher);
    loop {
        let message = tokio::select! {
            message = inbound.message() => message,
            () = tx.closed() => return,
        };
        let message = match message {
            Ok(Some(m)) => m,
            // The stream ended, or broke: the exchange is dropped.
            Ok(None) | Err(_) => return,
        };
        let answers = tokio::select! {
            answers = exchange.handle(message) => answers,
            () = tx.closed() => return,
        };
        match answers {
            Ok(answers) => {
                for answer in answers {
                    if tx.send(Ok(answer)).await.is_err() {
                        return;
                    }
                }
            }
            Err(status) => {
                let _ = tx.send(Err(status)).await;
                return;
            }
        }
        if exchange.done() {
            return;
        }
    }
}
