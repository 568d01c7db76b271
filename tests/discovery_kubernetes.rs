//! Kubernetes discovery, end to end: a real `semlb serve` with kube-rs
//! watches a stand-in of the Kubernetes API server
//! (`semlb_test_support::kube_api`: the list and watch wire format, with
//! resourceVersions, bookmarks, 410 Gone and dropped connections; no API
//! server can run here), and the engines it serves follow the Pods,
//! EndpointSlices and InferencePool there, while clients send requests.
//! The engines are simulators on loopback; a Pod's IP and named port say
//! where one listens.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use semlb_test_support::TempDir;
use semlb_test_support::gateway::{Gateway, sim_on};
use semlb_test_support::kube_api::{KubeApi, PodBuilder, Resource, endpoint_slice, inference_pool};
use semlb_test_support::process::{Proc, Stderr};

const TOKEN: &str = "discovery-kubernetes-admin-token";
const NS: &str = "llm";

fn addresses(engines: &[&Proc]) -> BTreeSet<String> {
    engines.iter().map(|e| format!("http://{}", e.addr)).collect()
}

/// `engine`'s host and port.
fn host_port(engine: &Proc) -> (&str, u16) {
    let (host, port) = engine.addr.rsplit_once(':').unwrap();
    (host, port.parse().unwrap())
}

/// A Pod for `engine` (its IP and its port, named `http`).
fn pod_of(name: &str, engine: &Proc, labels: &[(&str, &str)]) -> PodBuilder {
    let (ip, port) = host_port(engine);
    PodBuilder::new(NS, name).ip(ip).labels(labels).ports(&[("http", port)])
}

/// A gateway following the stand-in with `[discovery]` `settings`.
fn gateway(api: &KubeApi, dir: &TempDir, tag: &str, settings: &str) -> Gateway {
    let kubeconfig = api.kubeconfig(&dir.0, NS);
    Gateway::builder()
        .tag(tag)
        .admin(TOKEN)
        .stderr(Stderr::CaptureEcho)
        .config(&format!(
            "[discovery]\n{settings}\nkubeconfig = {:?}\n",
            kubeconfig.to_str().unwrap()
        ))
        .start()
}

#[test]
fn pods_are_served_while_running_and_ready_and_drained_when_deleted() {
    let api = KubeApi::start(Some("kube-token-of-the-test"));
    let (a, b, c, other) = (
        sim_on("127.0.0.1:0", "0.01"),
        sim_on("127.0.0.1:0", "0.01"),
        sim_on("127.0.0.1:0", "0.01"),
        sim_on("127.0.0.1:0", "0.01"),
    );
    let vllm = [("app", "vllm")];
    api.apply(Resource::Pods, pod_of("a", &a, &vllm).build());
    api.apply(Resource::Pods, pod_of("b", &b, &vllm).ready(false).build());
    api.apply(Resource::Pods, pod_of("other", &other, &[("app", "sglang")]).build());
    let dir = TempDir::new("kube");
    let gw = gateway(
        &api,
        &dir,
        "kube-pods",
        "kind = \"kubernetes\"\nselector = \"app=vllm\"\nport_name = \"http\"",
    );
    gw.wait_discovered(&[&a], "the one ready Pod of the selector");
    assert_eq!(gw.served_by(6, "a"), addresses(&[&a]));
    // Named after its Pod.
    assert_eq!(gw.admin_server(&format!("http://{}", a.addr)).unwrap()["name"], "a");

    api.apply(Resource::Pods, pod_of("b", &b, &vllm).build());
    gw.wait_discovered(&[&a, &b], "b once ready");
    api.apply(Resource::Pods, pod_of("c", &c, &vllm).phase("Pending").build());
    api.apply(Resource::Pods, pod_of("a", &a, &vllm).deleting().build());
    gw.wait_discovered(&[&b], "a drained once being deleted; c still pending");
    api.delete(Resource::Pods, NS, "a");
    api.apply(Resource::Pods, pod_of("c", &c, &vllm).build());
    gw.wait_discovered(&[&b, &c], "c once running");
    api.apply(Resource::Pods, pod_of("b", &b, &vllm).ready(false).build());
    gw.wait_discovered(&[&c], "b out once unready");
    assert_eq!(gw.served_by(6, "c"), addresses(&[&c]));
    // A Pod relabelled out of the selector leaves; back in, it returns.
    api.apply(Resource::Pods, pod_of("c", &c, &[("app", "retired")]).build());
    api.apply(Resource::Pods, pod_of("b", &b, &vllm).build());
    gw.wait_discovered(&[&b], "c relabelled away");

    // Every request carried the service account's token, and the watch
    // was a list, then a watch from its resourceVersion with bookmarks.
    let requests = api.requests();
    assert!(requests.iter().all(|r| r.authorized), "{requests:?}");
    let pods: Vec<_> = requests
        .iter()
        .filter(|r| r.path.contains("/api/v1/namespaces/llm/pods"))
        .collect();
    assert!(!pods[0].path.contains("watch=true"), "a list first: {pods:?}");
    assert!(pods[0].path.contains("labelSelector=app%3Dvllm"), "{pods:?}");
    let watch = pods.iter().find(|r| r.path.contains("watch=true")).expect("a watch");
    assert!(
        watch.path.contains("resourceVersion=") && watch.path.contains("allowWatchBookmarks=true"),
        "{watch:?}"
    );
}

