//! The servers a request may go to: its model pool's, by
//! [`crate::store::server_id`] (every server for the implicit pool and for
//! requests without a model).

use std::sync::Arc;

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
