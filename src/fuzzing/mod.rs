//! The bodies of the fuzz targets (`tests/fuzz`, run with `cargo fuzz`):
//! each takes arbitrary bytes, feeds them to one parser of untrusted input,
//! and panics only when that parser breaks a property it promises. The
//! corpus replay test (`tests/fuzz_corpus.rs`) runs the committed corpus
//! through the same functions on every `cargo test`, so what fuzzing found
//! stays tested without a nightly toolchain.
//!
//! | target | input | properties checked beyond "no panic" |
//! |---|---|---|
//! | [`request`] | a request body (endpoint and template from byte 0) | a refusal is a 4xx; an accepted body re-serialises, tokenizes and keys |
//! | [`event_stream`] | an engine's answer (SSE or JSON) | reading it and stripping usage give the same result however it is split |
//! | [`config`] | a TOML config | none (errors are values) |
//! | [`segment_file`] | a shm segment file: arbitrary, or a real one with bytes overwritten | open either refuses it or yields tables whose per-request reads and writes do not panic |
//! | [`segment_scan`] | a real shm segment with bytes overwritten | whole-table scans (`shm inspect`, `/metrics`, the supervisor's) and a dead process's counts taken back do not panic |
//! | [`completion`] | a completion record | a decoded record re-encodes to one that decodes the same |
//! | [`response_log`] | overwrites of a response cache holding known values | a read returns the value put under that key, or nothing |
//! | [`zmtp`] | a ZMTP peer's bytes (socket type from byte 0) | frames hold no more than arrived, reading holds a bounded multiple of it, messages sent again read back the same |
//! | [`kv_batch`] | a KV event batch (msgpack) | decoding holds a bounded multiple of the input; a batch written in each of vLLM's layouts decodes to itself |
//! | [`prometheus`] | an engine's `/metrics` text | a sample written again parses to itself; load figures are in range |
//! | [`redis_reply`] | Redis replies in a row (chunk size from byte 0) | those read whole read the same in pieces; the store's reply parsers give sorted, consistent answers; a checksummed value unseals only to what was sealed |
//! | [`peer_summary`] | a peer's load summary, after a few book operations | a summary re-serialises to itself; the book forwards only to a peer with room for the model |
//! | [`admin_body`] | an admin API body (server or pool, POST or PUT from byte 0) | a server's address normalises to itself; a pool the gateway takes is saved and read back as the same pool |
//! | [`key_headers`] | a request's key headers (`\x01`, `\x02` stand for two known keys) | the caller and the tenant do not depend on the headers' order; a key is let in only if it is the one presented |
//! | [`body_rewrite`] | a request body (pool name and salt from byte 0) | the `model`, `stream_options` and `cache_salt` rewrites change that member and nothing else |
//! | [`usage_strip`] | an event stream and where it is cut | usage stripping gives the same bytes however the stream is cut; a stream without usage passes as it is |
//!
//! The bodies live by where their input comes from: `engine` (its ZMTP
//! connection, KV event batches, `/metrics`), `remote` (Redis, peer
//! gateways), `client` (admin bodies, key headers, the body rewrites, the
//! usage stripper), `shm` (the segment, kept fast by a private copy of one
//! image per target) and this file (the first ones).
//!
//! Targets whose parser could be made to allocate from a size it reads
//! (`zmtp`, `kv_batch`, `redis_reply`) check how much it held at once
//! ([`peak_allocation`]) when the binary installs [`CountingAlloc`] as its
//! global allocator (their fuzz binaries and `tests/fuzz_corpus.rs` do).

mod client;
mod engine;
mod remote;
mod shm;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::Path;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Waker};

pub use client::{admin_body, body_rewrite, key_headers, usage_strip};
pub use engine::{kv_batch, prometheus, zmtp};
pub use remote::{peer_summary, redis_reply};
pub use shm::{remove_shm_files, response_log, segment_file, segment_scan};

use semlb_tokenizer::Tokenizer;
use semlb_tokenizer::chat::ChatTemplate;
use shm_layout::{Completion, CompletionRecord, ContinuationRef};

use crate::config::ServeConfig;
use crate::dispatcher::{UsageStrip, replay};
use crate::openai::answer::{self, AnswerForm, EventStreamText};
use crate::openai::prompt::{self, Endpoint, RequestLimits};
use crate::response_cache::{self, Tenant};

/// A ChatML template in Jinja, as real models ship them (the canonical
/// renderer is the other choice).
const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + \
                      '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% \
                      endif %}";

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(Tokenizer::bundled)
}

