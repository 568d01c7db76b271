//! SGLang's bootstrap rendezvous, both sides.
//!
//! A router sends the same body to a prefill and a decode engine at once,
//! with `bootstrap_host`/`bootstrap_port` (the prefill engine's bootstrap
//! server) and a random `bootstrap_room`. In SGLang the prefill request
//! waits in its bootstrap queue until the decode side has connected for
//! that room (`SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`, 300 s), then
//! runs its prefill and sends the KV; the decode side waits for it
//! (`SGLANG_DISAGGREGATION_WAITING_TIMEOUT`, 300 s) and then decodes; the
//! prefill's HTTP answer goes out once the transfer is done. The
//! simulator plays this with [`Rooms`] on the prefill engine, served on
//! its bootstrap port by [`serve`]:
//!
//! | route | body | answer |
//! | --- | --- | --- |
//! | `GET /health` | | 200 `OK` (SGLang's bootstrap server has it too) |
//! | `POST /sim/bootstrap/take` | `{"room"}` | the decode's long poll: it joins the room (which lets the prefill run), then waits for the KV: 200 `{"room", "num_tokens", "block_hashes"}` when it is ready; 410 if the prefill leg was aborted or failed; 409 if the room has a decode already; 504 after this engine's waiting timeout |
//! | `POST /sim/bootstrap/done` | `{"room", "pulled_tokens"}` | the transfer is over: the prefill answers its client and frees the KV; 200, or 410 if the prefill gave up meanwhile |
//! | `POST /sim/bootstrap/abandon` | `{"room"}` | the decode leg was cancelled: the prefill leg fails at once; 200 |
//!
//! A decode that drops its long poll (its client left, or its waiting
//! timeout) abandons the room too. On the prefill engine each leg holds a
//! [`PrefillSeat`]: whatever way the leg ends, the seat frees the held KV
//! and the room, and a leg that ends before the handoff (its client left,
//! a timeout) marks the room abandoned, which answers the waiting decode
//! 410 at once. The decode engine's side is [`pull`].

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::time::Instant;

use super::PdConfig;
use super::client::{self, SideChannelError};
use super::legs::Bootstrap;
use crate::engine::{Engine, KvHandoff};
use crate::prefix_cache::chained_hashes;

/// The decode's long poll.
pub const TAKE_PATH: &str = "/sim/bootstrap/take";

/// The decode's end of transfer.
pub const DONE_PATH: &str = "/sim/bootstrap/done";

/// The decode's cancellation.
pub const ABANDON_PATH: &str = "/sim/bootstrap/abandon";

/// Which leg of a room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The prefill leg.
    Prefill,
    /// The decode leg.
    Decode,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Side::Prefill => "prefill",
            Side::Decode => "decode",
        })
    }
}

/// Where a room stands.
#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// Waiting for one leg or both.
    Open { prefill: bool, decode: bool },
    /// The prefill is done; its KV is held for the decode.
    Ready { num_tokens: usize, block_hashes: Vec<u64> },
    /// The decode has its KV.
    Taken,
    /// A leg went away (or timed out).
    Abandoned(Side),
}

#[derive(Debug)]
struct Room {
    state: watch::Sender<State>,
}

impl Room {
    /// A room no leg has entered yet.
    fn open() -> Arc<Self> {
        Arc::new(Self {
            state: watch::Sender::new(State::Open {
                prefill: false,
                decode: false,
            }),
        })
    }
}

/// Why a rendezvous failed.
#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    /// Another leg of the same side is in the room.
    #[error("bootstrap_room {0} is already in use")]
    Duplicate(u64),
    /// The partner did not come, or its KV did not, in time.
    #[error("bootstrap_room {room}: {what} within {secs} s")]
    Timeout {
        /// The room.
        room: u64,
        /// What did not happen.
        what: &'static str,
        /// The timeout, in simulated seconds.
        secs: f64,
    },
    /// The partner leg was aborted or failed.
    #[error("bootstrap_room {room}: the {by} leg was aborted")]
    Abandoned {
        /// The room.
        room: u64,
        /// Whose leg.
        by: Side,
    },
    /// The prefill's bootstrap server did not answer.
    #[error("Decode bootstrap failed: {0}")]
    Unreachable(#[from] SideChannelError),
    /// The prefill's bootstrap server refused.
    #[error("bootstrap_room {room}: the bootstrap server answered {status}: {body}")]
    Refused {
        /// The room.
        room: u64,
        /// Its status.
        status: StatusCode,
        /// Its body.
        body: Value,
    },
    /// The prefill's prompt is not the decode's.
    #[error("bootstrap_room {room}: the prefill's prompt is not this request's ({why})")]
    Mismatch {
        /// The room.
        room: u64,
        /// What differs.
        why: String,
    },
}

