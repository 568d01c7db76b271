//! Reading an inference engine's Prometheus `/metrics`: a small, tolerant
//! parser of the text exposition format, and the load figures each engine
//! flavor's gauges give.
//!
//! # The parser
//!
//! [`samples`] walks the text format 0.0.4 (and what OpenMetrics adds to
//! it) line by line: `# HELP`, `# TYPE` and other comments are skipped;
//! a sample is `name{label="value",...} value [timestamp]`, where label
//! values may hold `\\`, `\"` and `\n` escapes as well as `,` `}` and
//! spaces, values may be `+Inf`, `-Inf` or `NaN`, the timestamp is optional,
//! and anything after a `#` that follows them (an OpenMetrics exemplar) is
//! ignored. Histogram and summary lines (`_bucket{le="+Inf"}`, `_sum`,
//! `_count`, `{quantile="0.5"}`) are ordinary samples. A line that does not
//! parse is skipped, never a panic: one odd line of an engine's output
//! does not cost the rest of it. [`parse_line`] says what is wrong with one.
//!
//! # Load figures per engine
//!
//! | flavor | waiting | running | KV-cache usage (0..1) |
//! | --- | --- | --- | --- |
//! | vLLM | `vllm:num_requests_waiting` | `vllm:num_requests_running` | `vllm:kv_cache_usage_perc`, else the older `vllm:gpu_cache_usage_perc` |
//! | SGLang | `sglang:num_queue_reqs` | `sglang:num_running_reqs` | `sglang:token_usage` |
//! | llama.cpp | `llamacpp:requests_deferred` | `llamacpp:requests_processing` | `llamacpp:kv_cache_usage_ratio` |
//!
//! Each flavor's prompt-token counter (`vllm:prompt_tokens_total`,
//! `sglang:prompt_tokens_total`, `llamacpp:prompt_tokens_total`) is read
//! too ([`EngineLoad::prompt_tokens`]): a counter that goes back means the
//! engine restarted, with an empty prefix cache.
//!
//! Request counts are summed over label sets (several `model_name`s, or
//! data-parallel ranks, in one server's output); usage ratios, which are
//! fractions of each set's own cache, are averaged. [`extract`] reads one
//! flavor, or with [`MetricsFlavor::Auto`] the first of vLLM, SGLang and
//! llama.cpp whose request gauges appear. A flavor needs its waiting or its
//! running gauge; a missing KV-usage gauge is recorded as absent
//! ([`LoadFigures::KV_USAGE_ABSENT`]), not as 0 %: llama.cpp's server
//! has had none since it dropped `llamacpp:kv_cache_usage_ratio` (checked
//! on b11434).

use std::borrow::Cow;

use shm_layout::LoadFigures;

use crate::config::MetricsFlavor;

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    /// The metric name (for histograms, with its `_bucket`, `_sum` or
    /// `_count` suffix).
    pub name: Cow<'a, str>,
    /// Label names and (unescaped) values, in the order written.
    pub labels: Vec<(&'a str, Cow<'a, str>)>,
    /// The value (`+Inf`, `-Inf` and `NaN` included).
    pub value: f64,
    /// The timestamp, as written (milliseconds in the text format, seconds
    /// in OpenMetrics), if any.
    pub timestamp: Option<f64>,
}

impl Sample<'_> {
    /// The value of label `name`, if present.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| *k == name).map(|(_, v)| v.as_ref())
    }
}

/// Why a line is not a sample.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LineError {
    /// The metric name is missing or has a character names cannot have.
    #[error("bad metric name at byte {at}")]
    Name {
        /// Where, in bytes from the line's start.
        at: usize,
    },
    /// The label set is malformed.
    #[error("bad label set at byte {at}: {what}")]
    Labels {
        /// Where, in bytes from the line's start.
        at: usize,
        /// What was expected.
        what: &'static str,
    },
    /// The value is missing or not a number.
    #[error("bad sample value {0:?}")]
    Value(String),
    /// The timestamp is not a number.
    #[error("bad timestamp {0:?}")]
    Timestamp(String),
}

