//! What a response process does: it drains completion rings and writes
//! what each finished request teaches back into the shared tables.
//!
//! For each record (a [`shm_layout::Completion`] pushed by a dispatcher):
//! if its server registration is still current, the prompt's block chain
//! and the chain of prompt + generated text are inserted (refreshing
//! existing entries) for that server, so the conversation's next turn
//! matches it; if the record carries a cacheable response, it is stored in
//! the response log as a TTL-stamped entry
//! ([`crate::response_cache::encode_entry`]). A record whose server was
//! retired or re-registered meanwhile teaches nothing about the new
//! registration and is dropped (counted).
//!
//! Dispatchers do not read or tokenize answers: a record carries the answer
//! as the engine sent it and the prompt's last partial block (its
//! continuation), and the response process reads the answer's text
//! ([`crate::openai::answer`]), tokenizes it with the gateway's tokenizer and hashes
//! the chain of prompt + answer ([`Responder::complete`]) before writing it.
//! The answer is tokenized on its own and appended to the prompt's tokens:
//! the pre-tokenizers split where a chat template's text meets the answer
//! (after the generation prompt's newline, or before the answer's leading
//! space), so the next turn's prompt tokenizes alike.
//!
//! The tokenizer has the gateway's shared segment store
//! ([`crate::store::segments`]), so the answer's segments are stored as it is
//! tokenized. A chat answer comes back in the next prompt as an assistant
//! message, framed by the chat template, so the response process also
//! renders it in a conversation (`[user, assistant: answer, user]`) and
//! tokenizes that: the segments around the answer are then the ones the
//! next prompt will have, and the dispatcher that gets the next turn finds
//! them already tokenized.
//!
//! The writes go to the configured store ([`crate::store::WriteBack`]): the
//! segment's tables, or Redis in one pipeline per drained batch.
//!
//! # What the engine reported
//!
//! A record carries what the routing expected the server to hold of the
//! prompt ([`shm_layout::Prediction`]), and the answer carries what the
//! engine found in its prefix cache ([`crate::openai::answer::Reported`]). The
//! response process compares the two ([`Responder::observe`]) and counts
//! them per server (`semlb_prefix_predicted_tokens_total`,
//! `semlb_prefix_confirmed_tokens_total`, `semlb_prefix_shortfalls_total`;
//! `semlb status` shows the accuracy).
//!
//! When an engine reports clearly fewer cached tokens than the table
//! *listed* for its server (two blocks and a quarter of them, at least),
//! it has evicted the deepest listed block. The dispatcher noted when the
//! server itself last refreshed that entry
//! ([`shm_layout::PrefixMatch::refreshed`]), if the server had no request
//! pending then (a pending request's prompt, learned at dispatch, may not
//! be computed yet: a shortfall is then no sign of an eviction); engines evict the least
//! recently used blocks first, so the server's entries refreshed before
//! that second are presumed evicted too. Its **horizon** is raised to it
//! ([`crate::store::WriteBack::demote_before`]) and lookups set its older
//! entries aside (`semlb_prefix_demotions_total{server}`). The entries stay
//! in the table (other servers may share them) until they age out or are
//! refreshed, which brings them back.
//!
//! When an engine reports no cached
//! prompt at all for prompts the table listed it as holding
//! ([`LOST_MIN_LISTED_BLOCKS`] blocks or more) and the server itself
//! refreshed under [`LOST_RECENT_S`] seconds before, while it had nothing
//! pending, [`LOST_IN_A_ROW`] times with no hit in between, its cache was
//! flushed or it restarted: the server is forgotten in every prefix entry
//! at once ([`crate::store::WriteBack::forget_server`]) rather than left
//! to age out, so the next requests are not sent there on the strength of
//! entries it no longer backs. (The prompt of the request that showed it
//! is cached there again: the engine has just computed it, and this record
//! writes it back.) The two conditions keep ordinary evictions out: an
//! engine evicts the least recently used blocks first, so losing what it
//! used seconds ago takes computing a whole cache's worth of tokens in
//! those seconds, and a busy server's miss may be a pending request's
//! prompt not yet computed. A busy engine's restart is seen by the health
//! checker instead (down and up again, or its counters going back).
//!
//! Responder `j` of `m` owns the rings `i` with `i % m == j`
//! ([`rings_for`]); a ring whose producer died mid-record is unblocked with
//! [`shm_layout::CompletionRing::recover`] using the registry's liveness.

pub mod event_loop;

pub use crate::metrics::counts::{Observation, ResponderStats};

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use semlb_tokenizer::Tokenizer;
use semlb_tokenizer::chat::{ChatMessage, ChatTemplate};
use shm_layout::{Completion, Pop, Prediction, ServerRef, Stamp, Tables};

