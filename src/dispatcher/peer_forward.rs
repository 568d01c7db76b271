//! Peer gateways on the dispatcher's side ([`crate::peers`]): the load
//! summary it serves them, its polls of theirs, and a request forwarded to
//! one with its answer relayed back.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{HeaderMap, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use tokio::time::Sleep;

use super::Dispatcher;
use super::http::{Body, BoxError, client_response_headers, error_response, json_response, set_header};
use super::relay::RelayTimer;
use crate::config::{ConfigError, PeeringConfig, ServeConfig};
use crate::metrics::PeerEvent;
use crate::peers::book::{Forward, Peer, PeerBook, TlsClient};
use crate::peers::summary::{LoadSummary, warm_s};
use crate::peers::{HOP_HEADER, LOAD_PATH, PEER_HEADER, TENANT_HEADER, TOKEN_HEADER};
use crate::routing::{Candidate, live_candidates};

/// The most bytes of a peer's load summary read.
const MAX_SUMMARY_BYTES: usize = 64 << 10;

/// What a request forwarded to a peer carries: the client's request as it
/// came (the peer is a gateway, and applies its own rules to it).
#[derive(Debug)]
pub(super) struct PeerCopy {
    /// The client's end-to-end headers, its API keys included.
    pub headers: HeaderMap,
    /// The client's body.
    pub body: Bytes,
    /// The model it asks for (a peer must serve it).
    pub model: String,
    /// The tenant this gateway authenticated it as (`None`: no `[auth]`;
    /// the client's headers then go as they came, its keys included).
    pub tenant: Option<std::sync::Arc<str>>,
}

/// What a dispatcher runs of `[peering]` and `[[peer]]`: built at start,
/// replaced whole when a reload changes them or their token files
/// ([`Dispatcher::set_peering`]).
#[derive(Debug, Default)]
pub struct Peering {
    /// `[peering]`.
    pub config: PeeringConfig,
    /// The peers and what this dispatcher knows of them (`None`: no peers).
    pub book: Option<Arc<PeerBook>>,
    /// The token peers present to read this gateway's load (`None`: its
    /// load is not served).
    token: Option<String>,
}

impl Peering {
    /// What `config` describes, its token files read.
    pub fn of(config: &ServeConfig) -> Result<Self, ConfigError> {
        let token = config.peering.read_token()?;
        let mut peers = Vec::with_capacity(config.peers.len());
        let connect_timeout = Duration::from_millis(config.limits.connect_timeout_ms);
        for (i, p) in config.peers.iter().enumerate() {
            let peer_token = p.read_token()?;
            let tls = p
                .tls()
                .map(|settings| TlsClient::new(settings, connect_timeout))
                .transpose()
                .map_err(|e| ConfigError::invalid("peer.url", format!("{:?}", p.url), e.to_string()))?;
            let peer = Peer::new(i, p, peer_token, tls)
                .map_err(|reason| ConfigError::invalid("peer.url", format!("{:?}", p.url), reason))?;
            peers.push(peer);
        }
        let book = (!peers.is_empty()).then(|| Arc::new(PeerBook::new(&config.peering, peers, config.dispatchers)));
        Ok(Self {
            config: config.peering.clone(),
            book,
            token,
        })
    }

    /// The peers configured, with their tokens.
    fn peers(&self) -> Vec<Peer> {
        self.book.as_ref().map_or_else(Vec::new, |b| b.peers())
    }

    /// Whether `other` has the same settings, peers and tokens (then a
    /// reload keeps this one, with what its book knows).
    pub fn same_as(&self, other: &Self) -> bool {
        (&self.config, &self.token) == (&other.config, &other.token) && self.peers() == other.peers()
    }

    /// Peers configured.
    pub fn peer_count(&self) -> usize {
        self.peers().len()
    }
}

