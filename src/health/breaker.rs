//! The health state machine of one server: a circuit breaker.
//!
//! ```text
//!            unhealthy_threshold consecutive failures,
//!            or ejected by a dispatcher (passive)
//!   Closed ────────────────────────────────────────────▶ Open
//!  (Up: routed,                                    (Down: not routed)
//!   checked every interval)                          │        ▲
//!      ▲                                 next check  │        │ failure: the success
//!      │                                 is due      ▼        │ count starts over
//!      └───────────────────────────────────────── HalfOpen ───┘
//!        healthy_threshold consecutive       (one probe in flight)
//!        successful probes
//! ```
//!
//! The breaker is pure logic: the runner ([`super::checker`]) asks it
//! whether a probe may start ([`Breaker::start_probe`]), reports the
//! result ([`Breaker::record`]), and writes the [`Transition`]s it returns
//! into the shm server table. It never looks at the clock; the runner probes
//! at the check interval, so a down server is probed once per interval and
//! never twice at once (the half-open state admits one probe).

/// What a server is, as far as its health goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// Taking requests (the breaker is closed).
    Up,
    /// Out of rotation (the breaker is open or half-open).
    Down,
}

/// A change of [`Health`] the runner must write to the server table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    /// The new health.
    pub to: Health,
    /// The consecutive results that caused it (failures for `Down`,
    /// successes for `Up`).
    pub after: u32,
}

/// The breaker's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Up; `failures` consecutive failures so far; `probing` while a check
    /// is in flight.
    Closed {
        /// Consecutive failures.
        failures: u32,
        /// A check is in flight.
        probing: bool,
    },
    /// Down, no probe in flight; `successes` consecutive successful probes.
    Open {
        /// Consecutive successful probes.
        successes: u32,
    },
    /// Down, one probe in flight.
    HalfOpen {
        /// Consecutive successful probes before this one.
        successes: u32,
    },
}

/// Thresholds of a [`Breaker`] (`health.unhealthy_threshold` and
/// `health.healthy_threshold`), each at least 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Thresholds {
    /// Consecutive failures that open the breaker.
    pub unhealthy: u32,
    /// Consecutive successful probes that close it again.
    pub healthy: u32,
}

/// One server's circuit breaker (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Breaker {
    state: BreakerState,
    thresholds: Thresholds,
}

impl Breaker {
    /// A closed breaker (servers are registered `Up`).
    pub fn new(thresholds: Thresholds) -> Self {
        Self {
            state: BreakerState::Closed {
                failures: 0,
                probing: false,
            },
            thresholds: Thresholds {
                unhealthy: thresholds.unhealthy.max(1),
                healthy: thresholds.healthy.max(1),
            },
        }
    }

    /// Its state.
    pub fn state(&self) -> BreakerState {
        self.state
    }

    /// The health it stands for.
    pub fn health(&self) -> Health {
        match self.state {
            BreakerState::Closed { .. } => Health::Up,
            BreakerState::Open { .. } | BreakerState::HalfOpen { .. } => Health::Down,
        }
    }

    /// Whether a probe may start now; if so, it is in flight until
    /// [`record`](Self::record). One probe at a time: an open breaker goes
    /// half-open, and a half-open or probing one refuses.
    pub fn start_probe(&mut self) -> bool {
        match self.state {
            BreakerState::Closed {
                failures,
                probing: false,
            } => {
                self.state = BreakerState::Closed {
                    failures,
                    probing: true,
                };
                true
            }
            BreakerState::Open { successes } => {
                self.state = BreakerState::HalfOpen { successes };
                true
            }
            BreakerState::Closed { probing: true, .. } | BreakerState::HalfOpen { .. } => false,
        }
    }

    /// The result of the probe in flight (a result without one counts as
    /// well, as if one had been started). Returns the transition to write,
    /// if the health changed.
    pub fn record(&mut self, ok: bool) -> Option<Transition> {
        let t = self.thresholds;
        match (self.state, ok) {
            (BreakerState::Closed { .. }, true) => {
                self.state = BreakerState::Closed {
                    failures: 0,
                    probing: false,
                };
                None
            }
            (BreakerState::Closed { failures, .. }, false) => {
                let failures = failures.saturating_add(1);
                if failures >= t.unhealthy {
                    self.state = BreakerState::Open { successes: 0 };
                    Some(Transition {
                        to: Health::Down,
                        after: failures,
                    })
                } else {
                    self.state = BreakerState::Closed {
                        failures,
                        probing: false,
                    };
                    None
                }
            }
            (BreakerState::Open { successes } | BreakerState::HalfOpen { successes }, true) => {
                let successes = successes.saturating_add(1);
                if successes >= t.healthy {
                    self.state = BreakerState::Closed {
                        failures: 0,
                        probing: false,
                    };
                    Some(Transition {
                        to: Health::Up,
                        after: successes,
                    })
                } else {
                    self.state = BreakerState::Open { successes };
                    None
                }
            }
            (BreakerState::Open { .. } | BreakerState::HalfOpen { .. }, false) => {
                self.state = BreakerState::Open { successes: 0 };
                None
            }
        }
    }

