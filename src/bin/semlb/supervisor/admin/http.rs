//! The admin API: an HTTP/1.1 listener of the supervisor, on its own
//! address (`[admin] listen` / `--admin-listen`), for operators.
//!
//! Every request must carry `Authorization: Bearer <token>` (`admin.token`
//! or `admin.token_file`), compared in constant time; without it, or with
//! another token, the answer is `401` with `WWW-Authenticate: Bearer` and an
//! OpenAI-style error body. Bodies are JSON both ways; bad input is a 4xx
//! with an error body saying what is wrong, never a 5xx.
//!
//! | request | what it does |
//! | --- | --- |
//! | `GET /admin/servers` | every server of the shm server table: slot, generation, address, name, state, in-flight requests and tokens, scraped load and its age |
//! | `POST /admin/servers` `{"url": "http://host:port", "name": "..."}` | registers a backend, `Up` at once (`201` with its slot; `409` if already registered) |
//! | `POST /admin/servers/{slot}/drain` | `Draining`: no new requests, those in flight finish; it stays registered |
//! | `POST /admin/servers/{slot}/undrain` | a drained server takes requests again |
//! | `DELETE /admin/servers/{slot}` | drains it and removes it once nothing is in flight, or after `drain_timeout_secs` (`200` when gone at once, else `202`) |
//! | `GET /admin/tables` | fill of the prefix table and the response cache's index |
//! | `POST /admin/flush/prefixes` | empties the prefix table (`{"removed": n}`) |
//! | `POST /admin/flush/responses` | empties the response cache (`{"removed": n}`) |
//! | `GET /admin/models` | the model pools in force, each as its `[[model]]` table in JSON with `"source"`: `config` (the configuration file's) or `admin` (added or replaced here) |
//! | `GET /admin/models/{name}` | one pool |
//! | `POST /admin/models` `{"name": ..., "backends": [...], ...}` | adds a pool (`201`; `409` if a pool answers to its name or an alias) |
//! | `PUT /admin/models/{name}` `{...}` | adds or replaces the pool `name` whole (`200` replaced, `201` added) |
//! | `DELETE /admin/models/{name}` | removes a pool (`404` unknown; `409` while adapters name it as their base) |
//!
//! A pool's body is a `[[model]]` table in JSON, with the same keys and
//! checks ([`semlb::config::models`]); its backends are `[[backend]]`
//! names or URLs (a URL the file does not list becomes a backend while a
//! pool names it); `tokenizer` and `chat_template` are absolute paths on
//! the gateway host and are loaded before the change is taken. A name with
//! `/` (`meta-llama/Llama-3.1-8B`) goes in the path as it is, or
//! percent-encoded. Pool changes are kept in `admin.models_file`
//! ([`semlb::config::ModelChanges`]; without it they answer `409`), so they
//! outlive reloads, restarts of a dispatcher and of the service. A change
//! is a reload: the supervisor applies it, then every dispatcher; the
//! answer comes once every dispatcher routes by it (its `dispatchers`
//! field says how many do), so the next request already sees it, or, if
//! one has not within [`APPLY_PATIENCE`], `202` with `"applied": false`.
//!
//! This module only speaks HTTP: each request becomes a [`Request`] sent
//! over a channel to the supervisor's loop ([`crate::supervisor`]; its
//! `admin` module carries the commands out), which owns the backend
//! bookkeeping, applies it to the shm segment and answers with a [`Reply`]. Everything goes through shm, so every dispatcher sees
//! a change at once. Changes are not written to the configuration file: a
//! reload (SIGHUP) applies the file's backend list again, which drains the
//! servers added here and not listed there.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Method, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use semlb::config::{BackendConfig, ModelConfig};
use semlb::tenancy::auth::constant_time_eq;
use serde_json::{Value, json};
use shm_layout::{ProcessState, Role, Segment};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

/// Largest request body accepted.
const MAX_BODY_BYTES: usize = 64 * 1024;

/// How long a pool change waits for every dispatcher to route by it.
pub const APPLY_PATIENCE: Duration = Duration::from_secs(30);

/// What an admin request asks the supervisor to do.
#[derive(Debug)]
pub enum Request {
    /// List the server table.
    ListServers,
    /// Register a backend (URL and name not yet validated).
    AddServer(BackendConfig),
    /// Set the server in this slot `Draining`.
    Drain(u16),
    /// Set the drained server in this slot `Up` again.
    Undrain(u16),
    /// Drain the server in this slot and remove it once drained.
    Remove(u16),
    /// The tables' fill.
    Tables,
    /// Empty the prefix table.
    FlushPrefixes,
    /// Empty the response cache.
    FlushResponses,
    /// About the model pools.
    Models(ModelRequest),
}

