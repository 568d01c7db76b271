//! Disaggregated prefill and decode through `semlb serve`, against
//! simulated engines that play vLLM's NixlConnector and SGLang's bootstrap
//! rendezvous (`semlb __sim --role prefill|decode --pd-protocol ...`), each
//! a real process, driven over real HTTP.
//!
//! Each engine lists what it received (`GET /sim/requests`): the tests
//! assert the bodies of both legs field by field, that the prefill's
//! parameters reach the decode leg verbatim, and what the client gets.
//! The last one has every engine publish its KV cache events to a gateway
//! in precise prefix mode: each leg goes where the events of the engines
//! of its role say the prompt is.

use std::time::Duration;

use serde_json::{Value, json};

use semlb_test_support as support;
use shm_layout::{KvEventsSync, ServerRef};
use support::gateway::{Gateway, chat, kv_backend_table, sim_with, sim_with_events, user, wait_for};
use support::http::{Response, http};
use support::process::Proc;

/// A simulated engine of `role` speaking `protocol`, at 100x real speed.
fn engine(role: &str, protocol: &str) -> Proc {
    engine_at(role, protocol, "0.01")
}

/// [`engine`] whose simulated second lasts `time_scale` real seconds.
fn engine_at(role: &str, protocol: &str, time_scale: &str) -> Proc {
    sim_with(time_scale, &pd_flags(role, protocol))
}

/// [`engine`] publishing its KV cache events (vLLM's `--kv-events-config`,
/// on free loopback ports, which its start line names).
fn engine_publishing(role: &str, protocol: &str) -> Proc {
    sim_with_events("0.01", 10_000, &pd_flags(role, protocol))
}

/// The simulator's flags for an engine of `role` speaking `protocol` (an
/// SGLang prefill engine's bootstrap server on a free port).
fn pd_flags<'a>(role: &'a str, protocol: &'a str) -> Vec<&'a str> {
    let mut args = vec!["--role", role, "--pd-protocol", protocol];
    if protocol == "sglang" && role == "prefill" {
        args.extend(["--bootstrap-port", "0"]);
    }
    args
}

/// `semlb serve` with these prefill and decode engines.
fn gateway(tag: &str, prefill: &[&Proc], decode: &[&Proc], extra: &[&str]) -> Gateway {
    let mut args: Vec<String> = Vec::new();
    for p in prefill {
        args.extend(["--prefill".into(), format!("http://{}", p.addr)]);
    }
    for d in decode {
        args.extend(["--decode".into(), format!("http://{}", d.addr)]);
    }
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    Gateway::builder().tag(tag).args(&args).start()
}

/// The inference requests `engine` received, oldest first.
fn received(engine: &Proc) -> Vec<Value> {
    let r = http(&engine.addr, "GET", "/sim/requests", None, &[]).expect("GET /sim/requests");
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["requests"].as_array().cloned().unwrap_or_default()
}

/// Whether the gateway holds `engine` up.
fn is_up(gw: &Gateway, engine: &Proc) -> bool {
    gw.listed(engine)
        .is_some_and(|s| s.state == shm_layout::ServerState::Up)
}

/// The bootstrap port the gateway read from `prefill`'s `/server_info`
/// (waited for: the health checker reads it).
fn learned_bootstrap_port(gw: &Gateway, prefill: &Proc) -> u16 {
    wait_for(
        "the bootstrap port read from /server_info",
        std::time::Duration::from_secs(10),
        || {
            let port = gw.listed(prefill).and_then(|s| s.disaggregation.bootstrap_port);
            (port.is_some(), port.unwrap_or(0))
        },
    )
}

/// A long system prompt: more than `pd.bypass_uncached_tokens` (256)
/// tokens, so a first turn is split (unless a decode engine holds it
/// already: then every conversation sharing it bypasses prefill).
fn system_prompt() -> Value {
    system_prompt_of("Assistant")
}

/// [`system_prompt`] of its own, from the first block on.
fn system_prompt_of(name: &str) -> Value {
    let text = (0..60)
        .map(|i| format!("Rule {i}: answer as briefly as the question allows."))
        .collect::<Vec<_>>()
        .join(" ");
    json!({"role": "system", "content": format!("You are {name}. {text}")})
}

fn completions(gw: &Gateway, body: Value, headers: &[(&str, &str)]) -> Response {
    gw.request("POST", "/v1/completions", Some(&body), headers)
        .expect("request")
}

/// The prefill leg of vLLM's NixlConnector, as the issue and vLLM's own
/// proxy give it: `kv_transfer_params` asking for a remote decode, not
/// streamed, one token in the field the client used, no `min_tokens`,
/// `n` 1; everything else as the client sent it.
fn assert_prefill_leg(leg: &Value, client: &Value) {
    assert_eq!(leg["leg"], "prefill", "{leg}");
    let body = &leg["body"];
    assert_eq!(
        body["kv_transfer_params"],
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
               "remote_block_ids": null, "remote_host": null, "remote_port": null}),
        "{body}"
    );
    assert_eq!(body["stream"], false, "{body}");
    assert!(body.get("stream_options").is_none(), "{body}");
    assert!(body.get("min_tokens").is_none(), "{body}");
    assert_eq!(body["n"], 1, "{body}");
    if client.get("max_completion_tokens").is_some() {
        assert_eq!(body["max_completion_tokens"], 1, "{body}");
        assert!(body.get("max_tokens").is_none(), "{body}");
    } else {
        assert_eq!(body["max_tokens"], 1, "{body}");
        assert!(body.get("max_completion_tokens").is_none(), "{body}");
    }
    for (key, value) in client.as_object().unwrap() {
        if ![
            "stream",
            "stream_options",
            "min_tokens",
            "n",
            "max_tokens",
            "max_completion_tokens",
        ]
        .contains(&key.as_str())
        {
            assert_eq!(&body[key], value, "{key} of {body}");
        }
    }
}