use crate::openai::answer::{AnswerForm, Reported, answer_text, stream_as_response};
use crate::pools::Tokenization;
use crate::prefix::blocks::BlockHasher;
use crate::routing::capacity::{CapacityLearner, Sample};
use crate::store::shm::ShmWriteBack;
use crate::store::{WriteBack, WriteStats};

/// Leading blocks the prefix table must have listed for a server before
/// its engine's report of no cached prompt counts as a lost cache.
pub const LOST_MIN_LISTED_BLOCKS: u32 = 2;

/// Reports of a lost cache with no hit in between from one server after
/// which the server is forgotten in every prefix entry.
pub const LOST_IN_A_ROW: u8 = 2;

/// Seconds within which the server must have refreshed the deepest listed
/// block for a report of nothing cached to count as a lost cache rather
/// than an eviction.
pub const LOST_RECENT_S: u16 = 30;

/// The rings responder `index` of `responders` consumes.
pub fn rings_for(index: usize, responders: usize, ring_count: usize) -> impl Iterator<Item = usize> {
    (0..ring_count).filter(move |i| responders > 0 && i % responders == index)
}

/// Whether `cached` tokens fall clearly short of `expected`: by two blocks
/// and a quarter of what was expected, at least.
fn clearly_short(expected: u64, cached: u64, block: u64) -> bool {
    expected.saturating_sub(cached) >= (2 * block).max(expected / 4)
}

impl ResponderStats {
    /// Adds what a store's write did.
    fn add(&mut self, w: &WriteStats) {
        self.records += w.records;
        self.blocks += w.blocks;
        self.responses_stored += w.responses_stored;
        self.responses_too_large += w.responses_too_large;
        self.writeback_failures += w.writeback_failures;
        self.writeback_dropped += w.writeback_dropped;
        self.evictions += w.evictions;
    }
}

/// Gives the tokenization of a model pool by its id (`None`: unknown).
pub type ModelTokenizers<'a> = Box<dyn FnMut(u64) -> Option<Tokenization> + 'a>;

/// [`ModelTokenizers`], in a responder.
struct TokenizerSource<'a>(ModelTokenizers<'a>);

impl std::fmt::Debug for TokenizerSource<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenizerSource")
    }
}

/// How long a responder waits before asking again for a tokenizer id it
/// was not given.
pub const RETRY_UNKNOWN_TOKENIZER: Duration = Duration::from_secs(5);

/// A response process's write-back: it reads the segment's rings and server
/// table and writes into a store ([`crate::store::WriteBack`]).
#[derive(Debug)]
pub struct Responder<'a> {
    tables: Tables<'a>,
    sink: Box<dyn WriteBack + 'a>,
    tokenizer: Tokenizer,
    template: Option<Arc<ChatTemplate>>,
    /// Where the tokenizers of model pools come from, by id (see
    /// [`with_model_tokenizers`](Self::with_model_tokenizers)).
    model_tokenizers: Option<TokenizerSource<'a>>,
    /// Those found, and when an id was last looked for in vain.
    found: HashMap<u64, Result<Tokenization, Instant>>,
    buf: Vec<u8>,
    tokens: Vec<u32>,
    batch: Vec<Completion>,
    stats: ResponderStats,
    /// Observations not yet taken by [`take_observations`](Self::take_observations).
    observations: Vec<Observation>,
    /// Per server slot: its generation and its lost-cache reports in a row.
    lost: Vec<(u32, u8)>,
    /// Whether a lost cache makes the server forgotten (else only counted).
    forgets: bool,
    /// Learns each server's admission limit from the records' timings.
    capacity: CapacityLearner,
}

impl<'a> Responder<'a> {
    /// A responder writing into `tables` (the shm store), tokenizing answers
    /// with `tokenizer` (the dispatchers' tokenizer).
    pub fn new(tables: Tables<'a>, tokenizer: Tokenizer) -> Self {
        Self::with_sink(tables, Box::new(ShmWriteBack::new(tables)), tokenizer)
    }

    /// A responder draining `tables`' rings into `sink`.
    pub fn with_sink(tables: Tables<'a>, sink: Box<dyn WriteBack + 'a>, tokenizer: Tokenizer) -> Self {
        Self {
            tables,
            sink,
            tokenizer,
            template: None,
            model_tokenizers: None,
            found: HashMap::new(),
            buf: Vec::new(),
            tokens: Vec::new(),
            batch: Vec::new(),
            stats: ResponderStats::default(),
            observations: Vec::new(),
            lost: vec![(0, 0); shm_layout::SERVER_SLOTS as usize],
            forgets: true,
            capacity: CapacityLearner::new(),
        }
    }

    /// Whether engines' reports are acted on: a server whose engine evicted
    /// listed blocks is demoted, one whose engine lost its cache forgotten
    /// (`learn_from_reports`; default true); else they are only counted.
    pub fn forgetting(mut self, forgets: bool) -> Self {
        self.forgets = forgets;
        self
    }