/// The rooms of a prefill engine.
#[derive(Debug, Default)]
pub struct Rooms {
    rooms: Mutex<HashMap<u64, Arc<Room>>>,
}

impl Rooms {
    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Arc<Room>>> {
        self.rooms.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Rooms open now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no room is open.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A prefill leg enters room `id`.
    pub fn join_prefill(self: &Arc<Self>, id: u64) -> Result<PrefillSeat, RendezvousError> {
        let mut rooms = self.lock();
        let room = rooms.entry(id).or_insert_with(Room::open);
        let joined = room.state.send_if_modified(|state| match state {
            State::Open { prefill, .. } if !*prefill => {
                *prefill = true;
                true
            }
            _ => false,
        });
        if !joined {
            return Err(RendezvousError::Duplicate(id));
        }
        Ok(PrefillSeat {
            rooms: Arc::clone(self),
            id,
            room: Arc::clone(room),
            held: None,
        })
    }

    /// A decode leg enters room `id` (its long poll).
    fn join_decode(self: &Arc<Self>, id: u64) -> Result<DecodeSeat, StatusCode> {
        let mut rooms = self.lock();
        let room = rooms.entry(id).or_insert_with(Room::open);
        let mut refusal = StatusCode::OK;
        room.state.send_if_modified(|state| match state {
            State::Open { decode, .. } if !*decode => {
                *decode = true;
                true
            }
            State::Abandoned(_) => {
                refusal = StatusCode::GONE;
                false
            }
            _ => {
                refusal = StatusCode::CONFLICT;
                false
            }
        });
        if refusal != StatusCode::OK {
            return Err(refusal);
        }
        Ok(DecodeSeat {
            rooms: Arc::clone(self),
            id,
            room: Arc::clone(room),
            answered: false,
        })
    }

    /// Removes room `id` if it is still `room`.
    fn remove(&self, id: u64, room: &Arc<Room>) {
        let mut rooms = self.lock();
        if rooms.get(&id).is_some_and(|r| Arc::ptr_eq(r, room)) {
            rooms.remove(&id);
        }
    }

    fn get(&self, id: u64) -> Option<Arc<Room>> {
        self.lock().get(&id).cloned()
    }
}

/// A prefill leg in its room. However the leg ends, dropping the seat
/// frees its KV and the room; before the handoff it abandons the room.
#[derive(Debug)]
pub struct PrefillSeat {
    rooms: Arc<Rooms>,
    id: u64,
    room: Arc<Room>,
    /// The engine and pin key of the KV held for the decode.
    held: Option<(Engine, u64)>,
}

impl PrefillSeat {
    /// Waits until the decode leg has joined (SGLang's bootstrap queue).
    pub async fn wait_partner(&self, timeout: Duration, secs: f64) -> Result<(), RendezvousError> {
        let mut state = self.room.state.subscribe();
        let met = state.wait_for(|s| !matches!(s, State::Open { decode: false, .. }));
        match tokio::time::timeout(timeout, met).await {
            Err(_) => Err(RendezvousError::Timeout {
                room: self.id,
                what: "no decode leg joined",
                secs,
            }),
            Ok(Ok(s)) if matches!(*s, State::Abandoned(Side::Decode)) => Err(RendezvousError::Abandoned {
                room: self.id,
                by: Side::Decode,
            }),
            Ok(_) => Ok(()),
        }
    }

    /// The prefill ran and the engine holds its prompt under `key`: marks
    /// the room ready and waits until the decode has taken the KV (the
    /// pulled tokens).
    pub async fn hand_over(
        &mut self,
        engine: &Engine,
        key: u64,
        timeout: Duration,
        secs: f64,
    ) -> Result<(), RendezvousError> {
        let Some(held) = engine.pinned(key) else {
            return Err(RendezvousError::Abandoned {
                room: self.id,
                by: Side::Prefill,
            });
        };
        self.held = Some((engine.clone(), key));
        let mut state = self.room.state.subscribe();
        self.room.state.send_if_modified(|s| match s {
            State::Open { .. } => {
                *s = State::Ready {
                    num_tokens: held.num_tokens,
                    block_hashes: held.block_hashes,
                };
                true
            }
            _ => false,
        });
        let taken = state.wait_for(|s| matches!(s, State::Taken | State::Abandoned(_)));
        match tokio::time::timeout(timeout, taken).await {
            Err(_) => Err(RendezvousError::Timeout {
                room: self.id,
                what: "the decode did not take the KV",
                secs,
            }),
            Ok(Ok(s)) if *s == State::Taken => Ok(()),
            Ok(_) => Err(RendezvousError::Abandoned {
                room: self.id,
                by: Side::Decode,
            }),
        }
    }
}

impl Drop for PrefillSeat {
    fn drop(&mut self) {
        self.room.state.send_if_modified(|s| {
            let open = !matches!(s, State::Taken | State::Abandoned(_));
            if open {
                *s = State::Abandoned(Side::Prefill);
            }
            open
        });
        if let Some((engine, key)) = self.held.take() {
            engine.release_pin(key);
        }
        self.rooms.remove(self.id, &self.room);
    }
}

/// A decode leg's long poll in a room: dropped before it was answered
/// (the decode went away), it abandons the room.
#[derive(Debug)]
struct DecodeSeat {
    rooms: Arc<Rooms>,
    id: u64,
    room: Arc<Room>,
    answered: bool,
}

impl Drop for DecodeSeat {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        let mut alone = false;
        self.room.state.send_if_modified(|s| match s {
            State::Open { prefill: false, .. } => {
                alone = true;
                false
            }
            State::Taken | State::Abandoned(_) => false,
            _ => {
                *s = State::Abandoned(Side::Decode);
                true
            }
        });
        if alone {
            self.rooms.remove(self.id, &self.room);
        }
    }
}

