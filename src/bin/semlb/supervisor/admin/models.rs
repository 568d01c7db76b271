//! The supervisor's side of the admin API's model pools
//! (`/admin/models`, [`crate::supervisor::admin::http`]): a change is checked, kept in
//! `admin.models_file` ([`ModelChanges`]) and put in force as a reload.
//!
//! A change is taken only when the whole configuration it makes validates
//! (the configuration file, the flags, the pools changed before and this
//! one: [`super::reload::reloaded_config`]) and the tokenizer and chat
//! template it names load. Then the file is written and the supervisor
//! applies the configuration exactly as a reload does
//! ([`Supervisor::apply`]): backends a pool names by URL are registered,
//! those no longer named drain, and the dispatchers, told to reload, read
//! the same files. The answer carries the configuration revision, which
//! the admin API waits for every dispatcher to run.
//!
//! Two changes are refused because they would change how every other
//! model routes: adding a pool to a gateway with none (its implicit pool
//! takes any model name on every backend; with one pool, every other name
//! would get 404), and removing the last pool. Define pools in the
//! configuration file for that.

use std::path::{Path, PathBuf};

use http::StatusCode as S;
use semlb::config::{ModelChanges, ModelConfig, ServeConfig};
use semlb::pools::TokenizerLoader;
use serde_json::{Value, json};

use super::http::{ModelRequest, Reply};
use crate::supervisor::Supervisor;
use crate::supervisor::reload::reloaded_config;

impl Supervisor<'_> {
    /// Carries out a model request and answers it.
    pub(in crate::supervisor) async fn answer_model_request(&mut self, request: ModelRequest) -> Reply {
        match request {
            ModelRequest::List => self.list_models(),
            ModelRequest::Get(name) => self.get_model(&name),
            ModelRequest::Set { model, replace } => self.set_model(*model, replace).await,
            ModelRequest::Remove(name) => self.remove_model(&name),
        }
    }

    /// The changes kept so far (none without `admin.models_file`).
    fn kept_changes(&self) -> Result<ModelChanges, Reply> {
        match &self.config.admin.models_file {
            Some(path) => ModelChanges::load(path).map_err(|e| {
                Reply::error(
                    S::CONFLICT,
                    format!("admin.models_file does not read: {e}; fix or remove it, then reload"),
                    "models_file_invalid",
                )
            }),
            None => Ok(ModelChanges::default()),
        }
    }

    /// `GET /admin/models`.
    fn list_models(&self) -> Reply {
        let changes = self.kept_changes().unwrap_or_default();
        let models: Vec<Value> = self.config.models.iter().map(|m| model_json(m, &changes)).collect();
        Reply::new(
            S::OK,
            json!({
                "models": models,
                "models_file": self.config.admin.models_file,
                "revision": self.revision,
            }),
        )
    }

    /// `GET /admin/models/{name}`.
    fn get_model(&self, name: &str) -> Reply {
        match self.config.models.iter().find(|m| m.name == name) {
            Some(model) => Reply::new(S::OK, model_json(model, &self.kept_changes().unwrap_or_default())),
            None => unknown_model(name),
        }
    }

    /// `POST /admin/models` (`replace` false) and `PUT /admin/models/{name}`.
    async fn set_model(&mut self, model: ModelConfig, replace: bool) -> Reply {
        let path = match self.models_file() {
            Ok(path) => path,
            Err(reply) => return reply,
        };
        if let Some(reply) = relative_file(&model) {
            return reply;
        }
        if self.config.models.is_empty() {
            return Reply::error(
                S::CONFLICT,
                "this gateway has no [[model]] pools: one implicit pool takes every model name on every backend, \
                 and adding a pool would make every other name 404. Define the pools in the configuration file first",
                "implicit_pool",
            );
        }
        let existing = self.config.models.iter().find(|m| m.name == model.name);
        if !replace
            && let Some(taken) = self
                .config
                .models
                .iter()
                .find(|m| model.names().any(|n| m.names().any(|o| o == n)))
        {
            return Reply::error(
                S::CONFLICT,
                format!(
                    "the pool {:?} answers to a name of this one already; PUT /admin/models/{{name}} replaces a pool",
                    taken.name
                ),
                "model_exists",
            );
        }
        let added = existing.is_none();
        let mut changes = match self.checked_changes() {
            Ok(changes) => changes,
            Err(reply) => return reply,
        };
        changes.set(model.clone());
        let new = match reloaded_config(self.args, &self.config, Some(&changes)) {
            Ok(new) => new,
            Err(e) => {
                return Reply::error(S::BAD_REQUEST, format!("the pool does not fit: {e}"), "invalid_model");
            }
        };
        if let Err(reply) = tokenization_loads(&new, &model).await {
            return reply;
        }
        if let Err(reply) = save(&changes, &path) {
            return reply;
        }
        let revision = self.apply(new);
        tracing::info!(model = %model.name, revision, "admin: model pool {:?} {}", model.name, if added { "added" } else { "replaced" });
        Reply::applied(
            if added { S::CREATED } else { S::OK },
            model_json(&model, &changes),
            revision,
        )
    }

    /// `DELETE /admin/models/{name}`.
    fn remove_model(&mut self, name: &str) -> Reply {
        let path = match self.models_file() {
            Ok(path) => path,
            Err(reply) => return reply,
        };
        if !self.config.models.iter().any(|m| m.name == name) {
            return unknown_model(name);
        }
        let adapters: Vec<&str> = self
            .config
            .models
            .iter()
            .filter(|m| m.base.as_deref() == Some(name))
            .map(|m| m.name.as_str())
            .collect();
        if !adapters.is_empty() {
            return Reply::error(
                S::CONFLICT,
                format!("{name:?} is the base model of the adapters {adapters:?}; remove them first"),
                "model_in_use",
            );
        }
        if self.config.models.len() == 1 {
            return Reply::error(
                S::CONFLICT,
                format!(
                    "{name:?} is the last pool; without pools one implicit pool would take every model name on every backend. \
                     Add another pool first, or change the configuration file"
                ),
                "last_pool",
            );
        }
        let mut changes = match self.checked_changes() {
            Ok(changes) => changes,
            Err(reply) => return reply,
        };
        // Whether the configuration file defines it (then its removal is kept).
        let in_file = match reloaded_config(self.args, &self.config, Some(&ModelChanges::default())) {
            Ok(file) => file.models.iter().any(|m| m.name == name),
            Err(e) => return file_invalid(&e),
        };
        changes.remove(name, in_file);
        let new = match reloaded_config(self.args, &self.config, Some(&changes)) {
            Ok(new) => new,
            Err(e) => {
                return Reply::error(S::CONFLICT, format!("without {name:?}: {e}"), "model_in_use");
            }
        };
        if let Err(reply) = save(&changes, &path) {
            return reply;
        }
        let revision = self.apply(new);
        tracing::info!(model = %name, revision, "admin: model pool {name:?} removed");
        Reply::applied(S::OK, json!({"removed": name}), revision)
    }

    /// `admin.models_file`, or the `409` saying it is needed.
    fn models_file(&self) -> Result<PathBuf, Reply> {
        self.config.admin.models_file.clone().ok_or_else(|| {
            Reply::error(
                S::CONFLICT,
                "pools change through the admin API only with [admin] models_file set (where the changes are kept); \
                 set it and restart, or change the configuration file and reload",
                "models_file_unset",
            )
        })
    }

    /// The kept changes, once the configuration with them resolves as it
    /// is now (else the configuration file is at fault, not the request).
    fn checked_changes(&self) -> Result<ModelChanges, Reply> {
        let changes = self.kept_changes()?;
        reloaded_config(self.args, &self.config, Some(&changes)).map_err(|e| file_invalid(&e))?;
        Ok(changes)
    }
}

