//! A stand-in of the Kubernetes API server's **list and watch**, for tests
//! of Kubernetes discovery (kube-rs's `watcher`) where no API server can
//! run: plain HTTP on `127.0.0.1:0`, its own thread and tokio runtime,
//! JSON only.
//!
//! # What it implements of the real API server
//!
//! - Three namespaced resources ([`Resource`]): Pods (`/api/v1/…/pods`),
//!   EndpointSlices (`/apis/discovery.k8s.io/v1/…/endpointslices`) and the
//!   Gateway API Inference Extension's InferencePools
//!   (`/apis/inference.networking.k8s.io/v1/…/inferencepools`), in one
//!   namespace (`/namespaces/{ns}/…`) or all, and `GET …/{name}` for one
//!   object (a 404 `Status` when absent).
//! - One global, increasing `resourceVersion` (etcd's revision): every
//!   change bumps it, the object carries it, a list's `metadata` has the
//!   revision it was taken at. Deleting is a change too: the `DELETED`
//!   event's object is the last state with the deletion's version.
//! - **List**: `{"kind":"PodList",…,"metadata":{"resourceVersion"},"items"}`
//!   sorted by namespace and name (the etcd key order). Items of the
//!   built-in kinds carry no `kind`/`apiVersion` (as the real server sends
//!   them), InferencePool items (a custom resource) do. `labelSelector`
//!   (`=`, `==`, `!=`, `in`, `notin`, `k`, `!k`, `>`/`<`, comma = AND;
//!   malformed: 400), `fieldSelector` on `metadata.name` and
//!   `metadata.namespace` only (`=`, `==`, `!=`; another field: 400).
//!   `limit` + `continue` pagination over a consistent snapshot (the
//!   continue token names the revision of the first page; a compacted one
//!   gets 410). `resourceVersion` as the "Resource versions" table of the
//!   API concepts document says: unset → most recent; `0` → any (here the
//!   current state); `N` with `resourceVersionMatch=NotOlderThan` (or
//!   unset, without `limit`) → the current state; `N` with
//!   `resourceVersionMatch=Exact` (or unset, with `limit`) → the state at
//!   `N` exactly, HTTP 410 `Expired` when compacted. The option checks of
//!   `ValidateListOptions` give 422 `Invalid`.
//! - **Watch** (`watch=true|1`): a chunked stream of newline-separated
//!   `{"type","object"}` events. From `resourceVersion=N`: every change after
//!   `N` that matches the selectors (history), then live ones; unset or `0`:
//!   synthetic `ADDED` events for the current state first. A change that
//!   makes an object stop matching a label selector is a `DELETED` (the
//!   previous content with the change's version), one that makes it start
//!   matching an `ADDED`, as the watch cache does. `allowWatchBookmarks=true`
//!   gets `BOOKMARK`s (`kind`, `apiVersion`, `metadata.resourceVersion`)
//!   when the test asks ([`KubeApi::bookmark`]). `sendInitialEvents=true`
//!   (with `resourceVersionMatch=NotOlderThan`, as the API requires) is the
//!   streaming list: the current state as `ADDED`, then a `BOOKMARK`
//!   annotated `k8s.io/initial-events-end: "true"`. `timeoutSeconds=N` ends
//!   the stream cleanly after `N` s. A watch from a version older than the
//!   compaction point ([`KubeApi::compact`]) gets one `ERROR` event with a
//!   410 `Expired` `Status` ("too old resource version") and ends.
//! - A bearer token (`Authorization: Bearer …`, else 401), every error as a
//!   `Status` object with its code and reason.
//! - The failures a watcher must survive: watches cut abruptly
//!   ([`KubeApi::drop_watches`]), the server away and back on the same
//!   port ([`KubeApi::set_away`]), history compacted.
//!
//! # What it does not
//!
//! No writes through the API (tests change objects with [`KubeApi::apply`]
//! and [`KubeApi::delete`], which are immediate: no admission, no
//! validation, no defaulting, no server-side apply, no finalizers or
//! graceful deletion: a terminating pod is one the test gives a
//! `deletionTimestamp`), no field selectors beyond `metadata.name` and
//! `metadata.namespace`, no protobuf, CBOR, tables or `PartialObjectMetadata`
//! (`watch_metadata`), no discovery documents (`/api`, `/apis`), no RBAC
//! (403), no periodic bookmarks, no "too large resource version" wait (a
//! watch from a future version just waits for it), no TLS, no compression.
//! An `apply` that changes nothing is, as on the real server, no change: no
//! new version, no event.
//!
//! # kube-rs 5.0's watcher against it
//!
//! With `watcher::Config::default()` (`ListWatch`, `MostRecent`, page size
//! 500, bookmarks on) kube 5.0 sends `GET {collection}?limit=500` (with
//! `fieldSelector=…&labelSelector=…` before `limit` when configured; pages
//! after the first add `&continue=TOKEN`; `any_semantic()` adds nothing
//! since kube drops `resourceVersion=0` when a limit is set), then
//! `GET {collection}?watch=true&timeoutSeconds=290&allowWatchBookmarks=true&resourceVersion=RV`
//! (selectors between `timeoutSeconds` and `allowWatchBookmarks`), resumed
//! with the same query from the last event's or bookmark's version; a 410
//! `ERROR` event sends it back to the list. With `streaming_lists()` the
//! first request is
//! `?watch=true&timeoutSeconds=290&allowWatchBookmarks=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&resourceVersion=0`.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response};
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

/// A resource the stand-in serves (all namespaced).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Resource {
    /// `v1` Pods.
    Pods,
    /// `discovery.k8s.io/v1` EndpointSlices.
    EndpointSlices,
    /// `inference.networking.k8s.io/v1` InferencePools (a custom resource).
    InferencePools,
}

impl Resource {
    const ALL: [Resource; 3] = [Resource::Pods, Resource::EndpointSlices, Resource::InferencePools];

