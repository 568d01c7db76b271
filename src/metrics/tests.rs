//! Tests of the word map, the recording and the rendering.

use super::*;
use shm_layout::{LayoutPlan, Segment};

use super::Observation;

fn empty() -> Snapshot {
    Snapshot {
        counters: vec![0; STAT_WORDS],
        servers: Vec::new(),
        prefix_entries: 0,
        prefix_capacity: 0,
        response_records: 0,
        ring_dropped: 0,
        restarts: [0; 2],
        cost_weights: Vec::new(),
        usage: Vec::new(),
    }
}

/// The lines of `text` for one family (its HELP, TYPE and samples).
fn family_of(text: &str, name: &str) -> String {
    text.lines()
        .filter(|l| {
            let l = l.trim_start_matches("# HELP ").trim_start_matches("# TYPE ");
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with([' ', '{', '_']) && !rest.starts_with("_total"))
        })
        .map(|l| format!("{l}\n"))
        .collect()
}

#[test]
fn codes_and_endpoints_map_to_labels() {
    assert_eq!(CODE_LABELS[code_index(200)], "200");
    assert_eq!(CODE_LABELS[code_index(201)], "2xx");
    assert_eq!(CODE_LABELS[code_index(302)], "3xx");
    assert_eq!(CODE_LABELS[code_index(418)], "4xx");
    assert_eq!(CODE_LABELS[code_index(503)], "503");
    assert_eq!(CODE_LABELS[code_index(599)], "5xx");
    assert_eq!(CODE_LABELS[code_index(99)], "1xx");
    assert_eq!(
        EndpointLabel::of_path("/v1/chat/completions"),
        EndpointLabel::ChatCompletions
    );
    assert_eq!(EndpointLabel::of_path("/metrics"), EndpointLabel::Other);
}

#[test]
fn histogram_buckets_are_inclusive_upper_bounds() {
    let h = TTFT;
    assert_eq!(h.bucket(0.0), h.base);
    assert_eq!(h.bucket(0.005), h.base, "le is inclusive");
    assert_eq!(h.bucket(0.0051), h.base + 1);
    assert_eq!(h.bucket(60.0), h.base + 12);
    assert_eq!(h.bucket(61.0), h.base + 13, "+Inf");
    let r = PREFIX_RATIO;
    assert_eq!(r.bucket(0.0), r.base, "no match has its own bucket");
    assert_eq!(r.bucket(0.05), r.base + 1);
    assert_eq!(r.bucket(1.0), r.base + 10);
}

#[test]
fn index_map_regions_do_not_overlap() {
    let stages = [Stage::Tokenize, Stage::Lookup, Stage::Route, Stage::Total].map(Stage::histogram);
    let mut spans = vec![
        (REQUESTS, UPSTREAM),
        (UPSTREAM, CACHE),
        (CACHE, RETRIES),
        (RETRIES, RECORDS),
        (RECORDS, DEGRADED),
        (DEGRADED, RESPONDER),
        (RESPONDER, HISTOGRAMS),
    ];
    for h in [TTFT, DURATION].iter().chain(&stages).chain([&PREFIX_RATIO]) {
        spans.push((h.base, h.sum_word() + 1));
    }
    spans.sort();
    for w in spans.windows(2) {
        assert!(w[0].1 <= w[1].0, "{w:?} overlap");
    }
    assert!(spans.last().unwrap().1 <= STAT_WORDS);
}

