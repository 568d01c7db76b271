//! `POST /v1/embeddings`: the request (`input` in the forms of a completions
//! `prompt`) and the simulator's answer, a vector drawn from the tokens.

use bytes::Bytes;

use super::completions::parse_prompt;
use super::fields::{field, opt_string, parse_object};
use super::{ApiError, Prompt};

/// A validated `POST /v1/embeddings` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmbeddingRequest {
    /// `model`, if given.
    pub model: Option<String>,
    /// `input`: one text or token-id list (a batch of several is refused,
    /// as `prompt`'s).
    pub input: Prompt,
}

/// Length of the simulator's embeddings.
pub const EMBEDDING_DIMENSIONS: usize = 16;

impl EmbeddingRequest {
    /// Parses and validates a request body (`input` takes the forms of
    /// a completions `prompt`).
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let obj = parse_object(body)?;
        let model = opt_string(&obj, "model")?;
        let input = parse_prompt(field(&obj, "input")).map_err(|e| ApiError {
            message: e
                .message
                .replace("`prompt`", "`input`")
                .replace("The prompt", "The input"),
            param: Some("input".into()),
            ..e
        })?;
        Ok(Self { model, input })
    }
}

/// The answer to an embeddings request of `tokens` for `model`: a unit
/// vector of [`EMBEDDING_DIMENSIONS`] drawn from the tokens (the same
/// tokens, the same vector), and the usage.
pub fn embedding_body(model: &str, tokens: &[u32]) -> Bytes {
    let mut state = seahash::hash(&tokens.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>());
    let mut vector: Vec<f64> = (0..EMBEDDING_DIMENSIONS)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 11) as f64 / (1u64 << 53) as f64 - 0.5
        })
        .collect();
    let norm = vector.iter().map(|x| x * x).sum::<f64>().sqrt().max(f64::MIN_POSITIVE);
    vector.iter_mut().for_each(|x| *x /= norm);
    let body = serde_json::json!({
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": vector}],
        "model": model,
        "usage": {"prompt_tokens": tokens.len(), "total_tokens": tokens.len()},
    });
    Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
}
