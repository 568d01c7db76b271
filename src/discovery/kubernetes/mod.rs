//! Kubernetes discovery (being written).
use tokio::sync::watch;

use super::{DiscoveryError, Endpoints};
use crate::config::DiscoveryConfig;

/// Starts watching.
pub async fn spawn(_config: &DiscoveryConfig, _tx: watch::Sender<Option<Endpoints>>) -> Result<(), DiscoveryError> {
    Err(DiscoveryError::Kubernetes("not built yet".into()))
}