/// Starts one task per peer of `book` that polls its load every
/// `peering.poll_ms`, until `book` is no longer the dispatcher's.
pub(super) fn start_polls(dispatcher: &Arc<Dispatcher>, peering: &Peering) {
    let Some(book) = &peering.book else { return };
    let every = Duration::from_millis(peering.config.poll_ms);
    let timeout = Duration::from_millis(peering.config.max_age_ms);
    for peer in book.peers() {
        tokio::spawn(poll(dispatcher.clone(), book.clone(), peer, every, timeout));
    }
}

async fn poll(dispatcher: Arc<Dispatcher>, book: Arc<PeerBook>, peer: Peer, every: Duration, timeout: Duration) {
    let Ok(uri) = format!("{}{LOAD_PATH}", peer.address).parse::<Uri>() else {
        return;
    };
    let mut warned = false;
    loop {
        let start = Instant::now();
        let next = tokio::time::Instant::now() + every;
        let answer = tokio::time::timeout(timeout, fetch_summary(&dispatcher, &peer, uri.clone())).await;
        if !dispatcher.peers().is_some_and(|current| Arc::ptr_eq(&current, &book)) {
            return;
        }
        match answer {
            Ok(Ok(summary)) if summary.region == peer.region => {
                warned = false;
                book.summary(peer.index, summary, start.elapsed(), Instant::now());
            }
            failed => {
                let why = match failed {
                    Ok(Ok(summary)) => format!(
                        "it says its region is {:?}, not {:?} as [[peer]] says",
                        summary.region, peer.region
                    ),
                    Ok(Err(e)) => e.to_string(),
                    Err(_) => format!("no answer within {} ms", timeout.as_millis()),
                };
                if !warned {
                    warned = true;
                    tracing::warn!(
                        peer = %peer.address,
                        region = %peer.region,
                        "peer gateway {} ({}): its load is unknown, nothing is forwarded to it: {why}",
                        peer.address,
                        peer.region
                    );
                }
                book.unreachable(peer.index);
            }
        }
        tokio::time::sleep_until(next).await;
    }
}

