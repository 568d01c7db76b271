//! Peer gateways across regions: SkyLB's two-layer forwarding.
//!
//! SkyLB (Xia et al., 2025) runs one balancer per region. Each serves its
//! own engines first; when every local engine is full and requests would
//! wait behind a long local backlog, it forwards them to a peer region's
//! balancer that has spare capacity, at most once per request. Regions
//! whose peaks do not coincide then lend each other capacity.
//!
//! # The pieces
//!
//! | piece | where |
//! | --- | --- |
//! | `[peering]`, `[[peer]]` | [`crate::config::PeeringConfig`], [`crate::config::PeerConfig`] |
//! | a conversation forwarded to a peer keeps going there while warm there | [`affinity`] |
//! | the load summary a gateway serves its peers: `GET /semlb/peer/load` with `x-semlb-peer-token` | [`summary`] |
//! | each dispatcher's view of its peers, polled every `peering.poll_ms`, and the choice of a peer | [`book`] |
//! | the forwarded request, its streamed answer relayed back | `crate::dispatcher::peer_forward` |
//!
//! # The rules
//!
//! - **When.** A request whose pool's policy holds requests
//!   (`selective_push`, `dual_map`) finds every local server full, and the
//!   local gateway queue's expected wait (its length ahead of the request
//!   times the recent interval between departures, or the oldest waiter's
//!   age if longer) exceeds `peering.forward_after_ms`.
//! - **Where.** A peer whose summary is fresh (received within
//!   `peering.max_age_ms`), that serves the request's model and has a free
//!   server left after what this dispatcher sent it since that summary; of
//!   those, the highest free share of servers less its round trip over
//!   `peering.delay_penalty_ms`. A peer whose round trip is longer than the
//!   local expected wait is not worth it.
//! - **Once only.** The forwarded request carries `x-semlb-hop: <origin
//!   region>`; a request that carries it is never forwarded again (it
//!   waits in the local queue like any other).
//! - **Affinity.** A request that continues a conversation forwarded to a
//!   peer (its prompt's chain matches the peer deeper than any local
//!   server: [`affinity`]) goes to that peer again while the entry is warm
//!   there and the peer's summary shows room, even when a local server has
//!   room; else it is routed here as any other.
//! - **Streaming.** The peer's answer (JSON or SSE) is relayed to the
//!   client as it arrives, under the request's deadline.
//! - **Failure.** A peer that cannot be reached, or answers a 5xx head,
//!   is not asked again until its next good summary, and the request goes
//!   to the local queue.
//!
//! The body forwarded is the client's as it came (the peer applies its own
//! model aliases and usage handling), with the client's headers, but never
//! the client's API key when this gateway checked it: the request carries
//! the peer's token (`x-semlb-peer-token`, the gateway's credential) and
//! the tenant this gateway authenticated (`x-semlb-peer-tenant`), and the
//! peer, seeing a valid token, serves it as that tenant under its own
//! tenant rules (limits, class, isolation; the `*` entry for a tenant it
//! does not list) without asking for a key. A request with the tenant
//! header and no valid token is refused (401 `invalid_peer_token`). A
//! gateway without `[auth]` forwards the client's headers as they came
//! (the peer then authenticates the client's key by its own keys). Engines
//! never see either header.
//!
//! # Transport
//!
//! A `[[peer]]` URL may be `https://`: load polls and forwarded requests
//! then go over TLS (rustls), checked against `peer.ca_file` (else the
//! system's usual web roots are not used: a CA file is required), with an
//! optional client certificate (`peer.cert_file`, `peer.key_file`) for a
//! peer that asks for one. A peer whose certificate does not verify is
//! unreachable (nothing is forwarded to it, its load is unknown).

pub mod affinity;
pub mod book;
pub mod summary;

/// The header a forwarded request carries: the region that forwarded it.
pub const HOP_HEADER: &str = "x-semlb-hop";

/// The header carrying a peer's token on load polls and forwarded
/// requests.
pub const TOKEN_HEADER: &str = "x-semlb-peer-token";

/// The header naming the tenant a forwarded request was authenticated as
/// by the gateway that forwarded it.
pub const TENANT_HEADER: &str = "x-semlb-peer-tenant";

/// The path of the load summary.
pub const LOAD_PATH: &str = "/semlb/peer/load";

/// The answer header naming the peer region that answered a forwarded
/// request (set by the gateway that forwarded it).
pub const PEER_HEADER: &str = "x-semlb-peer";
