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
//! | [`segment_file`] | a shm segment file: arbitrary, or a real one with bytes overwritten | open either refuses it or yields tables whose reads do not panic |
//! | [`completion`] | a completion record | a decoded record re-encodes to one that decodes the same |
//! | [`response_log`] | overwrites of a response cache holding known values | a read returns the value put under that key, or nothing |

use std::path::Path;
use std::sync::OnceLock;

use semlb_tokenizer::Tokenizer;
use semlb_tokenizer::chat::ChatTemplate;
use shm_layout::plan::MIN_SEGMENT_BYTES;
use shm_layout::{
    Completion, CompletionRecord, ContinuationRef, LayoutPlan, Pop, Region, RegionKind, ResponseKey, Segment, Stamp,
};

use crate::answer::{self, AnswerForm, EventStreamText};
use crate::config::ServeConfig;
use crate::dispatcher::{UsageStrip, replay};
use crate::prompt::{self, Endpoint, RequestLimits};
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

/// A request body: byte 0 picks the endpoint (bit 0) and the chat template
/// (bit 1); the rest is the body.
pub fn request(data: &[u8]) {
    let Some((&choice, body)) = data.split_first() else {
        return;
    };
    let endpoint = if choice & 1 == 0 {
        Endpoint::Completions
    } else {
        Endpoint::ChatCompletions
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
            let _ = response_cache::key(Tenant(7), endpoint, "a=1", &headers, &parsed.body);
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

/// A shm segment's file: byte 0 even, the rest is the whole file; odd, the
/// rest is a list of overwrites (`region:1 offset:4 len:1 bytes`) applied
/// to a real segment holding a few entries of every table.
pub fn segment_file(data: &[u8]) {
    static IMAGE: OnceLock<(Vec<u8>, Vec<Region>)> = OnceLock::new();
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let (image, regions) = IMAGE.get_or_init(real_segment_image);
    let file = if mode & 1 == 0 {
        rest.to_vec()
    } else {
        let mut file = image.clone();
        overwrite(&mut file, rest, |r, at| {
            match regions.get(usize::from(r) % (regions.len() + 1)) {
                Some(region) => (region.offset + at % region.bytes.max(1)) as usize,
                None => (at % 4096) as usize, // the header page
            }
        });
        file
    };
    let name = segment_file_name();
    if write_shm(&name, &file).is_err() {
        return;
    }
    if let Ok(segment) = Segment::open(&name) {
        read_everything(&segment);
    }
}

/// The shm name [`segment_file`] writes (one per process, rewritten by
/// every input).
fn segment_file_name() -> String {
    format!("semlb-fuzz-{}", std::process::id())
}

/// Removes the file [`segment_file`] left in `/dev/shm`.
pub fn remove_segment_file() {
    let _ = Segment::remove(&segment_file_name());
}

/// Applies the overwrites of `ops` to `file`; `place(region, offset)` says
/// where in the file an overwrite of `region` at `offset` lands.
fn overwrite(file: &mut [u8], mut ops: &[u8], place: impl Fn(u8, u64) -> usize) {
    while ops.len() >= 6 {
        let region = ops[0];
        let offset = u64::from(u32::from_le_bytes(ops[1..5].try_into().expect("4 bytes")));
        let len = usize::from(ops[5]).min(ops.len() - 6);
        let at = place(region, offset).min(file.len());
        let n = len.min(file.len() - at);
        file[at..at + n].copy_from_slice(&ops[6..6 + n]);
        ops = &ops[6 + len..];
    }
}

fn write_shm(name: &str, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(format!("/dev/shm/{name}"))?;
    f.write_all(bytes)
}

/// The bytes of a new segment of the smallest size with a few servers,
/// prefixes, responses and completion records in it, and its regions.
fn real_segment_image() -> (Vec<u8>, Vec<Region>) {
    let name = format!("semlb-fuzz-image-{}", std::process::id());
    let _ = Segment::remove(&name);
    let plan = LayoutPlan::for_size(MIN_SEGMENT_BYTES).expect("plan");
    let segment = Segment::create(&name, &plan).expect("create the fuzz image segment");
    let t = segment.tables();
    let servers: Vec<_> = (0..3)
        .map(|i| {
            t.servers
                .register(i, &format!("http://10.0.0.{i}:8000"), 0)
                .expect("register")
        })
        .collect();
    for (i, s) in servers.iter().enumerate() {
        t.prefix.insert(0x1000 + i as u64, *s, Stamp(1));
        t.servers.begin_request(1, *s, 10);
    }
    for k in 0..4u128 {
        let _ = t.responses.put(ResponseKey(k << 64 | k), &vec![k as u8; 100 << k]);
    }
    let record = CompletionRecord {
        server: servers[0],
        prompt_tokens: 12,
        output_tokens: 3,
        prompt_blocks: &[1, 2],
        full_blocks: &[1, 2, 3],
        continuation: None,
        response: Some((ResponseKey(1), b"{}")),
        prediction: None,
        timing: None,
    };
    let mut buf = Vec::new();
    record.encode_into(&mut buf);
    let _ = t.ring(0).push(&buf);
    let bytes: Vec<u8> = segment
        .raw_words()
        .iter()
        .flat_map(|w| w.load(std::sync::atomic::Ordering::Relaxed).to_le_bytes())
        .collect();
    let regions = RegionKind::ALL.iter().map(|k| segment.header().region(*k)).collect();
    drop(segment);
    let _ = Segment::remove(&name);
    (bytes, regions)
}

/// Reads every table of `segment` the way the gateway's processes do.
fn read_everything(segment: &Segment) {
    let t = segment.tables();
    let servers: Vec<_> = t.servers.servers().collect();
    for s in &servers {
        let _ = (t.servers.inflight_and_pending(s.server), t.servers.load(s.server));
    }
    let chain: Vec<u64> = (0x1000..0x1008).collect();
    let _ = t.prefix.longest_prefix_match(&chain, |_| true);
    let _ = t.prefix.lookup(0x1001);
    let _ = t.prefix.occupancy_estimate(0, 64);
    let _ = t.prefix.entries().take(64).count();
    let mut buf = Vec::new();
    for k in 0..4u128 {
        let _ = t.responses.get_into(ResponseKey(k << 64 | k), &mut buf);
    }
    let _ = (t.responses.stats(), t.segments.stats());
    let _ = t.registry.processes().count();
    let _ = t.stats.sum_all();
    let mut record = Completion::default();
    for r in 0..t.ring_count().min(4) {
        let ring = t.ring(r);
        for _ in 0..8 {
            match ring.pop(&mut buf) {
                Pop::Record => {
                    let _ = record.decode_from(&buf);
                }
                Pop::Pending => {
                    ring.recover(|_, _| false);
                }
                Pop::Empty => break,
            }
        }
    }
    for s in &servers {
        let _ = t.servers.reclaim_process(1);
        let _ = t.servers.inflight(s.server);
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

/// Overwrites (`region:1 offset:4 len:1 bytes`, region 0 the index, else
/// the log) of a response cache holding eight known values, then reads and
/// writes: a read returns the value put under its key or nothing.
pub fn response_log(data: &[u8]) {
    let segment = Segment::heap(&LayoutPlan::for_size(MIN_SEGMENT_BYTES).expect("plan"));
    let t = segment.tables();
    let value = |k: u128| -> Vec<u8> { (0..(64 << (k % 5))).map(|i| (i as u128 * 31 + k) as u8).collect() };
    let key = |k: u128| ResponseKey(k.wrapping_mul(0x9e37_79b9_7f4a_7c15) << 64 | k);
    for k in 0..8 {
        t.responses.put(key(k), &value(k)).expect("put");
    }
    let header = segment.header();
    let (index, log) = (
        header.region(RegionKind::ResponseIndex),
        header.region(RegionKind::ResponseLog),
    );
    let words = segment.raw_words();
    let mut ops = data;
    while ops.len() >= 6 {
        let r = if ops[0] & 1 == 0 { index } else { log };
        let offset = u64::from(u32::from_le_bytes(ops[1..5].try_into().expect("4 bytes"))) % r.bytes.max(1);
        let len = usize::from(ops[5]).min(ops.len() - 6);
        for (i, b) in ops[6..6 + len].iter().enumerate() {
            let at = r.offset + (offset + i as u64) % r.bytes;
            let w = &words[(at / 8) as usize];
            let shift = (at % 8) * 8;
            let old = w.load(std::sync::atomic::Ordering::Relaxed);
            w.store(
                old & !(0xff << shift) | u64::from(*b) << shift,
                std::sync::atomic::Ordering::Relaxed,
            );
        }
        ops = &ops[6 + len..];
    }
    let mut buf = Vec::new();
    for k in 0..8 {
        if let Some(got) = t.responses.get_into(key(k), &mut buf) {
            assert_eq!(
                got,
                &value(k)[..],
                "key {k} read back a value that was never put under it"
            );
        }
    }
    let _ = t.responses.stats();
    let _ = t.responses.put(key(9), b"after the damage");
    if let Some(got) = t.responses.get_into(key(9), &mut buf) {
        assert_eq!(got, b"after the damage");
    }
}
