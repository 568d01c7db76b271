//! The flags of `semlb bench pd` ([`PdArgs`]), the fleets it compares
//! ([`Topology`]) and the token ranges its workloads draw from
//! ([`TokenRange`]).

use std::fmt;
use std::str::FromStr;

use clap::{Args, ValueEnum};
use semlb::config::PdProtocol;

use crate::Common;

/// `semlb bench pd` flags. Durations and objectives are in simulated
/// time (see [`PdArgs::time_scale`]).
#[derive(Debug, Clone, Args)]
pub struct PdArgs {
    /// Common flags.
    #[command(flatten)]
    pub common: Common,
    /// Parts to run, comma-separated: `interference` (long prompts and
    /// long answers over a load sweep, every topology) and `conversations`
    /// (multi-turn: cache-aware against random pairing, bypass against
    /// aggregated serving).
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_enum, default_values_t = [Part::Interference, Part::Conversations])]
    pub parts: Vec<Part>,
    /// Simulated engines of every topology (the same engine parameters in
    /// every role).
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub engines: usize,
    /// Topologies of the interference sweep, comma-separated: `agg` (every
    /// engine aggregated, policy `cache_aware`) or `<P>p<D>d` (P prefill
    /// and D decode engines, P + D = --engines).
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "agg,1p3d,2p2d,3p1d"
    )]
    pub topologies: Vec<Topology>,
    /// The P/D protocol the engines speak and the gateway drives:
    /// `vllm-nixl` (vLLM's NixlConnector) or `sglang` (bootstrap
    /// rendezvous).
    #[arg(long, value_name = "PROTOCOL", default_value = "vllm-nixl")]
    pub pd_protocol: PdProtocol,
    /// Real seconds one simulated second lasts in the interference part
    /// (the engines' `--time-scale`): every figure is in simulated time,
    /// the client's real durations divided by it.
    #[arg(long, value_name = "S", default_value_t = 0.2)]
    pub time_scale: f64,
    /// The same for the conversations part: real time by default, since
    /// later turns take tens of milliseconds, against which the
    /// gateway's and the client's real milliseconds would count S⁻¹
    /// times.
    #[arg(long, value_name = "S", default_value_t = 1.0)]
    pub conv_time_scale: f64,
    /// Offered loads of the interference sweep, requests per simulated
    /// second to the whole fleet, comma-separated.
    #[arg(long, value_name = "LIST", value_delimiter = ',', default_values_t = [1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0])]
    pub rates: Vec<f64>,
    /// A topology's sweep stops after a point where fewer than this share
    /// of the requests met the SLO (past saturation, goodput only falls);
    /// 0 runs every point.
    #[arg(long, value_name = "SHARE", default_value_t = 0.5)]
    pub stop_attainment: f64,
    /// Simulated seconds of Poisson arrivals per load point (rate ×
    /// window of them).
    #[arg(long, value_name = "SECS", default_value_t = 60.0)]
    pub window_secs: f64,
    /// Simulated seconds after a load point's last arrival that its
    /// requests may still take; any left then has missed the SLO and is
    /// cancelled (at least the TTFT objective plus the longest answer at
    /// the TPOT objective, or a request that met the SLO could be cut).
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    pub drain_secs: f64,
    /// Prompt tokens of an interference request, uniform in MIN-MAX (each
    /// prompt distinct from its first block: no prefix cache hides its
    /// prefill).
    #[arg(long, value_name = "MIN-MAX", default_value = "4096-8192")]
    pub prompt_tokens: TokenRange,
    /// Answer tokens of an interference request, uniform in MIN-MAX (the
    /// `x-semlb-output-tokens` header; `max_tokens` is MAX).
    #[arg(long, value_name = "MIN-MAX", default_value = "256-512")]
    pub output_tokens: TokenRange,
    /// The TTFT objective, simulated ms.
    #[arg(long, value_name = "MS", default_value_t = 2000.0)]
    pub slo_ttft_ms: f64,
    /// The time-per-output-token objective, simulated ms.
    #[arg(long, value_name = "MS", default_value_t = 50.0)]
    pub slo_tpot_ms: f64,
    /// The P/D topology of the conversations part (run with cache-aware
    /// and with random pairing, beside `agg`).
    #[arg(long, value_name = "TOPOLOGY", default_value = "2p2d")]
    pub conv_topology: Topology,
    /// New conversations per simulated second (Poisson).
    #[arg(long, value_name = "R", default_value_t = 1.0)]
    pub conv_rate: f64,
    /// Simulated seconds of conversation arrivals.
    #[arg(long, value_name = "SECS", default_value_t = 40.0)]
    pub conv_secs: f64,
    /// Turns of a conversation.
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub turns: usize,
    /// Tokens of the document a conversation opens with, uniform in
    /// MIN-MAX.
    #[arg(long, value_name = "MIN-MAX", default_value = "2048-4096")]
    pub doc_tokens: TokenRange,
    /// Answer tokens of a conversation's turn, uniform in MIN-MAX.
    #[arg(long, value_name = "MIN-MAX", default_value = "128-256")]
    pub turn_output_tokens: TokenRange,
    /// Tokens of each follow-up question.
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub question_tokens: usize,
    /// Mean simulated seconds a user thinks before the next turn
    /// (exponential).
    #[arg(long, value_name = "SECS", default_value_t = 5.0)]
    pub think_secs: f64,
    /// More flags for every simulated engine, space-separated (e.g.
    /// `--sim-args "--kv-transfer-gbps 5"`).
    #[arg(long, value_name = "FLAGS", default_value = "", allow_hyphen_values = true)]
    pub sim_args: String,
    /// Dispatcher processes of the gateway.
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub dispatchers: usize,
    /// Seed of the arrivals, lengths and texts (every topology gets the
    /// same requests).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub seed: u64,
}