/// Serves the bootstrap routes on `listener` until `stop` changes or its
/// sender is dropped; the decode's long poll waits at most `waiting`
/// (real time).
pub async fn serve(listener: TcpListener, rooms: Arc<Rooms>, waiting: Duration, mut stop: watch::Receiver<()>) {
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let _ = stream.set_nodelay(true);
                let rooms = Arc::clone(&rooms);
                let service = service_fn(move |request| route(Arc::clone(&rooms), waiting, request));
                tokio::spawn(async move {
                    let mut builder = http1::Builder::new();
                    builder.timer(TokioTimer::new());
                    let _ = builder.serve_connection(TokioIo::new(stream), service).await;
                });
            }
        }
    }
}

fn json_response(status: StatusCode, body: &Value) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    response
}

async fn route(
    rooms: Arc<Rooms>,
    waiting: Duration,
    request: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let path = request.uri().path().to_owned();
    if request.method() == Method::GET && path == "/health" {
        return Ok(Response::new(Full::new(Bytes::from_static(b"OK"))));
    }
    if request.method() != Method::POST || ![TAKE_PATH, DONE_PATH, ABANDON_PATH].contains(&path.as_str()) {
        return Ok(json_response(
            StatusCode::NOT_FOUND,
            &json!({"error": format!("Not found: {path}")}),
        ));
    }
    let body = match Limited::new(request.into_body(), 1 << 20).collect().await {
        Ok(body) => body.to_bytes(),
        Err(_) => {
            return Ok(json_response(
                StatusCode::BAD_REQUEST,
                &json!({"error": "unreadable body"}),
            ));
        }
    };
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let Some(id) = body["room"].as_u64() else {
        return Ok(json_response(
            StatusCode::BAD_REQUEST,
            &json!({"error": "`room` (an integer) is required"}),
        ));
    };
    let (status, answer) = match path.as_str() {
        TAKE_PATH => take(&rooms, id, waiting).await,
        DONE_PATH => done(&rooms, id),
        _ => abandon(&rooms, id),
    };
    Ok(json_response(status, &answer))
}

/// The decode's long poll (see the module docs).
async fn take(rooms: &Arc<Rooms>, id: u64, waiting: Duration) -> (StatusCode, Value) {
    let mut seat = match rooms.join_decode(id) {
        Ok(seat) => seat,
        Err(StatusCode::GONE) => {
            return (
                StatusCode::GONE,
                json!({"error": format!("bootstrap_room {id} was abandoned")}),
            );
        }
        Err(status) => {
            return (
                status,
                json!({"error": format!("bootstrap_room {id} already has a decode leg")}),
            );
        }
    };
    let mut state = seat.room.state.subscribe();
    let ready = state.wait_for(|s| !matches!(s, State::Open { .. }));
    let answer = match tokio::time::timeout(waiting, ready).await {
        Err(_) => (
            StatusCode::GATEWAY_TIMEOUT,
            json!({"error": format!("bootstrap_room {id}: no KV within the waiting timeout")}),
        ),
        Ok(Ok(s)) => match &*s {
            State::Ready {
                num_tokens,
                block_hashes,
            } => (
                StatusCode::OK,
                json!({"room": id, "num_tokens": num_tokens, "block_hashes": block_hashes}),
            ),
            State::Abandoned(by) => (
                StatusCode::GONE,
                json!({"error": format!("bootstrap_room {id}: the {by} leg was aborted")}),
            ),
            _ => (
                StatusCode::CONFLICT,
                json!({"error": format!("bootstrap_room {id} was taken")}),
            ),
        },
        Ok(Err(_)) => (
            StatusCode::GONE,
            json!({"error": format!("bootstrap_room {id} is gone")}),
        ),
    };
    seat.answered = answer.0 == StatusCode::OK;
    answer
}

