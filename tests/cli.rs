//! End-to-end tests of the `semlb` binary: `shm create / inspect / remove`
//! and `demo`, run as a user would run them, against real POSIX shared
//! memory. Every test uses its own segment name (test name + pid) and a
//! guard that removes the segment however the test ends.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Command, Output};

use semlb_test_support::process::{assert_ok, run as semlb, stderr, stdout};
use shm_layout::Segment;

/// A unique segment name for one test, removed on drop.
struct TestSegment {
    name: String,
}

impl TestSegment {
    fn new(test: &str) -> Self {
        let name = format!("semlb-test-cli-{test}-{}", std::process::id());
        // A leftover of an earlier run with the same pid would confuse the test.
        let _ = Segment::remove(&name);
        Self { name }
    }

    fn path(&self) -> PathBuf {
        PathBuf::from("/dev/shm").join(&self.name)
    }
}

impl Drop for TestSegment {
    fn drop(&mut self) {
        let _ = Segment::remove(&self.name);
    }
}

/// Asserts a non-zero exit whose stderr contains every one of `needles`.
#[track_caller]
fn assert_fails_with(o: &Output, needles: &[&str]) {
    assert!(
        !o.status.success(),
        "expected failure, got success\nstdout:\n{}",
        stdout(o)
    );
    let err = stderr(o);
    for needle in needles {
        assert!(err.contains(needle), "stderr lacks {needle:?}:\n{err}");
    }
    assert!(!err.contains("panicked"), "the binary panicked:\n{err}");
}

#[test]
fn shm_create_inspect_remove_life_cycle() {
    let seg = TestSegment::new("life");
    let name = seg.name.as_str();

    let out = assert_ok(&semlb(&["shm", "create", "--shm-name", name, "--shm-size", "16MiB"]));
    assert!(
        out.starts_with(&format!("created shm segment /{name} (16 MiB)")),
        "{out}"
    );
    assert_eq!(out.lines().count(), 1, "one-line summary: {out}");
    let meta = std::fs::metadata(seg.path()).expect("the segment file exists");
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    assert_eq!(meta.len(), 16 << 20);

    let out = assert_ok(&semlb(&["shm", "inspect", "--shm-name", name]));
    for needle in [
        "magic           ok",
        "state           ready",
        "size            16777216 bytes (16 MiB)",
        // The creator (the `shm create` process) has exited by now.
        "(not running)",
        "prefix table      0 /",
        "servers           0",
        "processes         0",
    ] {
        assert!(out.contains(needle), "{needle:?} missing from inspect:\n{out}");
    }
    for region in [
        "servers",
        "in-flight ledger",
        "process registry",
        "completion rings",
        "response index",
        "response log",
        "segment index",
        "segment log",
        "prefix table",
        "rate limits",
    ] {
        assert!(
            out.contains(&format!("\n  {region} ")),
            "region {region:?} missing from inspect:\n{out}"
        );
    }

    let json = assert_ok(&semlb(&["shm", "inspect", "--shm-name", name, "--json"]));
    let v: serde_json::Value = serde_json::from_str(&json).expect("inspect --json prints JSON");
    assert_eq!(v["name"], format!("/{name}"));
    assert_eq!(v["header"]["state"], "ready");
    assert_eq!(v["header"]["magic_ok"], true);
    assert_eq!(v["header"]["segment_bytes"], 16u64 << 20);
    assert_eq!(v["regions"].as_array().map(Vec::len), Some(13));
    assert_eq!(v["rate_limits"]["capacity"], 16_384);
    assert_eq!(v["rate_limits"]["in_use"], 0);
    assert_eq!(v["segment_store"]["records"], 0);
    assert_eq!(v["completion_rings"]["count"], 64);

    assert_fails_with(
        &semlb(&["shm", "create", "--shm-name", name, "--shm-size", "16MiB"]),
        &["error:", "already exists", name],
    );
    assert!(
        seg.path().exists(),
        "a failed create must not remove the existing segment"
    );

    assert_ok(&semlb(&["shm", "remove", "--shm-name", name]));
    assert!(!seg.path().exists());
    assert_fails_with(
        &semlb(&["shm", "inspect", "--shm-name", name]),
        &["does not exist", name],
    );
    assert_fails_with(
        &semlb(&["shm", "remove", "--shm-name", name]),
        &["does not exist", name],
    );
}

