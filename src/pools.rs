//! Model pools at run time: which pool a request's `model` names, which
//! servers serve it, and how its prompts are tokenized, hashed and routed
//! (the configuration is [`crate::config::models`]).
//!
//! A [`ModelPools`] is built from a [`ServeConfig`]: one [`Pool`] per
//! `[[model]]`, or one implicit pool of every server for any model name
//! when there is none (the single-pool form of `--backend URL`). A pool
//! has:
//!
//! | part | what it is |
//! | --- | --- |
//! | names | its name (sent to its engines) and aliases; an adapter's name is its own |
//! | members | the [`server_id`]s of its backends (the implicit pool: every server) |
//! | [`Tokenization`] | its tokenizer and chat template, shared by the pools that use the same files, with an id the completion records carry so that a response process reads an answer with the same tokenizer |
//! | chain root | its name: aliases share a prefix keyspace, an adapter has its own (the implicit pool roots chains at the request's `model`, as before pools) |
//! | block size | its engines' |
//! | policy | its own instance of its routing policy |
//!
//! Rebuilding from a reloaded configuration ([`ModelPools::rebuild`])
//! keeps what did not change: loaded tokenizers (by file) and each pool's
//! policy, with what it learned, while its configuration is the same.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use semlb_tokenizer::chat::ChatTemplate;
use semlb_tokenizer::{SharedSegments, Tokenizer};
use shm_layout::PoolTag;

use crate::config::models::backend_index;
use crate::config::{ModelConfig, ServeConfig};
use crate::routing::swappable::SwappablePolicy;
use crate::routing::{Members, PolicyConfig};
use crate::store::server_id;
use crate::tenancy::rate_limit::{Bucket, Scope};

/// Why pools could not be built: a tokenizer or template that does not
/// load (the message names the model and the file).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("model {model:?}: {reason}")]
pub struct PoolError {
    /// The model (`*` for the global tokenizer).
    pub model: String,
    /// What went wrong.
    pub reason: String,
}

/// A tokenizer and the chat template rendered with it.
#[derive(Debug, Clone)]
pub struct Tokenization {
    /// Its id: 0 for the global `tokenizer` and `chat_template`, else a
    /// hash of the two files' paths ([`tokenization_id`]).
    pub id: u64,
    /// Its file, for people (`bundled phi-2` for the bundled one).
    pub name: String,
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template.
    pub template: Arc<ChatTemplate>,
}

/// The id of the tokenizer and template a model's settings name: 0 when
/// it names neither (the global ones), else a hash of the paths, never 0.
pub fn tokenization_id(tokenizer: Option<&Path>, template: Option<&Path>) -> u64 {
    if tokenizer.is_none() && template.is_none() {
        return 0;
    }
    let text = format!(
        "{}\0{}",
        tokenizer.map_or_else(String::new, |p| p.display().to_string()),
        template.map_or_else(String::new, |p| p.display().to_string())
    );
    xxhash_rust::xxh3::xxh3_64(text.as_bytes()).max(1)
}

/// Loads tokenizers and templates, each file once.
#[derive(Debug)]
pub struct TokenizerLoader {
    segment_cache_bytes: usize,
    shared: Option<Arc<dyn SharedSegments>>,
    tokenizers: HashMap<Option<PathBuf>, Tokenizer>,
    loaded: HashMap<u64, Tokenization>,
    global: (Option<PathBuf>, Option<PathBuf>),
}

impl TokenizerLoader {
    /// A loader whose tokenizers keep a segment cache of
    /// `segment_cache_bytes` each (0: none) and share segments through
    /// `shared`, with `config`'s global tokenizer and template as id 0.
    pub fn new(config: &ServeConfig, segment_cache_bytes: usize, shared: Option<Arc<dyn SharedSegments>>) -> Self {
        Self {
            segment_cache_bytes,
            shared,
            tokenizers: HashMap::new(),
            loaded: HashMap::new(),
            global: (config.tokenizer.clone(), config.chat_template.clone()),
        }
    }

