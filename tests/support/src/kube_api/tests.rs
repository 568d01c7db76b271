//! Tests of the stand-in itself, over plain HTTP/1.1.

use super::*;
use crate::http::http;
use serde_json::json;
use std::net::TcpStream;
use std::time::UNIX_EPOCH;

const WAIT: Duration = Duration::from_secs(5);
const SHORT: Duration = Duration::from_millis(300);

fn get(api: &KubeApi, path: &str) -> crate::http::Response {
    http(&api.addr, "GET", path, None, &[]).unwrap()
}

fn names(list: &Value) -> Vec<String> {
    list["items"]
        .as_array()
        .unwrap_or_else(|| panic!("no items: {list}"))
        .iter()
        .map(|i| i["metadata"]["name"].as_str().unwrap().to_owned())
        .collect()
}

fn pods_path(query: &str) -> String {
    format!("/api/v1/namespaces/ns/pods?{query}")
}

fn watch(api: &KubeApi, query: &str) -> WatchReader {
    let w = WatchReader::open(&api.addr, &pods_path(query), None).unwrap();
    assert_eq!(w.status, 200);
    w
}

fn event(e: &Value) -> (String, String, String) {
    (
        e["type"].as_str().unwrap().to_owned(),
        e["object"]["metadata"]["name"].as_str().unwrap_or("").to_owned(),
        e["object"]["metadata"]["resourceVersion"]
            .as_str()
            .unwrap_or("")
            .to_owned(),
    )
}

fn ev(kind: &str, name: &str, rv: u64) -> (String, String, String) {
    (kind.to_owned(), name.to_owned(), rv.to_string())
}

/// Three pods in `ns` (a: app=vllm tier=gpu, b: app=vllm, c: app=sglang)
/// and one elsewhere.
fn three_pods(api: &KubeApi) {
    api.apply(
        Resource::Pods,
        pod("ns", "a", "10.0.0.1", &[("app", "vllm"), ("tier", "gpu")], true),
    );
    api.apply(Resource::Pods, pod("ns", "b", "10.0.0.2", &[("app", "vllm")], false));
    api.apply(Resource::Pods, pod("ns", "c", "10.0.0.3", &[("app", "sglang")], true));
    api.apply(Resource::Pods, pod("other", "d", "10.0.0.4", &[("app", "vllm")], true));
}

#[test]
fn lists_filter_by_label_and_field_selectors() {
    let api = KubeApi::start(None);
    three_pods(&api);
    let cases = [
        ("", vec!["a", "b", "c"]),
        ("labelSelector=app%3Dvllm", vec!["a", "b"]),
        ("labelSelector=app%3D%3Dvllm", vec!["a", "b"]),
        ("labelSelector=app%21%3Dvllm", vec!["c"]),
        ("labelSelector=app+in+%28sglang%2Cother%29", vec!["c"]),
        ("labelSelector=app%20notin%20(sglang)", vec!["a", "b"]),
        ("labelSelector=tier", vec!["a"]),
        ("labelSelector=%21tier", vec!["b", "c"]),
        ("labelSelector=app%3Dvllm%2C%21tier", vec!["b"]),
        ("labelSelector=tier%21%3Dgpu", vec!["b", "c"]),
        ("fieldSelector=metadata.name%3Db", vec!["b"]),
        ("fieldSelector=metadata.name%21%3Db", vec!["a", "c"]),
        ("fieldSelector=metadata.namespace%3Dother", vec![]),
    ];
    for (query, want) in cases {
        let r = get(&api, &pods_path(query));
        assert_eq!(r.status, 200, "{query}: {}", r.text());
        let list = r.json();
        assert_eq!(names(&list), want, "{query}");
        assert_eq!(list["kind"], "PodList");
        assert_eq!(list["apiVersion"], "v1");
        assert_eq!(list["metadata"]["resourceVersion"], "4");
    }
    // All namespaces, in key order; built-in list items carry no kind.
    let all = get(&api, "/api/v1/pods?labelSelector=app%3Dvllm").json();
    assert_eq!(names(&all), ["a", "b", "d"]);
    let item = &all["items"][0];
    assert!(item.get("kind").is_none() && item.get("apiVersion").is_none(), "{item}");
    for field in ["uid", "creationTimestamp", "namespace"] {
        assert!(item["metadata"][field].is_string(), "{field}: {item}");
    }
    assert_eq!(item["metadata"]["resourceVersion"], "1");
    // One object; a missing one is a 404 Status.
    let one = get(&api, "/api/v1/namespaces/ns/pods/b").json();
    assert_eq!(
        (one["kind"].as_str(), one["status"]["podIP"].as_str()),
        (Some("Pod"), Some("10.0.0.2"))
    );
    let missing = get(&api, "/api/v1/namespaces/ns/pods/zz");
    assert_eq!(missing.status, 404);
    assert_eq!(missing.json()["reason"], "NotFound");
    assert_eq!(missing.json()["kind"], "Status");
    // Malformed selectors and unsupported fields: 400 Status.
    for query in [
        "labelSelector=app%3D%3D%3Dx",
        "labelSelector=app+in+%28%29",
        "labelSelector=app%2C",
        "labelSelector=-bad%3Dx",
        "labelSelector=app+in+x",
        "fieldSelector=status.phase%3DRunning",
    ] {
        let r = get(&api, &pods_path(query));
        assert_eq!(r.status, 400, "{query}: {}", r.text());
        assert_eq!(
            (r.json()["kind"].as_str(), r.json()["code"].as_u64()),
            (Some("Status"), Some(400))
        );
    }
    // An unknown path is a 404 Status too.
    assert_eq!(get(&api, "/api/v1/namespaces/ns/services").json()["code"], 404);
}

