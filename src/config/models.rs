//! `[[model]]`: a model pool — the name clients ask for, its aliases, the
//! backends that serve it, and how its prompts are tokenized, hashed and
//! routed. A LoRA adapter is a model with a `base`.
//!
//! Without any `[[model]]` table the gateway has one implicit pool: every
//! backend, any `model` name, the global `tokenizer`, `chat_template`,
//! `block_size` and `[policy]` (what `--backend URL` gives). With them,
//! requests route by their `model` field to that model's backends only, an
//! unknown model gets OpenAI's 404 `model_not_found`, and backends no model
//! lists take no inference requests.
//!
//! | key | type | default | meaning |
//! | --- | --- | --- | --- |
//! | `name` | string | required | the name clients send in `model`, and the one sent to its engines (their served name) |
//! | `aliases` | array of strings | `[]` | other names clients may send; the gateway rewrites them to `name` before forwarding |
//! | `backends` | array of strings | required (an adapter: its base's) | the `[[backend]]`s serving it, by `name` or by URL |
//! | `base` | string | none | makes this a LoRA adapter of that model: served by a subset of its backends, with its tokenizer, template and block size, and a prefix keyspace of its own |
//! | `tokenizer` | path | the global `tokenizer` | its `tokenizer.json` (or GGUF file) |
//! | `chat_template` | path | the global `chat_template`, or the model's GGUF tokenizer's | its `tokenizer_config.json` (or GGUF file) |
//! | `block_size` | integer | the global `block_size` | its engines' KV block size |
//! | `[model.resume]` | table | the global `[resume]` | its streams' resumption: a whole `[resume]` table (`enabled`, `max_attempts`, `stall_ms`), not merged with the global one |
//! | `[model.policy]` | table | the global `[policy]` | its routing policy: a whole `[policy]` table, not merged with the global one; its `queue` table is not used (the gateway queue is one per dispatcher, with the global `[policy.queue]`) |
//!
//! Pools change on reload (SIGHUP) and through the admin API, which keeps
//! its changes in `admin.models_file` ([`super::ModelChanges`]), merged
//! over these tables: dispatchers and response processes load
//! a changed pool's tokenizer, and keep a pool's policy (with what it
//! learned) while its configuration stays the same.

use std::collections::HashMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{BackendConfig, ConfigError, MAX_BLOCK_SIZE, quoted};
use crate::routing::PolicyConfig;
use crate::tenancy::rate_limit::RateLimits;

/// Most `[[model]]` tables.
pub const MAX_MODELS: usize = 256;
/// Longest model name or alias, in bytes.
pub const MAX_MODEL_NAME_BYTES: usize = 256;

/// One model pool (a `[[model]]` table).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The name clients ask for and its engines serve.
    pub name: String,
    /// Other names clients may ask for it by.
    #[serde(default)]
    pub aliases: Vec<String>,
    /// The backends serving it: `[[backend]]` names or URLs.
    #[serde(default)]
    pub backends: Vec<String>,
    /// The model this one is a LoRA adapter of.
    #[serde(default)]
    pub base: Option<String>,
    /// Its tokenizer; `None`: the global one.
    #[serde(default)]
    pub tokenizer: Option<PathBuf>,
    /// Its chat template; `None`: the global one.
    #[serde(default)]
    pub chat_template: Option<PathBuf>,
    /// Its engines' KV block size; `None`: the global one.
    #[serde(default)]
    pub block_size: Option<usize>,
    /// Its routing policy; `None`: the global `[policy]`.
    #[serde(default)]
    pub policy: Option<PolicyConfig>,
    /// Requests per minute to it, every tenant's together
    /// ([`crate::tenancy::rate_limit`]).
    #[serde(default)]
    pub requests_per_minute: Option<u64>,
    /// Prompt and output tokens per minute of it, every tenant's together.
    #[serde(default)]
    pub tokens_per_minute: Option<u64>,
    /// Its streams' resumption; `None`: the global `[resume]`.
    #[serde(default)]
    pub resume: Option<super::ResumeConfig>,
}

