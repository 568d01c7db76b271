//! The servers a request may go to: its model pool's, by
//! [`crate::store::server_id`] (every server for the implicit pool and for
//! requests without a model), of the role its part of the work needs
//! ([`Leg`]: a prefill engine of a disaggregated fleet takes prefill legs,
//! never a request of its own).

use std::sync::Arc;

use shm_layout::ServerRole;

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

/// The servers of a pool, by [`crate::store::server_id`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Members(Option<Arc<[u64]>>);

/// [`Members::every`], for borrowing.
static EVERY: Members = Members(None);

impl Members {
    /// Every server (the implicit pool).
    pub fn every() -> Self {
        Self(None)
    }

    /// Every server, borrowed for as long as needed.
    pub fn all() -> &'static Self {
        &EVERY
    }

    /// The servers with these ids.
    pub fn of(ids: impl IntoIterator<Item = u64>) -> Self {
        Self(Some(ids.into_iter().collect()))
    }

    /// Whether the server with id `id` (`None`: not readable) serves it.
    pub fn admits(&self, id: Option<u64>) -> bool {
        match &self.0 {
            None => true,
            Some(ids) => id.is_some_and(|id| ids.contains(&id)),
        }
    }

    /// Whether this is every server.
    pub fn is_every(&self) -> bool {
        self.0.is_none()
    }
}