    /// The path prefix of its group and version (`/api/v1`, `/apis/G/V`).
    fn prefix(self) -> &'static str {
        match self {
            Resource::Pods => "/api/v1",
            Resource::EndpointSlices => "/apis/discovery.k8s.io/v1",
            Resource::InferencePools => "/apis/inference.networking.k8s.io/v1",
        }
    }

    /// Its plural name in paths.
    pub fn plural(self) -> &'static str {
        match self {
            Resource::Pods => "pods",
            Resource::EndpointSlices => "endpointslices",
            Resource::InferencePools => "inferencepools",
        }
    }

    /// Its `kind`.
    pub fn kind(self) -> &'static str {
        match self {
            Resource::Pods => "Pod",
            Resource::EndpointSlices => "EndpointSlice",
            Resource::InferencePools => "InferencePool",
        }
    }

    /// Its `apiVersion`.
    pub fn api_version(self) -> &'static str {
        match self {
            Resource::Pods => "v1",
            Resource::EndpointSlices => "discovery.k8s.io/v1",
            Resource::InferencePools => "inference.networking.k8s.io/v1",
        }
    }

    /// Built into the API server: list items carry no `kind`/`apiVersion`.
    fn built_in(self) -> bool {
        !matches!(self, Resource::InferencePools)
    }

    /// The path of its collection, in `namespace` or (`None`) all.
    pub fn path(self, namespace: Option<&str>) -> String {
        match namespace {
            Some(ns) => format!("{}/namespaces/{ns}/{}", self.prefix(), self.plural()),
            None => format!("{}/{}", self.prefix(), self.plural()),
        }
    }
}

/// One request the stand-in received.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Logged {
    /// `GET`, …
    pub method: String,
    /// The path with its query, as sent (still percent-encoded).
    pub path: String,
    /// It carried the right bearer token (always true without a token).
    pub authorized: bool,
}

/// A change, kept in the history watches replay.
#[derive(Clone)]
struct Change {
    rv: u64,
    resource: Resource,
    /// The state before (`None`: a creation).
    old: Option<Value>,
    /// The state after (`None`: a deletion).
    new: Option<Value>,
}

/// What a watch's body sends.
enum Out {
    Line(Bytes),
    /// A clean end (the terminating chunk).
    End,
    /// An abrupt end: the connection is closed mid-body.
    Cut,
}

struct Watch {
    resource: Resource,
    filter: Filter,
    bookmarks: bool,
    tx: mpsc::UnboundedSender<Out>,
}

type Key = (Resource, String, String);

#[derive(Default)]
struct Store {
    rv: u64,
    /// Watches from below this version get 410.
    compacted: u64,
    objects: BTreeMap<Key, Value>,
    history: Vec<Change>,
    watches: Vec<Watch>,
    uids: u64,
}

struct Shared {
    token: Option<String>,
    store: Mutex<Store>,
    log: Mutex<Vec<Logged>>,
    /// Connection tasks to abort when going away.
    conns: Mutex<Vec<tokio::task::AbortHandle>>,
    live_conns: AtomicUsize,
}

/// Stops the accept loop; it acknowledges once the listener is closed.
type StopAccept = tokio::sync::oneshot::Sender<std::sync::mpsc::Sender<()>>;

/// The stand-in API server. Dropping it stops it.
pub struct KubeApi {
    /// `127.0.0.1:PORT`.
    pub addr: String,
    shared: Arc<Shared>,
    runtime: Option<tokio::runtime::Runtime>,
    stop_accept: Mutex<Option<StopAccept>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl KubeApi {
    /// Starts it on `127.0.0.1:0`; with `token`, every request must carry
    /// `Authorization: Bearer <token>`.
    pub fn start(token: Option<&str>) -> KubeApi {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kube-api")
            .enable_all()
            .build()
            .expect("a tokio runtime for the Kubernetes API stand-in");
        let shared = Arc::new(Shared {
            token: token.map(str::to_owned),
            store: Mutex::new(Store::default()),
            log: Mutex::new(Vec::new()),
            conns: Mutex::new(Vec::new()),
            live_conns: AtomicUsize::new(0),
        });
        let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let (stop, addr) = listen(&runtime, &shared, addr).unwrap_or_else(|e| panic!("kube-api: bind: {e}"));
        KubeApi {
            addr: addr.to_string(),
            shared,
            runtime: Some(runtime),
            stop_accept: Mutex::new(Some(stop)),
        }
    }

    /// Its base URL, `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Writes `dir/kubeconfig`: one cluster (`http://ADDR`), one user (the
    /// token, if any), one current context with `namespace` as its default.
    pub fn kubeconfig(&self, dir: &Path, namespace: &str) -> PathBuf {
        let user = match &self.shared.token {
            Some(t) => format!("\n    token: {t}"),
            None => " {}".to_owned(),
        };
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: semlb-test\n  cluster:\n    server: {}\nusers:\n- name: semlb-test\n  user:{user}\ncontexts:\n- name: semlb-test\n  context:\n    cluster: semlb-test\n    user: semlb-test\n    namespace: {namespace}\ncurrent-context: semlb-test\npreferences: {{}}\n",
            self.url()
        );
        let path = dir.join("kubeconfig");
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        path
    }

    /// Creates or replaces (by namespace and name) `object`, a whole
    /// object; the stand-in sets `uid` (kept on a replace),
    /// `resourceVersion`, `creationTimestamp` (kept on a replace), `kind`
    /// and `apiVersion` when missing. Emits `ADDED` or `MODIFIED`; an
    /// object equal to the stored one is no change (no event). Returns the
    /// object's resourceVersion.
    pub fn apply(&self, resource: Resource, mut object: Value) -> u64 {
        let (ns, name) = {
            let meta = object["metadata"].as_object().expect("the object has metadata");
            let ns = meta
                .get("namespace")
                .and_then(Value::as_str)
                .expect("metadata.namespace");
            let name = meta.get("name").and_then(Value::as_str).expect("metadata.name");
            (ns.to_owned(), name.to_owned())
        };
        let obj = object.as_object_mut().expect("an object");
        obj.entry("kind").or_insert_with(|| resource.kind().into());
        obj.entry("apiVersion").or_insert_with(|| resource.api_version().into());
        let mut store = lock(&self.shared.store);
        let key = (resource, ns, name);
        let old = store.objects.get(&key).cloned();
        match &old {
            Some(old) => {
                for field in ["uid", "creationTimestamp", "resourceVersion"] {
                    object["metadata"][field] = old["metadata"][field].clone();
                }
                if old == &object {
                    return rv_of(old);
                }
            }
            None => {
                store.uids += 1;
                object["metadata"]["uid"] = uid(store.uids).into();
                object["metadata"]["creationTimestamp"] = rfc3339(SystemTime::now()).into();
            }
        }
        store.rv += 1;
        let rv = store.rv;
        object["metadata"]["resourceVersion"] = rv.to_string().into();
        store.objects.insert(key, object.clone());
        store.record(Change {
            rv,
            resource,
            old,
            new: Some(object),
        });
        rv
    }

