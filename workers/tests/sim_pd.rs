//! Disaggregated prefill/decode between real `semlb-sim` processes: the
//! two legs of vLLM's NixlConnector handoff (the prefill's
//! `kv_transfer_params`, the decode's pull over the side channel, the
//! recompute fallbacks, EOS at prefill, the pin's expiry) and of SGLang's
//! bootstrap rendezvous (the legs meet, a prefill without a room is
//! refused, an unpaired leg times out, a cancelled leg fails its partner
//! at once), and `/sim/requests`. Each test starts its simulators on free
//! ports at a fast time scale and talks HTTP to them; waits poll the
//! simulators' own counters with a deadline, and no pass/fail depends on
//! real time beyond that deadline.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use semlb_test_support as support;
use serde_json::{Value, json};
use support::gateway::{bootstrap_port, kv_endpoints, sample, wait_for};
use support::http::{Response, http, request_bytes};
use support::process::{Proc, ProcBuilder, Stderr};

const MODEL: &str = "pd-model";

/// Bound on any wait.
const PATIENCE: Duration = Duration::from_secs(20);

/// A `semlb-sim` process with `extra` flags, at 100x real time unless
/// they name a time scale.
fn sim(extra: &[&str]) -> Proc {
    let mut args = vec!["--listen", "127.0.0.1:0", "--model", MODEL];
    if !extra.contains(&"--time-scale") {
        args.extend(["--time-scale", "0.01"]);
    }
    args.extend_from_slice(extra);
    ProcBuilder::new(args)
        .program(env!("CARGO_BIN_EXE_semlb-sim"))
        .what("semlb-sim")
        .stderr(Stderr::CaptureEcho)
        .start()
}

fn post(sim: &Proc, path: &str, body: &Value, headers: &[(&str, &str)]) -> Response {
    http(&sim.addr, "POST", path, Some(body), headers).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn get(sim: &Proc, path: &str) -> Response {
    http(&sim.addr, "GET", path, None, &[]).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// A sample of `/sim/metrics` (0 when absent).
fn metric(sim: &Proc, series: &str) -> f64 {
    let text = String::from_utf8(get(sim, "/sim/metrics").body).expect("text");
    sample(&text, series).unwrap_or(0.0)
}

/// The requests a simulator recorded.
fn requests(sim: &Proc) -> Vec<Value> {
    get(sim, "/sim/requests").json()["requests"]
        .as_array()
        .expect("a list")
        .clone()
}

/// A prompt of `n` token ids from `base` (no tokenizer in the way: the
/// prefix two prompts share is exact).
fn ids(base: u32, n: u32) -> Vec<u32> {
    (base..base + n).collect()
}

fn ok(r: &Response, what: &str) -> Value {
    assert_eq!(r.status, 200, "{what}: {}", String::from_utf8_lossy(&r.body));
    r.json()
}

/// vLLM's prefill-leg params, in the form the router sends (`with_nulls`:
/// vLLM's own proxy's, with the remote fields null).
fn prefill_params(with_nulls: bool) -> Value {
    if with_nulls {
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
               "remote_block_ids": null, "remote_host": null, "remote_port": null})
    } else {
        json!({"do_remote_decode": true, "do_remote_prefill": false})
    }
}

/// A vLLM prefill leg of `prompt` on `prefill`: its answer.
fn prefill_leg(prefill: &Proc, prompt: &[u32]) -> Value {
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1, "stream": false,
                      "kv_transfer_params": prefill_params(false)});
    ok(&post(prefill, "/v1/completions", &body, &[]), "prefill leg")
}

