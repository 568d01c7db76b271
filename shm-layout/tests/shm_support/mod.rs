//! Helpers shared by the integration tests of `shm-layout`: unique shm
//! names, a guard that removes a segment even when the test panics, and
//! [`both`], which runs one test body against a heap segment and a real
//! POSIX shm segment.

#![allow(dead_code)] // each test crate uses a different subset

use std::sync::atomic::{AtomicU32, Ordering};

use shm_layout::{LayoutPlan, RemoveError, Segment};

/// The smallest segment: 16 KiB rings, a ~3 MiB response log, ~216 K prefix slots.
pub const SMALL: u64 = 8 << 20;

/// The layout of the smallest segment.
pub fn small_plan() -> LayoutPlan {
    LayoutPlan::for_size(SMALL).expect("8 MiB is a valid size")
}

/// A shm name no other test (in this or any other process) uses:
/// `semlb-t-<pid>-<test>-<counter>`.
pub fn unique_name(test: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("semlb-t-{}-{test}-{n}", std::process::id())
}

/// `/dev/shm/<name>`: where Linux keeps the object `name`.
pub fn dev_shm_path(name: &str) -> std::path::PathBuf {
    std::path::Path::new("/dev/shm").join(name)
}

/// Removes the shm object `name` when dropped (also during a panic), so a
/// failing test leaves nothing behind in /dev/shm.
#[derive(Debug)]
pub struct ShmGuard {
    pub name: String,
}

impl ShmGuard {
    /// A guard for a fresh unique name (nothing is created yet).
    pub fn new(test: &str) -> Self {
        Self {
            name: unique_name(test),
        }
    }
}

impl Drop for ShmGuard {
    fn drop(&mut self) {
        match Segment::remove(&self.name) {
            Ok(()) | Err(RemoveError::NotFound { .. }) => {}
            Err(e) => eprintln!("could not remove test segment {}: {e}", self.name),
        }
    }
}

/// Creates a real shm segment with a unique name; the guard removes it.
pub fn create_shm(test: &str, plan: &LayoutPlan) -> (ShmGuard, Segment) {
    let guard = ShmGuard::new(test);
    let seg = Segment::create(&guard.name, plan).unwrap_or_else(|e| panic!("create {}: {e}", guard.name));
    (guard, seg)
}

/// Runs `body` once against a heap segment and once against a real shm
/// segment of the same plan (removed afterwards, even if `body` panics).
/// `seg.name()` tells the body (and its failure messages) which one it got.
pub fn both(test: &str, plan: &LayoutPlan, body: impl Fn(&Segment)) {
    let heap = Segment::heap(plan);
    body(&heap);
    drop(heap);
    let (_guard, shm) = create_shm(test, plan);
    body(&shm);
}

/// Which backing a segment is, for assertion messages.
pub fn backing(seg: &Segment) -> &'static str {
    if seg.name().is_some() { "shm" } else { "heap" }
}
