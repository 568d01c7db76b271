//! The engine sets the `chat` workload runs on: engines with and without
//! `/metrics`, clients that stream and clients that do not.
//!
//! They are the four situations a routing policy meets in a real fleet,
//! and the ones where a policy can fall into a trap of its own: without
//! engine metrics, a holding policy sees no engine queue; with clients that
//! do not stream, it sees no first token before an answer is complete
//! (`semlb::routing::capacity` learns each engine's admission limit for exactly
//! this). Each set is its own table, every policy against `least_load` on
//! the same engines.

use std::fmt;

use clap::ValueEnum;

/// One engine set of `--chat-sets`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ChatSet {
    /// Engines with `/metrics`, streaming clients.
    Stream,
    /// Engines with `/metrics`, clients that do not stream.
    Plain,
    /// Engines without `/metrics` (`semlb __sim --no-metrics`), streaming
    /// clients.
    NoMetricsStream,
    /// Engines without `/metrics`, clients that do not stream.
    NoMetricsPlain,
}

impl ChatSet {
    /// Every set, in report order.
    pub const ALL: [Self; 4] = [Self::Stream, Self::Plain, Self::NoMetricsStream, Self::NoMetricsPlain];

    /// Its name on the command line and in outputs.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Stream => "stream",
            Self::Plain => "plain",
            Self::NoMetricsStream => "no-metrics-stream",
            Self::NoMetricsPlain => "no-metrics-plain",
        }
    }

    /// Whether the engines serve `/metrics`.
    pub const fn metrics(self) -> bool {
        matches!(self, Self::Stream | Self::Plain)
    }

    /// Whether the clients stream.
    pub const fn stream(self) -> bool {
        matches!(self, Self::Stream | Self::NoMetricsStream)
    }

    /// What it is, in words.
    pub fn describe(self) -> String {
        format!(
            "engines {} /metrics, clients {}",
            if self.metrics() { "with" } else { "without" },
            if self.stream() { "streaming" } else { "not streaming" }
        )
    }
}

impl fmt::Display for ChatSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_four_sets_cover_metrics_and_streaming() {
        let mut seen: Vec<(bool, bool)> = ChatSet::ALL.iter().map(|s| (s.metrics(), s.stream())).collect();
        seen.sort();
        assert_eq!(seen, [(false, false), (false, true), (true, false), (true, true)]);
        for set in ChatSet::ALL {
            assert_eq!(ChatSet::from_str(set.name(), false), Ok(set));
        }
        assert_eq!(
            ChatSet::NoMetricsPlain.describe(),
            "engines without /metrics, clients not streaming"
        );
    }
}