    /// The observations made since the last call (the response process's
    /// loop counts them per server: `crate::metrics::Metrics::prediction`).
    pub fn take_observations(&mut self) -> std::vec::Drain<'_, Observation> {
        self.observations.drain(..)
    }

    /// Renders chat answers with `template` to store their segments as the
    /// next prompt will have them (see the module docs).
    pub fn with_chat_template(mut self, template: impl Into<Arc<ChatTemplate>>) -> Self {
        self.template = Some(template.into());
        self
    }

    /// Reads the answers of model pools with their own tokenizer (records
    /// name it by [`crate::pools::Tokenization::id`]) with what `source`
    /// gives for the id; an id it does not know (a pool a reload added
    /// that this process has not seen yet) is asked again at most every
    /// [`RETRY_UNKNOWN_TOKENIZER`], and its records meanwhile extend no
    /// chain (counted as `unreadable_answers`).
    pub fn with_model_tokenizers(mut self, source: ModelTokenizers<'a>) -> Self {
        self.model_tokenizers = Some(TokenizerSource(source));
        self
    }

    /// The tokenizer and template of tokenization `id` (0: the global one).
    fn tokenization(&mut self, id: u64) -> Option<(Tokenizer, Option<Arc<ChatTemplate>>)> {
        if id == 0 {
            return Some((self.tokenizer.clone(), self.template.clone()));
        }
        let retry = match self.found.get(&id) {
            Some(Ok(t)) => return Some((t.tokenizer.clone(), Some(t.template.clone()))),
            Some(Err(at)) => at.elapsed() >= RETRY_UNKNOWN_TOKENIZER,
            None => true,
        };
        if !retry {
            return None;
        }
        let found = self.model_tokenizers.as_mut().and_then(|source| (source.0)(id));
        let answer = found.as_ref().map(|t| (t.tokenizer.clone(), Some(t.template.clone())));
        self.found.insert(id, found.ok_or_else(Instant::now));
        answer
    }

    /// Computes `record`'s chain of prompt + answer from its continuation,
    /// if it has one: the answer's text read out of the bytes the
    /// dispatcher forwarded ([`crate::openai::answer`]), its tokens appended to the
    /// prompt's last partial block, hashed on from the prompt's chain. A
    /// record without an output token count gets the engine's
    /// (`usage.completion_tokens`) or else the answer's. Then the record's
    /// prediction is compared with the engine's report
    /// ([`observe`](Self::observe)) and its timing adjusts the server's
    /// admission limit ([`crate::routing::capacity`]).
    pub fn complete(&mut self, record: &mut Completion, now_ms: u64) {
        let reported = self.extend_chain(record);
        Self::response_from_stream(record);
        self.observe(record, now_ms);
        self.learn_capacity(record, &reported);
    }

    /// Adjusts the admission limit of `record`'s server from its timing
    /// and what the engine reported.
    fn learn_capacity(&mut self, record: &Completion, reported: &Reported) {
        let (Some(server), Some(timing)) = (record.server, record.timing) else {
            return;
        };
        if self.tables.servers.engine_slots(server).is_some() {
            // Its engine said how many it runs: nothing to learn.
            return;
        }
        let Some(sample) = Sample::of(&timing, record.output_tokens, reported.decode_us) else {
            return;
        };
        if self.capacity.observe(&self.tables.servers, server, &sample).is_some() {
            self.stats.capacity_samples += 1;
        }
    }

    /// Compares what the routing predicted of `record`'s server with the
    /// cached prompt tokens its engine reported, counts both, sets the
    /// server's older entries aside when its engine evicted what the table
    /// listed, and forgets the server everywhere when its cache was lost
    /// (see the module docs). `now_ms` is segment time.
    pub fn observe(&mut self, record: &Completion, now_ms: u64) {
        let (Some(p), Some(server)) = (record.prediction, record.server) else {
            return;
        };
        let Some(cached) = p.cached_tokens else { return };
        self.stats.observed += 1;
        let block = u64::from(p.block_size.max(1));
        let predicted = u64::from(p.predicted_blocks) * block;
        let cached = u64::from(cached);
        let demoted = self.demote(server, &p, cached, now_ms);
        self.observations.push(Observation {
            slot: server.slot,
            predicted,
            cached,
            short: clearly_short(predicted, cached, block),
            demoted,
        });
        let Some(lost) = self.lost.get_mut(usize::from(server.slot)) else {
            return;
        };
        if lost.0 != server.generation {
            *lost = (server.generation, 0);
        }
        if cached >= block {
            lost.1 = 0;
            return;
        }
        let recent = p
            .refreshed
            .is_some_and(|r| r.age(Stamp((now_ms / 1000) as u16)) < LOST_RECENT_S);
        if p.listed_blocks < LOST_MIN_LISTED_BLOCKS || !recent {
            return;
        }
        lost.1 += 1;
        if lost.1 < LOST_IN_A_ROW {
            return;
        }
        lost.1 = 0;
        if !self.forgets {
            return;
        }
        let forgotten = self.sink.forget_server(server);
        self.stats.forgotten_servers += 1;
        tracing::warn!(
            server_slot = server.slot,
            entries = forgotten,
            "server slot {}: its engine reported no cached prompt {LOST_IN_A_ROW} times with no hit in between, for prompts the prefix table listed it as holding and it had used seconds before: its cache was lost (flushed or restarted), so it is forgotten in {forgotten} prefix entries",
            server.slot
        );
    }

    /// The engine found clearly fewer of the prompt's tokens than the
    /// table *listed* for its server (not counting a continued
    /// conversation's credit): it evicted the deepest listed block, which
    /// the server itself last refreshed at `p.refreshed`. Engines evict
    /// the least recently used blocks first, so the server's entries
    /// refreshed before that second are presumed evicted too: its horizon
    /// is raised to it and lookups set them aside. Returns whether it moved.
    fn demote(&mut self, server: ServerRef, p: &Prediction, cached: u64, now_ms: u64) -> bool {
        let block = u64::from(p.block_size.max(1));
        let listed = u64::from(p.listed_blocks) * block;
        let Some(refreshed) = p
            .refreshed
            .filter(|_| self.forgets && clearly_short(listed, cached, block))
        else {
            return false;
        };
        let now_s = now_ms / 1000;
        let at_s = now_s.saturating_sub(u64::from(refreshed.age(Stamp(now_s as u16))));
        let demoted = self
            .sink
            .demote_before(server, u32::try_from(at_s).unwrap_or(u32::MAX), now_ms);
        self.stats.demotions += u64::from(demoted);
        demoted
    }

    /// A cacheable answer that came as an event stream is stored as the
    /// JSON response it stands for ([`stream_as_response`]), under the same
    /// key and bounds as a JSON answer: a later request gets it as JSON, or
    /// replayed as SSE if it streams. A stream that no JSON body stands for
    /// exactly (cut short, tool calls, ...) is not cached.
    fn response_from_stream(record: &mut Completion) {
        let Some(c) = record.continuation.as_ref() else {
            return;
        };
        let Some((AnswerForm::EventStream, chat)) = AnswerForm::from_byte(c.form) else {
            return;
        };
        if record.response_key.is_none() {
            return;
        }
        match stream_as_response(chat, &record.response) {
            Some(body) => record.response = body,
            None => {
                record.response_key = None;
                record.response.clear();
            }
        }
    }

    /// The chain of prompt + answer (see [`complete`](Self::complete));
    /// returns what the engine reported with the answer.
    fn extend_chain(&mut self, record: &mut Completion) -> Reported {
        let Some(c) = record.continuation.as_ref() else {
            return Reported::default();
        };
        let (Ok(block_size), Some((form, chat))) = (usize::try_from(c.block_size), AnswerForm::from_byte(c.form))
        else {
            return Reported::default();
        };
        let bytes = if c.answer_is_response {
            &record.response
        } else {
            &c.answer
        };
        let Some((text, reported)) = answer_text(form, bytes).filter(|_| block_size > 0) else {
            self.stats.unreadable_answers += 1;
            return Reported::default();
        };
        let tokenizer_id = c.tokenizer;
        let Some((tokenizer, template)) = self.tokenization(tokenizer_id) else {
            self.stats.unreadable_answers += 1;
            return Reported::default();
        };
        if let Some(p) = record.prediction.as_mut().filter(|p| p.cached_tokens.is_none()) {
            p.cached_tokens = reported.cached_tokens_u32();
        }
        self.tokens.clear();
        self.tokens.extend_from_slice(&c.tail);
        tokenizer.encode_into(&text, &mut self.tokens);
        let answer_tokens = self.tokens.len() - c.tail.len();
        record.full_blocks.clear();
        record.full_blocks.extend_from_slice(&record.prompt_blocks);
        BlockHasher::new(c.root, block_size).append(&self.tokens, &mut record.full_blocks);
        if record.output_tokens == 0 {
            let count = reported.completion_tokens.unwrap_or(answer_tokens as u64);
            record.output_tokens = u32::try_from(count).unwrap_or(u32::MAX);
        }
        self.stats.answers_tokenized += 1;
        self.stats.answer_tokens += answer_tokens as u64;
        if chat && let Some(template) = &template {
            // The answer framed as the next prompt will frame it; only the
            // segments the tokenizer stores matter here, not the ids.
            let conversation = [
                ChatMessage::new("user", "."),
                ChatMessage::new("assistant", text.as_str()),
                ChatMessage::new("user", "."),
            ];
            if let Ok(rendered) = template.render(&conversation) {
                self.tokens.clear();
                tokenizer.encode_into(&rendered, &mut self.tokens);
            }
        }
        reported
    }

    /// Counters so far.
    pub fn stats(&self) -> ResponderStats {
        self.stats
    }

    /// Whether `record`'s server registration is still current (counted
    /// when not).
    fn current(&mut self, record: &Completion) -> bool {
        let current = record.server.is_some_and(|server| {
            self.tables
                .servers
                .current(server.slot)
                .is_some_and(|(s, _)| s == server)
        });
        if !current {
            self.stats.stale_server += 1;
        }
        current
    }

    /// Applies one decoded record at prefix stamp `now` and segment time
    /// `now_ms`. Returns false if it was dropped as stale.
    pub fn apply(&mut self, record: &mut Completion, now: Stamp, now_ms: u64) -> bool {
        if !self.current(record) {
            return false;
        }
        self.complete(record, now_ms);
        let mut written = WriteStats::default();
        self.sink.write(std::slice::from_ref(record), now, now_ms, &mut written);
        self.stats.add(&written);
        true
    }

    /// Pops every committed record of ring `ring`, stepping over
    /// reservations whose producer is gone (`is_alive(slot, incarnation)`
    /// is the registry's liveness), and writes those whose server is
    /// current as one batch. Returns the number of records taken.
    pub fn drain(&mut self, ring: usize, now: Stamp, now_ms: u64, is_alive: impl Fn(u16, u32) -> bool) -> usize {
        let ring = self.tables.ring(ring);
        let mut taken = 0;
        let mut len = 0;
        loop {
            match ring.pop(&mut self.buf) {
                Pop::Record => {
                    if self.batch.len() == len {
                        self.batch.push(Completion::default());
                    }
                    let mut record = std::mem::take(&mut self.batch[len]);
                    match record.decode_from(&self.buf) {
                        Ok(()) if self.current(&record) => {
                            self.complete(&mut record, now_ms);
                            taken += 1;
                            self.batch[len] = record;
                            len += 1;
                            continue;
                        }
                        Ok(()) => {}
                        Err(_) => self.stats.undecodable += 1,
                    }
                    self.batch[len] = record;
                }
                Pop::Empty => break,
                Pop::Pending => {
                    if !ring.recover(&is_alive) {
                        break;
                    }
                    self.stats.recovered += 1;
                }
            }
        }
        let mut written = WriteStats::default();
        self.sink.write(&self.batch[..len], now, now_ms, &mut written);
        self.stats.add(&written);
        taken
    }
}

