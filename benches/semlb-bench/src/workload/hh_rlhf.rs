//! The `hh-rlhf` workload: HH-RLHF dialogues as multi-turn chats.
//!
//! The dialogues are the `chosen` transcripts of
//! `<data>/prompts/hh-rlhf-helpful-base-test.jsonl` (2 354 dialogues, 2.5
//! human turns each on average), split into `(human, assistant)` turns by
//! the e2e report's parser. Conversations start as a Poisson process of
//! `--hh-rlhf-rate` conversations per trace second (seeded), from
//! [`WARM_UP_S`] before the window that is sent (`[0, duration)`); only the
//! turns arriving in the window are sent, so the request rate is the steady
//! state's (conversations/s × turns per conversation) from its first second
//! to its last, and conversations that started before it appear with their
//! later turns (their earlier ones were never cached, as in a trace cut
//! out of a running service). Conversation `i` replays dialogue `i mod n`
//! (from the second pass over the dataset on, its first human turn starts
//! with `(session p)` so that repeated dialogues are distinct prompts).
//!
//! Turn k's prompt is the whole history: for each earlier turn
//! `"\n\nHuman: {human}\n\nAssistant:"` and `" {answer}"` (the dataset's
//! answer), then the new human turn. Each piece is tokenized on its own with
//! the run's tokenizer (the data directory's Qwen3 tokenizer, else the
//! bundled phi-2 one) and the ids are concatenated, so turn k+1's prompt *extends* turn k's prompt
//! exactly, token for token, as a chat engine's KV cache sees it. The turn's
//! output length is the token count of the dataset's answer (clamped to
//! `1..=--max-output`). Turn k+1 arrives after turn k's arrival, its
//! expected duration on an idle engine and an exponential think time of
//! mean [`THINK_MEAN_S`] (see the [workload docs](super)). The session id
//! is the conversation index.
//!
//! In the text form ([`text`](super::text), the replay's default) the
//! prompt is those pieces' text itself, which the engines tokenize with
//! their own tokenizer (the bundled phi-2 one: with the data directory's
//! Qwen3 tokenizer the token-id form's lengths, outputs and the offered
//! load are Qwen3 tokens, the engines' prompt counters phi-2 ones).
//!
//! # Load
//!
//! Prompts are short: ~100 Qwen3 tokens on average (~25 for a first turn, each
//! later turn adding the ~60-token answer and the next question), outputs
//! ~60 tokens. The default 90 conversations/s offer ~220 requests/s, i.e.
//! ~23 000 prompt tokens/s: ~57 % of four engines' 40 000 tokens/s of
//! prefill without any prefix reuse (~35 % with perfect reuse of each
//! conversation's history), and ~13 000 output tokens/s of decode. The
//! engines cannot be loaded further by prefill without sending more
//! requests than this 2-core machine streams comfortably (the replay runs
//! this workload in real time, speedup 1), so what separates the policies
//! here is queueing and batch balance more than prefix hits.

use semlb_test_support::Rng;

use crate::end_to_end::Dialogue;
use semlb_tokenizer::Tokenizer;

use super::text::TextPrompt;
use super::{Window, Workload, WorkloadKind, expected_turn_s, exponential};

/// Mean think time between an answer and the next question, trace seconds.
pub const THINK_MEAN_S: f64 = 5.0;

/// Conversations start this many trace seconds before the window that is
/// sent, so that the window is in steady state.
pub const WARM_UP_S: f64 = 30.0;

/// How the conversations are generated.
#[derive(Debug, Clone)]
pub struct HhRlhfParams {
    /// New conversations per trace second (Poisson).
    pub conversations_per_s: f64,
    /// The window sent, trace seconds: the turns arriving in it.
    pub duration_s: f64,
    /// Cap on a turn's output tokens.
    pub max_output: u32,
    /// Seed of the arrival and think times.
    pub seed: u64,
}