#[test]
fn recording_sums_over_processes() {
    let seg = Segment::heap(&LayoutPlan::for_size(8 << 20).unwrap());
    let t = seg.tables();
    let (a, b) = (Metrics::new(t.stats, 1), Metrics::new(t.stats, 2));
    a.request(EndpointLabel::Completions, 200);
    b.request(EndpointLabel::Completions, 200);
    b.request(EndpointLabel::Health, 503);
    a.cache(CacheResult::Hit);
    b.observe(TTFT, 0.02);
    a.observe(TTFT, 0.3);
    a.prefix_match(3, 4);
    b.prefix_match(0, 0);
    assert_eq!((a.requests(None), b.requests(None), b.requests(Some(5))), (1, 2, 1));
    let text = Snapshot::collect(&t, 0, 1000).render();
    assert!(
        text.contains("semlb_requests_total{endpoint=\"completions\",code=\"200\"} 2\n"),
        "{text}"
    );
    assert!(text.contains("semlb_response_cache_total{result=\"hit\"} 1\n"));
    assert!(text.contains("semlb_ttft_seconds_bucket{le=\"0.025\"} 1\n"));
    assert!(text.contains("semlb_ttft_seconds_bucket{le=\"0.5\"} 2\n"));
    assert!(text.contains("semlb_ttft_seconds_sum 0.32\n"));
    assert!(text.contains("semlb_ttft_seconds_count 2\n"));
    assert!(text.contains("semlb_prefix_match_ratio_bucket{le=\"0.8\"} 1\n"));
    assert!(text.contains("semlb_prefix_match_ratio_count 1\n"));
}

#[test]
fn predictions_are_counted_per_server_over_processes() {
    let seg = Segment::heap(&LayoutPlan::for_size(8 << 20).unwrap());
    let t = seg.tables();
    let server = t.servers.register(3, "http://e", 0).unwrap();
    t.servers.set_state(server, shm_layout::ServerState::Up);
    let (a, b) = (Metrics::new(t.stats, 1), Metrics::new(t.stats, 2));
    let slot = server.slot;
    let seen = |predicted, cached, short, demoted| Observation {
        slot,
        predicted,
        cached,
        short,
        demoted,
    };
    a.prediction(&seen(64, 64, false, false));
    b.prediction(&seen(48, 0, true, true));
    b.prediction(&seen(32, 80, false, false));
    b.forgotten();
    let text = Snapshot::collect(&t, 0, 1000).render();
    for line in [
        "semlb_prefix_predicted_tokens_total{server=\"http://e\"} 144\n",
        "semlb_prefix_confirmed_tokens_total{server=\"http://e\"} 96\n",
        "semlb_prefix_shortfalls_total{server=\"http://e\"} 1\n",
        "semlb_prefix_demotions_total{server=\"http://e\"} 1\n",
        "semlb_prefix_servers_forgotten_total 1\n",
    ] {
        assert!(text.contains(line), "{line} in\n{text}");
    }
    let counters = t.stats.sum_all();
    let want = PredictionTotals {
        predicted: 144,
        confirmed: 96,
        shortfalls: 1,
        demotions: 1,
    };
    assert_eq!(prediction_total(&counters, slot), want);
}

