//! One watch followed to sets of endpoints: kube-rs's watcher lists, then
//! watches from the list's resourceVersion (with bookmarks), lists again
//! when the API server says 410 Gone, and backs off on errors
//! ([`backoff`]: 0.5 s doubling to 5 s, plus jitter). Each object's
//! engines are kept by object; after a (re)list is complete and after
//! each change, the whole set is sent if it changed. While the API server cannot be reached nothing is sent, so
//! the backends found last stay.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::time::Duration;

use futures_util::StreamExt;
use kube::runtime::utils::ResetTimerBackoff;
use kube::runtime::watcher::{self, Event, ExponentialBackoff};
use kube::runtime::{WatchStreamExt, watcher as watch_stream};
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::sync::watch;

use super::super::{Endpoint, Endpoints};

/// The wait before a failed watch is tried again: 0.5 s doubling to 5 s,
/// each delay plus a random part of up to as much again (so the gateways
/// of a fleet do not retry in step), back to 0.5 s after a minute without
/// errors. A gateway thus catches up at most 10 s after the API server is
/// back. kube-rs's default (0.8 s doubling to 30 s, the same jitter) could
/// leave it a full minute on endpoints that had changed meanwhile, while
/// one list every few seconds costs the API server nothing it would notice.
pub fn backoff() -> ResetTimerBackoff<ExponentialBackoff> {
    let exponential = backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(500))
        .with_max_delay(Duration::from_secs(5))
        .with_factor(2.0)
        .with_jitter()
        .without_max_times();
    ResetTimerBackoff::new(exponential.into(), Duration::from_secs(60))
}

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
    let mut stream = std::pin::pin!(watch_stream(api, config).backoff(backoff()));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_starts_near_half_a_second_and_never_waits_past_ten() {
        let mut waits = backoff();
        let first = waits.next().expect("a wait");
        assert!(
            first >= Duration::from_millis(500) && first <= Duration::from_secs(1),
            "{first:?}"
        );
        let later: Vec<Duration> = waits.take(50).collect();
        assert_eq!(later.len(), 50, "it never gives up");
        assert!(later.iter().all(|w| *w <= Duration::from_secs(10)), "{later:?}");
        assert!(
            later.iter().any(|w| *w >= Duration::from_secs(5)),
            "it does back off: {later:?}"
        );
    }
}
