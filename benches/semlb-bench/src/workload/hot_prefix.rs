//! The `hot-prefix` workload: generated agent sessions on a few long,
//! shared system prompts of skewed popularity.
//!
//! # Generator (deterministic in `--seed`)
//!
//! * [`SYSTEM_PROMPT_TOKENS`]: six system prompts (tool descriptions,
//!   instructions) of 4 000, 6 000, 2 000, 5 000, 3 000 and 2 500 tokens of
//!   synthetic token ids.
//! * Sessions start as a Poisson process of `--hot-prefix-rate` sessions
//!   per trace second, from [`WARM_UP_S`] before the window that is sent
//!   (`[0, duration)`; only the steps arriving in it are sent, so the rate
//!   is steady throughout). Each picks system prompt k with Zipf probability
//!   ∝ 1/(k+1)^[`ZIPF_EXPONENT`]: 49 %, 20 %, 12 %, 8 %, 6 % and 5 % of the
//!   sessions, so the hottest prompt carries about half the traffic.
//! * A session is an agent loop of 1 to 6 steps (uniform). Step 1's prompt
//!   is the system prompt and a user part of 100–800 tokens; step j+1's is
//!   step j's prompt, its answer (the `output` tokens, synthetic) and a tool
//!   result of 200–1 000 tokens, so every step extends the previous one.
//!   Outputs are 50–300 tokens. Step j+1 arrives after step j's arrival,
//!   its expected duration on an idle engine and an exponential tool time
//!   of mean [`TOOL_MEAN_S`] (see the [workload docs](super)). The session id
//!   is the session index.
//! * In the text form ([`text`](super::text), the replay's default) each
//!   piece of synthetic tokens (a system prompt, a user part, an answer
//!   and the tool result after it) is instead a chunk of text of as many
//!   tokens with the engines' tokenizer, seeded by the piece, so that
//!   every step's text extends the previous step's and the six system
//!   prompts are six texts. The arrival times, lengths and outputs are the
//!   token-id form's (the text has seeds of its own).
//!
//! # Load
//!
//! A session makes 3.5 requests on average. With perfect prefix reuse on
//! the system prompts only (each cached wherever a request lands, the rest
//! of the prompt prefilled), step j needs the user part (450 tokens on
//! average) and the j − 1 earlier answers and tool results (175 + 600 = 775
//! each); a request is step j with weight Σ_S [S ≥ j] over the 1–6 step
//! counts, so E[j − 1] = (0+1+3+6+10+15) / 21 = 35/21 and a request needs
//! 450 + 775 × 35/21 ≈ 1 740 tokens of prefill. The default 4.5 sessions/s
//! = 15.75 requests/s thus need ≈ 27 400 tokens/s: ~70 % of four engines'
//! 40 000 tokens/s. A policy that also keeps each session on the engine
//! that holds its history needs only the new tokens: 450 for a first step,
//! 775 for a later one, (450 + 2.5 × 775) / 3.5 ≈ 680 on average, ≈ 10 700
//! tokens/s (27 %); one that sends every request of the hottest prompt to
//! one engine gives it half of the load (~140 % of its capacity). Without
//! any reuse the mean prompt is ~5 900 tokens (93 000 tokens/s, 230 %).
//! Outputs (175 on average) add ≈ 2 800 tokens/s of decode. The six system
//! prompts (22 500 tokens) fit in every engine's 400 000-token KV cache; the
//! live sessions' histories (≈ 45 sessions of ~6 000 tokens) fit in one
//! engine's.

use std::sync::Arc;

use semlb_test_support::{Rng, mix};

use super::text::{TextGen, TextPrompt};
use super::{Window, Workload, WorkloadKind, expected_turn_s, exponential, random_tokens, uniform};

/// Lengths of the system prompts, hottest first.
pub const SYSTEM_PROMPT_TOKENS: [usize; 6] = [4000, 6000, 2000, 5000, 3000, 2500];

/// Exponent of the Zipf popularity of the system prompts.
pub const ZIPF_EXPONENT: f64 = 1.3;

/// Mean tool time between an answer and the next agent step, trace seconds.
pub const TOOL_MEAN_S: f64 = 1.0;

/// Sessions start this many trace seconds before the window that is sent,
/// so that the window is in steady state.
pub const WARM_UP_S: f64 = 30.0;

/// Tokens of a session's user part.
const USER_TOKENS: (u32, u32) = (100, 800);
/// Agent steps (requests) per session.
const STEPS: (u32, u32) = (1, 6);
/// Tokens of a tool result appended after each answer.
const TOOL_TOKENS: (u32, u32) = (200, 1000);
/// Output tokens of a step.
const OUTPUT_TOKENS: (u32, u32) = (50, 300);