#[test]
fn renders_exact_text_for_a_fixture() {
    let mut s = empty();
    s.counters[REQUESTS + EndpointLabel::ChatCompletions as usize * CODE_LABELS.len() + code_index(200)] = 3;
    s.counters[UPSTREAM + 2 * 2] = 5;
    s.counters[UPSTREAM + 2 * 2 + 1] = 1;
    s.counters[CACHE] = 2;
    s.counters[RETRIES] = 1;
    s.counters[PREFIX_RATIO.base] = 1;
    s.counters[PREFIX_RATIO.base + 10] = 2;
    s.counters[PREFIX_RATIO.sum_word()] = 2_000_000;
    s.servers.push(ServerGauges {
        slot: 2,
        address: "http://a\"b\\c\n:8000".into(),
        state: ServerState::Draining,
        inflight: 4,
        load: Some(LoadFigures {
            waiting: 1,
            running: 7,
            kv_usage_permyriad: 2500,
            scraped_at_ms: 5,
            pending_at_scrape: 0,
        }),
        admission_limit: 6.5,
    });
    s.prefix_entries = 10;
    s.prefix_capacity = 64;
    s.restarts = [1, 0];
    s.cost_weights = vec![(3, 0.5)];
    let text = s.render();
    let srv = r#"server="http://a\"b\\c\n:8000""#;
    let want = [
        "# HELP semlb_requests_total HTTP requests answered, by endpoint and status.\n\
         # TYPE semlb_requests_total counter\n\
         semlb_requests_total{endpoint=\"chat_completions\",code=\"200\"} 3\n"
            .to_owned(),
        format!(
            "# HELP semlb_upstream_requests_total Upstream attempts per server: answered in full (ok) or failed (error).\n\
             # TYPE semlb_upstream_requests_total counter\n\
             semlb_upstream_requests_total{{{srv},outcome=\"ok\"}} 5\n\
             semlb_upstream_requests_total{{{srv},outcome=\"error\"}} 1\n"
        ),
        "semlb_response_cache_total{result=\"hit\"} 2\n\
         semlb_response_cache_total{result=\"miss\"} 0\n\
         semlb_response_cache_total{result=\"bypass\"} 0\n\
         # HELP semlb_retries_total Upstream attempts after the first of a request.\n\
         # TYPE semlb_retries_total counter\n\
         semlb_retries_total 1\n"
            .to_owned(),
        "# TYPE semlb_prefix_match_ratio histogram\n\
         semlb_prefix_match_ratio_bucket{le=\"0\"} 1\n\
         semlb_prefix_match_ratio_bucket{le=\"0.1\"} 1\n"
            .to_owned(),
        "semlb_prefix_match_ratio_bucket{le=\"0.9\"} 1\n\
         semlb_prefix_match_ratio_bucket{le=\"1\"} 3\n\
         semlb_prefix_match_ratio_bucket{le=\"+Inf\"} 3\n\
         semlb_prefix_match_ratio_sum 2\n\
         semlb_prefix_match_ratio_count 3\n"
            .to_owned(),
        format!(
            "semlb_server_inflight_requests{{{srv}}} 4\n\
             # HELP semlb_server_up 1 if the server takes requests (state up).\n\
             # TYPE semlb_server_up gauge\n\
             semlb_server_up{{{srv}}} 0\n\
             # HELP semlb_server_state The server's state: 1 for the current one.\n\
             # TYPE semlb_server_state gauge\n\
             semlb_server_state{{{srv},state=\"up\"}} 0\n\
             semlb_server_state{{{srv},state=\"draining\"}} 1\n\
             semlb_server_state{{{srv},state=\"down\"}} 0\n"
        ),
        format!("semlb_server_running_requests{{{srv}}} 7\n"),
        format!("semlb_server_admission_limit{{{srv}}} 6.5\n"),
        "# TYPE semlb_cost_weight gauge\nsemlb_cost_weight{dispatcher=\"3\"} 0.5\n".to_owned(),
        format!("semlb_server_kv_cache_usage_ratio{{{srv}}} 0.25\n"),
        "# TYPE semlb_prefix_table_entries gauge\n\
         semlb_prefix_table_entries 10\n\
         # HELP semlb_prefix_table_capacity Prefix-table slots.\n\
         # TYPE semlb_prefix_table_capacity gauge\n\
         semlb_prefix_table_capacity 64\n"
            .to_owned(),
        "semlb_process_restarts_total{role=\"dispatcher\"} 1\n\
         semlb_process_restarts_total{role=\"responder\"} 0\n"
            .to_owned(),
    ];
    for w in &want {
        assert!(text.contains(w.as_str()), "missing:\n{w}\nin:\n{text}");
    }
    // The whole of one small family, exactly.
    assert_eq!(
        family_of(&text, "semlb_store_degraded_lookups_total"),
        "# HELP semlb_store_degraded_lookups_total Routing lookups answered without the store (unreachable or slow).\n\
         # TYPE semlb_store_degraded_lookups_total counter\n\
         semlb_store_degraded_lookups_total 0\n"
    );
    // Every family has HELP and TYPE, once.
    let types = text.lines().filter(|l| l.starts_with("# TYPE ")).count();
    let helps = text.lines().filter(|l| l.starts_with("# HELP ")).count();
    assert_eq!(types, helps);
    assert!(types >= 25, "{types} families");
    // A server without fresh load has no load samples.
    s.servers[0].load = None;
    let text = s.render();
    assert!(!text.contains("semlb_server_kv_cache_usage_ratio{"));
    assert!(!text.contains("semlb_server_waiting_requests{"));
}
