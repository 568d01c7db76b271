//! `kind = "inference-pool"`: the engines of a Gateway API Inference
//! Extension `InferencePool` (`inference.networking.k8s.io/v1`): the
//! InferencePool is watched by name, and the Pods its `spec.selector`
//! selects are followed ([`super::pods`]) on each of its
//! `spec.targetPorts`. When the pool's selector or ports change, the Pod
//! watch starts again with them; when the pool is deleted, its engines
//! drain.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{ApiResource, DynamicObject};
use kube::runtime::watcher::{self, Event};
use kube::runtime::{WatchStreamExt, watcher as watch_stream};
use kube::{Api, Client};
use tokio::sync::watch;

use super::super::Endpoints;
use super::follow::{follow, next_event};
use super::pods::PodRules;

/// The InferencePool resource, v1.
pub fn resource() -> ApiResource {
    ApiResource {
        group: "inference.networking.k8s.io".into(),
        version: "v1".into(),
        api_version: "inference.networking.k8s.io/v1".into(),
        kind: "InferencePool".into(),
        plural: "inferencepools".into(),
    }
}

/// Why a pool cannot be followed: what is missing or wrong in its spec.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PoolSpecError(String);

/// What of a pool's spec the gateway follows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSpec {
    /// `spec.selector.matchLabels`, as a label selector.
    pub selector: String,
    /// `spec.targetPorts[].number`.
    pub ports: Vec<u16>,
}

impl PoolSpec {
    /// Reads `object`'s spec; the error says what is missing.
    pub fn of(object: &DynamicObject) -> Result<Self, PoolSpecError> {
        Self::read(object).map_err(PoolSpecError)
    }

    fn read(object: &DynamicObject) -> Result<Self, String> {
        let spec = object.data.get("spec").ok_or("it has no spec")?;
        let labels: BTreeMap<String, String> = spec
            .pointer("/selector/matchLabels")
            .cloned()
            .map(serde_json::from_value)
            .transpose()
            .map_err(|e| format!("spec.selector.matchLabels: {e}"))?
            .unwrap_or_default();
        if labels.is_empty() {
            return Err("spec.selector.matchLabels is empty (it would select every Pod)".into());
        }
        let ports: Vec<u16> = spec
            .get("targetPorts")
            .and_then(|p| p.as_array())
            .map(|ports| {
                ports
                    .iter()
                    .filter_map(|p| p.get("number")?.as_u64())
                    .filter_map(|n| u16::try_from(n).ok())
                    .filter(|n| *n != 0)
                    .collect()
            })
            .unwrap_or_default();
        if ports.is_empty() {
            return Err("spec.targetPorts names no port".into());
        }
        let selector = labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",");
        Ok(Self { selector, ports })
    }
}

/// Follows pool `name` in `namespace` until every receiver of `tx` is gone.
pub async fn follow_pool(
    client: Client,
    namespace: String,
    name: String,
    rules: PodRules,
    tx: watch::Sender<Option<Endpoints>>,
) {
    let pools: Api<DynamicObject> = Api::namespaced_with(client.clone(), &namespace, &resource());
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut stream = std::pin::pin!(watch_stream(pools, config).backoff(super::follow::backoff()));
    let what = format!("InferencePool {namespace}/{name}");
    let mut pods: Option<(PoolSpec, tokio::task::AbortHandle)> = None;
    let (mut failing, mut seen, mut refused) = (false, false, None::<String>);
    while let Some(event) = next_event(&mut stream, &tx, &what, &mut failing).await {
        match event {
            Event::Init => seen = false,
            Event::InitApply(pool) | Event::Apply(pool) => {
                seen = true;
                match PoolSpec::of(&pool) {
                    Ok(spec) => {
                        refused = None;
                        if pods.as_ref().is_none_or(|(s, _)| *s != spec) {
                            tracing::info!(watch = %what, selector = %spec.selector, ports = ?spec.ports, "discovery: {what} selects Pods {} on ports {:?}", spec.selector, spec.ports);
                            if let Some((_, old)) = pods.take() {
                                old.abort();
                            }
                            let task = start_pods(&client, &namespace, &spec, &rules, &tx);
                            pods = Some((spec, task));
                        }
                    }
                    Err(why) => {
                        let why = why.to_string();
                        if refused.as_deref() != Some(&why) {
                            tracing::error!(watch = %what, "discovery: {what} cannot be followed: {why}; keeping the endpoints found before");
                            refused = Some(why);
                        }
                    }
                }
            }
            Event::InitDone if !seen => {
                tracing::warn!(watch = %what, "discovery: {what} does not exist (yet); waiting for it");
            }
            Event::InitDone => {}
            Event::Delete(_) => {
                tracing::warn!(watch = %what, "discovery: {what} was deleted; draining its engines");
                if let Some((_, old)) = pods.take() {
                    old.abort();
                }
                tx.send_replace(Some(std::sync::Arc::new(Vec::new())));
            }
        }
    }
    if let Some((_, task)) = pods {
        task.abort();
    }
}

/// Starts following the Pods `spec` selects, sending on `tx`.
fn start_pods(
    client: &Client,
    namespace: &str,
    spec: &PoolSpec,
    rules: &PodRules,
    tx: &watch::Sender<Option<Endpoints>>,
) -> tokio::task::AbortHandle {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let config = watcher::Config::default().labels(&spec.selector);
    let (rules, ports) = (rules.clone(), spec.ports.clone());
    let what = format!("Pods {} in {namespace}", spec.selector);
    tokio::spawn(follow(api, config, what, tx.clone(), move |pod: &Pod| {
        rules.endpoints(pod, &ports)
    }))
    .abort_handle()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pool(spec: serde_json::Value) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "vllm", "namespace": "llm"}, "spec": spec
        }))
        .unwrap()
    }

    #[test]
    fn a_pool_s_selector_and_ports_are_read_as_gie_v1_defines_them() {
        let p = pool(json!({
            "selector": {"matchLabels": {"app": "vllm", "tier": "gpu"}},
            "targetPorts": [{"number": 8000}, {"number": 8001}],
            "endpointPickerRef": {"name": "semlb-epp", "port": {"number": 9002}}
        }));
        assert_eq!(
            PoolSpec::of(&p),
            Ok(PoolSpec {
                selector: "app=vllm,tier=gpu".into(),
                ports: vec![8000, 8001]
            })
        );
        for (spec, says) in [
            (json!({"targetPorts": [{"number": 8000}]}), "matchLabels is empty"),
            (json!({"selector": {"matchLabels": {"app": "vllm"}}}), "targetPorts"),
            (
                json!({"selector": {"matchLabels": {"app": 3}}, "targetPorts": [{"number": 1}]}),
                "matchLabels",
            ),
        ] {
            let e = PoolSpec::of(&pool(spec)).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
    }
}
