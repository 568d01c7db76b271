//! Backends found at run time (`[discovery]`): engines come and go (pods
//! scheduled, scaled in, rolled), and the gateway follows without a reload
//! or a restart.
//!
//! A **source** watches where the engines are listed and sends, on a
//! [`tokio::sync::watch`] channel, the whole set it sees each time it
//! changes ([`Endpoints`]). The supervisor reconciles the server table with
//! each set through the path the admin API uses: a new endpoint is
//! registered `Up` (in its model pool: [`shm_layout::PoolTag`]), one that
//! left is drained and retired once its requests finish (or after
//! `drain_timeout_secs`), one that comes back while still draining is `Up`
//! again with what was learned for it. A source that cannot read its list
//! (a broken file, an API server away) sends nothing, so the last set
//! stays: discovery never drops every backend because it lost its view.
//!
//! | source | file | what it watches |
//! | --- | --- | --- |
//! | `file` | [`file`] | a YAML or JSON file of endpoints, polled; atomic replaces and ConfigMap volume updates included |
//! | `kubernetes` | [`kubernetes`] | Pods by label selector, or a Service's EndpointSlices |
//! | `inference-pool` | [`kubernetes`] | a Gateway API Inference Extension `InferencePool` and the Pods it selects |
//!
//! [`selector`] parses and matches Kubernetes label selectors.

pub mod file;
#[cfg(feature = "kubernetes")]
pub mod kubernetes;
pub mod selector;

use std::sync::Arc;

use shm_layout::PoolTag;
use tokio::sync::watch;

use crate::config::{BackendConfig, BackendRole, DiscoveryConfig, DiscoveryKind, MetricsFlavor, ModelConfig};

/// One engine a source found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Its base URL, `http://host:port`.
    pub url: String,
    /// Its name in logs and metrics (a pod's name; default `host:port`).
    pub name: Option<String>,
    /// Its part in disaggregated serving.
    pub role: BackendRole,
    /// SGLang: its bootstrap server's port, when it prefills.
    pub bootstrap_port: Option<u16>,
    /// The model it serves, as the source says (a label, an annotation, a
    /// file entry); `None`: `discovery.model`.
    pub model: Option<String>,
    /// Its engine takes vLLM's `cache_salt` (a file entry's); `None`:
    /// `discovery.cache_salt`.
    pub cache_salt: Option<bool>,
    /// How its `/metrics` are read (a file entry's); `None`:
    /// `discovery.metrics_flavor`.
    pub metrics_flavor: Option<MetricsFlavor>,
    /// Its capacity relative to the others' (a file entry's; 1 to
    /// [`crate::config::MAX_WEIGHT`]).
    pub weight: u32,
    /// Its KV cache events endpoint, `tcp://` on its own host (a file
    /// entry's); `None`: `discovery.kv_events_port` on its address.
    pub kv_events: Option<String>,
    /// Its replay endpoint (a file entry's); `None`:
    /// `discovery.kv_events_replay_port`.
    pub kv_events_replay: Option<String>,
}

impl Endpoint {
    /// An endpoint at `url` with nothing else said.
    pub fn at(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            name: None,
            role: BackendRole::Both,
            bootstrap_port: None,
            model: None,
            cache_salt: None,
            metrics_flavor: None,
            weight: 1,
            kv_events: None,
            kv_events_replay: None,
        }
    }

    /// The backend it is registered as, as if configured, with what it
    /// does not say taken from `[discovery]`.
    pub fn backend(&self, discovery: &DiscoveryConfig) -> BackendConfig {
        let on_host = |port: Option<u16>| {
            let url: crate::config::BackendUrl = self.url.parse().ok()?;
            Some(format!("tcp://{}:{}", url.bracketed_host(), port?))
        };
        BackendConfig {
            name: self.name.clone(),
            role: self.role,
            bootstrap_port: self.bootstrap_port,
            cache_salt: self.cache_salt.unwrap_or(discovery.cache_salt),
            metrics_flavor: self.metrics_flavor.unwrap_or(discovery.metrics_flavor),
            weight: self.weight,
            kv_events: self.kv_events.clone().or_else(|| on_host(discovery.kv_events_port)),
            kv_events_replay: self
                .kv_events_replay
                .clone()
                .or_else(|| on_host(discovery.kv_events_replay_port)),
            ..BackendConfig::new(self.url.clone())
        }
    }
}

/// A source's whole set, as last seen.
pub type Endpoints = Arc<Vec<Endpoint>>;

/// What the supervisor follows: `None` until the source has seen its
/// first set.
pub type Found = watch::Receiver<Option<Endpoints>>;

/// Why discovery cannot start (a source that fails later keeps its last
/// set and logs; it never stops the gateway).
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// No Kubernetes client could be made (no kubeconfig, not in a
    /// cluster, a kubeconfig that does not load).
    #[error("Kubernetes discovery: {0}")]
    Kubernetes(String),
}

