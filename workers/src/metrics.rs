//! The Prometheus text exposition of the engine's stats,
//! with vLLM's metric names and types (and SGLang's behind a flag).
//!
//! [`render`] writes the text exposition format 0.0.4 (`# HELP` and
//! `# TYPE` lines, then samples), every series labelled
//! `model_name="<served name>"` as vLLM labels them. With
//! [`MetricsFlavor::Vllm`] (the default):
//!
//! | metric | type | value |
//! | --- | --- | --- |
//! | `vllm:num_requests_waiting` | gauge | requests in the FIFO queue |
//! | `vllm:num_requests_running` | gauge | requests in the running batch |
//! | `vllm:kv_cache_usage_perc` | gauge | fraction of KV blocks in use, 0..1 |
//! | `vllm:prefix_cache_queries_total` | counter | prompt tokens looked up in the prefix cache |
//! | `vllm:prefix_cache_hits_total` | counter | of those, tokens found |
//! | `vllm:prompt_tokens_total` | counter | prompt tokens processed |
//! | `vllm:generation_tokens_total` | counter | tokens generated |
//! | `vllm:request_success_total` | counter | requests finished |
//! | `vllm:time_to_first_token_seconds` | histogram | simulated TTFT ([`TTFT_BUCKETS`]) |
//! | `vllm:e2e_request_latency_seconds` | histogram | simulated end-to-end latency ([`E2E_BUCKETS`]) |
//! | `vllm:cache_config_info` | gauge | always 1; labels `block_size`, `num_gpu_blocks`, `cache_dtype`, `enable_prefix_caching` |
//!
//! Counters' `# TYPE` lines name the family without `_total`, as the format
//! (and `prometheus_client`) has it. [`MetricsFlavor::Sglang`] writes
//! SGLang's gauges instead, `sglang:num_queue_reqs`,
//! `sglang:num_running_reqs` and `sglang:token_usage` (same values as the
//! three vLLM gauges); [`MetricsFlavor::Both`] writes both sets.
//! [`MetricsFlavor::Llamacpp`] writes llama.cpp's unlabelled series instead
//! (`llamacpp:prompt_tokens_total` without cached tokens,
//! `llamacpp:prompt_tokens_cached_total`, `llamacpp:tokens_predicted_total`,
//! `llamacpp:requests_processing`, `llamacpp:requests_deferred`; no KV-cache
//! gauge), so the gateway sees the simulator as it sees a `llama-server`.

use crate::config::EngineConfig;
use crate::engine::EngineStats;

pub use crate::histogram::{E2E_BUCKETS, Histogram, TTFT_BUCKETS};

/// Which engine's metric names `/metrics` uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MetricsFlavor {
    /// vLLM's (`vllm:*`).
    #[default]
    Vllm,
    /// SGLang's gauges (`sglang:*`).
    Sglang,
    /// Both sets.
    Both,
    /// llama.cpp's `llama-server --metrics` (`llamacpp:*`, unlabelled, no
    /// KV-cache gauge), as its build b11434 serves them.
    Llamacpp,
    /// None: `/metrics` answers 404, as an engine started without metrics
    /// does (llama.cpp without `--metrics`, SGLang without
    /// `--enable-metrics`, most OpenAI-compatible servers).
    None,
}

/// A metrics flavor name [`MetricsFlavor`] does not know (the name given).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown metrics flavor `{0}` (expected vllm, sglang, both, llamacpp or none)")]
pub struct UnknownMetricsFlavor(pub String);

impl std::str::FromStr for MetricsFlavor {
    type Err = UnknownMetricsFlavor;

    fn from_str(s: &str) -> Result<Self, UnknownMetricsFlavor> {
        match s {
            "vllm" => Ok(Self::Vllm),
            "sglang" => Ok(Self::Sglang),
            "both" => Ok(Self::Both),
            "llamacpp" => Ok(Self::Llamacpp),
            "none" => Ok(Self::None),
            other => Err(UnknownMetricsFlavor(other.to_owned())),
        }
    }
}

