//! The counters at the end of a replay run: the prefix-cache, token and
//! request counters of one simulated engine, and the gateway's comparison
//! of what it predicted the engines held with what they reported (and the
//! `cost` policy's tuned weight, per dispatcher), read from their
//! Prometheus `/metrics` text. [`drive`](super::drive) reads them
//! after a run; [`stats`](super::stats) turns them into hit rates,
//! imbalance and prediction accuracy.

/// The sum of the samples of metric `name` (exact name, any labels) in a
/// Prometheus text exposition; `None` when there is none.
pub(crate) fn metric_sum(text: &str, name: &str) -> Option<f64> {
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

/// Every sample of metric `name` (exact name) in a Prometheus text
/// exposition: its label text (between the braces, empty without labels)
/// and its value, in the text's order.
pub(crate) fn metric_samples(text: &str, name: &str) -> Vec<(String, f64)> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        let Some(rest) = line.strip_prefix(name) else { continue };
        let (labels, value) = if let Some(inner) = rest.strip_prefix('{') {
            match inner.rfind('}') {
                Some(i) => (&inner[..i], &inner[i + 1..]),
                None => continue,
            }
        } else if rest.starts_with(' ') {
            ("", rest)
        } else {
            continue; // a longer name with this prefix
        };
        if let Some(v) = value.split_whitespace().next().and_then(|v| v.parse::<f64>().ok()) {
            out.push((labels.to_owned(), v));
        }
    }
    out
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
/// servers, and the `cost` policy's weights.
#[derive(Debug, Clone, Default)]
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
    /// The `cost` policy's weight λ as each dispatcher left it
    /// (`semlb_cost_weight{dispatcher}`): the dispatcher's registry slot
    /// and the weight, by slot; empty for the other policies.
    pub(super) cost_weights: Vec<(String, f64)>,
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
            cost_weights: cost_weights(text),
        }
    }

    /// Confirmed / predicted tokens (`None` when nothing was predicted).
    pub(super) fn accuracy(&self) -> Option<f64> {
        (self.predicted > 0.0).then(|| self.confirmed / self.predicted)
    }
}

/// The `semlb_cost_weight` samples of a gateway's `/metrics` text: the
/// `dispatcher` label (the whole label text without one) and the weight,
/// by dispatcher.
fn cost_weights(text: &str) -> Vec<(String, f64)> {
    let mut out: Vec<(String, f64)> = metric_samples(text, "semlb_cost_weight")
        .into_iter()
        .map(|(labels, w)| {
            let slot = labels
                .split(',')
                .find_map(|l| l.trim().strip_prefix("dispatcher="))
                .map_or(labels.as_str(), |v| v.trim_matches('"'))
                .to_owned();
            (slot, w)
        })
        .collect();
    out.sort_by(|a, b| {
        let num = |s: &str| s.parse::<u64>().ok();
        num(&a.0).cmp(&num(&b.0)).then_with(|| a.0.cmp(&b.0))
    });
    out
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

    #[test]
    fn the_cost_weight_is_read_per_dispatcher() {
        let text = "# HELP semlb_cost_weight The cost policy's weight.\n\
                    # TYPE semlb_cost_weight gauge\n\
                    semlb_cost_weight{dispatcher=\"10\"} 0.25\n\
                    semlb_cost_weight{dispatcher=\"3\"} 0.0625\n\
                    semlb_cost_weight_other{dispatcher=\"1\"} 9\n\
                    semlb_prefix_predicted_tokens_total 100\n";
        let g = GatewayCounters::parse(text);
        assert_eq!(g.cost_weights, [("3".to_owned(), 0.0625), ("10".to_owned(), 0.25)]);
        assert_eq!(g.predicted, 100.0);
        assert!(
            GatewayCounters::parse("semlb_prefix_predicted_tokens_total 1\n")
                .cost_weights
                .is_empty()
        );
        assert_eq!(
            metric_samples("x{a=\"b\"} 1\nx 2 17\nxy 3\n", "x"),
            [("a=\"b\"".to_owned(), 1.0), (String::new(), 2.0)]
        );
    }
}
