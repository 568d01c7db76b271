//! The engine's latency histograms, with vLLM's bucket bounds: what the
//! engine records ([`crate::engine`]) and `/metrics` renders
//! ([`crate::metrics`]).

/// vLLM's bucket bounds for `vllm:time_to_first_token_seconds`.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
];

/// vLLM's bucket bounds for `vllm:e2e_request_latency_seconds`.
pub const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
];

/// A Prometheus histogram: per-bucket counts (not cumulative), sum, count.
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// An empty histogram with upper bounds `bounds` (ascending; `+Inf` implied).
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    /// Records one observation.
    pub fn observe(&mut self, v: f64) {
        let i = self.bounds.iter().position(|b| v <= *b).unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += v;
        self.count += 1;
    }

    /// Upper bounds, without `+Inf`.
    pub fn bounds(&self) -> &'static [f64] {
        self.bounds
    }

    /// Cumulative counts for each bound, then `+Inf` (what `_bucket` lines show).
    pub fn cumulative(&self) -> Vec<u64> {
        self.counts
            .iter()
            .scan(0u64, |acc, c| {
                *acc += c;
                Some(*acc)
            })
            .collect()
    }

    /// Sum of all observations.
    pub fn sum(&self) -> f64 {
        self.sum
    }

    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.count
    }
}
