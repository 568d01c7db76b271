//! Loading a replay workload: its trace or prompts from the data
//! directory, generated at the setting's size, or `None` with a message
//! when its data is missing.

use anyhow::{Result, bail};
use semlb_tokenizer::Tokenizer;

use super::args::{ReplayArgs, Setting};
use crate::dispatch_path::{PROMPTS_FILE, TOKENIZER_FILE};
use crate::end_to_end::read_dialogues;
use crate::workload::agents::{self, AgentsParams};
use crate::workload::burst::{self, BurstParams};
use crate::workload::chat::{self, ChatParams};
use crate::workload::hh_rlhf::{self, HhRlhfParams};
use crate::workload::hot_prefix::{self, HotPrefixParams};
use crate::workload::text::{self, Fidelity, TextGen};
use crate::workload::{PromptForm, Workload, WorkloadKind, mooncake};

/// The workload `kind`, or `None` (with a message) when its data is missing.
pub(super) fn load_workload(args: &ReplayArgs, kind: WorkloadKind, setting: &Setting) -> Result<Option<Workload>> {
    let data = args.common.data_dir();
    // The text form is built for the engines' tokenizer.
    let engine_tokenizer = text::engine_tokenizer();
    let text_gen = (args.prompt_form == PromptForm::Text).then(|| TextGen::new(&engine_tokenizer));
    // What the fidelity line must add: a token-id form in another
    // tokenizer's ids.
    let mut ids_note = "";
    let mut workload = match kind {
        WorkloadKind::Mooncake => {
            let Some(path) = args
                .trace
                .clone()
                .or_else(|| data.as_ref().map(|d| d.join(mooncake::TRACE_FILE)))
            else {
                println!(
                    "skipping mooncake: no trace (pass --trace PATH or --data DIR with {})",
                    mooncake::TRACE_FILE
                );
                return Ok(None);
            };
            mooncake::load(
                &path,
                setting.duration_s,
                args.limit,
                args.max_output,
                args.seed,
                text_gen.as_ref(),
            )?
        }
        WorkloadKind::HhRlhf => {
            let Some(path) = data.as_ref().map(|d| d.join(PROMPTS_FILE)).filter(|p| p.is_file()) else {
                println!("skipping hh-rlhf: no dialogues (pass --data DIR with {PROMPTS_FILE})");
                return Ok(None);
            };
            let dialogues = read_dialogues(&path)?;
            if dialogues.is_empty() {
                bail!("{} holds no dialogues", path.display());
            }
            let tokenizer = match data.as_ref().map(|d| d.join(TOKENIZER_FILE)).filter(|p| p.is_file()) {
                Some(p) => {
                    ids_note = " (the token-id form is Qwen3's ids, and its lengths and outputs Qwen3 tokens; the \
                                engines count phi-2 tokens, hence the length difference)";
                    Tokenizer::from_file(&p)
                        .map_err(|e| anyhow::anyhow!("cannot load the tokenizer {}: {e}", p.display()))?
                }
                None => Tokenizer::bundled(),
            };
            let params = HhRlhfParams {
                conversations_per_s: args.hh_rlhf_rate,
                duration_s: setting.duration_s,
                max_output: args.max_output,
                seed: args.seed,
            };
            hh_rlhf::build(
                &dialogues,
                &tokenizer,
                &params,
                &path.display().to_string(),
                text_gen.is_some(),
            )
        }
        WorkloadKind::HotPrefix => hot_prefix::build(
            &HotPrefixParams {
                sessions_per_s: args.hot_prefix_rate,
                duration_s: setting.duration_s,
                max_output: args.max_output,
                seed: args.seed,
            },
            text_gen.as_ref(),
        ),
        WorkloadKind::Agents => agents::build(&AgentsParams {
            sessions_per_s: args.agents_rate,
            duration_s: setting.duration_s,
            max_output: args.max_output,
            seed: args.seed,
        }),
        WorkloadKind::Chat => chat::build(&ChatParams {
            conversations: args.chat_conversations,
            max_output: args.max_output,
            seed: args.seed,
            shape: chat::ChatShape::default(),
        }),
        WorkloadKind::SharedPrompt | WorkloadKind::ScaleOut => chat::build_as(
            kind,
            &ChatParams {
                conversations: args.shared_prompt_conversations,
                max_output: args.max_output,
                seed: args.seed,
                shape: chat::ChatShape::shared_prompt(),
            },
        ),
        WorkloadKind::Burst => burst::build(&BurstParams {
            background_sessions_per_s: args.burst_background_rate,
            duration_s: setting.duration_s,
            burst_sessions: args.burst_sessions,
            max_output: args.max_output,
            seed: args.seed,
        }),
    };
    if let Some(n) = args.limit {
        workload.requests.truncate(n);
    }
    if workload.requests.is_empty() {
        bail!("{kind}: no requests (raise --duration or the rate)");
    }
    if workload.prompt_form() == Some(PromptForm::Text) {
        let f = Fidelity::measure(&workload.requests, &engine_tokenizer);
        println!(
            "{kind}, text form, measured with the engines' tokenizer (bundled phi-2): {}{ids_note}",
            f.describe()
        );
        workload.fidelity = Some(f);
    }
    Ok(Some(workload))
}