#[test]
fn lists_page_over_one_snapshot_and_read_exact_versions() {
    let api = KubeApi::start(None);
    three_pods(&api);
    // kube's watcher: ?limit=500, everything fits: one page, no continue.
    let page = get(&api, &pods_path("limit=500")).json();
    assert_eq!(names(&page), ["a", "b", "c"]);
    assert!(page["metadata"]["continue"].as_str().unwrap_or("").is_empty(), "{page}");
    // Two pages; a change between them is not in the second one.
    let first = get(&api, &pods_path("limit=2")).json();
    assert_eq!(names(&first), ["a", "b"]);
    assert_eq!(first["metadata"]["remainingItemCount"], 1);
    let token = first["metadata"]["continue"].as_str().unwrap().to_owned();
    api.apply(Resource::Pods, pod("ns", "bb", "10.0.0.9", &[], true));
    api.delete(Resource::Pods, "ns", "c");
    let second = get(&api, &pods_path(&format!("limit=2&continue={token}"))).json();
    assert_eq!(names(&second), ["c"]);
    assert_eq!(second["metadata"]["resourceVersion"], "4");
    assert!(second["metadata"].get("continue").is_none(), "{second}");
    // Exact: the state at version 2; NotOlderThan: the current state.
    let exact = get(&api, &pods_path("resourceVersion=2&resourceVersionMatch=Exact")).json();
    assert_eq!(names(&exact), ["a", "b"]);
    let current = get(&api, &pods_path("resourceVersion=2&resourceVersionMatch=NotOlderThan")).json();
    assert_eq!(names(&current), ["a", "b", "bb"]);
    assert_eq!(current["metadata"]["resourceVersion"], "6");
    assert_eq!(
        names(&get(&api, &pods_path("resourceVersion=0")).json()),
        ["a", "b", "bb"]
    );
    // Options the API server refuses.
    assert_eq!(get(&api, &pods_path("resourceVersionMatch=Exact")).status, 422);
    assert_eq!(
        get(&api, &pods_path("resourceVersion=0&resourceVersionMatch=Exact")).status,
        422
    );
    assert_eq!(get(&api, &pods_path("continue=zz")).status, 400);
    // Compacted: the old version and the old token are gone.
    api.compact();
    let gone = get(&api, &pods_path("resourceVersion=2&resourceVersionMatch=Exact"));
    assert_eq!(gone.status, 410);
    assert_eq!(gone.json()["reason"], "Expired");
    assert_eq!(get(&api, &pods_path(&format!("limit=2&continue={token}"))).status, 410);
}

