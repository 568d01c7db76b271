//! Disaggregated prefill and decode: a request split into a prefill leg,
//! on an engine of role `prefill`, and a decode leg, on an engine that
//! decodes, driven by one of two protocols ([`crate::config::PdProtocol`]):
//!
//! | file | what it holds |
//! | --- | --- |
//! | [`vllm`] | vLLM's NixlConnector: the prefill leg's body, the `kv_transfer_params` its answer hands over, the decode leg's body |
//! | [`sglang`] | SGLang's bootstrap rendezvous: host, port and room on both legs |
//!
//! Whether a request is split, and the prefill leg itself, are the
//! proxy's ([`super::proxy`], its `pd` step): the decode engine is chosen
//! first, as for any request; a request it already holds all but
//! `pd.bypass_uncached_tokens` of goes to it alone (bypass, vLLM), as
//! does one asking for several sequences (vLLM), one whose pool has no
//! prefill engine up, and one whose prefill failed on two engines or
//! handed nothing over (SGLang: to an aggregated engine instead, since an
//! SGLang decode engine cannot serve alone).

pub(super) mod sglang;
pub(super) mod vllm;

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::HeaderMap;
use http::header::HeaderValue;
use tokio::sync::oneshot;

use shm_layout::{ServerRef, ServerRole};

use super::failure::Failure;
use crate::routing::Members;

/// The header both legs of a split request carry, with the same value.
pub(super) const REQUEST_ID: &str = "x-request-id";

/// Whether `members` (a pool's servers) has an engine of `role` up: a
/// request of the pool is split only when it has a prefill engine up.
pub(super) fn has_up(servers: &shm_layout::ServerTable<'_>, members: &Members, role: ServerRole) -> bool {
    servers
        .up_of_role(role)
        .any(|(server, _)| members.admits(servers.membership(server.slot)))
}

/// A leg that runs beside the answer (SGLang's prefill leg): it ends when
/// this is dropped, and tells when it failed (the answer it goes with
/// cannot come then: its decode leg waits for a partner that is gone).
#[derive(Debug)]
pub(super) struct Companion {
    task: tokio::task::AbortHandle,
    /// Its failure, once (`None`: reported already, or the leg ended well).
    failed: Option<oneshot::Receiver<LegFailed>>,
}

/// A companion leg's failure: the server it was on, and what happened.
#[derive(Debug)]
pub(super) struct LegFailed {
    /// The prefill engine.
    pub server: ServerRef,
    /// What went wrong there.
    pub failure: Failure,
}

impl Companion {
    /// The leg of `task`, which sends on `failed` if it fails (and drops
    /// it unsent if it ends well).
    pub fn new(task: tokio::task::AbortHandle, failed: oneshot::Receiver<LegFailed>) -> Self {
        Self {
            task,
            failed: Some(failed),
        }
    }

    /// Ready with the leg's failure; pending for ever once it ended well
    /// or its failure was taken.
    pub fn poll_failed(&mut self, cx: &mut Context<'_>) -> Poll<LegFailed> {
        let Some(rx) = self.failed.as_mut() else {
            return Poll::Pending;
        };
        match Pin::new(rx).poll(cx) {
            Poll::Ready(Ok(failed)) => {
                self.failed = None;
                Poll::Ready(failed)
            }
            Poll::Ready(Err(_)) => {
                self.failed = None;
                Poll::Pending
            }
            Poll::Pending => Poll::Pending,
        }
    }

    /// What it had to hand over reached its partner: a later failure of
    /// the leg no longer matters to the answer.
    pub fn handed_over(&mut self) {
        self.failed = None;
    }

    /// The leg's failure, if it failed already.
    pub fn try_failed(&mut self) -> Option<LegFailed> {
        let failed = self.failed.as_mut()?.try_recv().ok();
        if failed.is_some() {
            self.failed = None;
        }
        failed
    }
}

/// The failure of `companion`'s leg, when it comes (never, without one).
pub(super) async fn failed(companion: &mut Option<Companion>) -> LegFailed {
    match companion {
        Some(c) => std::future::poll_fn(|cx| c.poll_failed(cx)).await,
        None => std::future::pending().await,
    }
}

impl Drop for Companion {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The request id both legs carry: the client's `x-request-id`, else a
/// new one, put in `headers`.
pub(super) fn request_id(headers: &mut HeaderMap) -> String {
    if let Some(id) = headers.get(REQUEST_ID).and_then(|v| v.to_str().ok())
        && !id.is_empty()
    {
        return id.to_owned();
    }
    let id = format!("semlb-{:016x}{:016x}", random_u64(), random_u64());
    headers.insert(REQUEST_ID, HeaderValue::from_str(&id).expect("hex is a header value"));
    id
}

/// A random number from the system's source (request ids, rooms).
pub(super) fn random_u64() -> u64 {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 8];
    // The system's source does not fail on Linux once the kernel's pool
    // is initialised; a zero would only be a weaker id.
    let _ = ring::rand::SystemRandom::new().fill(&mut bytes);
    u64::from_le_bytes(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_legs_carry_the_clients_request_id_or_a_new_one() {
        let mut h = HeaderMap::new();
        h.insert(REQUEST_ID, HeaderValue::from_static("client-7"));
        assert_eq!(request_id(&mut h), "client-7");
        let mut h = HeaderMap::new();
        let id = request_id(&mut h);
        assert!(id.starts_with("semlb-") && id.len() == 38, "{id}");
        assert_eq!(h[REQUEST_ID], id.as_str());
        assert_ne!(request_id(&mut HeaderMap::new()), id);
    }
}
