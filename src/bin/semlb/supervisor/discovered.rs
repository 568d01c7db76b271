//! The supervisor's side of discovery (`[discovery]`, [`semlb::discovery`]):
//! the source runs as a task of the supervisor's runtime, and each set it
//! sends is reconciled with the server table ([`Backends::discovered`]),
//! each endpoint in the model pool it names.
//!
//! A reload that changes `[discovery]` starts the source again with the
//! new settings (the backends found so far stay until the new source has
//! seen its first set); one that turns discovery off drains what it found.
//! Every reload reconciles the last set again, so a changed `[[model]]`
//! list moves discovered engines to their pools.

use std::collections::HashSet;

use anyhow::{Context, Result};
use semlb::config::{DiscoveryConfig, ServeConfig};
use semlb::discovery::{Endpoints, Found};
use shm_layout::PoolTag;

use super::Supervisor;
use super::backends::address_of;

/// The running source and what was logged about its endpoints.
#[derive(Default)]
pub(super) struct Discovery {
    /// The source's sets; `None`: no discovery.
    found: Option<Found>,
    /// The settings it runs with.
    config: DiscoveryConfig,
    /// Endpoints left out and logged (their address and why), so a set
    /// sent again does not log them again.
    logged: HashSet<String>,
}

impl Discovery {
    /// Starts the source `config` says (none without `[discovery]`).
    pub(super) async fn start(config: &DiscoveryConfig) -> Result<Self> {
        let found = semlb::discovery::spawn(config)
            .await
            .context("starting discovery ([discovery])")?;
        if let Some(kind) = config.kind {
            tracing::info!(kind = %kind, "discovery: following {kind} endpoints");
        }
        Ok(Self {
            found,
            config: config.clone(),
            logged: HashSet::new(),
        })
    }

    /// Waits for the source's next set (forever without a source, or once
    /// the source has ended).
    pub(super) async fn changed(&mut self) {
        let ended = match &mut self.found {
            Some(found) => found.changed().await.is_err(),
            None => true,
        };
        if ended {
            self.found = None;
            std::future::pending::<()>().await;
        }
    }

    /// The last set the source sent (`None`: none yet, or no source).
    fn last(&mut self) -> Option<Endpoints> {
        self.found.as_mut().and_then(|f| f.borrow_and_update().clone())
    }

    /// `endpoints` as the backends to register, each in its pool; those
    /// that cannot be are logged once and left out.
    fn wanted(
        &mut self,
        endpoints: &Endpoints,
        config: &ServeConfig,
    ) -> Vec<(String, semlb::config::BackendConfig, PoolTag)> {
        let mut wanted = Vec::with_capacity(endpoints.len());
        for endpoint in endpoints.iter() {
            let backend = endpoint.backend(&config.discovery);
            let refused = address_of(&backend).map_err(|e| e.to_string()).and_then(|address| {
                semlb::discovery::pool_of(
                    endpoint.model.as_deref(),
                    config.discovery.model.as_deref(),
                    &config.models,
                )
                .map(|pool| (address, pool))
                .map_err(|e| e.to_string())
            });
            match refused {
                Ok((address, pool)) => wanted.push((address, backend, pool)),
                Err(why) => {
                    if self.logged.insert(format!("{}\0{why}", endpoint.url)) {
                        tracing::warn!(endpoint = %endpoint.url, "discovery: {} is left out: {why}", endpoint.url);
                    }
                }
            }
        }
        wanted
    }
}

impl Supervisor<'_> {
    /// Reconciles the backends with the source's last set, if it has one.
    pub(super) fn follow_discovery(&mut self) {
        let Some(endpoints) = self.discovery.last() else {
            return;
        };
        let wanted = self.discovery.wanted(&endpoints, &self.config);
        let (added, removed) = self.backends.discovered(&wanted, self.config.drain_timeout());
        if added + removed > 0 {
            tracing::info!(
                added,
                removed,
                "discovery: {added} backends added, {removed} removed; {} found",
                wanted.len()
            );
        }
    }

    /// After a reload: the source again if `[discovery]` changed (drained
    /// if it was turned off), and the last set reconciled with the new
    /// pools.
    pub(super) async fn rediscover(&mut self) {
        if self.config.discovery != self.discovery.config {
            match Discovery::start(&self.config.discovery).await {
                Ok(new) => {
                    let off = new.found.is_none();
                    self.discovery = new;
                    if off {
                        let (_, removed) = self.backends.discovered(&[], self.config.drain_timeout());
                        tracing::info!(removed, "discovery is off: draining the {removed} backends it found");
                    }
                }
                Err(e) => tracing::error!("reload: {e:#}; discovery keeps its running settings"),
            }
            return;
        }
        // The same source: its last set, borrowed again for the new pools.
        if let Some(found) = &self.discovery.found {
            let endpoints = found.borrow().clone();
            if let Some(endpoints) = endpoints {
                let wanted = self.discovery.wanted(&endpoints, &self.config);
                self.backends.discovered(&wanted, self.config.drain_timeout());
            }
        }
    }
}
