//! The reading side: [`Snapshot`], one scrape's counters and gauges, and
//! its Prometheus text.

use super::*;

/// Everything one scrape renders: the counters summed over all processes
/// and the gauges read from the segment.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    /// Every stats word summed over all process blocks ([`STAT_WORDS`] long).
    pub counters: Vec<u64>,
    /// The registered servers.
    pub servers: Vec<ServerGauges>,
    /// Occupied prefix-table slots.
    pub prefix_entries: u64,
    /// Prefix-table slots.
    pub prefix_capacity: u64,
    /// Records written to the response log.
    pub response_records: u64,
    /// Completion records dropped by the rings (full or too large).
    pub ring_dropped: u64,
    /// Restarts per role (dispatcher, responder).
    pub restarts: [u64; 2],
    /// The weight each running dispatcher's `cost` policy tunes:
    /// `(registry slot, weight)`.
    pub cost_weights: Vec<(u16, f64)>,
    /// Usage per tenant and model ([`shm_layout::usage_table`]).
    pub usage: Vec<UsageRow>,
}

impl Snapshot {
    /// The Prometheus text of `segment` now: [`Self::collect`] then
    /// [`Self::render`] (a scan: run it off the reactor).
    pub fn text_of(segment: &shm_layout::Segment, stale_after_ms: u64) -> String {
        Self::collect(&segment.tables(), segment.clock().now_ms(), stale_after_ms).render()
    }

    /// Reads a snapshot from the segment's tables. Scraped load older than
    /// `stale_after_ms` (segment milliseconds before `now_ms`) is left out.
    /// Counting the prefix table's entries scans it (run it off the reactor).
    pub fn collect(tables: &Tables<'_>, now_ms: u64, stale_after_ms: u64) -> Self {
        let servers = tables
            .servers
            .servers()
            .filter(|s| s.state != ServerState::Configuring)
            .map(|s| ServerGauges {
                slot: s.server.slot,
                address: s.address,
                state: s.state,
                inflight: s.inflight_requests,
                load: crate::health::fresh_load(s.load, now_ms, stale_after_ms),
                admission_limit: crate::routing::capacity::Admission::of(s.engine_slots, s.admission_limit).value(),
            })
            .collect();
        let mut restarts = [0; 2];
        let mut cost_weights = Vec::new();
        for p in tables.registry.processes() {
            if let (Some(Role::Dispatcher), ProcessState::Running, Some(w)) = (p.role, p.state, p.tuned) {
                cost_weights.push((p.slot, w));
            }
            match p.role {
                Some(Role::Dispatcher) => restarts[0] += p.restarts,
                Some(Role::Responder) => restarts[1] += p.restarts,
                _ => {}
            }
        }
        Self {
            counters: tables.stats.sum_all(),
            servers,
            prefix_entries: tables
                .prefix
                .occupancy_estimate(OCCUPANCY_SAMPLE_BUCKETS, OCCUPANCY_SAMPLE_ENTRIES),
            prefix_capacity: tables.prefix.capacity(),
            response_records: tables.responses.stats().records,
            ring_dropped: (0..tables.ring_count()).map(|i| tables.ring(i).stats().dropped).sum(),
            restarts,
            cost_weights,
            usage: tables.usage.rows(),
        }
    }

    fn counter(&self, index: usize) -> u64 {
        self.counters.get(index).copied().unwrap_or(0)
    }

    /// Requests in the gateway queues: entered less left (routed,
    /// abandoned, timed out). A dispatcher killed with requests queued
    /// leaves them counted until the gateway restarts.
    pub fn queue_depth(&self) -> u64 {
        queue_total(&self.counters).depth()
    }