#[test]
fn a_watch_replays_history_then_streams_live_changes() {
    let api = KubeApi::start(None);
    let rv_a = api.apply(Resource::Pods, pod("ns", "a", "10.0.0.1", &[], true));
    api.apply(Resource::Pods, pod("ns", "b", "10.0.0.2", &[], true));
    api.apply(Resource::Pods, pod("ns", "a", "10.0.0.1", &[], false));
    api.apply(
        Resource::EndpointSlices,
        endpoint_slice("ns", "s", "svc", ("http", 8000), &[]),
    );
    // An apply that changes nothing is no change.
    assert_eq!(api.apply(Resource::Pods, pod("ns", "b", "10.0.0.2", &[], true)), 2);
    // kube's watcher's query.
    let mut w = watch(
        &api,
        &format!("watch=true&timeoutSeconds=290&allowWatchBookmarks=true&resourceVersion={rv_a}"),
    );
    let got: Vec<_> = w.take(2, WAIT).iter().map(event).collect();
    assert_eq!(got, [ev("ADDED", "b", 2), ev("MODIFIED", "a", 3)]);
    api.wait_watching(Resource::Pods, WAIT);
    assert_eq!(api.watching(Resource::EndpointSlices), 0);
    api.delete(Resource::Pods, "ns", "b");
    api.apply(Resource::Pods, pod("other", "x", "10.0.0.3", &[], true));
    api.apply(Resource::Pods, pod("ns", "c", "10.0.0.3", &[], true));
    let got = w.take(2, WAIT);
    assert_eq!(event(&got[0]), ev("DELETED", "b", 5));
    assert_eq!(got[0]["object"]["status"]["podIP"], "10.0.0.2", "the last state");
    assert_eq!(event(&got[1]), ev("ADDED", "c", 7));
    assert_eq!(got[1]["object"]["kind"], "Pod", "watch objects carry their kind");
    assert_eq!(w.next(SHORT), Next::Quiet);
    // Without a resourceVersion: the current state as ADDED first.
    let mut w = watch(&api, "watch=1");
    let got: Vec<_> = w.take(2, WAIT).iter().map(event).collect();
    assert_eq!(got, [ev("ADDED", "a", 3), ev("ADDED", "c", 7)]);
    assert_eq!(w.next(SHORT), Next::Quiet);
}

#[test]
fn label_selector_transitions_are_added_and_deleted() {
    let api = KubeApi::start(None);
    let rv = api.apply(Resource::Pods, pod("ns", "p", "10.0.0.1", &[("app", "other")], true));
    let mut w = watch(
        &api,
        &format!("watch=true&allowWatchBookmarks=true&labelSelector=app%3Dvllm&resourceVersion={rv}"),
    );
    api.wait_watching(Resource::Pods, WAIT);
    api.apply(Resource::Pods, pod("ns", "p", "10.0.0.1", &[("app", "vllm")], true));
    api.apply(Resource::Pods, pod("ns", "p", "10.0.0.1", &[("app", "vllm")], false));
    api.apply(Resource::Pods, pod("ns", "p", "10.0.0.1", &[("app", "gone")], false));
    api.apply(Resource::Pods, pod("ns", "q", "10.0.0.2", &[("app", "other")], false));
    api.delete(Resource::Pods, "ns", "q");
    api.bookmark();
    let got = w.take(4, WAIT);
    let kinds: Vec<_> = got.iter().map(event).collect();
    assert_eq!(
        kinds,
        [
            ev("ADDED", "p", 2),
            ev("MODIFIED", "p", 3),
            ev("DELETED", "p", 4),
            ("BOOKMARK".into(), String::new(), "6".into())
        ]
    );
    // Leaving the selection: the previous content at the change's version.
    assert_eq!(got[2]["object"]["metadata"]["labels"]["app"], "vllm");
}

#[test]
fn bookmarks_go_to_watches_that_asked_and_streaming_lists_end_with_one() {
    let api = KubeApi::start(None);
    api.apply(
        Resource::InferencePools,
        inference_pool("ns", "pool", &[("app", "vllm")], &[8000]),
    );
    let path = Resource::InferencePools.path(Some("ns"));
    let mut with = WatchReader::open(
        &api.addr,
        &format!("{path}?watch=true&allowWatchBookmarks=true&resourceVersion=1"),
        None,
    )
    .unwrap();
    let mut without = WatchReader::open(&api.addr, &format!("{path}?watch=true&resourceVersion=1"), None).unwrap();
    while api.watching(Resource::InferencePools) < 2 {
        std::thread::sleep(Duration::from_millis(5));
    }
    api.bookmark();
    let b = with.take(1, WAIT).remove(0);
    assert_eq!(
        b,
        json!({"type": "BOOKMARK", "object": {"kind": "InferencePool", "apiVersion": "inference.networking.k8s.io/v1", "metadata": {"resourceVersion": "1"}}})
    );
    assert_eq!(without.next(SHORT), Next::Quiet);
    // kube's streaming list.
    let mut s = WatchReader::open(
        &api.addr,
        &format!("{path}?watch=true&timeoutSeconds=290&allowWatchBookmarks=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&resourceVersion=0"),
        None,
    )
    .unwrap();
    let got = s.take(2, WAIT);
    assert_eq!(event(&got[0]), ev("ADDED", "pool", 1));
    assert_eq!(got[0]["object"]["spec"]["endpointPickerRef"]["port"]["number"], 9002);
    assert_eq!(got[1]["type"], "BOOKMARK");
    assert_eq!(
        got[1]["object"]["metadata"]["annotations"]["k8s.io/initial-events-end"],
        "true"
    );
    // The list's items of a custom resource keep their kind.
    let list = get(&api, &path).json();
    assert_eq!(
        (list["kind"].as_str(), list["items"][0]["kind"].as_str()),
        (Some("InferencePoolList"), Some("InferencePool"))
    );
    // sendInitialEvents needs resourceVersionMatch=NotOlderThan; it is not for lists.
    let r = get(
        &api,
        &format!("{path}?watch=true&allowWatchBookmarks=true&sendInitialEvents=true"),
    );
    assert_eq!((r.status, r.json()["reason"].as_str()), (422, Some("Invalid")));
    assert_eq!(get(&api, &format!("{path}?sendInitialEvents=true")).status, 422);
}