#[cfg(test)]
mod tests {
    use shm_layout::{CompletionRecord, LayoutPlan, ResponseKey, Segment};

    use super::*;
    use crate::response_cache::fresh_body;
    use shm_layout::{Prediction, ServerRef};

    fn segment() -> Segment {
        Segment::heap(&LayoutPlan::for_size(8 << 20).unwrap())
    }

    #[test]
    fn ring_assignment_partitions_the_rings() {
        let all: Vec<usize> = (0..3).flat_map(|j| rings_for(j, 3, 64)).collect();
        let mut sorted = all.clone();
        sorted.sort();
        assert_eq!(sorted, (0..64).collect::<Vec<_>>());
        assert_eq!(rings_for(0, 1, 4).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        assert_eq!(rings_for(0, 0, 4).count(), 0);
    }

    #[test]
    fn a_record_warms_prompt_and_answer_and_caches_the_response() {
        let seg = segment();
        let t = seg.tables();
        let server = t.servers.register(1, "http://a", 0).unwrap();
        // Spread like real chain hashes (small integers would share a bucket).
        let h = |i: u64| i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let prompt = [h(11), h(12), h(13)];
        let full = [h(11), h(12), h(13), h(14), h(15)];
        let rec = CompletionRecord {
            server,
            prompt_tokens: 50,
            output_tokens: 40,
            prompt_blocks: &prompt,
            full_blocks: &full,
            continuation: None,
            response: Some((ResponseKey(9), b"{\"ok\":true}")),
            prediction: None,
            timing: None,
        };
        let mut buf = Vec::new();
        rec.encode_into(&mut buf);
        t.ring(2).push(&buf).unwrap();
        let mut r = Responder::new(t, Tokenizer::bundled());
        assert_eq!(r.drain(2, Stamp(5), 1_000, |_, _| true), 1);
        let m = t.prefix.longest_prefix_match(&full, |s| t.servers.is_live(s));
        assert_eq!(
            m.best(),
            Some((server.tag(), 5)),
            "the next turn matches prompt + answer"
        );
        let entry = t.responses.get(ResponseKey(9)).unwrap();
        assert_eq!(fresh_body(&entry, 1_100, 300_000), Some(&b"{\"ok\":true}"[..]));
        assert_eq!(
            r.stats(),
            ResponderStats {
                records: 1,
                blocks: 5,
                responses_stored: 1,
                ..Default::default()
            }
        );
    }

    /// What engines report is counted against the prediction, and a server
    /// whose engine reports no cached prompt for prompts the table listed
    /// and it used seconds before, twice, is forgotten everywhere; a hit in
    /// between resets the count, and a miss on what it used long ago (an
    /// eviction) or while it was busy (maybe not computed yet) counts
    /// nothing.
    #[test]
    fn an_engine_that_lost_its_cache_is_forgotten_after_two_reports() {
        let seg = segment();
        let t = seg.tables();
        let (a, b) = (
            t.servers.register(1, "http://a", 0).unwrap(),
            t.servers.register(2, "http://b", 0).unwrap(),
        );
        let h = |i: u64| i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let (other, shared) = ([h(50), h(51)], [h(60), h(61)]);
        for s in [a, b] {
            t.prefix.insert_chain(&shared, s, Stamp(1));
        }
        t.prefix.insert_chain(&other, a, Stamp(1));
        let mut r = Responder::new(t, Tokenizer::bundled());
        // Segment time 100 s; the deepest listed block was refreshed at
        // second 95 (`recent`), at second 40 (long ago) or while the server
        // was busy (unknown).
        const NOW_MS: u64 = 100_000;
        let with = |server, listed: u32, cached: Option<u32>, refreshed: Option<u16>| Completion {
            server: Some(server),
            prediction: Some(Prediction {
                block_size: 16,
                predicted_blocks: listed,
                listed_blocks: listed,
                refreshed: refreshed.map(Stamp),
                cached_tokens: cached,
            }),
            ..Completion::default()
        };
        let report = |server, listed, cached| with(server, listed, cached, Some(95));
        let listed_for = |s: ServerRef| t.prefix.entries().filter(|(_, e)| e.servers.contains(s.tag())).count();
        // A hit, a report of nothing cached, a hit: no loss.
        for cached in [Some(64), Some(0), Some(48), None] {
            r.observe(&report(a, 4, cached), NOW_MS);
        }
        // Nothing cached of one listed block: not evidence enough. Nothing
        // cached of blocks used long ago, or while busy: evictions, maybe.
        r.observe(&report(a, 1, Some(0)), NOW_MS);
        r.observe(&report(a, 1, Some(0)), NOW_MS);
        for refreshed in [Some(40), None, Some(40), None] {
            r.observe(&with(a, 3, Some(0), refreshed), NOW_MS);
        }
        assert_eq!((r.stats().forgotten_servers, listed_for(a)), (0, 4));
        // Twice with no hit in between: the cache is lost.
        r.observe(&report(a, 3, Some(0)), NOW_MS);
        r.observe(&with(a, 3, Some(0), None), NOW_MS);
        assert_eq!((r.stats().forgotten_servers, listed_for(a)), (0, 4));
        r.observe(&report(a, 3, Some(0)), NOW_MS);
        assert_eq!((r.stats().forgotten_servers, listed_for(a)), (1, 0));
        assert_eq!(listed_for(b), 2, "the other server keeps its entries");
        assert_eq!(r.stats().observed, 12);
        let seen: Vec<Observation> = r.take_observations().collect();
        assert!(seen.iter().all(|o| o.slot == a.slot));
        let sum = |f: fn(&Observation) -> u64| seen.iter().map(f).sum::<u64>();
        assert_eq!(sum(|o| o.predicted), 16 * (4 * 3 + 2 + 3 * 7));
        assert_eq!(sum(|o| o.cached), 64 + 48);
        assert_eq!(seen.iter().filter(|o| o.short).count(), 8);
        assert_eq!(r.take_observations().count(), 0, "taken once");
        // With `learn_from_reports = false` the reports are only counted.
        t.prefix.insert_chain(&other, a, Stamp(2));
        let mut counting = Responder::new(t, Tokenizer::bundled()).forgetting(false);
        for _ in 0..3 {
            counting.observe(&report(a, 3, Some(0)), NOW_MS);
        }
        assert_eq!((counting.stats().forgotten_servers, listed_for(a)), (0, 2));
        assert_eq!(counting.take_observations().filter(|o| o.short).count(), 3);
    }

    /// An engine that found clearly fewer tokens than the table listed
    /// evicted the deepest listed block: the server's horizon moves to when
    /// it last refreshed that block, and only then.
    #[test]
    fn a_shortfall_on_listed_blocks_raises_the_servers_horizon() {
        let seg = segment();
        let t = seg.tables();
        let a = t.servers.register(1, "http://a", 0).unwrap();
        let report = |predicted: u32, listed: u32, refreshed: u16, cached: u32| Completion {
            server: Some(a),
            prediction: Some(Prediction {
                block_size: 16,
                predicted_blocks: predicted,
                listed_blocks: listed,
                refreshed: Some(Stamp(refreshed)),
                cached_tokens: Some(cached),
            }),
            ..Completion::default()
        };
        let now_ms = 100_000;
        let mut r = Responder::new(t, Tokenizer::bundled());
        // Short of the prediction, but only of a continued conversation's
        // credit: the listed blocks were all found.
        r.observe(&report(8, 4, 40, 64), now_ms);
        // Short by one block: not clear.
        r.observe(&report(6, 6, 40, 80), now_ms);
        assert_eq!((t.servers.horizon(a), r.stats().demotions), (None, 0));
        // Short by four of six listed blocks, without the switch: counted only.
        let mut counting = Responder::new(t, Tokenizer::bundled()).forgetting(false);
        counting.observe(&report(6, 6, 40, 32), now_ms);
        assert!(counting.take_observations().all(|o| o.short && !o.demoted));
        assert_eq!(t.servers.horizon(a), None);
        // With it: the horizon is second 40, entries up to 60 s old count.
        r.observe(&report(6, 6, 40, 32), now_ms);
        assert_eq!((t.servers.horizon(a), r.stats().demotions), (Some(40), 1));
        assert_eq!(t.servers.entry_max_age(a.tag(), 100), Some(60));
        // An eviction seen of an older refresh does not move it back; the
        // stamps wrap (second 65_600 is stamp 64).
        r.observe(&report(6, 6, 30, 0), now_ms);
        assert_eq!(t.servers.horizon(a), Some(40));
        r.observe(&report(6, 6, 50, 0), 65_600_000);
        assert_eq!(t.servers.horizon(a), Some(65_600 - (64 - 50)));
        let seen: Vec<Observation> = r.take_observations().collect();
        assert_eq!(seen.iter().filter(|o| o.demoted).count(), 2);
        assert_eq!(seen.iter().filter(|o| o.short).count(), 4);
    }

    /// Pushes into ring 0 the record of an answer to a prompt of
    /// `prompt_tokens` whose chain is `prompt_blocks`, to be extended from
    /// `continuation`.
    fn push_answer(
        t: Tables<'_>,
        server: ServerRef,
        prompt_tokens: u32,
        prompt_blocks: &[u64],
        continuation: shm_layout::ContinuationRef<'_>,
    ) {
        let rec = CompletionRecord {
            server,
            prompt_tokens,
            output_tokens: 0,
            prompt_blocks,
            full_blocks: &[],
            continuation: Some(continuation),
            response: None,
            prediction: None,
            timing: None,
        };
        let mut buf = Vec::new();
        rec.encode_into(&mut buf);
        t.ring(0).push(&buf).unwrap();
    }

    /// A record with a continuation teaches the chain of the prompt's
    /// tokens followed by the answer's, as if the dispatcher had hashed it.
    #[test]
    fn a_continuation_is_tokenized_and_hashed_into_the_full_chain() {
        use shm_layout::ContinuationRef;
        let seg = segment();
        let t = seg.tables();
        let server = t.servers.register(1, "http://a", 0).unwrap();
        let tok = Tokenizer::bundled();
        let hasher = BlockHasher::new(BlockHasher::root_for("m", 9), 16);
        let prompt = tok.encode(&"The prompt of this conversation, long enough for a few blocks. ".repeat(3));
        let answer = " and the answer that the engine generated for it goes on for a while too.";
        let mut prompt_chain = Vec::new();
        hasher.chain(&prompt, &mut prompt_chain);
        let mut all = prompt.clone();
        all.extend(tok.encode(answer));
        let mut want = Vec::new();
        hasher.chain(&all, &mut want);
        assert!(want.len() > prompt_chain.len());
        let tail = &prompt[prompt_chain.len() * 16..];
        let continuation = ContinuationRef {
            root: hasher.root(),
            block_size: 16,
            tokenizer: 0,
            tail,
            form: AnswerForm::Text.to_byte(false),
            answer: Some(answer.as_bytes()),
        };
        push_answer(t, server, prompt.len() as u32, &prompt_chain, continuation);
        let mut r = Responder::new(t, tok.clone());
        assert_eq!(r.drain(0, Stamp(1), 0, |_, _| true), 1);
        let m = t.prefix.longest_prefix_match(&want, |s| t.servers.is_live(s));
        assert_eq!(m.best(), Some((server.tag(), want.len() as u32)));
        assert_eq!(r.stats().answers_tokenized, 1);
        assert_eq!(r.stats().answer_tokens, tok.encode(answer).len() as u64);
    }

    /// A record of a model pool with its own tokenizer is read with that
    /// one (given by the source, asked once); an id the source does not
    /// know extends no chain and is not asked again at once.
    #[test]
    fn a_pools_answers_are_read_with_its_tokenizer() {
        use shm_layout::ContinuationRef;
        let seg = segment();
        let t = seg.tables();
        let server = t.servers.register(1, "http://a", 0).unwrap();
        let bundled = Tokenizer::bundled();
        // Every byte a token: the same text, other ids and more of them.
        let mut json: serde_json::Value = serde_json::from_slice(semlb_tokenizer::BUNDLED_JSON).unwrap();
        json["model"]["merges"] = serde_json::json!([]);
        let bytes = Tokenizer::from_json(&serde_json::to_vec(&json).unwrap(), "bytes").unwrap();
        let answer = " an answer of the pool's model";
        assert_ne!(bytes.encode(answer), bundled.encode(answer));
        let hasher = BlockHasher::new(BlockHasher::root_for("pool", 3), 4);
        let push = |tokenizer: u64| {
            let continuation = ContinuationRef {
                root: hasher.root(),
                block_size: 4,
                tokenizer,
                tail: &[1, 2],
                form: AnswerForm::Text.to_byte(false),
                answer: Some(answer.as_bytes()),
            };
            push_answer(t, server, 2, &[], continuation);
        };
        let asked = std::cell::RefCell::new(Vec::new());
        let tokenization = Tokenization {
            id: 77,
            name: "bytes".into(),
            tokenizer: bytes.clone(),
            template: Arc::new(ChatTemplate::canonical()),
        };
        let mut r = Responder::new(t, bundled).with_model_tokenizers(Box::new(|id| {
            asked.borrow_mut().push(id);
            (id == 77).then(|| tokenization.clone())
        }));
        push(77);
        push(77);
        push(78);
        push(78);
        assert_eq!(r.drain(0, Stamp(1), 0, |_, _| true), 4);
        let mut tokens = vec![1, 2];
        tokens.extend(bytes.encode(answer));
        let mut want = Vec::new();
        hasher.chain(&tokens, &mut want);
        let m = t.prefix.longest_prefix_match(&want, |s| t.servers.is_live(s));
        assert_eq!(m.best(), Some((server.tag(), want.len() as u32)));
        let stats = r.stats();
        assert_eq!((stats.answers_tokenized, stats.unreadable_answers), (2, 2));
        assert_eq!(stats.answer_tokens, 2 * bytes.encode(answer).len() as u64);
        assert_eq!(*asked.borrow(), [77, 78], "each id asked once");
    }

    #[test]
    fn stale_servers_and_garbage_teach_nothing() {
        let seg = segment();
        let t = seg.tables();
        let old = t.servers.register(1, "http://a", 0).unwrap();
        t.servers.retire(old);
        let new = t.servers.register(2, "http://b", 0).unwrap();
        assert_eq!(new.slot, old.slot);
        let rec = CompletionRecord {
            server: old,
            prompt_tokens: 1,
            output_tokens: 1,
            prompt_blocks: &[1, 2],
            full_blocks: &[1, 2, 3],
            continuation: None,
            response: None,
            prediction: None,
            timing: None,
        };
        let mut buf = Vec::new();
        rec.encode_into(&mut buf);
        t.ring(0).push(&buf).unwrap();
        t.ring(0).push(b"not a record").unwrap();
        let mut r = Responder::new(t, Tokenizer::bundled());
        assert_eq!(r.drain(0, Stamp(1), 0, |_, _| true), 0);
        assert_eq!(t.prefix.lookup(1), None, "the new registration inherits nothing");
        assert_eq!(r.stats().stale_server, 1);
        assert_eq!(r.stats().undecodable, 1);
    }

    #[test]
    fn a_dead_producers_hole_is_stepped_over() {
        let seg = segment();
        let t = seg.tables();
        let server = t.servers.register(1, "http://a", 0).unwrap();
        let ring = t.ring(1);
        ring.set_owner(7, 1);
        let rec = CompletionRecord {
            server,
            prompt_tokens: 1,
            output_tokens: 1,
            prompt_blocks: &[21],
            full_blocks: &[21],
            continuation: None,
            response: None,
            prediction: None,
            timing: None,
        };
        let mut buf = Vec::new();
        rec.encode_into(&mut buf);
        ring.push(&buf).unwrap();
        // Kill the commit word of the first record: its producer died mid-push.
        let rings = seg.header().region(shm_layout::RegionKind::Rings);
        let word = ((rings.offset + (rings.param + 256) + 256) / 8) as usize;
        seg.raw_words()[word].store(0, std::sync::atomic::Ordering::Relaxed);
        ring.push(&buf).unwrap();
        let mut r = Responder::new(t, Tokenizer::bundled());
        assert_eq!(
            r.drain(1, Stamp(1), 0, |_, _| true),
            0,
            "a live owner's pending record is waited for"
        );
        assert_eq!(r.drain(1, Stamp(1), 0, |_, _| false), 1);
        assert_eq!(r.stats().recovered, 1);
        assert!(t.prefix.lookup(21).is_some());
    }
}