/// The decode has the KV.
fn done(rooms: &Rooms, id: u64) -> (StatusCode, Value) {
    let Some(room) = rooms.get(id) else {
        return (
            StatusCode::GONE,
            json!({"error": format!("bootstrap_room {id} is gone")}),
        );
    };
    let taken = room.state.send_if_modified(|s| match s {
        State::Ready { .. } => {
            *s = State::Taken;
            true
        }
        _ => false,
    });
    if taken {
        (StatusCode::OK, json!({"room": id, "taken": true}))
    } else {
        (
            StatusCode::GONE,
            json!({"error": format!("bootstrap_room {id} holds no KV")}),
        )
    }
}

/// The decode leg was cancelled.
fn abandon(rooms: &Rooms, id: u64) -> (StatusCode, Value) {
    if let Some(room) = rooms.get(id) {
        room.state.send_if_modified(|s| {
            let open = !matches!(s, State::Taken | State::Abandoned(_));
            if open {
                *s = State::Abandoned(Side::Decode);
            }
            open
        });
    }
    (StatusCode::OK, json!({"room": id, "abandoned": true}))
}

/// Tells the prefill's bootstrap server, if dropped armed, that the decode
/// leg is gone (best effort, from a task of its own).
struct AbandonOnDrop {
    target: Option<Bootstrap>,
}

impl Drop for AbandonOnDrop {
    fn drop(&mut self) {
        let Some(boot) = self.target.take() else { return };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = client::post_json(&boot.host, boot.port, ABANDON_PATH, &json!({"room": boot.room})).await;
            });
        }
    }
}

/// A decode leg's rendezvous with its prefill at `boot` (see the module
/// docs): waits for the KV (at most the waiting timeout), pulls the
/// tokens its prefix cache lacks, and returns the handoff to submit with
/// and the tokens pulled. Its `waited` is the time until the KV was
/// ready (real time, in simulated seconds) plus the transfer time.
pub async fn pull(
    engine: &Engine,
    boot: &Bootstrap,
    root: u64,
    prompt: &[u32],
    config: &PdConfig,
) -> Result<(KvHandoff, usize), RendezvousError> {
    let arrived = Instant::now();
    let engine_config = engine.config();
    let local = engine.cached_prefix_tokens(root, prompt);
    let mut guard = AbandonOnDrop {
        target: Some(boot.clone()),
    };
    let room = json!({"room": boot.room});
    let waiting = engine_config.real(config.waiting_timeout());
    let reply = match tokio::time::timeout(waiting, client::post_json(&boot.host, boot.port, TAKE_PATH, &room)).await {
        Err(_) => None,
        Ok(reply) => Some(reply?),
    };
    let reply = match reply {
        Some(reply) if reply.status == StatusCode::OK => reply,
        Some(reply) if reply.status == StatusCode::GONE => {
            return Err(RendezvousError::Abandoned {
                room: boot.room,
                by: Side::Prefill,
            });
        }
        Some(reply) if reply.status != StatusCode::GATEWAY_TIMEOUT => {
            return Err(RendezvousError::Refused {
                room: boot.room,
                status: reply.status,
                body: reply.body,
            });
        }
        _ => {
            return Err(RendezvousError::Timeout {
                room: boot.room,
                what: "the prefill's KV did not arrive",
                secs: config.waiting_timeout_s,
            });
        }
    };
    let ready_after = arrived.elapsed().div_f64(engine_config.time_scale);
    let ours = chained_hashes(root, prompt.iter().copied(), engine_config.block_size);
    let theirs: Option<Vec<u64>> = reply.body["block_hashes"]
        .as_array()
        .and_then(|h| h.iter().map(Value::as_u64).collect());
    let num_tokens = reply.body["num_tokens"].as_u64();
    if num_tokens != Some(prompt.len() as u64) || theirs.as_deref() != Some(&ours[..]) {
        return Err(RendezvousError::Mismatch {
            room: boot.room,
            why: format!(
                "{} tokens there, {} here, or other blocks",
                num_tokens.unwrap_or(0),
                prompt.len()
            ),
        });
    }
    let pulled = prompt.len() - local;
    let transfer = config.transfer_time(pulled as u64);
    tokio::time::sleep(engine_config.real(transfer)).await;
    let done = json!({"room": boot.room, "pulled_tokens": pulled});
    let reply = client::post_json(&boot.host, boot.port, DONE_PATH, &done).await?;
    if reply.status != StatusCode::OK {
        return Err(RendezvousError::Abandoned {
            room: boot.room,
            by: Side::Prefill,
        });
    }
    guard.target = None;
    let handoff = KvHandoff {
        pulled_from: Some(local),
        waited: ready_after + transfer,
        ..KvHandoff::default()
    };
    Ok((handoff, pulled))
}