/// Parses one line: `Ok(None)` for a blank line or a comment, the sample,
/// or why it is neither.
pub fn parse_line(line: &str) -> Result<Option<Sample<'_>>, LineError> {
    let text = line.trim_matches([' ', '\t', '\r']);
    if text.is_empty() || text.starts_with('#') {
        return Ok(None);
    }
    let lead = line.len() - line.trim_start_matches([' ', '\t', '\r']).len();
    let mut p = Cursor {
        s: text,
        pos: 0,
        base: lead,
    };
    let mut name = None;
    if !p.at(b'{') {
        let n = p.take_while(is_name_byte);
        if n.is_empty() || n.as_bytes()[0].is_ascii_digit() {
            return Err(LineError::Name { at: p.abs() });
        }
        name = Some(Cow::Borrowed(n));
    }
    let mut labels = Vec::new();
    let after_name = p.pos;
    p.skip_blanks();
    if p.at(b'{') {
        p.pos += 1;
        parse_labels(&mut p, &mut name, &mut labels)?;
    } else {
        p.pos = after_name;
    }
    let name = name.ok_or(LineError::Name { at: lead })?;
    let rest = &p.s[p.pos..];
    if !rest.starts_with([' ', '\t']) {
        return Err(LineError::Value(rest.to_owned()));
    }
    let mut fields = rest.split([' ', '\t']).filter(|f| !f.is_empty());
    let value_text = fields.next().unwrap_or_default();
    let value = parse_float(value_text).ok_or_else(|| LineError::Value(value_text.to_owned()))?;
    let timestamp = match fields.next() {
        None => None,
        Some(f) if f.starts_with('#') => None,
        Some(f) => Some(parse_float(f).ok_or_else(|| LineError::Timestamp(f.to_owned()))?),
    };
    Ok(Some(Sample {
        name,
        labels,
        value,
        timestamp,
    }))
}

/// The samples of a whole exposition, skipping comments and lines that do
/// not parse.
pub fn samples(text: &str) -> impl Iterator<Item = Sample<'_>> {
    text.lines().filter_map(|line| parse_line(line).ok().flatten())
}

/// A position in one line.
struct Cursor<'a> {
    s: &'a str,
    pos: usize,
    /// Bytes trimmed off the line's start (for error offsets).
    base: usize,
}

impl<'a> Cursor<'a> {
    fn at(&self, b: u8) -> bool {
        self.s.as_bytes().get(self.pos) == Some(&b)
    }

    fn abs(&self) -> usize {
        self.base + self.pos
    }

    fn skip_blanks(&mut self) {
        while matches!(self.s.as_bytes().get(self.pos), Some(b' ' | b'\t')) {
            self.pos += 1;
        }
    }

    fn take_while(&mut self, f: impl Fn(u8) -> bool) -> &'a str {
        let start = self.pos;
        while self.s.as_bytes().get(self.pos).is_some_and(|b| f(*b)) {
            self.pos += 1;
        }
        &self.s[start..self.pos]
    }

    /// A quoted string at the cursor (which is on the opening `"`),
    /// unescaped; the cursor ends after the closing quote.
    fn quoted(&mut self) -> Result<Cow<'a, str>, LineError> {
        let bad = |at| LineError::Labels {
            at,
            what: "a closing '\"' after the value",
        };
        self.pos += 1;
        let start = self.pos;
        let bytes = self.s.as_bytes();
        let mut owned: Option<String> = None;
        let mut run = start;
        loop {
            match bytes.get(self.pos) {
                None => return Err(bad(self.abs())),
                Some(b'"') => {
                    let value = match owned {
                        Some(mut o) => {
                            o.push_str(&self.s[run..self.pos]);
                            Cow::Owned(o)
                        }
                        None => Cow::Borrowed(&self.s[start..self.pos]),
                    };
                    self.pos += 1;
                    return Ok(value);
                }
                Some(b'\\') => {
                    let o = owned.get_or_insert_with(String::new);
                    o.push_str(&self.s[run..self.pos]);
                    match bytes.get(self.pos + 1) {
                        Some(b'n') => o.push('\n'),
                        Some(b'\\') => o.push('\\'),
                        Some(b'"') => o.push('"'),
                        // An unknown escape stands for itself, as Prometheus reads it.
                        Some(_) => o.push('\\'),
                        None => return Err(bad(self.abs())),
                    }
                    self.pos += if matches!(bytes.get(self.pos + 1), Some(b'n' | b'\\' | b'"')) {
                        2
                    } else {
                        1
                    };
                    run = self.pos;
                }
                Some(_) => {
                    // Step a whole character, so slicing stays on boundaries.
                    let c = self.s[self.pos..].chars().next().map_or(1, char::len_utf8);
                    self.pos += c;
                }
            }
        }
    }
}