    /// Deletes `namespace/name` (immediately: no grace period) and emits
    /// `DELETED` with the last state at the deletion's resourceVersion.
    /// Panics if it does not exist.
    pub fn delete(&self, resource: Resource, namespace: &str, name: &str) {
        let mut store = lock(&self.shared.store);
        let key = (resource, namespace.to_owned(), name.to_owned());
        let old = store
            .objects
            .remove(&key)
            .unwrap_or_else(|| panic!("no {} {namespace}/{name} to delete", resource.plural()));
        store.rv += 1;
        let rv = store.rv;
        store.record(Change {
            rv,
            resource,
            old: Some(old),
            new: None,
        });
    }

    /// The current resourceVersion.
    pub fn resource_version(&self) -> u64 {
        lock(&self.shared.store).rv
    }

    /// Forgets the history: watches from an older resourceVersion than the
    /// current one (a resumed watch included), and lists or continue
    /// tokens at one, get 410 Gone.
    pub fn compact(&self) {
        let mut store = lock(&self.shared.store);
        store.compacted = store.rv;
        store.history.clear();
    }

    /// Sends a `BOOKMARK` at the current resourceVersion on every open
    /// watch that asked for bookmarks.
    pub fn bookmark(&self) {
        let mut store = lock(&self.shared.store);
        let rv = store.rv;
        store.watches.retain(|w| {
            !w.bookmarks
                || w.tx
                    .send(Out::Line(event_line("BOOKMARK", &bookmark(w.resource, rv, false))))
                    .is_ok()
        });
    }

    /// Cuts every open watch connection abruptly (the connection closes
    /// mid-body, without the terminating chunk), as a load balancer or an
    /// API server restart does.
    pub fn drop_watches(&self) {
        let mut store = lock(&self.shared.store);
        for w in store.watches.drain(..) {
            let _ = w.tx.send(Out::Cut);
        }
    }

    /// Away: the listening socket is closed (connections are refused) and
    /// every open connection is cut. Back: listens again on the same
    /// address.
    pub fn set_away(&self, away: bool) {
        let mut stop = lock(&self.stop_accept);
        if away {
            let Some(tx) = stop.take() else { return };
            let (ack_tx, ack_rx) = std::sync::mpsc::channel();
            if tx.send(ack_tx).is_ok() {
                ack_rx
                    .recv_timeout(Duration::from_secs(10))
                    .expect("kube-api: the accept loop did not stop");
            }
            self.drop_watches();
            for conn in lock(&self.shared.conns).drain(..) {
                conn.abort();
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            while self.shared.live_conns.load(Ordering::SeqCst) > 0 {
                assert!(Instant::now() < deadline, "kube-api: connections still open while away");
                std::thread::sleep(Duration::from_millis(2));
            }
        } else if stop.is_none() {
            let addr: SocketAddr = self.addr.parse().unwrap();
            let runtime = self.runtime.as_ref().unwrap();
            // The port can be in use for a moment (TIME_WAIT is allowed by
            // SO_REUSEADDR, but not another listener): retry a while.
            let deadline = Instant::now() + Duration::from_secs(10);
            let started = loop {
                match listen(runtime, &self.shared, addr) {
                    Ok((tx, _)) => break tx,
                    Err(e) if Instant::now() < deadline => {
                        let _ = e;
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => panic!("kube-api: cannot listen on {addr} again: {e}"),
                }
            };
            *stop = Some(started);
        }
    }

    /// Every request so far, in order of arrival.
    pub fn requests(&self) -> Vec<Logged> {
        lock(&self.shared.log).clone()
    }

    /// How many watches of `resource` are open now.
    pub fn watching(&self, resource: Resource) -> usize {
        let mut store = lock(&self.shared.store);
        store.watches.retain(|w| !w.tx.is_closed());
        store.watches.iter().filter(|w| w.resource == resource).count()
    }

    /// Waits until a watch of `resource` is open; panics after `within`
    /// with the requests it saw.
    pub fn wait_watching(&self, resource: Resource, within: Duration) {
        let deadline = Instant::now() + within;
        while self.watching(resource) == 0 {
            if Instant::now() >= deadline {
                let seen: Vec<String> = self
                    .requests()
                    .iter()
                    .map(|l| format!("{} {} (authorized: {})", l.method, l.path, l.authorized))
                    .collect();
                panic!(
                    "no watch of {} open within {within:?}; requests:\n  {}",
                    resource.plural(),
                    seen.join("\n  ")
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// Binds `addr` (SO_REUSEADDR) and starts the accept loop on `runtime`.
fn listen(
    runtime: &tokio::runtime::Runtime,
    shared: &Arc<Shared>,
    addr: SocketAddr,
) -> std::io::Result<(StopAccept, SocketAddr)> {
    let _entered = runtime.enter();
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    let listener = socket.listen(128)?;
    let bound = listener.local_addr()?;
    let (tx, mut rx) = tokio::sync::oneshot::channel::<std::sync::mpsc::Sender<()>>();
    let shared = shared.clone();
    runtime.spawn(async move {
        loop {
            tokio::select! {
                ack = &mut rx => {
                    drop(listener);
                    if let Ok(ack) = ack {
                        let _ = ack.send(());
                    }
                    return;
                }
                accepted = listener.accept() => {
                    let Ok((stream, _)) = accepted else { continue };
                    serve_connection(&shared, stream);
                }
            }
        }
    });
    Ok((tx, bound))
}

/// Decrements the live connection count when its task ends or is aborted.
struct LiveConn(Arc<Shared>);

impl Drop for LiveConn {
    fn drop(&mut self) {
        self.0.live_conns.fetch_sub(1, Ordering::SeqCst);
    }
}

fn serve_connection(shared: &Arc<Shared>, stream: tokio::net::TcpStream) {
    shared.live_conns.fetch_add(1, Ordering::SeqCst);
    let live = LiveConn(shared.clone());
    let svc_shared = shared.clone();
    let task = tokio::spawn(async move {
        let _live = live;
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let shared = svc_shared.clone();
            async move { Ok::<_, Infallible>(handle(&shared, &req)) }
        });
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
            .await;
    });
    let mut conns = lock(&shared.conns);
    conns.retain(|c| !c.is_finished());
    conns.push(task.abort_handle());
}

/// A response body: whole, or a watch's stream of lines.
enum Body {
    /// A whole body.
    Full(Option<Bytes>),
    /// A watch.
    Watch(mpsc::UnboundedReceiver<Out>),
}

/// The error that cuts a watch's connection.
#[derive(Debug)]
struct Cut;

impl std::fmt::Display for Cut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("watch cut")
    }
}

impl std::error::Error for Cut {}

impl hyper::body::Body for Body {
    type Data = Bytes;
    type Error = Cut;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Cut>>> {
        match self.get_mut() {
            Body::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Body::Watch(rx) => match rx.poll_recv(cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(Some(Out::Line(line))) => Poll::Ready(Some(Ok(Frame::data(line)))),
                Poll::Ready(Some(Out::End) | None) => Poll::Ready(None),
                Poll::Ready(Some(Out::Cut)) => Poll::Ready(Some(Err(Cut))),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, Body::Full(None))
    }

    /// Exact for a whole body (sent with `content-length`, as the API
    /// server does); a watch is chunked.
    fn size_hint(&self) -> hyper::body::SizeHint {
        match self {
            Body::Full(b) => hyper::body::SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            Body::Watch(_) => hyper::body::SizeHint::default(),
        }
    }
}

/// A `Status` object.
fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    })
}

fn respond(code: u16, body: &Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Body::Full(Some(Bytes::from(body.to_string()))))
        .unwrap()
}