/// What an admin request asks about the model pools.
#[derive(Debug)]
pub enum ModelRequest {
    /// List them.
    List,
    /// One, by name.
    Get(String),
    /// Add a pool (`replace` false: refused if its name is taken) or add
    /// or replace it (`replace` true).
    Set {
        /// The pool (not yet validated).
        model: Box<ModelConfig>,
        /// Whether a pool of its name is replaced.
        replace: bool,
    },
    /// Remove the pool of this name.
    Remove(String),
}

/// The supervisor's answer: a status and a JSON body.
#[derive(Debug)]
pub struct Reply {
    /// HTTP status.
    pub status: StatusCode,
    /// JSON body.
    pub body: Value,
    /// The configuration revision the change made: the answer waits until
    /// every dispatcher runs it ([`APPLY_PATIENCE`]).
    pub revision: Option<u64>,
}

impl Reply {
    /// A success with `body`.
    pub fn new(status: StatusCode, body: Value) -> Self {
        Self {
            status,
            body,
            revision: None,
        }
    }

    /// A change that made configuration `revision`: answered once every
    /// dispatcher runs it.
    pub fn applied(status: StatusCode, body: Value, revision: u64) -> Self {
        Self {
            revision: Some(revision),
            ..Self::new(status, body)
        }
    }

    /// An OpenAI-style error: `{"error": {"message", "type", "param", "code"}}`.
    pub fn error(status: StatusCode, message: impl Into<String>, code: &str) -> Self {
        let kind = if status.is_server_error() {
            "server_error"
        } else {
            "invalid_request_error"
        };
        Self::new(
            status,
            json!({"error": {"message": message.into(), "type": kind, "param": null, "code": code}}),
        )
    }

    /// `404`: no server in `slot`.
    pub fn unknown_slot(slot: u16) -> Self {
        Self::error(
            StatusCode::NOT_FOUND,
            format!("no server is registered in slot {slot} (GET /admin/servers lists them)"),
            "unknown_slot",
        )
    }
}

/// One admin request on its way to the supervisor, with where to answer.
pub type Command = (Request, oneshot::Sender<Reply>);

/// Admin connections served at once: the admin API shares the
/// supervisor's runtime with reaping children and the watchdog, so a flood
/// of connections is closed at accept beyond this.
pub const MAX_ADMIN_CONNECTIONS: usize = 16;

/// Serves the admin API on `listener` until the task is dropped; each
/// request is checked against `token` and handed to `commands`; at most
/// [`MAX_ADMIN_CONNECTIONS`] connections at once. `segment` tells when
/// the dispatchers run a change.
pub async fn serve(listener: TcpListener, token: String, commands: mpsc::Sender<Command>, segment: Arc<Segment>) {
    let token: Arc<[u8]> = Arc::from(token.into_bytes());
    crate::supervisor::side_listener::serve(listener, "admin API", MAX_ADMIN_CONNECTIONS, move |request| {
        let (token, commands, segment) = (token.clone(), commands.clone(), segment.clone());
        async move {
            let mut reply = handle(request, &token, &commands).await;
            if let Some(revision) = reply.revision {
                await_dispatchers(&segment, revision, &mut reply).await;
            }
            respond(reply)
        }
    })
    .await;
}

/// Waits until every dispatcher (starting or running) runs configuration
/// `revision` or later, for up to [`APPLY_PATIENCE`], and says in `reply`
/// how many do (`202` with `"applied": false` when not all).
async fn await_dispatchers(segment: &Segment, revision: u64, reply: &mut Reply) {
    let registry = segment.tables().registry;
    let count = || {
        let dispatchers = registry.processes().filter(|p| {
            p.role == Some(Role::Dispatcher) && matches!(p.state, ProcessState::Starting | ProcessState::Running)
        });
        dispatchers.fold((0, 0), |(applied, all), p| {
            (applied + usize::from(p.revision >= revision), all + 1)
        })
    };
    let deadline = tokio::time::Instant::now() + APPLY_PATIENCE;
    // Other processes publish in shared memory: nothing to wait on but
    // the table itself, looked at every few milliseconds.
    let (mut applied, mut all) = count();
    while applied < all && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
        (applied, all) = count();
    }
    if let Some(body) = reply.body.as_object_mut() {
        body.insert("revision".into(), json!(revision));
        body.insert("dispatchers".into(), json!({"applied": applied, "running": all}));
        body.insert("applied".into(), json!(applied == all));
        if applied < all {
            reply.status = StatusCode::ACCEPTED;
            body.insert(
                "message".into(),
                json!(format!(
                    "the change is kept and the supervisor applied it, but {} of {all} dispatchers do not route by it after {} s; see the gateway's log",
                    all - applied,
                    APPLY_PATIENCE.as_secs()
                )),
            );
        }
    }
}

