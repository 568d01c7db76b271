//! What other servers answer the gateway: Redis (the store's replies)
//! and peer gateways (their load summaries).

use std::io::Read;
use std::time::{Duration, Instant};

use redis::Value;

use super::peak_allocation;
use crate::config::PeeringConfig;
use crate::peers::book::{Peer, PeerBook};
use crate::peers::summary::LoadSummary;
use crate::store::redis::client::{self, DispatchLookup, InflightLoad};

/// Most replies read from one input.
const MAX_REPLIES: usize = 64;
/// Most bytes the RESP reader may hold at once per input byte (an empty
/// array element is 3 bytes and a 56-byte value), beyond a slack.
const BYTES_PER_INPUT_BYTE: usize = 64;
/// Allocation any input may cost (the reader's buffers).
const ALLOCATION_SLACK: usize = 256 << 10;
/// Values the RESP reader sets aside for each aggregate header (array,
/// map, set, attribute, push) before any element arrives: the redis crate
/// reads them with combine's `count_min_max`, which reserves the declared
/// count capped at 4 096 (combine 4.6, `suggest_size_hint`). Nesting is
/// capped at 100 levels, so a reply being read holds at most ~23 MB of
/// such reservations however long its headers claim it is. (Found by this
/// target in CI: 154 bytes declaring a set of 123 456 725 inside another
/// held 468 378 bytes.) Only unfinished aggregates count: a finished one
/// read its elements, at least 3 input bytes each, which the per-byte
/// allowance covers; and the unfinished ones are nested in the one reply
/// being read.
const VALUES_RESERVED_PER_HEADER: usize = 4096;
/// The redis crate's nesting limit (`MAX_RECURSE_DEPTH`).
const MAX_NESTING: usize = 100;

/// Redis replies in a row (RESP2 or RESP3), as a pipeline's answer comes
/// back; byte 0 is how many bytes each read of the socket returns. Those
/// read whole read the same in pieces, the reader holds a bounded multiple
/// of the input, and the store's parsers of them (the in-flight sum, the
/// longest-prefix match, the dispatch lookup, the checksummed response)
/// give sorted, consistent answers.
pub fn redis_reply(data: &[u8]) {
    let Some((&step, stream)) = data.split_first() else {
        return;
    };
    let (whole, peak) = peak_allocation(|| replies(stream, stream.len().max(1)));
    if let Some(peak) = peak {
        let headers = stream
            .iter()
            .filter(|b| matches!(b, b'*' | b'%' | b'~' | b'|' | b'>'))
            .count()
            .min(MAX_NESTING);
        let reserved = headers * VALUES_RESERVED_PER_HEADER * size_of::<Value>();
        assert!(
            peak <= BYTES_PER_INPUT_BYTE * stream.len() + reserved + ALLOCATION_SLACK,
            "reading {} bytes of replies ({headers} aggregate headers at most) held {peak} bytes at once",
            stream.len()
        );
    }
    // Read in pieces, the replies read whole come first. (Not all of it:
    // the redis crate, 0.32.7, reads some malformed replies in pieces that
    // it refuses whole, skipping an element whose type byte is unknown;
    // tests/fuzz/regressions/redis_reply.)
    let pieces = replies(stream, 1 + usize::from(step % 64));
    let (whole_read, pieces_read) = (
        format!("{whole:?}"),
        format!("{:?}", &pieces[..whole.len().min(pieces.len())]),
    );
    assert_eq!(pieces_read, whole_read, "replies read whole read the same in pieces");
    for reply in &whole {
        if let Ok(loads) = client::parse_inflight(reply) {
            check_sorted_servers(&loads.iter().map(|l| l.server).collect::<Vec<_>>());
        }
        if let Ok((depths, stamps)) = client::parse_lpm(reply) {
            check_match(&depths, &stamps);
        }
        if let Value::BulkString(bytes) = reply {
            check_sealed(bytes);
        }
    }
    for (asked_response, asked_affinity) in [(false, false), (true, false), (false, true), (true, true)] {
        if let Ok(lookup) = client::parse_lookup(whole.clone(), asked_response, asked_affinity) {
            let DispatchLookup {
                response,
                prefix,
                refreshed,
                loads,
                holders,
            } = lookup;
            assert!(asked_response || response.is_none(), "a response nobody asked for");
            assert_eq!(asked_affinity, holders.is_some(), "holders asked for and given");
            check_match(&prefix, &refreshed);
            check_sorted_servers(&loads.iter().map(|l: &InflightLoad| l.server).collect::<Vec<_>>());
        }
    }
}

/// The replies in `stream` read through a socket that returns at most
/// `step` bytes per read, up to the first that does not parse.
fn replies(stream: &[u8], step: usize) -> Vec<Value> {
    let mut socket = Trickle { rest: stream, step };
    let mut parser = redis::Parser::new();
    let mut out = Vec::new();
    while out.len() < MAX_REPLIES
        && let Ok(value) = parser.parse_value(&mut socket)
    {
        out.push(value);
    }
    out
}

