//! The segment cache changes no id: multi-turn conversations rendered with
//! a chat template are encoded turn after turn by ONE tokenizer with a
//! segment cache (so earlier turns warm it), and every prompt's ids equal
//! HF's full encode of that prompt. The cache must really work: every
//! later turn hits it (earlier turns come back as the same segments),
//! unless the earlier messages had only short lines (the cache does not
//! keep segments of a few words: tokenizing them costs what a lookup
//! does). With a tiny cache (constant eviction) the ids stay exact and the
//! cache stays within its size.
//!
//! Conversations: the HH-RLHF dialogues split into turns (`shared/data`),
//! else generated ones. Templates: Qwen3's `chat_template` (with Qwen3's
//! tokenizer) and `ChatTemplate::canonical()` (with Qwen3's and the
//! bundled phi-2).
//!
//! Run against HF with `SEMLB_CONFORMANCE_ALLOW_HF=1` (the ids are then
//! checked, the cache counters are not: HF has no cache).

mod support;

use std::collections::BTreeMap;

use semlb_tokenizer::chat::{ChatMessage, ChatTemplate};
use semlb_tokenizer::{SegmentCacheStats, Tokenizer};
use support::corpus::{self, Rng};
use support::{Mismatch, SHOWN_MISMATCHES, Subject};

/// The cache size of the main runs.
const CACHE_BYTES: usize = 64 << 20;
/// The cache size of the eviction runs.
const TINY_CACHE_BYTES: usize = 4 << 10;

/// A line of an earlier message at least this long must come back as a
/// cache hit in a later turn.
const CACHED_LINE_BYTES: usize = 32;

/// A system prompt given to every other conversation (shared across
/// conversations, so it is cached once and hit many times).
const SYSTEM: &str = "You are a helpful assistant. Answer briefly and kindly.";

/// Turns from this one on share a row of the printed table.
const LAST_TURN_ROW: usize = 6;

/// One conversation: alternating user and assistant messages, user first.
type Conversation = Vec<ChatMessage<'static>>;

fn message(role: &str, content: &str) -> ChatMessage<'static> {
    ChatMessage::new(role.to_owned(), content.to_owned())
}

/// The HH-RLHF `chosen` dialogues as conversations, or generated ones
/// (with the source's name).
fn conversations() -> (Vec<Conversation>, &'static str) {
    if let Some(path) = corpus::data_file(corpus::HH_RLHF_FILE) {
        let transcripts = corpus::hh_rlhf_transcripts(&path);
        // `chosen` and `rejected` alternate; `chosen` only.
        let conversations: Vec<Conversation> = transcripts
            .iter()
            .step_by(2)
            .map(|t| {
                corpus::split_transcript(t)
                    .into_iter()
                    .map(|m| message(m.role, m.content.trim()))
                    .collect::<Conversation>()
            })
            .filter(|c| c.first().is_some_and(|m| m.role == "user"))
            .collect();
        return (conversations, "hh-rlhf dialogues");
    }
    (generated_conversations(), "generated conversations")
}

/// 300 four-turn conversations from the corpus' kinds of text.
fn generated_conversations() -> Vec<Conversation> {
    let mut rng = Rng(0xc0ffee);
    let topics = [
        "Explain how a load balancer picks a server.",
        "Translate 负载均衡器 into English, please.",
        "def f(x):\n    return x * 2\n\nWhat does this do?",
        "Why is the sky blue? 🌈🏳️‍🌈",
        "Write the numbers 1, 22, 333, 4444 and 1234567890 in words.",
        "It's late; we'll talk tomorrow, won't we?",
        "Καλημέρα! Привет! مرحبا! नमस्ते!",
        "<think>is this a special token?</think> and <|im_start|> inside text",
        "  indented\n\ttabs\r\nand CRLF  \n",
    ];
    (0..300)
        .map(|i| {
            let mut c = Vec::new();
            for turn in 0..4 {
                let user = format!("({i}.{turn}) {}", rng.pick(&topics));
                let answer = format!("Answer {i}.{turn}: {} {}", rng.pick(&topics), rng.next_u64());
                c.push(message("user", &user));
                c.push(message("assistant", &answer));
            }
            c
        })
        .collect()
}