impl ModelConfig {
    /// A base model `name` served by `backends`, with the global settings.
    pub fn new(name: impl Into<String>, backends: &[&str]) -> Self {
        Self {
            name: name.into(),
            aliases: Vec::new(),
            backends: backends.iter().map(|b| (*b).to_owned()).collect(),
            base: None,
            tokenizer: None,
            chat_template: None,
            block_size: None,
            policy: None,
            requests_per_minute: None,
            tokens_per_minute: None,
            resume: None,
        }
    }

    /// Its rate limits.
    pub fn limits(&self) -> RateLimits {
        RateLimits {
            requests_per_minute: self.requests_per_minute,
            tokens_per_minute: self.tokens_per_minute,
        }
    }

    /// The pool of an admin API body (`POST /admin/models`, or `PUT
    /// /admin/models/{named}` with `named`, which the body may leave out
    /// or must repeat), not yet validated; the error says what is wrong.
    pub fn from_admin_body(mut body: serde_json::Value, named: Option<&str>) -> Result<Self, ModelError> {
        let Some(object) = body.as_object_mut() else {
            return Err(ModelError::NotObject);
        };
        if let Some(named) = named {
            match object.get("name") {
                None => {
                    object.insert("name".into(), serde_json::Value::from(named));
                }
                Some(name) if name == named => {}
                Some(name) => {
                    return Err(ModelError::Renamed {
                        body: name.clone(),
                        path: named.to_owned(),
                    });
                }
            }
        }
        serde_json::from_value(body).map_err(ModelError::Table)
    }

    /// Every name it answers to: its name, then its aliases.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.name.as_str()).chain(self.aliases.iter().map(String::as_str))
    }
}

/// Why a model pool from the admin API, or a name of a pool, is refused.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The admin API body is not a JSON object.
    #[error("the body must be a JSON object: a [[model]] table")]
    NotObject,
    /// The body names another pool than the path (`PUT
    /// /admin/models/{path}`); `body` is its `name`, as JSON.
    #[error("the body names {body}, the path {path:?}; rename a pool by adding the new one and removing the old")]
    Renamed {
        /// The body's `name` value.
        body: serde_json::Value,
        /// The name in the path.
        path: String,
    },
    /// The body is not a `[[model]]` table.
    #[error("not a [[model]] table: {0}")]
    Table(serde_json::Error),
    /// A name or alias that is empty or longer than [`MAX_MODEL_NAME_BYTES`].
    #[error("must be 1 to {MAX_MODEL_NAME_BYTES} bytes")]
    NameLength,
    /// A name or alias with control characters or spaces around it.
    #[error("must have no control characters and no leading or trailing spaces")]
    NameCharacters,
}

/// Whether `name` may be a model name: 1 to [`MAX_MODEL_NAME_BYTES`]
/// bytes, no control characters, no leading or trailing space.
fn check_model_name(name: &str) -> Result<(), ModelError> {
    if name.is_empty() || name.len() > MAX_MODEL_NAME_BYTES {
        return Err(ModelError::NameLength);
    }
    if name.chars().any(char::is_control) || name.trim() != name {
        return Err(ModelError::NameCharacters);
    }
    Ok(())
}

/// The index of the backend `reference` names: a `[[backend]]`'s name (or
/// its default name, `host:port`), or its URL.
pub fn backend_index(backends: &[BackendConfig], reference: &str) -> Option<usize> {
    let url = reference.parse::<super::BackendUrl>().ok();
    backends
        .iter()
        .position(|b| b.display_name() == reference)
        .or_else(|| url.and_then(|u| backends.iter().position(|b| b.parsed_url().ok().as_ref() == Some(&u))))
}