#[test]
fn a_vllm_prefill_leg_answers_transfer_params_and_holds_its_prompt() {
    let prefill = sim(&["--role", "prefill"]);
    let port: u64 = prefill.addr.rsplit_once(':').unwrap().1.parse().unwrap();
    let mut engine_ids = Vec::new();
    for (i, with_nulls) in [false, true].into_iter().enumerate() {
        let body = json!({"model": MODEL, "prompt": ids(1000 * i as u32 + 100, 70), "max_tokens": 1,
                          "stream": false, "kv_transfer_params": prefill_params(with_nulls)});
        let request_id = format!("req-{i}");
        let v = ok(
            &post(&prefill, "/v1/completions", &body, &[("x-request-id", &request_id)]),
            "prefill",
        );
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(v["usage"]["completion_tokens"], 1);
        assert_eq!(v["usage"]["prompt_tokens"], 70);
        let p = &v["kv_transfer_params"];
        assert_eq!(p["do_remote_prefill"], true, "{p}");
        assert_eq!(p["do_remote_decode"], false);
        assert_eq!(p["tp_size"], 1);
        assert_eq!(p["remote_num_tokens"], 70);
        assert_eq!(p["remote_request_id"], v["id"], "the engine's request id");
        assert_eq!(p["remote_host"], "127.0.0.1");
        assert_eq!(p["remote_port"], port);
        // One KV-cache group; 70 tokens fill 5 blocks of 16 (the last partly).
        let groups = p["remote_block_ids"].as_array().expect("groups");
        assert_eq!(groups.len(), 1);
        assert_eq!(groups[0].as_array().expect("ids").len(), 5);
        engine_ids.push(p["remote_engine_id"].as_str().expect("engine id").to_owned());
        // What the engine received, as sent.
        let seen = requests(&prefill).pop().expect("recorded");
        assert_eq!(seen["body"], body);
        assert_eq!(seen["request_id"], request_id.as_str());
        assert_eq!(seen["leg"], "prefill");
        assert_eq!(seen["outcome"], "completed");
    }
    assert_eq!(engine_ids[0], engine_ids[1], "one engine, one id");
    assert_eq!(engine_ids[0].len(), 36, "a UUID: {}", engine_ids[0]);
    // Chat, capped by max_completion_tokens.
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "hello there"}],
                      "max_completion_tokens": 1, "kv_transfer_params": prefill_params(true)});
    let v = ok(&post(&prefill, "/v1/chat/completions", &chat, &[]), "chat prefill");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["kv_transfer_params"]["do_remote_prefill"], true);
    // Three prompts held; their blocks count as used KV.
    assert_eq!(metric(&prefill, "semlb_sim_pd_pins_held"), 3.0);
    assert_eq!(metric(&prefill, "semlb_sim_pd_pins_total"), 3.0);
    assert!(metric(&prefill, &format!("vllm:kv_cache_usage_perc{{model_name=\"{MODEL}\"}}")) > 0.0);
    // vLLM's face: owned_by vllm.
    assert_eq!(get(&prefill, "/v1/models").json()["data"][0]["owned_by"], "vllm");
}

#[test]
fn a_vllm_decode_leg_pulls_only_what_it_lacks_and_frees_the_pin() {
    let prefill = sim(&["--role", "prefill"]);
    let decode = sim(&["--role", "decode"]);
    // The decode engine holds the first 50 tokens already (3 full blocks).
    let prompt = ids(2000, 150);
    let warm = json!({"model": MODEL, "prompt": &prompt[..50], "max_tokens": 1});
    ok(&post(&decode, "/v1/completions", &warm, &[]), "warm-up");
    let answer = prefill_leg(&prefill, &prompt);
    let params = answer["kv_transfer_params"].clone();
    assert_eq!(metric(&prefill, "semlb_sim_pd_pins_held"), 1.0);

    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 8, "kv_transfer_params": params});
    let r = post(&decode, "/v1/completions", &body, &[("x-request-id", "pd-1")]);
    let v = ok(&r, "decode leg");
    assert_eq!(v["usage"]["completion_tokens"], 8);
    // Every prompt token but the last came from the caches (its own and
    // the pulled ones), as vLLM's num_cached_tokens counts them.
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 149);
    assert_eq!(r.header("x-semlb-sim-cached-tokens"), Some("149"));
    assert!(v.get("kv_transfer_params").is_none(), "{v}");
    assert_eq!(metric(&decode, "semlb_sim_pd_pulls_total"), 1.0);
    assert_eq!(metric(&decode, "semlb_sim_pd_pulled_tokens_total"), 150.0 - 48.0);
    assert_eq!(metric(&decode, "semlb_sim_pd_recomputes_total"), 0.0);
    assert_eq!(metric(&prefill, "semlb_sim_pd_pins_held"), 0.0);
    assert_eq!(metric(&prefill, "semlb_sim_pd_pins_released_total"), 1.0);
    let seen = requests(&decode).pop().expect("recorded");
    assert_eq!(
        (&seen["leg"], &seen["outcome"]),
        (&json!("decode"), &json!("completed"))
    );
    assert_eq!(seen["body"]["kv_transfer_params"], body["kv_transfer_params"]);

    // Streamed, with usage: the pulled prompt is cached here too.
    let prompt = ids(5000, 40);
    let params = prefill_leg(&prefill, &prompt)["kv_transfer_params"].clone();
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 5, "stream": true,
                      "stream_options": {"include_usage": true}, "kv_transfer_params": params});
    let r = post(&decode, "/v1/completions", &body, &[]);
    assert_eq!(r.status, 200);
    let events = support::sse::events(std::str::from_utf8(&r.body).expect("text"));
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).expect("usage chunk");
    assert_eq!(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 39);
    assert_eq!(metric(&decode, "semlb_sim_pd_pulled_tokens_total"), 102.0 + 40.0);
    assert_eq!(metric(&prefill, "semlb_sim_pd_pins_held"), 0.0);
}