#[test]
fn bad_sizes_are_refused_with_clear_messages() {
    let seg = TestSegment::new("sizes");
    let name = seg.name.as_str();
    let o = semlb(&["shm", "create", "--shm-name", name, "--shm-size", "12XB"]);
    assert_fails_with(&o, &["12XB", "unknown unit"]);
    assert_eq!(o.status.code(), Some(2), "a usage error");
    assert_fails_with(
        &semlb(&["shm", "create", "--shm-name", name, "--shm-size", "1MiB"]),
        &["error:", "1 MiB", "too small"],
    );
    assert_fails_with(
        &semlb(&[
            "shm",
            "create",
            "--shm-name",
            name,
            "--shm-size",
            "16MiB",
            "--max-response-fraction",
            "0.9",
        ]),
        &["error:", "0.9", "out of range"],
    );
    assert!(!seg.path().exists(), "refused sizes create nothing");
}

#[test]
fn bad_names_are_refused() {
    assert_fails_with(
        &semlb(&["shm", "inspect", "--shm-name", "a/b"]),
        &["invalid shm name", "a/b"],
    );
    assert_fails_with(
        &semlb(&["shm", "create", "--shm-name", ""]),
        &["invalid shm name", "empty"],
    );
}

#[test]
fn demo_routes_hits_the_response_cache_and_cleans_up() {
    let seg = TestSegment::new("demo");
    let out = assert_ok(&semlb(&["demo", "--shm-name", &seg.name]));
    assert!(out.contains("response-cache hit"), "{out}");
    assert!(out.contains("(prefix)"), "some turn follows its prefix:\n{out}");
    assert!(
        out.contains("fewest in flight"),
        "some turn goes to the least-loaded server:\n{out}"
    );
    assert!(
        out.contains("state           ready"),
        "the demo ends with the inspect report:\n{out}"
    );
    assert!(out.contains("servers           4"), "{out}");
    assert!(out.contains(&format!("removed shm segment /{}", seg.name)), "{out}");
    assert!(!seg.path().exists(), "the demo removes its segment");
}

/// The routing log: from the "routing" line to the inspect report.
fn routing_log(out: &str) -> Vec<&str> {
    out.lines()
        .skip_while(|l| !l.starts_with("routing"))
        .take_while(|l| !l.starts_with("--- semlb shm inspect"))
        .collect()
}

#[test]
fn demo_is_deterministic() {
    let (a, b) = (TestSegment::new("det-a"), TestSegment::new("det-b"));
    let run_a = assert_ok(&semlb(&["demo", "--shm-name", &a.name]));
    let run_b = assert_ok(&semlb(&["demo", "--shm-name", &b.name, "--shm-size", "32MiB"]));
    let (log_a, log_b) = (routing_log(&run_a), routing_log(&run_b));
    assert!(log_a.len() > 10, "{run_a}");
    assert_eq!(log_a, log_b);
}

#[test]
fn demo_never_removes_a_segment_it_did_not_create() {
    let seg = TestSegment::new("demo-taken");
    assert_ok(&semlb(&[
        "shm",
        "create",
        "--shm-name",
        &seg.name,
        "--shm-size",
        "8MiB",
    ]));
    assert_fails_with(
        &semlb(&["demo", "--shm-name", &seg.name]),
        &["error:", "already exists"],
    );
    assert!(seg.path().exists(), "the existing segment survives the failed demo");
}

#[test]
fn demo_with_a_too_small_segment_fails_cleanly() {
    let seg = TestSegment::new("demo-small");
    assert_fails_with(
        &semlb(&["demo", "--shm-name", &seg.name, "--shm-size", "4MiB"]),
        &["error:", "too small"],
    );
    assert!(!seg.path().exists());
}

