//! semlb as the Gateway API Inference Extension's endpoint picker, end to
//! end: a real `semlb serve --epp-listen` in front of simulated engines,
//! and a client built from Envoy's own protos (`envoy-types`' tonic
//! client) playing Envoy's side of ext_proc in `FULL_DUPLEX_STREAMED`
//! mode: request headers, the body in chunks, then (as Envoy would) the
//! request sent to the endpoint picked and the engine's answer streamed
//! back through the picker. No Envoy binary is available here; the
//! message sequence is the one Envoy sends.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, body_mutation, processing_request,
    processing_response,
};
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value as PbValue, value::Kind};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use semlb::dispatcher::epp::header_list;
use semlb_test_support as support;
use serde_json::{Value, json};
use support::gateway::{Gateway, sample, sim, sim_with, user, wait_for};
use support::http::http_bytes;
use support::process::Proc;
use tokio::runtime::Runtime;
use tokio::sync::mpsc;
use tonic::Streaming;
use tonic::transport::Channel;

const PATIENCE: Duration = Duration::from_secs(30);
const PATH: &str = "/v1/chat/completions";

fn unique(tag: &str) -> String {
    support::process::unique("epp", tag)
}

/// The picker's address, from the gateway's address line.
fn picker_addr(gw: &Gateway) -> String {
    let line = &gw.proc.line;
    let (_, rest) = line.split_once("grpc://").expect("an endpoint picker address");
    rest.split_whitespace().next().expect("an address").to_owned()
}

/// A gateway with the picker in front of `engines`.
fn gateway(tag: &str, engines: &[&Proc], extra: &[&str]) -> Gateway {
    let mut args = vec!["--epp-listen", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    Gateway::builder()
        .shm(&unique(tag))
        .tag(tag)
        .backends(engines)
        .args(&args)
        .start()
}

/// Plays Envoy: ext_proc streams to the picker.
struct Envoy {
    rt: Runtime,
    addr: String,
}

impl Envoy {
    fn of(gw: &Gateway) -> Envoy {
        // A worker thread drives the connections between the test's
        // calls (a dropped stream is cancelled at once, as Envoy does).
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        Envoy {
            rt,
            addr: picker_addr(gw),
        }
    }

    /// A new connection to the picker.
    fn client(&self) -> ExternalProcessorClient<Channel> {
        let url = format!("http://{}", self.addr);
        self.rt
            .block_on(ExternalProcessorClient::connect(url))
            .expect("connect to the endpoint picker")
    }

    /// A new stream on `client`.
    fn stream(&self, client: &mut ExternalProcessorClient<Channel>) -> ExtProc<'_> {
        let (tx, rx) = mpsc::channel::<ProcessingRequest>(64);
        let outbound = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
        let inbound = self
            .rt
            .block_on(client.process(outbound))
            .expect("an ext_proc stream")
            .into_inner();
        ExtProc {
            rt: &self.rt,
            answer_headers: HashMap::new(),
            tx: Some(tx),
            rx: inbound,
        }
    }

    /// A stream on a new connection.
    fn open(&self) -> ExtProc<'_> {
        let mut client = self.client();
        self.stream(&mut client)
    }

    /// `grpc.health.v1` status of `service` (1: serving, 2: not serving).
    fn health(&self, service: &str) -> i32 {
        use tonic_health::pb::HealthCheckRequest;
        use tonic_health::pb::health_client::HealthClient;
        let url = format!("http://{}", self.addr);
        self.rt.block_on(async {
            let channel = Channel::from_shared(url)
                .expect("a URL")
                .connect()
                .await
                .expect("connect");
            let mut client = HealthClient::new(channel);
            client
                .check(HealthCheckRequest {
                    service: service.to_owned(),
                })
                .await
                .map(|r| r.into_inner().status)
                .unwrap_or(-1)
        })
    }
}

/// One ext_proc stream: one HTTP request through "Envoy".
struct ExtProc<'r> {
    rt: &'r Runtime,
    /// The headers the picker set on the answer's head, once it came.
    answer_headers: HashMap<String, String>,
    tx: Option<mpsc::Sender<ProcessingRequest>>,
    rx: Streaming<ProcessingResponse>,
}

fn subset_metadata(subset: &[&str]) -> Metadata {
    let list = PbValue {
        kind: Some(Kind::ListValue(ListValue {
            values: subset
                .iter()
                .map(|s| PbValue {
                    kind: Some(Kind::StringValue((*s).to_owned())),
                })
                .collect(),
        })),
    };
    let hint = Struct {
        fields: [("x-gateway-destination-endpoint-subset".to_owned(), list)].into(),
    };
    Metadata {
        filter_metadata: [("envoy.lb.subset_hint".to_owned(), hint)].into(),
        ..Metadata::default()
    }
}

/// What the picker answered a request.
#[derive(Debug)]
enum Pick {
    Routed {
        /// The header's value: the pick, then fallbacks.
        endpoints: Vec<String>,
        /// The body to send the engine.
        body: Vec<u8>,
    },
    Immediate {
        status: u16,
        headers: HashMap<String, String>,
        body: Vec<u8>,
    },
}