impl std::fmt::Display for MetricsFlavor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Vllm => "vllm",
            Self::Sglang => "sglang",
            Self::Both => "both",
            Self::Llamacpp => "llamacpp",
            Self::None => "none",
        })
    }
}

/// `Content-Type` of the text exposition format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A label value escaped for the text format (`\\`, `\"`, `\n`).
fn escape_label(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// A sample value: like Python's `repr` of a float (`1.0`, `0.25`, `+Inf`, `NaN`).
fn fmt_value(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v == f64::INFINITY {
        "+Inf".into()
    } else if v == f64::NEG_INFINITY {
        "-Inf".into()
    } else {
        format!("{v:?}")
    }
}

/// Writes the text exposition of one process's metrics.
struct Writer {
    out: String,
    labels: String,
}

impl Writer {
    fn header(&mut self, family: &str, kind: &str, help: &str) {
        use std::fmt::Write;
        let _ = writeln!(self.out, "# HELP {family} {help}");
        let _ = writeln!(self.out, "# TYPE {family} {kind}");
    }

    fn sample(&mut self, name: &str, extra_labels: &str, value: f64) {
        use std::fmt::Write;
        let value = fmt_value(value);
        if self.labels.is_empty() && extra_labels.is_empty() {
            let _ = writeln!(self.out, "{name} {value}");
        } else {
            let _ = writeln!(self.out, "{name}{{{}{extra_labels}}} {value}", self.labels);
        }
    }

    fn gauge(&mut self, name: &str, help: &str, value: f64) {
        self.header(name, "gauge", help);
        self.sample(name, "", value);
    }

    /// A counter: family `name`, sample `name_total`.
    fn counter(&mut self, name: &str, help: &str, value: u64) {
        self.header(name, "counter", help);
        self.sample(&format!("{name}_total"), "", value as f64);
    }

    fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
        self.header(name, "histogram", help);
        let bucket = format!("{name}_bucket");
        let cumulative = h.cumulative();
        for (bound, count) in h.bounds().iter().zip(&cumulative) {
            self.sample(&bucket, &format!(",le=\"{}\"", fmt_value(*bound)), *count as f64);
        }
        self.sample(&bucket, ",le=\"+Inf\"", h.count() as f64);
        self.sample(&format!("{name}_sum"), "", h.sum());
        self.sample(&format!("{name}_count"), "", h.count() as f64);
    }
}

/// The Prometheus text exposition (format 0.0.4) of `stats` for a server
/// with `config`, in `flavor`'s names (see the module docs).
pub fn render(stats: &EngineStats, config: &EngineConfig, flavor: MetricsFlavor) -> String {
    let mut w = Writer {
        out: String::with_capacity(8192),
        labels: format!("model_name=\"{}\"", escape_label(&config.model_name)),
    };
    if matches!(flavor, MetricsFlavor::Vllm | MetricsFlavor::Both) {
        w.gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            stats.waiting as f64,
        );
        w.gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            stats.running as f64,
        );
        w.gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            stats.kv_usage,
        );
        w.counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.prefix_cache_queries,
        );
        w.counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            stats.prefix_cache_hits,
        );
        w.counter(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            stats.prompt_tokens,
        );
        w.counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            stats.generation_tokens,
        );
        w.counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            stats.requests_finished,
        );
        w.histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &stats.ttft,
        );
        w.histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            &stats.e2e,
        );
        w.header(
            "vllm:cache_config_info",
            "gauge",
            "Information of the LLMEngine CacheConfig",
        );
        let info = format!(
            ",block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",num_gpu_blocks=\"{}\"",
            config.block_size,
            config.num_blocks()
        );
        w.sample("vllm:cache_config_info", &info, 1.0);
    }
    if matches!(flavor, MetricsFlavor::Sglang | MetricsFlavor::Both) {
        w.gauge(
            "sglang:num_queue_reqs",
            "The number of requests in the waiting queue.",
            stats.waiting as f64,
        );
        w.gauge(
            "sglang:num_running_reqs",
            "The number of running requests.",
            stats.running as f64,
        );
        w.gauge("sglang:token_usage", "The token usage.", stats.kv_usage);
    }
    if flavor == MetricsFlavor::Llamacpp {
        llamacpp(&mut w, stats);
    }
    w.out
}

