//! The supervisor's side of the admin API: each request that the HTTP
//! side ([`crate::supervisor::admin::http`], which only parses and answers) hands over as a
//! command is carried out here ([`answer`]) on the [`Backends`]
//! bookkeeping and the segment, exactly as a reload does (registration,
//! `Draining`, retirement once drained or after `drain_timeout_secs`).
//!
//! Servers added through the API are not written to the file: the next
//! reload applies the file's backend list, so it drains and removes an
//! added server the file does not list (and a server the file lists is
//! from then on the file's). A drain (without removal) is kept by a reload
//! that still lists the server.

pub(crate) mod http;
mod models;

use std::time::Instant;

use ::http::StatusCode as S;
use semlb::config::StoreKind;
use semlb::config::{BackendConfig, ServeConfig};
use serde_json::json;
use shm_layout::{Segment, ServerState};

use self::http::{Reply, Request, server_json};
use crate::supervisor::backends::{AddError, Backends, Found, address_of};

/// Carries out one admin API request on the backends and answers it (not
/// the [scans](is_scan)).
pub(super) fn answer(request: Request, segment: &Segment, backends: &mut Backends<'_>, config: &ServeConfig) -> Reply {
    use Request as R;
    match request {
        R::ListServers => list(segment, backends),
        R::AddServer(backend) => add(backends, &backend),
        R::Drain(slot) => drain(segment, backends, slot, true),
        R::Undrain(slot) => drain(segment, backends, slot, false),
        R::Remove(slot) => remove(segment, backends, config, slot),
        R::Tables | R::FlushPrefixes | R::FlushResponses => scan(request, segment, config.store.kind),
        R::Models(_) => Reply::error(
            S::INTERNAL_SERVER_ERROR,
            "a model request is not a backend request",
            "internal",
        ),
    }
}

/// Whether `request` goes over whole tables (counting or clearing them):
/// those run on a blocking thread ([`scan`]), not on the supervisor's loop,
/// which also reaps children and pings the watchdog.
pub(super) fn is_scan(request: &Request) -> bool {
    matches!(
        request,
        Request::Tables | Request::FlushPrefixes | Request::FlushResponses
    )
}

/// Carries out a table scan ([`is_scan`]) and answers it.
pub(super) fn scan(request: Request, segment: &Segment, store: StoreKind) -> Reply {
    match request {
        Request::Tables => tables(segment, store),
        Request::FlushPrefixes => flush(segment, store, true),
        Request::FlushResponses => flush(segment, store, false),
        _ => Reply::error(S::INTERNAL_SERVER_ERROR, "not a table scan", "internal"),
    }
}

/// `GET /admin/servers`.
fn list(segment: &Segment, backends: &Backends<'_>) -> Reply {
    let now_ms = segment.clock().now_ms();
    let servers: Vec<_> = segment
        .tables()
        .servers
        .servers()
        .map(|info| {
            let (name, managed) = backends.describe(&info);
            server_json(&info, now_ms, name, managed)
        })
        .collect();
    Reply::new(S::OK, json!({ "servers": servers }))
}

/// `POST /admin/servers`: validated like a `[[backend]]`, registered
/// like a reload registers one.
fn add(backends: &mut Backends<'_>, backend: &BackendConfig) -> Reply {
    let address = match address_of(backend) {
        Ok(address) => address,
        Err(reason) => {
            return Reply::error(
                S::BAD_REQUEST,
                format!("url {:?}: {reason}", backend.url),
                "invalid_url",
            );
        }
    };
    if let Err(reason) = backend.check_name() {
        let name = backend.name.as_deref().unwrap_or_default();
        return Reply::error(S::BAD_REQUEST, format!("name {name:?}: {reason}"), "invalid_name");
    }
    if let Err(reason) = backend.check_weight() {
        return Reply::error(
            S::BAD_REQUEST,
            format!("weight {}: {reason}", backend.weight),
            "invalid_weight",
        );
    }
    if let Err(reason) = backend.check_events_on_own_host() {
        return Reply::error(S::BAD_REQUEST, format!("kv_events: {reason}"), "invalid_kv_events");
    }
    let server = match backends.add(&address, backend) {
        Ok(server) => server,
        Err(AddError::AlreadyRegistered { slot }) => {
            return Reply::error(
                S::CONFLICT,
                format!("{address} is already registered, in slot {slot}"),
                "already_registered",
            );
        }
        Err(AddError::NameTaken { name, other }) => {
            return Reply::error(
                S::CONFLICT,
                format!("the name {name:?} is taken by {other}; names must be unique"),
                "name_taken",
            );
        }
        Err(AddError::Table(e)) => {
            return Reply::error(S::CONFLICT, format!("cannot add {address}: {e:#}"), "table_full");
        }
    };
    let name = backend.display_name();
    tracing::info!(backend = %address, slot = server.slot, "admin: backend {address} ({name}) added in slot {}", server.slot);
    Reply::new(
        S::CREATED,
        json!({
            "slot": server.slot,
            "generation": server.generation,
            "address": address,
            "name": name,
            "state": "up",
        }),
    )
}

