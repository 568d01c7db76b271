//! The one place the crate takes its atomics from.
//!
//! Every table is written against these names, so a model checker can be
//! swapped in: under `--cfg loom` they come from `loom` (and 128-bit atomics
//! from a small loom-visible shim), otherwise from `std` and
//! `portable-atomic`. The shared-memory backing itself is not compiled under
//! loom (loom atomics cannot live in an `mmap`ed file); the table code is.

#[cfg(not(loom))]
pub(crate) use portable_atomic::AtomicU128;
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU64, Ordering, fence};

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, Ordering, fence};
#[cfg(loom)]
pub(crate) use loom_u128::AtomicU128;

/// Whether 128-bit atomics are lock-free on this CPU. The tables rely on it:
/// a lock-based fallback would be a per-process lock, meaningless across
/// processes.
#[cfg(not(loom))]
pub(crate) fn u128_is_lock_free() -> bool {
    AtomicU128::is_lock_free()
}

#[cfg(loom)]
mod loom_u128 {
    //! A 128-bit atomic for loom models: one loom mutex makes every
    //! operation indivisible, which is exactly what `cmpxchg16b` gives.
    use super::Ordering;
    use loom::sync::Mutex;

    #[derive(Debug)]
    pub(crate) struct AtomicU128(Mutex<u128>);

    impl AtomicU128 {
        pub(crate) fn new(v: u128) -> Self {
            Self(Mutex::new(v))
        }
        pub(crate) fn load(&self, _: Ordering) -> u128 {
            *self.0.lock().unwrap()
        }
        pub(crate) fn store(&self, v: u128, _: Ordering) {
            *self.0.lock().unwrap() = v;
        }
        pub(crate) fn compare_exchange(
            &self,
            current: u128,
            new: u128,
            _: Ordering,
            _: Ordering,
        ) -> Result<u128, u128> {
            let mut g = self.0.lock().unwrap();
            if *g == current {
                *g = new;
                Ok(current)
            } else {
                Err(*g)
            }
        }
    }
}
