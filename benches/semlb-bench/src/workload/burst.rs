//! The `burst` workload: a hot-prefix burst. Steady background chat
//! sessions on a few system prompts, then, at one instant, many new
//! sessions on one brand-new long system prompt, each continuing for a few
//! turns.
//!
//! It is what a launch, a scheduled job or a retry storm looks like to a
//! router: dozens of requests that share a long prefix no engine holds
//! yet arrive together. Sending them all to one engine computes the
//! prefix once but queues every one of them behind it (and the sessions
//! stay there, a hot spot); spreading them computes it on every engine
//! that gets one. The report gives the burst's own TTFT and SLO
//! attainment and the share of its requests the busiest engine served.
//!
//! # Generator (deterministic in `--seed`)
//!
//! * Background: [`BACKGROUND_SYSTEM_WORDS`], four system prompts of
//!   synthetic text (about 800–1 550 tokens with the bundled tokenizer);
//!   sessions start as a Poisson process of `--burst-background-rate`
//!   sessions per trace second over `[0, duration)`, each on a system
//!   prompt picked uniformly, of [`BACKGROUND_TURNS`] turns.
//! * Burst: at [`BURST_AT`] of the duration, `--burst-sessions` (default
//!   [`BURST_SESSIONS`]) sessions start at uniform times within
//!   [`BURST_WINDOW_S`] trace seconds, all on one new system prompt of
//!   [`BURST_SYSTEM_WORDS`] words (about 2 000 tokens) that no earlier
//!   request carried, each of [`BURST_TURNS`] turns.
//! * A turn adds a user question of 10–40 words; its answer
//!   ([`OUTPUT`] tokens, generated with `ignore_eos`) is appended to the
//!   session's messages before the next turn, which is sent the instant the
//!   answer ends (as in [`agents`](super::agents)). A call's `at_s` is its
//!   session's start plus the earlier calls' expected durations on an idle
//!   engine, the schedule rates are stated with. Session ids are sent as
//!   `x-session-id`.
//!
//! # Load
//!
//! The background is light: 2 sessions/s of 3.5 turns (7 calls/s) whose
//! new tokens per turn are ~110 (question and last answer) and whose first
//! turn prefills its system prompt unless its engine holds it: a few
//! percent of four engines' 40 000 tokens/s of prefill. The burst is 48
//! first turns of ~2 050 tokens within 0.1 s: ~98 000 tokens, 2.5 s of
//! all four engines' prefill if no engine reuses the new prompt, 0.2 s on
//! one engine plus 48 × ~50 uncached tokens if every session goes to the
//! engine that computed it first (which then decodes 48 sessions at once).

use semlb_test_support::Rng;

use super::{ChatCall, Request, Workload, WorkloadKind, expected_turn_s, exponential, tokens, uniform, words};

/// Words of the background system prompts.
pub const BACKGROUND_SYSTEM_WORDS: [usize; 4] = [600, 900, 1200, 800];

/// Words of the burst's system prompt (about 2 000 tokens).
pub const BURST_SYSTEM_WORDS: usize = 1540;

/// Sessions of the burst.
pub const BURST_SESSIONS: usize = 48;

/// Trace seconds within which the burst's sessions start.
pub const BURST_WINDOW_S: f64 = 0.1;

/// Where in the duration the burst starts (a fraction of it).
pub const BURST_AT: f64 = 0.4;

/// Turns of a background session, inclusive.
pub const BACKGROUND_TURNS: (u32, u32) = (2, 5);

/// Turns of a burst session, inclusive.
pub const BURST_TURNS: (u32, u32) = (3, 5);

/// Output tokens per turn, inclusive.
pub const OUTPUT: (u32, u32) = (32, 128);

/// The parameters of [`build`].
#[derive(Debug, Clone)]
pub struct BurstParams {
    /// Background sessions starting per trace second.
    pub background_sessions_per_s: f64,
    /// Trace seconds over which background sessions start.
    pub duration_s: f64,
    /// Sessions of the burst.
    pub burst_sessions: usize,
    /// Cap on a turn's output tokens.
    pub max_output: u32,
    /// Seed of the generator.
    pub seed: u64,
}

/// One session's calls starting at `start`, on system prompt `system` of
/// `system_words` words, of `turns` turns.
#[allow(clippy::too_many_arguments)]
fn session(
    rng: &mut Rng,
    requests: &mut Vec<Request>,
    session: u64,
    start: f64,
    system: usize,
    system_words: usize,
    turns: u32,
    max_output: u32,
) {
    let mut prompt = tokens(system_words);
    let mut new_tokens = prompt;
    let mut at = start;
    for step in 0..turns {
        let question = uniform(rng, 10, 40) as usize;
        let message = format!("Session {session}, question {step}: {}", words(rng, question));
        prompt += tokens(question + 4);
        new_tokens += tokens(question + 4);
        let output = uniform(rng, OUTPUT.0, OUTPUT.1).min(max_output.max(1));
        requests.push(Request::chat_call(
            at,
            session,
            output,
            ChatCall::new(system, step, message, prompt),
        ));
        at += expected_turn_s(new_tokens as usize, output);
        prompt += output;
        new_tokens = output;
    }
}

