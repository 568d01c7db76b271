//! Shared set-up for the criterion benches of the tables: a uniquely named
//! shm segment that is removed on drop, deterministic keys and chains, and
//! table population.

use shm_layout::{LayoutPlan, Segment, ServerRef, Stamp};

/// A shm segment removed when dropped.
pub struct BenchSegment {
    /// The segment.
    pub segment: Segment,
}

impl BenchSegment {
    /// Creates `semlb-bench-<tag>-<pid>` of `bytes` (a leftover of that
    /// name is removed first).
    pub fn create(tag: &str, bytes: u64) -> Self {
        let name = format!("semlb-bench-{tag}-{}", std::process::id());
        let _ = Segment::remove(&name);
        let plan = LayoutPlan::for_size(bytes).expect("bench plan");
        Self {
            segment: Segment::create(&name, &plan).expect("create bench segment"),
        }
    }
}

impl Drop for BenchSegment {
    fn drop(&mut self) {
        if let Some(name) = self.segment.name() {
            let _ = Segment::remove(name);
        }
    }
}

/// Deterministic, well-spread 64-bit keys ([`crate::mix`]).
pub fn key(i: u64) -> u64 {
    crate::mix(i)
}

/// A chain of `len` block hashes for conversation `c`.
pub fn chain(c: u64, len: usize) -> Vec<u64> {
    (0..len as u64).map(|b| key(c << 16 | b)).collect()
}

/// Registers `n` servers and returns them.
pub fn servers(segment: &Segment, n: usize) -> Vec<ServerRef> {
    let t = segment.tables();
    (0..n)
        .map(|i| {
            t.servers
                .register(i as u64, &format!("http://127.0.0.1:{}", 8000 + i), 0)
                .expect("register")
        })
        .collect()
}

/// Inserts `chains` chains of `len` blocks, spread over `servers`.
pub fn populate(segment: &Segment, servers: &[ServerRef], chains: u64, len: usize) {
    let t = segment.tables();
    for c in 0..chains {
        t.prefix
            .insert_chain(&chain(c, len), servers[(c as usize) % servers.len()], Stamp(1));
    }
}

/// Requests in flight to every server of `segment`, as its server table
/// counts them.
pub fn requests_in_flight(segment: &shm_layout::Segment) -> u64 {
    segment.tables().servers.servers().map(|s| s.inflight_requests).sum()
}