    /// The Prometheus text exposition (format 0.0.4).
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(16 << 10);
        let o = &mut out;
        self.render_requests(o);
        self.render_prefix_learning(o);
        self.render_cache_and_writes(o);
        self.render_latencies(o);
        self.render_queue(o);
        self.render_dispatch_learning(o);
        self.render_servers(o);
        self.render_usage(o);
        self.render_segment(o);
        out
    }

    /// Requests answered and upstream attempts.
    fn render_requests(&self, o: &mut String) {
        family(
            o,
            "semlb_requests_total",
            "counter",
            "HTTP requests answered, by endpoint and status.",
        );
        for (e, endpoint) in ENDPOINTS.iter().enumerate() {
            for (c, code) in CODE_LABELS.iter().enumerate() {
                let n = self.counter(request_word(e, c));
                if n > 0 {
                    sample(o, "semlb_requests_total", &[("endpoint", endpoint), ("code", code)], n);
                }
            }
        }

        family(
            o,
            "semlb_upstream_requests_total",
            "counter",
            "Upstream attempts per server: answered in full (ok) or failed (error).",
        );
        for s in &self.servers {
            for (k, outcome) in ["ok", "error"].into_iter().enumerate() {
                let n = self.counter(UPSTREAM + usize::from(s.slot) * 2 + k);
                sample(
                    o,
                    "semlb_upstream_requests_total",
                    &[("server", &s.address), ("outcome", outcome)],
                    n,
                );
            }
        }
    }

    /// What the prefix table predicted and the engines confirmed, forgotten servers, KV events, peers.
    fn render_prefix_learning(&self, o: &mut String) {
        let per_server = [
            (
                "semlb_prefix_predicted_tokens_total",
                "Prompt tokens the routing expected a server to hold in its prefix cache, over the requests whose engine reported its cached tokens.",
            ),
            (
                "semlb_prefix_confirmed_tokens_total",
                "Of the predicted prompt tokens, those the engine reported it found cached (prediction accuracy = confirmed / predicted).",
            ),
            (
                "semlb_prefix_shortfalls_total",
                "Requests whose engine reported clearly fewer cached prompt tokens than predicted.",
            ),
            (
                "semlb_prefix_demotions_total",
                "Times a server's prefix entries older than an eviction its engine reported were set aside (its horizon raised).",
            ),
        ];
        for (k, (name, help)) in per_server.into_iter().enumerate() {
            family(o, name, "counter", help);
            for s in &self.servers {
                let n = self.counter(PREDICTION + usize::from(s.slot) * PREDICTION_WORDS + k);
                sample(o, name, &[("server", &s.address)], n);
            }
        }
        family(
            o,
            "semlb_prefix_servers_forgotten_total",
            "counter",
            "Times a server's prefix entries were all forgotten because its engine reported that it lost its cache (flushed or restarted).",
        );
        sample(o, "semlb_prefix_servers_forgotten_total", &[], self.counter(FORGOTTEN));
        for (k, (name, help)) in KV_EVENT_COUNTERS.into_iter().enumerate() {
            family(o, name, "counter", help);
            sample(o, name, &[], self.counter(KV_EVENTS + k));
        }
        family(
            o,
            "semlb_affinity_routes_total",
            "counter",
            "Routing decisions an affinity made: a session's turn kept on its engine, moved off it (full) or new; a stored response continued on its engine or not found.",
        );
        for (k, (kind, outcome)) in AFFINITY_OUTCOMES.into_iter().enumerate() {
            sample(
                o,
                "semlb_affinity_routes_total",
                &[("kind", kind), ("outcome", outcome)],
                self.counter(AFFINITY + k),
            );
        }
        family(
            o,
            "semlb_stream_resumptions_total",
            "counter",
            "Chat streams broken after their first byte (cut, error event, stall): resumed on another engine, failed (no engine took the continuation), not resumed (not resumable, or attempts used up), or whole (only the end was missing).",
        );
        for (r, reason) in RESUME_REASONS.into_iter().enumerate() {
            for (k, outcome) in RESUME_OUTCOMES.into_iter().enumerate() {
                sample(
                    o,
                    "semlb_stream_resumptions_total",
                    &[("reason", reason), ("outcome", outcome)],
                    self.counter(RESUMPTIONS + r * RESUME_OUTCOMES.len() + k),
                );
            }
        }
        for (k, (name, help)) in PEER_COUNTERS.into_iter().enumerate() {
            family(o, name, "counter", help);
            sample(o, name, &[], self.counter(PEERS + k));
        }
        family(
            o,
            "semlb_pd_requests_total",
            "counter",
            "Requests of pools with prefill engines, by how they were served: split (a prefill and a decode leg), bypass (the decode engine held the prompt), decode_only (several choices, no prefill engine up, or the prefill failed or handed nothing over).",
        );
        for (k, path) in PD_PATHS.into_iter().enumerate() {
            sample(o, "semlb_pd_requests_total", &[("path", path)], self.counter(PD + k));
        }
        family(
            o,
            "semlb_pd_handoff_failures_total",
            "counter",
            "Prefill legs that gave their decode leg nothing: prefill_failed (no answer, a 5xx, the prefill timeout), no_params (a vLLM prefill that stopped at its one token).",
        );
        for (k, reason) in PD_FAILURES.into_iter().enumerate() {
            let word = PD + PD_PATHS.len() + k;
            sample(
                o,
                "semlb_pd_handoff_failures_total",
                &[("reason", reason)],
                self.counter(word),
            );
        }
        self.histogram(
            o,
            "semlb_pd_prefill_seconds",
            "Prefill legs of split requests, from sending to their answer's end.",
            &[PD_PREFILL],
            &[],
        );
        self.histogram(
            o,
            "semlb_pd_decode_seconds",
            "Decode legs of split requests, from sending to their answer's end (a client that left is not counted).",
            &[PD_DECODE],
            &[],
        );
        self.histogram(
            o,
            "semlb_kv_event_lag_seconds",
            "From an engine's KV event batch (its timestamp) to its application to the confirmed prefix table.",
            &[KV_EVENT_LAG],
            &[],
        );
    }

    /// The response cache, retries, stale connections, completion records, the store, the response processes.
    fn render_cache_and_writes(&self, o: &mut String) {
        family(
            o,
            "semlb_response_cache_total",
            "counter",
            "Inference requests by what the response cache did.",
        );
        for (k, result) in ["hit", "miss", "bypass"].into_iter().enumerate() {
            sample(
                o,
                "semlb_response_cache_total",
                &[("result", result)],
                self.counter(CACHE + k),
            );
        }
        family(
            o,
            "semlb_retries_total",
            "counter",
            "Upstream attempts after the first of a request.",
        );
        sample(o, "semlb_retries_total", &[], self.counter(RETRIES));
        family(
            o,
            "semlb_upstream_stale_connections_total",
            "counter",
            "Requests resent on a new connection because the server had closed the pooled one they went out on.",
        );
        sample(
            o,
            "semlb_upstream_stale_connections_total",
            &[],
            self.counter(STALE_CONNECTIONS),
        );
        family(
            o,
            "semlb_completion_records_total",
            "counter",
            "Completion records pushed to a responder, or dropped.",
        );
        for (k, result) in ["pushed", "dropped"].into_iter().enumerate() {
            sample(
                o,
                "semlb_completion_records_total",
                &[("result", result)],
                self.counter(RECORDS + k),
            );
        }
        family(
            o,
            "semlb_store_degraded_lookups_total",
            "counter",
            "Routing lookups answered without the store (unreachable or slow).",
        );
        sample(o, "semlb_store_degraded_lookups_total", &[], self.counter(DEGRADED));
        let responder = [
            (
                "semlb_responder_records_total",
                "Completion records applied by responders.",
            ),
            (
                "semlb_responder_blocks_total",
                "Prefix blocks inserted or refreshed by responders.",
            ),
            (
                "semlb_responder_responses_stored_total",
                "Responses stored in the response cache.",
            ),
            (
                "semlb_responder_writeback_failures_total",
                "Write-backs that failed (store unreachable).",
            ),
            (
                "semlb_responder_writeback_dropped_total",
                "Records given up after an outage's backlog filled.",
            ),
            (
                "semlb_prefix_table_evictions_total",
                "Prefix entries evicted from full buckets to make room.",
            ),
        ];
        for (i, (name, help)) in responder.into_iter().enumerate() {
            family(o, name, "counter", help);
            sample(o, name, &[], self.counter(RESPONDER + i));
        }
    }

    /// Time to first token, request duration, dispatch stages, prefix match.
    fn render_latencies(&self, o: &mut String) {
        self.histogram(
            o,
            "semlb_ttft_seconds",
            "Time from a request's arrival to the first byte of the upstream answer relayed to the client.",
            &[TTFT],
            &[],
        );
        self.histogram(
            o,
            "semlb_request_duration_seconds",
            "Inference requests end to end, until the answer's last byte.",
            &[DURATION],
            &[],
        );
        let stages = [Stage::Tokenize, Stage::Lookup, Stage::Route, Stage::Total];
        self.histogram(
            o,
            "semlb_dispatch_seconds",
            "Time the dispatcher spends deciding, by stage.",
            &stages.map(Stage::histogram),
            &STAGES,
        );
        self.histogram(
            o,
            "semlb_prefix_match_ratio",
            "Share of the prompt's blocks the chosen server has cached.",
            &[PREFIX_RATIO],
            &[],
        );
    }

    /// The gateway queue.
    fn render_queue(&self, o: &mut String) {
        family(
            o,
            "semlb_queue_requests_total",
            "counter",
            "Requests that waited in the gateway queue, by how they left it (full: refused at entry).",
        );
        for (k, outcome) in QUEUE_OUTCOMES.into_iter().enumerate() {
            sample(
                o,
                "semlb_queue_requests_total",
                &[("outcome", outcome)],
                self.counter(QUEUE + 1 + k),
            );
        }
        family(
            o,
            "semlb_queue_depth",
            "gauge",
            "Requests waiting in the gateway queues now (all dispatchers).",
        );
        sample(o, "semlb_queue_depth", &[], self.queue_depth());
        self.histogram(
            o,
            "semlb_queue_wait_seconds",
            "Time requests waited in the gateway queue.",
            &[QUEUE_WAIT],
            &[],
        );
    }

    /// Token segments, learning at dispatch, continued conversations.
    fn render_dispatch_learning(&self, o: &mut String) {
        family(
            o,
            "semlb_tokenizer_segments_total",
            "counter",
            "Text segments of prompts, by where their token ids came from: the dispatcher's own cache, the store shared by every process, or tokenized.",
        );
        for (k, source) in SEGMENT_SOURCES.into_iter().enumerate() {
            sample(
                o,
                "semlb_tokenizer_segments_total",
                &[("source", source)],
                self.counter(SEGMENTS + k),
            );
        }

        family(
            o,
            "semlb_dispatch_learned_total",
            "counter",
            "Prompts recorded in the prefix table for their server when dispatched, and those taken back because the attempt failed or was refused.",
        );
        for (k, result) in ["recorded", "taken_back"].into_iter().enumerate() {
            sample(
                o,
                "semlb_dispatch_learned_total",
                &[("result", result)],
                self.counter(LEARN_RECORDED + k),
            );
        }
        family(
            o,
            "semlb_dispatch_learned_blocks_total",
            "counter",
            "Prefix blocks written when prompts were dispatched.",
        );
        sample(
            o,
            "semlb_dispatch_learned_blocks_total",
            &[],
            self.counter(LEARN_BLOCKS),
        );
        family(
            o,
            "semlb_continued_conversations_total",
            "counter",
            "Requests routed to the server credited with the earlier answer their prompt carries, before its blocks were written back.",
        );
        sample(o, "semlb_continued_conversations_total", &[], self.counter(CONTINUED));
    }

    /// Per-server gauges: in flight, up, state, engine load, admission limit, cost weights.
    fn render_servers(&self, o: &mut String) {
        family(
            o,
            "semlb_server_inflight_requests",
            "gauge",
            "Requests in flight to a server.",
        );
        for s in &self.servers {
            sample(
                o,
                "semlb_server_inflight_requests",
                &[("server", &s.address)],
                s.inflight,
            );
        }
        family(
            o,
            "semlb_server_up",
            "gauge",
            "1 if the server takes requests (state up).",
        );
        for s in &self.servers {
            let up = u64::from(s.state == ServerState::Up);
            sample(o, "semlb_server_up", &[("server", &s.address)], up);
        }
        family(
            o,
            "semlb_server_state",
            "gauge",
            "The server's state: 1 for the current one.",
        );
        for s in &self.servers {
            for state in [ServerState::Up, ServerState::Draining, ServerState::Down] {
                let v = u64::from(s.state == state);
                sample(
                    o,
                    "semlb_server_state",
                    &[("server", &s.address), ("state", state.name())],
                    v,
                );
            }
        }
        let load = [
            (
                "semlb_server_waiting_requests",
                "Requests waiting in the server's queue (scraped).",
            ),
            (
                "semlb_server_running_requests",
                "Requests the server is running (scraped).",
            ),
        ];
        for (k, (name, help)) in load.into_iter().enumerate() {
            family(o, name, "gauge", help);
            for s in &self.servers {
                if let Some(l) = s.load {
                    let v = if k == 0 { l.waiting } else { l.running };
                    sample(o, name, &[("server", &s.address)], u64::from(v));
                }
            }
        }
        family(
            o,
            "semlb_server_admission_limit",
            "gauge",
            "Requests the server's engine runs at once: as its engine reported it (llama.cpp's slots), else learned from the latencies the gateway measures; the holding policies (selective_push, dual_map) keep at most this many in flight there when its metrics are not fresh, or when its engine reported it.",
        );
        for s in &self.servers {
            sample_f(
                o,
                "semlb_server_admission_limit",
                &[("server", s.address.as_str())],
                s.admission_limit,
            );
        }
        if !self.cost_weights.is_empty() {
            family(
                o,
                "semlb_cost_weight",
                "gauge",
                "The cost policy's weight of work queued at a server against the prompt tokens it would have to prefill there, as each dispatcher tunes it from the TTFT its requests see.",
            );
            for (slot, w) in &self.cost_weights {
                sample_f(o, "semlb_cost_weight", &[("dispatcher", &slot.to_string())], *w);
            }
        }
        family(
            o,
            "semlb_server_kv_cache_usage_ratio",
            "gauge",
            "The server's KV-cache usage, 0 to 1 (scraped; absent when stale or when its engine does not report it).",
        );
        for s in &self.servers {
            if let Some(kv) = s.load.and_then(|l| l.kv_usage()) {
                let labels = [("server", s.address.as_str())];
                sample_f(o, "semlb_server_kv_cache_usage_ratio", &labels, kv);
            }
        }
    }

    /// The segment: table sizes, dropped records, process restarts.
    fn render_segment(&self, o: &mut String) {
        let gauges = [
            (
                "semlb_prefix_table_entries",
                "Occupied prefix-table slots.",
                self.prefix_entries,
            ),
            (
                "semlb_prefix_table_capacity",
                "Prefix-table slots.",
                self.prefix_capacity,
            ),
            (
                "semlb_response_cache_records",
                "Records written to the response cache's log.",
                self.response_records,
            ),
        ];
        for (name, help, v) in gauges {
            family(o, name, "gauge", help);
            sample(o, name, &[], v);
        }
        family(
            o,
            "semlb_completion_ring_dropped_total",
            "counter",
            "Completion records the rings dropped (full, or too large).",
        );
        sample(o, "semlb_completion_ring_dropped_total", &[], self.ring_dropped);
        family(
            o,
            "semlb_process_restarts_total",
            "counter",
            "Child processes restarted, by role.",
        );
        for (k, role) in ["dispatcher", "responder"].into_iter().enumerate() {
            sample(o, "semlb_process_restarts_total", &[("role", role)], self.restarts[k]);
        }
    }

    /// One histogram family; `stages` labels the series with `stage`.
    fn histogram(&self, o: &mut String, name: &str, help: &str, series: &[Histogram], stages: &[&str]) {
        family(o, name, "histogram", help);
        for (i, h) in series.iter().enumerate() {
            let stage = stages.get(i).map(|s| ("stage", *s));
            let mut cumulative = 0;
            let bucket = format!("{name}_bucket");
            for (b, bound) in h
                .bounds
                .iter()
                .map(|b| b.to_string())
                .chain(["+Inf".to_owned()])
                .enumerate()
            {
                cumulative += self.counter(h.base + b);
                let mut labels: Vec<(&str, &str)> = stage.into_iter().collect();
                labels.push(("le", &bound));
                sample(o, &bucket, &labels, cumulative);
            }
            let labels: Vec<(&str, &str)> = stage.into_iter().collect();
            sample_f(
                o,
                &format!("{name}_sum"),
                &labels,
                self.counter(h.sum_word()) as f64 / h.scale,
            );
            sample(o, &format!("{name}_count"), &labels, cumulative);
        }
    }
}

