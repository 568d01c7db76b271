//! Fault injection: what a misbehaving inference server does, on purpose,
//! so the gateway's retries, timeouts and health handling can be tested.
//!
//! | flag | effect |
//! | --- | --- |
//! | `--fail-rate F` | a fraction `F` of inference requests is answered `500` with an OpenAI error body, before reaching the engine |
//! | `--reset-rate F` | a fraction `F` of inference responses is cut: streaming ones after the first SSE chunk, non-streaming ones right after the headers; the body ends with an error, so the connection is aborted without the terminating chunk |
//! | `--delay-ms N` | every response (any path) waits `N` real milliseconds first (not scaled by `time_scale`) |
//! | `--hang-after N` | after `N` inference requests, every further request on any path is read and never answered (until the server stops) |
//! | `--exit-after N` | once `N` inference requests have completed, the server stops gracefully (stops accepting, finishes in-flight requests) and `semlb-sim` exits with status 0 |
//! | `--stream-fault KIND` | a streamed answer breaks once `--stream-fault-after N` (default 50) output tokens are out: `die` (the process kills itself with `SIGKILL`, as an engine lost to an out-of-memory kill or a driver reset), `stall` (no further byte, the connection held open, as a hung GPU), `error` (the API's error event, then the stream's end, as vLLM streams a failure: `data: {"error": {...}}` and `data: [DONE]` on chat and completions); only the first `--stream-fault-count K` streamed answers when given |
//!
//! Only inference requests (`POST /v1/completions`,
//! `/v1/chat/completions`, `/v1/responses`, `/v1/messages`) are counted
//! and subject to `--fail-rate` and
//! `--reset-rate`; `/health`, `/metrics` and `/v1/models` are not, so
//! probing a server does not change its fault pattern.
//!
//! Decisions are deterministic: request number `i` (from 1, in arrival
//! order) fails if `u(seed, i, "fail") < F`, where `u` is a splitmix64 hash
//! mapped to `[0, 1)`; resets draw from an independent stream. The same
//! `--seed` and the same request order give the same faults.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::watch;

/// The fault flags.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FaultConfig {
    /// Fraction of inference requests answered 500 (0..=1).
    pub fail_rate: f64,
    /// Fraction of inference responses cut mid-way (0..=1).
    pub reset_rate: f64,
    /// Real delay before every response.
    pub delay: Duration,
    /// Inference requests answered before the server hangs.
    pub hang_after: Option<u64>,
    /// Inference requests completed before the server stops.
    pub exit_after: Option<u64>,
    /// Seed of the fault decisions.
    pub seed: u64,
    /// How streamed answers break mid-way, if they do.
    pub stream_fault: Option<StreamFault>,
}

/// How a streamed answer breaks mid-way (`--stream-fault`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamFault {
    /// What happens.
    pub kind: StreamFaultKind,
    /// Output tokens sent first.
    pub after: u32,
    /// Streamed answers that break (the first ones); `None`: every one.
    pub count: Option<u64>,
}

/// What a [`StreamFault`] does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamFaultKind {
    /// The process kills itself with `SIGKILL`.
    Die,
    /// Nothing more is sent; the connection stays open.
    Stall,
    /// The API's error event ends the stream.
    Error,
}

/// The flags of a [`StreamFault`] (`semlb-sim` and `semlb __sim` take
/// them).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct StreamFaultArgs {
    /// Break streamed answers mid-way: die (SIGKILL itself), stall (send
    /// nothing more, keep the connection) or error (the API's error event,
    /// then the stream's end).
    #[arg(long, value_name = "KIND")]
    pub stream_fault: Option<StreamFaultKind>,
    /// Output tokens a --stream-fault answer sends before it breaks.
    #[arg(long, default_value_t = 50, value_name = "N")]
    pub stream_fault_after: u32,
    /// Only the first K streamed answers break (default: every one).
    #[arg(long, value_name = "K")]
    pub stream_fault_count: Option<u64>,
}

impl StreamFaultArgs {
    /// The fault the flags ask for, if any.
    pub fn fault(&self) -> Option<StreamFault> {
        self.stream_fault.map(|kind| StreamFault {
            kind,
            after: self.stream_fault_after,
            count: self.stream_fault_count,
        })
    }
}

/// A `--stream-fault` value that is none of `die`, `stall`, `error`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("unknown stream fault `{0}` (expected die, stall or error)")]
pub struct UnknownStreamFault(pub String);

impl std::str::FromStr for StreamFaultKind {
    type Err = UnknownStreamFault;

    fn from_str(s: &str) -> Result<Self, UnknownStreamFault> {
        match s {
            "die" => Ok(Self::Die),
            "stall" => Ok(Self::Stall),
            "error" => Ok(Self::Error),
            other => Err(UnknownStreamFault(other.to_owned())),
        }
    }
}

