//! The supervisor's segment: claimed at start, then kept or removed at exit.
//!
//! [`claim`] takes the segment's owner lock ([`shm_layout::ownership`]),
//! so a second supervisor on the same name is refused however the first
//! one's pid is reused, and gets one of three:
//!
//! * **created**: no segment of that name; an empty one.
//! * **adopted** (a hot restart): the segment a stopped or killed
//!   supervisor left, made by this layout with the same plan. Once the
//!   earlier supervisor's children are gone (their member locks released;
//!   the claim waits up to the drain timeout plus 5 s), the processes it
//!   registered are marked exited and their in-flight counts reclaimed
//!   from their ledger rows. The prefix table, the response cache, the
//!   token segments, the completion rings (records not yet written back
//!   are written back by the new responders) and the servers' state are
//!   kept; [`super::backends`] keeps the registration of every backend
//!   still configured.
//! * **replaced**: a segment of another layout version or size, or one
//!   that does not validate: removed and created again, with one log line
//!   saying why.
//!
//! At exit the segment stays (`keep_segment`, the default) for the next
//! start, or is removed.

use std::time::Duration;

use anyhow::{Context, Result};
use semlb::config::ServeConfig;
use shm_layout::{Claim, Claimed, LayoutPlan, Ownership, PlanOptions, ProcessState, Segment};

/// How long past the drain timeout a start waits for the children of an
/// earlier supervisor to exit.
const MEMBERS_GRACE: Duration = Duration::from_secs(5);

/// A claimed segment and its owner lock.
#[derive(Debug)]
pub(super) struct OwnedSegment {
    /// The segment.
    pub segment: Segment,
    /// Whether an earlier supervisor's tables were adopted.
    pub adopted: bool,
    ownership: Ownership,
}

/// What an adoption took back from the processes of the earlier supervisor.
#[derive(Debug, Default, PartialEq, Eq)]
struct Reclaimed {
    /// Processes registered as running.
    processes: usize,
    /// Requests they had in flight.
    requests: u64,
}

/// Claims the configured segment (see the module docs), logging which way.
pub(super) fn claim(config: &ServeConfig) -> Result<OwnedSegment> {
    let plan = LayoutPlan::new(
        config.shm_size.0,
        PlanOptions {
            max_response_fraction: config.response_cache.max_value_fraction,
        },
    )?;
    let patience = config.drain_timeout() + MEMBERS_GRACE;
    let Claimed {
        segment,
        ownership,
        claim,
    } = Segment::claim(&config.shm_name, &plan, patience)
        .with_context(|| format!("claiming shm segment {}", config.shm_name))?;
    let name = ownership.name().to_owned();
    match &claim {
        Claim::Created => tracing::info!(shm = %name, "created shm segment {name}"),
        Claim::Adopted { waited } => {
            let reclaimed = reclaim(&segment);
            let t = segment.tables();
            let (prefixes, responses) = (t.prefix.occupancy(), t.responses.index_occupancy());
            tracing::info!(
                shm = %name,
                prefixes,
                responses,
                processes = reclaimed.processes,
                requests = reclaimed.requests,
                waited_ms = waited.as_millis() as u64,
                "adopted shm segment {name} with its tables: {prefixes} prefix entries, {responses} indexed responses; \
                 {} processes of the previous supervisor gone, {} requests they had in flight reclaimed",
                reclaimed.processes,
                reclaimed.requests
            );
        }
        Claim::Replaced { reason } => tracing::warn!(
            shm = %name,
            "replacing shm segment {name}: {reason}; the tables start empty"
        ),
    }
    Ok(OwnedSegment {
        adopted: matches!(claim, Claim::Adopted { .. }),
        segment,
        ownership,
    })
}

/// Marks every process the earlier supervisor registered exited (the claim
/// proved them gone) and takes back their in-flight counts.
fn reclaim(segment: &Segment) -> Reclaimed {
    let t = segment.tables();
    let mut reclaimed = Reclaimed::default();
    for p in t.registry.processes() {
        if matches!(p.state, ProcessState::Starting | ProcessState::Running) {
            t.registry.mark_exited(p.slot, p.incarnation);
            reclaimed.processes += 1;
        }
    }
    for process in 0..t.registry.capacity() as u16 {
        reclaimed.requests += t.servers.reclaim_process(process).requests;
    }
    reclaimed
}

/// Takes over the segment `name` from the supervisor handing over to this
/// one (an upgrade, [`super::upgrade`]), with the owner lock's descriptor
/// it handed over.
pub(super) fn inherit(name: &str, owner: std::os::fd::OwnedFd) -> Result<OwnedSegment> {
    let ownership = Ownership::inherit(owner, name).with_context(|| format!("taking over shm segment {name}"))?;
    let segment = Segment::open(name).with_context(|| {
        format!("taking over shm segment {name} (an upgrade to a build of another layout version needs a restart)")
    })?;
    tracing::info!(shm = %name, "took over shm segment {name} from the supervisor before this one");
    Ok(OwnedSegment {
        segment,
        adopted: true,
        ownership,
    })
}

impl OwnedSegment {
    /// The descriptor carrying the owner lock, to hand over.
    pub(super) fn owner_fd(&self) -> std::os::fd::RawFd {
        std::os::fd::AsRawFd::as_raw_fd(&self.ownership)
    }

    /// Gives the segment up: removes it unless `keep`, then releases the
    /// owner lock (in that order, so no other supervisor adopts a segment
    /// being removed).
    pub(super) fn release(self, keep: bool) {
        let Self { segment, ownership, .. } = self;
        let name = ownership.name().to_owned();
        drop(segment);
        if keep {
            tracing::info!(shm = %name, "leaving shm segment {name} in place");
        } else {
            let _ = Segment::remove(&name);
        }
        drop(ownership);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shm_layout::Role;

    #[test]
    fn an_adoption_reclaims_what_the_dead_processes_held() {
        let segment = Segment::heap(&LayoutPlan::for_size(8 << 20).unwrap());
        let t = segment.tables();
        let server = t.servers.register(0, "http://10.0.0.1:8000", 0).unwrap();
        for slot in 1..=3u16 {
            let incarnation = t.registry.claim(slot, Role::Dispatcher, 0);
            t.registry.attach(slot, incarnation, 1000 + u32::from(slot), 0);
            assert!(t.servers.begin_request(slot, server, 100));
        }
        let done = t.registry.claim(4, Role::Responder, 0);
        t.registry.mark_exited(4, done);
        assert_eq!(t.servers.inflight(server), (3, 300));
        assert_eq!(
            reclaim(&segment),
            Reclaimed {
                processes: 3,
                requests: 3
            }
        );
        assert_eq!(t.servers.inflight(server), (0, 0));
        assert!(t.registry.processes().all(|p| p.state == ProcessState::Exited));
        assert_eq!(reclaim(&segment), Reclaimed::default(), "nothing twice");
    }
}
