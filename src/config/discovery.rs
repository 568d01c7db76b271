//! `[discovery]`: backends found at run time rather than listed, from a
//! file of endpoints or from Kubernetes ([`crate::discovery`]). The
//! supervisor adds and drains what a source finds through the same path
//! as the admin API.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::Deserialize;

use super::{ConfigError, MetricsFlavor, quoted};

/// Where backends are discovered (`discovery.kind`, `--discovery`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DiscoveryKind {
    /// A YAML or JSON file of endpoints (`discovery.path`), read again
    /// when it changes.
    File,
    /// Kubernetes Pods by label selector (`discovery.selector`), or the
    /// EndpointSlices of a Service (`discovery.service`).
    Kubernetes,
    /// The Pods a Gateway API Inference Extension `InferencePool` selects
    /// (`discovery.inference_pool`), on its target port.
    InferencePool,
}

impl DiscoveryKind {
    /// The name in the configuration and on the command line.
    pub const fn name(self) -> &'static str {
        match self {
            Self::File => "file",
            Self::Kubernetes => "kubernetes",
            Self::InferencePool => "inference-pool",
        }
    }
}

impl fmt::Display for DiscoveryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DiscoveryKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "file" => Ok(Self::File),
            "kubernetes" => Ok(Self::Kubernetes),
            "inference-pool" => Ok(Self::InferencePool),
            other => Err(format!(
                "unknown discovery kind {other:?}: expected file, kubernetes or inference-pool"
            )),
        }
    }
}

/// Default `discovery.poll_ms`.
pub const DEFAULT_POLL_MS: u64 = 1000;

/// `[discovery]`. See the [configuration reference](super) for the keys.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DiscoveryConfig {
    /// Where backends are found; `None` (the default): only the
    /// configured ones and those the admin API adds.
    pub kind: Option<DiscoveryKind>,
    /// `file`: the endpoints file (YAML or JSON).
    pub path: Option<PathBuf>,
    /// `file`: how often the file is checked for a change, in ms.
    pub poll_ms: u64,
    /// Kubernetes: the namespace; default the one the gateway's pod runs
    /// in (in-cluster), else the kubeconfig context's, else `default`.
    pub namespace: Option<String>,
    /// `kubernetes`: the Pods' label selector (`app=vllm,tier in (a,b)`).
    pub selector: Option<String>,
    /// `kubernetes`: instead of `selector`, the Service whose
    /// EndpointSlices list the engines.
    pub service: Option<String>,
    /// Kubernetes: the engines' port (default: `port_name`'s, or the
    /// InferencePool's target port).
    pub port: Option<u16>,
    /// Kubernetes: the name of the engines' container port (or of the
    /// EndpointSlice port).
    pub port_name: Option<String>,
    /// The pool discovered engines serve when they do not say
    /// (`model_label`, `model_annotation`, a file entry's `model`): a
    /// `[[model]]` name. Needed with `[[model]]` pools unless every engine
    /// says.
    pub model: Option<String>,
    /// Kubernetes: the Pod label holding the engine's model.
    pub model_label: Option<String>,
    /// Kubernetes: the Pod annotation holding the engine's model.
    pub model_annotation: Option<String>,
    /// Kubernetes: Pods matching this selector too are prefill engines
    /// (P/D).
    pub prefill_selector: Option<String>,
    /// Kubernetes: Pods matching this selector too are decode engines.
    pub decode_selector: Option<String>,
    /// `inference-pool`: the InferencePool's name.
    pub inference_pool: Option<String>,
    /// Kubernetes: a kubeconfig file; default in-cluster (the pod's
    /// service account), else `$KUBECONFIG` or `~/.kube/config`.
    pub kubeconfig: Option<PathBuf>,
    /// The discovered engines take vLLM's `cache_salt` (a file entry may
    /// say otherwise), as `[[backend]] cache_salt`.
    pub cache_salt: bool,
    /// How the discovered engines' `/metrics` are read (a file entry may
    /// say otherwise), as `[[backend]] metrics_flavor`.
    pub metrics_flavor: MetricsFlavor,
    /// The port the discovered engines publish their KV cache events on,
    /// on their own address (vLLM's `--kv-events-config` endpoint
    /// `tcp://*:5557`); a file entry may say otherwise. Default none.
    pub kv_events_port: Option<u16>,
    /// The port of their replay socket (`replay_endpoint`). Default none.
    pub kv_events_replay_port: Option<u16>,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        Self {
            kind: None,
            path: None,
            poll_ms: DEFAULT_POLL_MS,
            namespace: None,
            selector: None,
            service: None,
            port: None,
            port_name: None,
            model: None,
            model_label: None,
            model_annotation: None,
            prefill_selector: None,
            decode_selector: None,
            inference_pool: None,
            kubeconfig: None,
            cache_salt: false,
            metrics_flavor: MetricsFlavor::Auto,
            kv_events_port: None,
            kv_events_replay_port: None,
        }
    }
}

