//! A Service's EndpointSlice as engines (`discovery.service`): the
//! endpoints whose `ready` condition is not false and that are not
//! terminating, on the slice's port named `discovery.port_name` (else
//! `discovery.port` if the slice has it, else its only port).
//!
//! A slice carries no Pod labels, so every engine serves the pool
//! `discovery.model` names, in role `both`; use Pod discovery
//! (`discovery.selector`) to read models and roles from labels.

use k8s_openapi::api::discovery::v1::EndpointSlice;

use super::super::Endpoint;
use super::pods::bracketed;
use crate::config::{BackendRole, DiscoveryConfig};

/// The label that ties a slice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// How slices become endpoints.
#[derive(Debug, Clone, Default)]
pub struct SliceRules {
    port: Option<u16>,
    port_name: Option<String>,
}

impl SliceRules {
    /// The rules `[discovery]` gives.
    pub fn of(config: &DiscoveryConfig) -> Self {
        Self {
            port: config.port,
            port_name: config.port_name.clone(),
        }
    }

    /// The slice's port for the engines.
    fn port(&self, slice: &EndpointSlice) -> Option<u16> {
        let ports = slice.ports.as_deref().unwrap_or_default();
        let number = |p: &k8s_openapi::api::discovery::v1::EndpointPort| p.port.and_then(|n| u16::try_from(n).ok());
        if let Some(name) = &self.port_name {
            return ports
                .iter()
                .find(|p| p.name.as_deref() == Some(name.as_str()))
                .and_then(number);
        }
        if let Some(port) = self.port {
            return ports
                .iter()
                .filter_map(number)
                .find(|n| *n == port)
                .or(ports.is_empty().then_some(port));
        }
        match ports {
            [only] => number(only),
            _ => None,
        }
    }

    /// The engines `slice` lists as ready.
    pub fn endpoints(&self, slice: &EndpointSlice) -> Vec<Endpoint> {
        if !matches!(slice.address_type.as_str(), "IPv4" | "IPv6") {
            return Vec::new();
        }
        let Some(port) = self.port(slice) else {
            return Vec::new();
        };
        slice
            .endpoints
            .iter()
            .filter(|e| {
                let c = e.conditions.as_ref();
                // An unknown readiness counts as ready (the API's rule).
                c.and_then(|c| c.ready) != Some(false) && c.and_then(|c| c.terminating) != Some(true)
            })
            .filter_map(|e| {
                let ip = e.addresses.first()?;
                Some(Endpoint {
                    url: format!("http://{}:{port}", bracketed(ip)),
                    name: e
                        .target_ref
                        .as_ref()
                        .filter(|r| r.kind.as_deref() == Some("Pod"))
                        .and_then(|r| r.name.clone()),
                    role: BackendRole::Both,
                    bootstrap_port: None,
                    model: None,
                    cache_salt: None,
                    metrics_flavor: None,
                    weight: 1,
                    kv_events: None,
                    kv_events_replay: None,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn slice(ports: serde_json::Value) -> EndpointSlice {
        serde_json::from_value(json!({
            "metadata": {"name": "vllm-abc", "namespace": "llm", "labels": {SERVICE_NAME_LABEL: "vllm"}},
            "addressType": "IPv4",
            "ports": ports,
            "endpoints": [
                {"addresses": ["10.0.0.1"], "conditions": {"ready": true}, "targetRef": {"kind": "Pod", "name": "vllm-0"}},
                {"addresses": ["10.0.0.2"], "conditions": {"ready": false}},
                {"addresses": ["10.0.0.3"], "conditions": {"ready": true, "terminating": true}},
                {"addresses": ["10.0.0.4"]},
            ]
        }))
        .unwrap()
    }

    fn rules(port: Option<u16>, port_name: Option<&str>) -> SliceRules {
        SliceRules {
            port,
            port_name: port_name.map(str::to_owned),
        }
    }

    #[test]
    fn ready_endpoints_that_are_not_terminating_are_engines() {
        let s = slice(json!([{"name": "http", "port": 8000, "protocol": "TCP"}]));
        let e = rules(None, None).endpoints(&s);
        let urls: Vec<_> = e.iter().map(|e| e.url.as_str()).collect();
        assert_eq!(urls, ["http://10.0.0.1:8000", "http://10.0.0.4:8000"]);
        assert_eq!(e[0].name.as_deref(), Some("vllm-0"));
        assert_eq!(e[1].name, None);
    }

    #[test]
    fn the_port_is_the_named_one_the_configured_one_or_the_only_one() {
        let two = slice(json!([{"name": "metrics", "port": 9090}, {"name": "http", "port": 8000}]));
        let port = |r: SliceRules| r.endpoints(&two).first().map(|e| e.url.clone());
        assert_eq!(port(rules(None, Some("http"))).as_deref(), Some("http://10.0.0.1:8000"));
        assert_eq!(port(rules(Some(9090), None)).as_deref(), Some("http://10.0.0.1:9090"));
        assert_eq!(port(rules(None, None)), None, "two ports and nothing says which");
        assert_eq!(port(rules(Some(7), None)), None, "not a port of the slice");
        assert_eq!(port(rules(None, Some("grpc"))), None);
        let mut fqdn = slice(json!([{"port": 8000}]));
        fqdn.address_type = "FQDN".into();
        assert!(rules(None, None).endpoints(&fqdn).is_empty());
    }
}
