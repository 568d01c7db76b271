//! The backends registered in the shm server table, as the supervisor
//! keeps them ([`Backends`]): the configured ones (and those added through
//! the admin API), and the removed ones still draining.
//!
//! A new backend is registered `Up`, so every dispatcher routes to it at
//! once; a removed one is set `Draining` (dispatchers route only to `Up`
//! servers) and retired, its slot freed, once it has no request in flight
//! or after `drain_timeout_secs`; one listed again while still draining is
//! `Up` again; unchanged ones are not touched (their prefix entries, load
//! and counts stay). A reload applies the file's list with
//! [`Backends::apply`], the admin API one backend at a time, discovery a
//! source's whole set with [`Backends::discovered`]. Each manages its own:
//! a reload leaves discovered backends alone, discovery leaves configured
//! and added ones alone (a backend both configured and discovered is the
//! configuration's).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use semlb::config::{BackendConfig, BackendUrlError};
use shm_layout::{PoolTag, Segment, ServerInfo, ServerRef, ServerState};

/// The backends registered in the server table: the configured ones, and
/// the removed ones still draining.
#[derive(Debug)]
pub(super) struct Backends<'a> {
    segment: &'a Segment,
    /// Configured backends, by address (`http://host:port`).
    live: Vec<(String, ServerRef)>,
    /// Removed backends finishing their requests: address, registration,
    /// when they are retired even with requests in flight.
    draining: Vec<(String, ServerRef, Instant)>,
    /// Names (`name`, else `host:port`) by address, live and draining.
    names: HashMap<String, String>,
    /// Addresses of live backends added through the admin API and not (or
    /// not yet) listed in the configuration.
    from_admin: HashSet<String>,
    /// Addresses of live backends found by discovery and not configured.
    from_discovery: HashSet<String>,
    /// Registrations an earlier supervisor left, not yet configured or
    /// drained ([`Backends::adopt`]).
    adopted: Vec<(String, ServerRef)>,
}

/// What the supervisor knows of a server-table slot.
#[derive(Debug)]
pub(super) enum Found<'b> {
    /// A live backend.
    Live { address: &'b str, server: ServerRef },
    /// A removed backend still draining, retired at `until` at the latest.
    Removing {
        address: &'b str,
        server: ServerRef,
        until: Instant,
    },
    /// Neither.
    Unknown,
}

/// Why [`Backends::add`] refused a backend.
#[derive(Debug)]
pub(super) enum AddError {
    /// The address is registered already, in `slot`.
    AlreadyRegistered { slot: u16 },
    /// Another live backend, at `other`, has the name.
    NameTaken { name: String, other: String },
    /// The server table refused it (full).
    Table(anyhow::Error),
}

/// How many backends are live, of them `Up`, and draining (for the status line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Counts {
    /// Live backends whose registration is current and `Up`.
    pub up: usize,
    /// Live backends.
    pub live: usize,
    /// Removed backends still draining.
    pub draining: usize,
}

/// How a backend is named in the server table: `http://host:port`, or the
/// reason its URL does not parse.
pub(super) fn address_of(backend: &BackendConfig) -> Result<String, BackendUrlError> {
    backend.server_address()
}

impl<'a> Backends<'a> {
    /// None yet, in `segment`'s server table.
    pub(super) fn new(segment: &'a Segment) -> Self {
        Self {
            segment,
            live: Vec::new(),
            draining: Vec::new(),
            names: HashMap::new(),
            from_admin: HashSet::new(),
            from_discovery: HashSet::new(),
            adopted: Vec::new(),
        }
    }

    /// The registrations an earlier supervisor left in `segment`'s server
    /// table (a hot restart or an upgrade), untouched until
    /// [`Backends::configure`] keeps those still configured and
    /// [`Backends::settle`] drains the others.
    pub(super) fn adopt(segment: &'a Segment) -> Self {
        let mut backends = Self::new(segment);
        for info in segment.tables().servers.servers() {
            backends.adopted.push((info.address, info.server));
        }
        backends
    }

