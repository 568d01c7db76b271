//! One watch followed to sets of endpoints: kube-rs's watcher lists, then
//! watches from the list's resourceVersion (with bookmarks), lists again
//! when the API server says 410 Gone, and backs off on errors (0.8 s
//! doubling to 30 s). Each object's engines are kept by object; after a
//! (re)list is complete and after each change, the whole set is sent if
//! it changed. While the API server cannot be reached nothing is sent, so
//! the backends found last stay.

use std::collections::BTreeMap;
use std::fmt::Debug;

use futures_util::StreamExt;
use kube::runtime::watcher::{self, Event};
use kube::runtime::{WatchStreamExt, watcher as watch_stream};
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::sync::watch;

use super::super::{Endpoint, Endpoints};

/// Follows `api` (objects `config` selects) until every receiver of `tx`
/// is gone, sending the engines `engines` finds in them; `what` names the
/// watch in logs.
pub async fn follow<K>(
    api: Api<K>,
    config: watcher::Config,
    what: String,
    tx: watch::Sender<Option<Endpoints>>,
    engines: impl Fn(&K) -> Vec<Endpoint> + Send,
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let mut stream = std::pin::pin!(watch_stream(api, config).default_backoff());
    let mut by_object: BTreeMap<String, Vec<Endpoint>> = BTreeMap::new();
    let mut relist: Option<BTreeMap<String, Vec<Endpoint>>> = None;
    let mut failing = false;
    while let Some(event) = next_event(&mut stream, &tx, &what, &mut failing).await {
        let complete = match event {
            Event::Init => {
                relist = Some(BTreeMap::new());
                false
            }
            Event::InitApply(object) => {
                if let Some(fresh) = relist.as_mut() {
                    fresh.insert(key(&object), engines(&object));
                }
                false
            }
            Event::InitDone => {
                by_object = relist.take().unwrap_or_default();
                true
            }
            Event::Apply(object) => {
                by_object.insert(key(&object), engines(&object));
                relist.is_none()
            }
            Event::Delete(object) => {
                by_object.remove(&key(&object));
                relist.is_none()
            }
        };
        if complete {
            send(&tx, &by_object, &what);
        }
    }
}

/// The watch's next event, until every receiver of `tx` is gone (`None`).
/// Errors (the watcher retries them, backing off) are logged once until
/// an event comes again; `failing` says whether the last was one.
pub async fn next_event<K, S>(
    stream: &mut std::pin::Pin<&mut S>,
    tx: &watch::Sender<Option<Endpoints>>,
    what: &str,
    failing: &mut bool,
) -> Option<Event<K>>
where
    S: futures_util::Stream<Item = Result<Event<K>, watcher::Error>>,
{
    loop {
        let next = tokio::select! {
            next = stream.next() => next?,
            () = tx.closed() => return None,
        };
        match next {
            Ok(event) => {
                if std::mem::take(failing) {
                    tracing::info!(watch = %what, "discovery: watching {what} again");
                }
                return Some(event);
            }
            Err(e) => {
                if !std::mem::replace(failing, true) {
                    tracing::warn!(watch = %what, "discovery: watching {what} failed: {e}; keeping the endpoints found before and retrying");
                }
            }
        }
    }
}

/// An object's key: namespace and name.
fn key<K: Resource>(object: &K) -> String {
    format!("{}/{}", object.namespace().unwrap_or_default(), object.name_any())
}

/// Sends the set (sorted by URL, each URL once) if it changed.
fn send(tx: &watch::Sender<Option<Endpoints>>, by_object: &BTreeMap<String, Vec<Endpoint>>, what: &str) {
    let mut set: Vec<Endpoint> = by_object.values().flatten().cloned().collect();
    set.sort_by(|a, b| a.url.cmp(&b.url));
    set.dedup_by(|a, b| a.url == b.url);
    tx.send_if_modified(|current| {
        if current.as_deref() == Some(&set) {
            return false;
        }
        tracing::debug!(watch = %what, engines = set.len(), "discovery: {what} lists {} engines", set.len());
        *current = Some(std::sync::Arc::new(set));
        true
    });
}
