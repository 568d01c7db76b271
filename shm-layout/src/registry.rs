//! The process registry: one slot per child process of the supervisor, so
//! the supervisor and `semlb status` can see who is alive.
//!
//! ```text
//! ProcessSlot (64 B)
//! ┌ state (incarnation:32 | role:8 | state:8) · pid · heartbeat_ms · started_ms · restarts · tuned · revision · pad
//! ```
//!
//! The supervisor [`claim`](Registry::claim)s a slot before starting a child
//! (bumping the incarnation), the child [`attach`](Registry::attach)es with
//! its pid and [`heartbeat`](Registry::heartbeat)s, and the supervisor marks
//! it [`exited`](Registry::mark_exited) when it reaps it. Every write after
//! the claim names the incarnation, so a late write from a previous
//! incarnation of the slot is ignored. No step holds a lock.
//!
//! The configuration revision ([`publish_revision`](Registry::publish_revision))
//! tells who runs which configuration: the supervisor publishes, in its
//! slot, the revision it has applied before it tells the dispatchers to
//! reload; each dispatcher publishes, in its own slot, the revision it read
//! there before resolving the configuration, once it runs what it
//! resolved. The admin API answers a pool change once every dispatcher has
//! caught up. (The word was padding before; 0 there means none.)

use crate::sync::{AtomicU64, Ordering};

/// The slot the supervisor registers itself in.
pub const SUPERVISOR_SLOT: u16 = 0;

/// What a process does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Role {
    /// The supervisor itself.
    Supervisor = 1,
    /// An HTTP dispatcher.
    Dispatcher = 2,
    /// A response (write-back) process.
    Responder = 3,
    /// A tool attached for inspection or benchmarking.
    Tool = 4,
}

impl Role {
    /// Lower-case name, as `semlb shm inspect` and `semlb status` print it.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Supervisor => "supervisor",
            Self::Dispatcher => "dispatcher",
            Self::Responder => "responder",
            Self::Tool => "tool",
        }
    }
}

/// Life-cycle state of a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ProcessState {
    /// Never used.
    Free = 0,
    /// Claimed by the supervisor; the child has not attached yet.
    Starting = 1,
    /// The child attached.
    Running = 2,
    /// The child exited or was reaped.
    Exited = 3,
}

impl ProcessState {
    /// Lower-case name, as `semlb shm inspect` and `semlb status` print it.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Free => "free",
            Self::Starting => "starting",
            Self::Running => "running",
            Self::Exited => "exited",
        }
    }
}

/// A copy of one registry slot.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProcessInfo {
    /// Slot index.
    pub slot: u16,
    /// Bumped on every claim.
    pub incarnation: u32,
    /// Role of the current incarnation, if set.
    pub role: Option<Role>,
    /// State of the current incarnation.
    pub state: ProcessState,
    /// Pid, 0 until attached.
    pub pid: u32,
    /// Last heartbeat, segment milliseconds.
    pub heartbeat_ms: u64,
    /// When the incarnation was claimed, segment milliseconds.
    pub started_ms: u64,
    /// Claims of this slot after the first (restarts).
    pub restarts: u64,
    /// The value the incarnation tunes online and publishes, if any: a
    /// dispatcher routing with the `cost` policy publishes its weight
    /// between cache and load ([`Registry::publish_tuned`]).
    pub tuned: Option<f64>,
    /// The configuration revision the process runs (0: none published;
    /// [`Registry::publish_revision`]).
    pub revision: u64,
}

#[repr(C, align(64))]
#[derive(Debug)]
pub(crate) struct ProcessSlot {
    state: AtomicU64,
    pid: AtomicU64,
    heartbeat_ms: AtomicU64,
    started_ms: AtomicU64,
    restarts: AtomicU64,
    /// `f64` bits of the published tuned value; 0 = none.
    tuned: AtomicU64,
    /// The configuration revision it runs; 0 = none.
    revision: AtomicU64,
    _pad: [u64; 1],
}

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<ProcessSlot>() as u64 == crate::plan::PROCESS_SLOT_BYTES);

#[cfg(test)]
impl ProcessSlot {
    pub(crate) fn new() -> Self {
        Self {
            state: AtomicU64::new(0),
            pid: AtomicU64::new(0),
            heartbeat_ms: AtomicU64::new(0),
            started_ms: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
            tuned: AtomicU64::new(0),
            revision: AtomicU64::new(0),
            _pad: [0; 1],
        }
    }
}

fn word(incarnation: u32, role: Role, state: ProcessState) -> u64 {
    (u64::from(incarnation) << 32) | ((role as u64) << 8) | state as u64
}