#[test]
fn a_vllm_decode_leg_without_a_usable_prefill_recomputes_its_prompt() {
    let prefill = sim(&["--role", "prefill"]);
    let decode = sim(&["--role", "decode"]);
    let decode_leg = |prompt: &[u32], params: &Value| {
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 4, "kv_transfer_params": params});
        ok(&post(&decode, "/v1/completions", &body, &[]), "decode leg")
    };
    // Incomplete params (no host).
    let prompt = ids(3000, 60);
    let mut params = prefill_leg(&prefill, &prompt)["kv_transfer_params"].clone();
    params["remote_host"] = Value::Null;
    let v = decode_leg(&prompt, &params);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "computed here");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert_eq!(metric(&decode, "semlb_sim_pd_recomputes_total"), 1.0);
    // An unreachable prefill (nobody on that port).
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let prompt = ids(3500, 60);
    let mut params = prefill_leg(&prefill, &prompt)["kv_transfer_params"].clone();
    params["remote_port"] = json!(closed);
    decode_leg(&prompt, &params);
    assert_eq!(metric(&decode, "semlb_sim_pd_recomputes_total"), 2.0);
    // A pin pulled once is gone: the second pull recomputes.
    let prompt = ids(4000, 60);
    let params = prefill_leg(&prefill, &prompt)["kv_transfer_params"].clone();
    decode_leg(&prompt, &params);
    assert_eq!(metric(&decode, "semlb_sim_pd_pulls_total"), 1.0);
    let other = ids(4500, 60);
    decode_leg(&other, &params);
    assert_eq!(metric(&decode, "semlb_sim_pd_recomputes_total"), 3.0);
    assert_eq!(metric(&decode, "semlb_sim_pd_pulls_total"), 1.0);
    // A plain request on a decode engine is served as usual.
    let plain = json!({"model": MODEL, "prompt": ids(6000, 20), "max_tokens": 3});
    assert_eq!(
        ok(&post(&decode, "/v1/completions", &plain, &[]), "plain")["usage"]["completion_tokens"],
        3
    );
    assert_eq!(requests(&decode).pop().expect("recorded")["leg"], "plain");
}

#[test]
fn a_vllm_prefill_leg_that_stops_on_eos_holds_nothing() {
    let prefill = sim(&["--role", "prefill"]);
    // Its natural length is one token: EOS comes before the cap.
    let body = json!({"model": MODEL, "prompt": ids(100, 40), "max_tokens": 1,
                      "kv_transfer_params": prefill_params(true)});
    let v = ok(
        &post(&prefill, "/v1/completions", &body, &[("x-semlb-output-tokens", "1")]),
        "prefill",
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(v.get("kv_transfer_params").is_none(), "{v}");
    assert_eq!(metric(&prefill, "semlb_sim_pd_pins_held"), 0.0);
    assert_eq!(metric(&prefill, "semlb_sim_pd_pins_total"), 0.0);
}

#[test]
fn an_unpulled_prompt_is_freed_after_the_abort_timeout() {
    // 20 simulated seconds: 0.2 s here.
    let prefill = sim(&["--role", "prefill", "--nixl-abort-timeout-s", "20"]);
    let decode = sim(&["--role", "decode"]);
    let prompt = ids(700, 100);
    let params = prefill_leg(&prefill, &prompt)["kv_transfer_params"].clone();
    let usage = format!("vllm:kv_cache_usage_perc{{model_name=\"{MODEL}\"}}");
    wait_for("the pin to expire", PATIENCE, || {
        let seen = (
            metric(&prefill, "semlb_sim_pd_pins_expired_total"),
            metric(&prefill, "semlb_sim_pd_pins_held"),
            metric(&prefill, &usage),
        );
        (seen == (1.0, 0.0, 0.0), seen)
    });
    // The decode leg finds nothing and recomputes.
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2, "kv_transfer_params": params});
    ok(&post(&decode, "/v1/completions", &body, &[]), "decode leg");
    assert_eq!(metric(&decode, "semlb_sim_pd_recomputes_total"), 1.0);
}