/// A part of the report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Part {
    /// Long prompts, long answers, a load sweep on every topology.
    Interference,
    /// Multi-turn conversations: pairing and bypass.
    Conversations,
}

/// A fleet of simulated engines behind one gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Topology {
    /// Every engine aggregated (role `both`), policy `cache_aware`.
    Aggregated,
    /// `prefill` engines of role prefill, `decode` of role decode.
    Split {
        /// Prefill engines.
        prefill: usize,
        /// Decode engines.
        decode: usize,
    },
}

impl Topology {
    /// Its engines.
    pub fn engines(self, aggregated: usize) -> usize {
        match self {
            Self::Aggregated => aggregated,
            Self::Split { prefill, decode } => prefill + decode,
        }
    }

    /// Its name in tables: `4 aggregated`, `2P+2D`.
    pub fn label(self, engines: usize) -> String {
        match self {
            Self::Aggregated => format!("{engines} aggregated"),
            Self::Split { prefill, decode } => format!("{prefill}P+{decode}D"),
        }
    }
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Aggregated => f.write_str("agg"),
            Self::Split { prefill, decode } => write!(f, "{prefill}p{decode}d"),
        }
    }
}

/// A `--topologies` entry that names no [`Topology`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("topology {0:?}: expected agg or <P>p<D>d with P and D at least 1 (e.g. 2p2d)")]
pub struct BadTopology(pub String);

impl FromStr for Topology {
    type Err = BadTopology;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "agg" {
            return Ok(Self::Aggregated);
        }
        let bad = || BadTopology(s.to_owned());
        let (p, d) = s.strip_suffix('d').and_then(|r| r.split_once('p')).ok_or_else(bad)?;
        let prefill: usize = p.parse().map_err(|_| bad())?;
        let decode: usize = d.parse().map_err(|_| bad())?;
        if prefill == 0 || decode == 0 {
            return Err(bad());
        }
        Ok(Self::Split { prefill, decode })
    }
}

/// Token counts drawn uniformly in `min..=max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenRange {
    /// The least.
    pub min: usize,
    /// The most.
    pub max: usize,
}

impl fmt::Display for TokenRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.min == self.max {
            write!(f, "{}", self.min)
        } else {
            write!(f, "{}-{}", self.min, self.max)
        }
    }
}

/// A token range that is not `MIN-MAX` with 1 ≤ MIN ≤ MAX.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("token range {0:?}: expected MIN-MAX with 1 <= MIN <= MAX (e.g. 4096-8192), or one count")]
pub struct BadTokenRange(pub String);

impl FromStr for TokenRange {
    type Err = BadTokenRange;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadTokenRange(s.to_owned());
        let (lo, hi) = s.split_once('-').unwrap_or((s, s));
        let min: usize = lo.trim().parse().map_err(|_| bad())?;
        let max: usize = hi.trim().parse().map_err(|_| bad())?;
        if min == 0 || min > max {
            return Err(bad());
        }
        Ok(Self { min, max })
    }
}