impl Pick {
    fn endpoint(&self) -> &str {
        match self {
            Pick::Routed { endpoints, .. } => &endpoints[0],
            other => panic!("not routed: {other:?}"),
        }
    }
}

impl ExtProc<'_> {
    fn send(&self, request: processing_request::Request, metadata: Option<Metadata>) {
        let tx = self.tx.as_ref().expect("the request stream is open");
        let message = ProcessingRequest {
            request: Some(request),
            metadata_context: metadata,
            ..ProcessingRequest::default()
        };
        // The picker may have ended the stream already (an immediate
        // response before the body's last chunk): what it answered tells.
        let _ = self.rt.block_on(tx.send(message));
    }

    fn recv(&mut self) -> ProcessingResponse {
        let rx = &mut self.rx;
        self.rt
            .block_on(async { tokio::time::timeout(PATIENCE, rx.message()).await })
            .expect("an answer in time")
            .expect("no gRPC error")
            .expect("an answer, not the stream's end")
    }

    /// Sends a request (headers, then `body` in `chunks` chunks, the
    /// subset hint with the headers) and reads the picker's answers.
    fn request(&mut self, extra: &[(&str, &str)], body: &[u8], chunks: usize, subset: Option<&[&str]>) -> Pick {
        let mut pairs = vec![
            (":method", "POST"),
            (":path", PATH),
            (":authority", "gateway"),
            ("content-type", "application/json"),
        ];
        pairs.extend_from_slice(extra);
        self.send(
            processing_request::Request::RequestHeaders(HttpHeaders {
                headers: Some(header_list(&pairs)),
                end_of_stream: body.is_empty(),
                ..HttpHeaders::default()
            }),
            subset.map(subset_metadata),
        );
        if !body.is_empty() {
            let size = body.len().div_ceil(chunks.max(1));
            let parts: Vec<&[u8]> = body.chunks(size).collect();
            for (i, part) in parts.iter().enumerate() {
                self.send(
                    processing_request::Request::RequestBody(HttpBody {
                        body: part.to_vec(),
                        end_of_stream: i + 1 == parts.len(),
                        ..HttpBody::default()
                    }),
                    None,
                );
            }
        }
        let first = self.recv();
        let (endpoints, metadata) = match first.response {
            Some(processing_response::Response::ImmediateResponse(r)) => {
                let headers = r
                    .headers
                    .map(|h| {
                        h.set_headers
                            .into_iter()
                            .filter_map(|o| o.header)
                            .map(|h| (h.key, String::from_utf8_lossy(&h.raw_value).into_owned()))
                            .collect()
                    })
                    .unwrap_or_default();
                return Pick::Immediate {
                    status: r.status.map_or(0, |s| s.code as u16),
                    headers,
                    body: r.body,
                };
            }
            Some(processing_response::Response::RequestHeaders(h)) => {
                let common = h.response.expect("a common response");
                assert!(common.clear_route_cache, "the route cache is cleared");
                let set: HashMap<String, String> = common
                    .header_mutation
                    .expect("a header mutation")
                    .set_headers
                    .into_iter()
                    .filter_map(|o| o.header)
                    .map(|h| (h.key, String::from_utf8_lossy(&h.raw_value).into_owned()))
                    .collect();
                let endpoints = set["x-gateway-destination-endpoint"].clone();
                let metadata = first
                    .dynamic_metadata
                    .and_then(|m| m.fields.get("envoy.lb").cloned())
                    .and_then(|v| match v.kind {
                        Some(Kind::StructValue(s)) => s.fields.get("x-gateway-destination-endpoint").cloned(),
                        _ => None,
                    })
                    .and_then(|v| match v.kind {
                        Some(Kind::StringValue(s)) => Some(s),
                        _ => None,
                    });
                if !body.is_empty() {
                    assert!(set.contains_key("content-length"), "{set:?}");
                }
                (endpoints, metadata)
            }
            other => panic!("the picker answered {other:?} first"),
        };
        assert_eq!(
            metadata.as_deref(),
            Some(endpoints.as_str()),
            "the dynamic metadata names the same"
        );
        let mut sent = Vec::new();
        while !body.is_empty() {
            match self.recv().response {
                Some(processing_response::Response::RequestBody(b)) => {
                    match b.response.and_then(|c| c.body_mutation).and_then(|m| m.mutation) {
                        Some(body_mutation::Mutation::StreamedResponse(s)) => {
                            sent.extend_from_slice(&s.body);
                            if s.end_of_stream {
                                break;
                            }
                        }
                        other => panic!("not a streamed body: {other:?}"),
                    }
                }
                other => panic!("expected the request body's answer, got {other:?}"),
            }
        }
        Pick::Routed {
            endpoints: endpoints.split(',').map(str::to_owned).collect(),
            body: sent,
        }
    }

    /// Streams the engine's answer (`status`, `content_type`, `body` in
    /// `chunks` chunks) through the picker, as Envoy does; what passes to
    /// the client.
    fn answer(&mut self, status: u16, content_type: &str, body: &[u8], chunks: usize) -> Vec<u8> {
        let status = status.to_string();
        self.send(
            processing_request::Request::ResponseHeaders(HttpHeaders {
                headers: Some(header_list(&[(":status", &status), ("content-type", content_type)])),
                end_of_stream: false,
                ..HttpHeaders::default()
            }),
            None,
        );
        match self.recv().response {
            Some(processing_response::Response::ResponseHeaders(h)) => {
                self.answer_headers = h
                    .response
                    .and_then(|c| c.header_mutation)
                    .map(|m| {
                        m.set_headers
                            .into_iter()
                            .filter_map(|o| o.header)
                            .map(|h| (h.key, String::from_utf8_lossy(&h.raw_value).into_owned()))
                            .collect()
                    })
                    .unwrap_or_default();
            }
            other => panic!("expected the response headers' answer, got {other:?}"),
        }
        let size = body.len().div_ceil(chunks.max(1)).max(1);
        let parts: Vec<&[u8]> = body.chunks(size).collect();
        let mut passed = Vec::new();
        for (i, part) in parts.iter().enumerate() {
            let end = i + 1 == parts.len();
            self.send(
                processing_request::Request::ResponseBody(HttpBody {
                    body: part.to_vec(),
                    end_of_stream: end,
                    ..HttpBody::default()
                }),
                None,
            );
            // One answer per chunk (each is far below the picker's 62 000-byte chunks).
            match self.recv().response {
                Some(processing_response::Response::ResponseBody(b)) => {
                    match b.response.and_then(|c| c.body_mutation).and_then(|m| m.mutation) {
                        Some(body_mutation::Mutation::StreamedResponse(s)) => {
                            passed.extend_from_slice(&s.body);
                            assert_eq!(s.end_of_stream, end, "the stream ends with its last chunk");
                        }
                        other => panic!("not a streamed body: {other:?}"),
                    }
                }
                other => panic!("expected the response body's answer, got {other:?}"),
            }
        }
        self.tx = None;
        passed
    }
}

