//! A dispatcher's view of its peers: their last load summaries, round
//! trips and failures, and the choice of a peer to forward to.
//!
//! Each dispatcher polls every peer itself (`crate::dispatcher::peer_forward`
//! runs the poller) and keeps its own book: no state is shared between
//! dispatchers, and a dispatcher that restarts has a full view within one
//! poll. So that `D` dispatchers that read the same summary do not all
//! send its free servers a request each, a dispatcher counts what it
//! forwarded to a peer since its last summary against a `1/D` share of
//! that peer's free servers (rounded up). A forwarded request that ends
//! gives its server back at once: before the next summary it is no longer
//! counted as sent; after it (the summary saw it running) it adds a free
//! server to that summary's. So a client that sends its next request the
//! instant an answer ends finds the room that answer left.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use shm_layout::ServerRef;

use super::summary::LoadSummary;
use crate::config::PeerTls;
use crate::config::{BackendUrlError, PeerConfig, PeeringConfig};
use crate::tls::PeerClient;

/// Weight of a new round trip in the moving average.
const RTT_WEIGHT: f64 = 0.3;

/// A peer as the poller and the forwarding path reach it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// Its index in the book.
    pub index: usize,
    /// `http://host:port` or `https://host:port`.
    pub address: String,
    /// Its region.
    pub region: String,
    /// The token it expects on load polls and forwarded requests.
    pub token: String,
    /// Latency added before every request to it (`peer.delay_ms`).
    pub delay: Duration,
    /// Its HTTPS client, for an `https://` peer (`None`: the dispatcher's
    /// plain HTTP client).
    pub tls: Option<TlsClient>,
}

impl Peer {
    /// The peer `config` with its token `token`, at `index`; an
    /// `https://` one with its client (`tls`). The error says what is
    /// wrong with its URL.
    pub fn new(
        index: usize,
        config: &PeerConfig,
        token: String,
        tls: Option<TlsClient>,
    ) -> Result<Self, BackendUrlError> {
        Ok(Self {
            index,
            address: config.address()?,
            region: config.region.clone(),
            token,
            delay: Duration::from_millis(config.delay_ms),
            tls,
        })
    }
}

/// The HTTPS client of an `https://` peer, with the settings and the
/// digest of the files it was built from: two are the same when those
/// are (a reload that rotates a certificate builds a new one).
#[derive(Clone)]
pub struct TlsClient {
    /// Its settings.
    pub settings: PeerTls,
    /// XXH3 of the CA, certificate and key files' bytes.
    digest: u64,
    /// The client (its connection pool shared by clones).
    pub client: Arc<PeerClient>,
}

impl TlsClient {
    /// The client `settings` make (the files read now), connecting within
    /// `connect_timeout`.
    pub fn new(settings: PeerTls, connect_timeout: Duration) -> Result<Self, crate::tls::TlsError> {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for path in [&settings.ca_file, &settings.cert_file, &settings.key_file]
            .into_iter()
            .flatten()
        {
            h.update(&std::fs::read(path).unwrap_or_default());
            h.update(&[0xff]);
        }
        let client = Arc::new(crate::tls::peer_client(&settings, connect_timeout)?);
        Ok(Self {
            settings,
            digest: h.digest(),
            client,
        })
    }
}

impl PartialEq for TlsClient {
    fn eq(&self, other: &Self) -> bool {
        (&self.settings, self.digest) == (&other.settings, other.digest)
    }
}

impl Eq for TlsClient {}

impl std::fmt::Debug for TlsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsClient")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
struct Entry {
    peer: Peer,
    /// Its last summary and when it arrived.
    summary: Option<(LoadSummary, Instant)>,
    /// Moving average of its polls' round trips.
    rtt: Option<Duration>,
    /// Requests forwarded to it since its last summary.
    sent: u32,
    /// Summaries received (the generation of the last one).
    generation: u64,
    /// Requests that were in flight there when its last summary was taken
    /// (forwarded before it) and have ended since: the servers they held
    /// are free again, which the summary could not know.
    released: u32,
    /// A forwarded request failed there since its last summary.
    failed: bool,
}

/// A request forwarded to a peer, as [`PeerBook::choose`] chose it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Forward {
    /// The peer.
    pub peer: Peer,
    /// The generation of the summary it was chosen by.
    generation: u64,
}

/// The peers of one dispatcher and what it knows of them.
#[derive(Debug)]
pub struct PeerBook {
    entries: Mutex<Vec<Entry>>,
    /// This gateway's region (`peering.region`: the hop header's value).
    region: String,
    max_age: Duration,
    forward_after: Duration,
    delay_penalty_ms: f64,
    /// Dispatchers of this gateway (each has a book).
    dispatchers: u32,
}

