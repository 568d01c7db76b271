//! A Pod as engines: ready ones only, at the engines' port (or ports), in
//! the model and the P/D role its labels say.
//!
//! | what | from |
//! | --- | --- |
//! | ready | phase `Running` and condition `Ready` = `True`, no deletion timestamp (a Pod being deleted drains) |
//! | address | `status.podIP` |
//! | port | `discovery.port`, else the container port named `discovery.port_name`; an InferencePool's `targetPorts` (one engine per port) |
//! | model | the label `discovery.model_label`, else the annotation `discovery.model_annotation` (else `discovery.model`, later) |
//! | role | `prefill` if `discovery.prefill_selector` matches, `decode` if `discovery.decode_selector` does; without either, llm-d's label `llm-d.ai/role` (`prefill`, `decode`, `both`); else `both` |
//! | name | the Pod's name (with several ports: `host:port`) |

use k8s_openapi::api::core::v1::Pod;

use super::super::Endpoint;
use super::super::selector::Selector;
use crate::config::{BackendRole, DiscoveryConfig};

/// llm-d's label for a Pod's part in disaggregated serving.
pub const LLM_D_ROLE_LABEL: &str = "llm-d.ai/role";

/// How Pods become endpoints (from `[discovery]`).
#[derive(Debug, Clone, Default)]
pub struct PodRules {
    /// The engines' port.
    pub port: Option<u16>,
    /// Or the name of their container port.
    pub port_name: Option<String>,
    /// The label holding the model.
    pub model_label: Option<String>,
    /// The annotation holding the model.
    pub model_annotation: Option<String>,
    /// Pods that prefill.
    pub prefill: Option<Selector>,
    /// Pods that decode.
    pub decode: Option<Selector>,
}

impl PodRules {
    /// The rules `[discovery]` gives (its selectors were checked when the
    /// configuration was validated; one that does not parse selects none).
    pub fn of(config: &DiscoveryConfig) -> Self {
        let selector = |s: &Option<String>| s.as_deref().map(|s| Selector::parse(s).unwrap_or_default());
        Self {
            port: config.port,
            port_name: config.port_name.clone(),
            model_label: config.model_label.clone(),
            model_annotation: config.model_annotation.clone(),
            prefill: selector(&config.prefill_selector),
            decode: selector(&config.decode_selector),
        }
    }

    /// The ports of `pod`'s engines: `targets` if given (an
    /// InferencePool's), else `port`, else the named container port.
    fn ports(&self, pod: &Pod, targets: &[u16]) -> Vec<u16> {
        if !targets.is_empty() {
            return targets.to_vec();
        }
        if let Some(port) = self.port {
            return vec![port];
        }
        let Some(name) = &self.port_name else {
            return Vec::new();
        };
        pod.spec
            .iter()
            .flat_map(|s| &s.containers)
            .flat_map(|c| c.ports.iter().flatten())
            .filter(|p| p.name.as_deref() == Some(name.as_str()))
            .filter_map(|p| u16::try_from(p.container_port).ok())
            .take(1)
            .collect()
    }

    /// Its part in disaggregated serving.
    fn role(&self, pod: &Pod) -> BackendRole {
        let labels = pod.metadata.labels.clone().unwrap_or_default();
        if self.prefill.is_some() || self.decode.is_some() {
            if self.prefill.as_ref().is_some_and(|s| s.matches(&labels)) {
                return BackendRole::Prefill;
            }
            if self.decode.as_ref().is_some_and(|s| s.matches(&labels)) {
                return BackendRole::Decode;
            }
            return BackendRole::Both;
        }
        match labels.get(LLM_D_ROLE_LABEL).map(String::as_str) {
            Some("prefill") => BackendRole::Prefill,
            Some("decode") => BackendRole::Decode,
            _ => BackendRole::Both,
        }
    }

    /// The model it says it serves.
    fn model(&self, pod: &Pod) -> Option<String> {
        let m = &pod.metadata;
        self.model_label
            .as_ref()
            .and_then(|k| m.labels.as_ref()?.get(k))
            .or_else(|| {
                self.model_annotation
                    .as_ref()
                    .and_then(|k| m.annotations.as_ref()?.get(k))
            })
            .cloned()
    }

    /// The engines `pod` runs, if it is ready (`targets`: an
    /// InferencePool's target ports).
    pub fn endpoints(&self, pod: &Pod, targets: &[u16]) -> Vec<Endpoint> {
        let Some(ip) = ready_ip(pod) else {
            return Vec::new();
        };
        let ports = self.ports(pod, targets);
        let (role, model) = (self.role(pod), self.model(pod));
        let one = ports.len() == 1;
        ports
            .into_iter()
            .map(|port| Endpoint {
                url: format!("http://{}:{port}", bracketed(ip)),
                name: if one { pod.metadata.name.clone() } else { None },
                role,
                bootstrap_port: None,
                model: model.clone(),
                cache_salt: None,
                metrics_flavor: None,
                weight: 1,
                kv_events: None,
                kv_events_replay: None,
            })
            .collect()
    }
}