/// A chat request body.
fn chat_body(messages: &[Value], extra: Value) -> Vec<u8> {
    let mut body = json!({"model": "semlb-sim", "messages": messages, "max_tokens": 16});
    if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
        b.extend(e);
    }
    body.to_string().into_bytes()
}

/// Sends `body` to `endpoint` as Envoy would after the pick.
fn forward(endpoint: &str, body: &[u8]) -> support::http::Response {
    http_bytes(endpoint, "POST", PATH, Some(body), &[]).expect("the engine answers")
}

/// Every server's requests in flight, summed.
fn inflight(gw: &Gateway) -> u64 {
    let t = gw.segment.tables();
    t.servers.servers().map(|s| t.servers.inflight(s.server).0).sum()
}

/// Waits until no request is in flight (a cancelled stream's count ends
/// once the picker sees the cancel).
fn wait_until_idle(gw: &Gateway, what: &str) {
    wait_for(what, PATIENCE, || {
        let n = inflight(gw);
        (n == 0, n)
    });
}

/// A whole request through the picker: picked, forwarded, answered.
fn through(envoy: &Envoy, extra: &[(&str, &str)], body: &[u8]) -> (String, support::http::Response, Vec<u8>) {
    let mut stream = envoy.open();
    let pick = stream.request(extra, body, 3, None);
    let Pick::Routed { endpoints, body: sent } = &pick else {
        panic!("not routed: {pick:?}");
    };
    let answer = forward(&endpoints[0], sent);
    let content_type = answer.header("content-type").unwrap_or("application/json").to_owned();
    let passed = stream.answer(answer.status, &content_type, &answer.body, 3);
    (endpoints[0].clone(), answer, passed)
}

