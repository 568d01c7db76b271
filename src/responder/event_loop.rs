//! A response process's main loop ([`ResponderLoop`]): it polls its
//! completion rings, applies what it finds ([`crate::responder`]), exports
//! its counters ([`crate::metrics`]) and heartbeats in the registry, until
//! told to stop.
//!
//! The stop comes in as a `&AtomicBool` (the `semlb` binary sets one from
//! its SIGTERM/SIGINT handler; a test sets it from another thread), as a
//! dispatcher's comes in as a future ([`crate::dispatcher::serve`]). It is
//! checked once per look at the rings: once it is set, the rings are
//! drained once more and [`ResponderLoop::run`] returns.
//!
//! No cross-process wake-up exists for ring pushes (one would cost the
//! dispatcher a system call per request), so a responder polls, off the
//! request path, with a sleep that adapts to the record rate
//! (`next_poll`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use shm_layout::Segment;

use crate::metrics::Metrics;
use crate::responder::{Responder, ResponderStats};

/// How often a responder heartbeats in the registry (as the dispatchers do;
/// the supervisor kills a child whose heartbeat is 10 s old).
const HEARTBEAT: Duration = Duration::from_millis(500);
/// Records a look at the rings should find under load.
const POLL_BATCH: usize = 16;
/// The shortest sleep between looks.
const MIN_POLL: Duration = Duration::from_micros(50);
/// The longest sleep while records keep coming.
const MAX_BUSY_POLL: Duration = Duration::from_millis(2);
/// The longest sleep when nothing comes.
const MAX_IDLE_POLL: Duration = Duration::from_millis(5);

/// A response process's loop: a [`Responder`] draining some of a
/// segment's completion rings, as one registry slot's process.
#[derive(Debug)]
pub struct ResponderLoop<'a> {
    segment: &'a Segment,
    responder: Responder<'a>,
    rings: Vec<usize>,
    slot: u16,
    incarnation: u32,
}

impl<'a> ResponderLoop<'a> {
    /// `responder` (writing into `segment`'s tables, or its own store)
    /// draining the completion `rings` of `segment` (for responder `j` of
    /// `m`, [`crate::responder::rings_for`]), heartbeating and counting as
    /// incarnation `incarnation` of registry slot `slot`.
    pub fn new(segment: &'a Segment, responder: Responder<'a>, rings: Vec<usize>, slot: u16, incarnation: u32) -> Self {
        Self {
            segment,
            responder,
            rings,
            slot,
            incarnation,
        }
    }

    /// Polls the rings until `shutdown` is set, then drains them once more
    /// and returns the responder's counters.
    pub fn run(mut self, shutdown: &AtomicBool) -> ResponderStats {
        let tables = self.segment.tables();
        let clock = self.segment.clock();
        let mut idle = MIN_POLL;
        let mut last_beat = 0u64;
        // Its counters go to its registry slot's stats block (`/metrics`).
        let metrics = Metrics::new(tables.stats, self.slot);
        let mut counted = self.responder.stats();
        loop {
            let stopping = shutdown.load(Ordering::Relaxed);
            let now_ms = clock.now_ms();
            let stamp = clock.stamp();
            let applied: usize = self
                .rings
                .iter()
                .map(|r| {
                    self.responder
                        .drain(*r, stamp, now_ms, |slot, inc| tables.registry.is_alive(slot, inc))
                })
                .sum();
            let now = self.responder.stats();
            metrics.responder(&counted, &now);
            for o in self.responder.take_observations() {
                metrics.prediction(&o);
            }
            for _ in counted.forgotten_servers..now.forgotten_servers {
                metrics.forgotten();
            }
            counted = now;
            if now_ms >= last_beat + HEARTBEAT.as_millis() as u64 {
                tables.registry.heartbeat(self.slot, self.incarnation, now_ms);
                last_beat = now_ms;
            }
            if stopping {
                return now;
            }
            idle = next_poll(idle, applied);
            std::thread::sleep(idle);
        }
    }
}

/// How long a responder sleeps after a look that found `applied` records,
/// having slept `idle` before it. A wake-up costs about as much as
/// applying a record, so while records keep coming the sleep is sized for
/// [`POLL_BATCH`] records per look, within [`MIN_POLL`] and
/// [`MAX_BUSY_POLL`] (the longest a record waits to be written under
/// load); with none, it backs off to [`MAX_IDLE_POLL`].
fn next_poll(idle: Duration, applied: usize) -> Duration {
    if applied == 0 {
        return (idle * 2).clamp(MIN_POLL, MAX_IDLE_POLL);
    }
    let scaled = idle.as_secs_f64() * POLL_BATCH as f64 / applied as f64;
    Duration::from_secs_f64(scaled).clamp(MIN_POLL, MAX_BUSY_POLL)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_poll_adapts_to_the_record_rate() {
        let us = Duration::from_micros;
        // Busy: sized for a batch per look, within the bounds.
        assert_eq!(next_poll(us(250), 4), us(1000));
        assert_eq!(next_poll(us(600), 16), us(600));
        assert_eq!(next_poll(us(600), 96), us(100));
        assert_eq!(next_poll(us(1500), 1), MAX_BUSY_POLL);
        assert_eq!(next_poll(us(60), 1000), MIN_POLL);
        // Idle: back off, up to the idle bound.
        assert_eq!(next_poll(us(1000), 0), us(2000));
        assert_eq!(next_poll(MAX_IDLE_POLL, 0), MAX_IDLE_POLL);
        // A steady rate settles: 13 records per ms.
        let mut idle = MIN_POLL;
        for _ in 0..20 {
            let applied = (idle.as_secs_f64() * 13_000.0).round() as usize;
            idle = next_poll(idle, applied);
        }
        let per_look = idle.as_secs_f64() * 13_000.0;
        assert!(
            (12.0..=20.0).contains(&per_look),
            "{idle:?}: {per_look} records per look"
        );
    }
}
