//! The stand-in's HTTP side: the accept loop, routing, lists and watches.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::*;

/// Binds `addr` (SO_REUSEADDR) and starts the accept loop on `runtime`.
pub(super) fn listen(
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
pub(super) struct LiveConn(Arc<Shared>);

impl Drop for LiveConn {
    fn drop(&mut self) {
        self.0.live_conns.fetch_sub(1, Ordering::SeqCst);
    }
}

pub(super) fn serve_connection(shared: &Arc<Shared>, stream: tokio::net::TcpStream) {
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
pub(super) enum Body {
    /// A whole body.
    Full(Option<Bytes>),
    /// A watch.
    Watch(mpsc::UnboundedReceiver<Out>),
}

/// The error that cuts a watch's connection.
#[derive(Debug)]
pub(super) struct Cut;

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
pub(super) fn status(code: u16, reason: &str, message: &str) -> Value {
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

pub(super) fn respond(code: u16, body: &Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Body::Full(Some(Bytes::from(body.to_string()))))
        .unwrap()
}

pub(super) fn error(code: u16, reason: &str, message: &str) -> Response<Body> {
    respond(code, &status(code, reason, message))
}

pub(super) fn handle(shared: &Arc<Shared>, req: &Request<Incoming>) -> Response<Body> {
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
pub(super) fn route(path: &str) -> Option<(Resource, Option<String>, Option<String>)> {
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
pub(super) fn parse_query(query: &str) -> BTreeMap<String, String> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (form_decode(k), form_decode(v))
        })
        .collect()
}

pub(super) fn form_decode(s: &str) -> String {
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

pub(super) fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut line = json!({"type": kind, "object": object}).to_string();
    line.push('\n');
    Bytes::from(line)
}

pub(super) fn bookmark(resource: Resource, rv: u64, initial_end: bool) -> Value {
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

pub(super) fn rv_of(obj: &Value) -> u64 {
    obj["metadata"]["resourceVersion"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

pub(super) fn too_old(requested: u64, compacted: u64) -> Value {
    status(
        410,
        "Expired",
        &format!("too old resource version: {requested} ({compacted})"),
    )
}

impl Store {
    /// Keeps `change` and sends it to the watches it concerns (dropping
    /// those whose client is gone).
    pub(super) fn record(&mut self, change: Change) {
        self.watches.retain(|w| match w.filter.event(&change) {
            Some(line) => w.tx.send(Out::Line(line)).is_ok(),
            None => !w.tx.is_closed(),
        });
        self.history.push(change);
    }

    /// The objects of `resource` at version `rv` (≥ the compaction point),
    /// by reverting the history after it.
    pub(super) fn state_at(&self, resource: Resource, rv: u64) -> BTreeMap<Key, Value> {
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

pub(super) fn list(shared: &Arc<Shared>, filter: &Filter, query: &BTreeMap<String, String>) -> Response<Body> {
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

pub(super) fn encode_continue(rv: u64, ns: &str, name: &str) -> String {
    format!("{rv}/{ns}/{name}")
        .bytes()
        .map(|b| format!("{b:02x}"))
        .collect()
}

pub(super) fn decode_continue(token: &str) -> Option<(u64, String, String)> {
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

pub(super) fn start_watch(shared: &Arc<Shared>, filter: Filter, query: &BTreeMap<String, String>) -> Response<Body> {
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