/// Starts the source `config` names on the current tokio runtime; `None`
/// without `[discovery]`.
pub async fn spawn(config: &DiscoveryConfig) -> Result<Option<Found>, DiscoveryError> {
    let Some(kind) = config.kind else {
        return Ok(None);
    };
    let (tx, rx) = watch::channel(None);
    match kind {
        DiscoveryKind::File => {
            tokio::spawn(file::follow(config.clone(), tx));
        }
        #[cfg(feature = "kubernetes")]
        DiscoveryKind::Kubernetes | DiscoveryKind::InferencePool => {
            kubernetes::spawn(config, tx).await?;
        }
        #[cfg(not(feature = "kubernetes"))]
        DiscoveryKind::Kubernetes | DiscoveryKind::InferencePool => {
            drop(tx);
            return Err(DiscoveryError::Kubernetes(
                "this semlb was built without its `kubernetes` feature".into(),
            ));
        }
    }
    Ok(Some(rx))
}

/// Why an endpoint serves no pool.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unpooled {
    /// It names a model no `[[model]]` pool has.
    #[error("it serves model {0:?}, which no [[model]] has as its name or an alias")]
    Unknown(String),
    /// It names none, and `discovery.model` is not set.
    #[error("it does not say which model it serves, and discovery.model is not set")]
    Unsaid,
}

/// The pool an endpoint serving `model` (else `default`) belongs to: the
/// tag of the `[[model]]` that has the name or alias (an adapter's: its
/// base's engines serve it). Without pools every server serves the
/// implicit pool, so any endpoint is taken, in no pool.
pub fn pool_of(model: Option<&str>, default: Option<&str>, models: &[ModelConfig]) -> Result<PoolTag, Unpooled> {
    if models.is_empty() {
        return Ok(PoolTag::NONE);
    }
    let name = model.or(default).ok_or(Unpooled::Unsaid)?;
    let model = models
        .iter()
        .find(|m| m.names().any(|n| n == name))
        .ok_or_else(|| Unpooled::Unknown(name.to_owned()))?;
    let base = model.base.as_deref().unwrap_or(&model.name);
    Ok(PoolTag::of(base))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_an_endpoint_does_not_say_comes_from_discovery() {
        let discovery = DiscoveryConfig {
            cache_salt: true,
            metrics_flavor: MetricsFlavor::Vllm,
            kv_events_port: Some(5557),
            kv_events_replay_port: Some(5558),
            ..DiscoveryConfig::default()
        };
        let b = Endpoint::at("http://10.1.2.3:8000").backend(&discovery);
        assert_eq!(b.kv_events.as_deref(), Some("tcp://10.1.2.3:5557"));
        assert_eq!(b.kv_events_replay.as_deref(), Some("tcp://10.1.2.3:5558"));
        assert!(b.cache_salt);
        assert_eq!(b.metrics_flavor, MetricsFlavor::Vllm);
        let v6 = Endpoint::at("http://[fd00::7]:8000").backend(&discovery);
        assert_eq!(v6.kv_events.as_deref(), Some("tcp://[fd00::7]:5557"));
        assert_eq!(v6.engine_settings().kv_events_port, Some(5557));
        let own = Endpoint {
            cache_salt: Some(false),
            kv_events: Some("tcp://10.1.2.3:6000".into()),
            weight: 4,
            ..Endpoint::at("http://10.1.2.3:8000")
        }
        .backend(&discovery);
        assert_eq!(
            (own.cache_salt, own.kv_events.as_deref(), own.weight),
            (false, Some("tcp://10.1.2.3:6000"), 4)
        );
        let plain = Endpoint::at("http://10.1.2.3:8000").backend(&DiscoveryConfig::default());
        assert_eq!((plain.kv_events, plain.cache_salt, plain.weight), (None, false, 1));
    }

    #[test]
    fn endpoints_join_the_pool_their_model_names() {
        let mut qwen = ModelConfig::new("qwen", &[]);
        qwen.aliases = vec!["default".into()];
        let mut sql = ModelConfig::new("qwen-sql", &[]);
        sql.base = Some("qwen".into());
        let models = [qwen, ModelConfig::new("llama", &[]), sql];
        assert_eq!(pool_of(Some("qwen"), None, &models), Ok(PoolTag::of("qwen")));
        assert_eq!(pool_of(Some("default"), None, &models), Ok(PoolTag::of("qwen")));
        assert_eq!(pool_of(Some("qwen-sql"), None, &models), Ok(PoolTag::of("qwen")));
        assert_eq!(pool_of(None, Some("llama"), &models), Ok(PoolTag::of("llama")));
        assert_eq!(pool_of(Some("llama"), Some("qwen"), &models), Ok(PoolTag::of("llama")));
        assert_eq!(pool_of(None, None, &models), Err(Unpooled::Unsaid));
        assert_eq!(
            pool_of(Some("mistral"), Some("qwen"), &models),
            Err(Unpooled::Unknown("mistral".into()))
        );
        assert_eq!(pool_of(Some("mistral"), None, &[]), Ok(PoolTag::NONE));
    }
}