#[test]
fn watches_from_before_a_compaction_get_410_gone() {
    let api = KubeApi::start(None);
    api.apply(Resource::Pods, pod("ns", "a", "10.0.0.1", &[], true));
    api.apply(Resource::Pods, pod("ns", "b", "10.0.0.2", &[], true));
    api.compact();
    let mut old = watch(&api, "watch=true&allowWatchBookmarks=true&resourceVersion=1");
    let got = old.take(1, WAIT).remove(0);
    assert_eq!(
        got,
        json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "too old resource version: 1 (2)", "reason": "Expired", "code": 410}})
    );
    assert_eq!(old.next(WAIT), Next::End);
    // From the compaction point on: fine.
    let mut current = watch(&api, "watch=true&resourceVersion=2");
    api.wait_watching(Resource::Pods, WAIT);
    api.apply(Resource::Pods, pod("ns", "c", "10.0.0.3", &[], true));
    assert_eq!(event(&current.take(1, WAIT)[0]), ev("ADDED", "c", 3));
}

#[test]
fn timeout_seconds_ends_a_watch_cleanly_and_drop_watches_cuts_it() {
    let api = KubeApi::start(None);
    let started = Instant::now();
    let mut w = watch(&api, "watch=true&timeoutSeconds=1&resourceVersion=0");
    assert_eq!(w.next(WAIT), Next::End);
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(4),
        "{took:?}"
    );
    let mut w = watch(&api, "watch=true&timeoutSeconds=290&resourceVersion=0");
    api.wait_watching(Resource::Pods, WAIT);
    api.drop_watches();
    match w.next(WAIT) {
        Next::Cut(_) => {}
        other => panic!("expected a cut, got {other:?}"),
    }
    assert_eq!(api.watching(Resource::Pods), 0);
}

#[test]
fn a_token_is_required_when_set() {
    let api = KubeApi::start(Some("s3cret"));
    let path = pods_path("");
    let none = get(&api, &path);
    assert_eq!(none.status, 401);
    assert_eq!(none.json()["reason"], "Unauthorized");
    let wrong = http(&api.addr, "GET", &path, None, &[("Authorization", "Bearer nope")]).unwrap();
    assert_eq!(wrong.status, 401);
    let right = http(&api.addr, "GET", &path, None, &[("Authorization", "Bearer s3cret")]).unwrap();
    assert_eq!(right.status, 200, "{}", right.text());
    assert!(
        right.header("content-length").is_some(),
        "a list has a length: {:?}",
        right.headers
    );
    assert_eq!(right.header("content-type"), Some("application/json"));
    assert!(
        WatchReader::open(&api.addr, &pods_path("watch=true"), None).is_err(),
        "a 401 is no stream"
    );
    let w = WatchReader::open(&api.addr, &pods_path("watch=true"), Some("s3cret")).unwrap();
    assert_eq!(w.status, 200);
    let log: Vec<bool> = api.requests().iter().map(|l| l.authorized).collect();
    assert_eq!(log, [false, false, true, false, true]);
    assert_eq!(
        api.requests()[0],
        Logged {
            method: "GET".into(),
            path: path.clone(),
            authorized: false
        }
    );
    // The kubeconfig names the server, the token and the namespace.
    let dir = crate::TempDir::new("kubeconfig");
    let text = std::fs::read_to_string(api.kubeconfig(&dir.0, "team-a")).unwrap();
    for want in [
        format!("server: http://{}", api.addr),
        "token: s3cret".into(),
        "namespace: team-a".into(),
        "current-context: semlb-test".into(),
    ] {
        assert!(text.contains(&want), "{want} in\n{text}");
    }
}