/// Checks the `[[model]]` tables against each other and the backends; the
/// first problem, naming `model[i].key`.
/// With `discovered`, a pool may list no backend: discovery adds them.
pub(super) fn validate_models(
    models: &[ModelConfig],
    backends: &[BackendConfig],
    discovered: bool,
) -> Result<(), ConfigError> {
    use ConfigError as E;
    if models.len() > MAX_MODELS {
        return Err(E::invalid(
            "model",
            format!("[{} tables]", models.len()),
            format!("at most {MAX_MODELS} models"),
        ));
    }
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (i, model) in models.iter().enumerate() {
        for (j, name) in model.names().enumerate() {
            let field = if j == 0 {
                format!("model[{i}].name")
            } else {
                format!("model[{i}].aliases")
            };
            check_model_name(name).map_err(|reason| E::invalid(&field, quoted(name), reason))?;
            if let Some(first) = seen.insert(name, i) {
                return Err(E::invalid(
                    field,
                    quoted(name),
                    format!("model[{first}] answers to that name already; names and aliases must be unique"),
                ));
            }
        }
        for reference in &model.backends {
            if backend_index(backends, reference).is_none() {
                return Err(E::invalid(
                    format!("model[{i}].backends"),
                    quoted(reference),
                    "no [[backend]] has that name or URL",
                ));
            }
        }
        if let Some(size) = model.block_size
            && !(1..=MAX_BLOCK_SIZE).contains(&size)
        {
            return Err(E::invalid(
                format!("model[{i}].block_size"),
                size,
                format!("must be between 1 and {MAX_BLOCK_SIZE} tokens"),
            ));
        }
        for (key, path) in [("tokenizer", &model.tokenizer), ("chat_template", &model.chat_template)] {
            if path.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
                return Err(E::invalid(
                    format!("model[{i}].{key}"),
                    "\"\"",
                    "must not be empty (leave it out for the global one)",
                ));
            }
        }
        model
            .limits()
            .check()
            .map_err(|field| E::invalid(format!("model[{i}].{field}"), 0, RateLimits::AT_LEAST_ONE))?;
        if let Some(resume) = &model.resume {
            resume.validate(&format!("model[{i}].resume"))?;
        }
        if let Some(policy) = &model.policy {
            policy
                .validate()
                .map_err(|e| E::invalid(format!("model[{i}].policy.{}", e.field), &e.value, e.reason.clone()))?;
        }
    }
    for (i, model) in models.iter().enumerate() {
        let Some(base_name) = &model.base else {
            if model.backends.is_empty() && !discovered {
                return Err(E::invalid(
                    format!("model[{i}].backends"),
                    "[]",
                    "list the backends that serve it (their names or URLs)",
                ));
            }
            continue;
        };
        let base = models.iter().find(|m| m.name == *base_name).ok_or_else(|| {
            E::invalid(
                format!("model[{i}].base"),
                quoted(base_name),
                "no [[model]] has that name (an adapter's base is a model's name, not an alias)",
            )
        })?;
        if base.base.is_some() {
            return Err(E::invalid(
                format!("model[{i}].base"),
                quoted(base_name),
                "is an adapter itself; an adapter's base must be a base model",
            ));
        }
        for (key, set) in [
            ("tokenizer", model.tokenizer.is_some()),
            ("chat_template", model.chat_template.is_some()),
            ("block_size", model.block_size.is_some()),
        ] {
            if set {
                return Err(E::invalid(
                    format!("model[{i}].{key}"),
                    "(set)",
                    "an adapter uses its base model's; leave it out",
                ));
            }
        }
        let of_base: Vec<Option<usize>> = base.backends.iter().map(|r| backend_index(backends, r)).collect();
        for reference in &model.backends {
            if !of_base.contains(&backend_index(backends, reference)) {
                return Err(E::invalid(
                    format!("model[{i}].backends"),
                    quoted(reference),
                    format!(
                        "does not serve its base model {base_name:?}; an adapter is served by some of its base's backends"
                    ),
                ));
            }
        }
    }
    Ok(())
}