/// Flags that cannot run together.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ArgsError {
    /// A topology whose engines are not `--engines`.
    #[error(
        "topology {topology} has {has} engines, not --engines {engines}: the topologies are compared at equal engine count"
    )]
    EngineCount {
        /// The topology.
        topology: Topology,
        /// Its engines.
        has: usize,
        /// `--engines`.
        engines: usize,
    },
    /// `--conv-topology agg`.
    #[error("--conv-topology {0}: the conversations part compares a P/D topology with agg; name one like 2p2d")]
    ConvTopologyAggregated(Topology),
    /// A time scale, rate or duration that is not positive.
    #[error("--{flag} {value}: must be a positive number")]
    NotPositive {
        /// The flag.
        flag: &'static str,
        /// Its value.
        value: f64,
    },
    /// A share outside 0..=1.
    #[error("--{flag} {value}: must be a share, from 0 to 1")]
    NotAShare {
        /// The flag.
        flag: &'static str,
        /// Its value.
        value: f64,
    },
    /// A drain shorter than a request that meets the SLO may take.
    #[error(
        "--drain-secs {drain}: at least {need} (the TTFT objective plus the longest answer at the TPOT objective), or requests meeting the SLO could be cut"
    )]
    DrainTooShort {
        /// `--drain-secs`.
        drain: f64,
        /// What the SLO allows.
        need: f64,
    },
}

impl PdArgs {
    /// Checks the flags together.
    pub fn validate(&self) -> Result<(), ArgsError> {
        for t in self.topologies.iter().chain([&self.conv_topology]) {
            let has = t.engines(self.engines);
            if has != self.engines {
                return Err(ArgsError::EngineCount {
                    topology: *t,
                    has,
                    engines: self.engines,
                });
            }
        }
        if self.conv_topology == Topology::Aggregated {
            return Err(ArgsError::ConvTopologyAggregated(self.conv_topology));
        }
        let positive = [
            ("time-scale", self.time_scale),
            ("conv-time-scale", self.conv_time_scale),
            ("window-secs", self.window_secs),
            ("conv-rate", self.conv_rate),
            ("conv-secs", self.conv_secs),
        ];
        let rates = self.rates.iter().map(|r| ("rates", *r));
        for (flag, value) in positive.into_iter().chain(rates) {
            if value.is_nan() || value <= 0.0 {
                return Err(ArgsError::NotPositive { flag, value });
            }
        }
        if !(0.0..=1.0).contains(&self.stop_attainment) {
            return Err(ArgsError::NotAShare {
                flag: "stop-attainment",
                value: self.stop_attainment,
            });
        }
        let need = (self.slo_ttft_ms + self.output_tokens.max as f64 * self.slo_tpot_ms) / 1e3;
        if self.drain_secs < need {
            return Err(ArgsError::DrainTooShort {
                drain: self.drain_secs,
                need,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topologies_parse_and_print() {
        assert_eq!("agg".parse(), Ok(Topology::Aggregated));
        let t: Topology = "1p3d".parse().unwrap();
        assert_eq!(t, Topology::Split { prefill: 1, decode: 3 });
        assert_eq!(
            (t.to_string(), t.label(4), t.engines(9)),
            ("1p3d".into(), "1P+3D".into(), 4)
        );
        assert_eq!(Topology::Aggregated.label(4), "4 aggregated");
        for bad in ["", "2p", "p2d", "0p4d", "2p0d", "2x2d", "aggregated"] {
            assert!(bad.parse::<Topology>().is_err(), "{bad}");
        }
    }

    #[test]
    fn token_ranges_parse() {
        assert_eq!("4096-8192".parse(), Ok(TokenRange { min: 4096, max: 8192 }));
        assert_eq!("64".parse(), Ok(TokenRange { min: 64, max: 64 }));
        assert_eq!(TokenRange { min: 64, max: 64 }.to_string(), "64");
        assert_eq!(TokenRange { min: 4, max: 8 }.to_string(), "4-8");
        for bad in ["0-4", "9-8", "a-b", "-"] {
            assert!(bad.parse::<TokenRange>().is_err(), "{bad}");
        }
    }
}