/// `[a-zA-Z0-9_:]`: the bytes of metric names (the first not a digit).
fn is_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b':'
}

/// The label set after `{` up to and including `}`. A bare quoted string
/// (Prometheus 3's quoted UTF-8 names) is the metric name.
fn parse_labels<'a>(
    p: &mut Cursor<'a>,
    name: &mut Option<Cow<'a, str>>,
    labels: &mut Vec<(&'a str, Cow<'a, str>)>,
) -> Result<(), LineError> {
    loop {
        p.skip_blanks();
        if p.at(b'}') {
            p.pos += 1;
            return Ok(());
        }
        if p.at(b'"') {
            let quoted = p.quoted()?;
            if name.is_some() {
                return Err(LineError::Labels {
                    at: p.abs(),
                    what: "one metric name",
                });
            }
            *name = Some(quoted);
        } else {
            let key = p.take_while(|b| b.is_ascii_alphanumeric() || b == b'_');
            if key.is_empty() {
                return Err(LineError::Labels {
                    at: p.abs(),
                    what: "a label name or '}'",
                });
            }
            p.skip_blanks();
            if !p.at(b'=') {
                return Err(LineError::Labels {
                    at: p.abs(),
                    what: "'=' after the label name",
                });
            }
            p.pos += 1;
            p.skip_blanks();
            if !p.at(b'"') {
                return Err(LineError::Labels {
                    at: p.abs(),
                    what: "a quoted label value",
                });
            }
            let value = p.quoted()?;
            labels.push((key, value));
        }
        p.skip_blanks();
        if p.at(b',') {
            p.pos += 1;
        } else if !p.at(b'}') {
            return Err(LineError::Labels {
                at: p.abs(),
                what: "',' or '}'",
            });
        }
    }
}

/// A sample value or timestamp: a decimal or exponent float, `+Inf`,
/// `-Inf`, `Inf` or `NaN` (any case).
fn parse_float(s: &str) -> Option<f64> {
    let unsigned = s.strip_prefix(['+', '-']).unwrap_or(s);
    if unsigned.eq_ignore_ascii_case("inf") || unsigned.eq_ignore_ascii_case("infinity") {
        return Some(if s.starts_with('-') {
            f64::NEG_INFINITY
        } else {
            f64::INFINITY
        });
    }
    if unsigned.eq_ignore_ascii_case("nan") {
        return Some(f64::NAN);
    }
    // Rust's parser also takes "inf"/"nan" forms handled above; refuse
    // anything but digits, '.', exponents and signs, so "0x10" is an error.
    if !s
        .bytes()
        .all(|b| b.is_ascii_digit() || matches!(b, b'.' | b'e' | b'E' | b'+' | b'-' | b'_'))
    {
        return None;
    }
    s.parse().ok()
}

/// An engine whose metric names are known (a concrete [`MetricsFlavor`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Engine {
    /// vLLM.
    Vllm,
    /// SGLang.
    Sglang,
    /// llama.cpp's `llama-server --metrics`.
    Llamacpp,
}

impl Engine {
    /// In auto-detection order.
    pub const ALL: [Self; 3] = [Self::Vllm, Self::Sglang, Self::Llamacpp];

    /// The configured flavor's engine; `None` for `auto`.
    pub fn of(flavor: MetricsFlavor) -> Option<Self> {
        match flavor {
            MetricsFlavor::Auto => None,
            MetricsFlavor::Vllm => Some(Self::Vllm),
            MetricsFlavor::Sglang => Some(Self::Sglang),
            MetricsFlavor::Llamacpp => Some(Self::Llamacpp),
        }
    }

    /// Its name in configuration (`metrics_flavor`).
    pub const fn name(self) -> &'static str {
        match self {
            Self::Vllm => "vllm",
            Self::Sglang => "sglang",
            Self::Llamacpp => "llamacpp",
        }
    }

    /// Its gauges: waiting, running, and the KV-usage ratios in order of
    /// preference.
    const fn names(self) -> (&'static str, &'static str, &'static [&'static str]) {
        match self {
            Self::Vllm => (
                "vllm:num_requests_waiting",
                "vllm:num_requests_running",
                &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
            ),
            Self::Sglang => (
                "sglang:num_queue_reqs",
                "sglang:num_running_reqs",
                &["sglang:token_usage"],
            ),
            Self::Llamacpp => (
                "llamacpp:requests_deferred",
                "llamacpp:requests_processing",
                &["llamacpp:kv_cache_usage_ratio"],
            ),
        }
    }
}

