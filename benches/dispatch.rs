//! The dispatch path of one request, stage by stage, for a ~2 000-token
//! chat prompt: what a dispatcher does between receiving a request and
//! sending it upstream (the HTTP parts aside).
//!
//! 1. `parse_render`: parse the JSON body and render the chat messages
//!    (`authenticate`: the caller of a key among 1 000, when `[auth]` is
//!    on; `pool_lookup`: the model pool of a name among 16 pools and 64
//!    aliases);
//! 2. `tokenize`: the real tokenizer (bundled phi-2; Qwen3 too when
//!    ../shared holds it);
//! 3. `hash_blocks`: the 16-token block chain;
//! 4. `cache_lookup`: the response-cache key and a (missing) lookup;
//! 5. `prefix_lookup`: longest-prefix match of the chain in a 256 MiB shm
//!    segment holding 500 such conversations on 4 servers
//!    (`prefix_lookup_precise`: the precise source, two of the servers'
//!    engines followed through their KV events);
//! 6. `choose/<policy>`: gather the live servers and run each routing policy
//!    (`shared_header`: the shared-header check every new request makes
//!    before it, [`semlb::routing::shared_header`]);
//! 7. `total`: all of it.
//!
//! And `kv_events/store_and_remove_32_blocks`: what a response process
//! does with an engine's KV events, per block (decode, hash, apply).
//!
//! The prompts are real dialogues (Anthropic HH-RLHF, ../shared/data/prompts)
//! concatenated to ~2 000 tokens, or a fixed text when ../shared is absent.
//! `cargo bench --bench dispatch`. It prints figures; it asserts nothing.

use std::hint::black_box;
use std::path::Path;

use criterion::{Criterion, criterion_group, criterion_main};
use semlb::openai::prompt::{Endpoint, RoutingInput, parse};
use semlb::prefix::blocks::BlockHasher;
use semlb::response_cache::{Tenant, key};
use semlb::routing::{self, PolicyConfig, RouteInput, live_candidates};
use semlb::store::shm::prefix_match;
use semlb_tokenizer::Tokenizer;
use semlb_tokenizer::chat::ChatTemplate;
use shm_layout::{LayoutPlan, Segment, Stamp};

/// The response-cache key of a chat body, as an anonymous client's.
fn cache_key(body: &semlb::openai::body::Object<'_>) -> shm_layout::ResponseKey {
    key(
        &semlb::response_cache::KeySecret::new(1),
        Tenant::ANONYMOUS,
        Endpoint::ChatCompletions,
        "",
        &http::HeaderMap::new(),
        body,
    )
}

const SHARED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/data");

/// Chat bodies of about `target` tokens each: real dialogues if available.
fn bodies(tokenizer: &Tokenizer, count: usize, target: usize) -> Vec<String> {
    let source = std::fs::read_to_string(Path::new(SHARED).join("prompts/hh-rlhf-helpful-base-test.jsonl"))
        .ok()
        .map(|s| {
            s.lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .filter_map(|v| v["chosen"].as_str().map(str::to_owned))
                .collect::<Vec<_>>()
        })
        .filter(|d| !d.is_empty())
        .unwrap_or_else(|| {
            (0..64)
                .map(|i| {
                    format!(
                        "Human: question {i} about caching, routing and batching? Assistant: {}",
                        "an answer that goes on ".repeat(20)
                    )
                })
                .collect()
        });
    let mut out = Vec::with_capacity(count);
    let mut next = 0usize;
    for c in 0..count {
        let mut text = format!("Conversation {c}.\n");
        while tokenizer.encode(&text).len() < target {
            text.push_str(&source[next % source.len()]);
            next += 1;
        }
        let body = serde_json::json!({
            "model": "semlb-sim",
            "temperature": 0,
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": text},
            ],
        });
        out.push(body.to_string());
    }
    out
}