#[test]
fn a_buffered_chat_is_picked_with_fallbacks_learned_and_charged() {
    let engines = [sim(), sim(), sim()];
    let refs: Vec<&Proc> = engines.iter().collect();
    let addrs: HashSet<String> = engines.iter().map(|e| e.addr.clone()).collect();
    let gw = gateway("buffered", &refs, &[]);
    let envoy = Envoy::of(&gw);

    let system = json!({"role": "system", "content": "You answer questions about the weather in one line."});
    let first = [system.clone(), user("What is the weather like in Lisbon in May?")];
    let body = chat_body(&first, json!({}));
    let mut stream = envoy.open();
    let pick = stream.request(&[("x-gateway-inference-fairness-id", "team-a")], &body, 3, None);
    let Pick::Routed { endpoints, body: sent } = &pick else {
        panic!("not routed: {pick:?}");
    };
    // The pick, then the other two engines as fallbacks.
    assert_eq!(endpoints.len(), 3, "{endpoints:?}");
    assert_eq!(endpoints.iter().collect::<HashSet<_>>().len(), 3, "{endpoints:?}");
    assert!(
        endpoints.iter().all(|e| addrs.contains(e)),
        "{endpoints:?} of {addrs:?}"
    );
    let sent_json: Value = serde_json::from_slice(sent).expect("the body sent is JSON");
    assert_eq!(sent_json["messages"], json!(first));
    // Counted in flight at the engine picked until its answer ends.
    assert_eq!(inflight(&gw), 1);
    let answer = forward(&endpoints[0], sent);
    assert_eq!(answer.status, 200, "{}", answer.text());
    let passed = stream.answer(200, "application/json", &answer.body, 3);
    assert_eq!(passed, answer.body, "the answer passes as it came");
    assert_eq!(inflight(&gw), 0, "the answer's end ended its count");
    // Learned: the responder applies the completion record; the next turn
    // goes where the conversation is.
    gw.written_back(semlb::metrics::responder_records);
    let reply = answer.json()["choices"][0]["message"]["content"]
        .as_str()
        .expect("an answer")
        .to_owned();
    let second = [
        system,
        user("What is the weather like in Lisbon in May?"),
        json!({"role": "assistant", "content": reply}),
        user("And in November?"),
    ];
    let (engine, answer, _) = through(
        &envoy,
        &[("x-gateway-inference-fairness-id", "team-a")],
        &chat_body(&second, json!({})),
    );
    assert_eq!(engine, endpoints[0], "the second turn follows its prefix");
    assert_eq!(answer.status, 200);
    // Both turns were charged to the tenant, with their output tokens.
    let m = gw.metrics();
    assert_eq!(
        sample(&m, "semlb_tenant_requests_total{tenant=\"team-a\"}"),
        Some(2.0),
        "{m}"
    );
    let output = sample(&m, "semlb_tenant_tokens_total{tenant=\"team-a\",type=\"output\"}").unwrap_or(0.0);
    assert!(output > 0.0, "output tokens charged: {output}");
    // Counted as the HTTP front's requests are.
    assert_eq!(
        sample(&m, "semlb_requests_total{endpoint=\"chat_completions\",code=\"200\"}"),
        Some(2.0),
        "{m}"
    );
}

#[test]
fn a_streamed_answer_with_its_model_rewritten_passes_without_the_usage_the_picker_asked_for() {
    let engine = sim();
    let gw = gateway("sse", &[&engine], &[]);
    let envoy = Envoy::of(&gw);
    // The gateway's route rewrites the model to the pool's.
    let body = chat_body(
        &[user("Stream me a short answer.")],
        json!({"stream": true, "model": "what-the-client-asked"}),
    );
    let mut stream = envoy.open();
    let pick = stream.request(&[("x-gateway-model-name-rewrite", "semlb-sim")], &body, 2, None);
    let Pick::Routed { endpoints, body: sent } = &pick else {
        panic!("not routed: {pick:?}");
    };
    // The gateway asks for the stream's usage on the client's behalf (to
    // read the engine's cached tokens and charge the output)...
    let sent_json: Value = serde_json::from_slice(sent).unwrap();
    assert_eq!(sent_json["model"], "semlb-sim", "{sent_json}");
    assert_eq!(sent_json["stream_options"]["include_usage"], true, "{sent_json}");
    let answer = forward(&endpoints[0], sent);
    assert_eq!(answer.status, 200);
    assert!(answer.text().contains("\"usage\""), "the engine reports usage");
    let passed = String::from_utf8(stream.answer(200, "text/event-stream", &answer.body, 5)).unwrap();
    // ... and keeps it from the client, which did not ask.
    assert!(passed.contains("data: [DONE]"), "{passed}");
    assert!(!passed.contains("\"usage\""), "{passed}");
    assert_eq!(inflight(&gw), 0);
}

#[test]
fn a_cancelled_stream_releases_its_count() {
    let engine = sim();
    let gw = gateway("cancel", &[&engine], &[]);
    let envoy = Envoy::of(&gw);
    let body = chat_body(&[user("This one is cancelled.")], json!({}));
    // Cancelled after the pick, before the answer.
    let mut stream = envoy.open();
    assert!(matches!(stream.request(&[], &body, 1, None), Pick::Routed { .. }));
    assert_eq!(inflight(&gw), 1);
    drop(stream);
    wait_until_idle(&gw, "the cancelled request's count to end");
    // Cancelled in the middle of the answer.
    let mut stream = envoy.open();
    let pick = stream.request(
        &[],
        &chat_body(&[user("So is this one.")], json!({"stream": true})),
        1,
        None,
    );
    let Pick::Routed { endpoints, body: sent } = &pick else {
        panic!("not routed: {pick:?}");
    };
    let answer = forward(&endpoints[0], sent);
    stream.send(
        processing_request::Request::ResponseHeaders(HttpHeaders {
            headers: Some(header_list(&[
                (":status", "200"),
                ("content-type", "text/event-stream"),
            ])),
            ..HttpHeaders::default()
        }),
        None,
    );
    stream.recv();
    stream.send(
        processing_request::Request::ResponseBody(HttpBody {
            body: answer.body[..answer.body.len() / 2].to_vec(),
            end_of_stream: false,
            ..HttpBody::default()
        }),
        None,
    );
    stream.recv();
    assert_eq!(inflight(&gw), 1);
    drop(stream);
    wait_until_idle(&gw, "the count of the request cancelled mid-answer to end");
}

/// A simulated engine of `role` in disaggregated serving, speaking
/// `protocol` (an SGLang prefill engine's bootstrap server on a free port).
fn pd_engine(role: &str, protocol: &str) -> Proc {
    let mut args = vec!["--role", role, "--pd-protocol", protocol];
    if protocol == "sglang" && role == "prefill" {
        args.extend(["--bootstrap-port", "0"]);
    }
    sim_with("0.01", &args)
}