/// `POST /admin/servers/{slot}/drain` (`drain`) and `.../undrain`.
fn drain(segment: &Segment, backends: &Backends<'_>, slot: u16, drain: bool) -> Reply {
    let servers = segment.tables().servers;
    let (address, server) = match backends.find(slot) {
        Found::Removing { address, server, .. } => {
            return if drain {
                let (inflight, _) = servers.inflight(server);
                Reply::new(
                    S::OK,
                    json!({"slot": slot, "address": address, "state": "draining", "removing": true, "inflight_requests": inflight}),
                )
            } else {
                Reply::error(
                    S::CONFLICT,
                    format!("{address} is being removed; add it again with POST /admin/servers"),
                    "removing",
                )
            };
        }
        Found::Live { address, server } => (address, server),
        Found::Unknown => return Reply::unknown_slot(slot),
    };
    let state = if drain {
        servers.set_state(server, ServerState::Draining);
        tracing::info!(backend = %address, "admin: backend {address} draining");
        ServerState::Draining
    } else {
        // Only a drained server is set Up; a down one stays to the
        // health checks.
        if servers.transition(server, ServerState::Draining, ServerState::Up) {
            tracing::info!(backend = %address, "admin: backend {address} takes requests again");
        }
        servers.current(slot).map_or(ServerState::Up, |(_, state)| state)
    };
    let (inflight, _) = servers.inflight(server);
    Reply::new(
        S::OK,
        json!({"slot": slot, "address": address, "state": state.name(), "removing": false, "inflight_requests": inflight}),
    )
}

/// `DELETE /admin/servers/{slot}`: drain, then retire once drained.
fn remove(segment: &Segment, backends: &mut Backends<'_>, config: &ServeConfig, slot: u16) -> Reply {
    if let Some(address) = backends.remove(slot, Instant::now() + config.drain_timeout()) {
        tracing::info!(backend = %address, "admin: backend {address} removed; draining it");
        backends.retire_drained();
        if !matches!(backends.find(slot), Found::Removing { .. }) {
            return Reply::new(S::OK, json!({"slot": slot, "address": address, "removed": true}));
        }
    }
    let Found::Removing { address, server, until } = backends.find(slot) else {
        return Reply::unknown_slot(slot);
    };
    let (inflight, _) = segment.tables().servers.inflight(server);
    Reply::new(
        S::ACCEPTED,
        json!({
            "slot": slot,
            "address": address,
            "removed": false,
            "state": "draining",
            "inflight_requests": inflight,
            "removed_within_ms": until.saturating_duration_since(Instant::now()).as_millis() as u64,
        }),
    )
}

/// `GET /admin/tables`.
fn tables(segment: &Segment, store: StoreKind) -> Reply {
    let tables = segment.tables();
    let stats = tables.responses.stats();
    Reply::new(
        S::OK,
        json!({
            "store": store.to_string(),
            "prefix": {"entries": tables.prefix.occupancy(), "capacity": tables.prefix.capacity()},
            "responses": {
                "entries": tables.responses.index_occupancy(),
                "capacity": tables.responses.index_capacity(),
                "log_bytes": stats.capacity,
                "records_written": stats.records,
            },
        }),
    )
}

/// `POST /admin/flush/prefixes` (`prefixes`) and `.../responses`.
fn flush(segment: &Segment, store: StoreKind, prefixes: bool) -> Reply {
    let what = if prefixes { "prefix table" } else { "response cache" };
    if store == StoreKind::Redis {
        return Reply::error(
            S::CONFLICT,
            format!("the {what} is in Redis (store.kind = \"redis\"), not in this host's segment; flush it in Redis"),
            "redis_store",
        );
    }
    let tables = segment.tables();
    let removed = if prefixes {
        tables.prefix.clear()
    } else {
        tables.responses.erase()
    };
    tracing::info!(removed, "admin: {what} flushed ({removed} entries removed)");
    Reply::new(
        S::OK,
        json!({ "flushed": if prefixes { "prefixes" } else { "responses" }, "removed": removed }),
    )
}
