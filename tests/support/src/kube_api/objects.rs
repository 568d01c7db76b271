//! Object builders for tests: Pods, EndpointSlices, InferencePools.

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

pub(super) fn uid(n: u64) -> String {
    let salt = crate::mix(n ^ u64::from(std::process::id()));
    format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        salt >> 32,
        (salt >> 16) & 0xffff,
        salt & 0xfff,
        (n >> 48) & 0xfff,
        n & 0xffff_ffff_ffff
    )
}

/// `YYYY-MM-DDTHH:MM:SSZ` (UTC).
pub fn rfc3339(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

pub(super) fn labels_map(labels: &[(&str, &str)]) -> Value {
    Value::Object(labels.iter().map(|(k, v)| ((*k).to_owned(), Value::from(*v))).collect())
}

/// A pod for tests: phase `Running`, condition `Ready` `True`/`False`, one
/// container `engine` with the port `http` 8000, `podIP` `ip`.
pub fn pod(namespace: &str, name: &str, ip: &str, labels: &[(&str, &str)], ready: bool) -> Value {
    PodBuilder::new(namespace, name)
        .ip(ip)
        .labels(labels)
        .ready(ready)
        .build()
}

/// A pod with more choices than [`pod`]: phase, no IP, terminating,
/// container ports, annotations.
#[derive(Clone, Debug)]
pub struct PodBuilder {
    pub(super) namespace: String,
    pub(super) name: String,
    pub(super) ip: Option<String>,
    pub(super) labels: Vec<(String, String)>,
    pub(super) annotations: Vec<(String, String)>,
    pub(super) ready: bool,
    pub(super) phase: String,
    pub(super) deleting: bool,
    pub(super) ports: Vec<(String, u16)>,
}

impl PodBuilder {
    /// `Running`, ready, no IP, no labels, the port `http` 8000.
    pub fn new(namespace: &str, name: &str) -> PodBuilder {
        PodBuilder {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            ip: None,
            labels: Vec::new(),
            annotations: Vec::new(),
            ready: true,
            phase: "Running".to_owned(),
            deleting: false,
            ports: vec![("http".to_owned(), 8000)],
        }
    }

    /// Its `status.podIP` (and `podIPs`).
    pub fn ip(mut self, ip: &str) -> Self {
        self.ip = Some(ip.to_owned());
        self
    }

    /// Its labels (added).
    pub fn labels(mut self, labels: &[(&str, &str)]) -> Self {
        self.labels
            .extend(labels.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
        self
    }

    /// Its annotations (added).
    pub fn annotations(mut self, annotations: &[(&str, &str)]) -> Self {
        self.annotations
            .extend(annotations.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
        self
    }

    /// The `Ready` condition.
    pub fn ready(mut self, ready: bool) -> Self {
        self.ready = ready;
        self
    }

    /// `status.phase` (`Pending`, `Running`, `Succeeded`, `Failed`, `Unknown`).
    pub fn phase(mut self, phase: &str) -> Self {
        self.phase = phase.to_owned();
        self
    }

    /// Terminating: a `deletionTimestamp` (and a 30 s grace period).
    pub fn deleting(mut self) -> Self {
        self.deleting = true;
        self
    }

    /// The container's named ports (replacing `http` 8000).
    pub fn ports(mut self, ports: &[(&str, u16)]) -> Self {
        self.ports = ports.iter().map(|(n, p)| ((*n).to_owned(), *p)).collect();
        self
    }

    /// The pod.
    pub fn build(self) -> Value {
        let pairs = |v: &[(String, String)]| {
            Value::Object(v.iter().map(|(k, v)| (k.clone(), Value::from(v.as_str()))).collect())
        };
        let mut meta = json!({"name": self.name, "namespace": self.namespace});
        if !self.labels.is_empty() {
            meta["labels"] = pairs(&self.labels);
        }
        if !self.annotations.is_empty() {
            meta["annotations"] = pairs(&self.annotations);
        }
        if self.deleting {
            meta["deletionTimestamp"] = rfc3339(SystemTime::now()).into();
            meta["deletionGracePeriodSeconds"] = 30.into();
        }
        let ports: Vec<Value> = self
            .ports
            .iter()
            .map(|(n, p)| json!({"name": n, "containerPort": p, "protocol": "TCP"}))
            .collect();
        let flag = if self.ready { "True" } else { "False" };
        let mut status = json!({
            "phase": self.phase,
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "ContainersReady", "status": flag},
                {"type": "Ready", "status": flag},
            ],
        });
        if let Some(ip) = &self.ip {
            status["podIP"] = ip.as_str().into();
            status["podIPs"] = json!([{"ip": ip}]);
        }
        json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": meta,
            "spec": {
                "containers": [{"name": "engine", "image": "vllm/vllm-openai:latest", "ports": ports}],
                "nodeName": "node-1",
            },
            "status": status,
        })
    }
}

/// An EndpointSlice of `service` (label `kubernetes.io/service-name`),
/// IPv4, one port `(name, number)`; each endpoint `(ip, ready, terminating,
/// pod name)`, with the conditions the EndpointSlice controller writes:
/// `serving` = the pod is ready, `ready` = serving and not terminating.
pub fn endpoint_slice(
    namespace: &str,
    name: &str,
    service: &str,
    port: (&str, u16),
    endpoints: &[(&str, bool, bool, Option<&str>)],
) -> Value {
    let endpoints: Vec<Value> = endpoints
        .iter()
        .map(|(ip, ready, terminating, pod)| {
            let mut e = json!({
                "addresses": [ip],
                "conditions": {"ready": *ready && !*terminating, "serving": ready, "terminating": terminating},
            });
            if let Some(pod) = pod {
                e["targetRef"] = json!({"kind": "Pod", "namespace": namespace, "name": pod});
            }
            e
        })
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                "kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
            },
        },
        "addressType": "IPv4",
        "ports": [{"name": port.0, "port": port.1, "protocol": "TCP"}],
        "endpoints": endpoints,
    })
}

/// An `inference.networking.k8s.io/v1` InferencePool: `spec.selector.matchLabels`,
/// `spec.targetPorts` (`[{number}]`), `spec.endpointPickerRef`
/// (`{name: "<name>-epp", port: {number: 9002}}`, with the CRD's defaults
/// `group: ""`, `kind: Service`, `failureMode: FailClose` written out, as a
/// server that defaulted them returns it).
pub fn inference_pool(namespace: &str, name: &str, match_labels: &[(&str, &str)], target_ports: &[u16]) -> Value {
    let ports: Vec<Value> = target_ports.iter().map(|p| json!({"number": p})).collect();
    json!({
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": labels_map(match_labels)},
            "targetPorts": ports,
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": format!("{name}-epp"),
                "port": {"number": 9002},
                "failureMode": "FailClose",
            },
        },
    })
}
