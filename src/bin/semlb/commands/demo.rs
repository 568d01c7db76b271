//! `semlb demo`: the tables at work, with no servers and no network.
//!
//! The demo creates a throw-away segment, registers four fake servers and
//! replays a few synthetic multi-turn conversations the way the gateway
//! will route them:
//!
//! 1. The prompt of each turn is the previous prompt, the previous answer
//!    and the new user text. Its "tokens" are its bytes; every whole block
//!    of [`BLOCK_TOKENS`] tokens gets a chained hash
//!    `h_i = seahash(h_{i-1} ‖ block_i)` (`h_{-1} = 0`), so equal hashes mean
//!    equal prefixes, as in vLLM's prefix cache.
//! 2. The exact-response cache is asked first, keyed by a 128-bit hash of
//!    (model, prompt).
//! 3. On a miss, [`shm_layout::PrefixTable::longest_prefix_match`] (live
//!    servers only) finds the server holding the longest prefix; it gets the
//!    request if it holds at least half of the prompt's blocks
//!    ([`PREFIX_ROUTE_PERCENT`]), otherwise the server with the fewest
//!    requests in flight does.
//! 4. The request is counted in flight (`begin_request`) until the same
//!    conversation's next turn, the fake answer goes into the response
//!    cache, and the chain of prompt + answer is recorded for the chosen
//!    server, as a responder process will do after a real response.
//!
//! At the end one earlier prompt is asked again and hits the response
//! cache, and the segment is printed as `semlb shm inspect` prints it. The
//! segment is removed when the demo ends, on error too. Everything printed
//! is deterministic except the segment name (it has the pid in it), pids and
//! times.

use std::io::Write;

use anyhow::{Context, Result, bail};
use shm_layout::{ResponseKey, Role, Segment, ServerRef, Tables};

use crate::cli::DemoArgs;
use crate::commands::report::Report;
use crate::commands::shm;
use semlb::config::size::ByteSize;

/// Tokens per prefix block.
pub const BLOCK_TOKENS: usize = 16;
/// A request follows its prefix if the best server holds at least this
/// share of the prompt's blocks.
pub const PREFIX_ROUTE_PERCENT: usize = 50;
/// Number of fake servers.
const SERVERS: u16 = 4;
/// The model every request names.
const MODEL: &str = "demo-model";
/// The synthetic conversations: a label and the user's turns. E forks A:
/// its first prompt is A's first prompt (a response-cache hit), and its
/// second turn shares A's first exchange, so it follows A's server.
///
/// No system prompt is shared by all of them: the prefix table remembers
/// at most [`shm_layout::prefix_table::LANES`] servers per block and a match
/// must hold the first block, so a prefix shared across all four servers
/// would hide the older ones from the match.
const CONVERSATIONS: [(char, &[&str]); 5] = [
    (
        'A',
        &[
            "How does a lock-free hash table survive a writer killed mid-update?",
            "And when two writers race for the same slot?",
            "Summarise that in one sentence.",
        ],
    ),
    (
        'B',
        &[
            "Why does prefix-aware routing beat round robin for chat traffic?",
            "Give one workload where it does not.",
            "How would you detect that workload online?",
        ],
    ),
    (
        'C',
        &[
            "Translate 'shared memory' into French and German.",
            "Now into Japanese.",
            "Which of the three is the shortest?",
        ],
    ),
    ('D', &["Write a haiku about a cache miss."]),
    (
        'E',
        &[
            "How does a lock-free hash table survive a writer killed mid-update?",
            "Could the same design work across machines?",
        ],
    ),
];

/// Removes the segment when dropped, unless [`Self::remove`] already did.
/// Armed only after the demo created the segment, so it never removes a
/// segment somebody else owns.
struct RemoveOnDrop {
    name: Option<String>,
}

impl RemoveOnDrop {
    fn remove(mut self) -> Result<()> {
        match self.name.take() {
            Some(name) => Segment::remove(&name).map_err(Into::into),
            None => Ok(()),
        }
    }
}

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(name) = self.name.take() {
            // Best effort on the error path: the original error matters more.
            let _ = Segment::remove(&name);
        }
    }
}

/// The chained block hashes of `tokens`; a partial last block is left out.
pub fn block_chain(tokens: &[u8]) -> Vec<u64> {
    let mut previous = 0u64;
    let mut buf = Vec::with_capacity(8 + BLOCK_TOKENS);
    tokens
        .chunks_exact(BLOCK_TOKENS)
        .map(|block| {
            buf.clear();
            buf.extend_from_slice(&previous.to_le_bytes());
            buf.extend_from_slice(block);
            previous = seahash::hash(&buf);
            previous
        })
        .collect()
}

