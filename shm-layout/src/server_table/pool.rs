//! A registration's model pool, for the servers that no `[[model]]` pool
//! lists: those found by discovery (a Kubernetes pod labelled with its
//! model, an endpoints file's `model`), whose addresses come and go.
//!
//! A pool admits a server when it lists the server's id, or when the
//! server's registration carries the pool's [`PoolTag`] (32 bits of a hash
//! of the pool's name). The tag is stored in the slot's pool word like the
//! other facts of a registration (`generation:32 | tag:32`, tag 0: none),
//! written while the slot is `Configuring` by
//! [`ServerTable::register_in`], so no request sees the registration
//! outside its pool, and changed later with [`ServerTable::set_pool`].
//! Routing reads it with the id ([`ServerTable::membership`]).

use super::facts::tagged;
use super::{ServerRef, ServerTable};
use crate::sync::Ordering;

/// A model pool, as a registration names it: 32 bits of the hash of the
/// pool's name, never 0 ([`PoolTag::NONE`] is no pool).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PoolTag(pub(crate) u32);

impl PoolTag {
    /// No pool: a server pools list by id, or that serves the implicit pool.
    pub const NONE: Self = Self(0);

    /// The tag of the pool named `name` (its `[[model]]` name, not an
    /// alias). Two pools of a gateway share a tag with probability about
    /// 2^-32 per pair.
    pub fn of(name: &str) -> Self {
        let h = xxhash_rust::xxh3::xxh3_64(name.as_bytes());
        Self(((h >> 32) as u32 ^ h as u32).max(1))
    }

    /// Whether this is no pool.
    pub const fn is_none(self) -> bool {
        self.0 == 0
    }
}

/// Who a registration is, for a pool's membership test: its id and its
/// pool tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemberKey {
    /// The operator-facing id ([`ServerTable::id_of`]).
    pub id: u64,
    /// The pool its registration names, or [`PoolTag::NONE`].
    pub pool: PoolTag,
}

impl ServerTable<'_> {
    /// Puts `server` in pool `pool` (`NONE`: none). Returns false (nothing
    /// stored) if `server` is not current.
    pub fn set_pool(&self, server: ServerRef, pool: PoolTag) -> bool {
        self.set_reported(server, |s| &s.pool, Some(pool.0))
    }

    /// The pool `server`'s registration names ([`PoolTag::NONE`] if none).
    #[inline]
    pub fn pool_of(&self, server: ServerRef) -> PoolTag {
        self.reported(server, |s| &s.pool).map_or(PoolTag::NONE, PoolTag)
    }

    /// The id and pool of `slot`'s current registration (any state but
    /// free or being configured), read consistently.
    pub fn membership(&self, slot: u16) -> Option<MemberKey> {
        let (server, _) = self.current(slot)?;
        let s = &self.slots[usize::from(slot)];
        let id = s.id.load(Ordering::Acquire);
        let pool = tagged(s.pool.load(Ordering::Acquire), server.generation).map_or(PoolTag::NONE, PoolTag);
        // The registration must still be the one both were read for.
        self.is_current(server).then_some(MemberKey { id, pool })
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::super::tests::parts;
    use super::super::{Disaggregation, ServerState};
    use super::*;

    #[test]
    fn a_pool_belongs_to_its_registration() {
        let (s, l) = parts();
        let t = ServerTable::new(&s, &l, 1);
        let qwen = PoolTag::of("qwen");
        let a = t
            .register_in(
                1,
                "http://a:8000",
                0,
                Disaggregation::default(),
                qwen,
                Default::default(),
            )
            .unwrap();
        assert_eq!(t.pool_of(a), qwen);
        assert_eq!(t.membership(a.slot), Some(MemberKey { id: 1, pool: qwen }));
        let b = t.register(2, "http://b:8000", 0).unwrap();
        assert_eq!(t.pool_of(b), PoolTag::NONE);
        let llama = PoolTag::of("llama");
        assert_ne!(llama, qwen);
        assert!(t.set_pool(b, llama));
        assert_eq!(t.membership(b.slot).unwrap().pool, llama);
        // A draining server is still a member (it finishes its requests).
        assert!(t.set_state(a, ServerState::Draining));
        assert_eq!(t.membership(a.slot).unwrap().pool, qwen);
        // Gone with its registration: the slot's next one is in no pool.
        assert!(t.retire(a));
        assert!(!t.set_pool(a, llama));
        assert_eq!(t.membership(a.slot), None);
        let c = t.register(3, "http://c:8000", 0).unwrap();
        assert_eq!(c.slot, a.slot);
        assert_eq!(t.pool_of(c), PoolTag::NONE);
        assert_eq!(t.pool_of(a), PoolTag::NONE);
    }

    #[test]
    fn tags_are_never_none() {
        for name in ["", "a", "qwen", "meta-llama/Llama-3.1-8B-Instruct"] {
            assert!(!PoolTag::of(name).is_none());
            assert_eq!(PoolTag::of(name), PoolTag::of(name));
        }
    }
}
