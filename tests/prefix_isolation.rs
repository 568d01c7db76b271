//! Tenant-salted prefixes, end to end: keys and `semlb keys limit
//! --isolate-prefixes`, two simulated engines that take vLLM's
//! `cache_salt` (`[[backend]] cache_salt = true`), `cache_aware` routing.
//!
//! The same long prompt, sampled (so never a response-cache hit), sent by
//! tenants in turn, each the instant the last answer ended:
//!
//! * two sharing tenants share its prefix: the second is routed by prefix
//!   to the first one's engine, which finds the prompt cached;
//! * an isolated tenant finds nothing of theirs, neither in the gateway's
//!   prefix table (not routed by prefix) nor in the engine's cache (no
//!   cached tokens, even on the engine that holds the prompt), then finds
//!   its own prefix the next time;
//! * another isolated tenant finds nothing of the first one's.

use semlb_test_support as support;
use serde_json::json;
use support::TempDir;
use support::gateway::{Gateway, add_key, routed, sim, user};
use support::http::{Response, http};
use support::process::{assert_ok, run as semlb};

#[test]
fn isolated_tenants_share_no_prefix_with_anyone() {
    let dir = TempDir::new("isolation");
    let keys_file = dir.0.join("keys.toml").display().to_string();
    let keys: Vec<String> = ["shared-a", "shared-b", "secret-x", "secret-y"]
        .iter()
        .map(|t| add_key(&keys_file, t, &[]).0)
        .collect();
    for tenant in ["secret-x", "secret-y"] {
        assert_ok(&semlb(&[
            "keys",
            "--file",
            &keys_file,
            "limit",
            "--tenant",
            tenant,
            "--isolate-prefixes",
        ]));
    }
    let listed = assert_ok(&semlb(&["keys", "--file", &keys_file, "list"]));
    assert!(listed.contains("isolated"), "{listed}");
    let engines = [sim(), sim()];
    let mut config = String::new();
    for e in &engines {
        config.push_str(&format!(
            "[[backend]]\nurl = \"http://{}\"\ncache_salt = true\n",
            e.addr
        ));
    }
    config.push_str(&format!("[auth]\nkeys_file = \"{keys_file}\"\ndebug_headers = true\n"));
    let gw = Gateway::builder().tag("isolation").config(&config).start();

    let prompt = format!(
        "Review the following design document carefully. {}",
        "The storage layer writes every record twice and checks both copies on read. ".repeat(40)
    );
    let ask = |key: &str| -> Response {
        let body = json!({
            "model": "semlb-sim",
            "messages": [user(&prompt)],
            "max_tokens": 4,
            "temperature": 0.9,
        });
        let r = http(
            gw.addr(),
            "POST",
            "/v1/chat/completions",
            Some(&body),
            &[("api-key", key)],
        )
        .unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        r
    };
    let cached = |r: &Response| {
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    let prompt_tokens = |r: &Response| r.json()["usage"]["prompt_tokens"].as_u64().unwrap();

    let first = ask(&keys[0]);
    let (engine, _) = routed(&first);
    assert_eq!(cached(&first), 0);
    let shared = ask(&keys[1]);
    assert_eq!(
        routed(&shared),
        (engine.clone(), "prefix".to_owned()),
        "shared tenants share"
    );
    assert!(
        cached(&shared) * 2 > prompt_tokens(&shared),
        "{} of {} cached",
        cached(&shared),
        prompt_tokens(&shared)
    );

    let x = ask(&keys[2]);
    assert_ne!(routed(&x).1, "prefix", "nothing of the others' in the table for x");
    assert_eq!(
        cached(&x),
        0,
        "nothing of the others' in {}'s cache for x",
        routed(&x).0
    );
    let x_again = ask(&keys[2]);
    assert_eq!(routed(&x_again), (routed(&x).0, "prefix".to_owned()), "x's own prefix");
    assert!(cached(&x_again) * 2 > prompt_tokens(&x_again), "x finds its own prefix");

    let y = ask(&keys[3]);
    assert_ne!(routed(&y).1, "prefix", "nothing of x's for y");
    assert_eq!(cached(&y), 0);
    // Both engines hold the prompt by now under some salt; the shared
    // tenants still find theirs.
    let back = ask(&keys[0]);
    assert_eq!(routed(&back), (engine, "prefix".to_owned()));
}