#[test]
fn away_refuses_connections_and_comes_back_on_the_same_port() {
    let api = KubeApi::start(None);
    api.apply(Resource::Pods, pod("ns", "a", "10.0.0.1", &[], true));
    let mut w = watch(&api, "watch=true&resourceVersion=1");
    api.wait_watching(Resource::Pods, WAIT);
    api.set_away(true);
    match w.next(WAIT) {
        Next::Cut(_) => {}
        other => panic!("expected a cut, got {other:?}"),
    }
    let refused = TcpStream::connect(&api.addr).unwrap_err();
    assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused, "{refused}");
    api.apply(Resource::Pods, pod("ns", "b", "10.0.0.2", &[], true));
    api.set_away(false);
    assert_eq!(names(&get(&api, &pods_path("")).json()), ["a", "b"]);
    // A resumed watch gets what it missed.
    let mut w = watch(&api, "watch=true&resourceVersion=1");
    assert_eq!(event(&w.take(1, WAIT)[0]), ev("ADDED", "b", 2));
}

#[test]
fn label_selectors_parse_as_the_api_server_does() {
    use Requirement::*;
    let s = |k: &str| k.to_owned();
    assert_eq!(parse_label_selector("").unwrap(), []);
    assert_eq!(
        parse_label_selector("a=b, c!=d,e in (f, g),h notin(i),j,!k,l>3, app.kubernetes.io/name==x,m=").unwrap(),
        [
            Eq(s("a"), s("b")),
            NotEq(s("c"), s("d")),
            In(s("e"), vec![s("f"), s("g")]),
            NotIn(s("h"), vec![s("i")]),
            Exists(s("j")),
            NotExists(s("k")),
            Gt(s("l"), 3),
            Eq(s("app.kubernetes.io/name"), s("x")),
            Eq(s("m"), s("")),
        ]
    );
    for bad in [
        "a=b,", ",a", "a===", "a b", "a in b", "a in ()", "a>b", "Bad_/x", "a=b=c", "in=a", "a=(b)",
    ] {
        assert!(parse_label_selector(bad).is_err(), "{bad:?} parsed");
    }
    let labels = json!({"app": "vllm"});
    let m = labels.as_object();
    assert!(NotEq(s("tier"), s("x")).matches(m), "!= matches a missing label");
    assert!(NotIn(s("tier"), vec![s("x")]).matches(m));
    assert!(!In(s("tier"), vec![s("x")]).matches(m));
    assert!(!Exists(s("tier")).matches(None));
}

#[test]
fn builders_make_the_objects_discovery_reads() {
    let p = PodBuilder::new("ns", "p")
        .labels(&[("app", "vllm")])
        .phase("Pending")
        .ready(false)
        .deleting()
        .ports(&[("metrics", 9000)])
        .annotations(&[("semlb.io/model", "m")])
        .build();
    assert!(p["status"].get("podIP").is_none());
    assert_eq!(p["status"]["phase"], "Pending");
    assert!(p["metadata"]["deletionTimestamp"].is_string());
    assert_eq!(
        p["spec"]["containers"][0]["ports"][0],
        json!({"name": "metrics", "containerPort": 9000, "protocol": "TCP"})
    );
    assert_eq!(p["metadata"]["annotations"]["semlb.io/model"], "m");
    let ready = pod("ns", "q", "10.0.0.1", &[], true);
    let cond = ready["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Ready")
        .unwrap()
        .clone();
    assert_eq!(cond["status"], "True");
    let s = endpoint_slice(
        "ns",
        "s",
        "svc",
        ("http", 8000),
        &[("10.0.0.1", true, true, Some("p")), ("10.0.0.2", true, false, None)],
    );
    assert_eq!(s["metadata"]["labels"]["kubernetes.io/service-name"], "svc");
    assert_eq!(
        s["endpoints"][0]["conditions"],
        json!({"ready": false, "serving": true, "terminating": true})
    );
    assert_eq!(s["endpoints"][0]["targetRef"]["name"], "p");
    assert_eq!(s["endpoints"][1]["conditions"]["ready"], true);
    let ip = inference_pool("ns", "pool", &[("app", "vllm")], &[8000, 8001]);
    assert_eq!(ip["spec"]["targetPorts"], json!([{"number": 8000}, {"number": 8001}]));
    assert_eq!(ip["spec"]["selector"]["matchLabels"]["app"], "vllm");
    assert_eq!(
        rfc3339(UNIX_EPOCH + Duration::from_secs(951_782_400 + 3_723)),
        "2000-02-29T01:02:03Z"
    );
}