/// `pod`'s IP, if it takes requests: running, ready, not being deleted.
pub fn ready_ip(pod: &Pod) -> Option<&str> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    if status.phase.as_deref() != Some("Running") {
        return None;
    }
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    ready.then_some(status.pod_ip.as_deref()?).filter(|ip| !ip.is_empty())
}

/// An IP as a URL's host (IPv6 in brackets).
pub fn bracketed(ip: &str) -> std::borrow::Cow<'_, str> {
    if ip.contains(':') {
        format!("[{ip}]").into()
    } else {
        ip.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(labels: serde_json::Value, phase: &str, ready: &str, deleting: bool) -> Pod {
        let mut metadata = json!({"name": "vllm-0", "namespace": "llm", "labels": labels,
            "annotations": {"semlb.io/model": "from-annotation"}});
        if deleting {
            metadata["deletionTimestamp"] = json!("2026-12-07T00:00:00Z");
        }
        serde_json::from_value(json!({
            "metadata": metadata,
            "spec": {"containers": [{"name": "engine", "ports": [
                {"name": "metrics", "containerPort": 9090}, {"name": "http", "containerPort": 8000}]}]},
            "status": {"phase": phase, "podIP": "10.1.2.3",
                "conditions": [{"type": "Ready", "status": ready}, {"type": "PodScheduled", "status": "True"}]}
        }))
        .unwrap()
    }

    fn rules(port: Option<u16>, port_name: Option<&str>) -> PodRules {
        PodRules {
            port,
            port_name: port_name.map(str::to_owned),
            model_label: Some("model".into()),
            model_annotation: Some("semlb.io/model".into()),
            ..PodRules::default()
        }
    }

    #[test]
    fn only_running_ready_pods_not_being_deleted_are_engines() {
        let r = rules(Some(8000), None);
        let labels = json!({"app": "vllm", "model": "qwen"});
        let e = r.endpoints(&pod(labels.clone(), "Running", "True", false), &[]);
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].url, "http://10.1.2.3:8000");
        assert_eq!(e[0].name.as_deref(), Some("vllm-0"));
        assert_eq!(e[0].model.as_deref(), Some("qwen"));
        assert_eq!(e[0].role, BackendRole::Both);
        for (phase, ready, deleting) in [
            ("Pending", "True", false),
            ("Running", "False", false),
            ("Running", "Unknown", false),
            ("Running", "True", true),
            ("Succeeded", "True", false),
        ] {
            assert!(
                r.endpoints(&pod(labels.clone(), phase, ready, deleting), &[])
                    .is_empty(),
                "{phase} {ready} {deleting}"
            );
        }
    }

    #[test]
    fn ports_come_from_the_setting_a_named_container_port_or_the_pool() {
        let p = pod(json!({}), "Running", "True", false);
        let urls =
            |r: &PodRules, targets: &[u16]| r.endpoints(&p, targets).into_iter().map(|e| e.url).collect::<Vec<_>>();
        assert_eq!(urls(&rules(None, Some("http")), &[]), ["http://10.1.2.3:8000"]);
        assert_eq!(urls(&rules(None, Some("grpc")), &[]), Vec::<String>::new());
        assert_eq!(urls(&rules(Some(30000), Some("http")), &[]), ["http://10.1.2.3:30000"]);
        assert_eq!(
            urls(&rules(None, None), &[8000, 8001]),
            ["http://10.1.2.3:8000", "http://10.1.2.3:8001"]
        );
        assert!(
            rules(None, None)
                .endpoints(&p, &[8000, 8001])
                .iter()
                .all(|e| e.name.is_none())
        );
        // The model from the annotation when the label is absent.
        assert_eq!(
            rules(Some(1), None).endpoints(&p, &[])[0].model.as_deref(),
            Some("from-annotation")
        );
    }

    #[test]
    fn roles_come_from_the_selectors_or_llm_d_s_label() {
        let labelled = |role: &str| {
            pod(
                json!({"app": "vllm", "llm-d.ai/role": role, "tier": role}),
                "Running",
                "True",
                false,
            )
        };
        let plain = rules(Some(8000), None);
        assert_eq!(plain.endpoints(&labelled("prefill"), &[])[0].role, BackendRole::Prefill);
        assert_eq!(plain.endpoints(&labelled("decode"), &[])[0].role, BackendRole::Decode);
        assert_eq!(plain.endpoints(&labelled("both"), &[])[0].role, BackendRole::Both);
        let mut by_selector = rules(Some(8000), None);
        by_selector.prefill = Some(Selector::parse("tier=decode").unwrap());
        assert_eq!(
            by_selector.endpoints(&labelled("decode"), &[])[0].role,
            BackendRole::Prefill,
            "the selectors, not the label"
        );
        assert_eq!(
            by_selector.endpoints(&labelled("prefill"), &[])[0].role,
            BackendRole::Both
        );
    }

    #[test]
    fn ipv6_pods_are_bracketed() {
        let mut p = pod(json!({}), "Running", "True", false);
        p.status.as_mut().unwrap().pod_ip = Some("fd00::1".into());
        let e = rules(Some(8000), None).endpoints(&p, &[]);
        assert_eq!(e[0].url, "http://[fd00::1]:8000");
    }
}