    /// The global tokenization (id 0).
    pub fn global(&mut self) -> Result<Tokenization, PoolError> {
        self.load(None, None, "*")
    }

    /// The tokenization of `model`'s files (its base's for an adapter:
    /// pass the base), loaded if it was not.
    pub fn for_model(&mut self, model: &ModelConfig) -> Result<Tokenization, PoolError> {
        self.load(model.tokenizer.as_deref(), model.chat_template.as_deref(), &model.name)
    }

    /// The tokenization with id `id` among those `config`'s models name,
    /// loaded if need be (a response process meeting an id it does not
    /// know); `None` if no model names it.
    pub fn by_id(&mut self, config: &ServeConfig, id: u64) -> Option<Tokenization> {
        if let Some(t) = self.loaded.get(&id) {
            return Some(t.clone());
        }
        let model = config
            .models
            .iter()
            .find(|m| tokenization_id(m.tokenizer.as_deref(), m.chat_template.as_deref()) == id)?;
        self.for_model(model).ok()
    }

    fn load(
        &mut self,
        tokenizer: Option<&Path>,
        template: Option<&Path>,
        model: &str,
    ) -> Result<Tokenization, PoolError> {
        let id = tokenization_id(tokenizer, template);
        if let Some(t) = self.loaded.get(&id) {
            return Ok(t.clone());
        }
        let err = |reason: String| PoolError {
            model: model.to_owned(),
            reason,
        };
        // Unset: the global file.
        let tokenizer_path = tokenizer.map(Path::to_path_buf).or_else(|| self.global.0.clone());
        let template_path = template.map(Path::to_path_buf).or_else(|| self.global.1.clone());
        let loaded = match self.tokenizers.get(&tokenizer_path) {
            Some(t) => t.clone(),
            None => {
                let mut t = match &tokenizer_path {
                    Some(path) => Tokenizer::from_file(path).map_err(|e| err(e.to_string()))?,
                    None => Tokenizer::bundled(),
                }
                .with_segment_cache(self.segment_cache_bytes);
                if let Some(shared) = &self.shared {
                    t = t.with_shared_segments(shared.clone());
                }
                self.tokenizers.insert(tokenizer_path.clone(), t.clone());
                t
            }
        };
        let template = ChatTemplate::resolve(template_path.as_deref(), tokenizer_path.as_deref())
            .map_err(|e| err(format!("its chat template: {e}")))?;
        let t = Tokenization {
            id,
            name: tokenizer_path.map_or_else(|| "bundled phi-2".to_owned(), |p| p.display().to_string()),
            tokenizer: loaded,
            template: Arc::new(template),
        };
        self.loaded.insert(id, t.clone());
        Ok(t)
    }
}

/// One model pool (see the module docs).
#[derive(Debug)]
pub struct Pool {
    /// Its name: what its engines serve (`None`: the implicit pool, which
    /// takes any name and forwards it as it is).
    name: Option<String>,
    /// Its aliases.
    aliases: Vec<String>,
    /// The model it is an adapter of.
    base: Option<String>,
    members: Members,
    tokenization: Tokenization,
    block_size: usize,
    policy: SwappablePolicy,
    /// The configuration `policy` was built from.
    policy_config: PolicyConfig,
    /// Its rate-limit buckets (every tenant's requests to it).
    limits: Vec<Bucket>,
    /// Its `[model.resume]`, if it has one.
    resume: Option<crate::config::ResumeConfig>,
}