/// The exact-response key of (model, prompt): two independently keyed
/// 64-bit seahashes over the length-prefixed model name and the prompt.
pub fn response_key(model: &str, prompt: &str) -> ResponseKey {
    let mut buf = Vec::with_capacity(8 + model.len() + prompt.len());
    buf.extend_from_slice(&(model.len() as u64).to_le_bytes());
    buf.extend_from_slice(model.as_bytes());
    buf.extend_from_slice(prompt.as_bytes());
    let lo = seahash::hash_seeded(
        &buf,
        0x243f_6a88_85a3_08d3,
        0x1319_8a2e_0370_7344,
        0xa409_3822_299f_31d0,
        0x082e_fa98_ec4e_6c89,
    );
    let hi = seahash::hash_seeded(
        &buf,
        0x4528_21e6_38d0_1377,
        0xbe54_66cf_34e9_0c6c,
        0xc0ac_29b7_c97c_50dd,
        0x3f84_d5b5_b547_0917,
    );
    ResponseKey((u128::from(hi) << 64) | u128::from(lo))
}

fn fake_answer(label: char, turn: usize, question: &str) -> String {
    format!("[{label}{turn}] A synthetic answer from the simulated engine to: {question}")
}

/// How one request was routed.
enum Route {
    /// To the server holding at least half of the prompt's blocks.
    Prefix,
    /// To the server with the fewest requests in flight.
    LeastLoaded(u64),
}

/// The router's state: the segment's tables, the demo's servers and its
/// process slot (the row of the in-flight ledger it counts in).
struct Router<'a> {
    tables: Tables<'a>,
    servers: Vec<(ServerRef, String)>,
    process: u16,
}

impl Router<'_> {
    fn address(&self, server: ServerRef) -> &str {
        self.servers
            .iter()
            .find(|(s, _)| *s == server)
            .map_or("?", |(_, a)| a.as_str())
    }

    fn least_loaded(&self) -> Option<(ServerRef, u64)> {
        self.servers
            .iter()
            .filter(|(s, _)| self.tables.servers.is_live(s.tag()))
            .map(|(s, _)| (*s, self.tables.servers.inflight(*s)))
            .min_by_key(|(s, (requests, tokens))| (*requests, *tokens, s.slot))
            .map(|(s, (requests, _))| (s, requests))
    }

    /// Picks a server for `chain`; returns it, how it was chosen and a
    /// description of the prefix match.
    fn route(&self, chain: &[u64]) -> Result<(ServerRef, Route, String)> {
        let m = self
            .tables
            .prefix
            .longest_prefix_match(chain, |t| self.tables.servers.is_live(t));
        let best = m.best().and_then(|(tag, blocks)| {
            let (server, _) = self.tables.servers.current(tag.slot())?;
            Some((server, blocks as usize))
        });
        let described = match best {
            None => "none".to_owned(),
            Some((s, blocks)) => format!(
                "server {} holds {blocks}/{} ({} %)",
                s.slot,
                chain.len(),
                blocks * 100 / chain.len().max(1)
            ),
        };
        if let Some((server, blocks)) = best
            && blocks * 100 >= chain.len() * PREFIX_ROUTE_PERCENT
        {
            return Ok((server, Route::Prefix, described));
        }
        let (server, inflight) = self.least_loaded().context("no live server to route to")?;
        Ok((server, Route::LeastLoaded(inflight), described))
    }
}

/// Runs the demo, writing its log and the final report to `out`.
pub fn run(args: &DemoArgs, out: &mut impl Write) -> Result<()> {
    let name = args
        .shm_name
        .clone()
        .unwrap_or_else(|| format!("semlb-demo-{}", std::process::id()));
    let plan = shm::plan(args.shm_size, shm_layout::plan::DEFAULT_MAX_RESPONSE_FRACTION)?;
    let segment = Segment::create(&name, &plan)?;
    let guard = RemoveOnDrop {
        name: Some(name.clone()),
    };
    replay(&segment, out)?;
    drop(segment);
    guard.remove()?;
    writeln!(out, "\nremoved shm segment {}", shm_layout::shm_path(&name)?)?;
    Ok(())
}