impl Snapshot {
    /// The usage families, per tenant (`semlb_tenant_*{tenant}`) and per
    /// model (`semlb_model_*{model}`).
    fn render_usage(&self, o: &mut String) {
        use shm_layout::{UsageCounter as C, UsageKind};
        for (kind, who) in [(UsageKind::Tenant, "tenant"), (UsageKind::Model, "model")] {
            let rows: Vec<&UsageRow> = self.usage.iter().filter(|r| r.kind == kind).collect();
            let counters = [
                ("requests_total", "Inference requests let in", C::Requests),
                (
                    "rate_limited_total",
                    "Requests refused by a rate limit (429)",
                    C::RateLimited,
                ),
                (
                    "cache_hits_total",
                    "Requests answered from the response cache",
                    C::CacheHits,
                ),
                ("queued_total", "Requests that waited in the gateway queue", C::Queued),
            ];
            for (suffix, help, counter) in counters {
                let name = format!("semlb_{who}_{suffix}");
                family(o, &name, "counter", &format!("{help}, per {who}."));
                for r in &rows {
                    sample(o, &name, &[(who, &r.name)], r.get(counter));
                }
            }
            let name = format!("semlb_{who}_tokens_total");
            family(
                o,
                &name,
                "counter",
                &format!("Prompt tokens (the gateway's count) and output tokens, per {who}."),
            );
            for r in &rows {
                sample(o, &name, &[(who, &r.name), ("type", "prompt")], r.get(C::PromptTokens));
                sample(o, &name, &[(who, &r.name), ("type", "output")], r.get(C::OutputTokens));
            }
            let name = format!("semlb_{who}_queue_seconds_total");
            family(
                o,
                &name,
                "counter",
                &format!("Seconds requests waited in the gateway queue, summed, per {who}."),
            );
            for r in &rows {
                sample_f(o, &name, &[(who, &r.name)], r.get(C::QueueMicros) as f64 / 1e6);
            }
        }
    }
}

fn family(o: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(o, "# HELP {name} {help}");
    let _ = writeln!(o, "# TYPE {name} {kind}");
}

fn labels(o: &mut String, labels: &[(&str, &str)]) {
    if labels.is_empty() {
        return;
    }
    o.push('{');
    for (i, (k, v)) in labels.iter().enumerate() {
        if i > 0 {
            o.push(',');
        }
        o.push_str(k);
        o.push_str("=\"");
        escape_label(o, v);
        o.push('"');
    }
    o.push('}');
}

/// A label value as the text format wants it: `\`, `"` and newlines escaped.
fn escape_label(o: &mut String, v: &str) {
    for c in v.chars() {
        match c {
            '\\' => o.push_str("\\\\"),
            '"' => o.push_str("\\\""),
            '\n' => o.push_str("\\n"),
            c => o.push(c),
        }
    }
}

fn sample(o: &mut String, name: &str, l: &[(&str, &str)], v: u64) {
    o.push_str(name);
    labels(o, l);
    let _ = writeln!(o, " {v}");
}

fn sample_f(o: &mut String, name: &str, l: &[(&str, &str)], v: f64) {
    o.push_str(name);
    labels(o, l);
    let _ = writeln!(o, " {v}");
}