/// A pool as the admin API shows it: its `[[model]]` table and where it
/// comes from.
fn model_json(model: &ModelConfig, changes: &ModelChanges) -> Value {
    let mut value = serde_json::to_value(model).unwrap_or_else(|_| json!({"name": model.name}));
    if let Some(object) = value.as_object_mut() {
        object.retain(|_, v| !v.is_null());
        let source = if changes.sets(&model.name) { "admin" } else { "config" };
        object.insert("source".into(), json!(source));
    }
    value
}

/// `404 model_not_found`, as the gateway answers an unknown model.
fn unknown_model(name: &str) -> Reply {
    Reply::error(
        S::NOT_FOUND,
        format!("no model pool is named {name:?} (GET /admin/models lists them)"),
        "model_not_found",
    )
}

/// `409`: the configuration does not resolve as it is now.
fn file_invalid(error: &str) -> Reply {
    Reply::error(
        S::CONFLICT,
        format!("the configuration does not validate as it is now ({error}); fix it first"),
        "configuration_invalid",
    )
}

/// `400` when the model names a tokenizer or template by a relative path
/// (relative to what, on the gateway host?).
fn relative_file(model: &ModelConfig) -> Option<Reply> {
    [("tokenizer", &model.tokenizer), ("chat_template", &model.chat_template)]
        .into_iter()
        .find_map(|(key, path)| {
            path.as_deref().filter(|p| p.is_relative()).map(|p| {
                Reply::error(
                    S::BAD_REQUEST,
                    format!(
                        "{key} {:?}: give an absolute path on the gateway host",
                        p.display().to_string()
                    ),
                    "invalid_model",
                )
            })
        })
}

/// Loads the tokenizer and chat template `model` names (its base's for an
/// adapter), on a blocking thread; `400` naming the file when one does
/// not load.
async fn tokenization_loads(config: &ServeConfig, model: &ModelConfig) -> Result<(), Reply> {
    let own = config
        .models
        .iter()
        .find(|m| Some(&m.name) == model.base.as_ref())
        .unwrap_or(model);
    if own.tokenizer.is_none() && own.chat_template.is_none() {
        return Ok(());
    }
    let (config, own) = (config.clone(), own.clone());
    let loaded =
        tokio::task::spawn_blocking(move || TokenizerLoader::new(&config, 0, None).for_model(&own).map(drop)).await;
    match loaded {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(Reply::error(S::BAD_REQUEST, format!("{e}"), "invalid_model")),
        Err(e) => Err(Reply::error(
            S::INTERNAL_SERVER_ERROR,
            format!("loading the tokenizer failed: {e}"),
            "internal",
        )),
    }
}

/// Writes the changes; `500` when the file cannot be written (the change
/// is then not made).
fn save(changes: &ModelChanges, path: &Path) -> Result<(), Reply> {
    changes.save(path).map_err(|e| {
        Reply::error(
            S::INTERNAL_SERVER_ERROR,
            format!(
                "cannot write admin.models_file {}: {e}; nothing changed",
                path.display()
            ),
            "models_file_unwritable",
        )
    })
}
