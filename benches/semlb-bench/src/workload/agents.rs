//! The `agents` workload: agent loops as agent frameworks run them, each
//! call sent the instant the previous answer ends.
//!
//! Unlike the other workloads (token-id completions at scheduled times),
//! these are **chat** requests whose history carries the engine's real
//! answers, and a session is **closed-loop**: call j+1 goes out when call
//! j's stream ends, with call j's answer as an assistant message and a tool
//! result as the next message. That is the case learning at dispatch is
//! for: the next call arrives before a response process can have written
//! the answer back.
//!
//! # Generator (deterministic in `--seed`)
//!
//! * [`SYSTEM_PROMPT_WORDS`]: four system prompts (tool catalogues) of
//!   synthetic text, about 1 300–4 000 tokens with the bundled tokenizer.
//! * Sessions start as a Poisson process of `--agents-rate` sessions per
//!   trace second over `[0, duration)`; every session is sent whole (its
//!   later calls may fall after the window). Each picks a system prompt
//!   uniformly.
//! * A session is 5 to 20 calls (uniform). Call 1 is the system prompt and
//!   a task of 60–200 words; call j+1 adds call j's answer (64–256 output
//!   tokens, generated with `ignore_eos`) and a tool result of 40–300
//!   words. The session id is sent as `x-session-id`.
//! * A request's `at_s` is its session's start for call 1 and, for later
//!   calls, the time they would be sent on an idle engine (the session's
//!   start plus each earlier call's expected duration): the schedule the
//!   report states rates and loads with. The calls themselves are sent when
//!   the previous one ends, whatever the engines do.
//!
//! # Load
//!
//! A session makes 12.5 calls on average. A call that stays on the engine
//! holding its history prefills only its new tokens: the previous answer
//! (160 on average) and tool result (~220 tokens), ≈ 380 tokens; one that
//! moves prefills its whole history (the system prompt, ~2 600 tokens on
//! average, plus ~380 per earlier call: ≈ 5 000 on average). At the default
//! 1.5 sessions/s (≈ 19 calls/s) that is ≈ 7 100 tokens/s with perfect
//! affinity (18 % of four engines' 40 000 tokens/s) and ≈ 94 000 tokens/s
//! (235 %) with none; decode is 160 tokens per call.

use semlb_test_support::Rng;

use super::{ChatCall, Request, Workload, WorkloadKind, expected_turn_s, exponential, tokens, uniform, words};

/// Words of the system prompts.
pub const SYSTEM_PROMPT_WORDS: [usize; 4] = [1000, 2200, 1500, 3000];

/// Calls per session, inclusive.
pub const CALLS: (u32, u32) = (5, 20);

/// The parameters of [`build`].
#[derive(Debug, Clone)]
pub struct AgentsParams {
    /// Sessions starting per trace second.
    pub sessions_per_s: f64,
    /// Trace seconds over which sessions start.
    pub duration_s: f64,
    /// Cap on a call's output tokens.
    pub max_output: u32,
    /// Seed of the generator.
    pub seed: u64,
}

/// The system prompts: tool catalogues of [`SYSTEM_PROMPT_WORDS`] words.
fn system_prompts(rng: &mut Rng) -> Vec<String> {
    SYSTEM_PROMPT_WORDS
        .iter()
        .enumerate()
        .map(|(k, n)| format!("You are agent {k}. Tools you may call:\n{}", words(rng, *n)))
        .collect()
}

/// The workload of `params`.
pub fn build(params: &AgentsParams) -> Workload {
    let mut rng = Rng(params.seed ^ 0x6167_656e_7473);
    let systems = system_prompts(&mut rng);
    let mut requests = Vec::new();
    let mut at = exponential(&mut rng, 1.0 / params.sessions_per_s);
    let mut session = 0u64;
    while at < params.duration_s {
        let system = (rng.next() % systems.len() as u64) as usize;
        let calls = uniform(&mut rng, CALLS.0, CALLS.1);
        let task = uniform(&mut rng, 60, 200) as usize;
        let mut prompt = tokens(SYSTEM_PROMPT_WORDS[system]) + tokens(task);
        let mut message = format!("Task {session}: {}", words(&mut rng, task));
        let mut new_tokens = prompt;
        let mut t = at;
        for step in 0..calls {
            let output = uniform(&mut rng, 64, 256).min(params.max_output.max(1));
            requests.push(Request::chat_call(
                t,
                session,
                output,
                ChatCall::new(system, step, message, prompt),
            ));
            t += expected_turn_s(new_tokens as usize, output);
            let tool = uniform(&mut rng, 40, 300) as usize;
            message = format!("Tool result {step}: {}", words(&mut rng, tool));
            new_tokens = output + tokens(tool);
            prompt += new_tokens;
        }
        session += 1;
        at += exponential(&mut rng, 1.0 / params.sessions_per_s);
    }
    let source = format!(
        "generated: {} sessions/s over {} s, {}–{} calls each, 4 system prompts, seed {}",
        params.sessions_per_s, params.duration_s, CALLS.0, CALLS.1, params.seed
    );
    let mut workload = Workload::new(WorkloadKind::Agents, requests, source, 0);
    workload.systems = systems;
    workload
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> AgentsParams {
        AgentsParams {
            sessions_per_s: 1.5,
            duration_s: 60.0,
            max_output: 2048,
            seed: 3,
        }
    }

    #[test]
    fn sessions_are_closed_loop_chains_of_calls() {
        let w = build(&params());
        assert_eq!(w.requests, build(&params()).requests, "deterministic in the seed");
        assert_eq!(w.systems.len(), 4);
        let mut sessions: std::collections::HashMap<u64, Vec<&Request>> = Default::default();
        for r in &w.requests {
            sessions.entry(r.session.unwrap()).or_default().push(r);
        }
        assert!((60..=120).contains(&sessions.len()), "{} sessions", sessions.len());
        for calls in sessions.values() {
            assert!((CALLS.0 as usize..=CALLS.1 as usize).contains(&calls.len()));
            let agent: Vec<&ChatCall> = calls.iter().map(|r| r.chat.as_ref().unwrap()).collect();
            assert!(
                agent.iter().enumerate().all(|(i, a)| a.step == i as u32),
                "in step order"
            );
            assert!(
                agent
                    .windows(2)
                    .all(|w| w[1].prompt_tokens > w[0].prompt_tokens && w[1].system == w[0].system)
            );
            assert!(agent[0].message.starts_with("Task ") && agent[1].message.starts_with("Tool result 0"));
            assert!(calls.iter().all(|r| (64..=256).contains(&r.output_tokens)));
        }
        assert!(w.requests.iter().all(|r| r.at_s >= 0.0 && r.prompt.is_empty()));
    }
}