fn error(code: u16, reason: &str, message: &str) -> Response<Body> {
    respond(code, &status(code, reason, message))
}

fn handle(shared: &Arc<Shared>, req: &Request<Incoming>) -> Response<Body> {
    let authorized = match &shared.token {
        None => true,
        Some(t) => {
            req.headers().get("authorization").and_then(|v| v.to_str().ok()) == Some(format!("Bearer {t}").as_str())
        }
    };
    let path_and_query = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_default();
    lock(&shared.log).push(Logged {
        method: req.method().to_string(),
        path: path_and_query,
        authorized,
    });
    if !authorized {
        return error(401, "Unauthorized", "Unauthorized");
    }
    let Some((resource, namespace, name)) = route(req.uri().path()) else {
        return error(404, "NotFound", "the server could not find the requested resource");
    };
    if req.method() != hyper::Method::GET {
        return error(
            405,
            "MethodNotAllowed",
            &format!("the stand-in serves only GET (not {})", req.method()),
        );
    }
    let query = parse_query(req.uri().query().unwrap_or(""));
    if let Some(name) = name {
        let ns = namespace.unwrap_or_default();
        let store = lock(&shared.store);
        return match store.objects.get(&(resource, ns, name.clone())) {
            Some(obj) => respond(200, obj),
            None => {
                let mut s = status(404, "NotFound", &format!("{} \"{name}\" not found", resource.plural()));
                s["details"] = json!({"name": name, "kind": resource.plural()});
                respond(404, &s)
            }
        };
    }
    let filter = match Filter::new(resource, namespace, &query) {
        Ok(f) => f,
        Err(resp) => return resp,
    };
    let watch = matches!(query.get("watch").map(String::as_str), Some("true" | "1"));
    if watch {
        start_watch(shared, filter, &query)
    } else {
        list(shared, &filter, &query)
    }
}

/// `(resource, namespace, name)` of a path, `None` when not served.
fn route(path: &str) -> Option<(Resource, Option<String>, Option<String>)> {
    for resource in Resource::ALL {
        let Some(rest) = path.strip_prefix(resource.prefix()) else {
            continue;
        };
        let segs: Vec<&str> = rest.trim_start_matches('/').split('/').collect();
        let plural = resource.plural();
        let own = |s: &str| s.to_owned();
        match segs.as_slice() {
            [p] if *p == plural => return Some((resource, None, None)),
            ["namespaces", ns, p] if *p == plural && !ns.is_empty() => return Some((resource, Some(own(ns)), None)),
            ["namespaces", ns, p, name] if *p == plural && !ns.is_empty() && !name.is_empty() => {
                return Some((resource, Some(own(ns)), Some(own(name))));
            }
            _ => {}
        }
    }
    None
}

/// The query's parameters, form-decoded (the last of a repeated name).
fn parse_query(query: &str) -> BTreeMap<String, String> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (form_decode(k), form_decode(v))
        })
        .collect()
}