/// A picker in front of these prefill and decode engines.
fn pd_gateway(tag: &str, prefill: &Proc, decode: &[&Proc], extra: &[&str]) -> Gateway {
    let mut args: Vec<String> = vec!["--prefill".into(), format!("http://{}", prefill.addr)];
    for d in decode {
        args.extend(["--decode".into(), format!("http://{}", d.addr)]);
    }
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    gateway(tag, &[], &args)
}

/// The inference requests `engine` received, oldest first (each with its
/// `leg` and `body`).
fn received(engine: &Proc) -> Vec<Value> {
    let r = support::http::http(&engine.addr, "GET", "/sim/requests", None, &[]).expect("GET /sim/requests");
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["requests"].as_array().cloned().unwrap_or_default()
}

/// A first turn of more than `pd.bypass_uncached_tokens` (256) tokens no
/// engine holds: split.
fn long_first_turn(name: &str) -> Vec<u8> {
    let rules = (0..60)
        .map(|i| format!("Rule {i}: answer as briefly as the question allows."))
        .collect::<Vec<_>>()
        .join(" ");
    let system = json!({"role": "system", "content": format!("You are {name}. {rules}")});
    chat_body(&[system, user("Where does the prefill run?")], json!({}))
}

/// vLLM's NixlConnector through the picker: the picker runs the prefill
/// leg itself and hands Envoy the decode leg's body (the prefill's
/// `kv_transfer_params`) with a decode engine picked and only decode
/// engines as fallbacks; the decode engine pulls the prompt.
#[test]
fn a_split_request_is_prefilled_by_the_picker_and_decoded_where_envoy_sends_it() {
    let p = pd_engine("prefill", "vllm-nixl");
    let decode = [pd_engine("decode", "vllm-nixl"), pd_engine("decode", "vllm-nixl")];
    let gw = pd_gateway("pd-vllm", &p, &[&decode[0], &decode[1]], &[]);
    let envoy = Envoy::of(&gw);
    let mut stream = envoy.open();
    let pick = stream.request(&[], &long_first_turn("Ada"), 2, None);
    let Pick::Routed { endpoints, body: sent } = &pick else {
        panic!("not routed: {pick:?}");
    };
    let decodes: HashSet<&str> = decode.iter().map(|d| d.addr.as_str()).collect();
    assert_eq!(
        endpoints.len(),
        2,
        "the pick and the other decode engine: {endpoints:?}"
    );
    assert!(
        endpoints.iter().all(|e| decodes.contains(e.as_str())),
        "decode engines only, never the prefill engine {}: {endpoints:?}",
        p.addr
    );
    // The prefill leg ran before the pick was answered.
    let prefilled = received(&p);
    assert_eq!(prefilled.len(), 1, "{prefilled:?}");
    assert_eq!(prefilled[0]["leg"], "prefill", "{}", prefilled[0]);
    assert_eq!(prefilled[0]["body"]["max_tokens"], 1, "{}", prefilled[0]);
    let sent_json: Value = serde_json::from_slice(sent).expect("the body sent is JSON");
    let params = &sent_json["kv_transfer_params"];
    assert_eq!(params["do_remote_prefill"], true, "{sent_json}");
    let (host, port) = p.addr.rsplit_once(':').expect("host:port");
    assert_eq!(params["remote_host"], host, "{sent_json}");
    assert_eq!(
        params["remote_port"],
        port.parse::<u64>().expect("a port"),
        "{sent_json}"
    );
    // Envoy sends it to the decode engine picked, which pulls the prompt:
    // it computes one token of it.
    let answer = forward(&endpoints[0], sent);
    assert_eq!(answer.status, 200, "{}", answer.text());
    let usage = &answer.json()["usage"];
    let prompt_tokens = usage["prompt_tokens"].as_u64().expect("usage");
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"],
        prompt_tokens - 1,
        "{usage}"
    );
    let decoded: Vec<Value> = decode.iter().flat_map(received).collect();
    assert_eq!(decoded.len(), 1, "{decoded:?}");
    assert_eq!(decoded[0]["leg"], "decode", "{}", decoded[0]);
    let passed = stream.answer(200, "application/json", &answer.body, 2);
    assert_eq!(passed, answer.body);
    assert_eq!(
        stream.answer_headers.get("x-semlb-prefill").map(String::as_str),
        Some(format!("http://{}", p.addr).as_str()),
        "the client's answer names the prefill engine, as the HTTP front's does"
    );
    assert_eq!(inflight(&gw), 0);
    let m = gw.metrics();
    assert_eq!(sample(&m, "semlb_pd_requests_total{path=\"split\"}"), Some(1.0), "{m}");
}