/// An SGLang pair: a prefill engine (its bootstrap port on a free port)
/// and a decode engine, each with `extra` flags.
fn sglang_pair(prefill_extra: &[&str], decode_extra: &[&str]) -> (Proc, Proc, u16) {
    let mut args = vec!["--role", "prefill", "--pd-protocol", "sglang", "--bootstrap-port", "0"];
    args.extend_from_slice(prefill_extra);
    let prefill = sim(&args);
    let port = bootstrap_port(&prefill.line).unwrap_or_else(|| panic!("no bootstrap port in {:?}", prefill.line));
    let mut args = vec!["--role", "decode", "--pd-protocol", "sglang"];
    args.extend_from_slice(decode_extra);
    (prefill, sim(&args), port)
}

fn sglang_body(prompt: &[u32], port: u16, room: u64, stream: bool) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": 10, "stream": stream,
           "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room})
}

/// The two legs of `body`, sent at once.
fn both_legs(prefill: &Proc, decode: &Proc, body: &Value) -> (Response, Response) {
    std::thread::scope(|s| {
        let p = s.spawn(|| post(prefill, "/v1/completions", body, &[]));
        let d = s.spawn(|| post(decode, "/v1/completions", body, &[]));
        (p.join().expect("prefill leg"), d.join().expect("decode leg"))
    })
}

#[test]
fn sglang_legs_meet_in_their_room() {
    let (prefill, decode, port) = sglang_pair(&[], &[]);
    // The first line names the bootstrap server, which answers as SGLang's.
    assert!(
        prefill
            .line
            .contains(&format!("bootstrap on 127.0.0.1:{port}; listening on http://"))
    );
    assert_eq!(bootstrap_port(&decode.line), None);
    let health = http(&format!("127.0.0.1:{port}"), "GET", "/health", None, &[]).expect("bootstrap health");
    assert_eq!((health.status, health.body.as_slice()), (200, &b"OK"[..]));
    let info = get(&prefill, "/server_info").json();
    assert_eq!(info["disaggregation_mode"], "prefill");
    assert_eq!(info["disaggregation_bootstrap_port"], port);
    assert_eq!(get(&decode, "/get_server_info").json()["disaggregation_mode"], "decode");
    assert_eq!(get(&decode, "/v1/models").json()["data"][0]["owned_by"], "sglang");

    let prompt = ids(900, 120);
    let (p, d) = both_legs(&prefill, &decode, &sglang_body(&prompt, port, 42, false));
    let p = ok(&p, "prefill leg");
    assert_eq!(p["choices"][0]["finish_reason"], "length", "SGLang's FINISH_LENGTH(0)");
    assert_eq!(p["usage"]["completion_tokens"], 1);
    let d = ok(&d, "decode leg");
    assert_eq!(d["usage"]["completion_tokens"], 10);
    assert_eq!(d["usage"]["prompt_tokens_details"]["cached_tokens"], 119);
    // The decode's first token is the prefill's.
    let first = p["choices"][0]["text"].as_str().expect("text");
    assert!(d["choices"][0]["text"].as_str().expect("text").starts_with(first));
    assert_eq!(metric(&prefill, "semlb_sim_pd_handoffs_total"), 1.0);
    assert_eq!(metric(&prefill, "semlb_sim_pd_pins_held"), 0.0);
    assert_eq!(metric(&prefill, "semlb_sim_pd_rooms_open"), 0.0);
    assert_eq!(metric(&decode, "semlb_sim_pd_pulled_tokens_total"), 120.0);
    assert_eq!(requests(&prefill).pop().expect("recorded")["leg"], "prefill");
    assert_eq!(requests(&decode).pop().expect("recorded")["leg"], "decode");

    // Streamed: the prefill's one token, the decode's answer.
    let (p, d) = both_legs(&prefill, &decode, &sglang_body(&ids(1900, 80), port, 43, true));
    assert_eq!((p.status, d.status), (200, 200));
    let p_text = support::sse::text(std::str::from_utf8(&p.body).expect("text"));
    let d_text = support::sse::text(std::str::from_utf8(&d.body).expect("text"));
    assert!(
        !p_text.is_empty() && d_text.starts_with(&p_text),
        "{p_text:?} / {d_text:?}"
    );
    assert_eq!(metric(&prefill, "semlb_sim_pd_handoffs_total"), 2.0);
}