/// The decode leg: the client's body with the prefill's parameters.
fn assert_decode_leg(leg: &Value, client: &Value, prefill: &Proc) -> Value {
    assert_eq!(leg["leg"], "decode", "{leg}");
    let body = &leg["body"];
    let params = &body["kv_transfer_params"];
    assert_eq!(params["do_remote_prefill"], true, "{body}");
    assert_eq!(params["do_remote_decode"], false, "{body}");
    let (host, port) = prefill.addr.rsplit_once(':').unwrap();
    assert_eq!(params["remote_host"], host, "{body}");
    assert_eq!(params["remote_port"], port.parse::<u64>().unwrap(), "{body}");
    assert!(
        params["remote_block_ids"][0].as_array().is_some_and(|b| !b.is_empty()),
        "{body}"
    );
    for (key, value) in client.as_object().unwrap() {
        if key != "stream_options" {
            assert_eq!(&body[key], value, "{key} of {body}");
        }
    }
    params.clone()
}

#[test]
fn vllm_split_requests_carry_both_legs_as_vllm_expects() {
    let (p, d) = (engine("prefill", "vllm-nixl"), engine("decode", "vllm-nixl"));
    let gw = gateway("pd-vllm", &[&p], &[&d], &[]);
    // Prompts that differ from their first block: no decode engine holds
    // any of them, so each is split.
    let prompt = |name: &str| {
        format!(
            "{} Now, the question.",
            system_prompt_of(name)["content"].as_str().unwrap()
        )
    };
    let cases = [
        (
            "/v1/completions",
            json!({"model": "semlb-sim", "prompt": prompt("Ada"), "max_tokens": 8, "min_tokens": 2}),
        ),
        (
            "/v1/completions",
            json!({"model": "semlb-sim", "prompt": prompt("Bea"), "max_tokens": 8, "stream": true}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "semlb-sim", "messages": [system_prompt_of("Cyd"), user("Plain chat.")],
                   "max_completion_tokens": 8}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "semlb-sim", "messages": [system_prompt_of("Dee"), user("Streamed chat.")], "max_tokens": 8,
                   "stream": true, "stream_options": {"include_usage": true}}),
        ),
    ];
    for (i, (path, body)) in cases.iter().enumerate() {
        let r = gw.request("POST", path, Some(body), &[]).expect("request");
        assert_eq!(r.status, 200, "case {i}: {}", r.text());
        assert_eq!(
            r.header("x-semlb-prefill"),
            Some(format!("http://{}", p.addr)).as_deref(),
            "case {i}"
        );
        assert_eq!(
            r.header("x-semlb-backend"),
            Some(format!("http://{}", d.addr)).as_deref(),
            "case {i}"
        );
        let prefilled = received(&p);
        let decoded = received(&d);
        assert_eq!((prefilled.len(), decoded.len()), (i + 1, i + 1), "case {i}");
        let (pl, dl) = (&prefilled[i], &decoded[i]);
        assert_prefill_leg(pl, body);
        assert_decode_leg(dl, body, &p);
        // One request id on both legs.
        assert!(pl["request_id"].as_str().is_some_and(|id| !id.is_empty()), "{pl}");
        assert_eq!(pl["request_id"], dl["request_id"]);
        assert_eq!(
            (pl["outcome"].clone(), dl["outcome"].clone()),
            (json!("completed"), json!("completed"))
        );
        // The decode engine pulled the prompt: it computed one token of it.
        let text = r.text();
        if body["stream"] == true {
            assert!(text.contains("data: [DONE]"), "case {i}: {text}");
        } else {
            let usage = &r.json()["usage"];
            let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap();
            assert_eq!(
                usage["prompt_tokens_details"]["cached_tokens"],
                prompt_tokens - 1,
                "case {i}: {text}"
            );
        }
    }
    let metrics = gw.metrics();
    assert!(
        metrics.contains("semlb_pd_requests_total{path=\"split\"} 4"),
        "{}",
        metrics
            .lines()
            .filter(|l| l.contains("semlb_pd"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// What goes to the decode engine alone: a prefill that stopped at its one
/// token (EOS: no parameters), a request for several choices, and a
/// conversation's next turn whose prompt the decode engine holds.
#[test]
fn vllm_requests_that_need_no_prefill_go_to_decode_alone() {
    let (p, d) = (engine("prefill", "vllm-nixl"), engine("decode", "vllm-nixl"));
    let gw = gateway("pd-alone", &[&p], &[&d], &[]);
    let long = system_prompt()["content"].as_str().unwrap().to_owned();
    // EOS at prefill: a one-token answer ends there, with no parameters.
    let body = json!({"model": "semlb-sim", "prompt": format!("One word. {long}"), "max_tokens": 8});
    let r = completions(&gw, body, &[("x-semlb-output-tokens", "1")]);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-semlb-prefill"), None);
    let (pl, dl) = (received(&p), received(&d));
    assert_eq!((pl.len(), dl.len()), (1, 1));
    assert_eq!(pl[0]["leg"], "prefill");
    assert_eq!(dl[0]["leg"], "plain", "{}", dl[0]);
    assert!(dl[0]["body"].get("kv_transfer_params").is_none());
    // Several choices: never split (the simulator itself refuses n > 1
    // with a 400; the request reached it whole).
    let body = json!({"model": "semlb-sim", "prompt": format!("Two answers. {long}"), "max_tokens": 4, "n": 2});
    let r = completions(&gw, body, &[]);
    assert_eq!(
        r.header("x-semlb-backend"),
        Some(format!("http://{}", d.addr)).as_deref(),
        "{}",
        r.text()
    );
    assert_eq!(received(&p).len(), 1, "no prefill leg for n = 2");
    let dl = received(&d);
    assert_eq!((dl.len(), dl[1]["body"]["n"].clone()), (2, json!(2)));
    assert!(dl[1]["body"].get("kv_transfer_params").is_none());
    // A conversation: turn 1 split, turn 2 (its decode engine holds turn
    // 1's prompt and answer) bypasses prefill.
    let mut messages = vec![system_prompt_of("Eve"), user("First question?")];
    let first = chat(&gw.proc.addr, &messages, json!({}), &[]);
    assert_eq!(first.status, 200, "{}", first.text());
    assert!(first.header("x-semlb-prefill").is_some_and(|v| v != "bypass"));
    messages.push(first.json()["choices"][0]["message"].clone());
    messages.push(user("And the second?"));
    let second = chat(&gw.proc.addr, &messages, json!({}), &[]);
    assert_eq!(second.status, 200, "{}", second.text());
    assert_eq!(second.header("x-semlb-prefill"), Some("bypass"));
    assert_eq!(received(&p).len(), 2, "turn 2 sent no prefill leg");
    let metrics = gw.metrics();
    for (path, n) in [("split", 1), ("bypass", 1), ("decode_only", 2)] {
        let line = format!("semlb_pd_requests_total{{path=\"{path}\"}} {n}");
        assert!(metrics.contains(&line), "{line} in\n{metrics}");
    }
    assert!(metrics.contains("semlb_pd_handoff_failures_total{reason=\"no_params\"} 1"));
}

/// A dead prefill engine: the request is served by its decode engine
/// alone, and the decode engine's health is not touched.
#[test]
fn a_dead_prefill_engine_leaves_the_decode_engine_serving() {
    let (mut p, d) = (engine("prefill", "vllm-nixl"), engine("decode", "vllm-nixl"));
    let gw = gateway("pd-deadp", &[&p], &[&d], &[]);
    p.kill9();
    let long = system_prompt()["content"].as_str().unwrap().to_owned();
    for i in 0..4 {
        let body = json!({"model": "semlb-sim", "prompt": format!("{long} Question {i}."), "max_tokens": 4});
        let r = completions(&gw, body, &[]);
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        assert_eq!(
            r.header("x-semlb-backend"),
            Some(format!("http://{}", d.addr)).as_deref()
        );
    }
    let decode = format!("http://{}", d.addr);
    let servers = wait_for(
        "the dead prefill engine down",
        std::time::Duration::from_secs(10),
        || {
            let r = http(&gw.proc.addr, "GET", "/metrics", None, &[]).unwrap();
            let up = |addr: &str| {
                r.text()
                    .lines()
                    .any(|l| l.starts_with("semlb_server_up{") && l.contains(addr) && l.ends_with(" 1"))
            };
            (!up(&format!("http://{}", p.addr)), up(&decode))
        },
    );
    assert!(servers, "the decode engine stayed up");
}

/// `semlb status` and `semlb shm inspect` show each backend's role.
#[test]
fn status_and_inspect_show_the_roles() {
    let (p, d) = (engine("prefill", "vllm-nixl"), engine("decode", "vllm-nixl"));
    let gw = gateway("pd-status", &[&p], &[&d], &[]);
    let status = support::process::assert_ok(&support::process::run(&["status", "--once", "--shm-name", &gw.shm]));
    for (engine, role) in [(&p, "prefill"), (&d, "decode")] {
        let row = status
            .lines()
            .find(|l| l.contains(&engine.addr))
            .unwrap_or_else(|| panic!("no row for {} in\n{status}", engine.addr));
        assert!(row.split_whitespace().any(|w| w == role), "{role} in {row:?}");
    }
    let inspect = support::process::assert_ok(&support::process::run(&[
        "shm",
        "inspect",
        "--json",
        "--shm-name",
        &gw.shm,
    ]));
    let v: Value = serde_json::from_str(&inspect).unwrap();
    let roles: Vec<(String, String)> = v["servers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["address"].as_str().unwrap().to_owned(),
                s["role"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert!(
        roles.contains(&(format!("http://{}", p.addr), "prefill".into())),
        "{roles:?}"
    );
    assert!(
        roles.contains(&(format!("http://{}", d.addr), "decode".into())),
        "{roles:?}"
    );
}

#[test]
fn sglang_legs_meet_at_the_prefill_engines_bootstrap_server() {
    let (p, d) = (engine("prefill", "sglang"), engine("decode", "sglang"));
    let port = support::gateway::bootstrap_port(&p.line).expect("a bootstrap port on the first line");
    // No port given: the gateway reads it from the engine's /server_info.
    let gw = gateway("pd-sglang", &[&p], &[&d], &["--pd-protocol", "sglang"]);
    assert_eq!(learned_bootstrap_port(&gw, &p), port);
    // SGLang numbers the rooms of `n` sequences itself: `n` 2 is split too
    // (the simulator answers it 400, `n > 1` being beyond what it plays).
    for (i, (stream, n)) in [(false, 1), (true, 1), (false, 2)].into_iter().enumerate() {
        let r = chat(
            &gw.proc.addr,
            &[system_prompt(), user(&format!("Question {i}?"))],
            json!({"stream": stream, "n": n}),
            &[],
        );
        if n > 1 {
            // Split: the decode leg carries the room. The simulator's 400
            // may come before the prefill leg reached its engine (the legs
            // run at once, and the answer ends both): its room is compared
            // only if it came.
            assert_eq!(r.status, 400, "{}", r.text());
            assert_eq!(
                r.header("x-semlb-prefill"),
                Some(format!("http://{}", p.addr)).as_deref()
            );
            let (pl, dl) = (received(&p), received(&d));
            assert_eq!(dl[i]["body"]["n"], json!(n), "{}", dl[i]);
            assert!(dl[i]["body"]["bootstrap_room"].as_u64().is_some(), "{}", dl[i]);
            if let Some(pl) = pl.get(i) {
                assert_eq!(pl["body"]["bootstrap_room"], dl[i]["body"]["bootstrap_room"]);
                assert_eq!(pl["body"]["n"], json!(n));
            }
            continue;
        }
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(
            r.header("x-semlb-prefill"),
            Some(format!("http://{}", p.addr)).as_deref()
        );
        let (pl, dl) = (received(&p), received(&d));
        let (pl, dl) = (&pl[i], &dl[i]);
        for field in ["bootstrap_host", "bootstrap_port", "bootstrap_room"] {
            assert_eq!(pl["body"][field], dl["body"][field], "{field}: {pl} {dl}");
        }
        assert_eq!(pl["body"]["bootstrap_port"], port);
        assert_eq!(pl["body"]["bootstrap_host"], "127.0.0.1");
        assert!(pl["body"]["bootstrap_room"].as_u64().is_some_and(|r| r < 1 << 63));
        assert_eq!(pl["body"]["messages"], dl["body"]["messages"]);
        assert_eq!(
            (pl["leg"].clone(), dl["leg"].clone()),
            (json!("prefill"), json!("decode"))
        );
        let done = wait_for("the prefill leg completed", std::time::Duration::from_secs(10), || {
            let outcome = received(&p)[i]["outcome"].clone();
            (outcome == "completed", outcome)
        });
        assert_eq!(done, "completed");
        assert_eq!(dl["outcome"], "completed");
    }
}

/// A client that leaves while its legs run (SGLang: both at once) ends
/// both: each engine sees its client go away.
#[test]
fn a_client_that_leaves_ends_both_legs() {
    use std::io::Write;
    // Real time: the prefill of this prompt takes its engine about half a
    // second, time enough to see both legs running.
    let (p, d) = (engine_at("prefill", "sglang", "1"), engine_at("decode", "sglang", "1"));
    let port = support::gateway::bootstrap_port(&p.line).expect("a bootstrap port");
    let config = format!(
        "[pd]\nprotocol = \"sglang\"\n\n[[backend]]\nurl = \"http://{}\"\nrole = \"prefill\"\nbootstrap_port = {port}\n\n\
         [[backend]]\nurl = \"http://{}\"\nrole = \"decode\"\n",
        p.addr, d.addr
    );
    let gw = Gateway::builder().tag("pd-leave").config(&config).start();
    let prompt = " alpha".repeat(5000);
    let body = json!({"model": "semlb-sim", "prompt": prompt, "max_tokens": 64, "stream": true}).to_string();
    let mut client = std::net::TcpStream::connect(&gw.proc.addr).unwrap();
    write!(
        client,
        "POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let running = |e: &Proc| received(e).first().is_some_and(|r| r["outcome"] == "running");
    wait_for("both legs running", std::time::Duration::from_secs(10), || {
        (running(&p) && running(&d), ())
    });
    drop(client);
    let ended = wait_for("both legs ended", std::time::Duration::from_secs(10), || {
        let (pl, dl) = (received(&p), received(&d));
        let outcomes = (pl[0]["outcome"].clone(), dl[0]["outcome"].clone());
        (outcomes.0 != "running" && outcomes.1 != "running", outcomes)
    });
    assert_eq!(
        ended,
        (json!("aborted"), json!("aborted")),
        "{:?} {:?}",
        received(&p),
        received(&d)
    );
}

/// With the routing state in Redis and a tenant limited to three requests
/// a minute, split requests are routed and charged as any: three pass (each
/// split: a leg is no request of its own), the fourth gets the 429.
#[test]
fn split_requests_are_charged_once_with_the_state_in_redis() {
    let Some(redis) = support::redis::RedisServer::start() else {
        return;
    };
    let dir = support::TempDir::new("pd-keys");
    let file = dir.0.join("keys.toml").display().to_string();
    let key = support::gateway::add_key(&file, "agents", &[]).0;
    support::gateway::limit_tenant(&file, "agents", &["--requests-per-minute", "3"]);
    let (p, d) = (engine("prefill", "vllm-nixl"), engine("decode", "vllm-nixl"));
    let gw = Gateway::builder()
        .tag("pd-redis")
        .redis(&redis.url(), "pd")
        .config(&format!("[auth]\nkeys_file = \"{file}\"\ndebug_headers = true\n"))
        .args(&[
            "--prefill".to_owned(),
            format!("http://{}", p.addr),
            "--decode".to_owned(),
            format!("http://{}", d.addr),
        ])
        .start();
    let bearer = format!("Bearer {key}");
    for i in 0..3 {
        let r = chat(
            &gw.proc.addr,
            &[system_prompt_of(&format!("Agent {i}")), user("Go.")],
            json!({"stream": true}),
            &[("authorization", &bearer)],
        );
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        assert_eq!(
            r.header("x-semlb-prefill"),
            Some(format!("http://{}", p.addr)).as_deref()
        );
    }
    let r = chat(
        &gw.proc.addr,
        &[system_prompt_of("Agent 3"), user("Go.")],
        json!({"stream": true}),
        &[("authorization", &bearer)],
    );
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!((received(&p).len(), received(&d).len()), (3, 3));
}

/// Two decode engines: conversations spread over them by load, and each
/// stays on the engine that decoded its first turn, whose later turns skip
/// prefill (that engine holds the whole conversation).
#[test]
fn conversations_stay_on_their_decode_engine_and_skip_prefill() {
    let p = engine("prefill", "vllm-nixl");
    let (d1, d2) = (engine("decode", "vllm-nixl"), engine("decode", "vllm-nixl"));
    // One dispatcher: the conversations come one after another, so every
    // first turn finds both engines idle and the tie goes in turn, and
    // each dispatcher process keeps its own turn (with two, both may start
    // on the same engine: 3 and 1 were seen).
    let gw = gateway("pd-conv", &[&p], &[&d1, &d2], &["--dispatchers", "1"]);
    let mut homes = Vec::new();
    for c in 0..4 {
        let mut messages = vec![system_prompt_of(&format!("Guide {c}")), user("Where do we start?")];
        let mut home = None;
        for turn in 0..3 {
            let r = chat(&gw.proc.addr, &messages, json!({"stream": true}), &[]);
            assert_eq!(r.status, 200, "conversation {c}, turn {turn}: {}", r.text());
            let backend = r.header("x-semlb-backend").unwrap().to_owned();
            let prefill = r.header("x-semlb-prefill").unwrap().to_owned();
            match &home {
                None => {
                    assert_eq!(
                        prefill,
                        format!("http://{}", p.addr),
                        "conversation {c}: turn 1 is split"
                    );
                    home = Some(backend);
                }
                Some(home) => {
                    assert_eq!(&backend, home, "conversation {c}, turn {turn} left its decode engine");
                    assert_eq!(prefill, "bypass", "conversation {c}, turn {turn}");
                }
            }
            let (answer, _) = support::gateway::stream_text(&r);
            messages.push(json!({"role": "assistant", "content": answer}));
            messages.push(user(&format!("And then, step {turn}?")));
        }
        homes.push(home.unwrap());
    }
    for d in [&d1, &d2] {
        let n = homes.iter().filter(|h| h.ends_with(&d.addr)).count();
        assert_eq!(n, 2, "conversations per decode engine: {homes:?}");
    }
    assert_eq!(received(&p).len(), 4, "one prefill leg per conversation");
}

/// A dead decode engine: the decode leg goes to the other one, with the
/// parameters the prefill handed over (one prefill leg per request), and
/// the prefill engine stays up.
#[test]
fn a_dead_decode_engine_is_routed_around_with_the_prefill_it_had() {
    let p = engine("prefill", "vllm-nixl");
    let (mut d1, d2) = (engine("decode", "vllm-nixl"), engine("decode", "vllm-nixl"));
    let gw = gateway("pd-deadd", &[&p], &[&d1, &d2], &[]);
    d1.kill9();
    for i in 0..6 {
        let r = chat(
            &gw.proc.addr,
            &[system_prompt_of(&format!("Pilot {i}")), user("Status?")],
            json!({"stream": true}),
            &[],
        );
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        assert_eq!(
            r.header("x-semlb-backend"),
            Some(format!("http://{}", d2.addr)).as_deref()
        );
        assert_eq!(
            r.header("x-semlb-prefill"),
            Some(format!("http://{}", p.addr)).as_deref()
        );
    }
    assert_eq!(received(&p).len(), 6, "one prefill leg per request, retries included");
    let decoded = received(&d2);
    assert_eq!(decoded.len(), 6);
    assert!(
        decoded
            .iter()
            .all(|r| r["leg"] == "decode" && r["outcome"] == "completed")
    );
    assert!(is_up(&gw, &p), "the prefill engine stays up");
}

/// Roles at runtime: a prefill engine added through the admin API is
/// listed with its role, and the next request of the pool is split.
#[test]
fn a_prefill_engine_added_through_the_admin_api_splits_the_next_request() {
    let (p, d) = (engine("prefill", "vllm-nixl"), engine("decode", "vllm-nixl"));
    let gw = Gateway::builder()
        .tag("pd-admin")
        .admin("a-long-enough-admin-token")
        .args(&["--decode".to_owned(), format!("http://{}", d.addr)])
        .start();
    let ask = |name: &str| chat(&gw.proc.addr, &[system_prompt_of(name), user("Hi.")], json!({}), &[]);
    let before = ask("Before");
    assert_eq!(before.status, 200, "{}", before.text());
    assert_eq!(before.header("x-semlb-prefill"), None, "no prefill engine yet");
    let decode = gw
        .admin_server(&format!("http://{}", d.addr))
        .expect("the decode engine listed");
    assert_eq!(
        (decode["role"].clone(), decode["bootstrap_port"].clone()),
        (json!("decode"), Value::Null)
    );
    let body = format!(r#"{{"url": "http://{}", "role": "prefill"}}"#, p.addr);
    let r = gw.admin("POST", "/admin/servers", Some(&body));
    assert_eq!(r.status, 201, "{r:?}");
    let prefill = gw
        .admin_server(&format!("http://{}", p.addr))
        .expect("the prefill engine listed");
    assert_eq!(prefill["role"], "prefill");
    let after = ask("After");
    assert_eq!(after.status, 200, "{}", after.text());
    assert_eq!(
        after.header("x-semlb-prefill"),
        Some(format!("http://{}", p.addr)).as_deref()
    );
    // A role that is not one: the admin API's 400.
    let body = r#"{"url": "http://127.0.0.1:9", "role": "producer"}"#;
    assert_eq!(gw.admin("POST", "/admin/servers", Some(body)).status, 400);
}

/// vLLM: a client that leaves during the prefill leg ends it, and no
/// decode leg is sent.
#[test]
fn a_client_that_leaves_during_the_prefill_ends_it() {
    use std::io::Write;
    let (p, d) = (
        engine_at("prefill", "vllm-nixl", "1"),
        engine_at("decode", "vllm-nixl", "1"),
    );
    let gw = gateway("pd-leave-v", &[&p], &[&d], &[]);
    let body =
        json!({"model": "semlb-sim", "prompt": " beta".repeat(5000), "max_tokens": 64, "stream": true}).to_string();
    let mut client = std::net::TcpStream::connect(&gw.proc.addr).unwrap();
    write!(
        client,
        "POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    wait_for("the prefill leg running", std::time::Duration::from_secs(10), || {
        (received(&p).first().is_some_and(|r| r["outcome"] == "running"), ())
    });
    drop(client);
    let outcome = wait_for("the prefill leg ended", std::time::Duration::from_secs(10), || {
        let outcome = received(&p)[0]["outcome"].clone();
        (outcome != "running", outcome)
    });
    assert_eq!(outcome, "aborted");
    assert!(received(&d).is_empty(), "no decode leg: {:?}", received(&d));
}

/// SGLang: a decode engine cannot serve a request alone (it waits for a
/// prefill partner). With no prefill engine in the pool a request goes to
/// an aggregated engine (role `both`), or, with none, gets a clear 503;
/// the decode engine never sees it.
#[test]
fn sglang_without_a_prefill_engine_goes_to_an_aggregated_engine_or_is_refused() {
    let (d, b) = (engine("decode", "sglang"), engine("both", "sglang"));
    let config = format!(
        "[pd]\nprotocol = \"sglang\"\n\n[[backend]]\nurl = \"http://{}\"\nrole = \"decode\"\n\n\
         [[backend]]\nurl = \"http://{}\"\nrole = \"both\"\n",
        d.addr, b.addr
    );
    let gw = Gateway::builder().tag("pd-sg-whole").config(&config).start();
    for i in 0..4 {
        let r = chat(
            &gw.proc.addr,
            &[system_prompt_of(&format!("Whole {i}")), user("Hi.")],
            json!({"stream": i % 2 == 0}),
            &[],
        );
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(
            r.header("x-semlb-backend"),
            Some(format!("http://{}", b.addr)).as_deref()
        );
        assert_eq!(r.header("x-semlb-prefill"), None);
    }
    assert!(received(&d).is_empty(), "{:?}", received(&d));
    assert_eq!(received(&b).len(), 4);

    let gw = Gateway::builder()
        .tag("pd-sg-none")
        .config(&format!(
            "[pd]\nprotocol = \"sglang\"\n\n[[backend]]\nurl = \"http://{}\"\nrole = \"decode\"\n",
            d.addr
        ))
        .start();
    let r = chat(&gw.proc.addr, &[system_prompt(), user("Hi.")], json!({}), &[]);
    assert_eq!(r.status, 503, "{}", r.text());
    let error = &r.json()["error"];
    assert_eq!(error["code"], "no_server_available", "{error}");
    assert!(
        error["message"]
            .as_str()
            .is_some_and(|m| m.contains("no prefill engine is up")),
        "{error}"
    );
    assert!(received(&d).is_empty(), "{:?}", received(&d));
}

/// SGLang: a prefill leg that fails ends its decode leg (which would wait
/// for it) and the request is split again on another prefill engine; the
/// decode engine is not blamed. The failing engine is stopped with
/// SIGSTOP: its leg runs into `pd.prefill_timeout_secs`.
#[test]
fn a_failed_sglang_prefill_leg_ends_its_decode_leg_and_is_tried_elsewhere() {
    failed_sglang_prefill_leg_is_tried_elsewhere("pd-sg-fail", false);
}

/// The same for a streamed answer, whose decode leg sends its head at once
/// and its first token only once the prefill leg handed over: a prefill
/// leg failing in between is tried elsewhere too, and the client gets the
/// whole stream (not one cut after its head).
#[test]
fn a_failed_sglang_prefill_leg_before_a_streams_first_token_is_tried_elsewhere() {
    failed_sglang_prefill_leg_is_tried_elsewhere("pd-sg-fail-s", true);
}

fn failed_sglang_prefill_leg_is_tried_elsewhere(tag: &str, stream: bool) {
    use nix::sys::signal::Signal;
    let (p1, p2, d) = (
        engine("prefill", "sglang"),
        engine("prefill", "sglang"),
        engine("decode", "sglang"),
    );
    let config = format!(
        "[pd]\nprotocol = \"sglang\"\nprefill_timeout_secs = 1\n\n[policy]\nkind = \"cache_aware\"\n\n\
         [[backend]]\nurl = \"http://{}\"\nrole = \"prefill\"\nbootstrap_port = {}\n\n\
         [[backend]]\nurl = \"http://{}\"\nrole = \"prefill\"\nbootstrap_port = {}\n\n\
         [[backend]]\nurl = \"http://{}\"\nrole = \"decode\"\n",
        p1.addr,
        support::gateway::bootstrap_port(&p1.line).expect("a bootstrap port"),
        p2.addr,
        support::gateway::bootstrap_port(&p2.line).expect("a bootstrap port"),
        d.addr
    );
    let gw = Gateway::builder().tag(tag).config(&config).start();
    let ask = |q: &str| {
        chat(
            &gw.proc.addr,
            &[system_prompt(), user(q)],
            json!({"stream": stream}),
            &[],
        )
    };
    let first = ask("First?");
    assert_eq!(first.status, 200, "{}", first.text());
    let warm = first.header("x-semlb-prefill").expect("split").to_owned();
    let (stopped, other) = if warm.ends_with(&p1.addr) {
        (&p1, &p2)
    } else {
        (&p2, &p1)
    };
    // The prompt is warm on `stopped`: the next turn's prefill goes there.
    stopped.signal(Signal::SIGSTOP);
    let second = ask("Second?");
    stopped.signal(Signal::SIGCONT);
    assert_eq!(second.status, 200, "{}", second.text());
    if stream {
        assert!(second.text().trim_end().ends_with("data: [DONE]"), "{}", second.text());
    }
    assert_eq!(
        second.header("x-semlb-prefill"),
        Some(format!("http://{}", other.addr)).as_deref()
    );
    assert_eq!(
        second.header("x-semlb-backend"),
        Some(format!("http://{}", d.addr)).as_deref()
    );
    let decoded = received(&d);
    let outcomes: Vec<_> = decoded.iter().map(|r| r["outcome"].as_str().unwrap_or("")).collect();
    assert_eq!(outcomes, ["completed", "aborted", "completed"], "{decoded:?}");
    // The ended decode leg waited in the stopped engine's room.
    assert_eq!(decoded[1]["body"]["bootstrap_host"], "127.0.0.1");
    assert_ne!(
        decoded[1]["body"]["bootstrap_room"],
        decoded[2]["body"]["bootstrap_room"]
    );
    let metrics = gw.metrics();
    assert!(
        metrics.contains("semlb_pd_handoff_failures_total{reason=\"prefill_failed\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("semlb_pd_requests_total{path=\"split\"} 2"),
        "{metrics}"
    );
    // Three prefill legs (one failed); two decode legs answered (the one
    // ended before its answer began is not a leg that answered).
    assert!(metrics.contains("semlb_pd_prefill_seconds_count 3"), "{metrics}");
    assert!(metrics.contains("semlb_pd_decode_seconds_count 2"), "{metrics}");
    assert!(is_up(&gw, &d), "the decode engine stays up");
}

/// SGLang: a decode leg that fails (its engine killed) ends its prefill
/// leg, which would otherwise wait in its room for a partner that never
/// comes; the request is split again with another decode engine.
#[test]
fn a_failed_sglang_decode_leg_ends_its_prefill_leg() {
    let p = engine("prefill", "sglang");
    let (mut d1, d2) = (engine("decode", "sglang"), engine("decode", "sglang"));
    let gw = gateway("pd-sg-deadd", &[&p], &[&d1, &d2], &["--pd-protocol", "sglang"]);
    let port = support::gateway::bootstrap_port(&p.line).expect("a bootstrap port");
    assert_eq!(learned_bootstrap_port(&gw, &p), port);
    d1.kill9();
    for i in 0..4 {
        let r = chat(
            &gw.proc.addr,
            &[system_prompt_of(&format!("Navigator {i}")), user("Course?")],
            json!({"stream": i % 2 == 1}),
            &[],
        );
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        assert_eq!(
            r.header("x-semlb-backend"),
            Some(format!("http://{}", d2.addr)).as_deref()
        );
    }
    // Every prefill leg ends: completed with its decode leg, or aborted
    // with the one that failed (none left waiting in its room).
    let legs = wait_for("every prefill leg ended", std::time::Duration::from_secs(10), || {
        let legs = received(&p);
        (legs.iter().all(|l| l["outcome"] != "running"), legs)
    });
    let outcomes: Vec<_> = legs.iter().map(|l| l["outcome"].as_str().unwrap_or("")).collect();
    assert_eq!(outcomes.iter().filter(|o| **o == "completed").count(), 4, "{legs:?}");
    assert!(
        outcomes.iter().all(|o| *o == "completed" || *o == "aborted"),
        "{legs:?}"
    );
    assert!(received(&d2).iter().all(|l| l["outcome"] == "completed"));
}

/// `[policy.prefix] confirm_window_secs` of [`precise_gateway`].
const CONFIRM_WINDOW_S: u64 = 1;

/// How long an engine's KV events may take to reach the confirmed table.
const EVENTS_PATIENCE: Duration = Duration::from_secs(20);

/// `semlb serve` in precise prefix mode (`cache_aware`, one dispatcher)
/// over these prefill and decode engines, following every engine's KV
/// events, with learning at dispatch off: nothing the gateway sends is
/// recorded for an engine, so what a prefill engine holds is known from
/// its events alone, and a decode engine's answers, written back by the
/// response process, count only for the confirm window.
fn precise_gateway(tag: &str, prefill: &[&Proc], decode: &[&Proc]) -> Gateway {
    let table = |engine: &Proc, role: &str| {
        let table = kv_backend_table(engine).expect("the engine publishes KV events");
        format!("{table}role = \"{role}\"\n")
    };
    let backends: String = prefill
        .iter()
        .map(|p| table(p, "prefill"))
        .chain(decode.iter().map(|d| table(d, "decode")))
        .collect();
    let config = format!(
        "learn_at_dispatch = false\n{backends}\n[policy]\nkind = \"cache_aware\"\n\n\
         [policy.prefix]\nsource = \"precise\"\nconfirm_window_secs = {CONFIRM_WINDOW_S}\n"
    );
    Gateway::builder().tag(tag).dispatchers(1).config(&config).start()
}

/// `engine`'s current registration in `gw`'s server table.
fn server_of(gw: &Gateway, engine: &Proc) -> ServerRef {
    gw.listed(engine)
        .map(|s| s.server)
        .unwrap_or_else(|| panic!("{} is not registered", engine.addr))
}

/// Leading blocks of `chain` the confirmed table (what the engines' events
/// said) lists `engine` for.
fn confirmed_depth(gw: &Gateway, engine: &Proc, chain: &[u64]) -> u32 {
    let tag = server_of(gw, engine).tag();
    gw.segment
        .tables()
        .confirmed
        .longest_prefix_match(chain, |s| s == tag)
        .blocks_for(tag)
}

/// The block chain `gw` hashes a request `body` to (`semlb tokenize` on
/// its segment: the dispatcher's own parsing, rendering and hashing).
fn chain_of(gw: &Gateway, body: &Value) -> Vec<u64> {
    let out = support::process::run(&["tokenize", "--json", "--shm-name", &gw.shm, "--body", &body.to_string()]);
    let v: Value = serde_json::from_str(&support::process::assert_ok(&out)).expect("tokenize --json");
    v["blocks"]
        .as_array()
        .expect("blocks")
        .iter()
        .map(|b| u64::from_str_radix(b.as_str().expect("a hex block hash"), 16).expect("hex"))
        .collect()
}

/// Precise mode over a vLLM P/D fleet learns from the KV events of both
/// roles, and from nothing else: a long prompt that a prefill engine
/// computed (and the gateway never saw) gets its prefill leg there, and
/// a conversation's next turn, once the gateway's own record of its
/// first answer is past the confirm window, goes to the decode engine
/// whose events say it holds the first turn (pulled, then decoded), with
/// no prefill leg.
#[test]
fn precise_mode_routes_both_legs_on_the_events_of_both_roles() {
    let protocol = "vllm-nixl";
    let prefill = [
        engine_publishing("prefill", protocol),
        engine_publishing("prefill", protocol),
    ];
    let decode = [
        engine_publishing("decode", protocol),
        engine_publishing("decode", protocol),
    ];
    let gw = precise_gateway("pd-precise", &[&prefill[0], &prefill[1]], &[&decode[0], &decode[1]]);
    let engines = [&prefill[0], &prefill[1], &decode[0], &decode[1]];
    wait_for(
        "every engine's events followed from their start",
        EVENTS_PATIENCE,
        || {
            let states: Vec<_> = engines
                .iter()
                .map(|e| gw.segment.tables().servers.kv_events(server_of(&gw, e)))
                .collect();
            (states.iter().all(|s| *s == Some(KvEventsSync::Complete)), states)
        },
    );

    // Prefill role. Four long prompts (40 blocks, past the bypass), each
    // computed by a prefill engine directly, two by each, in an order no
    // choice blind to the events gives (in turn alternates, by load picks
    // one engine for all): only the prefill engines' events tell the
    // gateway where they are.
    let holders = [0, 0, 1, 1];
    let prompt = |i: u32| -> Vec<u32> { (0..40 * 16 + 5).map(|t| 1000 + i * 7919 + t).collect() };
    let body = |i: u32| json!({"model": "semlb-sim", "prompt": prompt(i), "max_tokens": 8});
    for (i, &h) in holders.iter().enumerate() {
        let r = http(&prefill[h].addr, "POST", "/v1/completions", Some(&body(i as u32)), &[]).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
    for (i, &h) in holders.iter().enumerate() {
        let chain = chain_of(&gw, &body(i as u32));
        assert_eq!(chain.len(), 40);
        wait_for(
            &format!("prompt {i} confirmed on prefill engine {h}"),
            EVENTS_PATIENCE,
            || {
                let d = confirmed_depth(&gw, &prefill[h], &chain);
                (d == 40, d)
            },
        );
    }
    for (i, &h) in holders.iter().enumerate() {
        let r = completions(&gw, body(i as u32), &[]);
        assert_eq!(r.status, 200, "prompt {i}: {}", r.text());
        assert_eq!(
            r.header("x-semlb-prefill"),
            Some(format!("http://{}", prefill[h].addr)).as_deref(),
            "prompt {i}'s prefill leg goes to the engine that holds it"
        );
        let legs = received(&prefill[h]);
        assert_eq!(legs.last().unwrap()["leg"], "prefill", "{legs:?}");
    }

    // Decode role. A conversation's first turn is split; the decode engine
    // that served it pulled its prompt and decoded its answer (32 tokens:
    // two blocks at least past the prompt's).
    let chat_body = |messages: &[Value]| json!({"model": "semlb-sim", "messages": messages, "max_tokens": 32});
    let answer_length = [("x-semlb-output-tokens", "32")];
    let mut messages = vec![system_prompt_of("Archivist"), user("Where is the first record?")];
    let first = gw
        .request(
            "POST",
            "/v1/chat/completions",
            Some(&chat_body(&messages)),
            &answer_length,
        )
        .expect("request");
    assert_eq!(first.status, 200, "{}", first.text());
    assert!(
        first.header("x-semlb-prefill").is_some_and(|p| p != "bypass"),
        "turn 1 is split: {:?}",
        first.header("x-semlb-prefill")
    );
    let home = first.header("x-semlb-backend").expect("x-semlb-backend").to_owned();
    let home = decode
        .iter()
        .find(|d| home == format!("http://{}", d.addr))
        .unwrap_or_else(|| panic!("{home} is not a decode engine"));
    let usage = &first.json()["usage"];
    let computed = usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap() - 1;
    let turn1 = chain_of(&gw, &chat_body(&messages));
    messages.push(first.json()["choices"][0]["message"].clone());
    messages.push(user("And where is the second?"));
    let turn2 = chain_of(&gw, &chat_body(&messages));
    // Its events: the pulled prompt's blocks, then the blocks its answer
    // filled (turn 2's prompt starts with both).
    let held = wait_for(
        "turn 1's prompt and answer confirmed on its decode engine",
        EVENTS_PATIENCE,
        || {
            let d = confirmed_depth(&gw, home, &turn2);
            (u64::from(d) == computed / 16, d)
        },
    );
    assert!(
        held as usize > turn1.len(),
        "the answer's blocks too: {held} of {}",
        turn1.len()
    );
    // The gateway's own entries for turn 1 (its answer written back) count
    // for the confirm window: past it, only the events do (segment
    // stamps are whole seconds: one more).
    gw.written_back(semlb::metrics::responder_records);
    let written_s = gw.segment.clock().now_ms() / 1000;
    wait_for("the confirm window over", EVENTS_PATIENCE, || {
        let now_s = gw.segment.clock().now_ms() / 1000;
        (now_s > written_s + CONFIRM_WINDOW_S + 1, now_s)
    });
    let legs_before = (received(&prefill[0]).len(), received(&prefill[1]).len());
    let second = gw
        .request(
            "POST",
            "/v1/chat/completions",
            Some(&chat_body(&messages)),
            &answer_length,
        )
        .expect("request");
    assert_eq!(second.status, 200, "{}", second.text());
    assert_eq!(
        (second.header("x-semlb-backend"), second.header("x-semlb-prefill")),
        (Some(format!("http://{}", home.addr)).as_deref(), Some("bypass")),
        "turn 2 goes to the decode engine that holds turn 1, without a prefill leg"
    );
    assert_eq!(
        (received(&prefill[0]).len(), received(&prefill[1]).len()),
        legs_before,
        "no prefill leg for turn 2"
    );
    let cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    assert!(
        cached >= u64::from(held) * 16,
        "the decode engine found turn 1 cached: {cached}"
    );
}

/// The response cache applies to split requests as to any: an exact
/// repeat is answered by the gateway, and neither engine sees a leg.
#[test]
fn a_repeated_split_request_is_answered_from_the_cache_without_a_leg() {
    let (p, d) = (engine("prefill", "vllm-nixl"), engine("decode", "vllm-nixl"));
    let gw = gateway("pd-cache", &[&p], &[&d], &[]);
    let messages = [system_prompt_of("Librarian"), user("Which shelf?")];
    let deterministic = json!({"temperature": 0});
    let first = chat(&gw.proc.addr, &messages, deterministic.clone(), &[]);
    assert_eq!(first.status, 200, "{}", first.text());
    assert_eq!(first.header("x-semlb-cache"), Some("miss"));
    assert_eq!(
        first.header("x-semlb-prefill"),
        Some(format!("http://{}", p.addr)).as_deref()
    );
    gw.written_back(semlb::metrics::responder_records);
    let again = chat(&gw.proc.addr, &messages, deterministic, &[]);
    assert_eq!(again.header("x-semlb-cache"), Some("hit"), "{}", again.text());
    assert_eq!(again.json()["choices"], first.json()["choices"]);
    assert_eq!(
        (received(&p).len(), received(&d).len()),
        (1, 1),
        "no leg for the repeat"
    );
    let metrics = gw.metrics();
    assert!(
        metrics.contains("semlb_pd_requests_total{path=\"split\"} 1"),
        "{metrics}"
    );
}

/// SGLang: a request whose prefill leg failed on two prefill engines goes
/// whole to an aggregated engine, and the answer names no prefill engine.
/// Both prefill engines are stopped (SIGSTOP): each leg runs into
/// `pd.prefill_timeout_secs`.
#[test]
fn an_sglang_request_whose_prefill_failed_twice_goes_whole_to_an_aggregated_engine() {
    use nix::sys::signal::Signal;
    let (p1, p2) = (engine("prefill", "sglang"), engine("prefill", "sglang"));
    let (d, b) = (engine("decode", "sglang"), engine("both", "sglang"));
    let mut config = "[pd]\nprotocol = \"sglang\"\nprefill_timeout_secs = 1\n\n".to_owned();
    for p in [&p1, &p2] {
        let port = support::gateway::bootstrap_port(&p.line).expect("a bootstrap port");
        config += &format!(
            "[[backend]]\nurl = \"http://{}\"\nrole = \"prefill\"\nbootstrap_port = {port}\n\n",
            p.addr
        );
    }
    config += &format!(
        "[[backend]]\nurl = \"http://{}\"\nrole = \"decode\"\n\n[[backend]]\nurl = \"http://{}\"\nrole = \"both\"\n",
        d.addr, b.addr
    );
    // The first decode choice, among idle engines tied on every count, is
    // the first in table order: `d` (asserted below through its legs).
    // One dispatcher: ties rotate per process.
    let gw = Gateway::builder()
        .tag("pd-sg-twice")
        .dispatchers(1)
        .config(&config)
        .start();
    p1.signal(Signal::SIGSTOP);
    p2.signal(Signal::SIGSTOP);
    let r = chat(&gw.proc.addr, &[system_prompt(), user("Anyone?")], json!({}), &[]);
    p1.signal(Signal::SIGCONT);
    p2.signal(Signal::SIGCONT);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.header("x-semlb-backend"),
        Some(format!("http://{}", b.addr)).as_deref()
    );
    assert_eq!(r.header("x-semlb-prefill"), None, "no failed prefill engine named");
    assert_eq!(received(&b).len(), 1);
    // The request was split first (on `d`), and every split attempt's
    // decode leg was ended with its failed prefill leg: the second attempt
    // goes to `d` again (then whole after a second failure) or, as ties
    // rotate, to `b` at once.
    let decoded = received(&d);
    assert!(
        !decoded.is_empty() && decoded.iter().all(|l| l["outcome"] == "aborted"),
        "{decoded:?}"
    );
    let failures = gw
        .metrics()
        .lines()
        .find_map(|l| l.strip_prefix("semlb_pd_handoff_failures_total{reason=\"prefill_failed\"} "))
        .and_then(|v| v.parse::<u32>().ok());
    assert_eq!(failures, Some(decoded.len() as u32));
}