impl Pool {
    /// A pool; its policy is the same pool's in `previous` when that was
    /// built from the same `policy_config` (with what it learned), else a
    /// new one.
    fn new(
        name: Option<String>,
        model: Option<&ModelConfig>,
        members: Members,
        tokenization: Tokenization,
        block_size: usize,
        policy_config: PolicyConfig,
        previous: Option<&ModelPools>,
    ) -> Arc<Self> {
        let policy = match previous
            .and_then(|p| p.pools.iter().find(|old| old.name == name))
            .filter(|old| old.policy_config == policy_config)
        {
            Some(old) => SwappablePolicy::from_arc(old.policy.current_arc()),
            None => SwappablePolicy::new(crate::routing::build(&policy_config)),
        };
        let limits = match (model, &name) {
            (Some(m), Some(name)) => m.limits().buckets(Scope::Model, name),
            _ => Vec::new(),
        };
        Arc::new(Self {
            name,
            aliases: model.map(|m| m.aliases.clone()).unwrap_or_default(),
            base: model.and_then(|m| m.base.clone()),
            members,
            tokenization,
            block_size: block_size.max(1),
            policy,
            policy_config,
            limits,
            resume: model.and_then(|m| m.resume),
        })
    }

    /// How its streams are resumed: its `[model.resume]`, else `global`
    /// (the `[resume]` table).
    pub fn resume<'a>(&'a self, global: &'a crate::config::ResumeConfig) -> &'a crate::config::ResumeConfig {
        self.resume.as_ref().unwrap_or(global)
    }

    /// Its rate-limit buckets.
    pub fn limits(&self) -> &[Bucket] {
        &self.limits
    }

    /// Its name (`None`: the implicit pool).
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// Its aliases.
    pub fn aliases(&self) -> &[String] {
        &self.aliases
    }

    /// The model it is an adapter of.
    pub fn base(&self) -> Option<&str> {
        self.base.as_deref()
    }

    /// Its servers.
    pub fn members(&self) -> &Members {
        &self.members
    }

    /// Its tokenizer and template.
    pub fn tokenization(&self) -> &Tokenization {
        &self.tokenization
    }

    /// Tokens per prefix block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Tokens per prefix block, as the policies take it.
    pub fn block_tokens(&self) -> u32 {
        u32::try_from(self.block_size).unwrap_or(u32::MAX)
    }

    /// Its routing policy.
    pub fn policy(&self) -> &SwappablePolicy {
        &self.policy
    }

    /// Its policy's configuration.
    pub fn policy_config(&self) -> &PolicyConfig {
        &self.policy_config
    }

    /// Its prefix source as a lookup takes it ([`crate::store::LookupRequest::precise`]):
    /// the confirm window with `[policy.prefix] source = "precise"`.
    pub fn precise(&self) -> Option<u16> {
        let prefix = &self.policy_config().prefix;
        (prefix.source == crate::routing::PrefixSource::Precise)
            .then(|| u16::try_from(prefix.confirm_window_secs).unwrap_or(u16::MAX))
    }

    /// Whether its policy sees matches that end at a shared header as none
    /// (`[policy.prefix] shared_headers`).
    pub fn shared_headers(&self) -> bool {
        self.policy_config().prefix.shared_headers
    }

    /// What its chains are rooted at for a request naming `model`: its
    /// name, or `model` itself in the implicit pool.
    pub fn chain_model<'m>(&'m self, model: &'m str) -> &'m str {
        self.name.as_deref().unwrap_or(model)
    }

    /// The name to send its engines for a request naming `model`, when it
    /// is not `model` itself (an alias).
    pub fn upstream_name(&self, model: &str) -> Option<&str> {
        self.name.as_deref().filter(|name| *name != model)
    }
}

impl crate::openai::prompt::Templated for Arc<Pool> {
    fn template(&self) -> &ChatTemplate {
        &self.tokenization.template
    }
}

/// The pools of a gateway (see the module docs).
#[derive(Debug)]
pub struct ModelPools {
    pools: Vec<Arc<Pool>>,
    /// Every name and alias → index in `pools`.
    names: HashMap<String, usize>,
}

