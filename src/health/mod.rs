//! Health of the inference servers: active checks, passive checks, load
//! scraping. Everything it decides lands in the shm server table, so every
//! dispatcher sees it at once, with no messages between processes.
//!
//! | module | what |
//! | --- | --- |
//! | [`prometheus`] | a tolerant Prometheus text-format parser, and the load figures of vLLM, SGLang and llama.cpp |
//! | [`breaker`] | one server's circuit breaker: ejected after consecutive failures, re-admitted after consecutive successful probes |
//! | [`engine_info`] | what an engine says about itself once: its slots and context (llama.cpp's `/props`, `/v1/models`' `max_model_len`) |
//! | [`checker`] | the supervisor's task: health checks, `/metrics` scrapes and engine-info reads, written to the server table |
//! | this module | [`PassiveHealth`] (a dispatcher's failure counts), [`eject`], [`fresh_load`] |
//!
//! # Active checks
//!
//! The supervisor runs [`spawn`]: every `health.interval_ms` it sends
//! `GET <server><health.path>` to every registered server that is not
//! draining, with `health.timeout_ms` as the deadline; a 2xx answer is a
//! success, anything else (refused, reset, timed out, another status) a
//! failure. `health.unhealthy_threshold` consecutive failures set the
//! server `Down`: dispatchers stop routing to it and its prefix entries
//! stop matching. A down server is still probed at the interval, one probe
//! at a time (half-open), and `health.healthy_threshold` consecutive
//! successes set it `Up` again. A `Draining` server (an operator's or a
//! reload's decision) is neither probed nor changed.
//!
//! # Passive checks
//!
//! With `health.passive` (the default), each dispatcher counts, per server,
//! its requests that failed in a row — a connection error, a 5xx head, a
//! body cut or timed out — and a request answered in full resets the count
//! ([`PassiveHealth`]). The dispatcher that reaches `unhealthy_threshold`
//! sets the server `Down` in the server table itself ([`eject`]), so every
//! dispatcher stops using it at once, without waiting for the next check;
//! the active checker then re-admits it after `healthy_threshold`
//! successful probes. Counts are per dispatcher process, in memory: a
//! server failing for two dispatchers alternately needs the threshold in
//! one of them.
//!
//! # Load scraping
//!
//! Every `health.scrape_interval_ms` the checker reads each server's
//! `/metrics` (not the down ones), takes the waiting and running requests
//! and the KV-cache usage in the server's `metrics_flavor`
//! ([`prometheus::extract`]; `auto` tells from the names), and stores them
//! with the segment-clock time in the server table
//! ([`shm_layout::ServerTable::store_load`]). Routing ignores figures older
//! than `health.stale_after_ms` ([`fresh_load`]), so a server whose
//! `/metrics` stopped answering is not judged by an old snapshot. A failed
//! scrape does not count as a failed health check: an engine started
//! without metrics is still healthy.
//!
//! # Engine slots and context
//!
//! With the first scrape of a registration, and after the server was down
//! or its engine restarted, the checker asks the engine about itself once
//! ([`engine_info`]): `GET <server>/props`, and `GET <server>/v1/models`
//! when `/props` did not give the context. A llama.cpp engine says in
//! `/props` how many requests it runs at once (`total_slots`), which
//! replaces the learned admission limit for the holding policies
//! ([`crate::routing::capacity`], [`crate::routing::Candidate::pending_estimate`]),
//! and each slot's context (`n_ctx`); vLLM, SGLang and `semlb-sim` give the
//! context as `max_model_len` in `/v1/models`. The dispatchers answer a
//! request no live engine can take with the engines' 400 themselves
//! (`crate::dispatcher`'s context check).
//!
//! # Where staleness is applied
//!
//! In [`crate::store::local::LocalState`], the one place where both stores,
//! the gateway queue and a holding policy's check turn the server table
//! into the candidates a policy sees: it has the segment (hence its
//! clock), and the bound comes from the dispatcher's configuration.
//! [`crate::routing::live_candidates`] stays a plain read of the table (no
//! clock, no configuration), as the benchmarks, `/health` and `/v1/models`
//! use it.