/// Whether the request carries `Authorization: Bearer <token>`.
fn authorized<B>(request: &http::Request<B>, token: &[u8]) -> bool {
    let Some(value) = request.headers().get(header::AUTHORIZATION) else {
        return false;
    };
    let value = value.as_bytes();
    let Some(space) = value.iter().position(|b| *b == b' ') else {
        return false;
    };
    let (scheme, rest) = value.split_at(space);
    scheme.eq_ignore_ascii_case(b"bearer") && constant_time_eq(rest.trim_ascii(), token)
}

/// The route of a request, or the error reply for it.
fn route(method: &Method, path: &str) -> Result<RouteKind, Reply> {
    let segments: Vec<&str> = path.trim_end_matches('/').split('/').skip(1).collect();
    let allow = |allowed: &str| {
        Reply::error(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("{method} is not allowed on {path}; use {allowed}"),
            "method_not_allowed",
        )
    };
    let slot = |text: &str| {
        text.parse::<u16>().map_err(|_| {
            Reply::error(
                StatusCode::BAD_REQUEST,
                format!("{text:?} is not a server slot (a number from GET /admin/servers)"),
                "invalid_slot",
            )
        })
    };
    match segments.as_slice() {
        ["admin", "servers"] => match *method {
            Method::GET => Ok(RouteKind::List),
            Method::POST => Ok(RouteKind::Add),
            _ => Err(allow("GET or POST")),
        },
        ["admin", "servers", s] => match *method {
            Method::DELETE => Ok(RouteKind::Slot(Request::Remove(slot(s)?))),
            _ => Err(allow("DELETE")),
        },
        ["admin", "servers", s, action @ ("drain" | "undrain")] => match *method {
            Method::POST => {
                let slot = slot(s)?;
                Ok(RouteKind::Slot(if *action == "drain" {
                    Request::Drain(slot)
                } else {
                    Request::Undrain(slot)
                }))
            }
            _ => Err(allow("POST")),
        },
        ["admin", "tables"] => match *method {
            Method::GET => Ok(RouteKind::Slot(Request::Tables)),
            _ => Err(allow("GET")),
        },
        ["admin", "models"] => match *method {
            Method::GET => Ok(RouteKind::Slot(Request::Models(ModelRequest::List))),
            Method::POST => Ok(RouteKind::AddModel),
            _ => Err(allow("GET or POST")),
        },
        ["admin", "models", name @ ..] => {
            let name = model_name(&name.join("/"))?;
            match *method {
                Method::GET => Ok(RouteKind::Slot(Request::Models(ModelRequest::Get(name)))),
                Method::PUT => Ok(RouteKind::PutModel(name)),
                Method::DELETE => Ok(RouteKind::Slot(Request::Models(ModelRequest::Remove(name)))),
                _ => Err(allow("GET, PUT or DELETE")),
            }
        }
        ["admin", "flush", what @ ("prefixes" | "responses")] => match *method {
            Method::POST => Ok(RouteKind::Slot(if *what == "prefixes" {
                Request::FlushPrefixes
            } else {
                Request::FlushResponses
            })),
            _ => Err(allow("POST")),
        },
        _ => Err(Reply::error(
            StatusCode::NOT_FOUND,
            format!(
                "no admin route {method} {path}; see /admin/servers, /admin/servers/{{slot}}[/drain|/undrain], /admin/models[/{{name}}], /admin/tables, /admin/flush/prefixes, /admin/flush/responses"
            ),
            "not_found",
        )),
    }
}

/// A model's name as the path gives it (percent-decoded).
fn model_name(text: &str) -> Result<String, Reply> {
    let decoded = percent_encoding::percent_decode_str(text).decode_utf8().map_err(|_| {
        Reply::error(
            StatusCode::BAD_REQUEST,
            "the model name in the path is not UTF-8 once percent-decoded",
            "invalid_model_name",
        )
    })?;
    if decoded.is_empty() {
        return Err(Reply::error(
            StatusCode::BAD_REQUEST,
            "name the model: /admin/models/{name}",
            "invalid_model_name",
        ));
    }
    Ok(decoded.into_owned())
}