    /// Registers a configured `backend` at start: the registration an
    /// earlier supervisor left for its address ([`Backends::adopt`]) is
    /// kept, with its prefix entries, figures and learned limits (and `Up`
    /// again if it was draining); otherwise a new one is made
    /// ([`Backends::register`]).
    pub(super) fn configure(&mut self, backend: &BackendConfig) -> Result<ServerRef> {
        let address = address_of(backend).map_err(|e| anyhow!("backend {}: {e}", backend.url))?;
        if let Some(i) = self.adopted.iter().position(|(a, _)| *a == address) {
            let (address, server) = self.adopted.swap_remove(i);
            let servers = self.segment.tables().servers;
            servers.transition(server, ServerState::Draining, ServerState::Up);
            // The configuration's role and settings (an earlier binary's
            // registration may carry none: its dispatchers read them from
            // the configuration).
            self.keep_facts(server, &address, backend);
            self.names.insert(address.clone(), backend.display_name());
            self.live.push((address, server));
            return Ok(server);
        }
        self.register(backend)
    }

    /// Drains the adopted registrations no backend of the configuration
    /// kept: retired once nothing is in flight to them, or after
    /// `drain_timeout`. With `discovering`, they are kept as discovered
    /// instead (an upgrade or a restart of a gateway whose engines are
    /// discovered keeps serving them): discovery's first set then drains
    /// those it does not find ([`Backends::discovered`]).
    pub(super) fn settle(&mut self, drain_timeout: Duration, discovering: bool) {
        let until = Instant::now() + drain_timeout;
        let servers = self.segment.tables().servers;
        if discovering {
            // Their states stay (a server the health checks took out stays
            // out until they bring it back).
            for (address, server) in std::mem::take(&mut self.adopted) {
                tracing::info!(backend = %address, "backend {address} is not configured; kept until discovery says");
                self.names.insert(address.clone(), address.clone());
                self.from_discovery.insert(address.clone());
                self.live.push((address, server));
            }
            return;
        }
        for (address, server) in std::mem::take(&mut self.adopted) {
            servers.set_state(server, ServerState::Draining);
            tracing::info!(backend = %address, "backend {address} is no longer configured; draining it");
            self.names.insert(address.clone(), address.clone());
            self.draining.push((address, server, until));
        }
    }

    /// Registers `backend` in the server table (state `Up`: dispatchers
    /// route to it at once) and counts it as configured.
    pub(super) fn register(&mut self, backend: &BackendConfig) -> Result<ServerRef> {
        self.register_in(backend, PoolTag::NONE)
    }

    /// [`Backends::register`], in model pool `pool` (discovery's backends,
    /// which no pool lists).
    fn register_in(&mut self, backend: &BackendConfig, pool: PoolTag) -> Result<ServerRef> {
        let address = address_of(backend).map_err(|e| anyhow!("backend {}: {e}", backend.url))?;
        let server = self
            .segment
            .tables()
            .servers
            .register_in(
                semlb::store::server_id(&address),
                &address,
                self.segment.clock().now_ms(),
                backend.role.with_port(backend.bootstrap_port),
                pool,
                backend.engine_settings(),
            )
            .with_context(|| format!("registering backend {}", backend.url))?;
        self.names.insert(address.clone(), backend.display_name());
        self.live.push((address, server));
        Ok(server)
    }

    /// Gives `server` the role, bootstrap port and engine settings
    /// `backend` says, if it had others (a reload, the admin API or
    /// discovery changed them).
    fn keep_facts(&self, server: ServerRef, address: &str, backend: &BackendConfig) {
        let servers = self.segment.tables().servers;
        let settings = backend.engine_settings();
        if servers.settings(server) != settings && servers.set_settings(server, settings) {
            tracing::info!(
                backend = %address,
                cache_salt = settings.cache_salt,
                "backend {address}: cache_salt {}, metrics {:?}",
                settings.cache_salt,
                backend.metrics_flavor
            );
        }
        let wanted = backend.role.with_port(backend.bootstrap_port);
        if servers.disaggregation(server) != wanted && servers.set_disaggregation(server, wanted) {
            tracing::info!(
                backend = %address,
                role = wanted.role.name(),
                "backend {address} is now of role {}",
                wanted.role.name()
            );
        }
    }

    /// The live backend in server-table slot `slot`.
    fn live_in(&self, slot: u16) -> Option<usize> {
        self.live.iter().position(|(_, s)| s.slot == slot)
    }

    /// Moves live backend `i` to the draining list (state `Draining`), to be
    /// retired once drained or at `until`.
    fn start_draining(&mut self, i: usize, until: Instant) -> String {
        let (address, server) = self.live.remove(i);
        self.segment.tables().servers.set_state(server, ServerState::Draining);
        self.from_admin.remove(&address);
        self.from_discovery.remove(&address);
        self.draining.push((address.clone(), server, until));
        address
    }