pub mod breaker;
pub mod checker;
pub mod engine_info;
pub mod prometheus;

use std::sync::atomic::{AtomicU64, Ordering};

use shm_layout::plan::SERVER_SLOTS;
use shm_layout::{LoadFigures, ServerRef, ServerState, ServerTable};

use crate::config::HealthConfig;

pub use breaker::{Breaker, Health, Thresholds, Transition};
pub use checker::spawn;

/// `figures` if they were scraped at most `stale_after_ms` before `now_ms`
/// (segment milliseconds); `None` if they are older or were never scraped
/// (`scraped_at_ms == 0`). Figures stamped after `now_ms` (another
/// process's clock read raced this one) are fresh.
pub fn fresh_load(figures: LoadFigures, now_ms: u64, stale_after_ms: u64) -> Option<LoadFigures> {
    (figures.scraped_at_ms != 0 && now_ms.saturating_sub(figures.scraped_at_ms) <= stale_after_ms).then_some(figures)
}

/// Sets `server` `Down` if it is `Up` (never touches a draining, already
/// down or re-registered one). True if this call took it down.
pub fn eject(servers: &ServerTable<'_>, server: ServerRef) -> bool {
    servers.transition(server, ServerState::Up, ServerState::Down)
}

/// A dispatcher's passive health checks: per server slot, the requests that
/// failed in a row through this process (see the module docs). Lock-free;
/// a success costs one load when nothing failed.
#[derive(Debug)]
pub struct PassiveHealth {
    /// `generation:32 | consecutive failures:32`, per slot: a reused slot
    /// starts from zero.
    cells: Box<[AtomicU64]>,
    /// Failures in a row that eject; 0 = passive checks off.
    threshold: u32,
}

impl PassiveHealth {
    /// Passive checks as `config` says (`passive`, `unhealthy_threshold`).
    pub fn new(config: &HealthConfig) -> Self {
        Self::with_threshold(if config.passive {
            config.unhealthy_threshold.max(1)
        } else {
            0
        })
    }

    /// Passive checks ejecting after `threshold` failures in a row; 0 turns
    /// them off ([`failure`](Self::failure) never ejects).
    pub fn with_threshold(threshold: u32) -> Self {
        Self {
            cells: (0..SERVER_SLOTS).map(|_| AtomicU64::new(0)).collect(),
            threshold,
        }
    }

    /// Whether failures are counted.
    pub fn enabled(&self) -> bool {
        self.threshold > 0
    }

    fn cell(&self, server: ServerRef) -> Option<&AtomicU64> {
        self.cells.get(usize::from(server.slot))
    }

    /// A request to `server` was answered in full: its count starts over.
    pub fn success(&self, server: ServerRef) {
        let Some(cell) = self.cell(server).filter(|_| self.enabled()) else {
            return;
        };
        let clean = u64::from(server.generation) << 32;
        if cell.load(Ordering::Relaxed) != clean {
            cell.store(clean, Ordering::Relaxed);
        }
    }

    /// A request to `server` failed. True when this failure reaches the
    /// threshold: the caller should [`eject`] the server now (the count then
    /// starts over, so exactly one of several concurrent failures says so).
    pub fn failure(&self, server: ServerRef) -> bool {
        let Some(cell) = self.cell(server).filter(|_| self.enabled()) else {
            return false;
        };
        let generation = u64::from(server.generation) << 32;
        let mut current = cell.load(Ordering::Relaxed);
        loop {
            let count = if current >> 32 == generation >> 32 {
                (current as u32).saturating_add(1)
            } else {
                1
            };
            let eject = count >= self.threshold;
            let next = generation | if eject { 0 } else { u64::from(count) };
            match cell.compare_exchange_weak(current, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return eject,
                Err(seen) => current = seen,
            }
        }
    }