#[test]
fn an_expired_watch_lists_again_and_a_dropped_one_resumes() {
    let api = KubeApi::start(None);
    let engines: Vec<Proc> = (0..4).map(|_| sim_on("127.0.0.1:0", "0.01")).collect();
    let vllm = [("app", "vllm")];
    api.apply(Resource::Pods, pod_of("p0", &engines[0], &vllm).build());
    let dir = TempDir::new("kube");
    let gw = gateway(
        &api,
        &dir,
        "kube-expiry",
        "kind = \"kubernetes\"\nselector = \"app=vllm\"\nport_name = \"http\"",
    );
    gw.wait_discovered(&[&engines[0]], "p0");
    api.wait_watching(Resource::Pods, Duration::from_secs(10));

    // The connection drops: the watch resumes from where it was.
    api.drop_watches();
    api.apply(Resource::Pods, pod_of("p1", &engines[1], &vllm).build());
    gw.wait_discovered(&[&engines[0], &engines[1]], "p1 after a dropped watch");

    // The watch is cut and, while the API server is away, history moves
    // on and is compacted: resuming from its resourceVersion gets 410
    // Gone, so it lists again, and sees the changes made meanwhile (p0
    // gone, p2 new) from the list.
    let lists_before = lists(&api);
    api.set_away(true);
    api.delete(Resource::Pods, NS, "p0");
    api.apply(Resource::Pods, pod_of("p2", &engines[2], &vllm).build());
    api.compact();
    api.set_away(false);
    gw.wait_discovered(&[&engines[1], &engines[2]], "the set after a 410 and a new list");
    assert!(lists(&api) > lists_before, "listed again after 410 Gone");

    // A bookmark moves the watch's resourceVersion on without a change.
    api.bookmark();
    api.apply(Resource::Pods, pod_of("p3", &engines[3], &vllm).build());
    gw.wait_discovered(&[&engines[1], &engines[2], &engines[3]], "p3 after a bookmark");
}

/// Lists of Pods the stand-in served.
fn lists(api: &KubeApi) -> usize {
    api.requests()
        .iter()
        .filter(|r| r.path.contains("/pods") && !r.path.contains("watch=true"))
        .count()
}