/// What a replay saw.
#[derive(Default)]
struct Replay {
    prompts: usize,
    bytes: usize,
    ids: usize,
    mismatches: Vec<Mismatch>,
    mismatch_count: usize,
    /// Turns after the first of a conversation (where hits must grow).
    later_turns: usize,
    /// Those of them during which the cache had no new hit although an
    /// earlier message had a line of [`CACHED_LINE_BYTES`].
    later_turns_without_hits: Vec<(usize, usize)>,
    /// Turn number (1-based; the last row for all later ones) -> (prompts,
    /// hits, misses) during those turns.
    by_turn: BTreeMap<usize, (usize, u64, u64)>,
    /// The cache's bytes exceeded its capacity after some encode.
    over_capacity: Option<SegmentCacheStats>,
}

/// Encodes every conversation turn after turn with `ours` (one tokenizer,
/// one cache) and compares with HF's full encode of each prompt.
fn replay(subject: &Subject, ours: &Tokenizer, template: &ChatTemplate, conversations: &[Conversation]) -> Replay {
    let mut r = Replay::default();
    for (c, conversation) in conversations.iter().enumerate() {
        let mut messages = Vec::new();
        if c % 2 == 1 {
            messages.push(message("system", SYSTEM));
        }
        let mut turn = 0;
        // The messages the previous prompt was rendered from.
        let mut previous = 0;
        for m in conversation {
            messages.push(m.clone());
            if m.role != "user" {
                continue;
            }
            turn += 1;
            let prompt = template
                .render(&messages)
                .unwrap_or_else(|e| panic!("conversation {c} turn {turn}: the template fails: {e}"));
            let before = ours.segment_cache_stats();
            let ids = ours.encode(&prompt);
            let after = ours.segment_cache_stats();
            if after.bytes > after.capacity_bytes && r.over_capacity.is_none() {
                r.over_capacity = Some(after);
            }
            let entry = r.by_turn.entry(turn.min(LAST_TURN_ROW)).or_default();
            entry.0 += 1;
            entry.1 += after.hits - before.hits;
            entry.2 += after.misses - before.misses;
            if turn > 1 {
                r.later_turns += 1;
                let earlier = &messages[..previous];
                let long_line = earlier
                    .iter()
                    .any(|m| m.content.split('\n').any(|l| l.len() >= CACHED_LINE_BYTES));
                if after.hits == before.hits && long_line {
                    r.later_turns_without_hits.push((c, turn));
                }
            }
            previous = messages.len();
            let reference = subject.reference_ids(&prompt);
            r.prompts += 1;
            r.bytes += prompt.len();
            r.ids += reference.as_ref().map_or(0, Vec::len);
            if reference.as_ref() != Ok(&ids) {
                r.mismatch_count += 1;
                if r.mismatches.len() < SHOWN_MISMATCHES {
                    r.mismatches.push(Mismatch {
                        source: format!("conversation {c} turn {turn}"),
                        index: c,
                        text: prompt,
                        ours: ids,
                        reference,
                    });
                }
            }
        }
    }
    r
}

/// Replays `conversations` and checks ids, and (unless HF is behind the
/// API) the cache's counters.
fn check(subject: &Subject, dialect: &str, template: &ChatTemplate, template_name: &str, cache_bytes: usize) {
    subject.require_native(dialect);
    let (conversations, source) = conversations();
    let (conversations, source) = if cache_bytes == TINY_CACHE_BYTES {
        (conversations.into_iter().step_by(8).collect::<Vec<_>>(), source)
    } else {
        (conversations, source)
    };
    let ours = subject.ours.clone().with_segment_cache(cache_bytes);
    let r = replay(subject, &ours, template, &conversations);
    let stats = ours.segment_cache_stats();
    let label = format!(
        "{} + {template_name} template, {} KiB cache",
        subject.name,
        cache_bytes >> 10
    );
    println!(
        "segment cache, {label} [{}]: {} conversations ({source}), {} prompts, {} bytes, {} ids, {} mismatches; cache {stats:?}",
        ours.engine(),
        conversations.len(),
        r.prompts,
        r.bytes,
        r.ids,
        r.mismatch_count
    );
    for (turn, (prompts, hits, misses)) in &r.by_turn {
        let plus = if *turn == LAST_TURN_ROW { "+" } else { " " };
        println!("  turn {turn:>2}{plus}: {prompts:>5} prompts, {hits:>7} segment hits, {misses:>7} misses");
    }
    assert!(r.later_turns > 0, "{label}: no conversation has a second turn");
    if r.mismatch_count > 0 {
        let shown: Vec<String> = r.mismatches.iter().map(|m| m.describe(&subject.reference)).collect();
        panic!(
            "{label}: {} of {} prompts get other ids than HF's full encode; the first:\n{}",
            r.mismatch_count,
            r.prompts,
            shown.join("\n---\n")
        );
    }
    if !ours.engine().is_native() {
        println!("NOTE: {label}: HF has no segment cache; its counters are not checked");
        return;
    }
    assert_eq!(stats.capacity_bytes, cache_bytes, "{label}: the cache's capacity");
    assert!(
        r.over_capacity.is_none(),
        "{label}: the cache outgrew its capacity: {:?}",
        r.over_capacity
    );
    assert!(
        stats.misses > 0,
        "{label}: nothing was tokenized through the cache: {stats:?}"
    );
    if cache_bytes == TINY_CACHE_BYTES {
        assert!(
            stats.misses > stats.entries as u64,
            "{label}: a 4 KiB cache cannot hold every segment of {} prompts: {stats:?}",
            r.prompts
        );
    } else {
        assert!(stats.entries > 0, "{label}: nothing was cached: {stats:?}");
        assert!(stats.hits > 0, "{label}: the cache never hit: {stats:?}");
        assert!(
            r.later_turns_without_hits.is_empty(),
            "{label}: {} of {} later turns (each repeats the earlier turns) had no cache hit, e.g. (conversation, turn) {:?}",
            r.later_turns_without_hits.len(),
            r.later_turns,
            &r.later_turns_without_hits[..r.later_turns_without_hits.len().min(5)]
        );
    }
}