impl ModelPools {
    /// The pools of `config` (whose models are validated), loading their
    /// tokenizers through `loader`; pools equal to one of `previous`'s keep
    /// its policy.
    pub fn build(
        config: &ServeConfig,
        loader: &mut TokenizerLoader,
        previous: Option<&ModelPools>,
    ) -> Result<Self, PoolError> {
        if config.models.is_empty() {
            let pool = Pool::new(
                None,
                None,
                Members::every(),
                loader.global()?,
                config.block_size,
                config.policy.clone(),
                previous,
            );
            return Ok(Self {
                pools: vec![pool],
                names: HashMap::new(),
            });
        }
        let mut pools = Vec::with_capacity(config.models.len());
        let mut names = HashMap::new();
        for model in &config.models {
            let base = model
                .base
                .as_ref()
                .and_then(|b| config.models.iter().find(|m| m.name == *b));
            let settings = base.unwrap_or(model);
            let references = if model.backends.is_empty() {
                &settings.backends
            } else {
                &model.backends
            };
            let members = Members::of(
                references
                    .iter()
                    .filter_map(|r| backend_index(&config.backends, r))
                    .filter_map(|i| config.backends[i].parsed_url().ok())
                    .map(|url| server_id(&url.to_string())),
                // Discovered servers name the pool (an adapter's: its base's).
                PoolTag::of(&settings.name),
            );
            let index = pools.len();
            for name in model.names() {
                names.insert(name.to_owned(), index);
            }
            pools.push(Pool::new(
                Some(model.name.clone()),
                Some(model),
                members,
                loader.for_model(settings)?,
                settings.block_size.unwrap_or(config.block_size),
                model.policy.clone().unwrap_or_else(|| config.policy.clone()),
                previous,
            ));
        }
        Ok(Self { pools, names })
    }

    /// The same pools from a reloaded `config`: what did not change is kept
    /// (see the module docs).
    pub fn rebuild(&self, config: &ServeConfig, loader: &mut TokenizerLoader) -> Result<Self, PoolError> {
        Self::build(config, loader, Some(self))
    }

    /// The pool serving `model`, by name or alias (the implicit pool serves
    /// every name); `None`: no pool does.
    pub fn find(&self, model: &str) -> Option<&Arc<Pool>> {
        match self.names.get(model) {
            Some(i) => self.pools.get(*i),
            None if self.is_implicit() => self.pools.first(),
            None => None,
        }
    }

    /// Whether this is the implicit pool of every server (no `[[model]]`).
    pub fn is_implicit(&self) -> bool {
        self.pools.len() == 1 && self.pools[0].name.is_none()
    }

    /// Every pool, in configuration order.
    pub fn pools(&self) -> &[Arc<Pool>] {
        &self.pools
    }