    /// Draining backend `i` live again (state `Up`), unless its
    /// registration is gone.
    fn revive(&mut self, i: usize) -> Option<(String, ServerRef)> {
        let servers = self.segment.tables().servers;
        if !servers.set_state(self.draining[i].1, ServerState::Up) {
            return None;
        }
        let (address, server, _) = self.draining.remove(i);
        self.live.push((address.clone(), server));
        Some((address, server))
    }

    /// Makes `backends` (a reload's list) the configured backends: removed
    /// ones drain (retired at the latest after `drain_timeout`), added ones
    /// register, returning ones (still draining) are `Up` again; the others
    /// are not touched. Returns how many were added and removed.
    pub(super) fn apply(&mut self, backends: &[BackendConfig], drain_timeout: Duration) -> (usize, usize) {
        let mut wanted = Vec::new();
        for backend in backends {
            match address_of(backend) {
                Ok(a) if !wanted.iter().any(|(w, _)| *w == a) => wanted.push((a, backend)),
                Ok(_) => {}
                Err(e) => tracing::error!("reload: backend {}: {e}", backend.url),
            }
        }
        let (mut added, mut removed) = (0, 0);
        let until = Instant::now() + drain_timeout;
        // Discovered backends are discovery's to remove.
        while let Some(i) = self
            .live
            .iter()
            .position(|(a, _)| !self.from_discovery.contains(a) && !wanted.iter().any(|(w, _)| w == a))
        {
            let address = self.start_draining(i, until);
            tracing::info!(backend = %address, "reload: backend {address} removed; draining it");
            removed += 1;
        }
        for (address, backend) in wanted {
            // Listed in the file: the file's from now on, under its name.
            self.from_admin.remove(&address);
            self.from_discovery.remove(&address);
            self.names.insert(address.clone(), backend.display_name());
            if let Some((_, server)) = self.live.iter().find(|(a, _)| *a == address) {
                self.keep_facts(*server, &address, backend);
                continue;
            }
            added += 1;
            if let Some(i) = self.draining.iter().position(|(a, _, _)| *a == address)
                && let Some((address, server)) = self.revive(i)
            {
                self.keep_facts(server, &address, backend);
                tracing::info!(backend = %address, "reload: backend {address} added again (it was still draining)");
                continue;
            }
            match self.register(backend) {
                Ok(_) => tracing::info!(backend = %address, "reload: backend {address} added"),
                Err(e) => {
                    added -= 1;
                    tracing::error!(backend = %address, "reload: cannot add backend {address}: {e:#}");
                }
            }
        }
        (added, removed)
    }

    /// Adds `backend` (at `address`) as the admin API does: registered
    /// like a reload registers one, or `Up` again if it is still draining,
    /// and counted as added through the API.
    pub(super) fn add(&mut self, address: &str, backend: &BackendConfig) -> Result<ServerRef, AddError> {
        if let Some((_, server)) = self.live.iter().find(|(a, _)| *a == address) {
            return Err(AddError::AlreadyRegistered { slot: server.slot });
        }
        let name = backend.display_name();
        if let Some((other, _)) = self.live.iter().find(|(a, _)| self.names.get(a) == Some(&name)) {
            return Err(AddError::NameTaken {
                name,
                other: other.clone(),
            });
        }
        let again = self.draining.iter().position(|(a, _, _)| *a == address);
        // Being removed: it takes requests again, as after a reload that
        // lists it again.
        let server = match again.and_then(|i| self.revive(i)) {
            Some((_, server)) => {
                self.names.insert(address.to_owned(), name);
                self.keep_facts(server, address, backend);
                server
            }
            None => self.register(backend).map_err(AddError::Table)?,
        };
        self.from_admin.insert(address.to_owned());
        Ok(server)
    }

