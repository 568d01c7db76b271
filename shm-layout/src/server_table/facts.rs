//! What is known of one registration beyond its address and state, each
//! in a slot word tagged with the registration's generation
//! (`generation:32 | value:32`, value 0: nothing known), so that a value
//! dies with its registration and a write never lands on a slot
//! re-registered in between (every setter is a compare-and-swap that
//! checks the registration is still current):
//!
//! | word | value | written by |
//! | --- | --- | --- |
//! | horizon | segment second + 1 | response processes, when an engine evicted ([`ServerTable::raise_horizon`]) |
//! | admission | `f32` bits of the learned admission limit | response processes ([`ServerTable::adjust_admission_limit`]) |
//! | engine slots | requests the engine runs at once | the health checker, from llama.cpp's `/props` ([`ServerTable::set_engine_slots`]) |
//! | engine context | `counts_output:1 \| tokens:31` ([`EngineContext`]) | the health checker, from `/v1/models` (`max_model_len`) or llama.cpp's `/props` ([`ServerTable::set_engine_context`]) |
//! | KV events | [`KvEventsSync`] | the response process subscribed to the engine's KV cache events ([`ServerTable::set_kv_events`]) |

use super::{HORIZON_SPAN_S, ServerRef, ServerSlot, ServerTable, ServerTag};
use crate::sync::{AtomicU64, Ordering};

/// The admission limit an admission word holds for registration
/// `generation`, if any (`generation:32 | f32 bits:32`, 0 bits: none).
fn admission_of(word: u64, generation: u32) -> Option<f32> {
    tagged(word, generation).map(f32::from_bits).filter(|l| l.is_finite())
}

/// The tokens an engine takes per request: its context length, and
/// whether the output requested counts against it.
///
/// Stored as `counts_output:1 | tokens:31` in the engine-context word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineContext {
    /// Tokens of one request's context (at least 1, below 2^31).
    pub tokens: u32,
    /// Whether prompt **plus requested output** must fit (vLLM's and
    /// SGLang's `max_model_len`), or the prompt alone, leaving room for a
    /// token (llama.cpp's slot context: it stops generating at the end).
    pub counts_output: bool,
}

impl EngineContext {
    /// The largest context stored.
    pub const MAX_TOKENS: u32 = (1 << 31) - 1;

    fn pack(self) -> u32 {
        self.tokens.min(Self::MAX_TOKENS) | (u32::from(self.counts_output) << 31)
    }

    fn unpack(v: u32) -> Option<Self> {
        let tokens = v & Self::MAX_TOKENS;
        (tokens > 0).then_some(Self {
            tokens,
            counts_output: v >> 31 == 1,
        })
    }
}

/// How far the confirmed prefix table follows one engine's KV cache
/// events (stored in the KV-events word: 1 or 2; 0 is "no events").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvEventsSync {
    /// Every event since a state the subscriber knew (the engine's start,
    /// or a cache cleared) has been applied: the confirmed entries are the
    /// engine's cache, so lookups may trust them alone.
    Complete,
    /// Events were lost (a gap the engine could not replay, a subscriber
    /// that joined late): the confirmed entries are a part of the engine's
    /// cache, so lookups add them to the gateway's estimate.
    Partial,
}

impl KvEventsSync {
    /// Lower-case name, as `semlb status` and `/admin/servers` print it.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Complete => "complete",
            Self::Partial => "partial",
        }
    }

    fn pack(self) -> u32 {
        match self {
            Self::Complete => 1,
            Self::Partial => 2,
        }
    }

    fn unpack(v: u32) -> Option<Self> {
        match v {
            1 => Some(Self::Complete),
            2 => Some(Self::Partial),
            _ => None,
        }
    }
}

/// The value of a slot word tagged with its registration
/// (`generation:32 | value:32`, value 0: none) for `generation`.
pub(super) fn tagged(word: u64, generation: u32) -> Option<u32> {
    (word >> 32 == u64::from(generation) && word as u32 != 0).then_some(word as u32)
}