/// The conversations of `dialogues` (non-empty) tokenized with
/// `tokenizer`; with `text`, in the text form too.
pub(crate) fn build(
    dialogues: &[Dialogue],
    tokenizer: &Tokenizer,
    params: &HhRlhfParams,
    source: &str,
    text: bool,
) -> Workload {
    let mut rng = Rng::from_seed(params.seed ^ 0x4848_524C_4846);
    let mut window = Window::new(params.duration_s, params.max_output);
    let mut start = -WARM_UP_S;
    for conversation in 0u64.. {
        start += exponential(&mut rng, 1.0 / params.conversations_per_s);
        if start >= params.duration_s || dialogues.is_empty() {
            break;
        }
        let (index, pass) = (
            (conversation % dialogues.len() as u64) as usize,
            conversation / dialogues.len() as u64,
        );
        let mut history: Vec<u32> = Vec::new();
        let mut history_text = text.then(TextPrompt::default);
        let mut at = start;
        for (turn, (human, answer)) in dialogues[index].turns.iter().enumerate() {
            let human = if turn == 0 && pass > 0 {
                format!("(session {pass}) {human}")
            } else {
                human.clone()
            };
            let before = history.len();
            let (question, answer) = (format!("\n\nHuman: {human}\n\nAssistant:"), format!(" {answer}"));
            history.extend(tokenizer.encode(&question));
            let answer_tokens = tokenizer.encode(&answer);
            if let Some(h) = history_text.as_mut() {
                h.push(question);
            }
            let output_tokens = window.turn(
                at,
                &history,
                history_text.as_ref(),
                answer_tokens.len() as u32,
                conversation,
            );
            at += expected_turn_s(history.len() - before, output_tokens) + exponential(&mut rng, THINK_MEAN_S);
            history.extend(answer_tokens);
            if let Some(h) = history_text.as_mut() {
                h.push(answer);
            }
        }
    }
    let Window {
        requests, truncated, ..
    } = window;
    Workload::new(
        WorkloadKind::HhRlhf,
        requests,
        format!(
            "{source}: {} conversations/s for {} s, think time {THINK_MEAN_S} s",
            params.conversations_per_s, params.duration_s
        ),
        truncated,
    )
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::end_to_end::parse_dialogue;
    use crate::workload::Request;

    fn dialogues() -> Vec<Dialogue> {
        (0..50)
            .map(|i| {
                parse_dialogue(&format!(
                    "\n\nHuman: Question {i}?\n\nAssistant: Answer {i} goes on a bit.\
                     \n\nHuman: And then?\n\nAssistant: Then more.\n\nHuman: Thanks.\n\nAssistant: Welcome."
                ))
            })
            .collect()
    }

    fn params(seed: u64) -> HhRlhfParams {
        HhRlhfParams {
            conversations_per_s: 20.0,
            duration_s: 50.0,
            max_output: 2048,
            seed,
        }
    }

    #[test]
    fn conversations_are_deterministic_in_the_seed() {
        let tok = Tokenizer::bundled();
        let (a, b) = (
            build(&dialogues(), &tok, &params(1), "x", false),
            build(&dialogues(), &tok, &params(1), "x", false),
        );
        assert_eq!(a.requests, b.requests);
        let c = build(&dialogues(), &tok, &params(2), "x", false);
        assert_ne!(a.requests, c.requests);
    }

    #[test]
    fn each_turn_extends_the_previous_turns_prompt_and_answer() {
        let tok = Tokenizer::bundled();
        let w = build(&dialogues(), &tok, &params(3), "x", false);
        let mut by_session: HashMap<u64, Vec<&Request>> = HashMap::new();
        for r in &w.requests {
            by_session.entry(r.session.unwrap()).or_default().push(r);
        }
        let mut whole = 0;
        for turns in by_session.values() {
            assert!((1..=3).contains(&turns.len()));
            whole += usize::from(turns.len() == 3);
            for pair in turns.windows(2) {
                assert!(pair[1].at_s > pair[0].at_s);
                let prev = &pair[0].prompt;
                assert!(pair[1].prompt.len() > prev.len() + pair[0].output_tokens as usize);
                assert_eq!(&pair[1].prompt[..prev.len()], &prev[..]);
            }
        }
        assert!(whole > by_session.len() / 2);
        // The output length is the dataset answer's (conversation 1 000
        // replays dialogue 0 and starts in the window).
        let first = w
            .requests
            .iter()
            .find(|r| r.session == Some(1000))
            .expect("a conversation started in the window");
        assert_eq!(
            first.output_tokens as usize,
            tok.encode(" Answer 0 goes on a bit.").len()
        );
        // The second pass over the dataset is distinct from the first.
        let firsts: Vec<&Vec<u32>> = w.requests.iter().map(|r| &r.prompt).collect();
        let distinct: std::collections::HashSet<&Vec<u32>> = firsts.iter().copied().collect();
        assert_eq!(distinct.len(), firsts.len());
    }

    #[test]
    fn the_text_form_is_the_dialogues_text() {
        let tok = Tokenizer::bundled();
        let (ids, texts) = (
            build(&dialogues(), &tok, &params(5), "x", false),
            build(&dialogues(), &tok, &params(5), "x", true),
        );
        assert_eq!(ids.requests.len(), texts.requests.len());
        for (a, b) in ids.requests.iter().zip(&texts.requests) {
            assert_eq!(
                (a.at_s, &a.prompt, a.output_tokens),
                (b.at_s, &b.prompt, b.output_tokens)
            );
            let t = b.text.as_ref().unwrap().text();
            assert!(t.starts_with("\n\nHuman: ") && t.ends_with("\n\nAssistant:"), "{t:?}");
            // Tokenized whole, as the engine does, it is the pieces' ids.
            assert_eq!(tok.encode(&t), b.prompt);
        }
        assert!(ids.requests.iter().all(|r| r.text.is_none()));
    }

    #[test]
    fn turns_arrive_at_the_configured_rate_within_the_window() {
        let tok = Tokenizer::bundled();
        let w = build(&dialogues(), &tok, &params(4), "x", false);
        // 20 conversations/s of 3 turns: 60 turns/s, 3 000 in 50 s.
        assert!((2700..=3300).contains(&w.requests.len()), "{}", w.requests.len());
        assert!(w.requests.iter().all(|r| (0.0..50.0).contains(&r.at_s)));
        // As many in the first and the last ten seconds: no ramp.
        let count = |lo: f64| w.requests.iter().filter(|r| (lo..lo + 10.0).contains(&r.at_s)).count();
        let (first, last) = (count(0.0) as f64, count(40.0) as f64);
        assert!((first / last - 1.0).abs() < 0.2, "{first} {last}");
        assert!(w.has_sessions());
    }
}
