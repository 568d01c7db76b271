//! Every parameter of the simulated engine, with its default and the reason
//! the default is realistic.
//!
//! The defaults model one vLLM replica serving an 8B model (Qwen3-8B or
//! Llama-3.1-8B class, bf16) on one A100-80GB with vLLM's own defaults:
//!
//! | parameter | default | why |
//! | --- | --- | --- |
//! | `block_size` | 16 tokens | vLLM's default KV block size on CUDA (`--block-size 16`) |
//! | `kv_capacity_tokens` | 400 000 | 80 GB × `--gpu-memory-utilization` 0.9 (vLLM's default) = 72 GB, less ~16 GB of weights and a few GB of activations ≈ 52 GB of KV; Qwen3-8B keeps 36 layers × 8 KV heads × 128 dims × 2 (K, V) × 2 bytes = 144 KiB per token → ≈ 380 K tokens (a public vLLM benchmark harness lists 478 560 tokens for Qwen3-8B on a 94 GB H100 NVL, the same figure scaled) |
//! | `max_num_seqs` | 256 | vLLM's OpenAI-server default on A100s and GPUs under 70 GiB (`EngineArgs::get_batch_defaults`; 1024 on H100-class GPUs) |
//! | `max_model_len` | 32 768 | Qwen3's native context length |
//! | `prefill_tokens_per_s` | 10 000 | an 8B model costs ≈ 16 GFLOP per token; the A100's 312 dense bf16 TFLOPS at ~50 % utilisation ≈ 10 K tokens/s |
//! | `decode_step_base_ms` | 10 ms | a decode step streams all 16 GB of weights: 16 GB / 2.0 TB/s = 8 ms, plus kernel launch and scheduling overhead |
//! | `decode_step_per_seq_ms` | 0.08 ms | each running sequence adds its KV reads and sampling; at 256 sequences a step takes ≈ 30 ms, the inter-token latency vLLM shows near saturation |
//! | `default_output_tokens` | 128 | output length when neither `max_tokens` nor the benchmark override is given |
//! | `time_scale` | 1.0 | real time; tests use e.g. 0.01 (100× faster) |

use std::time::Duration;

/// The engine model's parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Name the engine serves (`/v1/models`, the `model` field, metric labels).
    pub model_name: String,
    /// LoRA adapters it also serves, by name (vLLM's `--lora-modules`):
    /// requests may name them, `/v1/models` lists them with the base as
    /// `parent`, and their prompts are cached apart from the base model's
    /// (vLLM puts the adapter in every block's hash).
    pub lora_adapters: Vec<String>,
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV cache capacity in tokens (rounded down to whole blocks).
    pub kv_capacity_tokens: u64,
    /// Most sequences in the running batch.
    pub max_num_seqs: u32,
    /// Longest prompt + output accepted.
    pub max_model_len: u32,
    /// Simulated prefill speed for uncached prompt tokens.
    pub prefill_tokens_per_s: f64,
    /// Simulated duration of one decode step with an empty batch.
    pub decode_step_base_ms: f64,
    /// Extra duration of one decode step per running sequence.
    pub decode_step_per_seq_ms: f64,
    /// Output length when the request names none.
    pub default_output_tokens: u32,
    /// Real duration of one simulated second (1.0 = real time, 0.01 = 100× faster).
    pub time_scale: f64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            model_name: "semlb-sim".to_owned(),
            lora_adapters: Vec::new(),
            block_size: 16,
            kv_capacity_tokens: 400_000,
            max_num_seqs: 256,
            max_model_len: 32_768,
            prefill_tokens_per_s: 10_000.0,
            decode_step_base_ms: 10.0,
            decode_step_per_seq_ms: 0.08,
            default_output_tokens: 128,
            time_scale: 1.0,
        }
    }
}

impl EngineConfig {
    /// The prefix-cache root of requests naming `model`: 0 for the base
    /// model, a hash of the adapter's name for an adapter; `None` if it
    /// serves no such model.
    pub fn cache_root(&self, model: &str) -> Option<u64> {
        if model == self.model_name {
            return Some(0);
        }
        self.lora_adapters
            .iter()
            .any(|a| a == model)
            .then(|| seahash::hash(model.as_bytes()).max(1))
    }

    /// KV blocks in the cache.
    pub fn num_blocks(&self) -> u64 {
        self.kv_capacity_tokens / u64::from(self.block_size)
    }

    /// Simulated prefill time of `tokens` uncached tokens.
    pub fn prefill_time(&self, tokens: u64) -> Duration {
        Duration::from_secs_f64(tokens as f64 / self.prefill_tokens_per_s)
    }

