//! Discovery from a file (`[discovery] kind = "file"`), end to end: a real
//! `semlb serve` follows an endpoints file while clients send requests,
//! and what it serves follows the file (the server table and the admin
//! API say how each backend is managed). Kubernetes discovery is tested in
//! `tests/discovery_kubernetes.rs`.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use semlb_test_support::TempDir;
use semlb_test_support::gateway::{Gateway, chat, routed, sim, sim_with, user, wait_for};
use semlb_test_support::process::{Proc, Stderr};
use serde_json::json;

const TOKEN: &str = "discovery-test-token-0123456789";

/// A file entry for `engine`.
fn entry(engine: &Proc, extra: &str) -> String {
    format!("  - url: http://{}\n{extra}", engine.addr)
}

fn endpoints(entries: &[String]) -> String {
    format!("endpoints:\n{}", entries.concat())
}

/// Writes `text` to `path` the way a deploy tool does: a new file renamed
/// over the old one (the old inode stays with whoever had it open).
fn replace_atomically(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn addresses(engines: &[&Proc]) -> BTreeSet<String> {
    engines.iter().map(|e| format!("http://{}", e.addr)).collect()
}

#[test]
fn the_gateway_serves_what_the_endpoints_file_lists_as_it_changes() {
    let (a, b, c) = (sim(), sim(), sim());
    let dir = TempDir::new("discovery");
    let file = dir.0.join("endpoints.yaml");
    std::fs::write(&file, endpoints(&[entry(&a, ""), entry(&b, "")])).unwrap();
    let gw = Gateway::builder()
        .tag("discovery-file")
        .admin(TOKEN)
        .stderr(Stderr::CaptureEcho)
        .args(&["--discovery", "file", "--discovery-file", file.to_str().unwrap()])
        .config("[discovery]\npoll_ms = 20\n")
        .start();
    gw.wait_discovered(&[&a, &b], "the file's two engines");
    let served = gw.served_by(12, "first");
    assert!(served.is_subset(&addresses(&[&a, &b])), "{served:?}");

    // Changed in place: one engine out, one in.
    std::fs::write(&file, endpoints(&[entry(&b, ""), entry(&c, "")])).unwrap();
    gw.wait_discovered(&[&b, &c], "b and c after the file changed in place");
    let served = gw.served_by(12, "second");
    assert!(served.is_subset(&addresses(&[&b, &c])), "{served:?}");

    // Replaced atomically (rename over it).
    replace_atomically(&file, &endpoints(&[entry(&c, "")]));
    gw.wait_discovered(&[&c], "c alone after an atomic replace");
    assert_eq!(gw.served_by(4, "third"), addresses(&[&c]));

    // A broken file: refused, logged, and the last good set kept.
    let from = gw.proc.stderr_text().len();
    std::fs::write(&file, "endpoints:\n  - url: http://nowhere\n    colour: red\n").unwrap();
    gw.proc.wait_stderr(
        from,
        "is refused, keeping the endpoints found before",
        Duration::from_secs(20),
    );
    assert_eq!(gw.served_by(4, "broken"), addresses(&[&c]));
    // Read again (a new inode, the same broken text): not logged again.
    replace_atomically(&file, "endpoints:\n  - url: http://nowhere\n    colour: red\n");
    // A removed file: logged once too, and the set kept.
    std::fs::remove_file(&file).unwrap();
    gw.proc.wait_stderr(from, "cannot read", Duration::from_secs(20));
    assert_eq!(gw.served_by(4, "missing"), addresses(&[&c]));
    // Fixed: followed again.
    std::fs::write(&file, endpoints(&[entry(&a, ""), entry(&c, "")])).unwrap();
    gw.wait_discovered(&[&a, &c], "a and c once the file is good again");
    let log = gw.proc.stderr_text();
    assert_eq!(
        log[from..].matches("is refused").count(),
        1,
        "the broken file is logged once:\n{}",
        &log[from..]
    );
    assert_eq!(log[from..].matches("cannot read").count(), 1, "{}", &log[from..]);
}

#[test]
fn a_reload_keeps_what_discovery_found_and_discovery_keeps_configured_backends() {
    let (configured, found) = (sim(), sim());
    let dir = TempDir::new("discovery");
    let file = dir.0.join("endpoints.json");
    std::fs::write(
        &file,
        json!({"endpoints": [{"url": format!("http://{}", found.addr)}]}).to_string(),
    )
    .unwrap();
    let gw = Gateway::builder()
        .tag("discovery-reload")
        .admin(TOKEN)
        .stderr(Stderr::CaptureEcho)
        .backends(&[&configured])
        .config(&format!(
            "[discovery]\nkind = \"file\"\npath = {:?}\npoll_ms = 20\n",
            file.to_str().unwrap()
        ))
        .start();
    let managed = |engine: &Proc| {
        gw.admin_server(&format!("http://{}", engine.addr))
            .map(|s| s["managed"].as_str().unwrap().to_owned())
    };
    wait_for("the found engine", Duration::from_secs(20), || {
        (managed(&found).as_deref() == Some("discovery"), managed(&found))
    });
    assert_eq!(managed(&configured).as_deref(), Some("config"));
    // A reload applies the file's (flags') backend list: the found engine stays.
    let from = gw.proc.stderr_text().len();
    gw.proc.signal(nix::sys::signal::Signal::SIGHUP);
    gw.proc.wait_stderr(from, "reloaded:", Duration::from_secs(20));
    assert_eq!(gw.admin_servers().len(), 2);
    assert_eq!(managed(&found).as_deref(), Some("discovery"));
    // An empty file: discovery's engine drains, the configured one stays.
    std::fs::write(&file, "[]").unwrap();
    wait_for("the found engine gone", Duration::from_secs(20), || {
        (managed(&found).is_none(), managed(&found))
    });
    assert_eq!(managed(&configured).as_deref(), Some("config"));
    let r = chat(gw.addr(), &[user("still served")], json!({}), &[]);
    assert_eq!(r.status, 200);
    assert_eq!(routed(&r).0, format!("http://{}", configured.addr));
}

#[test]
fn discovered_engines_serve_the_pool_their_model_names() {
    let (qwen, llama) = (
        sim_with("0.01", &["--model", "qwen"]),
        sim_with("0.01", &["--model", "llama"]),
    );
    let unknown = sim_with("0.01", &["--model", "mistral"]);
    let dir = TempDir::new("discovery");
    let file = dir.0.join("endpoints.yaml");
    std::fs::write(
        &file,
        endpoints(&[
            entry(&qwen, "    model: qwen-chat\n"),
            entry(&llama, "    model: llama\n"),
            entry(&unknown, "    model: mistral\n"),
        ]),
    )
    .unwrap();
    let gw = Gateway::builder()
        .tag("discovery-pools")
        .admin(TOKEN)
        .stderr(Stderr::CaptureEcho)
        .config(&format!(
            "[discovery]\nkind = \"file\"\npath = {:?}\npoll_ms = 20\n\n\
             [[model]]\nname = \"qwen\"\naliases = [\"qwen-chat\"]\n\n[[model]]\nname = \"llama\"\n",
            file.to_str().unwrap()
        ))
        .start();
    gw.wait_discovered(&[&qwen, &llama], "the two engines whose model has a pool");
    gw.proc.wait_stderr(0, "which no [[model]] has", Duration::from_secs(5));
    for (model, engine) in [("qwen", &qwen), ("qwen-chat", &qwen), ("llama", &llama)] {
        let served: BTreeSet<String> = (0..6)
            .map(|i| {
                let r = chat(
                    gw.addr(),
                    &[user(&format!("{model} {i}: a question"))],
                    json!({"model": model}),
                    &[],
                );
                assert_eq!(r.status, 200, "{}", r.text());
                routed(&r).0
            })
            .collect();
        assert_eq!(served, addresses(&[engine]), "model {model}");
    }
    // An engine's model changes (it was redeployed with another; here
    // the file says so): it moves to the other pool.
    std::fs::write(
        &file,
        endpoints(&[entry(&qwen, "    model: llama\n"), entry(&llama, "    model: llama\n")]),
    )
    .unwrap();
    wait_for("qwen's engine in the llama pool", Duration::from_secs(20), || {
        let r = gw.request("GET", "/v1/models", None, &[]).unwrap();
        let live: Vec<(String, u64)> = r.json()["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                (
                    m["id"].as_str().unwrap().to_owned(),
                    m["live_servers"].as_u64().unwrap(),
                )
            })
            .collect();
        let ok = live.contains(&("llama".into(), 2)) && live.contains(&("qwen".into(), 0));
        (ok, live)
    });
    let r = chat(gw.addr(), &[user("no engine left")], json!({"model": "qwen"}), &[]);
    assert_eq!(r.status, 503, "{}", r.text());
}