fn templates() -> &'static [ChatTemplate; 2] {
    static T: OnceLock<[ChatTemplate; 2]> = OnceLock::new();
    T.get_or_init(|| {
        [
            ChatTemplate::canonical(),
            ChatTemplate::from_source(CHATML, None, None).expect("the ChatML template compiles"),
        ]
    })
}

/// The system allocator, counting the bytes each thread holds, for
/// [`peak_allocation`]: a fuzz binary installs it with
/// `#[global_allocator] static A: CountingAlloc = CountingAlloc;`.
#[derive(Debug, Clone, Copy, Default)]
pub struct CountingAlloc;

/// Whether [`CountingAlloc`] is the global allocator (it has counted).
static COUNTING: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// Bytes this thread allocated less those it freed (below zero when
    /// it frees what other threads allocated).
    static HELD: Cell<isize> = const { Cell::new(0) };
    /// The most [`HELD`] reached since [`peak_allocation`] reset it.
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

impl CountingAlloc {
    /// Counts `grown` more bytes held and `shrunk` fewer.
    fn count(grown: usize, shrunk: usize) {
        COUNTING.store(true, Ordering::Relaxed);
        // `try_with`: a thread being torn down has no counters left.
        let _ = HELD.try_with(|held| {
            let now = held.get().wrapping_add_unsigned(grown).wrapping_sub_unsigned(shrunk);
            held.set(now);
            let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
        });
    }
}

// SAFETY: every call is passed to `System` unchanged; the counting touches
// only const-initialised thread-locals, which never allocate.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is `System`'s.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            Self::count(layout.size(), 0);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is `System`'s.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            Self::count(layout.size(), 0);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract is `System`'s.
        unsafe { System.dealloc(ptr, layout) };
        Self::count(0, layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract is `System`'s.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            Self::count(new_size, layout.size());
        }
        p
    }
}

/// Runs `f` and says how many bytes more than at its start this thread
/// held at most while it ran; `None` unless [`CountingAlloc`] is the
/// global allocator.
pub fn peak_allocation<T>(f: impl FnOnce() -> T) -> (T, Option<usize>) {
    let start = HELD.with(Cell::get);
    PEAK.with(|peak| peak.set(start));
    let out = f();
    let peak = PEAK.with(Cell::get);
    let held_most = usize::try_from(peak.wrapping_sub(start)).unwrap_or(0);
    (out, COUNTING.load(Ordering::Relaxed).then_some(held_most))
}

/// Runs `future` on this thread to its end: the targets' futures read and
/// write in-memory streams, which are always ready, so one poll ends them
/// (`None` if one ever is not).
fn block_on<F: Future>(future: F) -> Option<F::Output> {
    let mut future = std::pin::pin!(future);
    match future.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(out) => Some(out),
        Poll::Pending => None,
    }
}

/// Splits `data` at the cut points its first two bytes choose: the chunks
/// a network might deliver it in.
fn chunks(data: &[u8]) -> (Vec<&[u8]>, &[u8]) {
    let (seed, rest) = data.split_at(data.len().min(2));
    let step = 1 + usize::from(seed.first().copied().unwrap_or(0)) % 61;
    let skew = usize::from(seed.get(1).copied().unwrap_or(0));
    let mut out = Vec::new();
    let mut at = 0;
    let mut i = 0;
    while at < rest.len() {
        let len = (step + (skew * i) % 7).min(rest.len() - at);
        out.push(&rest[at..at + len]);
        at += len;
        i += 1;
    }
    (out, rest)
}

/// A request body: byte 0 picks the endpoint (bits 0 and 2: completions,
/// chat, Responses, Messages) and the chat template (bit 1); the rest is
/// the body.
pub fn request(data: &[u8]) {
    let Some((&choice, body)) = data.split_first() else {
        return;
    };
    let endpoint = match (choice & 1, choice >> 2 & 1) {
        (0, 0) => Endpoint::Completions,
        (1, 0) => Endpoint::ChatCompletions,
        (0, _) => Endpoint::Responses,
        _ => Endpoint::Messages,
    };
    let template = &templates()[usize::from(choice >> 1 & 1)];
    let limits = RequestLimits::default();
    match prompt::parse(endpoint, body, template, &limits) {
        Err(e) => {
            assert!(
                e.status.is_client_error(),
                "a refusal must be a 4xx, not {}: {e}",
                e.status
            );
            let _ = e.body().to_string();
        }
        Ok(parsed) => {
            let _ = parsed.body.canonical().len();
            let _ = (parsed.requested_output(), parsed.include_usage(), parsed.prompt_param());
            let _ = prompt::opening(&parsed.body);
            match &parsed.input {
                prompt::RoutingInput::Text(text) => {
                    let ids = tokenizer().encode(text);
                    let _ = tokenizer().decode(&ids);
                }
                prompt::RoutingInput::Tokens(ids) => {
                    let _ = tokenizer().decode(ids);
                }
            }
            let mut headers = http::HeaderMap::new();
            headers.insert("openai-organization", http::HeaderValue::from_static("org-fuzz"));
            let _ = response_cache::key(
                &response_cache::KeySecret::new(7),
                Tenant(7),
                endpoint,
                "a=1",
                &headers,
                &parsed.body,
            );
        }
    }
}