impl ServerTable<'_> {
    /// Sets `server`'s **horizon** to segment second `at_s`: its engine
    /// was seen to have evicted a prefix the server last refreshed then, so
    /// (engines evict least recently used blocks first) its prefix entries
    /// refreshed before it are presumed gone too, and lookups set them
    /// aside ([`entry_max_age`](Self::entry_max_age)). A horizon only moves
    /// forward, and belongs to one registration. Returns whether it moved
    /// (false if `server` is not current or its horizon is already later).
    pub fn raise_horizon(&self, server: ServerRef, at_s: u32) -> bool {
        let Some(s) = self.slots.get(usize::from(server.slot)) else {
            return false;
        };
        let word = (u64::from(server.generation) << 32) | u64::from(at_s.saturating_add(1));
        let mut current = s.horizon.load(Ordering::Acquire);
        loop {
            if !self.current(server.slot).is_some_and(|(r, _)| r == server) {
                return false;
            }
            if current >> 32 == u64::from(server.generation) && current as u32 >= word as u32 {
                return false;
            }
            match s
                .horizon
                .compare_exchange_weak(current, word, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return true,
                Err(now) => current = now,
            }
        }
    }

    /// The segment second of `server`'s horizon, if it has one.
    pub fn horizon(&self, server: ServerRef) -> Option<u32> {
        let word = self
            .slots
            .get(usize::from(server.slot))?
            .horizon
            .load(Ordering::Acquire);
        tagged(word, server.generation).map(|at| at - 1)
    }

    /// `server`'s learned admission limit, if one was learned for this
    /// registration ([`adjust_admission_limit`](Self::adjust_admission_limit)).
    #[inline]
    pub fn admission_limit(&self, server: ServerRef) -> Option<f32> {
        let word = self
            .slots
            .get(usize::from(server.slot))?
            .admission
            .load(Ordering::Relaxed);
        admission_of(word, server.generation)
    }

    /// Sets `server`'s admission limit to `adjust(current)` (`None`: none
    /// learned yet for this registration), atomically against other
    /// processes adjusting it: `adjust` may run more than once. A
    /// non-finite or non-positive result is not stored. Returns the limit
    /// stored, or `None` (nothing stored) if `server` is not current.
    pub fn adjust_admission_limit(&self, server: ServerRef, mut adjust: impl FnMut(Option<f32>) -> f32) -> Option<f32> {
        let s = self.slots.get(usize::from(server.slot))?;
        let mut current = s.admission.load(Ordering::Acquire);
        loop {
            if !self.is_current(server) {
                return None;
            }
            let old = admission_of(current, server.generation);
            let new = adjust(old);
            if !(new.is_finite() && new > 0.0) {
                return old;
            }
            let word = (u64::from(server.generation) << 32) | u64::from(new.to_bits());
            match s
                .admission
                .compare_exchange_weak(current, word, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Some(new),
                Err(now) => current = now,
            }
        }
    }

    /// Records that `server`'s engine runs at most `slots` requests at once
    /// (`None` or 0: it does not say), as its engine reported it. Returns
    /// false (nothing stored) if `server` is not current.
    pub fn set_engine_slots(&self, server: ServerRef, slots: Option<u32>) -> bool {
        self.set_reported(server, |s| &s.engine_slots, slots)
    }

    /// The requests `server`'s engine says it runs at once, if it said
    /// for this registration ([`set_engine_slots`](Self::set_engine_slots)).
    #[inline]
    pub fn engine_slots(&self, server: ServerRef) -> Option<u32> {
        self.reported(server, |s| &s.engine_slots)
    }

    /// Records how many tokens `server`'s engine takes per request (`None`:
    /// it does not say), as its engine reported it. Returns false (nothing
    /// stored) if `server` is not current.
    pub fn set_engine_context(&self, server: ServerRef, context: Option<EngineContext>) -> bool {
        self.set_reported(server, |s| &s.engine_context, context.map(EngineContext::pack))
    }

    /// How many tokens `server`'s engine takes per request, if it said for
    /// this registration ([`set_engine_context`](Self::set_engine_context)).
    #[inline]
    pub fn engine_context(&self, server: ServerRef) -> Option<EngineContext> {
        self.reported(server, |s| &s.engine_context)
            .and_then(EngineContext::unpack)
    }

    /// Records how far the confirmed prefix table follows `server`'s
    /// engine's KV cache events (`None`: not at all, e.g. its subscriber
    /// stopped). Returns false (nothing stored) if `server` is not current.
    pub fn set_kv_events(&self, server: ServerRef, sync: Option<KvEventsSync>) -> bool {
        self.set_reported(server, |s| &s.kv_events, sync.map(KvEventsSync::pack))
    }

    /// How far the confirmed prefix table follows `server`'s engine, if its
    /// events are subscribed to ([`set_kv_events`](Self::set_kv_events)).
    #[inline]
    pub fn kv_events(&self, server: ServerRef) -> Option<KvEventsSync> {
        self.reported(server, |s| &s.kv_events).and_then(KvEventsSync::unpack)
    }

    /// [`kv_events`](Self::kv_events) of the live registration `tag` names
    /// (`None` also when it is not live).
    #[inline]
    pub fn kv_events_of(&self, tag: ServerTag) -> Option<KvEventsSync> {
        self.kv_events(self.live(tag)?)
    }

    /// Stores `value` (`None`: 0, nothing) in `server`'s word `word`, if
    /// the registration is current.
    pub(super) fn set_reported(
        &self,
        server: ServerRef,
        word: fn(&ServerSlot) -> &AtomicU64,
        value: Option<u32>,
    ) -> bool {
        let Some(s) = self.slots.get(usize::from(server.slot)) else {
            return false;
        };
        let new = (u64::from(server.generation) << 32) | u64::from(value.unwrap_or(0));
        let mut current = word(s).load(Ordering::Acquire);
        loop {
            if !self.is_current(server) {
                return false;
            }
            match word(s).compare_exchange_weak(current, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(now) => current = now,
            }
        }
    }

    /// The value of `server`'s word `word`, if set for this registration.
    #[inline]
    pub(super) fn reported(&self, server: ServerRef, word: fn(&ServerSlot) -> &AtomicU64) -> Option<u32> {
        let w = word(self.slots.get(usize::from(server.slot))?).load(Ordering::Relaxed);
        tagged(w, server.generation)
    }

    /// The filter for [`crate::PrefixTable::longest_prefix_match_within`]
    /// at segment second `now_s`: `None` unless the tagged server is live
    /// ([`is_live`](Self::is_live)); else how old (in seconds) its entries
    /// may be: up to its horizon, or any age (`u16::MAX`) without one or
    /// when the horizon is older than [`HORIZON_SPAN_S`].
    #[inline]
    pub fn entry_max_age(&self, tag: ServerTag, now_s: u64) -> Option<u16> {
        let server = self.live(tag)?;
        let age = self
            .horizon(server)
            .map(|h| now_s.saturating_sub(u64::from(h)))
            .filter(|age| *age <= HORIZON_SPAN_S);
        Some(age.map_or(u16::MAX, |a| a as u16))
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::super::tests::parts;
    use super::super::*;

    #[test]
    fn a_horizon_moves_forward_bounds_entry_ages_and_dies_with_its_registration() {
        let (s, l) = parts();
        let t = ServerTable::new(&s, &l, 1);
        let a = t.register(11, "http://a", 0).unwrap();
        assert_eq!(t.entry_max_age(a.tag(), 100), Some(u16::MAX), "no horizon: any age");
        assert!(t.raise_horizon(a, 40));
        assert_eq!(t.horizon(a), Some(40));
        assert_eq!(t.entry_max_age(a.tag(), 100), Some(60));
        assert!(!t.raise_horizon(a, 30), "an older horizon is already covered");
        assert_eq!(t.horizon(a), Some(40));
        assert!(!t.raise_horizon(a, 0) && t.raise_horizon(a, 90));
        assert_eq!(t.entry_max_age(a.tag(), 100), Some(10));
        // Past its span a horizon no longer applies (stamps would wrap).
        assert_eq!(t.entry_max_age(a.tag(), 90 + HORIZON_SPAN_S + 1), Some(u16::MAX));
        assert!(t.set_state(a, ServerState::Down));
        assert_eq!(t.entry_max_age(a.tag(), 100), None, "not live");
        assert!(t.retire(a));
        assert!(!t.raise_horizon(a, 200), "not current");
        let a2 = t.register(12, "http://a2", 0).unwrap();
        assert_eq!(a2.slot, a.slot);
        assert_eq!(t.horizon(a2), None, "a new registration starts without one");
        assert_eq!(t.entry_max_age(a2.tag(), 100), Some(u16::MAX));
    }

    #[test]
    fn an_admission_limit_is_adjusted_atomically_and_dies_with_its_registration() {
        let (s, l) = parts();
        let t = ServerTable::new(&s, &l, 1);
        let a = t.register(11, "http://a", 0).unwrap();
        assert_eq!(t.admission_limit(a), None, "nothing learned yet");
        assert_eq!(t.adjust_admission_limit(a, |old| old.unwrap_or(8.0) + 1.0), Some(9.0));
        assert_eq!(t.adjust_admission_limit(a, |old| old.unwrap() * 0.5), Some(4.5));
        assert_eq!(t.admission_limit(a), Some(4.5));
        assert_eq!(t.get(a.slot).unwrap().admission_limit, Some(4.5));
        assert_eq!(t.adjust_admission_limit(a, |_| f32::NAN), Some(4.5), "refused, kept");
        assert_eq!(t.adjust_admission_limit(a, |_| 0.0), Some(4.5), "refused, kept");
        assert!(t.retire(a));
        assert_eq!(t.adjust_admission_limit(a, |_| 3.0), None, "not current");
        let a2 = t.register(12, "http://a2", 0).unwrap();
        assert_eq!(a2.slot, a.slot);
        assert_eq!(t.admission_limit(a2), None, "a new registration starts without one");
    }

    #[test]
    fn engine_slots_are_set_cleared_and_die_with_their_registration() {
        let (s, l) = parts();
        let t = ServerTable::new(&s, &l, 1);
        let a = t.register(11, "http://a", 0).unwrap();
        let b = t.register(12, "http://b", 0).unwrap();
        assert_eq!(t.engine_slots(a), None, "not said yet");
        assert!(t.set_engine_slots(a, Some(2)));
        assert_eq!(t.engine_slots(a), Some(2));
        assert_eq!(t.engine_slots(b), None, "per server");
        assert_eq!(t.get(a.slot).unwrap().engine_slots, Some(2));
        assert!(t.set_engine_slots(a, Some(4)), "an engine restarted with more");
        assert_eq!(t.engine_slots(a), Some(4));
        assert!(t.set_engine_slots(a, None));
        assert_eq!(t.engine_slots(a), None, "cleared");
        assert!(t.set_engine_slots(a, Some(3)));
        assert!(t.retire(a));
        assert!(!t.set_engine_slots(a, Some(5)), "not current");
        let a2 = t.register(13, "http://a2", 0).unwrap();
        assert_eq!(a2.slot, a.slot);
        assert_eq!(t.engine_slots(a2), None, "a new registration starts without them");
    }

    #[test]
    fn kv_events_sync_is_per_registration() {
        let (s, l) = parts();
        let t = ServerTable::new(&s, &l, 1);
        let a = t.register(11, "http://a", 0).unwrap();
        let b = t.register(12, "http://b", 0).unwrap();
        assert_eq!(t.kv_events(a), None, "no events until a subscriber says");
        assert!(t.set_kv_events(a, Some(KvEventsSync::Complete)));
        assert_eq!((t.kv_events(a), t.kv_events(b)), (Some(KvEventsSync::Complete), None));
        assert!(t.set_kv_events(a, Some(KvEventsSync::Partial)));
        assert_eq!(t.get(a.slot).unwrap().kv_events, Some(KvEventsSync::Partial));
        assert!(t.set_kv_events(a, None));
        assert_eq!(t.kv_events(a), None);
        assert!(t.set_kv_events(a, Some(KvEventsSync::Complete)) && t.retire(a));
        assert!(!t.set_kv_events(a, Some(KvEventsSync::Complete)), "not current");
        let a2 = t.register(13, "http://a2", 0).unwrap();
        assert_eq!(
            (a2.slot, t.kv_events(a2)),
            (a.slot, None),
            "a new registration starts unsubscribed"
        );
    }

    #[test]
    fn engine_context_is_its_own_word_and_dies_with_its_registration() {
        let (s, l) = parts();
        let t = ServerTable::new(&s, &l, 1);
        let a = t.register(11, "http://a", 0).unwrap();
        assert_eq!(t.engine_context(a), None, "not said yet");
        let llama = EngineContext {
            tokens: 4096,
            counts_output: false,
        };
        assert!(t.set_engine_context(a, Some(llama)) && t.set_engine_slots(a, Some(2)));
        assert_eq!((t.engine_context(a), t.engine_slots(a)), (Some(llama), Some(2)));
        assert_eq!(t.get(a.slot).unwrap().engine_context, Some(llama));
        assert!(t.set_engine_context(a, None));
        assert_eq!((t.engine_context(a), t.engine_slots(a)), (None, Some(2)));
        let vllm = EngineContext {
            tokens: EngineContext::MAX_TOKENS,
            counts_output: true,
        };
        assert!(t.set_engine_context(a, Some(vllm)));
        assert_eq!(
            t.engine_context(a),
            Some(vllm),
            "the flag and 31 bits of tokens round-trip"
        );
        assert!(t.retire(a));
        assert!(!t.set_engine_context(a, Some(llama)), "not current");
        let a2 = t.register(13, "http://a2", 0).unwrap();
        assert_eq!(a2.slot, a.slot);
        assert_eq!(t.engine_context(a2), None, "a new registration starts without it");
    }
}