#[test]
fn a_restart_keeps_serving_what_was_discovered_until_discovery_says_otherwise() {
    let (a, b) = (sim(), sim());
    let dir = TempDir::new("discovery");
    let file = dir.0.join("endpoints.yaml");
    std::fs::write(&file, endpoints(&[entry(&a, "")])).unwrap();
    let config = format!(
        "[discovery]\nkind = \"file\"\npath = {:?}\npoll_ms = 20\n",
        file.to_str().unwrap()
    );
    let first = Gateway::builder()
        .tag("discovery-restart")
        .admin(TOKEN)
        .config(&config)
        .start();
    first.wait_discovered(&[&a], "a");
    let registered = first.listed(&a).expect("a registered").server;
    let shm = first.shm.clone();
    first.stop_keeping_segment();
    // The file is gone when the gateway comes back (as an API server can
    // be): the engine it had is kept, with its registration, and served.
    std::fs::remove_file(&file).unwrap();
    let second = Gateway::builder()
        .tag("discovery-restart")
        .shm(&shm)
        .admin(TOKEN)
        .config(&config)
        .start();
    assert_eq!(second.served_by(4, "after the restart"), addresses(&[&a]));
    assert_eq!(second.listed(&a).expect("a still registered").server, registered);
    // Once discovery says, its set is followed.
    std::fs::write(&file, endpoints(&[entry(&b, "")])).unwrap();
    second.wait_discovered(&[&b], "b once the file is back");
}

