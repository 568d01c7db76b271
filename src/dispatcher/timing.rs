//! Where the dispatch time of one inference request goes: stamps from the
//! moment its headers arrived, recorded into the dispatch histograms and
//! shown to the client in `x-semlb-dispatch-ns`.

use super::Dispatcher;
use crate::metrics::Stage;

/// Where the dispatch time of one inference request goes: stamps taken
/// from the moment its headers arrived; shown to the client (and to
/// benchmarks) as `x-semlb-dispatch-ns: read=…,parse=…,tokenize=…,hash=…,cache=…,route=…,total=…`
/// (nanoseconds per stage; `cache` is the store lookup: response cache,
/// prefix match and load, one round trip on Redis; `route` is the policy's
/// choice; `total` ends when the request is handed to the upstream client).
#[derive(Debug, Clone, Copy)]
pub(super) struct DispatchTiming {
    pub(super) start: std::time::Instant,
    /// Cumulative nanoseconds at the end of each [`Mark`], in its order.
    marks: [u64; 5],
}

/// The stages [`DispatchTiming`] stamps the end of, in request order.
#[derive(Debug, Clone, Copy)]
pub(super) enum Mark {
    /// The body read.
    Read,
    /// The body parsed and the chat rendered.
    Parse,
    /// The routing text tokenized.
    Tokenize,
    /// The block chain hashed.
    Hash,
    /// The store lookup (response cache, prefix match, load).
    Cache,
}

impl DispatchTiming {
    pub(super) fn new() -> Self {
        Self {
            start: std::time::Instant::now(),
            marks: [0; 5],
        }
    }

    pub(super) fn mark(&mut self, stage: Mark) {
        self.marks[stage as usize] = self.start.elapsed().as_nanos() as u64;
    }

    /// Cumulative nanoseconds at the end of `stage`.
    fn at(&self, stage: Mark) -> u64 {
        self.marks[stage as usize]
    }

    /// Records the stages into the dispatch histograms; `sent`: the
    /// upstream hand-off (`None` for a cached answer: no route stage), and
    /// `end` the end of dispatch in ns.
    pub(super) fn observe(&self, dispatcher: &Dispatcher, routed: bool, end: u64) {
        let m = dispatcher.metrics();
        let secs = |ns: u64| ns as f64 / 1e9;
        let since = |a: Mark, b: Mark| secs(self.at(b).saturating_sub(self.at(a)));
        m.observe(Stage::Tokenize.histogram(), since(Mark::Parse, Mark::Tokenize));
        m.observe(Stage::Lookup.histogram(), since(Mark::Hash, Mark::Cache));
        if routed {
            m.observe(Stage::Route.histogram(), secs(end.saturating_sub(self.at(Mark::Cache))));
        }
        m.observe(Stage::Total.histogram(), secs(end));
    }

    /// The header value, with the upstream hand-off at `sent` ns.
    pub(super) fn header(&self, sent: u64) -> String {
        let since = |a: Mark, b: Mark| self.at(b) - self.at(a);
        format!(
            "read={},parse={},tokenize={},hash={},cache={},route={},total={sent}",
            self.at(Mark::Read),
            since(Mark::Read, Mark::Parse),
            since(Mark::Parse, Mark::Tokenize),
            since(Mark::Tokenize, Mark::Hash),
            since(Mark::Hash, Mark::Cache),
            sent.saturating_sub(self.at(Mark::Cache))
        )
    }
}
