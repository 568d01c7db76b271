//! Disaggregated prefill and decode (P/D) as the simulator plays it: the
//! two legs of vLLM's NixlConnector handoff and of SGLang's bootstrap
//! rendezvous, so that a P/D router (semlb's, SMG's, vllm-router's) can
//! drive simulated engines as it drives real ones.
//!
//! | file | concern |
//! | --- | --- |
//! | [`legs`] | which leg a request body is, for this engine's [`Role`] and [`PdProtocol`] |
//! | [`nixl`] | vLLM: the prefill's held prompts and side channel, the decode's pull |
//! | [`bootstrap`] | SGLang: the prefill's rooms and bootstrap server, the decode's rendezvous |
//! | [`client`] | the side channels' HTTP client |
//!
//! # vLLM (NixlConnector): two legs in sequence
//!
//! * **Prefill leg**: `kv_transfer_params.do_remote_decode: true` (the
//!   remote fields absent or null). It runs as any request (the router
//!   caps it at one token). If it finished on its length cap, its prompt's
//!   blocks stay pinned and its answer carries a top-level
//!   `kv_transfer_params` ([`nixl::transfer_params`]) naming them, this
//!   engine ([`Pd::engine_id`], made at start) and its side channel (this
//!   server's own address). If it stopped on EOS (its natural length,
//!   [`crate::api::natural_length`], is within its `max_tokens`: EOS is
//!   checked first, as in vLLM's `check_stop`), nothing is held and there
//!   are no params, as in vLLM. A streamed prefill leg is answered as a
//!   plain stream (routers send it with `stream: false`).
//! * **Decode leg**: `do_remote_prefill: true` and the prefill's params.
//!   Complete params: it pulls the prompt's KV ([`nixl::pull`]), only the
//!   blocks its prefix cache lacks, in [`PdConfig::transfer_time`], which
//!   frees the prefill's pin, then decodes; its `cached_tokens` are the
//!   prompt tokens it did not compute (local hits and pulled tokens: all
//!   but the last prompt token, as vLLM's `num_cached_tokens` counts
//!   tokens a connector loaded). Incomplete params, a prefill that no
//!   longer holds the prompt, or an unreachable one: it logs why and
//!   recomputes the prompt (correct, slower), as vLLM does.
//!
//! # SGLang: two legs at once
//!
//! Both legs carry the same body with `bootstrap_host`, `bootstrap_port`
//! and `bootstrap_room` (see [`bootstrap`]). A prefill-role engine refuses
//! a request without a room (400, SGLang's error shape), waits for the
//! decode leg to join the room, runs the prefill (one token), holds the
//! KV until the decode has taken it, and then answers a normal one-token
//! completion (`finish_reason: "length"`, as SGLang's prefill finishes
//! with `FINISH_LENGTH(0)`), streamed or not as the body asks. The
//! decode-role engine waits for the KV, pulls what it lacks and decodes;
//! a streamed decode leg gets its answer's head at once, before the KV
//! (SGLang's `StreamingResponse` starts before it), and an error after
//! that as an error event and `data: [DONE]`.
//! A leg whose partner does not come times out (the bootstrap and waiting
//! timeouts) with a 500; a leg whose partner is cancelled fails at once.
//! A decode-role engine serves a request without a room as a plain
//! request (a real SGLang decode server cannot: it has no prefill path),
//! so that a router's decode-only fallback can be tested.
//!
//! # Time
//!
//! The transfer time is `tokens × kv_bytes_per_token / kv_transfer_gbps`
//! in simulated time, slept scaled by the time scale like everything
//! else, and so are the timeouts ([`PdConfig`]): at time scale 0.01 the
//! 480 s pin timeout lasts 4.8 real seconds. The decode leg's TTFT counts
//! the transfer (and for SGLang the wait for the prefill).

mod bootstrap;
mod client;
mod legs;
mod nixl;

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::StatusCode;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::watch;