impl FaultConfig {
    /// Checks the values; the error names the flag, the value and the reason.
    pub fn validate(&self) -> Result<(), FaultConfigError> {
        for (flag, rate) in [("fail_rate", self.fail_rate), ("reset_rate", self.reset_rate)] {
            if !(0.0..=1.0).contains(&rate) {
                return Err(FaultConfigError::RateOutOfRange { flag, rate });
            }
        }
        if self.exit_after == Some(0) {
            return Err(FaultConfigError::ZeroExitAfter);
        }
        Ok(())
    }
}

/// Why a [`FaultConfig`] is refused ([`FaultConfig::validate`]): each
/// message names the flag, the value and the reason.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FaultConfigError {
    /// `fail_rate` or `reset_rate` is not a fraction.
    #[error("{flag} = {rate}: must be between 0 and 1")]
    RateOutOfRange {
        /// `fail_rate` or `reset_rate`.
        flag: &'static str,
        /// Its value.
        rate: f64,
    },
    /// `exit_after` is 0.
    #[error("exit_after = 0: must be at least 1")]
    ZeroExitAfter,
}

/// What to do with one inference request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// The request's number, from 1.
    pub index: u64,
    /// Never answer it.
    pub hang: bool,
    /// Answer 500 without reaching the engine.
    pub fail: bool,
    /// Cut the response.
    pub reset: bool,
}

/// Salt of the fail decisions.
const FAIL_SALT: u64 = 0x6661_696c;
/// Salt of the reset decisions.
const RESET_SALT: u64 = 0x0072_6573_6574;

/// The splitmix64 finaliser.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform draw in `[0, 1)`, a deterministic function of its inputs.
pub fn draw(seed: u64, index: u64, salt: u64) -> f64 {
    let h = mix(mix(seed ^ salt).wrapping_add(index));
    (h >> 11) as f64 / (1u64 << 53) as f64
}

/// Whether a draw selects the request for a fault of `rate`.
fn hit(rate: f64, seed: u64, index: u64, salt: u64) -> bool {
    rate > 0.0 && draw(seed, index, salt) < rate
}

/// The fault state of one server: counters, the hang flag, the exit signal.
#[derive(Debug)]
pub struct Faults {
    config: FaultConfig,
    admitted: AtomicU64,
    completed: AtomicU64,
    hanging: AtomicBool,
    exit: watch::Sender<bool>,
    /// Streamed answers begun (for `StreamFault::count`).
    streams: AtomicU64,
}

impl Faults {
    /// Fault state for `config`, with no request seen yet.
    pub fn new(config: FaultConfig) -> Self {
        Self {
            config,
            admitted: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            hanging: AtomicBool::new(false),
            exit: watch::Sender::new(false),
            streams: AtomicU64::new(0),
        }
    }

    /// The flags.
    pub fn config(&self) -> &FaultConfig {
        &self.config
    }

    /// Counts one inference request and decides its fate.
    pub fn admit(&self) -> Decision {
        let index = self.admitted.fetch_add(1, Ordering::Relaxed) + 1;
        let hang = self.config.hang_after.is_some_and(|n| index > n);
        if hang {
            self.hanging.store(true, Ordering::Relaxed);
        }
        let seed = self.config.seed;
        Decision {
            index,
            hang,
            fail: hit(self.config.fail_rate, seed, index, FAIL_SALT),
            reset: hit(self.config.reset_rate, seed, index, RESET_SALT),
        }
    }

    /// Counts one streamed answer beginning: how it is to break, if it is.
    pub fn stream_begins(&self) -> Option<StreamFault> {
        let fault = self.config.stream_fault?;
        let index = self.streams.fetch_add(1, Ordering::Relaxed) + 1;
        fault.count.is_none_or(|k| index <= k).then_some(fault)
    }

    /// Whether the server hangs (`--hang-after` was passed): every request
    /// on any path is then left unanswered.
    pub fn is_hanging(&self) -> bool {
        self.hanging.load(Ordering::Relaxed)
    }

    /// Inference requests admitted so far.
    pub fn admitted(&self) -> u64 {
        self.admitted.load(Ordering::Relaxed)
    }

    /// Counts one completed inference request; the `--exit-after`-th fires
    /// the exit signal.
    pub fn complete(&self) {
        let done = self.completed.fetch_add(1, Ordering::Relaxed) + 1;
        if self.config.exit_after.is_some_and(|n| done >= n) {
            self.exit.send_replace(true);
        }
    }

    /// Inference requests completed so far.
    pub fn completed(&self) -> u64 {
        self.completed.load(Ordering::Relaxed)
    }

    /// Whether `--exit-after` has fired.
    pub fn exit_requested(&self) -> bool {
        *self.exit.borrow()
    }

    /// Resolves once `--exit-after` has fired (never without it).
    pub async fn exit_signal(&self) {
        let mut rx = self.exit.subscribe();
        // The sender lives in `self`, so the channel cannot close while we wait.
        let _ = rx.wait_for(|fired| *fired).await;
    }