fn dispatch(c: &mut Criterion) {
    let template = ChatTemplate::canonical();
    let mut tokenizers = vec![("phi2", Tokenizer::bundled())];
    if let Ok(q) = Tokenizer::from_file(&Path::new(SHARED).join("tokenizers/qwen3-tokenizer.json")) {
        tokenizers.push(("qwen3", q));
    }
    let name = format!("semlb-bench-dispatch-{}", std::process::id());
    let _ = Segment::remove(&name);
    let seg = Segment::create(&name, &LayoutPlan::for_size(256 << 20).unwrap()).expect("segment");
    let t = seg.tables();
    let servers: Vec<_> = (0..4)
        .map(|i| {
            t.servers
                .register(i, &format!("http://127.0.0.1:{}", 8000 + i), 0)
                .unwrap()
        })
        .collect();
    let policy = routing::build(&PolicyConfig::default());
    let hasher = BlockHasher::new(BlockHasher::root_for("semlb-sim", seg.header().seed[0]), 16);
    let mut buf = Vec::new();
    let mut candidates = Vec::new();

    for (tok_name, tokenizer) in &tokenizers {
        let bodies = bodies(tokenizer, 500, 2000);
        // Warm the table: every conversation cached on one of the servers.
        let mut chain = Vec::new();
        let mut texts = Vec::new();
        for (i, b) in bodies.iter().enumerate() {
            let parsed = parse(Endpoint::ChatCompletions, b.as_bytes(), &template, &Default::default()).unwrap();
            let RoutingInput::Text(text) = parsed.input else {
                unreachable!("chat renders text")
            };
            hasher.chain(&tokenizer.encode(&text), &mut chain);
            t.prefix.insert_chain(&chain, servers[i % 4], Stamp(1));
            // Two of the four engines publish KV events (the precise lookup).
            if i % 4 < 2 {
                t.confirmed.insert_chain(&chain, servers[i % 4], Stamp(1));
            }
            texts.push(text);
        }
        let tokens = tokenizer.encode(&texts[0]);
        eprintln!(
            "{tok_name}: prompt of {} tokens, {} blocks",
            tokens.len(),
            tokens.len() / 16
        );
        let mut g = c.benchmark_group(format!("dispatch_2k_{tok_name}"));
        let mut i = 0usize;
        g.bench_function("parse_render", |b| {
            b.iter(|| {
                i = (i + 1) % bodies.len();
                black_box(
                    parse(
                        Endpoint::ChatCompletions,
                        bodies[i].as_bytes(),
                        &template,
                        &Default::default(),
                    )
                    .unwrap(),
                )
            })
        });
        // Client authentication: the caller of a request's key among 1 000
        // keys (SHA-256 of the key and a map lookup).
        let mut file = semlb::tenancy::auth::KeysFile::default();
        let made: Vec<String> = (0..1000)
            .map(|n| file.add(&format!("tenant-{n}"), Vec::new(), None).unwrap().0)
            .collect();
        let keys = semlb::tenancy::auth::Keys::new(&file);
        let requests: Vec<http::HeaderMap> = made
            .iter()
            .map(|k| {
                let mut h = http::HeaderMap::new();
                h.insert("authorization", format!("Bearer {k}").parse().unwrap());
                h
            })
            .collect();
        g.bench_function("authenticate", |b| {
            b.iter(|| {
                i = (i + 1) % requests.len();
                black_box(keys.caller(&requests[i]).is_ok())
            })
        });
        // The model pool a request names, among 16 pools with 4 aliases each.
        let pools_config = semlb::config::ServeConfig {
            backends: vec![semlb::config::BackendConfig::new("http://127.0.0.1:9")],
            models: (0..16)
                .map(|n| semlb::config::ModelConfig {
                    aliases: (0..4).map(|a| format!("model-{n}-alias-{a}")).collect(),
                    ..semlb::config::ModelConfig::new(format!("model-{n}"), &["127.0.0.1:9"])
                })
                .collect(),
            ..Default::default()
        };
        let pools = semlb::pools::ModelPools::build(
            &pools_config,
            &mut semlb::pools::TokenizerLoader::new(&pools_config, 0, None),
            None,
        )
        .unwrap();
        let names: Vec<String> = (0..64).map(|n| format!("model-{}-alias-{}", n % 16, n % 4)).collect();
        g.bench_function("pool_lookup", |b| {
            b.iter(|| {
                i = (i + 1) % names.len();
                black_box(pools.find(&names[i]).is_some())
            })
        });
        g.bench_function("tokenize", |b| {
            b.iter(|| {
                i = (i + 1) % texts.len();
                black_box(tokenizer.encode(&texts[i]))
            })
        });
        let all_tokens: Vec<Vec<u32>> = texts.iter().map(|x| tokenizer.encode(x)).collect();
        g.bench_function("hash_blocks", |b| {
            b.iter(|| {
                i = (i + 1) % all_tokens.len();
                hasher.chain(&all_tokens[i], &mut chain);
                black_box(chain.len())
            })
        });
        let parsed: Vec<_> = bodies
            .iter()
            .map(|b| parse(Endpoint::ChatCompletions, b.as_bytes(), &template, &Default::default()).unwrap())
            .collect();
        g.bench_function("cache_lookup", |b| {
            b.iter(|| {
                i = (i + 1) % parsed.len();
                let k = cache_key(&parsed[i].body);
                black_box(t.responses.get_into(k, &mut buf).is_some())
            })
        });
        let chains: Vec<Vec<u64>> = all_tokens
            .iter()
            .map(|x| {
                let mut ch = Vec::new();
                hasher.chain(x, &mut ch);
                ch
            })
            .collect();
        g.bench_function("prefix_lookup", |b| {
            b.iter(|| {
                i = (i + 1) % chains.len();
                black_box(prefix_match(&t, seg.clock().now_ms(), &chains[i], &[], None))
            })
        });
        // With peer gateways: a turn's match against the conversations
        // forwarded to peers (every other prompt went to one).
        let peers = [
            (semlb::peers::affinity::peer_ref(0, "http://10.1.0.1:8080"), Some(300)),
            (semlb::peers::affinity::peer_ref(1, "http://10.1.0.2:8080"), Some(300)),
        ];
        for (n, ch) in chains.iter().enumerate().step_by(2) {
            let peer = peers[n / 2 % 2].0;
            semlb::peers::affinity::record(
                &t.prefix,
                &semlb::peers::affinity::peer_chain(ch),
                peer,
                seg.clock().stamp(),
            );
        }
        g.bench_function("peer_affinity_lookup", |b| {
            b.iter(|| {
                i = (i + 1) % chains.len();
                let chain = semlb::peers::affinity::peer_chain(&chains[i]);
                black_box(semlb::peers::affinity::matched(
                    &t.prefix,
                    &chain,
                    seg.clock().stamp(),
                    &peers,
                ))
            })
        });
        for s in &servers[..2] {
            t.servers.set_kv_events(*s, Some(shm_layout::KvEventsSync::Complete));
        }
        // The precise source: the estimate and the confirmed table.
        g.bench_function("prefix_lookup_precise", |b| {
            b.iter(|| {
                i = (i + 1) % chains.len();
                black_box(prefix_match(&t, seg.clock().now_ms(), &chains[i], &[], Some(2)))
            })
        });
        for s in &servers[..2] {
            t.servers.set_kv_events(*s, None);
        }
        let matches: Vec<_> = chains
            .iter()
            .map(|ch| t.prefix.longest_prefix_match(ch, |s| t.servers.is_live(s)))
            .collect();
        // Each policy's choice (candidates read from the table each time).
        for kind in semlb::routing::PolicyKind::ALL {
            let each = semlb::routing::build(&semlb::routing::PolicyConfig {
                kind,
                ..Default::default()
            });
            g.bench_function(format!("choose/{kind}"), |b| {
                b.iter(|| {
                    i = (i + 1) % matches.len();
                    live_candidates(&t, &mut candidates);
                    let tokens = (chains[i].len() * 16) as u32;
                    let input = RouteInput::new(&chains[i], tokens, 16, &matches[i], &candidates);
                    black_box(each.choose(&input))
                })
            });
        }
        // The shared-header check each new request makes (one sketch
        // count, the matches' depths sorted, a few reads).
        let headers = semlb::routing::shared_header::SharedHeaders::new();
        g.bench_function("shared_header", |b| {
            b.iter(|| {
                i = (i + 1) % matches.len();
                black_box(headers.observe_match(&chains[i], &matches[i], false))
            })
        });
        g.bench_function("total", |b| {
            b.iter(|| {
                i = (i + 1) % bodies.len();
                let p = parse(
                    Endpoint::ChatCompletions,
                    bodies[i].as_bytes(),
                    &template,
                    &Default::default(),
                )
                .unwrap();
                let RoutingInput::Text(text) = &p.input else {
                    unreachable!()
                };
                hasher.chain(&tokenizer.encode(text), &mut chain);
                let k = cache_key(&p.body);
                let hit = t.responses.get_into(k, &mut buf).is_some();
                let m = prefix_match(&t, seg.clock().now_ms(), &chain, &[], None);
                live_candidates(&t, &mut candidates);
                let tokens = (chain.len() * 16) as u32;
                let input = RouteInput::new(&chain, tokens, 16, &m, &candidates);
                black_box((hit, policy.choose(&input)))
            })
        });
        g.finish();
    }
    let _ = Segment::remove(&name);
}