impl PeerBook {
    /// A book of `peers`, under `peering`'s rules, for one of `dispatchers`.
    pub fn new(peering: &PeeringConfig, peers: Vec<Peer>, dispatchers: usize) -> Self {
        Self {
            entries: Mutex::new(
                peers
                    .into_iter()
                    .map(|peer| Entry {
                        peer,
                        summary: None,
                        rtt: None,
                        sent: 0,
                        generation: 0,
                        released: 0,
                        failed: false,
                    })
                    .collect(),
            ),
            region: peering.region.clone().unwrap_or_default(),
            max_age: Duration::from_millis(peering.max_age_ms),
            forward_after: Duration::from_millis(peering.forward_after_ms),
            delay_penalty_ms: peering.delay_penalty_ms.max(1) as f64,
            dispatchers: u32::try_from(dispatchers.max(1)).unwrap_or(u32::MAX),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Entry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// This gateway's region, which the requests it forwards name.
    pub fn region(&self) -> &str {
        &self.region
    }

    /// The peers, to poll.
    pub fn peers(&self) -> Vec<Peer> {
        self.lock().iter().map(|e| e.peer.clone()).collect()
    }

    /// A poll of peer `index` answered `summary` after `rtt`.
    pub fn summary(&self, index: usize, summary: LoadSummary, rtt: Duration, now: Instant) {
        if let Some(e) = self.lock().get_mut(index) {
            e.summary = Some((summary, now));
            e.rtt = Some(match e.rtt {
                Some(old) => old.mul_f64(1.0 - RTT_WEIGHT) + rtt.mul_f64(RTT_WEIGHT),
                None => rtt,
            });
            e.sent = 0;
            e.released = 0;
            e.generation += 1;
            e.failed = false;
        }
    }

    /// A poll of peer `index` failed: what it said before is not used.
    pub fn unreachable(&self, index: usize) {
        if let Some(e) = self.lock().get_mut(index) {
            e.summary = None;
        }
    }

    /// A request forwarded to peer `index` failed: it gets no more until
    /// its next summary.
    pub fn failed(&self, index: usize) {
        if let Some(e) = self.lock().get_mut(index) {
            e.failed = true;
        }
    }

    /// The peer to forward a request for `model` to, when the local queue
    /// would keep it `local_wait` (`None`: unknown, the queue never
    /// drained yet): see the [module docs](super) for the rule. The peer is
    /// counted as sent one more request; tell [`ended`](Self::ended) when
    /// it ends.
    pub fn choose(&self, model: &str, local_wait: Option<Duration>, now: Instant) -> Option<Forward> {
        if local_wait.unwrap_or_default() < self.forward_after {
            return None;
        }
        let mut entries = self.lock();
        let mut best: Option<(f64, usize)> = None;
        for (i, e) in entries.iter().enumerate() {
            let Some(free) = self.room(e, model, now) else { continue };
            let rtt = e.rtt.unwrap_or_default();
            if local_wait.is_some_and(|wait| rtt >= wait) {
                continue;
            }
            let score = free - rtt.as_secs_f64() * 1000.0 / self.delay_penalty_ms;
            if best.is_none_or(|(s, _)| score > s) {
                best = Some((score, i));
            }
        }
        let (_, i) = best?;
        Some(Self::take(&mut entries[i]))
    }

    /// Peer `index`, for a request for `model` that continues a
    /// conversation it served ([`super::affinity`]), when its summary is
    /// fresh and shows room: the local queue's wait does not matter. The
    /// peer is counted as sent one more request, as by [`choose`](Self::choose).
    pub fn choose_warm(&self, index: usize, model: &str, now: Instant) -> Option<Forward> {
        let mut entries = self.lock();
        let e = entries.get_mut(index)?;
        self.room(e, model, now)?;
        Some(Self::take(e))
    }

    /// For each peer, how old (s) an entry of a conversation forwarded to
    /// it may be and still be warm there: `affinity_secs`, or less when its
    /// summary says its engines evict sooner; `None` for a peer without a
    /// fresh summary (its load, so its room, is unknown).
    pub fn warm_ages(&self, affinity_secs: u64, now: Instant) -> Vec<(ServerRef, Option<u16>)> {
        let cap = u16::try_from(affinity_secs).unwrap_or(u16::MAX);
        self.lock()
            .iter()
            .map(|e| {
                let age = e
                    .summary
                    .as_ref()
                    .filter(|(_, at)| cap > 0 && !e.failed && now.saturating_duration_since(*at) <= self.max_age)
                    .map(|(s, _)| s.warm_s.map_or(cap, |w| cap.min(u16::try_from(w).unwrap_or(u16::MAX))));
                (super::affinity::peer_ref(e.peer.index, &e.peer.address), age)
            })
            .collect()
    }

    /// Whether `e` takes a request for `model` now: its summary is fresh,
    /// it serves the model, has not failed since and has a free server in
    /// this dispatcher's share. `Some(its free share of servers, less what
    /// this dispatcher sent it)`.
    fn room(&self, e: &Entry, model: &str, now: Instant) -> Option<f64> {
        let (summary, at) = e.summary.as_ref()?;
        if e.failed || now.saturating_duration_since(*at) > self.max_age || !summary.serves(model) {
            return None;
        }
        // Saturating: `free` is the peer's word, up to u32::MAX.
        let share = summary.free.div_ceil(self.dispatchers).saturating_add(e.released);
        if share <= e.sent || summary.servers == 0 {
            return None;
        }
        let left = f64::from(share - e.sent) / f64::from(share);
        let free = f64::from(summary.free.saturating_add(e.released));
        Some(left * free.min(f64::from(summary.servers)) / f64::from(summary.servers))
    }

    /// Counts one more request sent to `e`.
    fn take(e: &mut Entry) -> Forward {
        e.sent += 1;
        Forward {
            peer: e.peer.clone(),
            generation: e.generation,
        }
    }

    /// A request forwarded as `forward` ended (its answer ended, failed or
    /// was dropped): the server it took there is free again. Before the
    /// peer's next summary, it is no longer counted as sent; after one
    /// (which saw it running), that summary's free servers are one more.
    pub fn ended(&self, forward: &Forward) {
        if let Some(e) = self.lock().get_mut(forward.peer.index) {
            if e.generation == forward.generation {
                e.sent = e.sent.saturating_sub(1);
            } else {
                e.released += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(index: usize, region: &str) -> Peer {
        Peer {
            index,
            address: format!("http://127.0.0.1:{}", 9000 + index),
            region: region.into(),
            token: "t".repeat(32),
            delay: Duration::ZERO,
            tls: None,
        }
    }

    fn summary(region: &str, servers: u32, free: u32) -> LoadSummary {
        LoadSummary {
            region: region.into(),
            servers,
            free,
            spare: u64::from(free),
            pending: 0,
            inflight: 0,
            queue: 0,
            models: vec![],
            warm_s: None,
        }
    }

    fn book(dispatchers: usize) -> PeerBook {
        let peering = PeeringConfig {
            region: Some("a".into()),
            forward_after_ms: 100,
            max_age_ms: 1000,
            delay_penalty_ms: 200,
            ..PeeringConfig::default()
        };
        PeerBook::new(&peering, vec![peer(0, "b"), peer(1, "c")], dispatchers)
    }

    const LONG: Option<Duration> = Some(Duration::from_secs(2));

    #[test]
    fn nothing_is_forwarded_without_a_fresh_summary_with_room_or_a_long_local_wait() {
        let b = book(1);
        let now = Instant::now();
        assert_eq!(b.choose("m", LONG, now), None, "no summary yet");
        b.summary(0, summary("b", 2, 0), Duration::from_millis(5), now);
        assert_eq!(b.choose("m", LONG, now), None, "no free server");
        b.summary(0, summary("b", 2, 1), Duration::from_millis(5), now);
        assert_eq!(
            b.choose("m", Some(Duration::from_millis(50)), now),
            None,
            "short local wait"
        );
        assert_eq!(b.choose("m", None, now), None, "an unknown wait is no wait");
        assert_eq!(b.choose("m", LONG, now + Duration::from_secs(2)), None, "stale");
        assert_eq!(b.choose("m", LONG, now).map(|f| f.peer.index), Some(0));
        assert_eq!(b.choose("m", LONG, now), None, "its one free server was taken");
        b.summary(0, summary("b", 2, 1), Duration::from_millis(5), now);
        b.failed(0);
        assert_eq!(b.choose("m", LONG, now), None, "failed since its summary");
        b.summary(0, summary("b", 2, 1), Duration::from_millis(5), now);
        b.unreachable(0);
        assert_eq!(b.choose("m", LONG, now), None, "unreachable");
    }

    #[test]
    fn the_freer_peer_wins_unless_it_is_much_further() {
        let b = book(1);
        let now = Instant::now();
        b.summary(0, summary("b", 4, 1), Duration::from_millis(5), now);
        b.summary(1, summary("c", 4, 4), Duration::from_millis(5), now);
        assert_eq!(b.choose("m", LONG, now).map(|f| f.peer.region), Some("c".into()));
        // c 300 ms away: 1.0 - 1.5 < 0.25 - 0.025.
        let b = book(1);
        b.summary(0, summary("b", 4, 1), Duration::from_millis(5), now);
        b.summary(1, summary("c", 4, 4), Duration::from_millis(300), now);
        assert_eq!(b.choose("m", LONG, now).map(|f| f.peer.region), Some("b".into()));
        // A peer further than the local wait is not worth it.
        let b = book(1);
        b.summary(1, summary("c", 4, 4), Duration::from_millis(300), now);
        assert_eq!(b.choose("m", Some(Duration::from_millis(200)), now), None);
    }

    #[test]
    fn a_forward_that_ended_after_a_summary_frees_its_server() {
        let b = book(1);
        let now = Instant::now();
        b.summary(0, summary("b", 1, 1), Duration::from_millis(1), now);
        let first = b.choose("m", LONG, now).expect("room");
        // A summary taken while it runs: no free server.
        b.summary(0, summary("b", 1, 0), Duration::from_millis(1), now);
        assert_eq!(b.choose("m", LONG, now), None);
        b.ended(&first);
        let second = b.choose("m", LONG, now).expect("its server is free again");
        assert_eq!(b.choose("m", LONG, now), None, "taken again");
        // One that ends before any newer summary gives back what it took.
        b.ended(&second);
        assert!(b.choose("m", LONG, now).is_some());
    }

    #[test]
    fn a_peer_claiming_every_server_free_overflows_nothing() {
        // Fuzz target peer_summary (tests/fuzz/regressions/peer_summary):
        // `free` is the peer's word; with a forward ended after a newer
        // summary, share and free counts went past u32::MAX.
        let b = book(1);
        let now = Instant::now();
        b.summary(0, summary("b", u32::MAX, u32::MAX), Duration::from_millis(1), now);
        let first = b.choose("m", LONG, now).expect("room");
        b.summary(0, summary("b", u32::MAX, u32::MAX), Duration::from_millis(1), now);
        b.ended(&first);
        assert!(b.choose("m", LONG, now).is_some());
    }

    #[test]
    fn dispatchers_share_a_peers_free_servers() {
        let b = book(4);
        let now = Instant::now();
        b.summary(0, summary("b", 8, 8), Duration::from_millis(1), now);
        let sent = (0..10).filter_map(|_| b.choose("m", LONG, now)).count();
        assert_eq!(sent, 2, "8 free servers shared by 4 dispatchers");
    }

    #[test]
    fn a_peer_not_serving_the_model_is_skipped() {
        let b = book(1);
        let now = Instant::now();
        let mut s = summary("b", 2, 2);
        s.models = vec!["other".into()];
        b.summary(0, s, Duration::from_millis(1), now);
        assert_eq!(b.choose("m", LONG, now), None);
        assert!(b.choose("other", LONG, now).is_some());
    }

    #[test]
    fn a_warm_peer_is_chosen_by_room_alone_and_its_window_follows_its_evictions() {
        let b = book(1);
        let now = Instant::now();
        assert!(
            b.warm_ages(300, now).iter().all(|(_, age)| age.is_none()),
            "no summary yet"
        );
        b.summary(0, summary("b", 1, 1), Duration::from_millis(1), now);
        let mut evicting = summary("c", 1, 0);
        evicting.warm_s = Some(40);
        b.summary(1, evicting, Duration::from_millis(1), now);
        let ages: Vec<_> = b.warm_ages(300, now).into_iter().map(|(_, a)| a).collect();
        assert_eq!(ages, [Some(300), Some(40)]);
        assert!(b.warm_ages(0, now).iter().all(|(_, age)| age.is_none()), "affinity off");
        // No local wait needed; room still is.
        assert_eq!(b.choose_warm(1, "m", now), None, "c has no free server");
        let f = b.choose_warm(0, "m", now).expect("b has room");
        assert_eq!(b.choose_warm(0, "m", now), None, "its one free server was taken");
        b.ended(&f);
        assert!(b.choose_warm(0, "m", now).is_some());
        assert_eq!(b.choose_warm(0, "m", now + Duration::from_secs(5)), None, "stale");
    }
}