#[test]
fn status_prints_snapshots_of_a_segment() {
    let seg = TestSegment::new("status");
    assert_ok(&semlb(&[
        "shm",
        "create",
        "--shm-name",
        &seg.name,
        "--shm-size",
        "8MiB",
    ]));
    let once = assert_ok(&semlb(&["status", "--shm-name", &seg.name, "--once"]));
    assert_eq!(once.matches("semlb status").count(), 1, "{once}");
    for section in ["prefix table   0 of", "SLOT SERVER", "SLOT ROLE"] {
        assert!(once.contains(section), "{section:?} missing:\n{once}");
    }
    let frames = assert_ok(&semlb(&[
        "status",
        "--shm-name",
        &seg.name,
        "--iterations",
        "2",
        "--interval",
        "0.05",
    ]));
    assert_eq!(frames.matches("semlb status").count(), 2, "{frames}");
    assert!(frames.contains("0.0 req/s"), "the second frame has a rate:\n{frames}");
    let missing = semlb(&["status", "--shm-name", "semlb-test-cli-no-such-segment", "--once"]);
    assert_fails_with(&missing, &["cannot attach", "semlb-test-cli-no-such-segment"]);
}

/// `semlb tokenize` on its own: a text and a request body with the
/// bundled tokenizer (GPT-2's ids), the chat rendering the gateway uses,
/// its JSON, `--jsonl`, and a body the gateway would refuse.
#[test]
fn tokenize_shows_what_the_gateway_sees() {
    let text = assert_ok(&semlb(&["tokenize", "--json", "Hello, world!"]));
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["ids"], serde_json::json!([15496, 11, 995, 0]));
    assert_eq!(v["blocks"].as_array().unwrap().len(), 0, "4 tokens: no full block");
    assert!(v["engine"].as_str().unwrap().starts_with("native"), "{v}");
    assert_eq!(v["seed_from_segment"], false);

    // A chat body: rendered with the canonical template, 16-token blocks,
    // block hashes rooted at the body's model.
    let body = serde_json::json!({
        "model": "m1",
        "messages": [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. ".repeat(4)}],
    })
    .to_string();
    let out = assert_ok(&semlb(&["tokenize", "--json", "--body", &body]));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["endpoint"], "/v1/chat/completions");
    assert_eq!(v["renderer"], "canonical");
    let rendered = v["text"].as_str().unwrap();
    assert!(rendered.starts_with("<|user|>\nThe quick brown fox") && rendered.ends_with("<|assistant|>\n"));
    let ids = v["ids"].as_array().unwrap();
    let blocks = v["blocks"].as_array().unwrap();
    assert_eq!(blocks.len(), ids.len() / 16);
    // The segments tile the text and their ids are the ids.
    let segments = v["segments"].as_array().unwrap();
    assert_eq!(
        segments.last().unwrap()["end"].as_u64().unwrap() as usize,
        rendered.len()
    );
    let joined: Vec<&serde_json::Value> = segments.iter().flat_map(|s| s["ids"].as_array().unwrap()).collect();
    assert_eq!(joined.len(), ids.len());
    // Another model, another chain; the same model and text, the same one.
    let other = assert_ok(&semlb(&[
        "tokenize",
        "--json",
        "--body",
        &body.replace("\"m1\"", "\"m2\""),
    ]));
    let other: serde_json::Value = serde_json::from_str(&other).unwrap();
    assert_eq!(other["ids"], v["ids"]);
    assert_ne!(other["blocks"], v["blocks"]);

    // The plain-text report names the segments and blocks.
    let report = assert_ok(&semlb(&["tokenize", "--body", &body]));
    for part in ["segments (", "token ids (", "blocks (", "seed 0x0"] {
        assert!(report.contains(part), "{part:?} missing:\n{report}");
    }

    // A body the gateway refuses is refused with the gateway's message.
    let bad = semlb(&["tokenize", "--body", r#"{"model":"m","messages":[]}"#]);
    assert_fails_with(&bad, &["400", "'messages' must not be empty"]);
    assert_fails_with(&semlb(&["tokenize"]), &["give a TEXT"]);
}

/// With `[[model]]` pools in `--config`, a body is seen with its model's
/// tokenizer and block size, an alias hashes like its model, and an
/// unknown model gets the gateway's 404.
#[test]
fn tokenize_uses_the_request_models_pool() {
    let dir = semlb_test_support::TempDir::new("tokenize-pools");
    let bundled = concat!(env!("CARGO_MANIFEST_DIR"), "/tokenizer/assets/phi2-tokenizer.json");
    let mut json: serde_json::Value = serde_json::from_slice(&std::fs::read(bundled).unwrap()).unwrap();
    json["model"]["merges"] = serde_json::json!([]);
    std::fs::write(dir.0.join("bytes.json"), serde_json::to_vec(&json).unwrap()).unwrap();
    let config = dir.0.join("semlb.toml");
    std::fs::write(
        &config,
        "[[backend]]\nurl = \"http://127.0.0.1:9\"\n\
         [[model]]\nname = \"alpha\"\nbackends = [\"127.0.0.1:9\"]\n\
         [[model]]\nname = \"beta\"\naliases = [\"b\"]\nbackends = [\"127.0.0.1:9\"]\ntokenizer = \"bytes.json\"\nblock_size = 4\n",
    )
    .unwrap();
    let config = config.display().to_string();
    let see = |model: &str| -> serde_json::Value {
        let body = format!(r#"{{"model":"{model}","prompt":"hello world, once more"}}"#);
        serde_json::from_str(&assert_ok(&semlb(&[
            "tokenize", "--config", &config, "--json", "--body", &body,
        ])))
        .unwrap()
    };
    let (alpha, beta, alias) = (see("alpha"), see("beta"), see("b"));
    assert_eq!(alpha["block_size"], 16);
    assert_eq!(beta["block_size"], 4);
    assert_eq!(
        beta["ids"].as_array().unwrap().len(),
        "hello world, once more".len(),
        "a token per byte"
    );
    assert!(alpha["ids"].as_array().unwrap().len() < 8, "{alpha}");
    assert_eq!(alias["blocks"], beta["blocks"], "an alias shares its model's keyspace");
    assert!(beta["tokenizer"].as_str().unwrap().contains("bytes.json"), "{beta}");
    let unknown = semlb(&[
        "tokenize",
        "--config",
        &config,
        "--body",
        r#"{"model":"gamma","prompt":"x"}"#,
    ]);
    assert_fails_with(&unknown, &["404", "gamma"]);
}

#[test]
fn tokenize_jsonl_answers_each_line() {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_semlb"))
        .args(["tokenize", "--jsonl"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "\"Hello, world!\"").unwrap();
    writeln!(stdin, r#"{{"model":"m","prompt":[1,2,3]}}"#).unwrap();
    writeln!(stdin, "\"\"").unwrap();
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let lines: Vec<serde_json::Value> = stdout(&out).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[0]["ids"], serde_json::json!([15496, 11, 995, 0]));
    assert_eq!(
        lines[1]["ids"],
        serde_json::json!([1, 2, 3]),
        "token-id prompts are taken as given"
    );
    assert_eq!(lines[2]["ids"], serde_json::json!([]));
}

/// `semlb serve --help` lists every routing policy with its line (it used
/// to name four of the nine), and an unknown one is refused with the list.
#[test]
fn serve_help_lists_every_policy() {
    let help = stdout(&semlb(&["serve", "--help"]));
    for kind in semlb::routing::PolicyKind::ALL {
        assert!(
            help.contains(&format!("- {}:", kind.name())) && help.contains(kind.summary()),
            "{} is not in serve --help:\n{help}",
            kind.name()
        );
    }
    let o = semlb(&["serve", "--policy", "nope"]);
    assert_fails_with(&o, &["invalid value 'nope'", "selective_push", "weighted_scorers"]);
}
