//! A routing policy replaceable while it serves: each model pool's
//! ([`crate::pools`]), swapped by a configuration reload.

use std::sync::{Arc, RwLock};

use super::{Choice, Policy, RouteInput};

/// The routing policy of a dispatcher, replaceable while it serves (a
/// configuration reload). Choosing takes an uncontended read lock (one
/// atomic operation); a replacement waits for the choices in progress, and
/// the next choice uses the new policy.
#[derive(Debug)]
pub struct SwappablePolicy(RwLock<Arc<dyn Policy>>);

impl SwappablePolicy {
    /// Starts with `policy`.
    pub fn new(policy: Box<dyn Policy>) -> Self {
        Self(RwLock::new(Arc::from(policy)))
    }

    /// Starts with a policy already in use (a pool rebuilt by a reload
    /// keeps its policy, with what it learned).
    pub fn from_arc(policy: Arc<dyn Policy>) -> Self {
        Self(RwLock::new(policy))
    }

    /// The current policy's choice (see [`Policy::choose`]).
    pub fn choose(&self, input: &RouteInput<'_>) -> Option<Choice> {
        self.current().choose(input)
    }

    /// Tells the current policy what a request it routed with `arm` saw
    /// ([`Policy::observe`]); returns the value it now publishes
    /// ([`Policy::tuned_weight`]).
    pub fn observe(&self, arm: u8, ttft_us: u32) -> Option<f64> {
        let policy = self.current();
        policy.observe(arm, ttft_us);
        policy.tuned_weight()
    }

    /// The value the current policy publishes ([`Policy::tuned_weight`]).
    pub fn tuned_weight(&self) -> Option<f64> {
        self.current().tuned_weight()
    }

    /// The current policy's name.
    pub fn name(&self) -> &'static str {
        self.current().name()
    }

    /// The current policy itself (held by the gateway queue's pump for one
    /// look at the queue).
    pub fn current_arc(&self) -> Arc<dyn Policy> {
        self.current().clone()
    }

    /// Replaces the policy; the next choice uses `policy`.
    pub fn replace(&self, policy: Box<dyn Policy>) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = Arc::from(policy);
    }

    fn current(&self) -> std::sync::RwLockReadGuard<'_, Arc<dyn Policy>> {
        // A panic while holding the lock leaves a valid policy behind.
        self.0.read().unwrap_or_else(|e| e.into_inner())
    }
}