/// llama.cpp's series (b11434's names, help texts and types; unlabelled):
/// its prompt-token counter excludes cached tokens, and it has no KV-cache
/// gauge. Its counters' `# TYPE` lines name the family with `_total`, as
/// `llama-server` writes them.
fn llamacpp(w: &mut Writer, stats: &EngineStats) {
    w.labels.clear();
    let counter = |w: &mut Writer, name: &str, help: &str, value: u64| {
        let name = format!("{name}_total");
        w.header(&name, "counter", help);
        w.sample(&name, "", value as f64);
    };
    counter(
        w,
        "llamacpp:prompt_tokens",
        "Number of prompt tokens processed, excluding cached tokens",
        stats.prompt_tokens.saturating_sub(stats.prefix_cache_hits),
    );
    counter(
        w,
        "llamacpp:prompt_tokens_cached",
        "Number of prompt tokens reused from the cache",
        stats.prefix_cache_hits,
    );
    counter(
        w,
        "llamacpp:tokens_predicted",
        "Number of generation tokens processed",
        stats.generation_tokens,
    );
    w.gauge(
        "llamacpp:requests_processing",
        "Number of requests processing",
        stats.running as f64,
    );
    w.gauge(
        "llamacpp:requests_deferred",
        "Number of requests deferred",
        stats.waiting as f64,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::collections::{BTreeMap, HashMap};

    /// One sample line.
    #[derive(Debug)]
    struct Sample {
        name: String,
        labels: BTreeMap<String, String>,
        value: f64,
    }

    fn is_metric_name(s: &str) -> bool {
        let mut chars = s.chars();
        chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    }

    fn is_label_name(s: &str) -> bool {
        let mut chars = s.chars();
        chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
    }

    fn parse_value(s: &str) -> Result<f64, String> {
        match s {
            "+Inf" => Ok(f64::INFINITY),
            "-Inf" => Ok(f64::NEG_INFINITY),
            "NaN" => Ok(f64::NAN),
            _ => s.parse::<f64>().map_err(|e| format!("bad value {s:?}: {e}")),
        }
    }

    /// `{a="x",b="y"}` (after the name) → labels and the rest of the line.
    fn parse_labels(s: &str) -> Result<(BTreeMap<String, String>, &str), String> {
        let mut labels = BTreeMap::new();
        let Some(mut rest) = s.strip_prefix('{') else {
            return Ok((labels, s));
        };
        loop {
            if let Some(after) = rest.strip_prefix('}') {
                return Ok((labels, after));
            }
            let eq = rest.find('=').ok_or("label without =")?;
            let name = &rest[..eq];
            if !is_label_name(name) {
                return Err(format!("bad label name {name:?}"));
            }
            rest = rest[eq + 1..].strip_prefix('"').ok_or("label value not quoted")?;
            let mut value = String::new();
            let mut chars = rest.char_indices();
            let end = loop {
                match chars.next() {
                    None => return Err("unterminated label value".into()),
                    Some((i, '"')) => break i,
                    Some((_, '\\')) => match chars.next() {
                        Some((_, '\\')) => value.push('\\'),
                        Some((_, '"')) => value.push('"'),
                        Some((_, 'n')) => value.push('\n'),
                        other => return Err(format!("bad escape {other:?}")),
                    },
                    Some((_, '\n')) => return Err("raw newline in label value".into()),
                    Some((_, c)) => value.push(c),
                }
            };
            if labels.insert(name.to_owned(), value).is_some() {
                return Err(format!("duplicate label {name}"));
            }
            rest = &rest[end + 1..];
            rest = rest.strip_prefix(',').unwrap_or(rest);
        }
    }

    /// Validates every line of a text exposition (format 0.0.4) strictly:
    /// HELP/TYPE syntax and order, names, labels, values, sample names per
    /// type, contiguous families, cumulative buckets ending in `+Inf` =
    /// `_count`. Returns the samples and the family types.
    fn parse_exposition(text: &str) -> (Vec<Sample>, HashMap<String, String>) {
        assert!(text.ends_with('\n'), "the exposition must end with a newline");
        let mut types: HashMap<String, String> = HashMap::new();
        let mut helps: HashMap<String, String> = HashMap::new();
        let mut samples = Vec::new();
        let mut families_done: Vec<String> = Vec::new();
        let mut current: Option<String> = None;
        for (n, line) in text.lines().enumerate() {
            let ctx = |e: String| format!("line {}: {e}: {line:?}", n + 1);
            if let Some(rest) = line.strip_prefix("# ") {
                let mut parts = rest.splitn(3, ' ');
                let keyword = parts.next().unwrap_or_default();
                let family = parts.next().unwrap_or_default().to_owned();
                let arg = parts.next().unwrap_or_default();
                match keyword {
                    "HELP" | "TYPE" => {
                        assert!(is_metric_name(&family), "{}", ctx("bad family name".into()));
                        assert!(!families_done.contains(&family), "{}", ctx("family reopened".into()));
                        if current.as_ref() != Some(&family) {
                            if let Some(done) = current.take() {
                                families_done.push(done);
                            }
                            current = Some(family.clone());
                        }
                        if keyword == "HELP" {
                            assert!(!types.contains_key(&family), "{}", ctx("HELP after TYPE".into()));
                            assert!(
                                helps.insert(family, arg.to_owned()).is_none(),
                                "{}",
                                ctx("second HELP".into())
                            );
                        } else {
                            assert!(
                                ["counter", "gauge", "histogram", "summary", "untyped"].contains(&arg),
                                "{}",
                                ctx("bad type".into())
                            );
                            assert!(
                                types.insert(family, arg.to_owned()).is_none(),
                                "{}",
                                ctx("second TYPE".into())
                            );
                        }
                    }
                    _ => {}
                }
                continue;
            }
            assert!(!line.starts_with('#'), "{}", ctx("comment without space".into()));
            assert!(!line.trim().is_empty(), "{}", ctx("empty line".into()));
            let name_end = line.find(['{', ' ']).unwrap_or(line.len());
            let name = &line[..name_end];
            assert!(is_metric_name(name), "{}", ctx("bad metric name".into()));
            let (labels, rest) = parse_labels(&line[name_end..]).unwrap_or_else(|e| panic!("{}", ctx(e)));
            let rest = rest
                .strip_prefix(' ')
                .unwrap_or_else(|| panic!("{}", ctx("no space before value".into())));
            let mut fields = rest.split(' ');
            let value = parse_value(fields.next().unwrap_or_default()).unwrap_or_else(|e| panic!("{}", ctx(e)));
            if let Some(ts) = fields.next() {
                ts.parse::<i64>()
                    .unwrap_or_else(|e| panic!("{}", ctx(format!("bad timestamp: {e}"))));
            }
            assert!(fields.next().is_none(), "{}", ctx("trailing fields".into()));
            // The sample belongs to the current family, as its type requires.
            let family = current
                .clone()
                .unwrap_or_else(|| panic!("{}", ctx("sample before any TYPE".into())));
            let kind = types
                .get(&family)
                .unwrap_or_else(|| panic!("{}", ctx("family without TYPE".into())));
            let suffix = name
                .strip_prefix(family.as_str())
                .unwrap_or_else(|| panic!("{}", ctx("not in the current family".into())));
            let allowed: &[&str] = match kind.as_str() {
                "counter" => &["_total", "_created"],
                "histogram" => &["_bucket", "_sum", "_count", "_created"],
                _ => &[""],
            };
            assert!(
                allowed.contains(&suffix),
                "{}",
                ctx(format!("suffix {suffix:?} not allowed for a {kind}"))
            );
            assert_eq!(
                suffix == "_bucket",
                labels.contains_key("le"),
                "{}",
                ctx("le only on buckets".into())
            );
            assert!(
                value.is_nan() || kind != "counter" || value >= 0.0,
                "{}",
                ctx("negative counter".into())
            );
            samples.push(Sample {
                name: name.to_owned(),
                labels,
                value,
            });
        }
        // Histograms: cumulative buckets, +Inf last and equal to _count.
        for (family, kind) in &types {
            if kind != "histogram" {
                continue;
            }
            let buckets: Vec<&Sample> = samples
                .iter()
                .filter(|s| s.name == format!("{family}_bucket"))
                .collect();
            let les: Vec<f64> = buckets.iter().map(|s| parse_value(&s.labels["le"]).unwrap()).collect();
            assert!(les.windows(2).all(|w| w[0] < w[1]), "{family}: le not ascending");
            assert_eq!(les.last(), Some(&f64::INFINITY), "{family}: no +Inf bucket");
            assert!(
                buckets.windows(2).all(|w| w[0].value <= w[1].value),
                "{family}: buckets not cumulative"
            );
            let count = samples
                .iter()
                .find(|s| s.name == format!("{family}_count"))
                .expect("_count");
            assert_eq!(buckets.last().unwrap().value, count.value, "{family}: +Inf != _count");
            assert!(
                samples.iter().any(|s| s.name == format!("{family}_sum")),
                "{family}: no _sum"
            );
        }
        (samples, types)
    }

    fn value(samples: &[Sample], name: &str) -> f64 {
        samples
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no {name}"))
            .value
    }

    fn stats() -> EngineStats {
        let mut ttft = Histogram::new(TTFT_BUCKETS);
        let mut e2e = Histogram::new(E2E_BUCKETS);
        for v in [0.0005, 0.03, 0.03, 3.0, 9999.0] {
            ttft.observe(v);
            e2e.observe(v * 10.0);
        }
        EngineStats {
            waiting: 3,
            running: 7,
            kv_usage: 0.25,
            num_blocks: 25_000,
            prefix_cache_queries: 1000,
            prefix_cache_hits: 640,
            prompt_tokens: 1000,
            generation_tokens: 512,
            requests_finished: 5,
            requests_aborted: 1,
            ttft,
            e2e,
        }
    }

    #[test]
    fn vllm_exposition_is_valid_and_complete() {
        let config = EngineConfig {
            model_name: "Qwen/Qwen3-8B".into(),
            ..EngineConfig::default()
        };
        let text = render(&stats(), &config, MetricsFlavor::Vllm);
        let (samples, types) = parse_exposition(&text);
        for s in &samples {
            assert_eq!(
                s.labels.get("model_name").map(String::as_str),
                Some("Qwen/Qwen3-8B"),
                "{}",
                s.name
            );
        }
        assert_eq!(value(&samples, "vllm:num_requests_waiting"), 3.0);
        assert_eq!(value(&samples, "vllm:num_requests_running"), 7.0);
        assert_eq!(value(&samples, "vllm:kv_cache_usage_perc"), 0.25);
        assert_eq!(value(&samples, "vllm:prefix_cache_queries_total"), 1000.0);
        assert_eq!(value(&samples, "vllm:prefix_cache_hits_total"), 640.0);
        assert_eq!(value(&samples, "vllm:prompt_tokens_total"), 1000.0);
        assert_eq!(value(&samples, "vllm:generation_tokens_total"), 512.0);
        assert_eq!(value(&samples, "vllm:request_success_total"), 5.0);
        assert_eq!(value(&samples, "vllm:time_to_first_token_seconds_count"), 5.0);
        assert!((value(&samples, "vllm:time_to_first_token_seconds_sum") - 10002.0605).abs() < 1e-6);
        assert_eq!(value(&samples, "vllm:e2e_request_latency_seconds_count"), 5.0);
        for (family, kind) in [
            ("vllm:num_requests_waiting", "gauge"),
            ("vllm:kv_cache_usage_perc", "gauge"),
            ("vllm:prefix_cache_queries", "counter"),
            ("vllm:prefix_cache_hits", "counter"),
            ("vllm:request_success", "counter"),
            ("vllm:time_to_first_token_seconds", "histogram"),
            ("vllm:e2e_request_latency_seconds", "histogram"),
            ("vllm:cache_config_info", "gauge"),
        ] {
            assert_eq!(types.get(family).map(String::as_str), Some(kind), "{family}");
        }
        // Buckets: one per bound plus +Inf, cumulative as observed.
        let ttft: Vec<&Sample> = samples
            .iter()
            .filter(|s| s.name == "vllm:time_to_first_token_seconds_bucket")
            .collect();
        assert_eq!(ttft.len(), TTFT_BUCKETS.len() + 1);
        assert_eq!(ttft[0].labels["le"], "0.001");
        assert_eq!(ttft[0].value, 1.0);
        let at = |le: &str| ttft.iter().find(|s| s.labels["le"] == le).unwrap().value;
        assert_eq!(at("0.02"), 1.0);
        assert_eq!(at("0.04"), 3.0);
        assert_eq!(at("5.0"), 4.0);
        assert_eq!(at("2560.0"), 4.0);
        assert_eq!(at("+Inf"), 5.0);
        let info = samples.iter().find(|s| s.name == "vllm:cache_config_info").unwrap();
        assert_eq!(info.value, 1.0);
        assert_eq!(info.labels["block_size"], "16");
        assert_eq!(info.labels["num_gpu_blocks"], "25000");
        assert!(!text.contains("sglang:"));
    }

    #[test]
    fn flavors_and_escaping() {
        let config = EngineConfig {
            model_name: "we\"ird\\name\nx".into(),
            ..EngineConfig::default()
        };
        let text = render(&stats(), &config, MetricsFlavor::Sglang);
        let (samples, types) = parse_exposition(&text);
        assert!(!text.contains("vllm:"));
        assert_eq!(samples.len(), 3);
        assert!(types.values().all(|t| t == "gauge"));
        assert_eq!(value(&samples, "sglang:num_queue_reqs"), 3.0);
        assert_eq!(value(&samples, "sglang:num_running_reqs"), 7.0);
        assert_eq!(value(&samples, "sglang:token_usage"), 0.25);
        assert!(samples.iter().all(|s| s.labels["model_name"] == "we\"ird\\name\nx"));

        let both = render(&stats(), &config, MetricsFlavor::Both);
        let (samples, _) = parse_exposition(&both);
        assert!(samples.iter().any(|s| s.name == "sglang:token_usage"));
        assert!(samples.iter().any(|s| s.name == "vllm:kv_cache_usage_perc"));

        // An empty engine renders valid zeros.
        let empty = EngineStats {
            waiting: 0,
            running: 0,
            kv_usage: 0.0,
            num_blocks: 2,
            prefix_cache_queries: 0,
            prefix_cache_hits: 0,
            prompt_tokens: 0,
            generation_tokens: 0,
            requests_finished: 0,
            requests_aborted: 0,
            ttft: Histogram::new(TTFT_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
        };
        let (samples, _) = parse_exposition(&render(&empty, &EngineConfig::default(), MetricsFlavor::Both));
        assert_eq!(value(&samples, "vllm:e2e_request_latency_seconds_sum"), 0.0);

        assert_eq!("both".parse::<MetricsFlavor>(), Ok(MetricsFlavor::Both));
        assert_eq!("none".parse::<MetricsFlavor>(), Ok(MetricsFlavor::None));
        assert_eq!("sglang".parse::<MetricsFlavor>(), Ok(MetricsFlavor::Sglang));
        assert_eq!(
            "vllm".parse::<MetricsFlavor>().map(|f| f.to_string()),
            Ok("vllm".into())
        );
        assert!("tgi".parse::<MetricsFlavor>().is_err());
        assert_eq!(
            "tgi".parse::<MetricsFlavor>().unwrap_err().to_string(),
            "unknown metrics flavor `tgi` (expected vllm, sglang, both, llamacpp or none)"
        );
    }

    #[test]
    fn the_llamacpp_flavor_is_what_llama_server_serves() {
        let text = render(&stats(), &EngineConfig::default(), MetricsFlavor::Llamacpp);
        assert!(!text.contains("vllm:") && !text.contains("kv_cache") && !text.contains('{'));
        // Line for line, what a real llama-server (b11434) writes: the
        // capture the gateway's scraper is tested on (its counters' TYPE
        // lines name the family with `_total`, which the strict validator
        // above would refuse, so it is compared as text).
        let real = include_str!("../../src/health/testdata/llamacpp-b11434.metrics");
        let name_of = |line: &str| {
            line.split(' ')
                .nth(if line.starts_with('#') { 2 } else { 0 })
                .unwrap_or_default()
                .to_owned()
        };
        for line in text.lines() {
            if line.starts_with('#') {
                assert!(real.lines().any(|r| r == line), "not llama.cpp's: {line:?}");
            } else {
                assert!(
                    real.lines().any(|r| !r.starts_with('#') && name_of(r) == name_of(line)),
                    "not llama.cpp's: {line:?}"
                );
            }
        }
        let value = |name: &str| -> f64 {
            let line = text
                .lines()
                .find(|l| name_of(l) == name && !l.starts_with('#'))
                .unwrap();
            line.rsplit(' ').next().unwrap().parse().unwrap()
        };
        assert_eq!(value("llamacpp:prompt_tokens_total"), 360.0, "cached excluded");
        assert_eq!(value("llamacpp:prompt_tokens_cached_total"), 640.0);
        assert_eq!(value("llamacpp:requests_processing"), 7.0);
        assert_eq!(value("llamacpp:requests_deferred"), 3.0);
        assert_eq!("llamacpp".parse::<MetricsFlavor>(), Ok(MetricsFlavor::Llamacpp));
    }

    #[test]
    fn the_validator_rejects_bad_expositions() {
        let bad = [
            "x 1",                                                            // no final newline
            "# TYPE x counter\nx 1\n",                                        // counter sample without _total
            "# TYPE x gauge\nx{a=\"1\" 1\n",                                  // unterminated labels
            "# TYPE x gauge\nx{a=1} 1\n",                                     // unquoted
            "# TYPE x gauge\nx one\n",                                        // bad value
            "# TYPE x histogram\nx_bucket{le=\"1\"} 2\nx_count 2\nx_sum 1\n", // no +Inf
            "# TYPE x gauge\n# TYPE y gauge\nx 1\n",                          // not in the current family
            "y 1\n",                                                          // no TYPE
        ];
        for text in bad {
            assert!(
                std::panic::catch_unwind(|| parse_exposition(text)).is_err(),
                "accepted {text:?}"
            );
        }
    }

    #[test]
    fn observations_land_in_the_right_bucket() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        h.observe(0.05);
        h.observe(0.1);
        h.observe(0.5);
        h.observe(7.0);
        assert_eq!(h.cumulative(), vec![2, 3, 4]);
        assert_eq!(h.count(), 4);
        assert!((h.sum() - 7.65).abs() < 1e-9);
    }
}