/// An endpoints file's `weight` is the engine's share: in turn, an engine
/// of weight 3 takes three requests for every one of an engine of weight
/// 1; a weight changed in the file applies to the engine where it is, and
/// the admin API refuses a weight out of range.
#[test]
fn weights_in_the_endpoints_file_share_the_requests() {
    let (light, heavy) = (sim(), sim());
    let dir = TempDir::new("discovery-weights");
    let file = dir.0.join("endpoints.yaml");
    std::fs::write(
        &file,
        endpoints(&[entry(&light, "    weight: 1\n"), entry(&heavy, "    weight: 3\n")]),
    )
    .unwrap();
    let gw = Gateway::builder()
        .tag("discovery-weights")
        .admin(TOKEN)
        .dispatchers(1)
        .args(&["--policy", "round_robin"])
        .config(&format!(
            "[discovery]\nkind = \"file\"\npath = {:?}\npoll_ms = 20\n",
            file.to_str().unwrap()
        ))
        .start();
    gw.wait_discovered(&[&light, &heavy], "both engines");
    let count = |n: usize, tag: &str| -> (usize, usize) {
        let mut at_heavy = 0;
        for i in 0..n {
            let r = chat(gw.addr(), &[user(&format!("{tag} {i}: a question"))], json!({}), &[]);
            assert_eq!(r.status, 200, "{}", r.text());
            at_heavy += usize::from(routed(&r).0 == format!("http://{}", heavy.addr));
        }
        (n - at_heavy, at_heavy)
    };
    // One dispatcher's turns: 1 then 3, exactly.
    assert_eq!(count(40, "first"), (10, 30));
    // The weights swapped in the file: the same registrations, new weights.
    std::fs::write(
        &file,
        endpoints(&[entry(&light, "    weight: 3\n"), entry(&heavy, "\n")]),
    )
    .unwrap();
    wait_for("the new weights applied", Duration::from_secs(20), || {
        let (l, h) = count(8, "probe");
        (l == 6 && h == 2, (l, h))
    });
    let r = gw.admin(
        "POST",
        "/admin/servers",
        Some(&format!("{{\"url\": \"http://{}\", \"weight\": 0}}", sim().addr)),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("invalid_weight"), "{}", r.text());
}
