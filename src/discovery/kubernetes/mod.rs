//! Kubernetes discovery, with kube-rs (its client over rustls, and its
//! watcher: list, then watch from the list's resourceVersion with
//! bookmarks, list again on 410 Gone, back off on errors).
//!
//! | kind | watches | file |
//! | --- | --- | --- |
//! | `kubernetes` with `selector` | the Pods of a label selector | [`pods`] |
//! | `kubernetes` with `service` | the EndpointSlices of a Service (label `kubernetes.io/service-name`) | [`slices`] |
//! | `inference-pool` | an InferencePool, then the Pods it selects | [`inference_pool`] |
//!
//! [`follow`] turns one watch into sets of endpoints.
//!
//! **Credentials:** `discovery.kubeconfig` if set; else kube-rs's
//! inference: in a Pod, its service account (the token and CA mounted at
//! `/var/run/secrets/kubernetes.io/serviceaccount`, the API server from
//! `KUBERNETES_SERVICE_HOST`), else `$KUBECONFIG` or `~/.kube/config`.
//! The service account needs `get`, `list` and `watch` on what is
//! watched (`deploy/kubernetes` has the Role).
//!
//! **Namespace:** `discovery.namespace`, else the credentials' (the Pod's
//! own namespace in a cluster, the kubeconfig context's outside).

pub mod follow;
pub mod inference_pool;
pub mod pods;
pub mod slices;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher;
use kube::{Api, Client};
use tokio::sync::watch;

use super::{DiscoveryError, Endpoints};
use crate::config::{DiscoveryConfig, DiscoveryKind};
use pods::PodRules;
use slices::{SERVICE_NAME_LABEL, SliceRules};

/// A client with the credentials `config` says.
pub async fn client(config: &DiscoveryConfig) -> Result<Client, DiscoveryError> {
    let fail = |e: &dyn std::fmt::Display| DiscoveryError::Kubernetes(e.to_string());
    let kube_config = match &config.kubeconfig {
        Some(path) => {
            let file = Kubeconfig::read_from(path).map_err(|e| fail(&format_args!("{}: {e}", path.display())))?;
            kube::Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
                .await
                .map_err(|e| fail(&format_args!("{}: {e}", path.display())))?
        }
        None => kube::Config::infer().await.map_err(|e| {
            fail(&format_args!(
                "no credentials: not in a Pod, and no kubeconfig ($KUBECONFIG, ~/.kube/config, or discovery.kubeconfig): {e}"
            ))
        })?,
    };
    Client::try_from(kube_config).map_err(|e| fail(&e))
}

/// Starts the watch `config` says, sending its sets on `tx`.
pub async fn spawn(config: &DiscoveryConfig, tx: watch::Sender<Option<Endpoints>>) -> Result<(), DiscoveryError> {
    let client = client(config).await?;
    let namespace = config
        .namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_owned());
    match (config.kind, &config.selector, &config.service, &config.inference_pool) {
        (Some(DiscoveryKind::Kubernetes), Some(selector), _, _) => {
            let api: Api<Pod> = Api::namespaced(client, &namespace);
            let rules = PodRules::of(config);
            let what = format!("Pods {selector} in {namespace}");
            tokio::spawn(follow::follow(
                api,
                watcher::Config::default().labels(selector),
                what,
                tx,
                move |pod: &Pod| rules.endpoints(pod, &[]),
            ));
        }
        (Some(DiscoveryKind::Kubernetes), None, Some(service), _) => {
            let api: Api<EndpointSlice> = Api::namespaced(client, &namespace);
            let rules = SliceRules::of(config);
            let what = format!("the EndpointSlices of Service {namespace}/{service}");
            tokio::spawn(follow::follow(
                api,
                watcher::Config::default().labels(&format!("{SERVICE_NAME_LABEL}={service}")),
                what,
                tx,
                move |slice: &EndpointSlice| rules.endpoints(slice),
            ));
        }
        (Some(DiscoveryKind::InferencePool), _, _, Some(pool)) => {
            tokio::spawn(inference_pool::follow_pool(
                client,
                namespace,
                pool.clone(),
                PodRules::of(config),
                tx,
            ));
        }
        _ => {
            return Err(DiscoveryError::Kubernetes(
                "nothing to watch (the configuration check should have said)".into(),
            ));
        }
    }
    Ok(())
}