    /// The server was taken out by someone else (a dispatcher's passive
    /// check): open the breaker, so that it takes `healthy` successful
    /// probes to come back. No effect if already open.
    pub fn eject(&mut self) {
        if self.health() == Health::Up {
            self.state = BreakerState::Open { successes: 0 };
        }
    }

    /// The server was put back by someone else (an operator): close the
    /// breaker with a clean count. No effect if already closed.
    pub fn admit(&mut self) {
        if self.health() == Health::Down {
            self.state = BreakerState::Closed {
                failures: 0,
                probing: false,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker(unhealthy: u32, healthy: u32) -> Breaker {
        Breaker::new(Thresholds { unhealthy, healthy })
    }

    /// Runs one probe with result `ok`.
    fn probe(b: &mut Breaker, ok: bool) -> Option<Transition> {
        assert!(b.start_probe(), "a probe may start: {:?}", b.state());
        b.record(ok)
    }

    #[test]
    fn ejected_after_consecutive_failures_only() {
        let mut b = breaker(3, 2);
        assert_eq!(b.health(), Health::Up);
        assert_eq!(probe(&mut b, false), None);
        assert_eq!(probe(&mut b, false), None);
        assert_eq!(probe(&mut b, true), None, "a success resets the count");
        assert_eq!(probe(&mut b, false), None);
        assert_eq!(probe(&mut b, false), None);
        assert_eq!(
            probe(&mut b, false),
            Some(Transition {
                to: Health::Down,
                after: 3
            })
        );
        assert_eq!(b.health(), Health::Down);
        assert_eq!(b.state(), BreakerState::Open { successes: 0 });
    }

    #[test]
    fn readmitted_after_consecutive_successful_probes() {
        let mut b = breaker(1, 3);
        assert_eq!(probe(&mut b, false).map(|t| t.to), Some(Health::Down));
        assert_eq!(probe(&mut b, true), None);
        assert_eq!(probe(&mut b, true), None);
        assert_eq!(probe(&mut b, false), None, "a failure starts the count over");
        assert_eq!(b.state(), BreakerState::Open { successes: 0 });
        assert_eq!(probe(&mut b, true), None);
        assert_eq!(probe(&mut b, true), None);
        assert_eq!(b.health(), Health::Down);
        assert_eq!(
            probe(&mut b, true),
            Some(Transition {
                to: Health::Up,
                after: 3
            })
        );
        assert_eq!(
            b.state(),
            BreakerState::Closed {
                failures: 0,
                probing: false
            }
        );
        // Back up, the failure count starts from zero.
        assert_eq!(probe(&mut b, false).map(|t| t.to), Some(Health::Down));
    }

    #[test]
    fn half_open_admits_one_probe_at_a_time() {
        let mut b = breaker(1, 2);
        probe(&mut b, false);
        assert!(b.start_probe());
        assert_eq!(b.state(), BreakerState::HalfOpen { successes: 0 });
        assert!(!b.start_probe(), "a second probe waits for the first");
        assert_eq!(b.health(), Health::Down, "half-open is still out of rotation");
        assert_eq!(b.record(true), None);
        assert_eq!(b.state(), BreakerState::Open { successes: 1 });
        assert!(b.start_probe());
        assert_eq!(b.record(true).map(|t| t.to), Some(Health::Up));
        // Closed: also one check at a time.
        assert!(b.start_probe());
        assert!(!b.start_probe());
        assert_eq!(b.record(true), None);
        assert!(b.start_probe());
    }

    #[test]
    fn thresholds_of_one() {
        let mut b = breaker(1, 1);
        assert_eq!(probe(&mut b, false).map(|t| (t.to, t.after)), Some((Health::Down, 1)));
        assert_eq!(probe(&mut b, true).map(|t| (t.to, t.after)), Some((Health::Up, 1)));
        // Zero is taken as one.
        let mut b = breaker(0, 0);
        assert_eq!(probe(&mut b, false).map(|t| t.to), Some(Health::Down));
        assert_eq!(probe(&mut b, true).map(|t| t.to), Some(Health::Up));
    }

    #[test]
    fn outside_ejection_and_admission() {
        let mut b = breaker(3, 2);
        probe(&mut b, false);
        b.eject();
        assert_eq!(b.state(), BreakerState::Open { successes: 0 });
        b.eject();
        assert_eq!(b.state(), BreakerState::Open { successes: 0 }, "idempotent");
        assert_eq!(probe(&mut b, true), None);
        assert_eq!(probe(&mut b, true).map(|t| t.to), Some(Health::Up));
        b.eject();
        b.admit();
        assert_eq!(
            b.state(),
            BreakerState::Closed {
                failures: 0,
                probing: false
            }
        );
        // Admitting a closed breaker keeps its count.
        probe(&mut b, false);
        b.admit();
        assert_eq!(
            b.state(),
            BreakerState::Closed {
                failures: 1,
                probing: false
            }
        );
    }
}