    /// The failures in a row counted for `server` (0 for another
    /// generation of its slot).
    pub fn failures(&self, server: ServerRef) -> u32 {
        self.cell(server)
            .map(|c| c.load(Ordering::Relaxed))
            .filter(|v| v >> 32 == u64::from(server.generation))
            .map_or(0, |v| v as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use shm_layout::{LayoutPlan, Segment};

    fn server(slot: u16, generation: u32) -> ServerRef {
        ServerRef { slot, generation }
    }

    #[test]
    fn fresh_and_stale_figures() {
        let f = |at| LoadFigures {
            waiting: 1,
            running: 2,
            kv_usage_permyriad: 3,
            scraped_at_ms: at,
            pending_at_scrape: 0,
        };
        assert_eq!(fresh_load(f(1000), 1000, 500), Some(f(1000)));
        assert_eq!(fresh_load(f(1000), 1500, 500), Some(f(1000)), "at the bound: fresh");
        assert_eq!(fresh_load(f(1000), 1501, 500), None);
        assert_eq!(fresh_load(f(2000), 1000, 500), Some(f(2000)), "stamped ahead");
        assert_eq!(fresh_load(f(0), 0, u64::MAX), None, "never scraped");
        assert_eq!(fresh_load(LoadFigures::default(), 10, 5), None);
    }

    #[test]
    fn passive_counts_consecutive_failures() {
        let p = PassiveHealth::with_threshold(3);
        let a = server(4, 7);
        assert!(!p.failure(a));
        assert!(!p.failure(a));
        p.success(a);
        assert_eq!(p.failures(a), 0, "a success starts over");
        assert!(!p.failure(a));
        assert!(!p.failure(a));
        assert_eq!(p.failures(a), 2);
        assert!(p.failure(a), "the third in a row ejects");
        assert_eq!(p.failures(a), 0, "and the count starts over");
        assert!(!p.failure(a));
        // Another slot is counted apart.
        assert!(!p.failure(server(5, 7)));
        assert_eq!(p.failures(a), 1);
        // A re-registered slot (new generation) starts from zero.
        let a2 = server(4, 8);
        assert_eq!(p.failures(a2), 0);
        assert!(!p.failure(a2));
        assert!(!p.failure(a2));
        assert!(p.failure(a2));
        // The old generation's success does not clear the new one's count.
        assert!(!p.failure(a2));
        p.success(a2);
        assert_eq!(p.failures(a2), 0);
        // Out-of-range slots are ignored.
        assert!(!p.failure(server(u16::MAX, 0)));
        p.success(server(u16::MAX, 0));
    }

    #[test]
    fn passive_off_or_threshold_one() {
        let off = PassiveHealth::new(&HealthConfig {
            passive: false,
            ..HealthConfig::default()
        });
        assert!(!off.enabled());
        assert!((0..10).all(|_| !off.failure(server(0, 1))));
        assert_eq!(off.failures(server(0, 1)), 0);
        let one = PassiveHealth::new(&HealthConfig {
            unhealthy_threshold: 1,
            ..HealthConfig::default()
        });
        assert!(one.failure(server(0, 1)));
        assert!(one.failure(server(0, 1)));
    }

    #[test]
    fn concurrent_failures_eject_once_per_threshold() {
        let p = PassiveHealth::with_threshold(4);
        let a = server(1, 1);
        let ejections = std::sync::atomic::AtomicU32::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..1000 {
                        if p.failure(a) {
                            ejections.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(ejections.load(Ordering::Relaxed), 1000);
        assert_eq!(p.failures(a), 0);
    }

    #[test]
    fn eject_only_takes_up_servers_down() {
        let segment = Segment::heap(&LayoutPlan::for_size(16 << 20).unwrap());
        let servers = segment.tables().servers;
        let a = servers.register(1, "http://a:1", 0).unwrap();
        assert!(eject(&servers, a));
        assert!(!eject(&servers, a), "already down");
        assert_eq!(servers.current(a.slot), Some((a, ServerState::Down)));
        assert!(servers.set_state(a, ServerState::Draining));
        assert!(!eject(&servers, a), "a draining server is left alone");
        assert_eq!(servers.current(a.slot), Some((a, ServerState::Draining)));
    }
}