fn form_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                match u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("zz"), 16) {
                    Ok(v) => {
                        out.push(v);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// What a list or watch selects.
struct Filter {
    resource: Resource,
    namespace: Option<String>,
    labels: Vec<Requirement>,
    fields: Vec<(String, bool, String)>,
}

impl Filter {
    #[allow(clippy::result_large_err)]
    fn new(
        resource: Resource,
        namespace: Option<String>,
        query: &BTreeMap<String, String>,
    ) -> Result<Filter, Response<Body>> {
        let labels = parse_label_selector(query.get("labelSelector").map(String::as_str).unwrap_or(""))
            .map_err(|e| error(400, "BadRequest", &format!("unable to parse requirement: {e}")))?;
        let fields = parse_field_selector(query.get("fieldSelector").map(String::as_str).unwrap_or(""))
            .map_err(|e| error(400, "BadRequest", &e))?;
        Ok(Filter {
            resource,
            namespace,
            labels,
            fields,
        })
    }

    fn unselective(&self) -> bool {
        self.labels.is_empty() && self.fields.is_empty()
    }

    fn matches(&self, obj: &Value) -> bool {
        let meta = &obj["metadata"];
        let ns = meta["namespace"].as_str().unwrap_or("");
        if self.namespace.as_deref().is_some_and(|n| n != ns) {
            return false;
        }
        let fields_ok = self.fields.iter().all(|(field, eq, value)| {
            let actual = match field.as_str() {
                "metadata.name" => meta["name"].as_str().unwrap_or(""),
                _ => ns,
            };
            (actual == value) == *eq
        });
        let labels = meta["labels"].as_object();
        fields_ok && self.labels.iter().all(|r| r.matches(labels))
    }

    /// The events `change` makes on a watch with this filter (none, or one).
    fn event(&self, change: &Change) -> Option<Bytes> {
        if change.resource != self.resource {
            return None;
        }
        let was = change.old.as_ref().is_some_and(|o| self.matches(o));
        let is = change.new.as_ref().is_some_and(|n| self.matches(n));
        match (was, is) {
            (true, true) => Some(event_line("MODIFIED", change.new.as_ref().unwrap())),
            (false, true) => Some(event_line("ADDED", change.new.as_ref().unwrap())),
            (true, false) => {
                // The previous content at the change's version (a deletion,
                // or an object that left the selection).
                let mut old = change.old.clone().unwrap();
                old["metadata"]["resourceVersion"] = change.rv.to_string().into();
                Some(event_line("DELETED", &old))
            }
            (false, false) => None,
        }
    }
}

/// One requirement of a label selector.
#[derive(Debug, PartialEq)]
enum Requirement {
    Eq(String, String),
    NotEq(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
    Gt(String, i64),
    Lt(String, i64),
}

impl Requirement {
    fn matches(&self, labels: Option<&Map<String, Value>>) -> bool {
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        match self {
            Requirement::Eq(k, v) => get(k) == Some(v.as_str()),
            Requirement::NotEq(k, v) => get(k) != Some(v.as_str()),
            Requirement::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            Requirement::NotIn(k, vs) => !get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            Requirement::Exists(k) => get(k).is_some(),
            Requirement::NotExists(k) => get(k).is_none(),
            Requirement::Gt(k, n) => get(k).and_then(|x| x.parse::<i64>().ok()).is_some_and(|x| x > *n),
            Requirement::Lt(k, n) => get(k).and_then(|x| x.parse::<i64>().ok()).is_some_and(|x| x < *n),
        }
    }
}

#[derive(Debug, PartialEq)]
enum Token {
    Ident(String),
    In,
    NotIn,
    Not,
    NotEq,
    Eq,
    DoubleEq,
    Gt,
    Lt,
    Open,
    Close,
    Comma,
}

fn lex(s: &str) -> Vec<Token> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    while let Some(&c) = chars.peek() {
        match c {
            c if c.is_whitespace() => {
                chars.next();
            }
            '!' | '=' => {
                chars.next();
                let double = chars.peek() == Some(&'=');
                if double {
                    chars.next();
                }
                out.push(match (c, double) {
                    ('!', true) => Token::NotEq,
                    ('!', false) => Token::Not,
                    (_, true) => Token::DoubleEq,
                    _ => Token::Eq,
                });
            }
            '>' | '<' | '(' | ')' | ',' => {
                chars.next();
                out.push(match c {
                    '>' => Token::Gt,
                    '<' => Token::Lt,
                    '(' => Token::Open,
                    ')' => Token::Close,
                    _ => Token::Comma,
                });
            }
            _ => {
                let mut ident = String::new();
                while let Some(&c) = chars.peek() {
                    if c.is_whitespace() || "!=><(),".contains(c) {
                        break;
                    }
                    ident.push(c);
                    chars.next();
                }
                out.push(match ident.as_str() {
                    "in" => Token::In,
                    "notin" => Token::NotIn,
                    _ => Token::Ident(ident),
                });
            }
        }
    }
    out
}

/// A label selector's requirements (the syntax of apimachinery's
/// `labels.Parse`); the error says what is wrong.
fn parse_label_selector(s: &str) -> Result<Vec<Requirement>, String> {
    let tokens = lex(s);
    let mut reqs = Vec::new();
    if tokens.is_empty() {
        return Ok(reqs);
    }
    let mut i = 0;
    loop {
        let (req, next) = parse_requirement(&tokens, i)?;
        reqs.push(req);
        match tokens.get(next) {
            None => return Ok(reqs),
            Some(Token::Comma) if next + 1 < tokens.len() => i = next + 1,
            Some(t) => return Err(format!("found '{t:?}', expected: ',' or end of string")),
        }
    }
}

fn parse_requirement(t: &[Token], i: usize) -> Result<(Requirement, usize), String> {
    let key = |j: usize| match t.get(j) {
        Some(Token::Ident(k)) => valid_key(k).map(|()| k.clone()),
        other => Err(format!("found '{other:?}', expected: identifier")),
    };
    if t.get(i) == Some(&Token::Not) {
        return Ok((Requirement::NotExists(key(i + 1)?), i + 2));
    }
    let k = key(i)?;
    // A single value: an identifier, or empty before ',' or the end.
    let value = |j: usize| match t.get(j) {
        Some(Token::Ident(v)) => valid_value(v).map(|()| (v.clone(), j + 1)),
        None | Some(Token::Comma) => Ok((String::new(), j)),
        Some(other) => Err(format!("found '{other:?}', expected: identifier")),
    };
    match t.get(i + 1) {
        None | Some(Token::Comma) => Ok((Requirement::Exists(k), i + 1)),
        Some(Token::Eq | Token::DoubleEq) => value(i + 2).map(|(v, n)| (Requirement::Eq(k, v), n)),
        Some(Token::NotEq) => value(i + 2).map(|(v, n)| (Requirement::NotEq(k, v), n)),
        Some(op @ (Token::Gt | Token::Lt)) => match t.get(i + 2) {
            Some(Token::Ident(v)) => {
                let n: i64 = v
                    .parse()
                    .map_err(|_| format!("for 'Gt', 'Lt' operators, the value must be an integer: {v}"))?;
                let r = if *op == Token::Gt {
                    Requirement::Gt(k, n)
                } else {
                    Requirement::Lt(k, n)
                };
                Ok((r, i + 3))
            }
            other => Err(format!("found '{other:?}', expected: identifier")),
        },
        Some(op @ (Token::In | Token::NotIn)) => {
            if t.get(i + 2) != Some(&Token::Open) {
                return Err("found no '(', expected: '(' after 'in' or 'notin'".into());
            }
            let mut values = Vec::new();
            let mut j = i + 3;
            loop {
                match t.get(j) {
                    Some(Token::Ident(v)) => {
                        valid_value(v)?;
                        values.push(v.clone());
                        j += 1;
                    }
                    Some(Token::Comma | Token::Close) => values.push(String::new()),
                    other => return Err(format!("found '{other:?}', expected: ',', ')' or identifier")),
                }
                match t.get(j) {
                    Some(Token::Comma) => j += 1,
                    Some(Token::Close) => break,
                    other => return Err(format!("found '{other:?}', expected: ',' or ')'")),
                }
            }
            if values == [String::new()] && t.get(i + 3) == Some(&Token::Close) {
                return Err("for 'in', 'notin' operators, values set can't be empty".into());
            }
            let r = if *op == Token::In {
                Requirement::In(k, values)
            } else {
                Requirement::NotIn(k, values)
            };
            Ok((r, j + 1))
        }
        Some(other) => Err(format!("found '{other:?}', expected: in, notin, =, ==, !=, gt, lt")),
    }
}

fn name_part_ok(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(c))
}

fn valid_key(k: &str) -> Result<(), String> {
    let (prefix, name) = match k.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, k),
    };
    let prefix_ok = prefix.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 253
            && p.split('.').all(|l| {
                !l.is_empty()
                    && l.len() <= 63
                    && l.bytes()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
                    && !l.starts_with('-')
                    && !l.ends_with('-')
            })
    });
    if prefix_ok && name_part_ok(name) {
        Ok(())
    } else {
        Err(format!("invalid label key \"{k}\""))
    }
}