/// What [`extract`] read: which engine and its figures.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineLoad {
    /// Whose names were read.
    pub engine: Engine,
    /// Requests queued, summed over label sets.
    pub waiting: f64,
    /// Requests running, summed over label sets.
    pub running: f64,
    /// KV-cache usage, 0..1, averaged over label sets; `None` when the
    /// engine does not report it.
    pub kv_usage: Option<f64>,
    /// Prompt tokens processed since the engine started (a counter, summed
    /// over label sets); `None` when the engine does not report it.
    pub prompt_tokens: Option<f64>,
}

impl EngineLoad {
    /// As the server table stores them, scraped at `scraped_at_ms` (segment
    /// milliseconds; 0 means never, so it is taken as 1) while the gateway
    /// had `pending` requests without a first token at the server.
    pub fn figures(&self, scraped_at_ms: u64, pending: u64) -> LoadFigures {
        let count = |v: f64| {
            if v.is_nan() {
                0
            } else {
                v.round().clamp(0.0, f64::from(u32::MAX)) as u32
            }
        };
        let kv_usage_permyriad = match self.kv_usage.filter(|v| !v.is_nan()) {
            Some(kv) => (kv.clamp(0.0, 1.0) * 10_000.0).round() as u16,
            None => LoadFigures::KV_USAGE_ABSENT,
        };
        LoadFigures {
            waiting: count(self.waiting),
            running: count(self.running),
            kv_usage_permyriad,
            scraped_at_ms: scraped_at_ms.max(1),
            pending_at_scrape: u32::try_from(pending).unwrap_or(u32::MAX),
        }
    }
}

/// Why no load figures could be read from an exposition.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExtractError {
    /// The configured engine's request gauges are absent.
    #[error("no {} load gauges ({waiting} or {running}) in the metrics", engine.name())]
    Missing {
        /// The engine looked for.
        engine: Engine,
        /// Its waiting gauge.
        waiting: &'static str,
        /// Its running gauge.
        running: &'static str,
    },
    /// Auto-detection found no known engine's gauges.
    #[error("no known load gauges (vllm:, sglang: or llamacpp: request gauges) in the metrics")]
    Unknown,
}

/// Sum and count of one gauge's samples.
#[derive(Debug, Clone, Copy, Default)]
struct Acc {
    sum: f64,
    n: u32,
}

impl Acc {
    fn add(&mut self, v: f64) {
        if !v.is_nan() {
            self.sum += v.max(0.0);
            self.n += 1;
        }
    }

    fn sum(self) -> Option<f64> {
        (self.n > 0).then_some(self.sum)
    }

    fn mean(self) -> Option<f64> {
        (self.n > 0).then(|| self.sum / f64::from(self.n))
    }
}

/// Number of gauges read per engine: waiting, running, up to two KV ratios.
const GAUGES: usize = 5;

/// The load figures in `text` (a `/metrics` answer) for `flavor`; with
/// `auto`, the first engine (vLLM, SGLang, llama.cpp) whose waiting or
/// running gauge appears.
pub fn extract(text: &str, flavor: MetricsFlavor) -> Result<EngineLoad, ExtractError> {
    let mut acc = [[Acc::default(); GAUGES]; Engine::ALL.len()];
    for sample in samples(text) {
        let Some((e, g)) = gauge_index(&sample.name) else {
            continue;
        };
        acc[e][g].add(sample.value);
    }
    let read = |engine: Engine| {
        let a = &acc[Engine::ALL.iter().position(|e| *e == engine).unwrap_or(0)];
        let (waiting, running) = (a[0].sum(), a[1].sum());
        (waiting.is_some() || running.is_some()).then(|| EngineLoad {
            engine,
            waiting: waiting.unwrap_or(0.0),
            running: running.unwrap_or(0.0),
            kv_usage: a[2].mean().or(a[3].mean()),
            prompt_tokens: a[4].sum(),
        })
    };
    match Engine::of(flavor) {
        Some(engine) => read(engine).ok_or_else(|| {
            let (waiting, running, _) = engine.names();
            ExtractError::Missing {
                engine,
                waiting,
                running,
            }
        }),
        None => Engine::ALL.into_iter().find_map(read).ok_or(ExtractError::Unknown),
    }
}