/// The engines' KV events applied by a response process: one batch that
/// stores a 32-block prompt (decoded, hashed into the gateway's chain from
/// its token ids, inserted into the confirmed table) and one that removes
/// those blocks. Criterion's element rate is per block (64 per iteration).
fn kv_events(c: &mut Criterion) {
    use semlb::kv_events::follower::{ChainRoots, Follower};
    use semlb::kv_events::wire::decode_batch;
    use semlb_workers::kv_events::{KvEvent, WireHash, encode_batch};

    const BLOCKS: u64 = 32;
    let name = format!("semlb-bench-kvev-{}", std::process::id());
    let _ = Segment::remove(&name);
    let seg = Segment::create(&name, &LayoutPlan::for_size(256 << 20).unwrap()).expect("segment");
    let t = seg.tables();
    let server = t.servers.register(1, "http://127.0.0.1:8000", 0).unwrap();
    let hasher = BlockHasher::new(BlockHasher::root_for("semlb-sim", seg.header().seed[0]), 16);
    let roots = ChainRoots {
        base: Some(hasher),
        adapters: Default::default(),
    };
    let mut follower = Follower::new(server, roots);
    // 1024 prompts of their own, so the table sees new keys.
    let batches: Vec<(Vec<u8>, Vec<u8>)> = (0..1024u64)
        .map(|p| {
            let hashes: Vec<WireHash> = (0..BLOCKS).map(|b| WireHash::from(p << 20 | b)).collect();
            let stored = KvEvent::Stored {
                block_hashes: hashes.clone(),
                parent: None,
                token_ids: (0..BLOCKS as u32 * 16).map(|i| p as u32 * 100_000 + i).collect(),
                block_size: 16,
                lora_name: None,
                salt: None,
            };
            (
                encode_batch(1.0, &[stored], None),
                encode_batch(1.0, &[KvEvent::Removed(hashes)], None),
            )
        })
        .collect();
    let mut g = c.benchmark_group("kv_events");
    g.throughput(criterion::Throughput::Elements(2 * BLOCKS));
    let mut i = 0;
    g.bench_function("store_and_remove_32_blocks", |b| {
        b.iter(|| {
            i = (i + 1) % batches.len();
            let now = seg.clock().stamp();
            let stored = decode_batch(&batches[i].0).unwrap();
            let a = follower.apply(&stored, &t, now);
            let removed = decode_batch(&batches[i].1).unwrap();
            let r = follower.apply(&removed, &t, now);
            black_box((a.stored, r.removed))
        })
    });
    g.finish();
    let _ = Segment::remove(&name);
}

criterion_group!(benches, dispatch, kv_events);
criterion_main!(benches);