pub use bootstrap::{PrefillSeat, RendezvousError, Rooms};
pub use client::SideChannelError;
pub use legs::{Bootstrap, Leg, RemotePrefill};
pub use nixl::{PullError, QUERY_PATH as NIXL_QUERY_PATH, RELEASE_PATH as NIXL_RELEASE_PATH};

use crate::api::ApiError;
use crate::engine::{Engine, KvHandoff};

/// What an engine does in a P/D fleet (vLLM's `kv_role`, SGLang's
/// `--disaggregation-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Role {
    /// Prefill legs (`kv_producer`, `prefill`).
    Prefill,
    /// Decode legs (`kv_consumer`, `decode`).
    Decode,
    /// Both, or aggregated serving (`kv_both`, SGLang's `null`).
    #[default]
    Both,
}

impl Role {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        }
    }

    /// SGLang's `disaggregation_mode` for it (`null` for both).
    pub fn disaggregation_mode(self) -> &'static str {
        match self {
            Role::Both => "null",
            role => role.name(),
        }
    }
}

/// A role name [`Role`] does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown role `{0}` (expected prefill, decode or both)")]
pub struct UnknownRole(pub String);

impl std::str::FromStr for Role {
    type Err = UnknownRole;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            "both" => Ok(Role::Both),
            other => Err(UnknownRole(other.to_owned())),
        }
    }
}

/// Which engine's P/D protocol the simulator speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PdProtocol {
    /// vLLM with the NixlConnector.
    #[default]
    VllmNixl,
    /// SGLang's bootstrap rendezvous.
    Sglang,
}

impl PdProtocol {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            PdProtocol::VllmNixl => "vllm-nixl",
            PdProtocol::Sglang => "sglang",
        }
    }

    /// `owned_by` in `/v1/models`: the engine played.
    pub fn owned_by(self) -> &'static str {
        match self {
            PdProtocol::VllmNixl => "vllm",
            PdProtocol::Sglang => "sglang",
        }
    }
}

/// A protocol name [`PdProtocol`] does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown P/D protocol `{0}` (expected vllm-nixl or sglang)")]
pub struct UnknownProtocol(pub String);

impl std::str::FromStr for PdProtocol {
    type Err = UnknownProtocol;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "vllm-nixl" => Ok(PdProtocol::VllmNixl),
            "sglang" => Ok(PdProtocol::Sglang),
            other => Err(UnknownProtocol(other.to_owned())),
        }
    }
}