#[test]
fn an_sglang_prefill_request_without_a_room_is_refused() {
    let (prefill, _decode, _) = sglang_pair(&[], &[]);
    let r = post(
        &prefill,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "hi", "max_tokens": 3}),
        &[],
    );
    assert_eq!(r.status, 400);
    let v = r.json();
    assert_eq!(
        (&v["object"], &v["code"], &v["type"]),
        (&json!("error"), &json!(400), &json!("BadRequestError"))
    );
    assert!(
        v["message"].as_str().expect("message").contains("bootstrap_room"),
        "{v}"
    );
    let seen = requests(&prefill).pop().expect("recorded");
    assert_eq!((&seen["outcome"], &seen["status"]), (&json!("failed"), &json!(400)));
}

#[test]
fn unpaired_sglang_legs_time_out_and_free_their_room() {
    // 10 simulated seconds: 0.1 s here.
    let (prefill, decode, port) = sglang_pair(&["--bootstrap-timeout-s", "10"], &["--waiting-timeout-s", "10"]);
    // A decode leg whose prefill never comes.
    let r = post(
        &decode,
        "/v1/completions",
        &sglang_body(&ids(10, 30), port, 7, false),
        &[],
    );
    assert_eq!(r.status, 500, "{}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    assert_eq!(v["object"], "error");
    assert!(
        v["message"].as_str().expect("message").contains("bootstrap_room 7"),
        "{v}"
    );
    assert_eq!(metric(&decode, "semlb_sim_pd_rendezvous_timeouts_total"), 1.0);
    wait_for("the room to be freed", PATIENCE, || {
        let open = metric(&prefill, "semlb_sim_pd_rooms_open");
        (open == 0.0, open)
    });
    // A prefill leg whose decode never comes.
    let r = post(
        &prefill,
        "/v1/completions",
        &sglang_body(&ids(10, 30), port, 8, false),
        &[],
    );
    assert_eq!(r.status, 500, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(metric(&prefill, "semlb_sim_pd_rendezvous_timeouts_total"), 1.0);
    assert_eq!(metric(&prefill, "semlb_sim_pd_rooms_open"), 0.0);
    assert_eq!(metric(&prefill, "semlb_sim_pd_pins_held"), 0.0);
    assert_eq!(requests(&prefill).pop().expect("recorded")["outcome"], "failed");
}

/// Sends `body` to `sim` on a raw connection, to drop it later (the
/// client going away).
fn leave_later(sim: &Proc, body: &Value) -> TcpStream {
    let mut stream = TcpStream::connect(&sim.addr).expect("connect");
    let payload = body.to_string();
    let request = request_bytes(&sim.addr, "POST", "/v1/completions", Some(payload.as_bytes()), &[]);
    stream.write_all(&request).expect("write");
    stream
}

/// Waits until `sim`'s engine runs a request.
fn wait_running(sim: &Proc) {
    let running = format!("vllm:num_requests_running{{model_name=\"{MODEL}\"}}");
    wait_for("the prefill to run", PATIENCE, || {
        let n = metric(sim, &running);
        (n == 1.0, n)
    });
}

/// A slow prefill (1 000 tokens at 100 tokens/s and time scale 0.1: 1 s
/// of real time) and timeouts that would never fire during a test.
const SLOW: [&str; 8] = [
    "--time-scale",
    "0.1",
    "--prefill-tokens-per-s",
    "100",
    "--bootstrap-timeout-s",
    "100000",
    "--waiting-timeout-s",
    "100000",
];

#[test]
fn a_cancelled_sglang_prefill_leg_fails_its_decode_at_once() {
    let (prefill, decode, port) = sglang_pair(&SLOW, &SLOW[4..]);
    let body = sglang_body(&ids(100, 1000), port, 99, false);
    std::thread::scope(|s| {
        let d = s.spawn(|| post(&decode, "/v1/completions", &body, &[]));
        let leg = leave_later(&prefill, &body);
        wait_running(&prefill);
        drop(leg);
        let r = d.join().expect("decode leg");
        assert_eq!(r.status, 500, "{}", String::from_utf8_lossy(&r.body));
        let message = r.json()["message"].as_str().expect("message").to_owned();
        assert!(message.contains("prefill leg was aborted"), "{message}");
    });
    assert_eq!(metric(&decode, "semlb_sim_pd_rendezvous_abandoned_total"), 1.0);
    let seen = requests(&decode).pop().expect("recorded");
    assert_eq!((&seen["outcome"], &seen["status"]), (&json!("failed"), &json!(500)));
    wait_for("the prefill leg to be aborted", PATIENCE, || {
        let outcome = requests(&prefill).pop().expect("recorded")["outcome"].clone();
        (outcome == "aborted", outcome)
    });
    wait_for("the prefill's room and KV to be freed", PATIENCE, || {
        let seen = (
            metric(&prefill, "semlb_sim_pd_rooms_open"),
            metric(&prefill, "semlb_sim_pd_pins_held"),
        );
        (seen == (0.0, 0.0), seen)
    });
}

#[test]
fn a_cancelled_sglang_decode_leg_fails_its_prefill_at_once() {
    let (prefill, decode, port) = sglang_pair(&SLOW, &SLOW[4..]);
    let body = sglang_body(&ids(100, 1000), port, 77, false);
    std::thread::scope(|s| {
        let p = s.spawn(|| post(&prefill, "/v1/completions", &body, &[]));
        let leg = leave_later(&decode, &body);
        wait_running(&prefill);
        drop(leg);
        // It fails when its prefill step ends, not after its timeout.
        let r = p.join().expect("prefill leg");
        assert_eq!(r.status, 500, "{}", String::from_utf8_lossy(&r.body));
        let message = r.json()["message"].as_str().expect("message").to_owned();
        assert!(message.contains("decode leg was aborted"), "{message}");
    });
    assert_eq!(metric(&prefill, "semlb_sim_pd_rendezvous_abandoned_total"), 1.0);
    assert_eq!(metric(&prefill, "semlb_sim_pd_pins_held"), 0.0);
    assert_eq!(metric(&prefill, "semlb_sim_pd_rooms_open"), 0.0);
    wait_for("the decode leg to be aborted", PATIENCE, || {
        let outcome = requests(&decode).pop().expect("recorded")["outcome"].clone();
        (outcome == "aborted", outcome)
    });
}

#[test]
fn sim_requests_records_bodies_and_how_they_ended() {
    // Slow enough that a long stream is still running when its client leaves.
    let engine = sim(&["--time-scale", "0.1"]);
    let good = json!({"model": MODEL, "prompt": "a completed request", "max_tokens": 3});
    ok(
        &post(&engine, "/v1/completions", &good, &[("x-request-id", "one")]),
        "good",
    );
    let bad = json!({"model": MODEL, "prompt": "a refused request", "max_tokens": 0});
    assert_eq!(post(&engine, "/v1/completions", &bad, &[]).status, 400);
    let long = json!({"model": MODEL, "prompt": "a long stream", "max_tokens": 2000,
                      "ignore_eos": true, "stream": true});
    let mut stream = leave_later(&engine, &long);
    let mut first = [0u8; 64];
    let n = stream.read(&mut first).expect("the first bytes");
    assert!(n > 0);
    drop(stream);
    let seen = wait_for("the stream to be aborted", PATIENCE, || {
        let seen = requests(&engine);
        (seen.len() == 3 && seen[2]["outcome"] == "aborted", seen)
    });
    assert_eq!(seen[0]["seq"], 1);
    assert_eq!(seen[0]["path"], "/v1/completions");
    assert_eq!(seen[0]["body"], good);
    assert_eq!(seen[0]["request_id"], "one");
    assert_eq!(
        (&seen[0]["leg"], &seen[0]["outcome"]),
        (&json!("plain"), &json!("completed"))
    );
    assert_eq!(seen[0]["status"], 200);
    assert_eq!(seen[1]["body"], bad);
    assert_eq!(
        (&seen[1]["outcome"], &seen[1]["status"]),
        (&json!("failed"), &json!(400))
    );
    assert!(seen[1]["reason"].as_str().expect("reason").contains("max_tokens"));
    assert!(seen[1]["request_id"].is_null());
    assert_eq!(seen[2]["body"], long);
    assert!(seen[2]["status"].is_null());
}

#[test]
fn the_first_line_parsers_read_both_prefixes() {
    let line = "semlb-sim kv events on tcp://127.0.0.1:5 replay tcp://127.0.0.1:6; bootstrap on 127.0.0.1:7; listening on http://127.0.0.1:8";
    assert_eq!(bootstrap_port(line), Some(7));
    let events = kv_endpoints(line).expect("kv endpoints");
    assert_eq!(
        (events.events.as_str(), events.replay.as_str()),
        ("tcp://127.0.0.1:5", "tcp://127.0.0.1:6")
    );
    assert_eq!(bootstrap_port("semlb-sim listening on http://127.0.0.1:8"), None);
}
