//! The counters at the end of a replay run: the prefix-cache, token and
//! request counters of one simulated engine, and the gateway's comparison
//! of what it predicted the engines held with what they reported, read from
//! their Prometheus `/metrics` text. [`drive`](super::drive) reads them
//! after a run; [`stats`](super::stats) turns them into hit rates,
//! imbalance and prediction accuracy.

/// The sum of the samples of metric `name` (exact name, any labels) in a
/// Prometheus text exposition; `None` when there is none.
pub(super) fn metric_sum(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') || !line.starts_with(name) {
            continue;
        }
        let rest = &line[name.len()..];
        let value = if rest.starts_with('{') {
            rest.rfind('}').map(|i| &rest[i + 1..])
        } else if rest.starts_with(' ') {
            Some(rest)
        } else {
            None // a longer name with this prefix
        };
        // "value [timestamp]"
        if let Some(v) = value
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<f64>().ok())
        {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// One engine's counters at the end of a run.
#[derive(Debug, Clone, Default)]
pub(super) struct EngineCounters {
    pub(super) hits: f64,
    pub(super) queries: f64,
    pub(super) prompt_tokens: f64,
    pub(super) generation_tokens: f64,
    pub(super) requests: f64,
}

impl EngineCounters {
    /// The counters of one engine's `/metrics` text.
    pub(super) fn parse(text: &str) -> Self {
        let m = |n| metric_sum(text, n).unwrap_or(0.0);
        Self {
            hits: m("vllm:prefix_cache_hits_total"),
            queries: m("vllm:prefix_cache_queries_total"),
            prompt_tokens: m("vllm:prompt_tokens_total"),
            generation_tokens: m("vllm:generation_tokens_total"),
            requests: m("vllm:request_success_total"),
        }
    }

    /// Prompt tokens the engine had to prefill.
    pub(super) fn uncached(&self) -> f64 {
        (self.prompt_tokens - self.hits).max(0.0)
    }
}

/// The gateway's prediction counters at the end of a run, summed over
/// servers.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct GatewayCounters {
    /// Answers whose engine's report the response processes read.
    pub(super) records: f64,
    /// Prompt tokens the routing predicted the chosen engine held.
    pub(super) predicted: f64,
    /// Of those, found cached by the engine.
    pub(super) confirmed: f64,
    /// Requests with a clear shortfall.
    pub(super) shortfalls: f64,
    /// Times a server's older entries were set aside.
    pub(super) demotions: f64,
    /// Times a server was forgotten everywhere (a lost cache).
    pub(super) forgotten: f64,
}

impl GatewayCounters {
    /// The counters of the gateway's `/metrics` text.
    pub(super) fn parse(text: &str) -> Self {
        let m = |n| metric_sum(text, n).unwrap_or(0.0);
        Self {
            records: m("semlb_responder_records_total"),
            predicted: m("semlb_prefix_predicted_tokens_total"),
            confirmed: m("semlb_prefix_confirmed_tokens_total"),
            shortfalls: m("semlb_prefix_shortfalls_total"),
            demotions: m("semlb_prefix_demotions_total"),
            forgotten: m("semlb_prefix_servers_forgotten_total"),
        }
    }

    /// Confirmed / predicted tokens (`None` when nothing was predicted).
    pub(super) fn accuracy(&self) -> Option<f64> {
        (self.predicted > 0.0).then(|| self.confirmed / self.predicted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_text_sums_one_name_over_labels() {
        let text = "# HELP vllm:prefix_cache_hits Prefix cache hits.\n\
                    # TYPE vllm:prefix_cache_hits counter\n\
                    vllm:prefix_cache_hits_total{model_name=\"semlb-sim\"} 640.0\n\
                    vllm:prefix_cache_hits_total{model_name=\"other\",x=\"a}b\"} 10\n\
                    vllm:prefix_cache_queries_total{model_name=\"semlb-sim\"} 1000.0\n\
                    vllm:request_success_total 5 1700000000\n";
        assert_eq!(metric_sum(text, "vllm:prefix_cache_hits_total"), Some(650.0));
        assert_eq!(metric_sum(text, "vllm:prefix_cache_queries_total"), Some(1000.0));
        assert_eq!(metric_sum(text, "vllm:request_success_total"), Some(5.0));
        assert_eq!(metric_sum(text, "vllm:prefix_cache"), None);
        assert_eq!(metric_sum(text, "vllm:missing_total"), None);
        let c = EngineCounters::parse(text);
        assert_eq!((c.hits, c.queries, c.uncached()), (650.0, 1000.0, 0.0));
    }
}