/// A socket of in-memory bytes returning at most `step` bytes per read.
struct Trickle<'a> {
    rest: &'a [u8],
    step: usize,
}

impl Read for Trickle<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = buf.len().min(self.step).min(self.rest.len());
        buf[..n].copy_from_slice(&self.rest[..n]);
        self.rest = &self.rest[n..];
        Ok(n)
    }
}

/// Servers sorted, each once.
fn check_sorted_servers(servers: &[u64]) {
    assert!(
        servers.windows(2).all(|w| w[0] < w[1]),
        "servers {servers:x?} are not sorted and unique"
    );
}

/// A prefix match: each server once, sorted, at depth 1 or more, and
/// stamped exactly when matched.
fn check_match(depths: &[(u64, u32)], stamps: &[(u64, u64)]) {
    let servers: Vec<u64> = depths.iter().map(|(s, _)| *s).collect();
    check_sorted_servers(&servers);
    assert!(depths.iter().all(|(_, d)| *d >= 1), "a match of depth 0: {depths:?}");
    let stamped: Vec<u64> = stamps.iter().map(|(s, _)| *s).collect();
    if !stamps.is_empty() {
        assert_eq!(stamped, servers, "the stamped servers are the matched ones");
    }
}

/// A stored value unseals only to a body that seals to it, and a body
/// sealed unseals to itself.
fn check_sealed(stored: &[u8]) {
    if let Some(body) = client::unsealed(stored.to_vec()) {
        assert_eq!(client::sealed(&body), stored, "unsealed to a body that seals otherwise");
    }
    assert_eq!(client::unsealed(client::sealed(stored)).as_deref(), Some(stored));
}

/// A peer's load summary (the body of `GET /semlb/peer/load`) after byte
/// 0 (bits 0-1: dispatchers less one; bit 2: the model asked for is the
/// summary's first; bits 3-7: the poll's round trip in ms) and byte 1 (how
/// many of the next bytes are book operations: bits 0-1 choose, choose
/// warm, end a forward, a new summary; bits 2-7 the time since the first
/// summary, in 20 ms). A summary re-serialises to itself, and the book
/// forwards a request only to a peer whose summary is fresh, serves the
/// model and has servers.
pub fn peer_summary(data: &[u8]) {
    let [setup, ops, rest @ ..] = data else {
        return;
    };
    let (ops, body) = rest.split_at((usize::from(*ops) % 32).min(rest.len()));
    let Ok(summary) = serde_json::from_slice::<LoadSummary>(body) else {
        return;
    };
    let written = serde_json::to_vec(&summary).expect("a summary serializes");
    let again: LoadSummary = serde_json::from_slice(&written).expect("a written summary parses");
    assert_eq!(again, summary, "a summary re-serialises to itself");

    let peering = PeeringConfig {
        region: Some("eu-west".into()),
        max_age_ms: 1000,
        forward_after_ms: 100,
        delay_penalty_ms: 200,
        ..PeeringConfig::default()
    };
    let peer = Peer {
        index: 0,
        address: "http://10.0.0.9:8080".into(),
        region: summary.region.clone(),
        token: "t".repeat(32),
        delay: Duration::ZERO,
        tls: None,
    };
    let book = PeerBook::new(&peering, vec![peer], 1 + usize::from(setup & 3));
    let model = match summary.models.first() {
        Some(first) if setup & 4 != 0 => first.clone(),
        _ => "qwen3".to_owned(),
    };
    let rtt = Duration::from_millis(u64::from(setup >> 3));
    let start = Instant::now();
    let mut polled = start;
    book.summary(0, summary.clone(), rtt, polled);
    let mut forwards = Vec::new();
    for op in ops {
        let now = start + Duration::from_millis(u64::from(op >> 2) * 20);
        let forward = match op & 3 {
            0 => book.choose(&model, Some(Duration::from_secs(5)), now),
            1 => book.choose_warm(0, &model, now),
            2 => {
                if let Some(f) = forwards.pop() {
                    book.ended(&f);
                }
                None
            }
            _ => {
                polled = polled.max(now);
                book.summary(0, summary.clone(), rtt, polled);
                None
            }
        };
        if let Some(f) = forward {
            assert!(
                summary.serves(&model) && summary.servers > 0,
                "forwarded a request for {model:?} to a peer whose summary is {summary:?}"
            );
            assert!(
                now.saturating_duration_since(polled) <= Duration::from_millis(peering.max_age_ms),
                "forwarded on a stale summary"
            );
            forwards.push(f);
        }
        let _ = book.warm_ages(300, now);
    }
}