/// Which engine and which of its [`GAUGES`] a metric name is.
fn gauge_index(name: &str) -> Option<(usize, usize)> {
    let prefix_end = name.find(':')?;
    let e = match &name[..prefix_end] {
        "vllm" => 0,
        "sglang" => 1,
        "llamacpp" => 2,
        _ => return None,
    };
    let (waiting, running, kv) = Engine::ALL[e].names();
    if name == waiting {
        Some((e, 0))
    } else if name == running {
        Some((e, 1))
    } else if name.strip_prefix(&name[..=prefix_end]) == Some("prompt_tokens_total") {
        Some((e, 4))
    } else {
        kv.iter().position(|k| *k == name).map(|i| (e, 2 + i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM V1 (0.10) output, abridged: `# HELP`/`# TYPE`, `model_name`
    /// and `engine` labels, counters, a histogram, an info gauge.
    const VLLM: &str = r#"# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12345.0
python_gc_objects_collected_total{generation="1"} 678.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.4217
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 120448.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.005",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 250.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 250.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 31.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",gpu_memory_utilization="0.9",num_gpu_blocks="27153"} 1.0
"#;

    /// vLLM V0 (0.6) output: the older `gpu_cache_usage_perc` name, two
    /// models (LoRA adapters are separate label sets in some setups).
    const VLLM_V0: &str = r#"# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="base"} 2.0
vllm:num_requests_running{model_name="base-lora"} 1.0
# HELP vllm:num_requests_swapped Number of requests swapped to CPU.
# TYPE vllm:num_requests_swapped gauge
vllm:num_requests_swapped{model_name="base"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="base"} 4.0
vllm:num_requests_waiting{model_name="base-lora"} 5.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="base"} 0.5
vllm:gpu_cache_usage_perc{model_name="base-lora"} 0.7
# HELP vllm:cpu_cache_usage_perc CPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:cpu_cache_usage_perc gauge
vllm:cpu_cache_usage_perc{model_name="base"} 0.0
"#;

    /// SGLang output (`--enable-metrics`), abridged.
    const SGLANG: &str = r#"# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 12.0
# HELP sglang:num_used_tokens The number of used tokens.
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 91234.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 0.83
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 1204.5
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 9.0
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 0.61
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_sum{model_name="Qwen/Qwen2.5-7B-Instruct"} 2.5
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="Qwen/Qwen2.5-7B-Instruct"} 10.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="Qwen/Qwen2.5-7B-Instruct"} 12.0
sglang:time_to_first_token_seconds_count{model_name="Qwen/Qwen2.5-7B-Instruct"} 12.0
"#;

    /// llama.cpp `llama-server --metrics` output (no labels).
    const LLAMACPP: &str = r#"# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 4096