/// SGLang's rendezvous through the picker: the picker starts the prefill
/// leg on the prefill engine and hands Envoy the decode leg's body with
/// the same bootstrap room; the prefill leg lasts as long as the answer.
#[test]
fn an_sglang_split_meets_its_prefill_leg_at_the_bootstrap_server() {
    let p = pd_engine("prefill", "sglang");
    let d = pd_engine("decode", "sglang");
    let port = support::gateway::bootstrap_port(&p.line).expect("a bootstrap port on the first line");
    let gw = pd_gateway("pd-sglang", &p, &[&d], &["--pd-protocol", "sglang"]);
    // The gateway reads the port from the engine's /server_info.
    wait_for("the bootstrap port read from /server_info", PATIENCE, || {
        let learned = gw.listed(&p).and_then(|s| s.disaggregation.bootstrap_port);
        (learned == Some(port), learned)
    });
    let envoy = Envoy::of(&gw);
    let mut stream = envoy.open();
    let pick = stream.request(&[], &long_first_turn("Bea"), 2, None);
    let Pick::Routed { endpoints, body: sent } = &pick else {
        panic!("not routed: {pick:?}");
    };
    assert_eq!(
        endpoints,
        std::slice::from_ref(&d.addr),
        "the decode engine, no fallback"
    );
    let sent_json: Value = serde_json::from_slice(sent).expect("the body sent is JSON");
    assert_eq!(sent_json["bootstrap_port"], port, "{sent_json}");
    assert_eq!(sent_json["bootstrap_host"], "127.0.0.1", "{sent_json}");
    assert!(sent_json["bootstrap_room"].as_u64().is_some(), "{sent_json}");
    // The decode engine waits for its prefill leg, which the picker began.
    let answer = forward(&endpoints[0], sent);
    assert_eq!(answer.status, 200, "{}", answer.text());
    let prefilled = received(&p);
    assert_eq!(prefilled.len(), 1, "{prefilled:?}");
    for field in ["bootstrap_host", "bootstrap_port", "bootstrap_room"] {
        assert_eq!(prefilled[0]["body"][field], sent_json[field], "{field}");
    }
    let passed = stream.answer(200, "application/json", &answer.body, 1);
    assert_eq!(passed, answer.body);
    assert_eq!(
        stream.answer_headers.get("x-semlb-prefill").map(String::as_str),
        Some(format!("http://{}", p.addr).as_str())
    );
    let done = wait_for("the prefill leg completed", PATIENCE, || {
        let outcome = received(&p)[0]["outcome"].clone();
        (outcome == "completed", outcome)
    });
    assert_eq!(done, "completed");
    assert_eq!(inflight(&gw), 0);
}

#[test]
fn conversations_sharing_a_system_prompt_spread_while_in_flight() {
    let engines = [sim(), sim(), sim()];
    let refs: Vec<&Proc> = engines.iter().collect();
    let gw = gateway("spread", &refs, &["--policy", "cache_aware"]);
    let envoy = Envoy::of(&gw);
    let system: String = (0..110)
        .map(|i| format!("Rule {i}: the operator's handbook, section {}, applies here. ", i * 13))
        .collect();
    // Twelve conversations picked, none answered yet: all in flight.
    let mut client = envoy.client();
    let mut held = Vec::new();
    let mut per_engine: HashMap<String, usize> = HashMap::new();
    for i in 0..12 {
        let body = chat_body(
            &[
                json!({"role": "system", "content": system}),
                user(&format!("Question {i}: what is {i} cubed?")),
            ],
            json!({}),
        );
        let mut stream = envoy.stream(&mut client);
        let pick = stream.request(&[], &body, 2, None);
        *per_engine.entry(pick.endpoint().to_owned()).or_default() += 1;
        held.push(stream);
    }
    assert_eq!(inflight(&gw), 12);
    assert_eq!(per_engine.len(), 3, "every engine took some: {per_engine:?}");
    drop(held);
    wait_until_idle(&gw, "the held requests' counts to end");
}

#[test]
fn the_subset_hint_is_honoured() {
    let engines = [sim(), sim(), sim()];
    let refs: Vec<&Proc> = engines.iter().collect();
    let gw = gateway("subset", &refs, &[]);
    let envoy = Envoy::of(&gw);
    for (i, engine) in engines.iter().enumerate() {
        for turn in 0..2 {
            let body = chat_body(&[user(&format!("Subset {i}, turn {turn}"))], json!({}));
            let mut stream = envoy.open();
            let pick = stream.request(&[], &body, 1, Some(&[engine.addr.as_str()]));
            let Pick::Routed { endpoints, .. } = &pick else {
                panic!("not routed: {pick:?}");
            };
            assert_eq!(
                endpoints,
                std::slice::from_ref(&engine.addr),
                "only the subset's endpoint"
            );
        }
    }
    // Two of three: the pick and its fallback among them.
    let two = [engines[0].addr.as_str(), engines[2].addr.as_str()];
    let mut stream = envoy.open();
    let pick = stream.request(&[], &chat_body(&[user("Two of three")], json!({})), 1, Some(&two));
    let Pick::Routed { endpoints, .. } = &pick else {
        panic!("not routed: {pick:?}");
    };
    assert_eq!(
        endpoints.iter().collect::<HashSet<_>>(),
        two.iter().map(|s| s.to_string()).collect::<Vec<_>>().iter().collect()
    );
    // None of the gateway's: 503.
    let mut stream = envoy.open();
    match stream.request(
        &[],
        &chat_body(&[user("Elsewhere")], json!({})),
        1,
        Some(&["10.9.9.9:80"]),
    ) {
        Pick::Immediate { status, .. } => assert_eq!(status, 503),
        other => panic!("{other:?}"),
    }
}