/// Why a peer gateway's summary or answer could not be had.
#[derive(Debug, thiserror::Error)]
pub(super) enum PeerError {
    /// Its token or the tenant is not a header value.
    #[error("{0}")]
    Header(#[from] http::header::InvalidHeaderValue),
    /// Its address and the path do not make a URI.
    #[error("{0}")]
    Uri(#[from] http::uri::InvalidUri),
    /// No answer head (the client's error and its causes).
    #[error("{}", crate::error_chain(.0))]
    Request(#[from] hyper_util::client::legacy::Error),
    /// The answer's body broke off or was too long.
    #[error("{0}")]
    Body(Box<dyn std::error::Error + Send + Sync>),
    /// Its summary endpoint refused.
    #[error("{LOAD_PATH} answered {status}: {body}")]
    Refused { status: StatusCode, body: String },
    /// Its summary is not one.
    #[error("its summary does not parse: {0}")]
    Summary(serde_json::Error),
    /// No head before the request's deadline.
    #[error("no answer head before the request's deadline")]
    Deadline,
    /// A 5xx head (the request may go elsewhere).
    #[error("it answered {0}")]
    Answered(StatusCode),
}

/// One poll of `peer`'s load summary at `uri`.
async fn fetch_summary(dispatcher: &Dispatcher, peer: &Peer, uri: Uri) -> Result<LoadSummary, PeerError> {
    if !peer.delay.is_zero() {
        tokio::time::sleep(peer.delay).await;
    }
    let mut request = Request::new(Full::new(Bytes::new()));
    *request.uri_mut() = uri;
    let token = HeaderValue::from_str(&peer.token)?;
    request.headers_mut().insert(TOKEN_HEADER, token);
    let response = peer_request(dispatcher, peer, request).await?;
    let status = response.status();
    let body = Limited::new(response.into_body(), MAX_SUMMARY_BYTES)
        .collect()
        .await
        .map_err(PeerError::Body)?
        .to_bytes();
    if !status.is_success() {
        return Err(PeerError::Refused {
            status,
            body: String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned(),
        });
    }
    serde_json::from_slice(&body).map_err(PeerError::Summary)
}

/// The tenant a peer gateway forwarded a request as: `None` when it names
/// none (the request is authenticated by its own key, if any); else the
/// tenant, if it also presents this gateway's peering token, or why not.
pub(super) fn forwarded_tenant<'h>(
    dispatcher: &Dispatcher,
    headers: &'h HeaderMap,
) -> Option<Result<&'h str, &'static str>> {
    let tenant = headers.get(TENANT_HEADER)?;
    let peering = dispatcher.peering();
    let Some(token) = peering.token.as_deref() else {
        return Some(Err(
            "this gateway takes no requests forwarded by peers (no peering.token_file)",
        ));
    };
    let presented = headers.get(TOKEN_HEADER).map_or(&b""[..], HeaderValue::as_bytes);
    if !crate::tenancy::auth::constant_time_eq(presented, token.as_bytes()) {
        return Some(Err(
            "a request forwarded by a peer gateway needs the peering token in x-semlb-peer-token",
        ));
    }
    Some(
        tenant
            .to_str()
            .ok()
            .filter(|t| !t.is_empty())
            .ok_or("x-semlb-peer-tenant must name a tenant"),
    )
}

/// `request` sent to `peer`: over its HTTPS client, else the dispatcher's.
async fn peer_request(
    dispatcher: &Dispatcher,
    peer: &Peer,
    request: Request<Full<Bytes>>,
) -> Result<Response<Incoming>, hyper_util::client::legacy::Error> {
    match &peer.tls {
        Some(tls) => tls.client.request(request).await,
        None => dispatcher.client().request(request).await,
    }
}

/// `GET /semlb/peer/load`: this gateway's load, for a peer presenting the
/// token (`peering.token_file`); 404 when none is configured, 401 for a
/// wrong or missing token.
pub(super) fn load_summary(dispatcher: &Dispatcher, headers: &HeaderMap) -> Response<Body> {
    let peering = dispatcher.peering();
    let (Some(token), Some(region)) = (peering.token.as_deref(), peering.config.region.as_deref()) else {
        return error_response(
            StatusCode::NOT_FOUND,
            format!("{LOAD_PATH} is not served: this gateway has no peering.token_file"),
            Some("unknown_url"),
        );
    };
    let presented = headers.get(TOKEN_HEADER).map_or(&b""[..], HeaderValue::as_bytes);
    if !crate::tenancy::auth::constant_time_eq(presented, token.as_bytes()) {
        return error_response(
            StatusCode::UNAUTHORIZED,
            format!("{LOAD_PATH} needs the peering token in {TOKEN_HEADER}"),
            Some("invalid_peer_token"),
        );
    }
    let mut candidates = Vec::new();
    live_candidates(&dispatcher.segment().tables(), &mut candidates);
    let pools = dispatcher.pools();
    let models = if pools.is_implicit() {
        Vec::new()
    } else {
        pools.names().map(|(name, _)| name.to_owned()).collect()
    };
    // Free: what the (first) pool's holding policy would send one more
    // request to, asked as it asks once a request is counted.
    let policy = pools.pools()[0].policy().current_arc();
    let free = |c: &Candidate| {
        if policy.holds_requests() {
            policy.admits(&Candidate {
                inflight: c.inflight + 1,
                pending: c.pending + 1,
                ..*c
            })
        } else {
            c.pending_estimate() == 0
        }
    };
    let mut summary = LoadSummary::of(region, &candidates, free, dispatcher.metrics().queue_depth(), models);
    let now_s = dispatcher.segment().clock().now_ms() / 1000;
    summary.warm_s = warm_s(&dispatcher.segment().tables().servers, &candidates, now_s);
    dispatcher.metrics().peer(PeerEvent::LoadServed);
    match serde_json::to_value(&summary) {
        Ok(v) => json_response(StatusCode::OK, &v),
        Err(e) => error_response(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), None),
    }
}

/// Sends `copy` (a `method` request for `path_and_query`) to `peer` with
/// this gateway's region in the hop header, and relays its answer until
/// `deadline`. `start`: when the request arrived (its TTFT and duration
/// are recorded). A connection failure or a 5xx head is the error (the
/// request has not reached a client yet, and may go elsewhere).
pub(super) async fn send(
    dispatcher: &Arc<Dispatcher>,
    guard: ForwardGuard,
    method: &Method,
    path_and_query: &str,
    copy: &PeerCopy,
    deadline: tokio::time::Instant,
    start: Option<Instant>,
) -> Result<Response<Body>, PeerError> {
    let peer = guard.forward.peer.clone();
    let uri = format!("{}{path_and_query}", peer.address).parse::<Uri>()?;
    let mut request = Request::new(Full::new(copy.body.clone()));
    *request.method_mut() = method.clone();
    *request.uri_mut() = uri;
    *request.headers_mut() = copy.headers.clone();
    let headers = request.headers_mut();
    if let Ok(v) = HeaderValue::from_str(guard.book.region()) {
        headers.insert(HOP_HEADER, v);
    }
    // An authenticated client's key stays here: the peer gets this
    // gateway's credential and the tenant it checked.
    if let Some(tenant) = &copy.tenant {
        for name in crate::response_cache::API_KEY_HEADERS {
            headers.remove(name);
        }
        headers.insert(TOKEN_HEADER, HeaderValue::from_str(&peer.token)?);
        headers.insert(TENANT_HEADER, HeaderValue::from_str(tenant)?);
    }
    if !peer.delay.is_zero() {
        tokio::time::sleep(peer.delay).await;
    }
    let head = tokio::select! {
        biased;
        head = peer_request(dispatcher, &peer, request) => head?,
        () = tokio::time::sleep_until(deadline) => return Err(PeerError::Deadline),
    };
    if head.status().is_server_error() {
        return Err(PeerError::Answered(head.status()));
    }
    let (parts, incoming) = head.into_parts();
    let relay = PeerRelay {
        inner: incoming,
        deadline: Box::pin(tokio::time::sleep_until(deadline)),
        timer: start.map(|s| RelayTimer::new(dispatcher.clone(), s)),
        finished: false,
        _ended: guard,
    };
    let mut response = Response::new(relay.boxed_unsync());
    *response.status_mut() = parts.status;
    client_response_headers(&parts.headers, response.headers_mut());
    set_header(response.headers_mut(), PEER_HEADER, &peer.region);
    dispatcher.metrics().peer(PeerEvent::Forwarded);
    Ok(response)
}

/// A peer's answer relayed to the client as it arrives, until the
/// request's deadline. The peer learns from it; this gateway does not.
struct PeerRelay {
    inner: Incoming,
    deadline: Pin<Box<Sleep>>,
    timer: Option<RelayTimer>,
    finished: bool,
    /// Tells the peer book when the relay is dropped.
    _ended: ForwardGuard,
}

/// A request forwarded as `forward`: tells the book it was chosen from
/// (a reload may have replaced it since) that it ended when dropped (its
/// answer ended, failed, or its client left; or it never got a head).
pub(super) struct ForwardGuard {
    book: Arc<PeerBook>,
    forward: Forward,
}

impl ForwardGuard {
    /// The guard of `forward`, chosen from `book`.
    pub(super) fn new(book: Arc<PeerBook>, forward: Forward) -> Self {
        Self { book, forward }
    }
}

impl Drop for ForwardGuard {
    fn drop(&mut self) {
        self.book.ended(&self.forward);
    }
}

impl HttpBody for PeerRelay {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if this.finished {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if frame.is_data()
                    && let Some(t) = this.timer.as_mut()
                {
                    t.frame();
                }
                if this.inner.is_end_stream() {
                    this.finished = true;
                    this.timer = None;
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.finished = true;
                this.timer = None;
                Poll::Ready(Some(Err(Box::new(e))))
            }
            Poll::Ready(None) => {
                this.finished = true;
                this.timer = None;
                Poll::Ready(None)
            }
            Poll::Pending => {
                if this.deadline.as_mut().poll(cx).is_ready() {
                    this.finished = true;
                    this.timer = None;
                    return Poll::Ready(Some(Err(
                        "semlb: the peer gateway's answer outlived the request's deadline".into(),
                    )));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.finished
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
