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
//! `pd.bypass_uncached_tokens` of goes to it alone (bypass), as does one
//! asking for several choices, one whose pool has no prefill engine up,
//! and one whose prefill failed on two engines or handed nothing over.

pub(super) mod sglang;
pub(super) mod vllm;

use http::HeaderMap;
use http::header::HeaderValue;

use crate::routing::Members;
use shm_layout::ServerRole;

/// The header both legs of a split request carry, with the same value.
pub(super) const REQUEST_ID: &str = "x-request-id";

/// Whether `members` (a pool's servers) has a prefill engine that is up:
/// only then is a request of the pool split.
pub(super) fn has_prefill(servers: &shm_layout::ServerTable<'_>, members: &Members) -> bool {
    servers
        .up_of_role(ServerRole::Prefill)
        .any(|(_, id)| members.admits(Some(id)))
}

/// A task that ends when this is dropped: the SGLang prefill leg that
/// goes with a decode leg's answer (the relay holds it).
#[derive(Debug)]
pub(super) struct Companion(tokio::task::AbortHandle);

impl Companion {
    /// Ends the task of `handle` when dropped.
    pub fn new(handle: tokio::task::AbortHandle) -> Self {
        Self(handle)
    }
}

impl Drop for Companion {
    fn drop(&mut self) {
        self.0.abort();
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