#[test]
fn the_api_server_away_for_a_minute_leaves_the_backends_serving() {
    let api = KubeApi::start(None);
    let (a, b) = (sim_on("127.0.0.1:0", "0.01"), sim_on("127.0.0.1:0", "0.01"));
    let vllm = [("app", "vllm")];
    api.apply(Resource::Pods, pod_of("a", &a, &vllm).build());
    api.apply(Resource::Pods, pod_of("b", &b, &vllm).build());
    let dir = TempDir::new("kube");
    let gw = gateway(
        &api,
        &dir,
        "kube-away",
        "kind = \"kubernetes\"\nselector = \"app=vllm\"\nport_name = \"http\"",
    );
    gw.wait_discovered(&[&a, &b], "both Pods");
    api.wait_watching(Resource::Pods, Duration::from_secs(10));
    let from = gw.proc.stderr_text().len();
    api.set_away(true);
    // A minute without the API server (the figure): the watcher
    // retries, backing off to its cap (5 s plus jitter) after four tries;
    // the backends stay and clients are served by both throughout.
    let until = Instant::now() + Duration::from_secs(60);
    let mut served = BTreeSet::new();
    let mut round = 0;
    while Instant::now() < until {
        served.extend(gw.served_by(2, &format!("away {round}")));
        round += 1;
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(served, addresses(&[&a, &b]));
    gw.proc.wait_stderr(from, "failed", Duration::from_secs(1));
    // Meanwhile a was deleted; back, the gateway catches up.
    api.delete(Resource::Pods, NS, "a");
    api.set_away(false);
    gw.wait_discovered(&[&b], "b alone once the API server is back");
}

#[test]
fn a_service_s_endpoint_slices_are_followed() {
    let api = KubeApi::start(None);
    let (a, b, c) = (
        sim_on("127.0.0.1:0", "0.01"),
        sim_on("127.0.0.1:0", "0.01"),
        sim_on("127.0.0.1:0", "0.01"),
    );
    // One slice per engine: each listens on its own port here (a slice
    // groups the endpoints that share a port set).
    let slice = |name: &str, e: &Proc, ready: bool, terminating: bool| {
        let (ip, port) = host_port(e);
        endpoint_slice(
            NS,
            name,
            "vllm",
            ("http", port),
            &[(ip, ready, terminating, Some(name))],
        )
    };
    api.apply(Resource::EndpointSlices, slice("vllm-a", &a, true, false));
    api.apply(Resource::EndpointSlices, slice("vllm-b", &b, false, false));
    api.apply(Resource::EndpointSlices, slice("vllm-c", &c, true, true));
    let (_, other_port) = host_port(&c);
    api.apply(
        Resource::EndpointSlices,
        endpoint_slice(
            NS,
            "web-x",
            "web",
            ("http", other_port),
            &[("127.0.0.1", true, false, None)],
        ),
    );
    let dir = TempDir::new("kube");
    let gw = gateway(
        &api,
        &dir,
        "kube-slices",
        "kind = \"kubernetes\"\nservice = \"vllm\"\nport_name = \"http\"",
    );
    gw.wait_discovered(
        &[&a],
        "the ready endpoint, not the unready or terminating ones, nor another Service's",
    );
    api.apply(Resource::EndpointSlices, slice("vllm-b", &b, true, false));
    gw.wait_discovered(&[&a, &b], "b once ready");
    api.apply(Resource::EndpointSlices, slice("vllm-a", &a, true, true));
    gw.wait_discovered(&[&b], "a drained once terminating");
    api.delete(Resource::EndpointSlices, NS, "vllm-c");
    assert_eq!(gw.served_by(4, "slices"), addresses(&[&b]));
}

#[test]
fn an_inference_pool_s_pods_are_followed_on_its_target_port() {
    let api = KubeApi::start(None);
    // An InferencePool has one target port for all its Pods: the engines
    // listen on the same port at different loopback addresses.
    let a = sim_on("127.0.0.2:0", "0.01");
    let (_, port) = host_port(&a);
    let b = sim_on(&format!("127.0.0.3:{port}"), "0.01");
    let c = sim_on(&format!("127.0.0.4:{port}"), "0.01");
    let pod = |name: &str, e: &Proc, labels: &[(&str, &str)]| {
        PodBuilder::new(NS, name).ip(host_port(e).0).labels(labels).build()
    };
    api.apply(Resource::Pods, pod("a", &a, &[("app", "vllm"), ("pool", "one")]));
    api.apply(Resource::Pods, pod("b", &b, &[("app", "vllm"), ("pool", "two")]));
    api.apply(Resource::Pods, pod("c", &c, &[("app", "sglang"), ("pool", "one")]));
    api.apply(
        Resource::InferencePools,
        inference_pool(NS, "vllm", &[("app", "vllm")], &[port]),
    );
    let dir = TempDir::new("kube");
    let gw = gateway(
        &api,
        &dir,
        "kube-pool",
        "kind = \"inference-pool\"\ninference_pool = \"vllm\"",
    );
    gw.wait_discovered(&[&a, &b], "the pool's Pods on its target port");
    assert_eq!(gw.served_by(8, "pool"), addresses(&[&a, &b]));
    // Its selector changes: the Pods it selects now.
    api.apply(
        Resource::InferencePools,
        inference_pool(NS, "vllm", &[("pool", "one")], &[port]),
    );
    gw.wait_discovered(&[&a, &c], "the Pods of the new selector");
    // Deleted: its engines drain.
    api.delete(Resource::InferencePools, NS, "vllm");
    gw.wait_discovered(&[], "nothing once the pool is deleted");
}

/// Whether this machine lets a process make a user and mount namespace
/// and mount a tmpfs on `/run` in it (what the in-cluster test needs to
/// put a service account where kube-rs reads it).
fn mount_namespaces_work() -> bool {
    std::process::Command::new("unshare")
        .args(["-rm", "sh", "-c", "mount -t tmpfs tmpfs /run && mkdir -p /run/secrets"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A TLS front for `upstream` (the stand-in speaks plain HTTP) with
/// `server`'s certificate, as the API server presents one of the
/// cluster's CA: its port (it serves while the runtime lives).
fn tls_front(server: &semlb_test_support::tls::CertFiles, upstream: String) -> (tokio::runtime::Runtime, u16) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let acceptor = semlb::tls::server::acceptor(&semlb::config::ListenerTls {
        cert_file: server.cert.clone(),
        key_file: server.key.clone(),
        client_ca_file: None,
    })
    .expect("a TLS acceptor");
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let port = listener.local_addr().unwrap().port();
    rt.spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, upstream) = (acceptor.clone(), upstream.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let Ok(mut plain) = tokio::net::TcpStream::connect(&upstream).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
            });
        }
    });
    (rt, port)
}