impl DiscoveryConfig {
    /// Whether backends are discovered.
    pub fn is_on(&self) -> bool {
        self.kind.is_some()
    }

    /// Whether discovered engines can tell their model themselves (a label,
    /// an annotation, or each file entry).
    fn engines_say_model(&self) -> bool {
        self.model_label.is_some() || self.model_annotation.is_some() || self.kind == Some(DiscoveryKind::File)
    }

    /// Checks the section against `models` (the `[[model]]` names); the
    /// first problem, naming `discovery.key`.
    pub(super) fn validate(&self, models: &[super::ModelConfig]) -> Result<(), ConfigError> {
        use ConfigError as E;
        let Some(kind) = self.kind else {
            return Ok(());
        };
        let need = |key: &str, what: &str| E::invalid(format!("discovery.{key}"), "not set", what.to_owned());
        match kind {
            DiscoveryKind::File => {
                if self.path.is_none() {
                    return Err(need("path", "kind = \"file\" reads its endpoints from this file"));
                }
                if !(10..=3_600_000).contains(&self.poll_ms) {
                    return Err(E::invalid(
                        "discovery.poll_ms",
                        self.poll_ms,
                        "must be between 10 ms and 1 hour",
                    ));
                }
            }
            DiscoveryKind::Kubernetes => match (&self.selector, &self.service) {
                (None, None) => {
                    return Err(need(
                        "selector",
                        "kind = \"kubernetes\" watches the Pods of a label selector (or the EndpointSlices of discovery.service)",
                    ));
                }
                (Some(_), Some(service)) => {
                    return Err(E::invalid(
                        "discovery.service",
                        quoted(service),
                        "set selector (Pods) or service (EndpointSlices), not both",
                    ));
                }
                (Some(_), None) if self.port.is_none() && self.port_name.is_none() => {
                    return Err(need(
                        "port",
                        "the engines' port is needed to reach Pods (or port_name, a named container port)",
                    ));
                }
                _ => {}
            },
            DiscoveryKind::InferencePool => {
                if self.inference_pool.is_none() {
                    return Err(need(
                        "inference_pool",
                        "kind = \"inference-pool\" reads this InferencePool",
                    ));
                }
            }
        }
        for (key, value) in [
            ("selector", &self.selector),
            ("prefill_selector", &self.prefill_selector),
            ("decode_selector", &self.decode_selector),
        ] {
            if let Some(v) = value
                && let Err(reason) = crate::discovery::selector::Selector::parse(v)
            {
                return Err(E::invalid(format!("discovery.{key}"), quoted(v), reason));
            }
        }
        if self.port == Some(0) {
            return Err(E::invalid("discovery.port", 0, "must be a port, 1 to 65535"));
        }
        if let Some(model) = &self.model {
            if !models.is_empty() && !models.iter().any(|m| m.names().any(|n| n == model)) {
                return Err(E::invalid(
                    "discovery.model",
                    quoted(model),
                    "no [[model]] has that name or alias",
                ));
            }
        } else if !models.is_empty() && !self.engines_say_model() {
            return Err(need(
                "model",
                "with [[model]] pools, say which pool discovered engines serve (discovery.model, or model_label / model_annotation)",
            ));
        }
        Ok(())
    }
}