/// What a route needs: a body to parse, or nothing more.
enum RouteKind {
    /// `GET /admin/servers`.
    List,
    /// `POST /admin/servers`: parse the body.
    Add,
    /// `POST /admin/models`: parse the body.
    AddModel,
    /// `PUT /admin/models/{name}`: parse the body.
    PutModel(String),
    /// A request that needs no body.
    Slot(Request),
}

/// The request's body as JSON, at most [`MAX_BODY_BYTES`]; `shape` says
/// what it should look like in the error for one that is not JSON.
async fn json_body(request: http::Request<Incoming>, shape: &str) -> Result<Value, Reply> {
    let body = match Limited::new(request.into_body(), MAX_BODY_BYTES).collect().await {
        Ok(body) => body.to_bytes(),
        Err(e) => {
            let too_large = e.downcast_ref::<http_body_util::LengthLimitError>().is_some();
            return Err(if too_large {
                Reply::error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("the body is larger than {MAX_BODY_BYTES} bytes"),
                    "body_too_large",
                )
            } else {
                Reply::error(
                    StatusCode::BAD_REQUEST,
                    format!("cannot read the body: {e}"),
                    "bad_body",
                )
            });
        }
    };
    serde_json::from_slice(&body).map_err(|e| {
        Reply::error(
            StatusCode::BAD_REQUEST,
            format!("the body must be JSON {shape}: {e}"),
            "invalid_json",
        )
    })
}

/// A model pool from a JSON body (`named`: the name the path gives, which
/// the body may leave out or must repeat).
fn model_of(body: Value, named: Option<&str>) -> Result<ModelConfig, Reply> {
    ModelConfig::from_admin_body(body, named)
        .map_err(|m| Reply::error(StatusCode::BAD_REQUEST, m.to_string(), "invalid_model"))
}

/// Answers one request.
async fn handle(request: http::Request<Incoming>, token: &[u8], commands: &mpsc::Sender<Command>) -> Reply {
    if !authorized(&request, token) {
        return Reply::error(
            StatusCode::UNAUTHORIZED,
            "the admin API needs Authorization: Bearer <token> with the configured admin token",
            "invalid_api_key",
        );
    }
    let kind = match route(request.method(), request.uri().path()) {
        Ok(kind) => kind,
        Err(reply) => return reply,
    };
    let command = match kind {
        RouteKind::List => Request::ListServers,
        RouteKind::Slot(command) => command,
        RouteKind::Add => {
            let shape = r#"{"url": "http://host:port", "name": "..."} (name optional)"#;
            let parsed = json_body(request, shape).await.and_then(|body| {
                BackendConfig::from_admin_body(body).map_err(|e| {
                    Reply::error(
                        StatusCode::BAD_REQUEST,
                        format!("the body must be JSON {shape}: {e}"),
                        "invalid_json",
                    )
                })
            });
            match parsed {
                Ok(backend) => Request::AddServer(backend),
                Err(reply) => return reply,
            }
        }
        RouteKind::AddModel | RouteKind::PutModel(_) => {
            let named = match &kind {
                RouteKind::PutModel(name) => Some(name.clone()),
                _ => None,
            };
            let shape = r#"{"name": "...", "backends": ["..."], ...} (a [[model]] table)"#;
            let model = json_body(request, shape)
                .await
                .and_then(|body| model_of(body, named.as_deref()));
            match model {
                Ok(model) => Request::Models(ModelRequest::Set {
                    model: Box::new(model),
                    replace: named.is_some(),
                }),
                Err(reply) => return reply,
            }
        }
    };
    let (reply_tx, reply_rx) = oneshot::channel();
    if commands.send((command, reply_tx)).await.is_err() {
        return Reply::error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the supervisor is stopping",
            "stopping",
        );
    }
    reply_rx.await.unwrap_or_else(|_| {
        Reply::error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the supervisor is stopping",
            "stopping",
        )
    })
}

/// The HTTP response of a reply (`WWW-Authenticate` on a 401).
fn respond(reply: Reply) -> http::Response<Full<Bytes>> {
    let mut body = reply.body.to_string();
    body.push('\n');
    let mut response = http::Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = reply.status;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    if reply.status == StatusCode::UNAUTHORIZED {
        headers.insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"semlb-admin\""),
        );
    }
    response
}

