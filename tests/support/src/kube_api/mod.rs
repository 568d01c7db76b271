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

mod objects;
mod selectors;
mod serve;
mod watch_reader;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use serde_json::Value;
use tokio::sync::mpsc;

pub use objects::*;
use selectors::*;
use serve::*;
pub use watch_reader::*;

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

#[cfg(test)]
mod tests;