/// The trace second the burst starts at for `duration_s`.
pub fn burst_start_s(duration_s: f64) -> f64 {
    duration_s * BURST_AT
}

/// The workload of `params`.
pub fn build(params: &BurstParams) -> Workload {
    let mut rng = Rng(params.seed ^ 0x62_7572_7374);
    let mut systems: Vec<String> = BACKGROUND_SYSTEM_WORDS
        .iter()
        .enumerate()
        .map(|(k, n)| {
            format!(
                "You are the assistant of service {k}. Follow these rules:\n{}",
                words(&mut rng, *n)
            )
        })
        .collect();
    let burst_system = systems.len();
    systems.push(format!(
        "You are the assistant of the product launched today. Its manual:\n{}",
        words(&mut rng, BURST_SYSTEM_WORDS)
    ));
    let mut requests = Vec::new();
    let mut id = 0u64;
    let mut at = exponential(&mut rng, 1.0 / params.background_sessions_per_s);
    while at < params.duration_s {
        let system = (rng.next() % BACKGROUND_SYSTEM_WORDS.len() as u64) as usize;
        let turns = uniform(&mut rng, BACKGROUND_TURNS.0, BACKGROUND_TURNS.1);
        session(
            &mut rng,
            &mut requests,
            id,
            at,
            system,
            BACKGROUND_SYSTEM_WORDS[system],
            turns,
            params.max_output,
        );
        id += 1;
        at += exponential(&mut rng, 1.0 / params.background_sessions_per_s);
    }
    let burst_at = burst_start_s(params.duration_s);
    for _ in 0..params.burst_sessions {
        let start = burst_at + rng.unit() * BURST_WINDOW_S;
        let turns = uniform(&mut rng, BURST_TURNS.0, BURST_TURNS.1);
        session(
            &mut rng,
            &mut requests,
            id,
            start,
            burst_system,
            BURST_SYSTEM_WORDS,
            turns,
            params.max_output,
        );
        id += 1;
    }
    let source = format!(
        "generated: {} background sessions/s over {} s on {} system prompts, then {} sessions on a new ~{}-token \
         system prompt within {} s at {} s, seed {}",
        params.background_sessions_per_s,
        params.duration_s,
        BACKGROUND_SYSTEM_WORDS.len(),
        params.burst_sessions,
        tokens(BURST_SYSTEM_WORDS),
        BURST_WINDOW_S,
        burst_at,
        params.seed
    );
    let mut workload = Workload::new(WorkloadKind::Burst, requests, source, 0);
    workload.systems = systems;
    workload.burst_system = Some(burst_system);
    workload
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn params(seed: u64) -> BurstParams {
        BurstParams {
            background_sessions_per_s: 2.0,
            duration_s: 40.0,
            burst_sessions: BURST_SESSIONS,
            max_output: 2048,
            seed,
        }
    }

    #[test]
    fn the_burst_is_deterministic_in_the_seed() {
        let a = build(&params(1));
        assert_eq!(a.requests, build(&params(1)).requests);
        assert_eq!(a.systems, build(&params(1)).systems);
        assert_ne!(a.requests, build(&params(2)).requests);
        assert!(a.requests.windows(2).all(|p| p[0].at_s <= p[1].at_s));
    }

    #[test]
    fn burst_sessions_start_together_on_a_new_long_system_prompt() {
        let w = build(&params(3));
        let burst = w.burst_system.expect("a burst system prompt");
        assert_eq!(burst, BACKGROUND_SYSTEM_WORDS.len());
        // ~2 000 tokens with the bundled tokenizer's estimate.
        assert!((1900..=2100).contains(&tokens(BURST_SYSTEM_WORDS)));
        assert!(!w.systems[..burst].contains(&w.systems[burst]));
        let mut sessions: HashMap<u64, Vec<&Request>> = HashMap::new();
        for r in &w.requests {
            sessions.entry(r.session.unwrap()).or_default().push(r);
        }
        let calls = |r: &Request| r.chat.clone().unwrap();
        let (burst_sessions, background): (Vec<_>, Vec<_>) =
            sessions.values().partition(|s| calls(s[0]).system == burst);
        assert_eq!(burst_sessions.len(), BURST_SESSIONS);
        let at = burst_start_s(40.0);
        for s in &burst_sessions {
            let first = s.iter().map(|r| r.at_s).fold(f64::INFINITY, f64::min);
            assert!((at..at + BURST_WINDOW_S).contains(&first), "{first}");
            assert!((BURST_TURNS.0 as usize..=BURST_TURNS.1 as usize).contains(&s.len()));
        }
        // No request before the burst carries its prompt.
        assert!(
            w.requests
                .iter()
                .filter(|r| r.at_s < at)
                .all(|r| calls(r).system != burst)
        );
        // 2 sessions/s over 40 s: about 80 background sessions.
        assert!((50..=110).contains(&background.len()), "{}", background.len());
        for s in sessions.values() {
            let steps: Vec<u32> = s.iter().map(|r| calls(r).step).collect();
            assert_eq!(steps, (0..s.len() as u32).collect::<Vec<_>>());
            assert!(s.iter().all(|r| (OUTPUT.0..=OUTPUT.1).contains(&r.output_tokens)));
        }
    }
}