    /// Makes `found` (a discovery source's whole set: address, backend,
    /// pool) the discovered backends, as [`Backends::apply`] does for the
    /// configured ones: those no longer found drain (retired at the
    /// latest after `drain_timeout`), new ones register in their pool,
    /// returning ones (still draining) are `Up` again, the others keep
    /// their registration (their role and pool follow the source). A
    /// backend configured or added through the admin API is left to
    /// them. Returns how many were added and removed.
    pub(super) fn discovered(
        &mut self,
        found: &[(String, BackendConfig, PoolTag)],
        drain_timeout: Duration,
    ) -> (usize, usize) {
        let (mut added, mut removed) = (0, 0);
        let until = Instant::now() + drain_timeout;
        while let Some(i) = self
            .live
            .iter()
            .position(|(a, _)| self.from_discovery.contains(a) && !found.iter().any(|(f, _, _)| f == a))
        {
            let address = self.start_draining(i, until);
            tracing::info!(backend = %address, "discovery: backend {address} is gone; draining it");
            removed += 1;
        }
        let servers = self.segment.tables().servers;
        for (address, backend, pool) in found {
            if let Some((_, server)) = self.live.iter().find(|(a, _)| a == address) {
                if self.from_discovery.contains(address) {
                    self.keep_facts(*server, address, backend);
                    if servers.pool_of(*server) != *pool {
                        servers.set_pool(*server, *pool);
                    }
                }
                continue;
            }
            self.names.insert(address.clone(), backend.display_name());
            if let Some(i) = self.draining.iter().position(|(a, _, _)| a == address)
                && let Some((address, server)) = self.revive(i)
            {
                self.keep_facts(server, &address, backend);
                servers.set_pool(server, *pool);
                tracing::info!(backend = %address, "discovery: backend {address} is back (it was still draining)");
                self.from_discovery.insert(address);
                added += 1;
                continue;
            }
            match self.register_in(backend, *pool) {
                Ok(server) => {
                    tracing::info!(backend = %address, slot = server.slot, "discovery: backend {address} ({}) added", backend.display_name());
                    self.from_discovery.insert(address.clone());
                    added += 1;
                }
                Err(e) => {
                    self.names.remove(address);
                    tracing::error!(backend = %address, "discovery: cannot add backend {address}: {e:#}");
                }
            }
        }
        (added, removed)
    }

    /// Drains the live backend in `slot`, to be retired once drained (or at
    /// `until`: [`Backends::retire_drained`]); returns its address, `None`
    /// if no live backend is there.
    pub(super) fn remove(&mut self, slot: u16, until: Instant) -> Option<String> {
        let i = self.live_in(slot)?;
        Some(self.start_draining(i, until))
    }

    /// What is in server-table slot `slot`.
    pub(super) fn find(&self, slot: u16) -> Found<'_> {
        if let Some((address, server, until)) = self.draining.iter().find(|(_, s, _)| s.slot == slot) {
            return Found::Removing {
                address,
                server: *server,
                until: *until,
            };
        }
        match self.live_in(slot) {
            Some(i) => Found::Live {
                address: &self.live[i].0,
                server: self.live[i].1,
            },
            None => Found::Unknown,
        }
    }

    /// How `info` (a server of the table) is shown by the admin API: its
    /// name, and who manages it (`removing`, `admin` or `config`).
    pub(super) fn describe(&self, info: &ServerInfo) -> (Option<&str>, &'static str) {
        let managed = if self.draining.iter().any(|(_, s, _)| *s == info.server) {
            "removing"
        } else if self.from_admin.contains(&info.address) {
            "admin"
        } else if self.from_discovery.contains(&info.address) {
            "discovery"
        } else {
            "config"
        };
        (self.names.get(&info.address).map(String::as_str), managed)
    }

    /// How many are live, `Up` and draining.
    pub(super) fn counts(&self) -> Counts {
        let servers = self.segment.tables().servers;
        let up = self
            .live
            .iter()
            .filter(|(_, server)| {
                servers
                    .current(server.slot)
                    .is_some_and(|(s, state)| s == *server && state == ServerState::Up)
            })
            .count();
        Counts {
            up,
            live: self.live.len(),
            draining: self.draining.len(),
        }
    }

    /// Retires the removed backends whose requests have finished, or whose
    /// drain timeout has passed.
    pub(super) fn retire_drained(&mut self) {
        let servers = self.segment.tables().servers;
        let now = Instant::now();
        let names = &mut self.names;
        self.draining.retain(|(address, server, until)| {
            let (inflight, _) = servers.inflight(*server);
            if inflight > 0 && now < *until {
                return true;
            }
            servers.retire(*server);
            names.remove(address);
            if inflight > 0 {
                tracing::warn!(
                    backend = %address,
                    inflight,
                    "backend {address} removed after the drain timeout with {inflight} requests in flight"
                );
            } else {
                tracing::info!(backend = %address, "backend {address} drained and removed");
            }
            false
        });
    }
}