fn replay(segment: &Segment, out: &mut impl Write) -> Result<()> {
    let tables = segment.tables();
    let clock = segment.clock();
    let mut servers = Vec::new();
    for i in 0..SERVERS {
        let address = format!("http://127.0.0.1:{}", 8000 + i);
        let server = tables.servers.register(u64::from(i) + 1, &address, clock.now_ms())?;
        servers.push((server, address));
    }
    let Some(process) = tables.registry.find_free() else {
        bail!("the process registry of a new segment is full");
    };
    let incarnation = tables.registry.claim(process, Role::Tool, clock.now_ms());
    tables
        .registry
        .attach(process, incarnation, std::process::id(), clock.now_ms());
    let router = Router {
        tables,
        servers,
        process,
    };

    writeln!(
        out,
        "semlb demo: shm segment {} ({}), {} servers, {} conversations, model {MODEL}",
        segment.name().unwrap_or("(heap)"),
        ByteSize(segment.header().segment_bytes),
        SERVERS,
        CONVERSATIONS.len()
    )?;
    writeln!(
        out,
        "routing: to the longest cached prefix if it covers >= {PREFIX_ROUTE_PERCENT} % of the prompt's \
         {BLOCK_TOKENS}-token blocks, else to the server with the fewest requests in flight \
         (a request stays in flight until its conversation's next turn)"
    )?;
    // Per conversation: the prompt so far and the request in flight.
    let mut prompts: Vec<String> = vec![String::new(); CONVERSATIONS.len()];
    let mut inflight: Vec<Option<(ServerRef, u64)>> = vec![None; CONVERSATIONS.len()];
    let mut first_prompt = None;
    let (mut prefix_routed, mut routed, mut cache_hits) = (0, 0, 0);
    let most_turns = CONVERSATIONS.iter().map(|(_, t)| t.len()).max().unwrap_or(0);
    for turn in 0..most_turns {
        for (c, (label, questions)) in CONVERSATIONS.iter().enumerate() {
            let Some(question) = questions.get(turn) else { continue };
            if let Some((server, tokens)) = inflight[c].take() {
                router.tables.servers.end_request(router.process, server, tokens, false);
            }
            let prompt = &mut prompts[c];
            prompt.push_str("User: ");
            prompt.push_str(question);
            prompt.push_str("\nAssistant: ");
            let key = response_key(MODEL, prompt);
            let chain = block_chain(prompt.as_bytes());
            let cached = router.tables.responses.get(key);
            write!(
                out,
                "  {label}{}  {:>4} tokens {:>3} blocks  response cache {}  ",
                turn + 1,
                prompt.len(),
                chain.len(),
                if cached.is_some() { "hit " } else { "miss" }
            )?;
            let answer = match cached {
                Some(bytes) => {
                    cache_hits += 1;
                    writeln!(out, "→ answered from the cache")?;
                    String::from_utf8_lossy(&bytes).into_owned()
                }
                None => {
                    routed += 1;
                    let (server, route, matched) = router.route(&chain)?;
                    let how = match route {
                        Route::Prefix => {
                            prefix_routed += 1;
                            "prefix".to_owned()
                        }
                        Route::LeastLoaded(n) => format!("fewest in flight: {n}"),
                    };
                    writeln!(
                        out,
                        "match: {matched:<28} → server {} {} ({how})",
                        server.slot,
                        router.address(server)
                    )?;
                    let tokens = prompt.len() as u64;
                    if !router.tables.servers.begin_request(router.process, server, tokens) {
                        bail!("server {} was retired while routing to it", server.slot);
                    }
                    inflight[c] = Some((server, tokens));
                    let answer = fake_answer(*label, turn + 1, question);
                    router.tables.responses.put(key, answer.as_bytes())?;
                    let mut held = prompt.clone();
                    held.push_str(&answer);
                    router
                        .tables
                        .prefix
                        .insert_chain(&block_chain(held.as_bytes()), server, clock.stamp());
                    answer
                }
            };
            if first_prompt.is_none() {
                first_prompt = Some((format!("{label}{}", turn + 1), prompt.clone()));
            }
            prompt.push_str(&answer);
            prompt.push('\n');
        }
    }
    for (server, tokens) in inflight.into_iter().flatten() {
        router.tables.servers.end_request(router.process, server, tokens, false);
    }
    writeln!(
        out,
        "{prefix_routed} of {routed} routed turns followed their prefix; {cache_hits} answered from the response cache"
    )?;

    let (label, prompt) = first_prompt.context("the demo has no conversations")?;
    match router.tables.responses.get(response_key(MODEL, &prompt)) {
        Some(answer) => writeln!(
            out,
            "re-asking {label}: response-cache hit ({} bytes): {:?}",
            answer.len(),
            String::from_utf8_lossy(&answer)
        )?,
        None => bail!("re-asking {label} missed the response cache"),
    }

    writeln!(out, "\n--- semlb shm inspect ---")?;
    write!(out, "{}", Report::of(segment).text())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_share_exactly_the_common_whole_blocks() {
        let a = block_chain(b"0123456789abcdef0123456789ABCDEFtail");
        let b = block_chain(b"0123456789abcdef0123456789ABCDEXand more text here");
        assert_eq!(a.len(), 2, "the partial block is left out");
        assert_eq!(b.len(), 3);
        assert_eq!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
        // Chained: the same block after a different prefix hashes differently.
        let c = block_chain(b"XXXXXXXXXXXXXXXX0123456789ABCDEF");
        assert_ne!(a[1], c[1]);
        assert!(block_chain(b"short").is_empty());
    }

    #[test]
    fn response_keys_separate_model_and_prompt() {
        let k = response_key("m", "prompt");
        assert_eq!(k, response_key("m", "prompt"));
        assert_ne!(k, response_key("m", "prompt "));
        assert_ne!(k, response_key("mp", "rompt"));
        assert_ne!(k.0 >> 64, k.0 & u128::from(u64::MAX));
    }
}