/// The OpenAI-style error of an immediate response.
fn error_of(pick: &Pick, status: u16) -> (Value, HashMap<String, String>) {
    match pick {
        Pick::Immediate {
            status: s,
            headers,
            body,
        } => {
            assert_eq!(*s, status, "{}", String::from_utf8_lossy(body));
            let body: Value = serde_json::from_slice(body).expect("a JSON body");
            assert!(body["error"]["message"].is_string(), "{body}");
            assert!(body["error"]["type"].is_string(), "{body}");
            assert_eq!(
                headers.get("content-type").map(String::as_str),
                Some("application/json")
            );
            (body, headers.clone())
        }
        other => panic!("not an immediate response: {other:?}"),
    }
}

#[test]
fn errors_come_back_as_immediate_responses_and_health_follows_the_engines() {
    let mut engine = sim();
    let dir = support::TempDir::new("epp-keys");
    let keys = dir.0.join("keys.json").display().to_string();
    support::gateway::add_key(&keys, "someone", &[]);
    support::gateway::limit_tenant(&keys, "burst", &["--requests-per-minute", "1"]);
    let gw = Gateway::builder()
        .shm(&unique("errors"))
        .tag("epp-errors")
        .backends(&[&engine])
        .config(&format!(
            "[auth]\nkeys_file = \"{keys}\"\n[limits]\nmax_body_bytes = \"64KiB\"\n"
        ))
        .args(&["--epp-listen", "127.0.0.1:0"])
        .start();
    let envoy = Envoy::of(&gw);
    assert_eq!(envoy.health(""), 1, "live");
    assert_eq!(envoy.health("liveness"), 1, "live");
    wait_for("readiness with an engine up", PATIENCE, || {
        let s = envoy.health("readiness");
        (s == 1, s)
    });
    assert_eq!(envoy.health("envoy.service.ext_proc.v3.ExternalProcessor"), 1);

    // A body that is not JSON: 400.
    let pick = envoy
        .open()
        .request(&[], b"{\"model\": \"semlb-sim\", \"messages\": [", 2, None);
    let (body, _) = error_of(&pick, 400);
    assert_eq!(body["error"]["type"], "invalid_request_error");
    // A body over `limits.max_body_bytes`, in chunks: 413.
    let long = chat_body(&[user(&"many words ".repeat(7000))], json!({}));
    let (body, _) = error_of(&envoy.open().request(&[], &long, 4, None), 413);
    assert_eq!(body["error"]["code"], "payload_too_large", "{body}");
    // A tenant past its rate limit: 429 with Retry-After.
    let ask = |i: usize| {
        envoy.open().request(
            &[("x-gateway-inference-fairness-id", "burst")],
            &chat_body(&[user(&format!("burst {i}"))], json!({})),
            1,
            None,
        )
    };
    assert!(matches!(ask(0), Pick::Routed { .. }));
    let (body, headers) = error_of(&ask(1), 429);
    assert_eq!(body["error"]["code"], "rate_limit_exceeded", "{body}");
    assert!(
        headers.get("retry-after").is_some_and(|v| v.parse::<u64>().is_ok()),
        "{headers:?}"
    );
    // No engine up: not ready, and 503.
    engine.kill9();
    wait_for("readiness to drop with no engine up", PATIENCE, || {
        let s = envoy.health("readiness");
        (s == 2, s)
    });
    let pick = envoy
        .open()
        .request(&[], &chat_body(&[user("Anyone there?")], json!({})), 1, None);
    let (body, _) = error_of(&pick, 503);
    assert_eq!(body["error"]["code"], "no_server_available", "{body}");
    assert_eq!(envoy.health(""), 1, "still live");
}

/// Dispatchers of the gateway: (registry slot, pid).
fn dispatchers(gw: &Gateway) -> Vec<(u16, u32)> {
    gw.running(shm_layout::Role::Dispatcher)
        .iter()
        .map(|p| (p.slot, p.pid))
        .collect()
}

/// Inference requests each dispatcher handled (every one is counted as
/// a cache miss or bypass).
fn handled(gw: &Gateway, slot: u16) -> u64 {
    use semlb::metrics::{CacheResult, Metrics};
    let m = Metrics::new(gw.segment.tables().stats, slot);
    m.cache_count(CacheResult::Miss) + m.cache_count(CacheResult::Bypass)
}