fn role_of(w: u64) -> Option<Role> {
    Some(match (w >> 8) as u8 {
        1 => Role::Supervisor,
        2 => Role::Dispatcher,
        3 => Role::Responder,
        4 => Role::Tool,
        _ => return None,
    })
}

fn state_of(w: u64) -> ProcessState {
    match w as u8 {
        1 => ProcessState::Starting,
        2 => ProcessState::Running,
        3 => ProcessState::Exited,
        _ => ProcessState::Free,
    }
}

/// The registry over its slots.
#[derive(Debug, Clone, Copy)]
pub struct Registry<'a> {
    slots: &'a [ProcessSlot],
}

impl<'a> Registry<'a> {
    pub(crate) fn new(slots: &'a [ProcessSlot]) -> Self {
        Self { slots }
    }

    /// Number of slots.
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// A slot no process is using (free or exited).
    pub fn find_free(&self) -> Option<u16> {
        self.slots
            .iter()
            .position(|s| {
                matches!(
                    state_of(s.state.load(Ordering::Acquire)),
                    ProcessState::Free | ProcessState::Exited
                )
            })
            .map(|i| i as u16)
    }

    /// Starts a new incarnation of `slot` for a child with `role`; returns
    /// the incarnation the child must attach with.
    pub fn claim(&self, slot: u16, role: Role, now_ms: u64) -> u32 {
        let s = &self.slots[usize::from(slot)];
        let old = s.state.load(Ordering::Acquire);
        let incarnation = ((old >> 32) as u32).wrapping_add(1);
        if state_of(old) != ProcessState::Free {
            s.restarts.fetch_add(1, Ordering::Relaxed);
        }
        s.pid.store(0, Ordering::Relaxed);
        s.tuned.store(0, Ordering::Relaxed);
        s.revision.store(0, Ordering::Relaxed);
        s.started_ms.store(now_ms, Ordering::Relaxed);
        s.heartbeat_ms.store(now_ms, Ordering::Relaxed);
        s.state
            .store(word(incarnation, role, ProcessState::Starting), Ordering::Release);
        incarnation
    }