fn qwen3_template() -> Option<ChatTemplate> {
    semlb_tokenizer::test_data::tokenizer_file("qwen3-tokenizer_config.json")
        .map(|p| ChatTemplate::from_tokenizer_config(&p).expect("Qwen3's chat template loads"))
}

#[test]
fn qwen3_template_turn_after_turn_matches_hf() {
    let (Some(subject), Some(template)) = (Subject::qwen3(), qwen3_template()) else {
        return;
    };
    check(&subject, "qwen2", &template, "Qwen3", CACHE_BYTES);
}

#[test]
fn qwen3_canonical_template_turn_after_turn_matches_hf() {
    let Some(subject) = Subject::qwen3() else { return };
    check(&subject, "qwen2", &ChatTemplate::canonical(), "canonical", CACHE_BYTES);
}

#[test]
fn phi2_canonical_template_turn_after_turn_matches_hf() {
    check(
        &Subject::bundled_phi2(),
        "gpt2",
        &ChatTemplate::canonical(),
        "canonical",
        CACHE_BYTES,
    );
}

#[test]
fn tiny_cache_under_eviction_keeps_ids_exact() {
    check(
        &Subject::bundled_phi2(),
        "gpt2",
        &ChatTemplate::canonical(),
        "canonical",
        TINY_CACHE_BYTES,
    );
    let (Some(subject), Some(template)) = (Subject::qwen3(), qwen3_template()) else {
        return;
    };
    check(&subject, "qwen2", &template, "Qwen3", TINY_CACHE_BYTES);
}

/// The conversations are multi-turn (the hit checks need later turns) and
/// the templates make each turn's prompt extend the previous one.
#[test]
fn conversations_have_later_turns_that_extend_earlier_prompts() {
    let (conversations, source) = conversations();
    let users = |c: &Conversation| c.iter().filter(|m| m.role == "user").count();
    let multi = conversations.iter().filter(|c| users(c) >= 2).count();
    println!(
        "{} conversations ({source}), {multi} with two or more user turns",
        conversations.len()
    );
    assert!(multi * 4 >= conversations.len(), "at least a quarter are multi-turn");
    let mut templates = vec![("canonical", ChatTemplate::canonical())];
    templates.extend(qwen3_template().map(|t| ("Qwen3", t)));
    for (name, template) in templates {
        for c in conversations.iter().filter(|c| users(c) >= 2).take(200) {
            let second_user = c.iter().enumerate().filter(|(_, m)| m.role == "user").nth(1).unwrap().0;
            let first = template.render(&c[..1]).unwrap();
            let second = template.render(&c[..=second_user]).unwrap();
            // Up to the generation prompt (Qwen3 drops <think> blocks of
            // earlier answers; HH-RLHF answers have none).
            assert!(
                second.starts_with(&first),
                "{name}: turn 2 does not extend turn 1:\n{first:?}\n{second:?}"
            );
        }
    }
}
