//! A dispatcher's liveness, told apart from how busy its reactor is.
//!
//! A dispatcher serves every connection on one single-threaded reactor. Its
//! heartbeat in the registry, which the supervisor reads to kill a hung
//! child after 10 s and to stop the systemd watchdog's pings after 3 s,
//! used to be a task on that reactor: a few requests that kept it busy for
//! seconds (parsing and rendering huge bodies) made the process look hung,
//! and its restart cut every stream it served. Now a thread of its own
//! beats, and the reactor only pulses a [`ReactorWatch`] every
//! [`PULSE`]: the thread beats while the reactor's last pulse is at most
//! [`STUCK_AFTER_MS`] old, warns once when it lags by more than
//! [`LAG_WARN_MS`], and stops beating only when the reactor is stuck, so a
//! reactor that never comes back (a deadlock, an endless loop) is still
//! found and restarted.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// How often the reactor pulses.
pub const PULSE: Duration = Duration::from_millis(100);
/// A reactor whose last pulse is older than this is stuck: the heartbeats
/// stop, and the supervisor restarts the process 10 s later.
pub const STUCK_AFTER_MS: u64 = 30_000;
/// A lag worth a warning in the log.
pub const LAG_WARN_MS: u64 = 1_000;

/// The reactor's last pulse, read by the heartbeat thread.
#[derive(Debug)]
pub struct ReactorWatch {
    last_pulse_ms: AtomicU64,
}

/// What the heartbeat thread makes of the reactor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReactorState {
    /// Pulsing on time.
    Running,
    /// Late by this many ms, not yet stuck.
    Lagging(u64),
    /// Late by this many ms: stuck.
    Stuck(u64),
}

impl ReactorWatch {
    /// A watch whose reactor last pulsed at `now_ms`.
    pub fn new(now_ms: u64) -> Self {
        Self {
            last_pulse_ms: AtomicU64::new(now_ms),
        }
    }

    /// The reactor is running at `now_ms`.
    pub fn pulse(&self, now_ms: u64) {
        self.last_pulse_ms.fetch_max(now_ms, Ordering::Relaxed);
    }

    /// The reactor at `now_ms`.
    pub fn state(&self, now_ms: u64) -> ReactorState {
        let lag = now_ms.saturating_sub(self.last_pulse_ms.load(Ordering::Relaxed));
        if lag > STUCK_AFTER_MS {
            ReactorState::Stuck(lag)
        } else if lag > LAG_WARN_MS {
            ReactorState::Lagging(lag)
        } else {
            ReactorState::Running
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_late_reactor_lags_then_is_stuck_and_a_pulse_brings_it_back() {
        let w = ReactorWatch::new(1_000);
        assert_eq!(w.state(1_000 + PULSE.as_millis() as u64), ReactorState::Running);
        assert_eq!(w.state(1_000 + LAG_WARN_MS), ReactorState::Running);
        assert_eq!(w.state(3_500), ReactorState::Lagging(2_500));
        assert_eq!(w.state(1_000 + STUCK_AFTER_MS), ReactorState::Lagging(STUCK_AFTER_MS));
        assert_eq!(w.state(1_001 + STUCK_AFTER_MS), ReactorState::Stuck(STUCK_AFTER_MS + 1));
        w.pulse(40_000);
        assert_eq!(w.state(40_050), ReactorState::Running);
        w.pulse(39_000);
        assert_eq!(w.state(40_050), ReactorState::Running, "pulses never go back");
    }
}