/// An engine's answer: read as an event stream (whole and in chunks),
/// as a JSON body, stripped of usage (whole and in chunks), and replayed
/// from as a stored answer.
pub fn event_stream(data: &[u8]) {
    let (pieces, whole) = chunks(data);

    let mut at_once = EventStreamText::default();
    at_once.feed(whole);
    let mut split = EventStreamText::default();
    for p in &pieces {
        split.feed(p);
    }
    assert_eq!(
        (&at_once.text, at_once.reported, at_once.done, at_once.overflow),
        (&split.text, split.reported, split.done, split.overflow),
        "an event stream reads the same however it is split"
    );

    let mut strip = UsageStrip::default();
    let mut at_once = strip.feed(whole).to_vec();
    at_once.extend_from_slice(&strip.finish());
    let mut strip = UsageStrip::default();
    let mut split = Vec::new();
    for p in &pieces {
        split.extend_from_slice(&strip.feed(p));
    }
    split.extend_from_slice(&strip.finish());
    assert_eq!(
        String::from_utf8_lossy(&at_once),
        String::from_utf8_lossy(&split),
        "usage stripping gives the same bytes however the stream is split"
    );

    for chat in [false, true] {
        if let Some(body) = answer::stream_as_response(chat, whole) {
            let _ = answer::json_answer(&body);
        }
        for form in [AnswerForm::Text, AnswerForm::Json, AnswerForm::EventStream] {
            let _ = answer::answer_text(form, whole);
        }
    }
    let _ = answer::json_answer(whole);
    for endpoint in [Endpoint::Completions, Endpoint::ChatCompletions] {
        if let Some(events) = replay(endpoint, whole, true) {
            let mut read = EventStreamText::default();
            read.feed(&events);
            assert!(read.done, "a replayed stream ends with [DONE]");
        }
    }
    for endpoint in [Endpoint::Responses, Endpoint::Messages] {
        if let Some(events) = replay(endpoint, whole, true) {
            let api = crate::openai::agent_streams::AgentStream::of(&events);
            assert!(api.is_some(), "a replayed stream names its API");
            assert!(
                api.and_then(|api| api.as_response(&events)).is_some(),
                "a replayed stream stands for a whole answer"
            );
        }
    }
}

/// A configuration file's text, parsed and validated.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(config) = ServeConfig::from_toml(text, Path::new("/fuzz/semlb.toml")) {
        let _ = config.validate();
    }
}

/// A completion record's bytes.
pub fn completion(data: &[u8]) {
    let mut decoded = Completion::default();
    if decoded.decode_from(data).is_err() {
        return;
    }
    let Some(server) = decoded.server else {
        return;
    };
    let continuation = decoded.continuation.as_ref().map(|c| ContinuationRef {
        root: c.root,
        block_size: c.block_size,
        tokenizer: c.tokenizer,
        tail: &c.tail,
        form: c.form,
        answer: (!c.answer_is_response).then_some(&c.answer[..]),
    });
    let record = CompletionRecord {
        server,
        prompt_tokens: decoded.prompt_tokens,
        output_tokens: decoded.output_tokens,
        prompt_blocks: &decoded.prompt_blocks,
        full_blocks: &decoded.full_blocks,
        continuation,
        response: decoded.response_key.map(|k| (k, &decoded.response[..])),
        prediction: decoded.prediction,
        timing: decoded.timing,
    };
    let mut bytes = Vec::new();
    record.encode_into(&mut bytes);
    assert_eq!(
        bytes.len(),
        record.encoded_len(),
        "encoded_len is the encoding's length"
    );
    let mut again = Completion::default();
    again.decode_from(&bytes).expect("a re-encoded record decodes");
    assert_eq!(again, decoded, "a record survives re-encoding");
}
