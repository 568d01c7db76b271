//! The configuration's tests: parsing, flags over a file, validation.

use super::*;

const EXAMPLE: &str = include_str!("../../systemd/semlb.toml");
const EXAMPLE_PATH: &str = "/etc/semlb/semlb.toml";

fn parse(text: &str) -> Result<ServeConfig, ConfigError> {
    ServeConfig::from_toml(text, Path::new("/etc/semlb/test.toml"))
}

fn parse_err(text: &str) -> String {
    match parse(text) {
        Err(e @ ConfigError::Parse { .. }) => e.to_string(),
        other => panic!("expected a parse error for {text:?}, got {other:?}"),
    }
}

/// The defaults plus one backend: valid.
fn valid() -> ServeConfig {
    let mut config = ServeConfig::default();
    config.backends.push(BackendConfig::new("http://127.0.0.1:8000"));
    config
}

fn invalid(config: &ServeConfig) -> (String, String, String, String) {
    match config.validate() {
        Err(e @ ConfigError::Invalid { .. }) => {
            let shown = e.to_string();
            let ConfigError::Invalid { field, value, reason } = e else {
                unreachable!()
            };
            (field, value, reason, shown)
        }
        other => panic!("expected a validation error, got {other:?}"),
    }
}

/// The example with its commented-out settings (`# key = value`) turned on.
fn example_uncommented() -> String {
    EXAMPLE
        .lines()
        .map(|line| {
            let body = line.strip_prefix('#').map(str::trim_start);
            match body {
                Some(body) if is_setting(body) || is_table_header(body) => body,
                _ => line,
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// `[table]` or `[[table]]` (with a comment after it, perhaps).
fn is_table_header(line: &str) -> bool {
    let name = line.split(" #").next().unwrap_or("").trim();
    name.starts_with('[')
        && name.ends_with(']')
        && name
            .trim_matches(['[', ']'])
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b == b'_' || b == b'.')
}

/// `key = ...` with a lower-case key: a setting rather than prose.
fn is_setting(line: &str) -> bool {
    line.split_once(" = ")
        .is_some_and(|(key, _)| !key.is_empty() && key.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'))
}

#[test]
fn defaults() {
    let c = ServeConfig::default();
    assert_eq!(c.listen, "0.0.0.0:8080".parse().unwrap());
    let cores = std::thread::available_parallelism().unwrap().get();
    assert_eq!(c.dispatchers, cores.min(64));
    assert!(c.dispatchers >= 1);
    assert_eq!(c.responders, 1);
    assert_eq!(c.shm_name, "semlb");
    assert_eq!(c.shm_size, ByteSize(256 << 20));
    assert_eq!(c.tokenizer, None);
    assert_eq!(c.chat_template, None);
    assert_eq!(c.block_size, 16);
    assert!(c.backends.is_empty());
    assert_eq!(c.policy, PolicyConfig::default());
    assert_eq!(c.policy.kind, PolicyKind::CacheAware);
    assert_eq!(
        c.response_cache,
        ResponseCacheConfig {
            enabled: true,
            ttl_secs: 300,
            scope: CacheScope::Tenant,
            max_value_fraction: 0.125,
            cache_nondeterministic: false,
        }
    );
    assert_eq!(
        c.limits,
        LimitsConfig {
            max_body_bytes: ByteSize(16 << 20),
            request_timeout_secs: 600,
            connect_timeout_ms: 2000,
            retries: 2,
            check_context: true,
            client_timeout_secs: 30,
            max_connections: 4096,
            max_messages: 4096,
            max_prompt_bytes: ByteSize(8 << 20),
            reserve_output_tokens: 4096,
            max_connections_per_ip: 0,
            max_inflight_body_bytes: ByteSize(256 << 20),
        }
    );
    assert_eq!(
        c.health,
        HealthConfig {
            path: "/health".into(),
            interval_ms: 2000,
            timeout_ms: 1000,
            unhealthy_threshold: 3,
            healthy_threshold: 2,
            scrape_interval_ms: 1000,
            stale_after_ms: 5000,
            passive: true,
        }
    );
    assert_eq!(c.health.interval(), Duration::from_secs(2));
    assert_eq!(c.health.timeout(), Duration::from_secs(1));
    assert_eq!(c.health.scrape_interval(), Duration::from_secs(1));
    assert_eq!(c.drain_timeout_secs, 30);
    assert_eq!(c.drain_timeout(), Duration::from_secs(30));
    assert_eq!(c.limits.request_timeout(), Duration::from_secs(600));
    assert_eq!(c.limits.connect_timeout(), Duration::from_millis(2000));
    assert_eq!(c.response_cache.ttl(), Duration::from_secs(300));

    // An empty file and no file are the defaults too.
    assert_eq!(parse("").unwrap(), c);
    assert_eq!(ServeConfig::load(None).unwrap(), c);
    // The defaults lack only a backend.
    let (field, ..) = invalid(&c);
    assert_eq!(field, "backend");
    valid().validate().unwrap();
}

#[test]
fn example_file_parses_validates_and_shows_the_defaults() {
    let c = ServeConfig::from_toml(EXAMPLE, Path::new(EXAMPLE_PATH)).unwrap();
    c.validate().unwrap();
    // Every value it sets is the default, so it documents them truly.
    let defaults = ServeConfig {
        backends: c.backends.clone(),
        ..ServeConfig::default()
    };
    assert_eq!(c, defaults);
    let flavors: Vec<MetricsFlavor> = c.backends.iter().map(|b| b.metrics_flavor).collect();
    assert_eq!(
        flavors,
        [MetricsFlavor::Vllm, MetricsFlavor::Auto, MetricsFlavor::Llamacpp]
    );
}

#[test]
fn example_file_with_every_commented_setting_enabled_parses() {
    let text = example_uncommented();
    assert_ne!(
        text.trim_end(),
        EXAMPLE.trim_end(),
        "the example should have commented-out settings"
    );
    let mut c = ServeConfig::from_toml(&text, Path::new(EXAMPLE_PATH)).unwrap();
    // admin.token and admin.token_file are alternatives; the example shows both.
    assert!(c.admin.listen.is_some() && c.admin.token.is_some() && c.admin.token_file.is_some());
    assert!(c.admin.models_file.as_ref().is_some_and(|p| p.is_absolute()), "{c:?}");
    c.admin.token = None;
    c.validate().unwrap();
    assert!(c.tokenizer.is_some() && c.chat_template.is_some(), "{c:?}");
    assert!(c.backends.iter().any(|b| b.name.is_some()), "{c:?}");
    assert_eq!(c.models.len(), 3, "the example's models: {c:?}");
    assert!(c.models.iter().any(|m| m.base.is_some() && m.policy.is_none()));
    assert!(c.models.iter().any(|m| m.policy.is_some()));
    // Every key of the schema appears in the example.
    for key in [
        "listen",
        "dispatchers",
        "responders",
        "shm_name",
        "shm_size",
        "keep_segment",
        "tokenizer",
        "chat_template",
        "block_size",
        "segment_cache_size",
        "drain_timeout_secs",
        "[[backend]]",
        "url",
        "name",
        "metrics_flavor",
        "cache_salt",
        "kv_events",
        "kv_events_replay",
        "[[model]]",
        "aliases",
        "requests_per_minute",
        "tokens_per_minute",
        "backends",
        "base",
        "[model.policy]",
        "[policy]",
        "kind",
        "[policy.queue]",
        "capacity",
        "max_wait_ms",
        "recheck_ms",
        "fair_share",
        "batch_max_delay_ms",
        "[policy.cache_aware]",
        "cache_threshold",
        "balance_abs_threshold",
        "balance_rel_threshold",
        "scale_to_capacity",
        "weigh_queued_prefill",
        "queued_prefill_margin",
        "saved_tokens_per_spread",
        "fallback_weighs_own_prefill",
        "[policy.selective_push]",
        "mode",
        "max_pending",
        "max_outstanding",
        "cache_wait_ms",
        "[policy.consistent_hash]",
        "key_headers",
        "user_field",
        "conversation_key",
        "fallback_prefix_blocks",
        "virtual_nodes",
        "bounded_load",
        "load_epsilon",
        "[policy.dual_map]",
        "min_prefix_blocks",
        "max_prefix_blocks",
        "hot_share",
        "window",
        "ttft_slo_ms",
        "prefill_tokens_per_sec",
        "[policy.weighted_scorers]",
        "prefix_weight",
        "queue_weight",
        "kv_cache_weight",
        "load_weight",
        "pick",
        "[policy.prefix]",
        "source",
        "confirm_window_secs",
        "shared_headers",
        "[response_cache]",
        "enabled",
        "ttl_secs",
        "scope",
        "max_value_fraction",
        "cache_nondeterministic",
        "[limits]",
        "max_body_bytes",
        "request_timeout_secs",
        "connect_timeout_ms",
        "retries",
        "check_context",
        "client_timeout_secs",
        "max_connections",
        "max_messages",
        "max_prompt_bytes",
        "reserve_output_tokens",
        "max_connections_per_ip",
        "max_inflight_body_bytes",
        "[store]",
        "[store.redis]",
        "url",
        "namespace",
        "prefix_ttl_secs",
        "timeout_ms",
        "connect_timeout_ms",
        "retry_ms",
        "lookup",
        "write_backlog",
        "username",
        "password_file",
        "ca_file",
        "[health]",
        "path",
        "interval_ms",
        "timeout_ms",
        "unhealthy_threshold",
        "healthy_threshold",
        "scrape_interval_ms",
        "stale_after_ms",
        "passive",
        "[auth]",
        "keys_file",
        "debug_headers",
        "tenant_share_percent",
        "[peering]",
        "poll_ms",
        "max_age_ms",
        "forward_after_ms",
        "delay_penalty_ms",
        "affinity_secs",
        "[admin]",
        "listen",
        "token",
        "token_file",
        "models_file",
    ] {
        let present = text.lines().any(|l| {
            l.split(" #").next().unwrap_or("").trim() == key
                || l.split_once(" = ").is_some_and(|(k, _)| k.trim() == key)
        });
        assert!(present, "{key} is missing from systemd/semlb.toml");
    }
}

#[test]
fn full_file_parses() {
    let text = r#"
listen = "127.0.0.1:9000"
dispatchers = 4
responders = 2
shm_name = "semlb-test"
shm_size = "1GiB"
tokenizer = "tok/tokenizer.json"
chat_template = "/models/qwen/tokenizer_config.json"
block_size = 32
drain_timeout_secs = 5

[[backend]]
url = "http://10.0.0.1:8000"
name = "gpu-0"
metrics_flavor = "vllm"

[[backend]]
url = "http://[::1]:30000/"
metrics_flavor = "sglang"
role = "prefill"
bootstrap_port = 9000

[[backend]]
url = "HTTP://Llama.Local:8080"
metrics_flavor = "llamacpp"

[response_cache]
enabled = false
ttl_secs = 60
scope = "global"
max_value_fraction = 0.25
cache_nondeterministic = true

[limits]
max_body_bytes = "1MiB"
request_timeout_secs = 120
connect_timeout_ms = 500
retries = 0
check_context = false
"#;
    let c = parse(text).unwrap();
    c.validate().unwrap();
    assert_eq!(c.listen, "127.0.0.1:9000".parse().unwrap());
    assert_eq!((c.dispatchers, c.responders), (4, 2));
    assert_eq!(c.shm_name, "semlb-test");
    assert_eq!(c.shm_size, ByteSize(1 << 30));
    // Relative to the file's directory; absolute paths stay.
    assert_eq!(c.tokenizer, Some(PathBuf::from("/etc/semlb/tok/tokenizer.json")));
    assert_eq!(
        c.chat_template,
        Some(PathBuf::from("/models/qwen/tokenizer_config.json"))
    );
    assert_eq!(c.block_size, 32);
    assert_eq!(c.drain_timeout_secs, 5);
    assert_eq!(
        c.backends[0],
        BackendConfig {
            url: "http://10.0.0.1:8000".into(),
            name: Some("gpu-0".into()),
            metrics_flavor: MetricsFlavor::Vllm,
            cache_salt: false,
            kv_events: None,
            kv_events_replay: None,
            role: BackendRole::Both,
            bootstrap_port: None,
            weight: 1,
        }
    );
    assert_eq!(
        (c.backends[1].role, c.backends[1].bootstrap_port),
        (BackendRole::Prefill, Some(9000))
    );
    let names: Vec<String> = c.backends.iter().map(BackendConfig::display_name).collect();
    assert_eq!(names, ["gpu-0", "[::1]:30000", "llama.local:8080"]);
    let flavors: Vec<MetricsFlavor> = c.backends.iter().map(|b| b.metrics_flavor).collect();
    assert_eq!(
        flavors,
        [MetricsFlavor::Vllm, MetricsFlavor::Sglang, MetricsFlavor::Llamacpp]
    );
    assert_eq!(
        c.response_cache,
        ResponseCacheConfig {
            enabled: false,
            ttl_secs: 60,
            scope: CacheScope::Global,
            max_value_fraction: 0.25,
            cache_nondeterministic: true,
        }
    );
    assert_eq!(
        c.limits,
        LimitsConfig {
            max_body_bytes: ByteSize(1 << 20),
            request_timeout_secs: 120,
            connect_timeout_ms: 500,
            retries: 0,
            check_context: false,
            client_timeout_secs: 30,
            max_connections: 4096,
            max_messages: 4096,
            max_prompt_bytes: ByteSize(8 << 20),
            reserve_output_tokens: 4096,
            max_connections_per_ip: 0,
            max_inflight_body_bytes: ByteSize(256 << 20),
        }
    );
}

#[test]
fn policy_table() {
    let c = parse("[policy]\nkind = \"round_robin\"\n").unwrap();
    assert_eq!(
        c.policy,
        PolicyConfig {
            kind: PolicyKind::RoundRobin,
            ..PolicyConfig::default()
        }
    );
    let c = parse("[policy.cache_aware]\nbalance_abs_threshold = 64\n").unwrap();
    assert_eq!(c.policy.kind, PolicyKind::CacheAware);
    assert_eq!(c.policy.cache_aware.balance_abs_threshold, 64);
    assert_eq!(c.policy.cache_aware.cache_threshold, 0.3);
    let msg = parse_err("[policy]\nkind = \"fastest\"\n");
    assert!(
        msg.contains("unknown variant `fastest`") && msg.contains("line 2"),
        "{msg}"
    );
}

#[test]
fn the_policies_of_the_field_take_their_tables() {
    let mut c = parse(
        r#"
[[backend]]
url = "http://127.0.0.1:8000"
[policy]
kind = "dual_map"
[policy.queue]
capacity = 8
[policy.selective_push]
mode = "max_outstanding"
max_outstanding = 4
[policy.consistent_hash]
key_headers = ["X-Tenant"]
bounded_load = false
[policy.dual_map]
ttft_slo_ms = 500
prefill_tokens_per_sec = 2e5
[policy.weighted_scorers]
pick = "weighted_random"
kv_cache_weight = 0.0
"#,
    )
    .unwrap();
    c.validate().unwrap();
    let p = &c.policy;
    assert_eq!(p.kind, PolicyKind::DualMap);
    assert_eq!((p.queue.capacity, p.queue.max_wait_ms), (8, 60_000));
    assert_eq!(p.selective_push.mode, crate::routing::PushMode::MaxOutstanding);
    assert_eq!(p.selective_push.max_outstanding, 4);
    assert_eq!(p.consistent_hash.key_headers, ["X-Tenant"]);
    assert!(!p.consistent_hash.bounded_load);
    assert_eq!((p.dual_map.ttft_slo_ms, p.dual_map.prefill_tokens_per_sec), (500, 2e5));
    assert_eq!(p.weighted_scorers.pick, crate::routing::Pick::WeightedRandom);
    // Errors name the key under [policy.…], its value and why.
    c.policy.consistent_hash.key_headers = vec!["bad header".into()];
    let e = c.validate().unwrap_err().to_string();
    assert!(
        e.contains("policy.consistent_hash.key_headers") && e.contains("bad header"),
        "{e}"
    );
    c.policy = PolicyConfig::default();
    c.policy.queue.capacity = 0;
    let e = c.validate().unwrap_err().to_string();
    assert!(
        e.contains("policy.queue.capacity") && e.contains("1 and 1000000"),
        "{e}"
    );
}

#[test]
fn partial_tables_keep_the_other_defaults() {
    let c = parse("[limits]\nretries = 5\n[response_cache]\nscope = \"global\"\n").unwrap();
    assert_eq!(
        c.limits,
        LimitsConfig {
            retries: 5,
            ..LimitsConfig::default()
        }
    );
    assert_eq!(
        c.response_cache,
        ResponseCacheConfig {
            scope: CacheScope::Global,
            ..ResponseCacheConfig::default()
        }
    );
    assert_eq!(c.block_size, DEFAULT_BLOCK_SIZE);
}

#[test]
fn unknown_keys_are_rejected_naming_key_and_line() {
    let cases: &[(&str, &str, usize)] = &[
        ("listen = \"0.0.0.0:1\"\nlisten_addr = \"x\"\n", "listen_addr", 2),
        ("\n\n[limits]\nretries = 1\nmax_retries = 3\n", "max_retries", 5),
        ("[response_cache]\nttl = 5\n", "ttl", 2),
        ("[[backend]]\nurl = \"http://a:1\"\nweigth = 2\n", "weigth", 3),
        ("[policy]\nthreshhold = 0.5\n", "threshhold", 2),
        ("[policy.cache_aware]\nthreshold = 0.5\n", "threshold", 2),
        ("[health]\ninterval = 5\n", "interval", 2),
        ("[caches]\nenabled = true\n", "caches", 1),
        // The list is `[[backend]]`, not `backends`.
        ("[[backends]]\nurl = \"http://a:1\"\n", "backends", 1),
    ];
    for (text, key, line) in cases {
        let msg = parse_err(text);
        assert!(msg.contains(&format!("unknown field `{key}`")), "{key}: {msg}");
        assert!(msg.contains(&format!("line {line}")), "{key}: {msg}");
        assert!(msg.contains("/etc/semlb/test.toml"), "{msg}");
    }
}

#[test]
fn wrong_types_are_rejected_with_the_line() {
    let cases: &[(&str, usize, &str)] = &[
        ("# comment\n\ndispatchers = \"four\"\n", 3, "invalid type"),
        ("listen = 8080\n", 1, "invalid type"),
        (
            "listen = \"localhost:8080\"\n",
            1,
            "invalid address \"localhost:8080\": expected an IP address and a port",
        ),
        ("responders = -1\n", 1, "-1"),
        ("[response_cache]\nenabled = \"yes\"\n", 2, "invalid type"),
        (
            "[response_cache]\nscope = \"everyone\"\n",
            2,
            "unknown variant `everyone`",
        ),
        (
            "[[backend]]\nurl = \"http://a:1\"\nmetrics_flavor = \"tgi\"\n",
            3,
            "unknown variant `tgi`",
        ),
        ("[[backend]]\nname = \"a\"\n", 1, "missing field `url`"),
        ("backend = \"http://a:1\"\n", 1, "invalid type"),
        ("[limits]\nretries = 1.5\n", 2, "invalid type"),
        ("block_size = 16\nblock_size = 32\n", 2, "duplicate key"),
        ("shm_size = 256MiB\n", 1, "TOML parse error"),
    ];
    for (text, line, what) in cases {
        let msg = parse_err(text);
        assert!(msg.contains(&format!("line {line}")), "{text:?}: {msg}");
        assert!(msg.contains(what), "{text:?}: {msg}");
    }
}

#[test]
fn sizes_parse_from_strings_and_integers() {
    let cases: &[(&str, u64)] = &[
        ("\"256MiB\"", 256 << 20),
        ("\"1.5GiB\"", 3 << 29),
        ("\"100MB\"", 100_000_000),
        ("\"64 m\"", 64 << 20),
        ("\"16777216\"", 16 << 20),
        ("268435456", 256 << 20),
    ];
    for (value, want) in cases {
        let c = parse(&format!("shm_size = {value}\n[limits]\nmax_body_bytes = {value}\n")).unwrap();
        assert_eq!(c.shm_size, ByteSize(*want), "{value}");
        assert_eq!(c.limits.max_body_bytes, ByteSize(*want), "{value}");
    }
    let cases: &[(&str, &[&str])] = &[
        ("\"12XB\"", &["\"12XB\"", "unknown unit \"XB\""]),
        ("\"\"", &["it is empty"]),
        ("\"1.5\"", &["not a whole number of bytes"]),
        ("\"99999999999TiB\"", &["larger than"]),
        ("-5", &["cannot be negative"]),
        ("1.5", &["invalid type"]),
        ("true", &["invalid type"]),
    ];
    for (value, wants) in cases {
        let msg = parse_err(&format!("\n[limits]\nmax_body_bytes = {value}\n"));
        assert!(msg.contains("line 3"), "{value}: {msg}");
        for want in *wants {
            assert!(msg.contains(want), "{value}: {msg}");
        }
    }
}

#[test]
fn unreadable_file_is_a_read_error_naming_it() {
    let path = Path::new("/nonexistent/semlb/semlb.toml");
    let err = ServeConfig::load(Some(path)).unwrap_err();
    assert!(
        matches!(&err, ConfigError::Read { path: p, source } if p == path && source.kind() == std::io::ErrorKind::NotFound)
    );
    assert!(err.to_string().contains("/nonexistent/semlb/semlb.toml"), "{err}");
}

#[test]
fn invalid_error_names_field_value_and_reason() {
    let mut c = valid();
    c.dispatchers = 0;
    let err = c.validate().unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid configuration: dispatchers = 0: must be at least 1"
    );
}

#[test]
fn each_validation_rule() {
    type Mutate = fn(&mut ServeConfig);
    let cases: &[(&str, Mutate, &str, &str, &str)] = &[
        ("dispatchers", |c| c.dispatchers = 0, "dispatchers", "0", "at least 1"),
        ("dispatchers", |c| c.dispatchers = 65, "dispatchers", "65", "at most 64"),
        ("responders", |c| c.responders = 0, "responders", "0", "at least 1"),
        (
            "responders",
            |c| {
                c.dispatchers = 2;
                c.responders = 3
            },
            "responders",
            "3",
            "at most dispatchers = 2",
        ),
        (
            "processes",
            |c| {
                c.dispatchers = 64;
                c.responders = 64
            },
            "responders",
            "64",
            "129 processes",
        ),
        ("shm_name", |c| c.shm_name = String::new(), "shm_name", "\"\"", "empty"),
        ("shm_name", |c| c.shm_name = "a/b".into(), "shm_name", "\"a/b\"", "'/'"),
        (
            "shm_name",
            |c| c.shm_name = "x".repeat(201),
            "shm_name",
            "xxx",
            "longer than 200",
        ),
        (
            "shm_size",
            |c| c.shm_size = ByteSize(4 << 20),
            "shm_size",
            "\"4 MiB\"",
            "between 8 MiB and 1 TiB",
        ),
        (
            "shm_size",
            |c| c.shm_size = ByteSize(2 << 40),
            "shm_size",
            "\"2 TiB\"",
            "between 8 MiB and 1 TiB",
        ),
        (
            "tokenizer",
            |c| c.tokenizer = Some(PathBuf::new()),
            "tokenizer",
            "\"\"",
            "empty",
        ),
        (
            "chat_template",
            |c| c.chat_template = Some(PathBuf::new()),
            "chat_template",
            "\"\"",
            "empty",
        ),
        (
            "block_size",
            |c| c.block_size = 0,
            "block_size",
            "0",
            "between 1 and 1024",
        ),
        (
            "block_size",
            |c| c.block_size = 1025,
            "block_size",
            "1025",
            "between 1 and 1024",
        ),
        (
            "no backend",
            |c| c.backends.clear(),
            "backend",
            "[]",
            "at least one backend",
        ),
        (
            "too many backends",
            |c| c.backends = (1..=129).map(|p| BackendConfig::new(format!("http://h:{p}"))).collect(),
            "backend",
            "129",
            "at most 128",
        ),
        (
            "bad url",
            |c| c.backends.push(BackendConfig::new("https://h:1")),
            "backend[1].url",
            "\"https://h:1\"",
            "scheme must be http",
        ),
        (
            "duplicate url",
            |c| c.backends.push(BackendConfig::new("http://127.0.0.1:8000/")),
            "backend[1].url",
            "\"http://127.0.0.1:8000/\"",
            "same server as backend[0].url",
        ),
        (
            "duplicate name",
            |c| {
                c.backends[0].name = Some("gpu".into());
                c.backends.push(BackendConfig {
                    name: Some("gpu".into()),
                    ..BackendConfig::new("http://b:1")
                })
            },
            "backend[1].name",
            "\"gpu\"",
            "backend[0] has that name",
        ),
        (
            "name clashing with a default name",
            |c| {
                c.backends.push(BackendConfig {
                    name: Some("h:2".into()),
                    ..BackendConfig::new("http://h:1")
                });
                c.backends.push(BackendConfig::new("http://h:2"))
            },
            "backend[2].name",
            "\"h:2\"",
            "backend[1] has that name",
        ),
        (
            "bad name",
            |c| c.backends[0].name = Some("gpu 0".into()),
            "backend[0].name",
            "\"gpu 0\"",
            "letters, digits",
        ),
        (
            "empty name",
            |c| c.backends[0].name = Some(String::new()),
            "backend[0].name",
            "\"\"",
            "1 to 64",
        ),
        (
            "weight 0",
            |c| c.backends[0].weight = 0,
            "backend[0].weight",
            "0",
            "1 to 1000",
        ),
        (
            "weight too large",
            |c| c.backends[0].weight = 1001,
            "backend[0].weight",
            "1001",
            "1 to 1000",
        ),
        (
            "ttl 0",
            |c| c.response_cache.ttl_secs = 0,
            "response_cache.ttl_secs",
            "0",
            "enabled = false",
        ),
        (
            "ttl huge",
            |c| c.response_cache.ttl_secs = MAX_TTL_SECS + 1,
            "response_cache.ttl_secs",
            "31536001",
            "one year",
        ),
        (
            "fraction 0",
            |c| c.response_cache.max_value_fraction = 0.0,
            "response_cache.max_value_fraction",
            "0",
            "greater than 0",
        ),
        (
            "fraction big",
            |c| c.response_cache.max_value_fraction = 0.75,
            "response_cache.max_value_fraction",
            "0.75",
            "at most 0.5",
        ),
        (
            "fraction NaN",
            |c| c.response_cache.max_value_fraction = f64::NAN,
            "response_cache.max_value_fraction",
            "NaN",
            "at most 0.5",
        ),
        (
            "body 0",
            |c| c.limits.max_body_bytes = ByteSize(0),
            "limits.max_body_bytes",
            "\"0 B\"",
            "greater than 0",
        ),
        (
            "request timeout 0",
            |c| c.limits.request_timeout_secs = 0,
            "limits.request_timeout_secs",
            "0",
            "between 1 and 86400",
        ),
        (
            "request timeout huge",
            |c| c.limits.request_timeout_secs = u64::MAX,
            "limits.request_timeout_secs",
            "18446744073709551615",
            "between 1 and 86400",
        ),
        (
            "connect timeout 0",
            |c| c.limits.connect_timeout_ms = 0,
            "limits.connect_timeout_ms",
            "0",
            "at least 1",
        ),
        (
            "connect timeout over the request timeout",
            |c| {
                c.limits.request_timeout_secs = 2;
                c.limits.connect_timeout_ms = 2001
            },
            "limits.connect_timeout_ms",
            "2001",
            "(2000)",
        ),
        (
            "retries",
            |c| c.limits.retries = 11,
            "limits.retries",
            "11",
            "at most 10",
        ),
        (
            "client timeout 0",
            |c| c.limits.client_timeout_secs = 0,
            "limits.client_timeout_secs",
            "0",
            "between 1 and 3600",
        ),
        (
            "no messages",
            |c| c.limits.max_messages = 0,
            "limits.max_messages",
            "0",
            "at least 1",
        ),
        (
            "no prompt",
            |c| c.limits.max_prompt_bytes = ByteSize(0),
            "limits.max_prompt_bytes",
            "\"0 B\"",
            "greater than 0",
        ),
        (
            "no connections",
            |c| c.limits.max_connections = 0,
            "limits.max_connections",
            "0",
            "between 1 and 1000000",
        ),
        (
            "policy threshold",
            |c| c.policy.cache_aware.cache_threshold = 1.5,
            "policy.cache_aware.cache_threshold",
            "1.5",
            "between 0.0 and 1.0",
        ),
        (
            "policy ratio",
            |c| c.policy.cache_aware.balance_rel_threshold = 0.5,
            "policy.cache_aware.balance_rel_threshold",
            "0.5",
            ">= 1.0",
        ),
        (
            "drain timeout",
            |c| c.drain_timeout_secs = MAX_TIMEOUT_SECS + 1,
            "drain_timeout_secs",
            "86401",
            "at most 86400",
        ),
        (
            "redis url",
            |c| c.store.redis.url = "http://cache:6379".into(),
            "store.redis.url",
            "\"http://cache:6379\"",
            "",
        ),
        (
            "redis namespace",
            |c| c.store.redis.namespace = "a b".into(),
            "store.redis.namespace",
            "\"a b\"",
            "A-Z a-z 0-9",
        ),
        (
            "redis ttl",
            |c| c.store.redis.prefix_ttl_secs = 0,
            "store.redis.prefix_ttl_secs",
            "0",
            "between 1 and",
        ),
        (
            "redis timeout",
            |c| c.store.redis.timeout_ms = 0,
            "store.redis.timeout_ms",
            "0",
            "between 1 and 60000",
        ),
        (
            "redis retry",
            |c| c.store.redis.retry_ms = 5,
            "store.redis.retry_ms",
            "5",
            "between 10 and 60000",
        ),
        (
            "health path relative",
            |c| c.health.path = "health".into(),
            "health.path",
            "\"health\"",
            "starting with '/'",
        ),
        (
            "health path with a space",
            |c| c.health.path = "/he alth".into(),
            "health.path",
            "\"/he alth\"",
            "no spaces",
        ),
        (
            "health interval 0",
            |c| c.health.interval_ms = 0,
            "health.interval_ms",
            "0",
            "between 10 and 3600000",
        ),
        (
            "health timeout 0",
            |c| c.health.timeout_ms = 0,
            "health.timeout_ms",
            "0",
            "between 1 and health.interval_ms = 2000",
        ),
        (
            "health timeout over the interval",
            |c| c.health.timeout_ms = 2001,
            "health.timeout_ms",
            "2001",
            "one check in flight",
        ),
        (
            "health unhealthy threshold 0",
            |c| c.health.unhealthy_threshold = 0,
            "health.unhealthy_threshold",
            "0",
            "between 1 and 100",
        ),
        (
            "health healthy threshold big",
            |c| c.health.healthy_threshold = 101,
            "health.healthy_threshold",
            "101",
            "between 1 and 100",
        ),
        (
            "health scrape interval huge",
            |c| c.health.scrape_interval_ms = MAX_HEALTH_INTERVAL_MS + 1,
            "health.scrape_interval_ms",
            "3600001",
            "between 10 and 3600000",
        ),
        (
            "health stale before the next scrape",
            |c| c.health.stale_after_ms = 999,
            "health.stale_after_ms",
            "999",
            "scrape_interval_ms = 1000",
        ),
        (
            "admin without a token",
            |c| c.admin.listen = Some("127.0.0.1:9090".parse().unwrap()),
            "admin.listen",
            "\"127.0.0.1:9090\"",
            "needs a bearer token",
        ),
        (
            "admin on the gateway's address",
            |c| {
                c.admin.listen = Some(c.listen);
                c.admin.token = Some("0123456789abcdef".into())
            },
            "admin.listen",
            "\"0.0.0.0:8080\"",
            "must differ from listen",
        ),
        (
            "admin on the gateway's port",
            |c| {
                c.admin.listen = Some("127.0.0.1:8080".parse().unwrap());
                c.admin.token = Some("0123456789abcdef".into())
            },
            "admin.listen",
            "\"127.0.0.1:8080\"",
            "must differ from listen",
        ),
        (
            "metrics on the gateway's port",
            |c| c.metrics.listen = Some("127.0.0.1:8080".parse().unwrap()),
            "metrics.listen",
            "\"127.0.0.1:8080\"",
            "must differ from listen",
        ),
        (
            "metrics on the admin API's address",
            |c| {
                c.admin.listen = Some("127.0.0.1:9090".parse().unwrap());
                c.admin.token = Some("0123456789abcdef".into());
                c.metrics.listen = Some("0.0.0.0:9090".parse().unwrap())
            },
            "metrics.listen",
            "\"0.0.0.0:9090\"",
            "must differ from admin.listen",
        ),
        (
            "admin token too short",
            |c| c.admin.token = Some("short".into()),
            "admin.token",
            "hidden",
            "16 to 4096 characters",
        ),
        (
            "admin token with a space",
            |c| c.admin.token = Some("0123456789 abcdef".into()),
            "admin.token",
            "hidden",
            "visible ASCII",
        ),
        (
            "admin token and token file",
            |c| {
                c.admin.token = Some("0123456789abcdef".into());
                c.admin.token_file = Some("/etc/semlb/admin.token".into())
            },
            "admin.token_file",
            "admin.token",
            "not both",
        ),
        (
            "admin token file empty",
            |c| c.admin.token_file = Some(PathBuf::new()),
            "admin.token_file",
            "\"\"",
            "must not be empty",
        ),
        (
            "admin models file empty",
            |c| c.admin.models_file = Some(PathBuf::new()),
            "admin.models_file",
            "\"\"",
            "must not be empty",
        ),
        (
            "redis backlog",
            |c| c.store.redis.write_backlog = 2_000_000,
            "store.redis.write_backlog",
            "2000000",
            "at most 1000000",
        ),
    ];
    for (name, mutate, field, value, reason) in cases {
        let mut c = valid();
        mutate(&mut c);
        let (f, v, r, shown) = invalid(&c);
        assert_eq!(f, *field, "{name}: {shown}");
        assert!(v.contains(value), "{name}: value {v:?} lacks {value:?}: {shown}");
        assert!(r.contains(reason), "{name}: reason {r:?} lacks {reason:?}: {shown}");
        assert!(shown.contains(&format!("{f} = {v}: {r}")), "{name}: {shown}");
    }
}

#[test]
fn boundary_values_are_accepted() {
    type Mutate = fn(&mut ServeConfig);
    let cases: &[Mutate] = &[
        |c| c.dispatchers = 64,
        |c| {
            c.dispatchers = 64;
            c.responders = 63
        },
        |c| {
            c.dispatchers = 1;
            c.responders = 1
        },
        |c| c.shm_size = ByteSize(MIN_SEGMENT_BYTES),
        |c| c.shm_size = ByteSize(MAX_SEGMENT_BYTES),
        |c| c.shm_name = "/semlb".into(),
        |c| c.block_size = 1,
        |c| c.block_size = MAX_BLOCK_SIZE,
        |c| c.backends = (1..=128).map(|p| BackendConfig::new(format!("http://h:{p}"))).collect(),
        |c| c.response_cache.max_value_fraction = 0.5,
        |c| c.response_cache.ttl_secs = MAX_TTL_SECS,
        |c| c.limits.connect_timeout_ms = c.limits.request_timeout_secs * 1000,
        |c| c.limits.request_timeout_secs = MAX_TIMEOUT_SECS,
        |c| c.limits.retries = MAX_RETRIES,
        |c| c.limits.client_timeout_secs = MAX_CLIENT_TIMEOUT_SECS,
        |c| c.limits.max_connections = MAX_CONNECTIONS,
        |c| c.limits.max_body_bytes = ByteSize(1),
        |c| c.drain_timeout_secs = 0,
        |c| c.listen = "[::]:0".parse().unwrap(),
        |c| c.backends[0].name = Some("gpu-0.rack_1:a".into()),
        |c| c.health.path = "/v1/models?probe=1".into(),
        |c| {
            c.health.interval_ms = 10;
            c.health.timeout_ms = 10;
            c.health.scrape_interval_ms = 10;
            c.health.stale_after_ms = 10
        },
        |c| {
            c.health.unhealthy_threshold = MAX_HEALTH_THRESHOLD;
            c.health.healthy_threshold = 1;
            c.health.passive = false
        },
        |c| c.health.stale_after_ms = MAX_TIMEOUT_SECS * 1000,
    ];
    for (i, mutate) in cases.iter().enumerate() {
        let mut c = valid();
        mutate(&mut c);
        assert!(c.validate().is_ok(), "case {i}: {:?}", c.validate());
    }
}

#[test]
fn valid_sizes_give_a_valid_segment_layout() {
    for size in [MIN_SEGMENT_BYTES, 256 << 20, 3 << 29] {
        for fraction in [f64::MIN_POSITIVE, 0.125, 0.5] {
            let mut c = valid();
            c.shm_size = ByteSize(size);
            c.response_cache.max_value_fraction = fraction;
            c.validate().unwrap();
            let options = shm_layout::PlanOptions {
                max_response_fraction: fraction,
            };
            shm_layout::LayoutPlan::new(size, options).unwrap();
        }
    }
}

#[test]
fn backend_urls() {
    let good: &[(&str, &str, u16)] = &[
        ("http://127.0.0.1:8000", "127.0.0.1", 8000),
        ("http://127.0.0.1:8000/", "127.0.0.1", 8000),
        ("HTTP://Worker-1.Example.com:30000", "worker-1.example.com", 30000),
        ("http://vllm_0:8000", "vllm_0", 8000),
        ("http://[::1]:8080", "::1", 8080),
        ("http://[fe80:0:0::1]:1", "fe80::1", 1),
        ("http://h:65535", "h", 65535),
    ];
    for (url, host, port) in good {
        let parsed: BackendUrl = url.parse().unwrap_or_else(|e| panic!("{url}: {e}"));
        assert_eq!((parsed.host.as_str(), parsed.port), (*host, *port), "{url}");
    }
    assert_eq!(
        "http://[::1]:8080".parse::<BackendUrl>().unwrap().authority(),
        "[::1]:8080"
    );
    assert_eq!("http://A:1/".parse::<BackendUrl>().unwrap().to_string(), "http://a:1");

    let bad: &[(&str, &str)] = &[
        ("", "expected http://host:port"),
        ("127.0.0.1:8000", "expected http://host:port"),
        ("https://h:443", "scheme must be http, not \"https\""),
        ("grpc://h:1", "scheme must be http"),
        ("http://h", "port is missing"),
        ("http://h:", "port is missing"),
        ("http://h:0", "not in 1..=65535"),
        ("http://h:65536", "not in 1..=65535"),
        ("http://h:+80", "not a number"),
        ("http://h:80x", "not a number"),
        ("http://:8000", "host is missing"),
        ("http://h:1/v1", "path, query or fragment (found \"/v1\")"),
        ("http://h:1?x=1", "path, query or fragment"),
        ("http://h:1#f", "path, query or fragment"),
        ("http://user:pw@h:1", "user information"),
        ("http://::1:8000", "must be in brackets"),
        ("http://[::1:8000", "closed with ']'"),
        ("http://[::g]:8000", "not an IPv6 address"),
        ("http://[::1]8000", "expected ':port'"),
        ("http://[::1]", "port is missing"),
        ("http://bad host:1", "not a host name"),
        ("http://-h:1", "not a host name"),
        ("http://a..b:1", "not a host name"),
    ];
    for (url, want) in bad {
        let err = url.parse::<BackendUrl>().unwrap_err().to_string();
        assert!(err.contains(want), "{url}: {err}");
    }
    let long = format!("http://{}:1", "a.".repeat(130));
    assert!(
        long.parse::<BackendUrl>()
            .unwrap_err()
            .to_string()
            .contains("longer than 256 bytes")
    );
}

#[test]
fn overrides_win_over_the_file() {
    let mut c = parse(
        r#"
listen = "127.0.0.1:1"
dispatchers = 2
responders = 2
shm_name = "from-file"
shm_size = "64MiB"
tokenizer = "file-tokenizer.json"
chat_template = "file-template.json"
block_size = 32
[[backend]]
url = "http://file:1"
[limits]
retries = 3
[policy]
kind = "least_load"
[policy.cache_aware]
cache_threshold = 0.25
"#,
    )
    .unwrap();
    let policy = c.policy.clone();
    assert_eq!(policy.kind, PolicyKind::LeastLoad);
    assert_eq!(policy.cache_aware.cache_threshold, 0.25);
    c.apply(ServeOverrides {
        listen: Some("127.0.0.1:2".parse().unwrap()),
        dispatchers: Some(8),
        responders: Some(3),
        shm_name: Some("from-flags".into()),
        shm_size: Some("1GiB".parse().unwrap()),
        backends: None,
        prefill: Vec::new(),
        decode: Vec::new(),
        pd_protocol: Some(PdProtocol::Sglang),
        tokenizer: Some("flag-tokenizer.json".into()),
        chat_template: Some("flag-template.json".into()),
        block_size: Some(64),
        policy: Some(PolicyKind::RoundRobin),
        store: Some(StoreKind::Redis),
        redis_url: Some("redis://cache:7000/2".into()),
        redis_namespace: Some("blue".into()),
        redis_lookup: Some(RedisLookup::Naive),
        admin_listen: Some("127.0.0.1:9090".parse().unwrap()),
        admin_token_file: Some("flag-token".into()),
        metrics_listen: Some("127.0.0.1:9091".parse().unwrap()),
        discovery: Some(DiscoveryKind::Kubernetes),
        discovery_file: Some("flag-endpoints.yaml".into()),
        discovery_selector: Some("app=vllm".into()),
        discovery_namespace: Some("llm".into()),
        discovery_port: Some(8000),
        inference_pool: Some("pool".into()),
        epp_listen: Some("127.0.0.1:9002".parse().unwrap()),
    });
    assert_eq!(c.epp.listen, Some("127.0.0.1:9002".parse().unwrap()));
    assert_eq!(c.discovery.kind, Some(DiscoveryKind::Kubernetes));
    assert_eq!(c.discovery.path, Some(PathBuf::from("flag-endpoints.yaml")));
    assert_eq!(
        (c.discovery.selector.as_deref(), c.discovery.namespace.as_deref()),
        (Some("app=vllm"), Some("llm"))
    );
    assert_eq!(
        (c.discovery.port, c.discovery.inference_pool.as_deref()),
        (Some(8000), Some("pool"))
    );
    assert_eq!(c.admin.listen, Some("127.0.0.1:9090".parse().unwrap()));
    assert_eq!(c.metrics.listen, Some("127.0.0.1:9091".parse().unwrap()));
    assert_eq!(c.admin.token_file, Some(PathBuf::from("flag-token")));
    assert_eq!(c.pd.protocol, PdProtocol::Sglang);
    c.validate().unwrap();
    assert_eq!(c.store.kind, StoreKind::Redis);
    assert_eq!(
        (c.store.redis.url.as_str(), c.store.redis.namespace.as_str()),
        ("redis://cache:7000/2", "blue")
    );
    assert_eq!(c.store.redis.lookup, RedisLookup::Naive);
    assert_eq!(c.store.redis.timeout_ms, 100, "the file's other Redis keys stay");
    assert_eq!(c.listen, "127.0.0.1:2".parse().unwrap());
    assert_eq!((c.dispatchers, c.responders), (8, 3));
    assert_eq!(c.shm_name, "from-flags");
    assert_eq!(c.shm_size, ByteSize(1 << 30));
    // Flag paths are taken as given (relative to the working directory).
    assert_eq!(c.tokenizer, Some(PathBuf::from("flag-tokenizer.json")));
    assert_eq!(c.chat_template, Some(PathBuf::from("flag-template.json")));
    assert_eq!(c.block_size, 64);
    assert_eq!(c.policy.kind, PolicyKind::RoundRobin);
    // The file's policy parameters stay.
    assert_eq!(c.policy.cache_aware, policy.cache_aware);
    // Not overridden: the file's.
    assert_eq!(c.backends, [BackendConfig::new("http://file:1")]);
    assert_eq!(c.limits.retries, 3);
}

#[test]
fn absent_overrides_keep_the_file() {
    let text = "dispatchers = 3\nblock_size = 8\ntokenizer = \"t.json\"\n[[backend]]\nurl = \"http://a:1\"\n";
    let mut c = parse(text).unwrap();
    c.apply(ServeOverrides::default());
    assert_eq!(c, parse(text).unwrap());
}

#[test]
fn backend_flags_replace_the_file_list() {
    let mut c = parse(
        "[[backend]]\nurl = \"http://a:1\"\nname = \"a\"\nmetrics_flavor = \"vllm\"\n\
         [[backend]]\nurl = \"http://b:1\"\n",
    )
    .unwrap();
    c.apply(ServeOverrides {
        backends: Some(vec!["http://c:1".into(), "http://a:1".into()]),
        ..ServeOverrides::default()
    });
    assert_eq!(
        c.backends,
        [BackendConfig::new("http://c:1"), BackendConfig::new("http://a:1")]
    );
    c.validate().unwrap();

    // Flags are validated like the file.
    c.apply(ServeOverrides {
        backends: Some(vec!["http://c:1".into(), "http://c:1/".into()]),
        ..ServeOverrides::default()
    });
    let (field, ..) = invalid(&c);
    assert_eq!(field, "backend[1].url");
}

#[test]
fn admin_table_parses_and_the_token_file_is_checked() {
    let c = parse("[admin]\nlisten = \"127.0.0.1:9090\"\ntoken_file = \"admin.token\"\n").unwrap();
    assert_eq!(c.admin.listen, Some("127.0.0.1:9090".parse().unwrap()));
    assert_eq!(c.admin.token_file, Some(PathBuf::from("/etc/semlb/admin.token")));
    assert!(parse_err("[admin]\nlisten = \"localhost:9090\"\n").contains("host names are not accepted"));
    assert!(parse_err("[admin]\nbogus = 1\n").contains("unknown field `bogus`"));
    assert_eq!(AdminConfig::default().read_token(None).unwrap(), None);
    let inline = AdminConfig {
        token: Some("0123456789abcdef".into()),
        ..AdminConfig::default()
    };
    assert_eq!(inline.read_token(None).unwrap().as_deref(), Some("0123456789abcdef"));

    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("semlb-admin-token-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("admin.token");
    std::fs::write(&path, "0123456789abcdef0123\n").unwrap();
    let from_file = AdminConfig {
        token_file: Some(path.clone()),
        ..AdminConfig::default()
    };
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let err = from_file.read_token(None).unwrap_err().to_string();
    assert!(
        err.contains("admin.token_file") && err.contains("readable by every user") && err.contains("0644"),
        "{err}"
    );
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
    let err = from_file.read_token(None).unwrap_err().to_string();
    assert!(err.contains("readable by its group") && err.contains("0640"), "{err}");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(
        from_file.read_token(None).unwrap().as_deref(),
        Some("0123456789abcdef0123")
    );
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o400)).unwrap();
    assert_eq!(
        from_file.read_token(None).unwrap().as_deref(),
        Some("0123456789abcdef0123")
    );
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::write(&path, "short\n").unwrap();
    let err = from_file.read_token(None).unwrap_err().to_string();
    assert!(err.contains("16 to 4096"), "{err}");
    let missing = AdminConfig {
        token_file: Some(dir.join("missing")),
        ..AdminConfig::default()
    };
    assert!(
        missing
            .read_token(None)
            .unwrap_err()
            .to_string()
            .contains("cannot read it")
    );
    let a_directory = AdminConfig {
        token_file: Some(dir.clone()),
        ..AdminConfig::default()
    };
    let err = a_directory.read_token(None).unwrap_err().to_string();
    assert!(err.contains("not a regular file"), "{err}");
    // An inline token: the configuration file it is written in is checked.
    let config = dir.join("semlb.toml");
    std::fs::write(&config, "[admin]\n").unwrap();
    std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o644)).unwrap();
    let err = inline.read_token(Some(&config)).unwrap_err().to_string();
    assert!(
        err.contains("admin.token") && err.contains("readable by every user"),
        "{err}"
    );
    assert!(!err.contains("0123456789abcdef"), "the token is not echoed: {err}");
    std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(
        inline.read_token(Some(&config)).unwrap().as_deref(),
        Some("0123456789abcdef")
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn resolve_reads_applies_and_validates() {
    let dir = std::env::temp_dir().join(format!("semlb-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("semlb.toml");
    std::fs::write(
        &path,
        "dispatchers = 2\ntokenizer = \"tok.json\"\n[[backend]]\nurl = \"http://a:1\"\n",
    )
    .unwrap();

    let c = ServeConfig::resolve(Some(&path), ServeOverrides::default()).unwrap();
    assert_eq!(c.dispatchers, 2);
    assert_eq!(c.tokenizer, Some(dir.join("tok.json")));

    let flags = ServeOverrides {
        dispatchers: Some(0),
        ..ServeOverrides::default()
    };
    let err = ServeConfig::resolve(Some(&path), flags).unwrap_err();
    assert!(err.to_string().contains("dispatchers = 0: must be at least 1"), "{err}");

    // No file: flags alone make a configuration.
    let flags = ServeOverrides {
        backends: Some(vec!["http://b:2".into()]),
        ..ServeOverrides::default()
    };
    let c = ServeConfig::resolve(None, flags).unwrap();
    assert_eq!(c.backends, [BackendConfig::new("http://b:2")]);
    // Prefill and decode engines on the command line: with `--backend`,
    // the whole list, in that order.
    let flags = ServeOverrides {
        backends: Some(vec!["http://b:2".into()]),
        prefill: vec!["http://p:1".into()],
        decode: vec!["http://d:1".into(), "http://d:2".into()],
        pd_protocol: Some(PdProtocol::Sglang),
        ..ServeOverrides::default()
    };
    let c = ServeConfig::resolve(Some(&path), flags).unwrap();
    let roles: Vec<(&str, BackendRole)> = c.backends.iter().map(|b| (b.url.as_str(), b.role)).collect();
    assert_eq!(
        roles,
        [
            ("http://b:2", BackendRole::Both),
            ("http://p:1", BackendRole::Prefill),
            ("http://d:1", BackendRole::Decode),
            ("http://d:2", BackendRole::Decode)
        ]
    );
    assert_eq!(c.pd.protocol, PdProtocol::Sglang);
    assert!(ServeConfig::resolve(None, ServeOverrides::default()).is_err());

    std::fs::write(&path, "dispatchers = 2\nbogus = 1\n").unwrap();
    let err = ServeConfig::resolve(Some(&path), ServeOverrides::default()).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains(&path.display().to_string()) && msg.contains("unknown field `bogus`"),
        "{msg}"
    );
    assert!(msg.contains("line 2"), "{msg}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn store_names_parse_back() {
    for kind in [StoreKind::Shm, StoreKind::Redis] {
        assert_eq!(kind.name().parse::<StoreKind>(), Ok(kind));
    }
    assert!(
        "memcached"
            .parse::<StoreKind>()
            .unwrap_err()
            .to_string()
            .contains("shm or redis")
    );
    assert_eq!("naive".parse::<RedisLookup>(), Ok(RedisLookup::Naive));
}

#[test]
fn model_pools_are_checked_against_each_other_and_the_backends() {
    let text = r#"
[[backend]]
url = "http://10.0.0.1:8000"
name = "gpu-0"
[[backend]]
url = "http://10.0.0.2:8000"

[[model]]
name = "big"
aliases = ["default"]
backends = ["gpu-0", "http://10.0.0.2:8000"]
tokenizer = "tok.json"
[model.policy]
kind = "least_load"

[[model]]
name = "big-lora"
base = "big"
backends = ["10.0.0.2:8000"]
"#;
    let c = parse(text).unwrap();
    c.validate().unwrap();
    assert_eq!(c.models[0].tokenizer.as_deref(), Some(Path::new("/etc/semlb/tok.json")));
    assert_eq!(c.models[0].policy.as_ref().map(|p| p.kind), Some(PolicyKind::LeastLoad));
    assert_eq!(c.models[1].base.as_deref(), Some("big"));
    let with = |edit: &dyn Fn(&mut ServeConfig)| {
        let mut c = c.clone();
        edit(&mut c);
        let (field, value, reason, _) = invalid(&c);
        (field, value, reason)
    };
    let (field, value, _) = with(&|c| c.models[1].aliases = vec!["default".into()]);
    assert_eq!((field.as_str(), value.as_str()), ("model[1].aliases", "\"default\""));
    let (field, _, reason) = with(&|c| c.models[0].backends.push("gpu-9".into()));
    assert_eq!(field, "model[0].backends");
    assert!(reason.contains("no [[backend]]"), "{reason}");
    let (field, ..) = with(&|c| c.models[0].backends.clear());
    assert_eq!(field, "model[0].backends");
    let (field, ..) = with(&|c| c.models[1].base = Some("default".into()));
    assert_eq!(field, "model[1].base", "a base is a name, not an alias");
    let (field, ..) = with(&|c| c.models[1].block_size = Some(32));
    assert_eq!(field, "model[1].block_size", "an adapter has its base's");
    let (field, ..) = with(&|c| {
        c.models[0].backends = vec!["gpu-0".into()];
    });
    assert_eq!(field, "model[1].backends", "an adapter's backends serve its base");
    let (field, ..) = with(&|c| c.models[0].name = " big".into());
    assert_eq!(field, "model[0].name");
    let (field, ..) = with(&|c| c.models[0].policy.as_mut().unwrap().queue.capacity = 0);
    assert_eq!(field, "model[0].policy.queue.capacity");
    let (field, _, reason) = with(&|c| c.models[1].tokens_per_minute = Some(0));
    assert_eq!(field, "model[1].tokens_per_minute");
    assert!(reason.contains("at least 1"), "{reason}");
    assert!(parse_err("[[model]]\nname = \"m\"\nbackend = [\"x\"]\n").contains("unknown field"));
}

#[test]
fn discovery_needs_what_its_kind_reads_and_replaces_the_backend_list_requirement() {
    let base = |section: &str| {
        let text = format!("{section}\n");
        ServeConfig::from_toml(&text, Path::new("/etc/semlb/semlb.toml"))
            .and_then(|c| c.validate())
            .map_err(|e| e.to_string())
    };
    base("[discovery]\nkind = \"file\"\npath = \"endpoints.yaml\"").unwrap();
    let c = ServeConfig::from_toml(
        "[discovery]\nkind = \"file\"\npath = \"endpoints.yaml\"\n",
        Path::new("/etc/semlb/semlb.toml"),
    )
    .unwrap();
    assert_eq!(
        c.discovery.path,
        Some(PathBuf::from("/etc/semlb/endpoints.yaml")),
        "relative to the file"
    );
    base("[discovery]\nkind = \"kubernetes\"\nselector = \"app=vllm\"\nport = 8000").unwrap();
    base("[discovery]\nkind = \"kubernetes\"\nservice = \"vllm\"").unwrap();
    base("[discovery]\nkind = \"inference-pool\"\ninference_pool = \"vllm\"").unwrap();
    for (section, says) in [
        ("", "at least one backend is needed"),
        ("[discovery]\nkind = \"file\"", "discovery.path"),
        (
            "[discovery]\nkind = \"file\"\npath = \"e.yaml\"\npoll_ms = 1",
            "discovery.poll_ms",
        ),
        ("[discovery]\nkind = \"kubernetes\"", "discovery.selector"),
        (
            "[discovery]\nkind = \"kubernetes\"\nselector = \"app=vllm\"",
            "discovery.port",
        ),
        (
            "[discovery]\nkind = \"kubernetes\"\nselector = \"app=vllm\"\nservice = \"s\"\nport = 1",
            "not both",
        ),
        (
            "[discovery]\nkind = \"kubernetes\"\nselector = \"app in vllm\"\nport = 1",
            "parentheses",
        ),
        (
            "[discovery]\nkind = \"kubernetes\"\nselector = \"app=vllm\"\nport = 1\ndecode_selector = \"role=\"\nprefill_selector = \"!\"",
            "discovery.prefill_selector",
        ),
        ("[discovery]\nkind = \"inference-pool\"", "discovery.inference_pool"),
        (
            "[discovery]\nkind = \"kubernetes\"\nservice = \"s\"\n[[model]]\nname = \"m\"",
            "discovery.model",
        ),
        (
            "[discovery]\nkind = \"kubernetes\"\nservice = \"s\"\nmodel = \"x\"\n[[model]]\nname = \"m\"",
            "no [[model]] has that name",
        ),
        ("[discovery]\nkind = \"dns\"", "unknown variant"),
    ] {
        let e = match base(section) {
            Err(e) => e,
            Ok(()) => panic!("{section:?} validated"),
        };
        assert!(e.contains(says), "{section:?}: {e}");
    }
    // A pool with no backend of its own is fine when discovery finds them.
    base("[discovery]\nkind = \"kubernetes\"\nservice = \"s\"\nmodel_label = \"model\"\n[[model]]\nname = \"m\"")
        .unwrap();
}

#[test]
fn the_kubernetes_manifests_configuration_validates() {
    // deploy/kubernetes's ConfigMap, read by this parser (validate.py
    // checks the manifests around it).
    let text = include_str!("../../deploy/kubernetes/standalone/semlb.toml");
    let c = ServeConfig::from_toml(text, Path::new("/etc/semlb/semlb.toml")).unwrap();
    c.validate().unwrap();
    assert_eq!(c.discovery.kind, Some(DiscoveryKind::Kubernetes));
    let text = include_str!("../../deploy/kubernetes/epp/picker/semlb.toml");
    let c = ServeConfig::from_toml(text, Path::new("/etc/semlb/semlb.toml")).unwrap();
    c.validate().unwrap();
    assert_eq!(c.discovery.kind, Some(DiscoveryKind::InferencePool));
    assert!(c.epp.listen.is_some());
}

#[test]
fn resume_tables_are_checked_globally_and_per_pool() {
    let mut config = valid();
    config.resume.max_attempts = MAX_RETRIES + 1;
    assert_eq!(invalid(&config).0, "resume.max_attempts");
    let mut config = valid();
    config.resume.stall_ms = 50;
    assert_eq!(invalid(&config).0, "resume.stall_ms");
    let mut config = valid();
    config.resume.stall_ms = 0;
    assert!(config.validate().is_ok(), "0: never");
    let mut config = valid();
    config.models = vec![ModelConfig {
        resume: Some(ResumeConfig {
            stall_ms: 50,
            ..ResumeConfig::default()
        }),
        ..ModelConfig::new("m", &["http://127.0.0.1:8000"])
    }];
    let (field, value, ..) = invalid(&config);
    assert_eq!((field.as_str(), value.as_str()), ("model[0].resume.stall_ms", "50"));
    config.models[0].resume = Some(ResumeConfig {
        enabled: false,
        ..ResumeConfig::default()
    });
    assert!(config.validate().is_ok());
}