/// How a server of the table is shown by `GET /admin/servers`
/// (`horizon_age_s`: how old its horizon is, the shm store's: `null` when
/// it has none; `admission_limit`: the requests its engine is estimated to
/// run at once, `null` until learned: [`crate::routing::capacity`]; `engine_slots`:
/// the requests its engine says it runs at once, `null` unless it said;
/// `engine_context`: the tokens its engine takes per request and whether
/// the requested output counts, `null` unless it said:
/// [`crate::health::engine_info`]; `kv_events`: how far the confirmed
/// prefix table follows its engine's KV cache events, `complete` or
/// `partial`, `null` when they are not followed: [`crate::kv_events`];
/// `role`: `both`, `prefill` or `decode`, and `bootstrap_port`, the port
/// of a prefill engine's bootstrap server when known (SGLang)).
pub fn server_json(info: &shm_layout::ServerInfo, now_ms: u64, name: Option<&str>, managed: &str) -> Value {
    let load = info.load;
    let scraped = load.scraped_at_ms != 0;
    json!({
        "slot": info.server.slot,
        "generation": info.server.generation,
        "id": info.id,
        "address": info.address,
        "name": name,
        "state": info.state.name(),
        "managed": managed,
        "registered_ms": info.registered_ms,
        "horizon_age_s": info.horizon_s.map(|h| (now_ms / 1000).saturating_sub(u64::from(h))),
        "admission_limit": info.admission_limit,
        "engine_slots": info.engine_slots,
        "engine_context": info.engine_context.map(|c| json!({"tokens": c.tokens, "counts_output": c.counts_output})),
        "kv_events": info.kv_events.map(|s| s.name()),
        "role": info.disaggregation.role.name(),
        "bootstrap_port": info.disaggregation.bootstrap_port,
        "inflight_requests": info.inflight_requests,
        "inflight_tokens": info.inflight_tokens,
        "load": {
            "waiting": scraped.then_some(load.waiting),
            "running": scraped.then_some(load.running),
            "kv_usage": load.kv_usage().filter(|_| scraped),
            "age_ms": scraped.then(|| now_ms.saturating_sub(load.scraped_at_ms)),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_whole() {
        assert!(constant_time_eq(b"0123456789abcdef", b"0123456789abcdef"));
        assert!(!constant_time_eq(b"0123456789abcdef", b"0123456789abcdeF"));
        assert!(!constant_time_eq(b"0123456789abcdef", b"0123456789abcde"));
        assert!(!constant_time_eq(b"", b"x"));
    }

    #[test]
    fn the_bearer_scheme_is_required() {
        let with = |value: &str| {
            http::Request::builder()
                .header(header::AUTHORIZATION, value)
                .body(())
                .unwrap()
        };
        let token = b"0123456789abcdef";
        assert!(authorized(&with("Bearer 0123456789abcdef"), token));
        assert!(authorized(&with("bearer 0123456789abcdef"), token));
        assert!(!authorized(&with("Basic 0123456789abcdef"), token));
        assert!(!authorized(&with("Bearer 0123456789abcdeX"), token));
        assert!(!authorized(&with("0123456789abcdef"), token));
        assert!(!authorized(&http::Request::new(()), token));
    }

    #[test]
    fn routes() {
        let ok = |m: Method, p: &str| route(&m, p).is_ok();
        let status = |m: Method, p: &str| route(&m, p).err().map(|r| r.status);
        assert!(ok(Method::GET, "/admin/servers"));
        assert!(ok(Method::GET, "/admin/servers/"));
        assert!(ok(Method::POST, "/admin/servers"));
        assert!(ok(Method::POST, "/admin/servers/3/drain"));
        assert!(ok(Method::POST, "/admin/servers/3/undrain"));
        assert!(ok(Method::DELETE, "/admin/servers/3"));
        assert!(ok(Method::POST, "/admin/flush/prefixes"));
        assert!(ok(Method::POST, "/admin/flush/responses"));
        assert!(ok(Method::GET, "/admin/tables"));
        assert_eq!(
            status(Method::DELETE, "/admin/servers/x"),
            Some(StatusCode::BAD_REQUEST)
        );
        assert_eq!(
            status(Method::DELETE, "/admin/servers/70000"),
            Some(StatusCode::BAD_REQUEST)
        );
        assert_eq!(
            status(Method::GET, "/admin/flush/prefixes"),
            Some(StatusCode::METHOD_NOT_ALLOWED)
        );
        assert_eq!(status(Method::GET, "/admin/nope"), Some(StatusCode::NOT_FOUND));
        assert_eq!(
            status(Method::POST, "/admin/flush/everything"),
            Some(StatusCode::NOT_FOUND)
        );
    }
}