/// How the sessions are generated.
#[derive(Debug, Clone)]
pub struct HotPrefixParams {
    /// New sessions per trace second (Poisson).
    pub sessions_per_s: f64,
    /// The window sent, trace seconds: the steps arriving in it.
    pub duration_s: f64,
    /// Cap on a step's output tokens.
    pub max_output: u32,
    /// Seed of everything.
    pub seed: u64,
}

/// The system prompts' token ids.
pub fn system_prompts(seed: u64) -> Vec<Vec<u32>> {
    SYSTEM_PROMPT_TOKENS
        .iter()
        .enumerate()
        .map(|(k, n)| random_tokens(&mut Rng::from_seed(seed ^ (0x5157_0000 + k as u64).rotate_left(24)), *n))
        .collect()
}

/// The system prompts' text: as many tokens as [`SYSTEM_PROMPT_TOKENS`]
/// with the tokenizer `text` was built for.
pub fn system_texts(text: &TextGen, seed: u64) -> Vec<Arc<str>> {
    SYSTEM_PROMPT_TOKENS
        .iter()
        .enumerate()
        .map(|(k, n)| text.chunk(mix(seed ^ 0x5359_5354_454D ^ ((k as u64) << 48)), *n).into())
        .collect()
}

/// The seed of piece `piece` (0: the user part; j: what follows step j's
/// answer) of session `session`'s text.
fn piece_seed(seed: u64, session: u64, piece: u64) -> u64 {
    mix(mix(seed ^ 0x484F_5450_5245) ^ session.rotate_left(20) ^ piece)
}

/// The popularity of each system prompt (sums to 1).
pub fn popularity() -> Vec<f64> {
    let w: Vec<f64> = (0..SYSTEM_PROMPT_TOKENS.len())
        .map(|k| 1.0 / ((k + 1) as f64).powf(ZIPF_EXPONENT))
        .collect();
    let total: f64 = w.iter().sum();
    w.iter().map(|x| x / total).collect()
}