# HELP llamacpp:prompt_seconds_total Prompt process time
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 1.873
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 1024
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s.
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 2186.86
# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.25
# HELP llamacpp:kv_cache_tokens KV-cache tokens.
# TYPE llamacpp:kv_cache_tokens gauge
llamacpp:kv_cache_tokens 2048
# HELP llamacpp:requests_processing Number of request processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 4
# HELP llamacpp:requests_deferred Number of request deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 2
"#;

    fn load(text: &str, flavor: MetricsFlavor) -> EngineLoad {
        extract(text, flavor).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn lines_parse() {
        let s = parse_line(r#"http_requests_total{method="post",code="200"} 1027 1395066363000"#)
            .unwrap()
            .unwrap();
        assert_eq!(s.name, "http_requests_total");
        assert_eq!(s.label("method"), Some("post"));
        assert_eq!(s.label("code"), Some("200"));
        assert_eq!((s.value, s.timestamp), (1027.0, Some(1_395_066_363_000.0)));

        // Escapes, and ',' '}' '=' and spaces inside a value.
        let s = parse_line(r#"msdos_file_access_time_seconds{path="C:\\DIR\\FILE.TXT",error="Cannot find file:\n\"FILE.TXT\"",x="a, b} = c"} 1.458255915e9"#)
            .unwrap()
            .unwrap();
        assert_eq!(s.label("path"), Some(r"C:\DIR\FILE.TXT"));
        assert_eq!(s.label("error"), Some("Cannot find file:\n\"FILE.TXT\""));
        assert_eq!(s.label("x"), Some("a, b} = c"));
        assert_eq!(s.value, 1.458255915e9);

        let value = |line: &str| parse_line(line).unwrap().unwrap().value;
        assert_eq!(value("metric_without_timestamp_and_labels 12.47"), 12.47);
        assert_eq!(
            value("something_weird{problem=\"division by zero\"} +Inf -3982045"),
            f64::INFINITY
        );
        assert_eq!(value("x -Inf"), f64::NEG_INFINITY);
        assert!(value("x NaN").is_nan());
        assert_eq!(value("x{} 1e+06"), 1e6);
        assert_eq!(value("x{a=\"1\",} 2"), 2.0, "trailing comma");
        assert_eq!(value("  \tx { a = \"1\" , b=\"2\" }\t3  "), 3.0, "blanks");
        assert_eq!(value("x 4\r"), 4.0, "CRLF line ends");
        // Histogram and summary lines are samples like any other.
        let s = parse_line(r#"rpc_duration_seconds_bucket{le="+Inf"} 144320"#)
            .unwrap()
            .unwrap();
        assert_eq!(
            (s.name.as_ref(), s.label("le")),
            ("rpc_duration_seconds_bucket", Some("+Inf"))
        );
        let s = parse_line(r#"rpc_duration_seconds{quantile="0.99"} 76656"#)
            .unwrap()
            .unwrap();
        assert_eq!(s.label("quantile"), Some("0.99"));
        // An OpenMetrics exemplar after the value is ignored.
        let s = parse_line(r#"foo_bucket{le="0.1"} 8 # {trace_id="KOO5S4vxi0o"} 0.67"#)
            .unwrap()
            .unwrap();
        assert_eq!((s.value, s.timestamp), (8.0, None));
        // Prometheus 3's quoted UTF-8 names.
        let s = parse_line(r#"{"my.metric", code="200"} 5"#).unwrap().unwrap();
        assert_eq!((s.name.as_ref(), s.label("code")), ("my.metric", Some("200")));
        // Comments and blank lines are nothing.
        for line in ["", "   ", "# HELP x y", "# TYPE x gauge", "#", "# EOF"] {
            assert_eq!(parse_line(line), Ok(None), "{line:?}");
        }
    }

    #[test]
    fn garbage_is_an_error_never_a_panic() {
        let bad = [
            "x",
            "x{",
            "x{a} 1",
            "x{a=} 1",
            "x{a=\"1\" 1",
            "x{a=\"1\"b=\"2\"} 1",
            "x{a=\"unterminated} 1",
            "x{a=\"\\",
            "x{=\"1\"} 1",
            "{} 1",
            "{\"a\", \"b\"} 1",
            "1x 2",
            "x one",
            "x 1 later",
            "x 0x10",
            "x{a=\"é\\\"} 1",
            "é 1",
            "x{é=\"1\"} 1",
            "x1",
            "x{}1",
        ];
        for line in bad {
            assert!(parse_line(line).is_err(), "{line:?}: {:?}", parse_line(line));
        }
        // Every prefix and every byte-mutation of real output parses or
        // fails cleanly.
        for text in [VLLM, SGLANG, LLAMACPP] {
            for end in (0..text.len()).filter(|i| text.is_char_boundary(*i)) {
                let _ = samples(&text[..end]).count();
            }
            let mut bytes = text.as_bytes().to_vec();
            for i in (0..bytes.len()).step_by(7) {
                bytes[i] = bytes[i].wrapping_mul(31).wrapping_add(7);
                let mangled = String::from_utf8_lossy(&bytes);
                let _ = extract(&mangled, MetricsFlavor::Auto);
            }
        }
    }

    #[test]
    fn whole_outputs_parse_line_by_line() {
        let n = samples(VLLM).count();
        assert_eq!(n, VLLM.lines().filter(|l| !l.starts_with('#')).count());
        let info = samples(VLLM).find(|s| s.name == "vllm:cache_config_info").unwrap();
        assert_eq!(info.label("num_gpu_blocks"), Some("27153"));
        // A bad line in the middle costs only itself.
        let text = format!("{VLLM}\nthis is {{ not a sample\n{LLAMACPP}");
        assert_eq!(samples(&text).count(), n + samples(LLAMACPP).count());
    }

    #[test]
    fn vllm_figures() {
        let l = load(VLLM, MetricsFlavor::Vllm);
        assert_eq!(l.engine, Engine::Vllm);
        assert_eq!((l.waiting, l.running, l.kv_usage), (3.0, 7.0, Some(0.4217)));
        let f = l.figures(1234, 0);
        assert_eq!(
            f,
            LoadFigures {
                waiting: 3,
                running: 7,
                kv_usage_permyriad: 4217,
                scraped_at_ms: 1234,
                pending_at_scrape: 0,
            }
        );
        // Older vLLM: gpu_cache_usage_perc; two models summed, usage averaged.
        let l = load(VLLM_V0, MetricsFlavor::Vllm);
        assert_eq!((l.waiting, l.running), (9.0, 3.0));
        assert!((l.kv_usage.unwrap() - 0.6).abs() < 1e-9);
        // Both names: the newer one wins.
        let both = format!("{VLLM_V0}{VLLM}");
        let l = load(&both, MetricsFlavor::Vllm);
        assert_eq!(l.kv_usage, Some(0.4217));
        assert_eq!((l.waiting, l.running), (12.0, 10.0));
    }

    #[test]
    fn sglang_figures() {
        let l = load(SGLANG, MetricsFlavor::Sglang);
        assert_eq!(l.engine, Engine::Sglang);
        assert_eq!((l.waiting, l.running, l.kv_usage), (9.0, 12.0, Some(0.83)));
        assert_eq!(l.figures(1, 0).kv_usage_permyriad, 8300);
        // Data-parallel ranks: requests add up.
        let dp = "sglang:num_running_reqs{dp_rank=\"0\"} 3\nsglang:num_running_reqs{dp_rank=\"1\"} 4\n\
                  sglang:num_queue_reqs{dp_rank=\"0\"} 1\nsglang:num_queue_reqs{dp_rank=\"1\"} 0\n\
                  sglang:token_usage{dp_rank=\"0\"} 0.2\nsglang:token_usage{dp_rank=\"1\"} 0.4\n";
        let l = load(dp, MetricsFlavor::Sglang);
        assert_eq!((l.waiting, l.running), (1.0, 7.0));
        assert!((l.kv_usage.unwrap() - 0.3).abs() < 1e-9);
    }

    #[test]
    fn llamacpp_figures() {
        let l = load(LLAMACPP, MetricsFlavor::Llamacpp);
        assert_eq!(l.engine, Engine::Llamacpp);
        assert_eq!((l.waiting, l.running, l.kv_usage), (2.0, 4.0, Some(0.25)));
        assert_eq!(l.prompt_tokens, Some(4096.0), "the counter a restart resets");
        assert_eq!(l.figures(5, 0).kv_usage(), Some(0.25));
    }

    /// What `llama-server --metrics` of llama.cpp b11434 (the build
    /// `workers/recipes/llama-cpp/get.sh` makes) really serves, captured
    /// after one request: no KV-usage gauge, which is absent in the server
    /// table, not 0 %.
    #[test]
    fn a_real_llamacpp_exposition_has_no_kv_usage_and_it_is_recorded_absent() {
        let text = include_str!("testdata/llamacpp-b11434.metrics");
        let l = load(text, MetricsFlavor::Auto);
        assert_eq!(l.engine, Engine::Llamacpp);
        assert_eq!((l.waiting, l.running, l.kv_usage), (0.0, 0.0, None));
        assert_eq!(l.prompt_tokens, Some(23.0));
        let f = l.figures(5, 0);
        assert_eq!(f.kv_usage_permyriad, LoadFigures::KV_USAGE_ABSENT);
        assert_eq!(f.kv_usage(), None);
    }

    #[test]
    fn auto_detects_the_engine() {
        assert_eq!(load(VLLM, MetricsFlavor::Auto).engine, Engine::Vllm);
        assert_eq!(load(VLLM_V0, MetricsFlavor::Auto).engine, Engine::Vllm);
        assert_eq!(load(SGLANG, MetricsFlavor::Auto).engine, Engine::Sglang);
        assert_eq!(load(LLAMACPP, MetricsFlavor::Auto).engine, Engine::Llamacpp);
        // vLLM first when a server exposes several (semlb-sim --metrics-flavor both).
        let both = format!("{SGLANG}{VLLM}");
        assert_eq!(load(&both, MetricsFlavor::Auto).engine, Engine::Vllm);
        // Only an info gauge or unrelated metrics: nothing known.
        let info = "vllm:cache_config_info{block_size=\"16\"} 1.0\nprocess_cpu_seconds_total 3.2\n";
        assert_eq!(extract(info, MetricsFlavor::Auto), Err(ExtractError::Unknown));
        assert_eq!(extract("", MetricsFlavor::Auto), Err(ExtractError::Unknown));
    }

    #[test]
    fn a_configured_flavor_reads_only_its_names() {
        let err = extract(VLLM, MetricsFlavor::Sglang).unwrap_err();
        assert_eq!(
            err.to_string(),
            "no sglang load gauges (sglang:num_queue_reqs or sglang:num_running_reqs) in the metrics"
        );
        assert!(extract(SGLANG, MetricsFlavor::Llamacpp).is_err());
        // Only one of the two request gauges is enough.
        let l = load("vllm:num_requests_running 2\n", MetricsFlavor::Vllm);
        assert_eq!((l.waiting, l.running, l.kv_usage), (0.0, 2.0, None));
    }

    #[test]
    fn the_simulators_output_reads_in_every_flavor() {
        use semlb_workers::config::EngineConfig;
        use semlb_workers::engine::EngineStats;
        use semlb_workers::metrics::{E2E_BUCKETS, Histogram, MetricsFlavor as SimFlavor, TTFT_BUCKETS, render};

        let stats = EngineStats {
            waiting: 3,
            running: 7,
            kv_usage: 0.25,
            num_blocks: 1024,
            prefix_cache_queries: 1000,
            prefix_cache_hits: 640,
            prompt_tokens: 1000,
            generation_tokens: 512,
            requests_finished: 5,
            requests_aborted: 0,
            ttft: Histogram::new(TTFT_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
        };
        let config = EngineConfig {
            model_name: "a \"quoted\" model".into(),
            ..EngineConfig::default()
        };
        for (sim, flavor, engine) in [
            (SimFlavor::Vllm, MetricsFlavor::Auto, Engine::Vllm),
            (SimFlavor::Vllm, MetricsFlavor::Vllm, Engine::Vllm),
            (SimFlavor::Sglang, MetricsFlavor::Auto, Engine::Sglang),
            (SimFlavor::Both, MetricsFlavor::Sglang, Engine::Sglang),
        ] {
            let text = render(&stats, &config, sim);
            assert!(samples(&text).all(|s| s.label("model_name") == Some("a \"quoted\" model")));
            let l = load(&text, flavor);
            assert_eq!(l.engine, engine, "{sim}");
            assert_eq!(
                l.figures(7, 0),
                LoadFigures {
                    waiting: 3,
                    running: 7,
                    kv_usage_permyriad: 2500,
                    scraped_at_ms: 7,
                    pending_at_scrape: 0,
                }
            );
        }
    }

    #[test]
    fn odd_values_are_clamped() {
        let text = "vllm:num_requests_waiting{a=\"1\"} NaN\nvllm:num_requests_waiting{a=\"2\"} -4\n\
                    vllm:num_requests_running +Inf\nvllm:kv_cache_usage_perc 1.7\n";
        let f = load(text, MetricsFlavor::Vllm).figures(0, 0);
        assert_eq!(f.waiting, 0);
        assert_eq!(f.running, u32::MAX);
        assert_eq!(f.kv_usage_permyriad, 10_000);
        assert_eq!(f.scraped_at_ms, 1, "0 would mean never scraped");
        let f = EngineLoad {
            engine: Engine::Vllm,
            waiting: 2.6,
            running: f64::NAN,
            kv_usage: Some(f64::NAN),
            prompt_tokens: None,
        }
        .figures(9, 0);
        // A NaN usage says no more than a missing one: absent.
        assert_eq!(
            (f.waiting, f.running, f.kv_usage_permyriad),
            (3, 0, LoadFigures::KV_USAGE_ABSENT)
        );
    }
}