/// The P/D parameters, with their defaults and why.
///
/// | parameter | default | why |
/// | --- | --- | --- |
/// | `role` | both | an aggregated engine (which still takes vLLM decode legs, as `kv_both`) |
/// | `protocol` | vllm-nixl | the simulator plays vLLM |
/// | `bootstrap_port` | 8998 | SGLang's `--disaggregation-bootstrap-port` default (0: a free port) |
/// | `kv_bytes_per_token` | 131 072 | Llama-3.1-8B in bf16: 2 (K, V) × 32 layers × 8 KV heads × 128 dims × 2 bytes (Qwen3-8B's 36 layers: 147 456) |
/// | `kv_transfer_gbps` | 25 GB/s | one 200 Gb/s RDMA NIC (ConnectX-6/7, HDR InfiniBand or RoCE) at line rate: 1 000 tokens of an 8B model (131 MB) move in 5.2 ms |
/// | `nixl_abort_timeout_s` | 480 s | vLLM's `VLLM_NIXL_ABORT_REQUEST_TIMEOUT` |
/// | `bootstrap_timeout_s` | 300 s | SGLang's `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT` |
/// | `waiting_timeout_s` | 300 s | SGLang's `SGLANG_DISAGGREGATION_WAITING_TIMEOUT` |
///
/// It is also the flags of `semlb-sim` and `semlb __sim` (one declaration,
/// flattened into both).
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct PdConfig {
    /// Its part in disaggregated prefill/decode: prefill, decode or both
    /// (an aggregated engine; in vLLM mode it still takes decode legs, as
    /// kv_role kv_both).
    #[arg(long = "role", default_value = "both", value_name = "ROLE")]
    pub role: Role,
    /// The P/D protocol it speaks: vllm-nixl (kv_transfer_params, a pull
    /// over a side channel) or sglang (bootstrap_room rendezvous).
    #[arg(long = "pd-protocol", default_value = "vllm-nixl", value_name = "PROTOCOL")]
    pub protocol: PdProtocol,
    /// SGLang prefill role: the bootstrap server's port (0: a free one;
    /// the bound one is printed), as SGLang's --disaggregation-bootstrap-port.
    #[arg(long, default_value_t = PdConfig::default().bootstrap_port, value_name = "PORT")]
    pub bootstrap_port: u16,
    /// KV cache bytes per token, for the transfer time [default: Llama-3.1-8B bf16].
    #[arg(long, default_value_t = PdConfig::default().kv_bytes_per_token, value_name = "BYTES")]
    pub kv_bytes_per_token: u64,
    /// KV transfer bandwidth between engines, in GB/s (10^9 bytes/s)
    /// [default: one 200 Gb/s RDMA NIC].
    #[arg(long, default_value_t = PdConfig::default().kv_transfer_gbps, value_name = "GB_PER_S")]
    pub kv_transfer_gbps: f64,
    /// vLLM prefill: simulated seconds an unpulled prompt stays pinned
    /// (VLLM_NIXL_ABORT_REQUEST_TIMEOUT).
    #[arg(long, default_value_t = PdConfig::default().nixl_abort_timeout_s, value_name = "S")]
    pub nixl_abort_timeout_s: f64,
    /// SGLang prefill: simulated seconds it waits for its decode
    /// (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT).
    #[arg(long, default_value_t = PdConfig::default().bootstrap_timeout_s, value_name = "S")]
    pub bootstrap_timeout_s: f64,
    /// SGLang decode: simulated seconds it waits for its prefill's KV
    /// (SGLANG_DISAGGREGATION_WAITING_TIMEOUT).
    #[arg(long, default_value_t = PdConfig::default().waiting_timeout_s, value_name = "S")]
    pub waiting_timeout_s: f64,
}

impl Default for PdConfig {
    fn default() -> Self {
        Self {
            role: Role::Both,
            protocol: PdProtocol::VllmNixl,
            bootstrap_port: 8998,
            kv_bytes_per_token: 131_072,
            kv_transfer_gbps: 25.0,
            nixl_abort_timeout_s: 480.0,
            bootstrap_timeout_s: 300.0,
            waiting_timeout_s: 300.0,
        }
    }
}

/// Why a [`PdConfig`] is refused: the field, the value, the reason.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PdConfigError {
    /// A bandwidth or timeout that is not a positive, finite number.
    #[error("{field} = {value}: must be a positive number")]
    NotPositive {
        /// The field.
        field: &'static str,
        /// Its value.
        value: f64,
    },
}

impl PdConfig {
    /// Checks the values.
    pub fn validate(&self) -> Result<(), PdConfigError> {
        for (field, value) in [
            ("kv_transfer_gbps", self.kv_transfer_gbps),
            ("nixl_abort_timeout_s", self.nixl_abort_timeout_s),
            ("bootstrap_timeout_s", self.bootstrap_timeout_s),
            ("waiting_timeout_s", self.waiting_timeout_s),
        ] {
            if !value.is_finite() || value <= 0.0 {
                return Err(PdConfigError::NotPositive { field, value });
            }
        }
        Ok(())
    }

    /// Simulated time to move the KV of `tokens` tokens between engines.
    pub fn transfer_time(&self, tokens: u64) -> Duration {
        let bytes = tokens as f64 * self.kv_bytes_per_token as f64;
        Duration::from_secs_f64(bytes / (self.kv_transfer_gbps * 1e9))
    }

    fn nixl_abort_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.nixl_abort_timeout_s)
    }

    fn bootstrap_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.bootstrap_timeout_s)
    }

    fn waiting_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.waiting_timeout_s)
    }
}