#[test]
fn two_pickers_on_one_segment_see_each_others_routing() {
    let engines = [sim(), sim(), sim()];
    let refs: Vec<&Proc> = engines.iter().collect();
    let gw = gateway("two", &refs, &["--dispatchers", "2"]);
    let envoy = Envoy::of(&gw);
    let both = dispatchers(&gw);
    assert_eq!(both.len(), 2);
    let before: Vec<u64> = both.iter().map(|(s, _)| handled(&gw, *s)).collect();
    let first = [user("Tell me about the history of the printing press.")];
    let (engine, answer, _) = through(&envoy, &[], &chat_body(&first, json!({})));
    gw.written_back(semlb::metrics::responder_records);
    let after: Vec<u64> = both.iter().map(|(s, _)| handled(&gw, *s)).collect();
    let served = (0..2)
        .find(|i| after[*i] > before[*i])
        .expect("a dispatcher handled it");
    // The other dispatcher alone accepts now: the one that learned the
    // conversation is stopped.
    let (stopped, other) = (both[served], both[1 - served]);
    kill(Pid::from_raw(stopped.1 as i32), Signal::SIGSTOP).expect("SIGSTOP");
    let reply = answer.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    let second = [
        first[0].clone(),
        json!({"role": "assistant", "content": reply}),
        user("And who came after Gutenberg?"),
    ];
    let before_other = handled(&gw, other.0);
    let (again, answer, _) = through(&envoy, &[], &chat_body(&second, json!({})));
    kill(Pid::from_raw(stopped.1 as i32), Signal::SIGCONT).expect("SIGCONT");
    assert_eq!(answer.status, 200);
    assert_eq!(handled(&gw, other.0), before_other + 1, "the other dispatcher picked");
    assert_eq!(again, engine, "it routed the conversation where the first learned it");
}

/// Removes the segment and stops the successor (no child of the test)
/// when dropped.
struct Successor {
    shm: String,
    pid: Option<u32>,
}

impl Drop for Successor {
    fn drop(&mut self) {
        if let Some(pid) = self.pid {
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
            let deadline = std::time::Instant::now() + PATIENCE;
            while kill(Pid::from_raw(pid as i32), None).is_ok() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = shm_layout::Segment::remove(&self.shm);
    }
}

#[test]
fn the_picker_listener_is_handed_over_in_an_upgrade() {
    use support::process::ProcBuilder;
    let engine = sim();
    let shm = unique("upgrade");
    let mut successor = Successor {
        shm: shm.clone(),
        pid: None,
    };
    let args = Gateway::builder()
        .backends(&[&engine])
        .args(&["--epp-listen", "127.0.0.1:0"])
        .serve_args(&shm);
    let mut old = ProcBuilder::new(&args).what("the gateway to upgrade").start();
    let addr = old
        .line
        .split_once("grpc://")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .expect("a picker address")
        .to_owned();
    let segment = shm_layout::Segment::open(&shm).expect("the segment");
    let supervisor = || {
        segment
            .tables()
            .registry
            .processes()
            .find(|p| p.role == Some(shm_layout::Role::Supervisor) && p.state == shm_layout::ProcessState::Running)
            .map(|p| p.pid)
    };
    let envoy = Envoy {
        rt: tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap(),
        addr,
    };
    wait_for("the picker to be ready", PATIENCE, || {
        let s = envoy.health("readiness");
        (s == 1, s)
    });
    let body = chat_body(&[user("Before the upgrade")], json!({}));
    assert!(matches!(envoy.open().request(&[], &body, 1, None), Pick::Routed { .. }));

    let old_pid = old.pid().as_raw() as u32;
    kill(old.pid(), Signal::SIGUSR2).expect("SIGUSR2");
    // The old supervisor exits once the successor said it is ready; the
    // successor's dispatchers then answer on the same picker address: it
    // was handed the socket (binding `--epp-listen 127.0.0.1:0` anew would
    // listen elsewhere; a fixed port would not bind while the old
    // supervisor held it, and the upgrade would fail).
    let status = old
        .wait_exit(Duration::from_secs(60))
        .expect("the old supervisor exits");
    assert_eq!(status.code(), Some(0));
    let new_pid = supervisor().expect("a supervisor");
    assert_ne!(new_pid, old_pid);
    successor.pid = Some(new_pid);
    wait_for("the successor's picker to be ready", PATIENCE, || {
        let s = envoy.health("readiness");
        (s == 1, s)
    });
    let body = chat_body(&[user("After the upgrade")], json!({}));
    let pick = envoy.open().request(&[], &body, 1, None);
    assert_eq!(
        pick.endpoint(),
        engine.addr,
        "the successor's dispatchers pick on the same address"
    );
}

#[test]
fn a_message_out_of_order_is_a_grpc_error_and_the_picker_serves_on() {
    let engine = sim();
    let gw = gateway("order", &[&engine], &[]);
    let envoy = Envoy::of(&gw);
    // A body before any headers: Envoy's mistake, not a client's.
    let mut stream = envoy.open();
    stream.send(
        processing_request::Request::RequestBody(HttpBody {
            body: b"{}".to_vec(),
            end_of_stream: true,
            ..HttpBody::default()
        }),
        None,
    );
    let rx = &mut stream.rx;
    let answer = envoy
        .rt
        .block_on(async { tokio::time::timeout(PATIENCE, rx.message()).await })
        .expect("an answer in time");
    let status = answer.expect_err("a gRPC error");
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
    assert_eq!(inflight(&gw), 0);
    // The next stream is served.
    let body = chat_body(&[user("In order this time")], json!({}));
    assert_eq!(envoy.open().request(&[], &body, 1, None).endpoint(), engine.addr);
}