fn valid_value(v: &str) -> Result<(), String> {
    if v.is_empty() || name_part_ok(v) {
        Ok(())
    } else {
        Err(format!("invalid label value: \"{v}\""))
    }
}

/// `metadata.name` / `metadata.namespace` with `=`, `==` or `!=`.
fn parse_field_selector(s: &str) -> Result<Vec<(String, bool, String)>, String> {
    let mut out = Vec::new();
    for term in s.split(',').filter(|t| !t.trim().is_empty()) {
        let (field, eq, value) = if let Some((f, v)) = term.split_once("!=") {
            (f, false, v)
        } else if let Some((f, v)) = term.split_once("==") {
            (f, true, v)
        } else if let Some((f, v)) = term.split_once('=') {
            (f, true, v)
        } else {
            return Err(format!("invalid selector: '{s}'; can't understand '{term}'"));
        };
        let field = field.trim();
        if field != "metadata.name" && field != "metadata.namespace" {
            return Err(format!("field label not supported: {field}"));
        }
        out.push((field.to_owned(), eq, value.trim().to_owned()));
    }
    Ok(out)
}

fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut line = json!({"type": kind, "object": object}).to_string();
    line.push('\n');
    Bytes::from(line)
}

fn bookmark(resource: Resource, rv: u64, initial_end: bool) -> Value {
    let mut b = json!({
        "kind": resource.kind(),
        "apiVersion": resource.api_version(),
        "metadata": {"resourceVersion": rv.to_string()},
    });
    if initial_end {
        b["metadata"]["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    b
}

fn rv_of(obj: &Value) -> u64 {
    obj["metadata"]["resourceVersion"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

fn too_old(requested: u64, compacted: u64) -> Value {
    status(
        410,
        "Expired",
        &format!("too old resource version: {requested} ({compacted})"),
    )
}

impl Store {
    /// Keeps `change` and sends it to the watches it concerns (dropping
    /// those whose client is gone).
    fn record(&mut self, change: Change) {
        self.watches.retain(|w| match w.filter.event(&change) {
            Some(line) => w.tx.send(Out::Line(line)).is_ok(),
            None => !w.tx.is_closed(),
        });
        self.history.push(change);
    }

    /// The objects of `resource` at version `rv` (≥ the compaction point),
    /// by reverting the history after it.
    fn state_at(&self, resource: Resource, rv: u64) -> BTreeMap<Key, Value> {
        let mut objects: BTreeMap<Key, Value> = self
            .objects
            .iter()
            .filter(|(k, _)| k.0 == resource)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for change in self.history.iter().rev().take_while(|c| c.rv > rv) {
            if change.resource != resource {
                continue;
            }
            let any = change.old.as_ref().or(change.new.as_ref()).unwrap();
            let key = (
                resource,
                any["metadata"]["namespace"].as_str().unwrap_or("").to_owned(),
                any["metadata"]["name"].as_str().unwrap_or("").to_owned(),
            );
            match &change.old {
                Some(old) => objects.insert(key, old.clone()),
                None => objects.remove(&key),
            };
        }
        objects
    }
}

fn list(shared: &Arc<Shared>, filter: &Filter, query: &BTreeMap<String, String>) -> Response<Body> {
    let rv_param = query.get("resourceVersion").map(String::as_str).unwrap_or("");
    let version_match = query.get("resourceVersionMatch").map(String::as_str).unwrap_or("");
    let cont = query.get("continue").map(String::as_str).unwrap_or("");
    let limit: Option<usize> = match query.get("limit").map(|l| l.parse::<i64>()) {
        None => None,
        Some(Ok(n)) if n > 0 => Some(n as usize),
        Some(Ok(_)) => None,
        Some(Err(_)) => return error(400, "BadRequest", "limit: invalid value"),
    };
    // ValidateListOptions.
    let mut invalid = Vec::new();
    if !version_match.is_empty() {
        if rv_param.is_empty() {
            invalid.push(
                "resourceVersionMatch: Forbidden: resourceVersionMatch is forbidden unless resourceVersion is provided",
            );
        }
        if !cont.is_empty() {
            invalid
                .push("resourceVersionMatch: Forbidden: resourceVersionMatch is forbidden when continue is provided");
        }
        if version_match != "Exact" && version_match != "NotOlderThan" {
            invalid.push("resourceVersionMatch: Unsupported value: supported values: \"Exact\", \"NotOlderThan\"");
        }
        if version_match == "Exact" && rv_param == "0" {
            invalid.push("resourceVersionMatch: Forbidden: resourceVersionMatch \"exact\" is forbidden for resourceVersion \"0\"");
        }
    }
    if query.contains_key("sendInitialEvents") {
        invalid.push("sendInitialEvents: Forbidden: sendInitialEvents is forbidden for list");
    }
    if !invalid.is_empty() {
        return error(
            422,
            "Invalid",
            &format!("ListOptions.meta.k8s.io \"\" is invalid: {}", invalid.join(", ")),
        );
    }
    let store = lock(&shared.store);
    // (snapshot version, start after this key)
    let (at, after): (u64, Option<(String, String)>) = if !cont.is_empty() {
        if !rv_param.is_empty() && rv_param != "0" {
            return error(
                400,
                "BadRequest",
                "specifying resource version is not allowed when using continue",
            );
        }
        match decode_continue(cont) {
            Some((rv, ns, name)) => (rv, Some((ns, name))),
            None => {
                return error(
                    400,
                    "BadRequest",
                    "continue key is not valid: incorrect encoded start resourceVersion",
                );
            }
        }
    } else if rv_param.is_empty() || rv_param == "0" {
        (store.rv, None)
    } else {
        let Ok(n) = rv_param.parse::<u64>() else {
            return error(400, "BadRequest", &format!("invalid resource version: {rv_param}"));
        };
        let exact = version_match == "Exact" || (version_match.is_empty() && limit.is_some());
        if n > store.rv {
            let mut s = status(
                504,
                "Timeout",
                &format!("Too large resource version: {n}, current: {}", store.rv),
            );
            s["details"] = json!({"causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}], "retryAfterSeconds": 1});
            return respond(504, &s);
        }
        if exact { (n, None) } else { (store.rv, None) }
    };
    if at < store.compacted {
        let s = if cont.is_empty() {
            too_old(at, store.compacted)
        } else {
            status(
                410,
                "Expired",
                "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.",
            )
        };
        return respond(410, &s);
    }
    let objects = store.state_at(filter.resource, at);
    drop(store);
    let mut selected = objects
        .into_iter()
        .filter(|(k, _)| after.as_ref().is_none_or(|(ns, name)| (&k.1, &k.2) > (ns, name)))
        .filter(|(_, v)| filter.matches(v));
    let mut items = Vec::new();
    let mut last: Option<Key> = None;
    for (k, mut v) in selected.by_ref() {
        if limit.is_some_and(|l| items.len() >= l) {
            // One more exists: this page is full.
            last = Some(k);
            break;
        }
        if filter.resource.built_in()
            && let Some(o) = v.as_object_mut()
        {
            o.remove("kind");
            o.remove("apiVersion");
        }
        items.push(v);
    }
    let mut metadata = json!({"resourceVersion": at.to_string()});
    if last.is_some() {
        let end = &items[items.len() - 1]["metadata"];
        let token = encode_continue(
            at,
            end["namespace"].as_str().unwrap_or(""),
            end["name"].as_str().unwrap_or(""),
        );
        metadata["continue"] = token.into();
        if filter.unselective() {
            metadata["remainingItemCount"] = (selected.count() + 1).into();
        }
    }
    respond(
        200,
        &json!({
            "kind": format!("{}List", filter.resource.kind()),
            "apiVersion": filter.resource.api_version(),
            "metadata": metadata,
            "items": items,
        }),
    )
}

fn encode_continue(rv: u64, ns: &str, name: &str) -> String {
    format!("{rv}/{ns}/{name}")
        .bytes()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn decode_continue(token: &str) -> Option<(u64, String, String)> {
    if !token.len().is_multiple_of(2) {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..token.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(token.get(i..i + 2)?, 16).ok())
        .collect();
    let text = String::from_utf8(bytes?).ok()?;
    let mut parts = text.splitn(3, '/');
    let rv = parts.next()?.parse().ok()?;
    Some((rv, parts.next()?.to_owned(), parts.next()?.to_owned()))
}

fn start_watch(shared: &Arc<Shared>, filter: Filter, query: &BTreeMap<String, String>) -> Response<Body> {
    let rv_param = query.get("resourceVersion").map(String::as_str).unwrap_or("");
    let version_match = query.get("resourceVersionMatch").map(String::as_str).unwrap_or("");
    let bookmarks = query.get("allowWatchBookmarks").map(String::as_str) == Some("true");
    let initial = query.get("sendInitialEvents").map(String::as_str);
    // validateWatchOptions.
    let mut invalid = Vec::new();
    if initial.is_some() && version_match != "NotOlderThan" {
        invalid.push(
            "resourceVersionMatch: Forbidden: sendInitialEvents requires setting resourceVersionMatch to NotOlderThan",
        );
    }
    if !version_match.is_empty() {
        if initial.is_none() {
            invalid.push("resourceVersionMatch: Forbidden: resourceVersionMatch is forbidden for watch unless sendInitialEvents is provided");
        }
        if version_match != "NotOlderThan" {
            invalid.push("resourceVersionMatch: Unsupported value: supported values: \"NotOlderThan\"");
        }
    }
    if initial == Some("true") && !bookmarks {
        invalid.push("allowWatchBookmarks: Required value: allowWatchBookmarks must be set to true when sendInitialEvents is true");
    }
    if !invalid.is_empty() {
        return error(
            422,
            "Invalid",
            &format!("ListOptions.meta.k8s.io \"\" is invalid: {}", invalid.join(", ")),
        );
    }
    let timeout = match query.get("timeoutSeconds").map(|t| t.parse::<u64>()) {
        None => None,
        Some(Ok(t)) => Some(Duration::from_secs(t)),
        Some(Err(_)) => return error(400, "BadRequest", "timeoutSeconds: invalid value"),
    };
    let from: Option<u64> = if rv_param.is_empty() || rv_param == "0" {
        None
    } else {
        match rv_param.parse() {
            Ok(n) => Some(n),
            Err(_) => return error(400, "BadRequest", &format!("invalid resource version: {rv_param}")),
        }
    };
    let send_initial = initial == Some("true") || (initial.is_none() && from.is_none());
    let (tx, rx) = mpsc::unbounded_channel();
    let mut store = lock(&shared.store);
    let resource = filter.resource;
    let replay_from = if send_initial {
        // The current state as ADDED (NotOlderThan N: the current state is
        // not older), then, when asked, the end-of-initial-events bookmark.
        for (key, obj) in store.objects.range((resource, String::new(), String::new())..) {
            if key.0 != resource {
                break;
            }
            if filter.matches(obj) {
                let _ = tx.send(Out::Line(event_line("ADDED", obj)));
            }
        }
        if initial == Some("true") {
            let _ = tx.send(Out::Line(event_line("BOOKMARK", &bookmark(resource, store.rv, true))));
        }
        Some(store.rv)
    } else {
        match from {
            Some(n) if n < store.compacted => {
                let _ = tx.send(Out::Line(event_line("ERROR", &too_old(n, store.compacted))));
                let _ = tx.send(Out::End);
                None
            }
            Some(n) => Some(n),
            None => Some(store.rv),
        }
    };
    if let Some(n) = replay_from {
        for change in store.history.iter().filter(|c| c.rv > n) {
            if let Some(line) = filter.event(change) {
                let _ = tx.send(Out::Line(line));
            }
        }
        if let Some(t) = timeout {
            let end = tx.clone();
            tokio::spawn(async move {
                tokio::time::sleep(t).await;
                let _ = end.send(Out::End);
            });
        }
        store.watches.push(Watch {
            resource,
            filter,
            bookmarks,
            tx,
        });
    }
    drop(store);
    Response::builder()
        .status(200)
        .header("content-type", "application/json")
        .body(Body::Watch(rx))
        .unwrap()
}

fn uid(n: u64) -> String {
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

fn labels_map(labels: &[(&str, &str)]) -> Value {
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
    namespace: String,
    name: String,
    ip: Option<String>,
    labels: Vec<(String, String)>,
    annotations: Vec<(String, String)>,
    ready: bool,
    phase: String,
    deleting: bool,
    ports: Vec<(String, u16)>,
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

/// A blocking reader of one watch (or any chunked JSON-lines answer), for
/// tests of code that talks to the stand-in and of the stand-in itself.
pub struct WatchReader {
    /// The status code.
    pub status: u16,
    reader: BufReader<TcpStream>,
    /// Bytes of the current chunk not read yet (`None`: the stream ended).
    left: Option<usize>,
    pending: Vec<u8>,
}

/// What [`WatchReader::next`] read.
#[derive(Debug, PartialEq)]
pub enum Next {
    /// One event (a JSON line).
    Event(Value),
    /// The server ended the stream cleanly (the terminating chunk).
    End,
    /// The connection closed mid-stream, or failed.
    Cut(String),
    /// Nothing within the wait.
    Quiet,
}

impl WatchReader {
    /// `GET path` on `addr` with `token` as a bearer token.
    pub fn open(addr: &str, path: &str, token: Option<&str>) -> Result<WatchReader, String> {
        let mut s = TcpStream::connect(addr).map_err(|e| e.to_string())?;
        let auth = token
            .map(|t| format!("Authorization: Bearer {t}\r\n"))
            .unwrap_or_default();
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Accept: application/json\r\nConnection: close\r\n\r\n"
        )
        .map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut reader = BufReader::new(s);
        let mut line = String::new();
        reader.read_line(&mut line).map_err(|e| e.to_string())?;
        let status = line
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or(format!("status line {line:?}"))?;
        let mut chunked = false;
        loop {
            line.clear();
            reader.read_line(&mut line).map_err(|e| e.to_string())?;
            if line.trim().is_empty() {
                break;
            }
            let l = line.to_ascii_lowercase();
            if l.starts_with("transfer-encoding:") && l.contains("chunked") {
                chunked = true;
            }
        }
        if !chunked {
            return Err(format!("not a chunked answer (status {status})"));
        }
        Ok(WatchReader {
            status,
            reader,
            left: Some(0),
            pending: Vec::new(),
        })
    }

    /// The next event, waiting at most `wait`.
    pub fn next(&mut self, wait: Duration) -> Next {
        let deadline = Instant::now() + wait;
        loop {
            if let Some(nl) = self.pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.pending.drain(..=nl).collect();
                return match serde_json::from_slice(&line) {
                    Ok(v) => Next::Event(v),
                    Err(e) => Next::Cut(format!("not JSON: {e}: {}", String::from_utf8_lossy(&line))),
                };
            }
            let Some(left) = self.left else { return Next::End };
            let now = Instant::now();
            if now >= deadline {
                return Next::Quiet;
            }
            self.reader.get_ref().set_read_timeout(Some(deadline - now)).unwrap();
            match self.step(left) {
                Ok(()) => {}
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    return Next::Quiet;
                }
                Err(e) => {
                    self.left = None;
                    return Next::Cut(e.to_string());
                }
            }
        }
    }

    /// Reads some of the current chunk, or the next chunk's size line.
    fn step(&mut self, left: usize) -> std::io::Result<()> {
        let eof = || std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "connection closed mid-stream");
        if left > 0 {
            let mut buf = vec![0; left.min(8192)];
            let n = self.reader.read(&mut buf)?;
            if n == 0 {
                return Err(eof());
            }
            self.pending.extend_from_slice(&buf[..n]);
            self.left = Some(left - n);
            if left == n {
                let mut crlf = [0; 2];
                self.reader.read_exact(&mut crlf)?;
            }
            return Ok(());
        }
        let mut size = String::new();
        if self.reader.read_line(&mut size)? == 0 {
            return Err(eof());
        }
        let size = usize::from_str_radix(size.trim(), 16)
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("chunk size {size:?}")))?;
        self.left = if size == 0 { None } else { Some(size) };
        Ok(())
    }

    /// The events until `n` are read; panics with what came instead.
    pub fn take(&mut self, n: usize, wait: Duration) -> Vec<Value> {
        let mut out = Vec::new();
        while out.len() < n {
            match self.next(wait) {
                Next::Event(v) => out.push(v),
                other => panic!("expected {n} events, got {out:?} then {other:?}"),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests;