/// In a Pod: no kubeconfig, the `kubernetes` Service's address in
/// `KUBERNETES_SERVICE_HOST` / `_PORT`, and the Pod's service account
/// (token, the cluster's CA, namespace) mounted at
/// `/var/run/secrets/kubernetes.io/serviceaccount`. Played here by
/// running `semlb` in a mount namespace of its own (`unshare -rm`, a tmpfs
/// on `/run`) with those files, against the stand-in behind TLS with a
/// certificate of that CA. The Pods of the service account's namespace
/// are found, and every request carried its token. A machine that does
/// not let a process make the namespaces (some container runtimes) skips
/// the test, saying so.
#[test]
fn in_a_pod_the_service_account_is_used() {
    const SA_TOKEN: &str = "service-account-token-of-the-pod";
    if !mount_namespaces_work() {
        eprintln!("skipped: this machine does not let a process make a mount namespace (unshare -rm)");
        return;
    }
    let api = KubeApi::start(Some(SA_TOKEN));
    let dir = TempDir::new("kube-in-cluster");
    let ca = semlb_test_support::tls::ca(&dir.0, "cluster-ca");
    let server = semlb_test_support::tls::signed(&dir.0, &ca, "apiserver");
    let upstream = api.url().trim_start_matches("http://").to_owned();
    let (_front, port) = tls_front(&server, upstream);
    let sa = dir.0.join("serviceaccount");
    std::fs::create_dir(&sa).unwrap();
    std::fs::write(sa.join("token"), SA_TOKEN).unwrap();
    std::fs::copy(&ca.cert, sa.join("ca.crt")).unwrap();
    std::fs::write(sa.join("namespace"), NS).unwrap();
    let engine = sim_on("127.0.0.1:0", "0.01");
    api.apply(Resource::Pods, pod_of("a", &engine, &[("app", "vllm")]).build());
    let home = dir.0.join("home");
    std::fs::create_dir(&home).unwrap();
    let script = "set -e; mount -t tmpfs tmpfs /run; \
                  mkdir -p /run/secrets/kubernetes.io/serviceaccount; \
                  cp \"$SA\"/token \"$SA\"/ca.crt \"$SA\"/namespace /run/secrets/kubernetes.io/serviceaccount/; \
                  exec \"$@\"";
    let gw = Gateway::builder()
        .tag("kube-in-cluster")
        .admin(TOKEN)
        .stderr(Stderr::CaptureEcho)
        .wrapped("unshare", &["-rm", "sh", "-c", script, "sh"])
        .env("SA", sa.to_str().unwrap())
        .env("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        .env("KUBERNETES_SERVICE_PORT", &port.to_string())
        .env("HOME", home.to_str().unwrap())
        .env("KUBECONFIG", "")
        .config("[discovery]\nkind = \"kubernetes\"\nselector = \"app=vllm\"\nport_name = \"http\"\n")
        .start();
    gw.wait_discovered(&[&engine], "the Pod of the service account's namespace");
    assert_eq!(gw.served_by(4, "in-cluster"), addresses(&[&engine]));
    let requests = api.requests();
    assert!(!requests.is_empty());
    assert!(requests.iter().all(|r| r.authorized), "{requests:?}");
    assert!(
        requests.iter().all(|r| r.path.contains("/api/v1/namespaces/llm/pods")),
        "{requests:?}"
    );
}