    /// The real delay before every response.
    pub fn delay(&self) -> Duration {
        self.config.delay
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_are_uniform_and_deterministic() {
        let n = 20_000;
        let mean: f64 = (1..=n).map(|i| draw(7, i, FAIL_SALT)).sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.02, "{mean}");
        assert!((1..=n).all(|i| (0.0..1.0).contains(&draw(7, i, FAIL_SALT))));
        assert_eq!(draw(1, 2, 3), draw(1, 2, 3));
        assert_ne!(draw(1, 2, FAIL_SALT), draw(1, 2, RESET_SALT));
        assert_ne!(draw(1, 2, FAIL_SALT), draw(2, 2, FAIL_SALT));
    }

    #[test]
    fn rates_select_the_right_fraction() {
        let faults = Faults::new(FaultConfig {
            fail_rate: 0.25,
            reset_rate: 0.5,
            ..FaultConfig::default()
        });
        let decisions: Vec<Decision> = (0..10_000).map(|_| faults.admit()).collect();
        let fails = decisions.iter().filter(|d| d.fail).count();
        let resets = decisions.iter().filter(|d| d.reset).count();
        assert!((2_200..2_800).contains(&fails), "{fails}");
        assert!((4_700..5_300).contains(&resets), "{resets}");
        assert!(decisions.iter().all(|d| !d.hang));
        assert_eq!(decisions.last().unwrap().index, 10_000);
        // Same seed, same pattern.
        let again = Faults::new(faults.config().clone());
        assert!(decisions.iter().all(|d| again.admit() == *d));

        let none = Faults::new(FaultConfig::default());
        let always = Faults::new(FaultConfig {
            fail_rate: 1.0,
            reset_rate: 1.0,
            ..FaultConfig::default()
        });
        for _ in 0..1000 {
            let d = none.admit();
            assert!(!d.fail && !d.reset);
            let d = always.admit();
            assert!(d.fail && d.reset);
        }
    }

    #[test]
    fn only_the_first_streams_break_when_counted() {
        let fault = StreamFault {
            kind: "stall".parse().unwrap(),
            after: 5,
            count: Some(2),
        };
        let faults = Faults::new(FaultConfig {
            stream_fault: Some(fault),
            ..FaultConfig::default()
        });
        let got: Vec<_> = (0..4).map(|_| faults.stream_begins()).collect();
        assert_eq!(got, [Some(fault), Some(fault), None, None]);
        let every = Faults::new(FaultConfig {
            stream_fault: Some(StreamFault { count: None, ..fault }),
            ..FaultConfig::default()
        });
        assert!((0..10).all(|_| every.stream_begins().is_some()));
        assert!(Faults::new(FaultConfig::default()).stream_begins().is_none());
        assert!("crash".parse::<StreamFaultKind>().is_err());
    }

    #[test]
    fn hang_after_n() {
        let faults = Faults::new(FaultConfig {
            hang_after: Some(2),
            ..FaultConfig::default()
        });
        assert!(!faults.admit().hang);
        assert!(!faults.admit().hang);
        assert!(!faults.is_hanging());
        assert!(faults.admit().hang);
        assert!(faults.is_hanging());
    }

    #[tokio::test]
    async fn exit_after_n() {
        let faults = std::sync::Arc::new(Faults::new(FaultConfig {
            exit_after: Some(2),
            ..FaultConfig::default()
        }));
        let waiter = tokio::spawn({
            let faults = faults.clone();
            async move { faults.exit_signal().await }
        });
        faults.complete();
        assert!(!faults.exit_requested());
        faults.complete();
        assert!(faults.exit_requested());
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(faults.completed(), 2);
    }

    #[test]
    fn validation() {
        assert!(FaultConfig::default().validate().is_ok());
        assert!(
            FaultConfig {
                fail_rate: 1.5,
                ..FaultConfig::default()
            }
            .validate()
            .is_err()
        );
        assert!(
            FaultConfig {
                reset_rate: -0.1,
                ..FaultConfig::default()
            }
            .validate()
            .is_err()
        );
        assert!(
            FaultConfig {
                fail_rate: f64::NAN,
                ..FaultConfig::default()
            }
            .validate()
            .is_err()
        );
        assert!(
            FaultConfig {
                exit_after: Some(0),
                ..FaultConfig::default()
            }
            .validate()
            .is_err()
        );
    }

    #[test]
    fn validation_messages_name_the_flag_the_value_and_the_reason() {
        let message = |config: FaultConfig| config.validate().unwrap_err().to_string();
        assert_eq!(
            message(FaultConfig {
                fail_rate: 1.5,
                ..FaultConfig::default()
            }),
            "fail_rate = 1.5: must be between 0 and 1"
        );
        assert_eq!(
            message(FaultConfig {
                reset_rate: -0.1,
                ..FaultConfig::default()
            }),
            "reset_rate = -0.1: must be between 0 and 1"
        );
        assert_eq!(
            message(FaultConfig {
                fail_rate: f64::NAN,
                ..FaultConfig::default()
            }),
            "fail_rate = NaN: must be between 0 and 1"
        );
        assert_eq!(
            message(FaultConfig {
                exit_after: Some(0),
                ..FaultConfig::default()
            }),
            "exit_after = 0: must be at least 1"
        );
    }
}