/// Why [`Pd::start`] failed.
#[derive(Debug, thiserror::Error)]
pub enum PdStartError {
    /// The configuration is refused.
    #[error("invalid P/D configuration: {0}")]
    Config(#[from] PdConfigError),
    /// The bootstrap port cannot be bound.
    #[error("cannot listen on the bootstrap port {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
}

/// What the P/D legs did, since the start (`/sim/metrics`).
#[derive(Debug, Default)]
pub struct PdCounters {
    /// vLLM prefill legs whose prompt was held for a remote decode.
    pub pins: AtomicU64,
    /// Of those, released by their decode's pull.
    pub pins_released: AtomicU64,
    /// Of those, freed by the abort timeout, never pulled.
    pub pins_expired: AtomicU64,
    /// Decode legs whose prompt KV was pulled (both protocols).
    pub pulls: AtomicU64,
    /// Prompt tokens pulled by them.
    pub pulled_tokens: AtomicU64,
    /// vLLM decode legs that recomputed their prompt (incomplete params,
    /// a failed pull).
    pub recomputes: AtomicU64,
    /// SGLang prefill legs whose decode took the KV.
    pub handoffs: AtomicU64,
    /// SGLang legs whose partner or KV did not come in time.
    pub rendezvous_timeouts: AtomicU64,
    /// SGLang legs whose partner was aborted.
    pub rendezvous_abandoned: AtomicU64,
}

/// A P/D-capable engine's state: its role and protocol, its id, the
/// prompts it holds (vLLM) or its bootstrap rooms (SGLang), its counters.
#[derive(Debug)]
pub struct Pd {
    config: PdConfig,
    engine_id: String,
    /// This server's address, for the side channel (set by the server).
    side_channel: OnceLock<SocketAddr>,
    counters: Arc<PdCounters>,
    pins: Arc<nixl::Pins>,
    rooms: Arc<Rooms>,
    bootstrap: Option<SocketAddr>,
    next_key: AtomicU64,
    /// Dropped with the state: stops the bootstrap server.
    _stop: watch::Sender<()>,
}

/// A random-looking UUID (version 4 layout) for this engine.
fn new_engine_id() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let n = N.fetch_add(1, Ordering::Relaxed);
    let seed = [
        nanos.to_le_bytes().as_slice(),
        &std::process::id().to_le_bytes(),
        &n.to_le_bytes(),
    ]
    .concat();
    let hi = seahash::hash(&seed);
    let lo = seahash::hash_seeded(&seed, hi, !hi, n, 0x6e69786c);
    let bits = (u128::from(hi) << 64 | u128::from(lo)) & !(0xf << 76) & !(0x3 << 62) | (0x4 << 76) | (0x2 << 62);
    let hex = format!("{bits:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

impl Pd {
    /// The state of an engine of `config` running at `time_scale`. An
    /// SGLang prefill engine's bootstrap server is bound on `ip` and its
    /// `bootstrap_port` and served from now on (on the current tokio
    /// runtime) until the state is dropped.
    pub async fn start(config: PdConfig, ip: IpAddr, time_scale: f64) -> Result<Pd, PdStartError> {
        config.validate()?;
        let (stop, stopped) = watch::channel(());
        let rooms = Arc::new(Rooms::default());
        let mut bootstrap = None;
        if config.protocol == PdProtocol::Sglang && config.role == Role::Prefill {
            let addr = SocketAddr::new(ip, config.bootstrap_port);
            let listener = TcpListener::bind(addr)
                .await
                .map_err(|source| PdStartError::Bind { addr, source })?;
            let bound = listener
                .local_addr()
                .map_err(|source| PdStartError::Bind { addr, source })?;
            bootstrap = Some(bound);
            // The decode's long poll is bounded by this engine's waiting
            // timeout too (the decode's own is the one that matters).
            let waiting = config.waiting_timeout().mul_f64(time_scale);
            tokio::spawn(bootstrap::serve(listener, Arc::clone(&rooms), waiting, stopped));
        }
        Ok(Self::with(config, rooms, bootstrap, stop))
    }

    /// The state of an engine that is not part of a P/D fleet (role both,
    /// vLLM's protocol, default parameters): it still takes vLLM's legs.
    pub fn plain() -> Pd {
        let (stop, _) = watch::channel(());
        Self::with(PdConfig::default(), Arc::new(Rooms::default()), None, stop)
    }

    fn with(config: PdConfig, rooms: Arc<Rooms>, bootstrap: Option<SocketAddr>, stop: watch::Sender<()>) -> Pd {
        Pd {
            config,
            engine_id: new_engine_id(),
            side_channel: OnceLock::new(),
            counters: Arc::default(),
            pins: Arc::default(),
            rooms,
            bootstrap,
            next_key: AtomicU64::new(1),
            _stop: stop,
        }
    }

    /// The parameters.
    pub fn config(&self) -> &PdConfig {
        &self.config
    }

    /// This engine's id (`remote_engine_id`).
    pub fn engine_id(&self) -> &str {
        &self.engine_id
    }

    /// The counters.
    pub fn counters(&self) -> &PdCounters {
        &self.counters
    }

    /// The SGLang bootstrap server's address, if it is bound.
    pub fn bootstrap_addr(&self) -> Option<SocketAddr> {
        self.bootstrap
    }

    /// The bootstrap port `/server_info` reports: the bound one, else the
    /// configured one (SGLang reports its flag in every mode).
    pub fn bootstrap_port(&self) -> u16 {
        self.bootstrap.map_or(self.config.bootstrap_port, |a| a.port())
    }

    /// The start line's part for the bootstrap server: `bootstrap on
    /// ADDR; ` (empty without one).
    pub fn describe(&self) -> String {
        self.bootstrap
            .map(|addr| format!("bootstrap on {addr}; "))
            .unwrap_or_default()
    }

    /// Open SGLang rooms (this engine's bootstrap server).
    pub fn open_rooms(&self) -> usize {
        self.rooms.len()
    }

    /// Tells the state the server's address (the side channel a prefill's
    /// `kv_transfer_params` name); the first call wins. An unspecified
    /// address (`0.0.0.0`) is advertised as loopback.
    pub fn advertise(&self, addr: SocketAddr) {
        let ip = match addr.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::from([127, 0, 0, 1]),
            IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::from(std::net::Ipv6Addr::LOCALHOST),
            ip => ip,
        };
        let _ = self.side_channel.set(SocketAddr::new(ip, addr.port()));
    }

    /// The leg of a request body (see [`legs`]).
    pub fn leg(&self, body: &[u8]) -> Result<Leg, ApiError> {
        Leg::of(body, self.config.role, self.config.protocol)
    }

    /// A fresh key to hold a prompt under ([`KvHandoff::hold_prompt`]).
    pub fn pin_key(&self) -> u64 {
        self.next_key.fetch_add(1, Ordering::Relaxed)
    }

    /// A vLLM prefill leg finished and the engine holds its prompt under
    /// `key`: keeps it for `request_id` until pulled or expired, and
    /// returns the `kv_transfer_params` to answer.
    pub fn nixl_hold(&self, engine: &Engine, key: u64, request_id: &str) -> Option<Value> {
        let timeout = engine.config().real(self.config.nixl_abort_timeout());
        let held = self.pins.hold(engine, key, request_id, timeout, &self.counters)?;
        let at = self
            .side_channel
            .get()
            .copied()
            .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
        Some(nixl::transfer_params(
            &self.engine_id,
            request_id,
            &held,
            &at.ip().to_string(),
            at.port(),
        ))
    }

    /// The NIXL side channel's routes ([`NIXL_QUERY_PATH`],
    /// [`NIXL_RELEASE_PATH`]).
    pub fn nixl_side_channel(&self, engine: &Engine, path: &str, body: &[u8]) -> (StatusCode, Value) {
        nixl::answer(&self.pins, engine, &self.engine_id, &self.counters, path, body)
    }

    /// A vLLM decode leg's handoff: the pulled prompt, or (incomplete
    /// params, a failed pull, logged) nothing: the prompt is recomputed.
    pub async fn nixl_decode(
        &self,
        engine: &Engine,
        remote: Option<&RemotePrefill>,
        root: u64,
        prompt: &[u32],
    ) -> KvHandoff {
        let c = &self.counters;
        let why = match remote {
            None => "its kv_transfer_params are incomplete".to_owned(),
            Some(remote) => match nixl::pull(engine, remote, root, prompt, &self.config).await {
                Ok((handoff, pulled)) => {
                    c.pulls.fetch_add(1, Ordering::Relaxed);
                    c.pulled_tokens.fetch_add(pulled as u64, Ordering::Relaxed);
                    return handoff;
                }
                Err(e) => format!("the pull from {} failed: {e}", remote.engine_id),
            },
        };
        c.recomputes.fetch_add(1, Ordering::Relaxed);
        eprintln!(
            "semlb-sim: a decode leg recomputes its prompt ({} tokens): {why}",
            prompt.len()
        );
        KvHandoff::default()
    }

    /// An SGLang prefill leg enters `room` and waits for its decode.
    pub async fn sglang_prefill_seat(&self, engine: &Engine, room: u64) -> Result<PrefillSeat, ApiError> {
        let seat = self
            .rooms
            .join_prefill(room)
            .map_err(|e| ApiError::bad_request(e.to_string(), Some("bootstrap_room")).in_sglang_format())?;
        let timeout = engine.config().real(self.config.bootstrap_timeout());
        seat.wait_partner(timeout, self.config.bootstrap_timeout_s)
            .await
            .map_err(|e| self.rendezvous_failed("Prefill", e))?;
        Ok(seat)
    }

    /// An SGLang prefill leg ran and the engine holds its prompt under
    /// `key`: waits until the decode has taken the KV.
    pub async fn sglang_hand_over(&self, seat: &mut PrefillSeat, engine: &Engine, key: u64) -> Result<(), ApiError> {
        let timeout = engine.config().real(self.config.bootstrap_timeout());
        seat.hand_over(engine, key, timeout, self.config.bootstrap_timeout_s)
            .await
            .map_err(|e| self.rendezvous_failed("Prefill", e))?;
        self.counters.handoffs.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// An SGLang decode leg's handoff: its prompt's KV, pulled from its
    /// prefill at `boot`.
    pub async fn sglang_decode(
        &self,
        engine: &Engine,
        boot: &Bootstrap,
        root: u64,
        prompt: &[u32],
    ) -> Result<KvHandoff, ApiError> {
        let (handoff, pulled) = bootstrap::pull(engine, boot, root, prompt, &self.config)
            .await
            .map_err(|e| self.rendezvous_failed("Decode", e))?;
        let c = &self.counters;
        c.pulls.fetch_add(1, Ordering::Relaxed);
        c.pulled_tokens.fetch_add(pulled as u64, Ordering::Relaxed);
        Ok(handoff)
    }

    /// The 500 of a failed rendezvous (counted, logged), SGLang-shaped.
    fn rendezvous_failed(&self, side: &str, e: RendezvousError) -> ApiError {
        let counter = match e {
            RendezvousError::Timeout { .. } => Some(&self.counters.rendezvous_timeouts),
            RendezvousError::Abandoned { .. } => Some(&self.counters.rendezvous_abandoned),
            _ => None,
        };
        if let Some(counter) = counter {
            counter.fetch_add(1, Ordering::Relaxed);
        }
        eprintln!("semlb-sim: {side} leg failed: {e}");
        let message = match e {
            RendezvousError::Unreachable(_) => e.to_string(),
            _ => format!("{side} bootstrap failed: {e}"),
        };
        ApiError::server_error(StatusCode::INTERNAL_SERVER_ERROR, message).in_sglang_format()
    }

    /// The counters in the Prometheus text format (for `/sim/metrics`).
    pub fn metrics(&self, engine: &Engine) -> String {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
            let family = name.strip_suffix("_total").unwrap_or(name);
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {family} {kind}\n{name} {value}\n"
            ));
        };
        metric(
            "semlb_sim_pd_pins_held",
            "gauge",
            "Prompts held for a remote decode now.",
            engine.pins() as f64,
        );
        metric(
            "semlb_sim_pd_rooms_open",
            "gauge",
            "SGLang bootstrap rooms open now (this prefill engine's).",
            self.rooms.len() as f64,
        );
        let counters: [(&str, &str, &AtomicU64); 9] = [
            (
                "semlb_sim_pd_pins_total",
                "vLLM prefill legs whose prompt was held for a remote decode.",
                &c.pins,
            ),
            (
                "semlb_sim_pd_pins_released_total",
                "Held prompts released by their decode's pull.",
                &c.pins_released,
            ),
            (
                "semlb_sim_pd_pins_expired_total",
                "Held prompts freed by the abort timeout, never pulled.",
                &c.pins_expired,
            ),
            (
                "semlb_sim_pd_pulls_total",
                "Decode legs whose prompt KV was pulled.",
                &c.pulls,
            ),
            (
                "semlb_sim_pd_pulled_tokens_total",
                "Prompt tokens pulled by decode legs.",
                &c.pulled_tokens,
            ),
            (
                "semlb_sim_pd_recomputes_total",
                "vLLM decode legs that recomputed their prompt.",
                &c.recomputes,
            ),
            (
                "semlb_sim_pd_handoffs_total",
                "SGLang prefill legs whose decode took the KV.",
                &c.handoffs,
            ),
            (
                "semlb_sim_pd_rendezvous_timeouts_total",
                "SGLang legs whose partner or KV did not come in time.",
                &c.rendezvous_timeouts,
            ),
            (
                "semlb_sim_pd_rendezvous_abandoned_total",
                "SGLang legs whose partner was aborted.",
                &c.rendezvous_abandoned,
            ),
        ];
        for (name, help, value) in counters {
            metric(name, "counter", help, get(value));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_transfer_time_is_bytes_over_bandwidth() {
        let config = PdConfig::default();
        // 1 000 tokens × 128 KiB at 25 GB/s.
        let t = config.transfer_time(1000);
        assert!((t.as_secs_f64() - 0.005_242_88).abs() < 1e-9, "{t:?}");
        assert_eq!(config.transfer_time(0), Duration::ZERO);
        assert_eq!(config.validate(), Ok(()));
        let bad = PdConfig {
            waiting_timeout_s: 0.0,
            ..PdConfig::default()
        };
        assert_eq!(
            bad.validate().unwrap_err().to_string(),
            "waiting_timeout_s = 0: must be a positive number"
        );
    }

    #[test]
    fn names_parse_and_print() {
        for role in [Role::Prefill, Role::Decode, Role::Both] {
            assert_eq!(role.name().parse::<Role>(), Ok(role));
        }
        assert_eq!(Role::Both.disaggregation_mode(), "null");
        assert_eq!(Role::Decode.disaggregation_mode(), "decode");
        assert!("mixed".parse::<Role>().is_err());
        for protocol in [PdProtocol::VllmNixl, PdProtocol::Sglang] {
            assert_eq!(protocol.name().parse::<PdProtocol>(), Ok(protocol));
        }
        assert!("mooncake".parse::<PdProtocol>().is_err());
    }

    #[test]
    fn engine_ids_look_like_uuids_and_differ() {
        let (a, b) = (new_engine_id(), new_engine_id());
        assert_ne!(a, b);
        assert_eq!(a.len(), 36);
        assert_eq!(&a[14..15], "4", "{a}");
        assert!(matches!(&a[19..20], "8" | "9" | "a" | "b"), "{a}");
    }

    #[test]
    fn side_channel_addresses_are_reachable() {
        let pd = Pd::plain();
        pd.advertise("0.0.0.0:8000".parse().unwrap());
        assert_eq!(pd.side_channel.get(), Some(&"127.0.0.1:8000".parse().unwrap()));
        pd.advertise("10.0.0.1:9000".parse().unwrap());
        assert_eq!(
            pd.side_channel.get(),
            Some(&"127.0.0.1:8000".parse().unwrap()),
            "the first wins"
        );
        assert_eq!(pd.describe(), "");
        assert_eq!(pd.bootstrap_port(), 8998);
    }
}
