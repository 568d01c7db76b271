//! The model pools changed through the admin API: kept in
//! `admin.models_file`, merged over the configuration file's `[[model]]`
//! tables by every process that resolves the configuration.
//!
//! The admin API never rewrites the operator's configuration file. It
//! keeps its changes in a file of its own, written whole (to a temporary
//! file, then renamed over it, mode 0600):
//!
//! ```toml
//! # Written by semlb's admin API (PUT / POST / DELETE /admin/models).
//! removed = ["old-chat"]        # pools of the configuration file taken out
//!
//! [[model]]                     # pools added, or the file's replaced
//! name = "support-bot"
//! base = "llama-3-8b"
//! backends = ["gpu-a"]
//! ```
//!
//! [`ModelChanges::merge_into`] applies it to a configuration: a `[[model]]`
//! here replaces the file's of the same name in place, or is appended; a
//! name in `removed` takes the file's pool out. A pool here may name its
//! backends by URL where the configuration file has no `[[backend]]` for
//! them: such a URL becomes a backend of the merged configuration (with
//! the defaults), registered by the supervisor while a pool names it.
//!
//! Because every process merges the same file, a dispatcher restarted
//! after a crash, a reload and a restart of the service all keep what the
//! admin API changed. To drop the changes, delete the file (or the entries)
//! and reload.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::models::backend_index;
use super::{BackendConfig, ConfigError, ModelConfig, ServeConfig};

/// What the admin API changed (the contents of `admin.models_file`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelChanges {
    /// Names of the configuration file's pools taken out.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub removed: Vec<String>,
    /// Pools added, or replacing the file's of the same name.
    #[serde(default, rename = "model", skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<ModelConfig>,
}

/// The first lines of a written file.
const HEADER: &str = "# Written by semlb's admin API (PUT, POST and DELETE /admin/models): the model\n\
                      # pools it changed, merged over the configuration file's [[model]] tables.\n\
                      # Edit it only while semlb is stopped, or reload (SIGHUP) after editing.\n\n";

impl ModelChanges {
    /// Reads `path`; a file that does not exist is no change. Relative
    /// `tokenizer` and `chat_template` paths are relative to its directory.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(source) => {
                return Err(ConfigError::Read {
                    path: path.to_owned(),
                    source,
                });
            }
        };
        let mut changes: Self = toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: e.to_string().trim_end().to_owned(),
        })?;
        let base = path.parent().unwrap_or(Path::new(""));
        for file in changes
            .models
            .iter_mut()
            .flat_map(|m| [&mut m.tokenizer, &mut m.chat_template])
            .flatten()
        {
            if file.is_relative() {
                *file = base.join(&*file);
            }
        }
        Ok(changes)
    }

    /// Writes the changes to `path` whole: a temporary file beside it,
    /// mode 0600, synced, then renamed over it (a reader sees the old file
    /// or the new one, never a part).
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        let text = toml::to_string(self).map_err(std::io::Error::other)?;
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!(".tmp{}", std::process::id()));
        let tmp = PathBuf::from(tmp);
        let written = (|| {
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)?;
            file.write_all(HEADER.as_bytes())?;
            file.write_all(text.as_bytes())?;
            file.sync_all()?;
            std::fs::rename(&tmp, path)
        })();
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written
    }

    /// Whether there is no change.
    pub fn is_empty(&self) -> bool {
        self.removed.is_empty() && self.models.is_empty()
    }

    /// Whether the pool `name` was added or replaced here.
    pub fn sets(&self, name: &str) -> bool {
        self.models.iter().any(|m| m.name == name)
    }

    /// Adds `model`, or replaces the pool of its name.
    pub fn set(&mut self, model: ModelConfig) {
        self.removed.retain(|n| *n != model.name);
        match self.models.iter_mut().find(|m| m.name == model.name) {
            Some(slot) => *slot = model,
            None => self.models.push(model),
        }
    }

    /// Takes the pool `name` out; `in_file`: the configuration file
    /// defines one of that name, which stays out.
    pub fn remove(&mut self, name: &str, in_file: bool) {
        self.models.retain(|m| m.name != name);
        if in_file && !self.removed.iter().any(|n| n == name) {
            self.removed.push(name.to_owned());
        }
    }

    /// Applies the changes to `config` (see the module docs). Removals of
    /// pools the file no longer defines change nothing.
    pub fn merge_into(&self, config: &mut ServeConfig) {
        config
            .models
            .retain(|m| !self.removed.contains(&m.name) || self.sets(&m.name));
        for model in &self.models {
            match config.models.iter_mut().find(|m| m.name == model.name) {
                Some(slot) => *slot = model.clone(),
                None => config.models.push(model.clone()),
            }
            for reference in &model.backends {
                if backend_index(&config.backends, reference).is_none()
                    && reference.parse::<super::BackendUrl>().is_ok()
                {
                    config.backends.push(BackendConfig::new(reference.clone()));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> ServeConfig {
        ServeConfig::from_toml(text, Path::new("/etc/semlb/semlb.toml")).unwrap()
    }

    const FILE: &str = "[[backend]]\nurl = \"http://10.0.0.1:8000\"\nname = \"a\"\n\n\
                        [[model]]\nname = \"alpha\"\nbackends = [\"a\"]\n\n\
                        [[model]]\nname = \"gamma\"\nbackends = [\"a\"]\n";

    #[test]
    fn changes_replace_in_place_append_and_remove() {
        let mut changes = ModelChanges::default();
        let mut alpha = ModelConfig::new("alpha", &["a"]);
        alpha.aliases = vec!["default".into()];
        changes.set(alpha.clone());
        changes.set(ModelConfig::new("beta", &["http://10.0.0.2:8000"]));
        changes.remove("gamma", true);
        let mut merged = config(FILE);
        changes.merge_into(&mut merged);
        let names: Vec<&str> = merged.models.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["alpha", "beta"]);
        assert_eq!(merged.models[0], alpha, "the file's alpha is replaced whole");
        let urls: Vec<&str> = merged.backends.iter().map(|b| b.url.as_str()).collect();
        assert_eq!(
            urls,
            ["http://10.0.0.1:8000", "http://10.0.0.2:8000"],
            "a URL becomes a backend"
        );
        merged.validate().unwrap();

        // Setting a removed name again brings it back; removing an added
        // one forgets it, with no tombstone when the file lacks it.
        changes.set(ModelConfig::new("gamma", &["a"]));
        assert!(changes.removed.is_empty());
        changes.remove("beta", false);
        assert_eq!(changes.removed, Vec::<String>::new());
        assert!(!changes.sets("beta"));
    }

    #[test]
    fn the_file_round_trips_and_is_private() {
        let dir = std::env::temp_dir().join(format!("semlb-model-changes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("models.toml");
        assert_eq!(
            ModelChanges::load(&path).unwrap(),
            ModelChanges::default(),
            "no file: no change"
        );
        let mut changes = ModelChanges::default();
        let mut model = ModelConfig::new("beta", &["a"]);
        model.tokenizer = Some("/srv/beta/tokenizer.json".into());
        model.policy = Some(crate::routing::PolicyConfig::default());
        model.requests_per_minute = Some(60);
        changes.set(model);
        changes.remove("gamma", true);
        changes.save(&path).unwrap();
        assert_eq!(ModelChanges::load(&path).unwrap(), changes);
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        std::fs::write(&path, "removed = 3\n").unwrap();
        let err = ModelChanges::load(&path).unwrap_err().to_string();
        assert!(err.contains("models.toml"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