    /// Every name a client may ask for, with its pool: each pool's name,
    /// then its aliases (none for the implicit pool).
    pub fn names(&self) -> impl Iterator<Item = (&str, &Arc<Pool>)> {
        self.pools
            .iter()
            .flat_map(|p| p.name.iter().chain(p.aliases.iter()).map(move |n| (n.as_str(), p)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::BackendConfig;

    fn key(id: u64, pool: PoolTag) -> shm_layout::MemberKey {
        shm_layout::MemberKey { id, pool }
    }

    fn config(models: Vec<ModelConfig>) -> ServeConfig {
        ServeConfig {
            backends: vec![
                BackendConfig::new("http://127.0.0.1:9001"),
                BackendConfig {
                    name: Some("b".into()),
                    ..BackendConfig::new("http://127.0.0.1:9002")
                },
            ],
            models,
            ..ServeConfig::default()
        }
    }

    #[test]
    fn without_models_one_pool_takes_every_name_and_server() {
        let c = config(vec![]);
        let pools = ModelPools::build(&c, &mut TokenizerLoader::new(&c, 0, None), None).unwrap();
        assert!(pools.is_implicit());
        let pool = pools.find("anything").unwrap();
        assert!(pool.members().admits(Some(key(12345, PoolTag::NONE))));
        assert_eq!(pool.chain_model("anything"), "anything");
        assert_eq!(pool.upstream_name("anything"), None);
        assert_eq!(pool.tokenization().id, 0);
    }

    #[test]
    fn models_route_by_name_and_alias_to_their_backends_only() {
        let mut a = ModelConfig::new("big", &["127.0.0.1:9001"]);
        a.aliases = vec!["default".into()];
        let mut lora = ModelConfig::new("big-sql", &[]);
        lora.base = Some("big".into());
        let c = config(vec![a, ModelConfig::new("small", &["b"]), lora]);
        c.validate().unwrap();
        let pools = ModelPools::build(&c, &mut TokenizerLoader::new(&c, 0, None), None).unwrap();
        assert!(!pools.is_implicit());
        assert!(pools.find("nope").is_none());
        let id = |port| Some(key(server_id(&format!("http://127.0.0.1:{port}")), PoolTag::NONE));
        let big = pools.find("default").unwrap();
        assert_eq!(big.name(), Some("big"));
        assert_eq!(big.upstream_name("default"), Some("big"));
        assert_eq!(big.upstream_name("big"), None);
        assert_eq!(big.chain_model("default"), "big", "aliases share the keyspace");
        assert!(big.members().admits(id(9001)) && !big.members().admits(id(9002)));
        let small = pools.find("small").unwrap();
        assert!(small.members().admits(id(9002)) && !small.members().admits(id(9001)));
        // The adapter: its base's servers, its own keyspace.
        let sql = pools.find("big-sql").unwrap();
        assert_eq!((sql.base(), sql.chain_model("big-sql")), (Some("big"), "big-sql"));
        assert!(sql.members().admits(id(9001)) && !sql.members().admits(id(9002)));
        // A server discovery registered in a pool, by its name: the pool's
        // (and its adapters'), not another's.
        let found = Some(key(77, PoolTag::of("big")));
        assert!(big.members().admits(found) && sql.members().admits(found));
        assert!(!small.members().admits(found));
        assert!(
            !big.members().admits(Some(key(77, PoolTag::of("default")))),
            "by name, not alias"
        );
        assert!(!big.members().admits(Some(key(77, PoolTag::NONE))));
        assert_eq!(
            pools.names().map(|(n, _)| n).collect::<Vec<_>>(),
            ["big", "default", "small", "big-sql"]
        );
    }

    #[test]
    fn a_rebuild_keeps_an_unchanged_pools_policy() {
        let c = config(vec![ModelConfig::new("m", &["b"])]);
        let mut loader = TokenizerLoader::new(&c, 0, None);
        let first = ModelPools::build(&c, &mut loader, None).unwrap();
        let same = first.rebuild(&c, &mut loader).unwrap();
        let policy = |p: &ModelPools| p.find("m").unwrap().policy().current_arc();
        assert!(Arc::ptr_eq(&policy(&first), &policy(&same)));
        let mut changed = c.clone();
        changed.models[0].policy = Some(PolicyConfig {
            kind: crate::routing::PolicyKind::LeastLoad,
            ..PolicyConfig::default()
        });
        let other = same.rebuild(&changed, &mut loader).unwrap();
        assert!(!Arc::ptr_eq(&policy(&same), &policy(&other)));
        assert_eq!(policy(&other).name(), "least_load");
    }

    #[test]
    fn tokenization_ids_tell_files_apart() {
        assert_eq!(tokenization_id(None, None), 0);
        let a = tokenization_id(Some(Path::new("/a.json")), None);
        let b = tokenization_id(Some(Path::new("/b.json")), None);
        let at = tokenization_id(Some(Path::new("/a.json")), Some(Path::new("/t.json")));
        assert!(a != 0 && a != b && a != at);
    }
}