/// The sessions; with `text`, in the text form too.
pub fn build(params: &HotPrefixParams, text: Option<&TextGen>) -> Workload {
    let systems = system_prompts(params.seed);
    let system_text = text.map(|t| system_texts(t, params.seed));
    let popularity = popularity();
    let mut rng = Rng::from_seed(params.seed ^ 0x4854_5052_4546);
    let mut window = Window::new(params.duration_s, params.max_output);
    let mut start = -WARM_UP_S;
    for session in 0u64.. {
        start += exponential(&mut rng, 1.0 / params.sessions_per_s);
        if start >= params.duration_s {
            break;
        }
        let mut u = rng.unit();
        let k = popularity
            .iter()
            .position(|p| {
                u -= p;
                u <= 0.0
            })
            .unwrap_or(popularity.len() - 1);
        let mut history = systems[k].clone();
        let mut new_tokens = uniform(&mut rng, USER_TOKENS.0, USER_TOKENS.1) as usize;
        history.extend(random_tokens(&mut rng, new_tokens));
        let mut history_text = text.zip(system_text.as_ref()).map(|(t, s)| {
            TextPrompt(vec![
                s[k].clone(),
                t.chunk(piece_seed(params.seed, session, 0), new_tokens).into(),
            ])
        });
        let mut at = start;
        for step in 1..=uniform(&mut rng, STEPS.0, STEPS.1) {
            let output = uniform(&mut rng, OUTPUT_TOKENS.0, OUTPUT_TOKENS.1);
            let output_tokens = window.turn(at, &history, history_text.as_ref(), output, session);
            at += expected_turn_s(new_tokens, output_tokens) + exponential(&mut rng, TOOL_MEAN_S);
            let tool = uniform(&mut rng, TOOL_TOKENS.0, TOOL_TOKENS.1) as usize;
            new_tokens = output_tokens as usize + tool;
            history.extend(random_tokens(&mut rng, new_tokens));
            if let (Some(t), Some(h)) = (text, history_text.as_mut()) {
                h.push(t.chunk(piece_seed(params.seed, session, u64::from(step)), new_tokens));
            }
        }
    }
    let Window {
        requests, truncated, ..
    } = window;
    Workload::new(
        WorkloadKind::HotPrefix,
        requests,
        format!(
            "generated: {} sessions/s for {} s on {} system prompts (Zipf {ZIPF_EXPONENT}), seed {}",
            params.sessions_per_s,
            params.duration_s,
            SYSTEM_PROMPT_TOKENS.len(),
            params.seed
        ),
        truncated,
    )
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::workload::Request;

    fn params(seed: u64) -> HotPrefixParams {
        HotPrefixParams {
            sessions_per_s: 12.0,
            duration_s: 100.0,
            max_output: 2048,
            seed,
        }
    }

    #[test]
    fn sessions_are_deterministic_in_the_seed() {
        let a = build(&params(1), None);
        assert_eq!(a.requests, build(&params(1), None).requests);
        assert_ne!(a.requests, build(&params(2), None).requests);
        assert!(a.requests.windows(2).all(|p| p[0].at_s <= p[1].at_s));
    }

    #[test]
    fn each_step_extends_the_previous_one() {
        let w = build(&params(3), None);
        let mut by_session: HashMap<u64, Vec<&Request>> = HashMap::new();
        for r in &w.requests {
            by_session.entry(r.session.unwrap()).or_default().push(r);
        }
        let mut multi = 0;
        for steps in by_session.values() {
            assert!((1..=6).contains(&steps.len()));
            multi += usize::from(steps.len() > 1);
            for pair in steps.windows(2) {
                let prev = &pair[0].prompt;
                let added = pair[1].prompt.len() - prev.len();
                assert!(added >= pair[0].output_tokens as usize + 200);
                assert_eq!(&pair[1].prompt[..prev.len()], &prev[..]);
            }
            for r in steps {
                assert!((50..=300).contains(&r.output_tokens));
            }
        }
        assert!(multi > by_session.len() / 2);
    }

    #[test]
    fn the_text_form_has_the_same_requests_with_text_of_their_length() {
        let tok = semlb_tokenizer::Tokenizer::bundled();
        let text = TextGen::new(&tok);
        let short = HotPrefixParams {
            duration_s: 10.0,
            ..params(6)
        };
        let (ids, texts) = (build(&short, None), build(&short, Some(&text)));
        assert_eq!(ids.requests.len(), texts.requests.len());
        let systems = system_texts(&text, 6);
        for (k, s) in systems.iter().enumerate() {
            assert_eq!(tok.encode(s).len(), SYSTEM_PROMPT_TOKENS[k]);
        }
        let mut last: HashMap<u64, String> = HashMap::new();
        for (a, b) in ids.requests.iter().zip(&texts.requests) {
            assert_eq!(
                (a.at_s, &a.prompt, a.output_tokens, a.session),
                (b.at_s, &b.prompt, b.output_tokens, b.session)
            );
            let t = b.text.as_ref().unwrap().text();
            assert!(systems.iter().any(|s| t.starts_with(&**s)));
            // Every step's text extends the previous step's.
            if let Some(prev) = last.get(&b.session.unwrap()) {
                assert!(t.starts_with(prev.as_str()));
            }
            last.insert(b.session.unwrap(), t);
        }
        // Token counts equal the ids' (a sample: tokenizing all is slow
        // in debug builds).
        for r in texts.requests.iter().step_by(7) {
            assert_eq!(tok.encode(&r.text.as_ref().unwrap().text()).len(), r.prompt.len());
        }
    }

    #[test]
    fn the_hottest_system_prompt_is_the_most_frequent() {
        let w = build(&params(4), None);
        let systems = system_prompts(4);
        let mut count = [0usize; 6];
        for r in &w.requests {
            let k = systems.iter().position(|s| r.prompt.starts_with(s)).unwrap();
            count[k] += 1;
        }
        let share = count[0] as f64 / w.requests.len() as f64;
        assert!((0.4..0.6).contains(&share), "{count:?}");
        assert!(count[1..].iter().all(|c| *c < count[0]), "{count:?}");
        let p = popularity();
        assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        assert!((0.45..0.52).contains(&p[0]));
    }

    #[test]
    fn steps_arrive_at_the_configured_rate_within_the_window() {
        let w = build(&params(5), None);
        // 12 sessions/s of 3.5 steps: 42 requests/s, 4 200 in 100 s.
        let n = w.requests.len();
        assert!((3800..=4600).contains(&n), "{n}");
        assert!(w.requests.iter().all(|r| (0.0..100.0).contains(&r.at_s)));
        let count = |lo: f64| w.requests.iter().filter(|r| (lo..lo + 20.0).contains(&r.at_s)).count();
        let (first, last) = (count(0.0) as f64, count(80.0) as f64);
        assert!((first / last - 1.0).abs() < 0.2, "{first} {last}");
        assert!(w.has_sessions());
    }
}
