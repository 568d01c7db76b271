//! The `chat` workload: multi-turn chats on a few shared system prompts,
//! sent by a fixed number of clients, each sending its next turn the
//! instant its answer ends and starting a new conversation when one ends.
//!
//! It is the workload where a routing policy can lose most by being
//! clever: a closed loop has no offered rate, so a policy that holds
//! requests it should have sent, or piles conversations on one engine,
//! shows it directly as fewer requests per second. `semlb bench replay`
//! runs it on four engine sets (engines with and without `/metrics`,
//! clients that stream and clients that do not; see
//! [`ChatSet`](crate::replay::ChatSet)), the robustness check of every
//! policy against `least_load`.
//!
//! # Generator (deterministic in `--seed`)
//!
//! * [`SYSTEM_PROMPT_WORDS`]: four system prompts (a team's rules) of
//!   synthetic text, about 650–1 050 tokens with the bundled tokenizer;
//!   each conversation picks one uniformly, so a quarter of the
//!   conversations share each.
//! * A conversation is [`TURNS`] turns (uniform); each turn adds a user
//!   question of 10–40 words, and its answer (16–64 output tokens,
//!   generated with `ignore_eos`) is appended to the messages before the
//!   next turn.
//! * Every request has `at_s` 0: there is no schedule. The replay starts
//!   `--chat-clients` clients (default 16) that take conversations in
//!   order, so the requests in flight stay at the number of clients.
//!
//! # Load
//!
//! A turn that stays on the engine holding its conversation prefills its
//! new tokens only (the last answer and the question, ~70 tokens); a
//! conversation's first turn prefills its system prompt unless its engine
//! holds it (~900 tokens). Decode is 40 tokens per turn on average, so
//! with 16 clients on four engines the engines spend most of their time
//! decoding small batches: the work a policy can waste is prefill of
//! system prompts and histories, and the throughput it can lose is
//! clients waiting at the gateway or on one busy engine.

use semlb_test_support::Rng;

use super::{ChatCall, Request, Workload, WorkloadKind, tokens, uniform, words};

/// Words of the system prompts.
pub const SYSTEM_PROMPT_WORDS: [usize; 4] = [500, 800, 600, 700];

/// Turns per conversation, inclusive.
pub const TURNS: (u32, u32) = (2, 6);

/// Output tokens per turn, inclusive.
pub const OUTPUT: (u32, u32) = (16, 64);

/// The parameters of [`build`].
#[derive(Debug, Clone)]
pub struct ChatParams {
    /// Conversations.
    pub conversations: usize,
    /// Cap on a turn's output tokens.
    pub max_output: u32,
    /// Seed of the generator.
    pub seed: u64,
    /// Sizes of the conversations.
    pub shape: ChatShape,
}

/// The sizes of a chat workload's conversations.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatShape {
    /// Words of each system prompt (one system prompt per entry).
    pub system_prompt_words: Vec<usize>,
    /// Turns per conversation, inclusive.
    pub turns: (u32, u32),
    /// Words of a user question, inclusive.
    pub question_words: (u32, u32),
    /// Output tokens per turn, inclusive.
    pub output: (u32, u32),
}

impl ChatShape {
    /// The `shared-prompt` workload: one system prompt of 700 words
    /// (about 900 tokens) that every conversation opens with, 6–14 turns
    /// (10 on average: 50 conversations are about 500 requests), the
    /// `chat` workload's questions and answers. The most common shape of
    /// real traffic (one application, one system prompt), and the one on
    /// which a router that follows the longest prefix alone sends every
    /// conversation to the engine that first computed the system prompt.
    pub fn shared_prompt() -> Self {
        Self {
            system_prompt_words: vec![700],
            turns: (6, 14),
            ..Self::default()
        }
    }
}

impl Default for ChatShape {
    /// The `chat` workload of `semlb bench replay` ([`SYSTEM_PROMPT_WORDS`],
    /// [`TURNS`], 10–40-word questions, [`OUTPUT`]).
    fn default() -> Self {
        Self {
            system_prompt_words: SYSTEM_PROMPT_WORDS.to_vec(),
            turns: TURNS,
            question_words: (10, 40),
            output: OUTPUT,
        }
    }
}

/// The workload of `params`.
pub fn build(params: &ChatParams) -> Workload {
    build_as(WorkloadKind::Chat, params)
}

/// The workload of `params`, reported as `kind` (`chat` or
/// `shared-prompt`).
pub fn build_as(kind: WorkloadKind, params: &ChatParams) -> Workload {
    let shape = &params.shape;
    let mut rng = Rng(params.seed ^ 0x6368_6174);
    let systems: Vec<String> = shape
        .system_prompt_words
        .iter()
        .enumerate()
        .map(|(k, n)| {
            format!(
                "You are the assistant of team {k}. Follow these rules:\n{}",
                words(&mut rng, *n)
            )
        })
        .collect();
    let mut requests = Vec::new();
    for conversation in 0..params.conversations {
        let system = (rng.next() % systems.len() as u64) as usize;
        let turns = uniform(&mut rng, shape.turns.0, shape.turns.1);
        let mut prompt = tokens(shape.system_prompt_words[system]);
        for step in 0..turns {
            let question = uniform(&mut rng, shape.question_words.0, shape.question_words.1) as usize;
            let message = format!(
                "Conversation {conversation}, question {step}: {}",
                words(&mut rng, question)
            );
            prompt += tokens(question + 4);
            let output = uniform(&mut rng, shape.output.0, shape.output.1).min(params.max_output.max(1));
            requests.push(Request::chat_call(
                0.0,
                conversation as u64,
                output,
                ChatCall::new(system, step, message, prompt),
            ));
            prompt += output;
        }
    }
    let source = format!(
        "generated: {} conversations of {}–{} turns, {} system prompts, seed {}",
        params.conversations,
        shape.turns.0,
        shape.turns.1,
        systems.len(),
        params.seed
    );
    let mut workload = Workload::new(kind, requests, source, 0);
    workload.systems = systems;
    workload
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversations_are_chains_of_turns_on_shared_system_prompts() {
        let params = ChatParams {
            conversations: 200,
            max_output: 2048,
            seed: 5,
            shape: ChatShape::default(),
        };
        let w = build(&params);
        assert_eq!(w.requests, build(&params).requests, "deterministic in the seed");
        let mut systems = [0usize; 4];
        let mut conversation = Vec::new();
        for r in &w.requests {
            let call = r.chat.as_ref().unwrap();
            assert_eq!((r.at_s, r.prompt.is_empty()), (0.0, true));
            assert!((OUTPUT.0..=OUTPUT.1).contains(&r.output_tokens));
            if call.step == 0 {
                systems[call.system] += 1;
                conversation.clear();
            }
            conversation.push(r);
            // In order, one conversation after the other, each on one
            // system prompt with a growing prompt.
            assert_eq!(call.step as usize + 1, conversation.len());
            assert!(conversation.windows(2).all(|p| {
                let (a, b) = (p[0].chat.as_ref().unwrap(), p[1].chat.as_ref().unwrap());
                p[0].session == p[1].session && a.system == b.system && b.prompt_tokens > a.prompt_tokens
            }));
        }
        assert!(systems.iter().all(|n| (25..=75).contains(n)), "{systems:?}");
        let turns = w.requests.len() as f64 / 200.0;
        assert!((3.5..=4.5).contains(&turns), "{turns} turns per conversation");
        // Conversations of one system prompt share it word for word.
        assert!(w.systems.iter().all(|s| s.starts_with("You are the assistant of team")));
    }
}