    fn transition(&self, slot: u16, incarnation: u32, from: &[ProcessState], to: ProcessState) -> bool {
        let s = &self.slots[usize::from(slot)];
        let w = s.state.load(Ordering::Acquire);
        let Some(role) = role_of(w) else { return false };
        if (w >> 32) as u32 != incarnation || !from.contains(&state_of(w)) {
            return false;
        }
        s.state
            .compare_exchange(w, word(incarnation, role, to), Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Called by the child: records its pid and marks it running.
    pub fn attach(&self, slot: u16, incarnation: u32, pid: u32, now_ms: u64) -> bool {
        let s = &self.slots[usize::from(slot)];
        let w = s.state.load(Ordering::Acquire);
        if (w >> 32) as u32 != incarnation || state_of(w) != ProcessState::Starting {
            return false;
        }
        s.pid.store(u64::from(pid), Ordering::Relaxed);
        s.heartbeat_ms.store(now_ms, Ordering::Relaxed);
        self.transition(slot, incarnation, &[ProcessState::Starting], ProcessState::Running)
    }

    /// Called by the child periodically. False if the slot moved on.
    pub fn heartbeat(&self, slot: u16, incarnation: u32, now_ms: u64) -> bool {
        let s = &self.slots[usize::from(slot)];
        if (s.state.load(Ordering::Acquire) >> 32) as u32 != incarnation {
            return false;
        }
        s.heartbeat_ms.fetch_max(now_ms, Ordering::Relaxed);
        true
    }

    /// Called by the child: publishes the value it tunes online (see
    /// [`ProcessInfo::tuned`]). False if the slot moved on. A value that is
    /// not finite, or 0, reads back as none.
    pub fn publish_tuned(&self, slot: u16, incarnation: u32, value: f64) -> bool {
        let Some(s) = self.slots.get(usize::from(slot)) else {
            return false;
        };
        if (s.state.load(Ordering::Acquire) >> 32) as u32 != incarnation {
            return false;
        }
        let bits = if value.is_finite() { value.to_bits() } else { 0 };
        s.tuned.store(bits, Ordering::Relaxed);
        true
    }

    /// Publishes the configuration revision the process in `slot` runs
    /// (see the module docs; a revision only grows, so a late, smaller one
    /// is ignored). False if the slot moved on.
    pub fn publish_revision(&self, slot: u16, incarnation: u32, revision: u64) -> bool {
        let Some(s) = self.slots.get(usize::from(slot)) else {
            return false;
        };
        if (s.state.load(Ordering::Acquire) >> 32) as u32 != incarnation {
            return false;
        }
        s.revision.fetch_max(revision, Ordering::AcqRel);
        true
    }

    /// Called by the supervisor once the child is reaped.
    pub fn mark_exited(&self, slot: u16, incarnation: u32) -> bool {
        self.transition(
            slot,
            incarnation,
            &[ProcessState::Starting, ProcessState::Running],
            ProcessState::Exited,
        )
    }

    /// Whether that incarnation is starting or running (false for a slot
    /// beyond the registry, as a corrupt owner word may name).
    pub fn is_alive(&self, slot: u16, incarnation: u32) -> bool {
        self.get(slot).is_some_and(|i| {
            i.incarnation == incarnation && matches!(i.state, ProcessState::Starting | ProcessState::Running)
        })
    }

    /// A copy of `slot`, `None` beyond the registry.
    pub fn get(&self, slot: u16) -> Option<ProcessInfo> {
        let s = self.slots.get(usize::from(slot))?;
        let w = s.state.load(Ordering::Acquire);
        Some(ProcessInfo {
            slot,
            incarnation: (w >> 32) as u32,
            role: role_of(w),
            state: state_of(w),
            pid: s.pid.load(Ordering::Relaxed) as u32,
            heartbeat_ms: s.heartbeat_ms.load(Ordering::Relaxed),
            started_ms: s.started_ms.load(Ordering::Relaxed),
            restarts: s.restarts.load(Ordering::Relaxed),
            tuned: Some(f64::from_bits(s.tuned.load(Ordering::Relaxed))).filter(|v| *v != 0.0 && v.is_finite()),
            revision: s.revision.load(Ordering::Acquire),
        })
    }

    /// Every slot that was ever used.
    pub fn processes(&self) -> impl Iterator<Item = ProcessInfo> + '_ {
        (0..self.slots.len() as u16)
            .filter_map(|i| self.get(i))
            .filter(|p| p.state != ProcessState::Free)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn life_cycle_and_stale_incarnations() {
        let slots: Vec<ProcessSlot> = (0..4).map(|_| ProcessSlot::new()).collect();
        let r = Registry::new(&slots);
        let slot = r.find_free().unwrap();
        let inc = r.claim(slot, Role::Dispatcher, 10);
        assert!(r.is_alive(slot, inc));
        assert!(r.attach(slot, inc, 4242, 11));
        assert!(r.heartbeat(slot, inc, 20));
        assert_eq!(r.get(slot).unwrap().tuned, None);
        assert!(r.publish_tuned(slot, inc, 0.75));
        assert_eq!(r.get(slot).unwrap().tuned, Some(0.75));
        let info = r.get(slot).unwrap();
        assert_eq!(
            (info.pid, info.state, info.role, info.heartbeat_ms),
            (4242, ProcessState::Running, Some(Role::Dispatcher), 20)
        );
        assert!(r.mark_exited(slot, inc));
        assert!(!r.is_alive(slot, inc));
        let inc2 = r.claim(slot, Role::Dispatcher, 30);
        assert_eq!(inc2, inc + 1);
        assert_eq!(r.get(slot).unwrap().restarts, 1);
        assert_eq!(r.get(slot).unwrap().tuned, None, "a new incarnation publishes its own");
        assert!(!r.publish_tuned(slot, inc, 2.0), "old incarnation ignored");
        assert!(!r.publish_tuned(999, inc2, 2.0));
        assert_eq!(r.get(999), None);
        assert!(!r.is_alive(999, inc2));
        assert!(!r.heartbeat(slot, inc, 40), "old incarnation ignored");
        assert!(!r.attach(slot, inc, 1, 40));
        assert!(!r.mark_exited(slot, inc));
        assert_eq!(r.processes().count(), 1);
    }

    #[test]
    fn revisions_only_grow_and_start_over_with_an_incarnation() {
        let slots: Vec<ProcessSlot> = (0..2).map(|_| ProcessSlot::new()).collect();
        let r = Registry::new(&slots);
        let inc = r.claim(1, Role::Dispatcher, 10);
        assert_eq!(r.get(1).unwrap().revision, 0);
        assert!(r.publish_revision(1, inc, 7));
        assert!(
            r.publish_revision(1, inc, 5),
            "a late, smaller one is taken and ignored"
        );
        assert_eq!(r.get(1).unwrap().revision, 7);
        assert!(!r.publish_revision(1, inc + 1, 9), "another incarnation's");
        assert!(!r.publish_revision(9, inc, 9), "beyond the registry");
        assert_eq!(r.get(1).unwrap().revision, 7);
        let inc2 = r.claim(1, Role::Dispatcher, 20);
        assert_eq!(r.get(1).unwrap().revision, 0, "a new incarnation publishes its own");
        assert!(r.publish_revision(1, inc2, 3));
        assert_eq!(r.get(1).unwrap().revision, 3);
    }
}
