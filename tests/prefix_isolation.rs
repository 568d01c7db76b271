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
//!
//! And the salt reaches engines that are not in the configuration:
//! discovered ones (`[discovery] cache_salt`, an endpoints file's entry
//! saying otherwise) and those the admin API adds.

use semlb_test_support as support;
use serde_json::json;
use support::TempDir;
use support::gateway::{Gateway, add_key, limit_tenant, routed, sample, sim, user, wait_for};
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
        limit_tenant(&keys_file, tenant, &["--isolate-prefixes"]);
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
    let ask = |key: &str| ask(&gw, &prompt, key, 4, 0.9);
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

/// The tokenizer's segment caches are partitioned by tenant for isolated
/// tenants (issue 39: the `tokenize=` time of a prompt said whether any
/// tenant had sent or been answered the same lines). Read off the
/// gateway's own counts of where each segment's ids came from: another
/// isolated tenant's lines, and a sharing tenant's, are never a cache hit
/// for an isolated tenant (every segment is tokenized again), while its
/// own lines are, whichever dispatcher it reaches.
#[test]
fn an_isolated_tenant_never_finds_another_tenants_lines_in_the_tokenizer_caches() {
    let dir = TempDir::new("isolation-segments");
    let keys_file = dir.0.join("keys.toml").display().to_string();
    let keys: Vec<String> = ["open", "secret-x", "secret-y"]
        .iter()
        .map(|t| add_key(&keys_file, t, &[]).0)
        .collect();
    for tenant in ["secret-x", "secret-y"] {
        limit_tenant(&keys_file, tenant, &["--isolate-prefixes"]);
    }
    let engine = sim();
    let gw = Gateway::builder()
        .tag("isolation-segments")
        .dispatchers(2)
        .backends(&[&engine])
        .config(&format!("[auth]\nkeys_file = \"{keys_file}\"\n"))
        .start();
    // Lines long enough to be kept in the segment caches on their own.
    let prompt: String = (0..12)
        .map(|i| {
            format!("Line {i} of the confidential quarterly plan: revenue targets, hiring, and the launch date.\n")
        })
        .collect();
    let segments = |gw: &Gateway| -> (f64, f64) {
        let m = gw.metrics();
        let get =
            |source: &str| sample(&m, &format!("semlb_tokenizer_segments_total{{source=\"{source}\"}}")).unwrap_or(0.0);
        (get("local_cache") + get("shared_store"), get("tokenized"))
    };
    let ask = |key: &str| {
        ask(&gw, &prompt, key, 2, 0.9);
    };
    let delta = |key: &str| {
        let (hits, tokenized) = segments(&gw);
        ask(key);
        let (hits_after, tokenized_after) = segments(&gw);
        (hits_after - hits, tokenized_after - tokenized)
    };
    let (_, x_first) = delta(&keys[1]);
    assert!(x_first >= 12.0, "x's lines were tokenized: {x_first}");
    for (who, key) in [("secret-y", &keys[2]), ("open", &keys[0])] {
        let (hits, tokenized) = delta(key);
        assert_eq!(hits, 0.0, "{who} found x's lines in the tokenizer's caches");
        assert!(tokenized >= 12.0, "{who}: {tokenized} segments tokenized");
    }
    // x's own lines are found again (in either dispatcher's cache or the
    // store both share), as are y's and the open tenant's.
    for key in &keys {
        let (hits, _) = delta(key);
        assert!(hits >= 12.0, "a tenant's own lines are cached: {hits}");
    }
}

/// A tenant's share of the shared tables is bounded (issue 39): with
/// `auth.tenant_share_percent = 1`, a tenant that sends unique prompts of
/// three times 1 % of the prefix table's slots gets no more than 1 % of
/// them learned (plus what the budget refilled meanwhile: 1 % per ten
/// minutes), while another tenant's prompts are still learned and its
/// answers cached.
#[test]
fn a_flooding_tenant_cannot_fill_the_shared_tables() {
    let dir = TempDir::new("share-bound");
    let keys_file = dir.0.join("keys.toml").display().to_string();
    let flood = add_key(&keys_file, "flood", &[]).0;
    let quiet = add_key(&keys_file, "quiet", &[]).0;
    let engine = sim();
    let gw = Gateway::builder()
        .tag("share-bound")
        .shm_size("8MiB")
        .backends(&[&engine])
        .config(&format!(
            "[auth]\nkeys_file = \"{keys_file}\"\ndebug_headers = true\ntenant_share_percent = 1\n"
        ))
        .start();
    let budget = gw.segment.tables().prefix.capacity() / 100;
    let learned = || sample(&gw.metrics(), "semlb_dispatch_learned_blocks_total").unwrap_or(0.0) as u64;
    let ask = |key: &str, text: &str| ask(&gw, text, key, 2, 0.0);
    // Flood: six unique prompts of about half the budget each (a block is
    // 16 tokens; a word of this text is two or three).
    let start = std::time::Instant::now();
    let before = learned();
    for i in 0..6 {
        let text: String = (0..budget * 3).map(|w| format!("f{i}w{w} ")).collect();
        ask(&flood, &text);
    }
    let flooded = learned() - before;
    let refill = budget * start.elapsed().as_millis() as u64 / 600_000 + 1;
    eprintln!("share of {budget} blocks: the flood had {flooded} learned (refill {refill})");
    assert!(flooded > 0, "the flood's first prompts are learned");
    assert!(
        flooded <= budget + refill,
        "{flooded} blocks learned for a tenant whose share is {budget}"
    );
    // The quiet tenant is learned and cached as ever.
    let y = "Quiet's repeated question, deterministic.";
    let before = learned();
    ask(&quiet, &format!("{y} {}", "Some context for the question. ".repeat(20)));
    assert!(learned() > before, "the quiet tenant's prompt is learned");
    support::gateway::wait_for(
        "the quiet tenant's answer cached",
        std::time::Duration::from_secs(20),
        || {
            let c = ask(&quiet, y).header("x-semlb-cache").map(str::to_owned);
            (c.as_deref() == Some("hit"), c)
        },
    );
}