    /// Simulated duration of one decode step of `seqs` sequences.
    pub fn decode_step_time(&self, seqs: usize) -> Duration {
        Duration::from_secs_f64((self.decode_step_base_ms + self.decode_step_per_seq_ms * seqs as f64) / 1000.0)
    }

    /// The real time that simulates `simulated`.
    pub fn real(&self, simulated: Duration) -> Duration {
        simulated.mul_f64(self.time_scale)
    }

    /// Checks the values; the error names the field, the value and the reason.
    pub fn validate(&self) -> Result<(), EngineConfigError> {
        if self.block_size == 0 {
            return Err(EngineConfigError::ZeroBlockSize);
        }
        if self.num_blocks() < 2 {
            return Err(EngineConfigError::KvCapacityUnderTwoBlocks(self.kv_capacity_tokens));
        }
        if self.max_num_seqs == 0 {
            return Err(EngineConfigError::ZeroMaxNumSeqs);
        }
        if self.prefill_tokens_per_s.is_nan() || self.prefill_tokens_per_s <= 0.0 {
            return Err(EngineConfigError::PrefillSpeedNotPositive(self.prefill_tokens_per_s));
        }
        if [self.decode_step_base_ms, self.decode_step_per_seq_ms]
            .iter()
            .any(|v| v.is_nan() || *v < 0.0)
        {
            return Err(EngineConfigError::NegativeDecodeStep {
                base_ms: self.decode_step_base_ms,
                per_seq_ms: self.decode_step_per_seq_ms,
            });
        }
        if !self.time_scale.is_finite() || self.time_scale <= 0.0 {
            return Err(EngineConfigError::TimeScaleNotPositive(self.time_scale));
        }
        Ok(())
    }
}

/// Why an [`EngineConfig`] is refused ([`EngineConfig::validate`]): each
/// message names the field, the value and the reason.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineConfigError {
    /// `block_size` is 0.
    #[error("block_size = 0: must be at least 1")]
    ZeroBlockSize,
    /// `kv_capacity_tokens` (the value) holds fewer than 2 blocks.
    #[error("kv_capacity_tokens = {0}: must hold at least 2 blocks")]
    KvCapacityUnderTwoBlocks(u64),
    /// `max_num_seqs` is 0.
    #[error("max_num_seqs = 0: must be at least 1")]
    ZeroMaxNumSeqs,
    /// `prefill_tokens_per_s` (the value) is not a positive number.
    #[error("prefill_tokens_per_s = {0}: must be positive")]
    PrefillSpeedNotPositive(f64),
    /// `decode_step_base_ms` or `decode_step_per_seq_ms` is negative (or NaN).
    #[error("decode_step_*_ms = {base_ms}/{per_seq_ms}: must not be negative")]
    NegativeDecodeStep {
        /// `decode_step_base_ms`.
        base_ms: f64,
        /// `decode_step_per_seq_ms`.
        per_seq_ms: f64,
    },
    /// `time_scale` (the value) is not a positive, finite number.
    #[error("time_scale = {0}: must be a positive number")]
    TimeScaleNotPositive(f64),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_valid() {
        assert_eq!(EngineConfig::default().validate(), Ok(()));
    }

    #[test]
    fn validation_messages_name_the_field_the_value_and_the_reason() {
        let message = |config: EngineConfig| config.validate().unwrap_err().to_string();
        let d = EngineConfig::default;
        for (config, expected) in [
            (
                EngineConfig { block_size: 0, ..d() },
                "block_size = 0: must be at least 1",
            ),
            (
                EngineConfig {
                    kv_capacity_tokens: 31,
                    ..d()
                },
                "kv_capacity_tokens = 31: must hold at least 2 blocks",
            ),
            (
                EngineConfig { max_num_seqs: 0, ..d() },
                "max_num_seqs = 0: must be at least 1",
            ),
            (
                EngineConfig {
                    prefill_tokens_per_s: 0.0,
                    ..d()
                },
                "prefill_tokens_per_s = 0: must be positive",
            ),
            (
                EngineConfig {
                    prefill_tokens_per_s: f64::NAN,
                    ..d()
                },
                "prefill_tokens_per_s = NaN: must be positive",
            ),
            (
                EngineConfig {
                    decode_step_per_seq_ms: -0.5,
                    ..d()
                },
                "decode_step_*_ms = 10/-0.5: must not be negative",
            ),
            (
                EngineConfig {
                    time_scale: f64::INFINITY,
                    ..d()
                },
                "time_scale = inf: must be a positive number",
            ),
        ] {
            assert_eq!(message(config), expected);
        }
    }
}
