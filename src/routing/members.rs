//! The servers a request may go to: its model pool's, by
//! [`crate::store::server_id`] or, for servers found by discovery, by the
//! pool their registration names ([`PoolTag`]) (every server for the
//! implicit pool and for requests without a model), of the role its part of the work needs
//! ([`Leg`]: a prefill engine of a disaggregated fleet takes prefill legs,
//! never a request of its own).

use std::sync::Arc;

use shm_layout::{MemberKey, PoolTag, ServerRole};

/// Which part of a request a server is chosen for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Leg {
    /// The request itself, or its decode leg: servers that decode.
    #[default]
    Request,
    /// The prefill leg of a split request: servers that prefill.
    Prefill,
    /// The request served whole by an aggregated server (role `both`):
    /// an SGLang P/D pool's request that cannot be split (an SGLang
    /// decode engine has no prefill of its own).
    Whole,
}

impl Leg {
    /// Whether a server of `role` takes this part.
    pub const fn admits(self, role: ServerRole) -> bool {
        match self {
            Self::Request => role.decodes(),
            Self::Prefill => role.prefills(),
            Self::Whole => matches!(role, ServerRole::Both),
        }
    }
}

/// The servers of a pool: those it lists, by [`crate::store::server_id`],
/// and those registered in it by discovery (their [`PoolTag`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Members {
    /// The ids it lists; `None`: every server (the implicit pool).
    ids: Option<Arc<[u64]>>,
    /// Its tag: a server registered with it is a member too.
    pool: PoolTag,
}

/// [`Members::every`], for borrowing.
static EVERY: Members = Members {
    ids: None,
    pool: PoolTag::NONE,
};

impl Members {
    /// Every server (the implicit pool).
    pub fn every() -> Self {
        Self::default()
    }

    /// Every server, borrowed for as long as needed.
    pub fn all() -> &'static Self {
        &EVERY
    }

    /// The servers with these ids, and those registered in pool `pool`.
    pub fn of(ids: impl IntoIterator<Item = u64>, pool: PoolTag) -> Self {
        Self {
            ids: Some(ids.into_iter().collect()),
            pool,
        }
    }

    /// Whether the server `key` says (`None`: not readable) serves it.
    pub fn admits(&self, key: Option<MemberKey>) -> bool {
        match &self.ids {
            None => true,
            Some(ids) => key.is_some_and(|k| ids.contains(&k.id) || (!k.pool.is_none() && k.pool == self.pool)),
        }
    }

    /// Whether this is every server.
    pub fn is_every(&self) -> bool {
        self.ids.is_none()
    }
}