/// Asks `prompt` (a chat, `max_tokens` long at `temperature`) with `key`;
/// the answer, which must be 200.
fn ask(gw: &Gateway, prompt: &str, key: &str, max_tokens: u32, temperature: f64) -> Response {
    let body = json!({
        "model": "semlb-sim",
        "messages": [user(prompt)],
        "max_tokens": max_tokens,
        "temperature": temperature,
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
}

/// The bodies of the inference requests `engine` received.
fn bodies(engine: &support::process::Proc) -> Vec<serde_json::Value> {
    let r = http(&engine.addr, "GET", "/sim/requests", None, &[]).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["requests"]
        .as_array()
        .map(|a| a.iter().map(|r| r["body"].clone()).collect())
        .unwrap_or_default()
}

/// Engines the gateway found or was given at run time take the salt as
/// their registration says: a discovered engine by `[discovery]
/// cache_salt`, one whose endpoints-file entry says `cache_salt: false`
/// not, one added through the admin API by its body's `cache_salt`.
#[test]
fn discovered_and_added_engines_get_the_salt_as_their_registration_says() {
    const TOKEN: &str = "isolation-admin-token-0123456789";
    let dir = TempDir::new("isolation-discovered");
    let keys_file = dir.0.join("keys.toml").display().to_string();
    let (open, _) = add_key(&keys_file, "open", &[]);
    let (secret, _) = add_key(&keys_file, "secret", &[]);
    limit_tenant(&keys_file, "secret", &["--isolate-prefixes"]);
    let (salted, unsalted, added) = (sim(), sim(), sim());
    let file = dir.0.join("endpoints.yaml");
    std::fs::write(
        &file,
        format!(
            "endpoints:\n  - url: http://{}\n  - url: http://{}\n    cache_salt: false\n",
            salted.addr, unsalted.addr
        ),
    )
    .unwrap();
    let gw = Gateway::builder()
        .tag("isolation-discovered")
        .admin(TOKEN)
        .args(&["--policy", "round_robin"])
        .config(&format!(
            "[discovery]\nkind = \"file\"\npath = \"{}\"\npoll_ms = 20\ncache_salt = true\n\
             [auth]\nkeys_file = \"{keys_file}\"\n",
            file.display()
        ))
        .start();
    gw.wait_discovered(&[&salted, &unsalted], "the file's two engines");
    let r = gw.admin(
        "POST",
        "/admin/servers",
        Some(&format!("{{\"url\": \"http://{}\", \"cache_salt\": true}}", added.addr)),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    wait_for("the added engine listed", std::time::Duration::from_secs(10), || {
        let listed = gw.listed(&added).is_some();
        (listed, listed)
    });
    // Round robin: each tenant's requests reach every engine.
    for i in 0..9 {
        for (tenant, key) in [("secret", &secret), ("open", &open)] {
            let prompt = format!("Request {i} of {tenant}: summarise the storage layer's design in one line.");
            ask(&gw, &prompt, key, 2, 0.9);
        }
    }
    for (engine, takes) in [(&salted, true), (&unsalted, false), (&added, true)] {
        let bodies = bodies(engine);
        let mut secrets = 0;
        for body in &bodies {
            let text = body["messages"][0]["content"].as_str().unwrap_or_default();
            let isolated = text.contains(" of secret:");
            secrets += usize::from(isolated);
            let salt = body.get("cache_salt").and_then(|s| s.as_str());
            assert_eq!(
                salt.is_some(),
                isolated && takes,
                "{}: salted iff the isolated tenant's and the engine takes it: {body}",
                engine.addr
            );
            if let Some(salt) = salt {
                assert_eq!(salt.len(), 32, "{salt}");
            }
        }
        assert!(secrets > 0, "round robin sent the isolated tenant to {}", engine.addr);
    }
}
