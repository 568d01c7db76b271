//! The shared-memory segment as another process may have left it: a
//! damaged file ([`segment_file`], [`segment_scan`]) and a damaged response
//! cache ([`response_log`]).
//!
//! A segment is 8 MiB at least, and making one per input (as these targets
//! first did: a heap segment, or a file written whole) cost milliseconds,
//! 4 000 and 9 000 inputs a minute. Instead each target makes its image
//! once per process, a real segment left in `/dev/shm`, and keeps a private
//! copy of it open ([`Segment::open_copy`]): an input's damage and the
//! tables' own writes land in pages of the copy, which
//! [`Segment::discard_copy_writes`] throws away after the input. Damage to
//! the header, which [`Segment::open`] must see to validate, is written
//! into the image's file instead, read by a new copy, and written back.
//! The whole-table scans (`semlb shm inspect`, `/metrics`) read megabytes
//! per input, so they are a target of their own, [`segment_scan`].

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use std::sync::{Mutex, PoisonError};

use shm_layout::plan::{HEADER_BYTES, MIN_SEGMENT_BYTES};
use shm_layout::{Completion, CompletionRecord, LayoutPlan, Pop, Region, RegionKind, ResponseKey, Segment, Stamp};

/// A segment image in `/dev/shm`, made once per process and target.
struct Image {
    /// Its shm name.
    name: String,
    /// Its file, open to write damage into.
    file: File,
    /// Its bytes as made, to undo damage with.
    bytes: Vec<u8>,
    /// Its regions, in [`RegionKind::ALL`] order.
    regions: Vec<Region>,
    /// A private copy of it, kept open.
    copy: Segment,
}

impl Image {
    /// The image named `semlb-fuzz-{target}-{pid}`: a new segment of the
    /// smallest size, filled by `fill`.
    fn make(target: &str, fill: impl FnOnce(&Segment)) -> Self {
        let name = image_name(target);
        let _ = Segment::remove(&name);
        let plan = LayoutPlan::for_size(MIN_SEGMENT_BYTES).expect("plan");
        let segment = Segment::create(&name, &plan).expect("create the fuzz image segment");
        fill(&segment);
        let bytes: Vec<u8> = segment
            .raw_words()
            .iter()
            .flat_map(|w| w.load(Ordering::Relaxed).to_le_bytes())
            .collect();
        let regions = RegionKind::ALL.iter().map(|k| segment.header().region(*k)).collect();
        drop(segment);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(format!("/dev/shm/{name}"))
            .expect("open the fuzz image's file");
        let copy = Segment::open_copy(&name).expect("open a copy of the fuzz image");
        Self {
            name,
            file,
            bytes,
            regions,
            copy,
        }
    }

    /// Where the overwrites of `ops` (`region:1 offset:4 len:1 bytes`, a
    /// region index past the last is the header page) land, and what they
    /// write.
    fn overwrites<'a>(&self, mut ops: &'a [u8]) -> Vec<(usize, &'a [u8])> {
        let (len, regions) = (self.bytes.len(), &self.regions);
        let mut out = Vec::new();
        while ops.len() >= 6 {
            let offset = u64::from(u32::from_le_bytes(ops[1..5].try_into().expect("4 bytes")));
            let n = usize::from(ops[5]).min(ops.len() - 6);
            let at = match regions.get(usize::from(ops[0]) % (regions.len() + 1)) {
                Some(region) => (region.offset + offset % region.bytes.max(1)) as usize,
                None => (offset % HEADER_BYTES) as usize,
            }
            .min(len);
            out.push((at, &ops[6..6 + n.min(len - at)]));
            ops = &ops[6 + n..];
        }
        out
    }

    /// Runs `read` on the image with the overwrites of `ops`: in the kept
    /// copy, or (when one reaches the header) in the file, opened anew.
    fn damaged(&self, ops: &[u8], read: impl FnOnce(&Segment)) {
        let writes = self.overwrites(ops);
        if writes.iter().all(|(at, _)| *at >= HEADER_BYTES as usize) {
            let _discard = Discard(&self.copy);
            for (at, bytes) in writes {
                poke(&self.copy, at, bytes);
            }
            read(&self.copy);
            return;
        }
        let mut damage = Damage {
            image: self,
            spans: Vec::new(),
        };
        for (at, bytes) in writes.into_iter().filter(|(_, b)| !b.is_empty()) {
            self.file.write_at(bytes, at as u64).expect("write into the fuzz image");
            damage.spans.push((at, bytes.len()));
        }
        if let Ok(segment) = Segment::open_copy(&self.name) {
            read(&segment);
        }
    }
}

/// Discards the writes to a kept copy when dropped (also when a read
/// panics, so the next input finds the image as made).
struct Discard<'a>(&'a Segment);

impl Drop for Discard<'_> {
    fn drop(&mut self) {
        self.0.discard_copy_writes();
    }
}

/// Writes `bytes` at byte `at` of `segment`, through its words.
fn poke(segment: &Segment, at: usize, bytes: &[u8]) {
    let words = segment.raw_words();
    for (i, b) in bytes.iter().enumerate() {
        let at = at + i;
        let w = &words[at / 8];
        let shift = (at % 8) * 8;
        let old = w.load(Ordering::Relaxed);
        w.store(old & !(0xff << shift) | u64::from(*b) << shift, Ordering::Relaxed);
    }
}

/// The shm name of `target`'s image in this process.
fn image_name(target: &str) -> String {
    format!("semlb-fuzz-{target}-{}", std::process::id())
}

/// The shm name [`segment_file`] writes a whole file under (rewritten by
/// every input).
fn whole_file_name() -> String {
    format!("semlb-fuzz-{}", std::process::id())
}

/// Removes the files `target` ([`segment_file`], [`segment_scan`],
/// [`response_log`]) left in `/dev/shm` (a fuzz run exits without).
pub fn remove_shm_files(target: &str) {
    let _ = Segment::remove(&image_name(target));
    if target == "segment_file" {
        let _ = Segment::remove(&whole_file_name());
    }
}

/// Damage written into an image's file, written back when dropped (also
/// when a read panics, so the next input finds the image as made).
struct Damage<'a> {
    image: &'a Image,
    /// Where bytes were written: offset, length.
    spans: Vec<(usize, usize)>,
}

impl Drop for Damage<'_> {
    fn drop(&mut self) {
        for &(at, n) in self.spans.iter().rev() {
            self.image
                .file
                .write_at(&self.image.bytes[at..at + n], at as u64)
                .expect("undo the damage to the fuzz image");
        }
    }
}

/// Runs `f` on `target`'s image, made (filled by `fill`) on first use, one
/// input at a time (tests may call from several threads).
fn with_image<T>(target: &str, fill: fn(&Segment), f: impl FnOnce(&Image) -> T) -> T {
    static IMAGES: Mutex<Vec<(String, &'static Image)>> = Mutex::new(Vec::new());
    let image = {
        let mut images = IMAGES.lock().unwrap_or_else(PoisonError::into_inner);
        match images.iter().find(|(t, _)| t == target) {
            Some((_, image)) => *image,
            None => {
                let image: &'static Image = Box::leak(Box::new(Image::make(target, fill)));
                images.push((target.to_owned(), image));
                image
            }
        }
    };
    static BUSY: Mutex<()> = Mutex::new(());
    let _busy = BUSY.lock().unwrap_or_else(PoisonError::into_inner);
    f(image)
}

/// Puts a few entries in every table of `segment`: the image
/// [`segment_file`] and [`segment_scan`] damage.
fn fill_tables(segment: &Segment) {
    let t = segment.tables();
    let servers: Vec<_> = (0..3)
        .map(|i| {
            t.servers
                .register(i, &format!("http://10.0.0.{i}:8000"), 0)
                .expect("register")
        })
        .collect();
    for (i, s) in servers.iter().enumerate() {
        t.prefix.insert(0x1000 + i as u64, *s, Stamp(1));
        t.servers.begin_request(1, *s, 10);
    }
    for k in 0..4u128 {
        let _ = t.responses.put(ResponseKey(k << 64 | k), &vec![k as u8; 100 << k]);
    }
    let record = CompletionRecord {
        server: servers[0],
        prompt_tokens: 12,
        output_tokens: 3,
        prompt_blocks: &[1, 2],
        full_blocks: &[1, 2, 3],
        continuation: None,
        response: Some((ResponseKey(1), b"{}")),
        prediction: None,
        timing: None,
    };
    let mut buf = Vec::new();
    record.encode_into(&mut buf);
    let _ = t.ring(0).push(&buf);
}

/// A shm segment's file: byte 0 even, the rest is the whole file; odd, the
/// rest is a list of overwrites (`region:1 offset:4 len:1 bytes`, a region
/// past the last is the header page) of a real segment holding a few
/// entries of every table. Opening either refuses it or gives tables whose
/// per-request reads and writes (servers by slot, lookups, ring pops) do
/// not panic.
pub fn segment_file(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode & 1 == 0 {
        let name = whole_file_name();
        if write_shm(&name, rest).is_ok()
            && let Ok(segment) = Segment::open(&name)
        {
            read_per_request(&segment);
        }
        return;
    }
    with_image("segment_file", fill_tables, |image| {
        image.damaged(rest, read_per_request)
    });
}

/// Overwrites (as [`segment_file`]'s, without its byte 0) of a real
/// segment, whose whole tables (prefixes, stats, servers and their
/// in-flight ledger, processes) are then scanned as `semlb shm inspect`,
/// `/metrics` and the supervisor scan them, and a dead process's counts
/// taken back: nothing panics.
pub fn segment_scan(data: &[u8]) {
    with_image("segment_scan", fill_tables, |image| {
        image.damaged(data, |segment| {
            let t = segment.tables();
            let _ = t.prefix.occupancy_estimate(0, 64);
            let _ = t.prefix.entries().take(64).count();
            let _ = t.stats.sum_all();
            // Every server's in-flight counts (a column of the ledger,
            // one cell per process) and, as the supervisor does for a dead
            // process, its counts taken back.
            for s in t.servers.servers() {
                let _ = (t.servers.inflight_and_pending(s.server), t.servers.load(s.server));
            }
            let _ = t.registry.processes().count();
            let _ = t.servers.reclaim_process(1);
        });
    });
}

fn write_shm(name: &str, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(format!("/dev/shm/{name}"))?;
    f.write_all(bytes)
}

/// Reads and writes `segment`'s tables as a request and its completion
/// record do.
fn read_per_request(segment: &Segment) {
    let t = segment.tables();
    // The image's servers (a dispatcher reads its candidates by slot).
    for (s, _) in (0..4).filter_map(|slot| t.servers.current(slot)) {
        let _ = t.servers.load(s);
    }
    let chain: [u64; 8] = std::array::from_fn(|i| 0x1000 + i as u64);
    let _ = t.prefix.longest_prefix_match(&chain, |_| true);
    let _ = t.prefix.lookup(0x1001);
    let mut buf = Vec::new();
    for k in 0..4u128 {
        let _ = t.responses.get_into(ResponseKey(k << 64 | k), &mut buf);
    }
    let _ = (t.responses.stats(), t.segments.stats());
    let mut record = Completion::default();
    for r in 0..t.ring_count().min(4) {
        let ring = t.ring(r);
        for _ in 0..8 {
            match ring.pop(&mut buf) {
                Pop::Record => {
                    let _ = record.decode_from(&buf);
                }
                Pop::Pending => {
                    ring.recover(|_, _| false);
                }
                Pop::Empty => break,
            }
        }
    }
}

/// The response cache's key of value `k` of [`response_log`]'s image.
fn response_key(k: u128) -> ResponseKey {
    ResponseKey(k.wrapping_mul(0x9e37_79b9_7f4a_7c15) << 64 | k)
}

/// Value `k` of [`response_log`]'s image: 64 to 1024 bytes.
fn response_value(k: u128) -> Vec<u8> {
    (0..(64 << (k % 5))).map(|i| (i as u128 * 31 + k) as u8).collect()
}

/// Overwrites (`region:1 offset:4 len:1 bytes`, region 0 the index, else
/// the log) of a response cache holding eight known values, then reads and
/// writes: a read returns the value put under its key or nothing.
pub fn response_log(data: &[u8]) {
    with_image("response_log", fill_responses, |image| {
        damaged_responses(&image.copy, data)
    });
}

/// Puts [`response_log`]'s eight values in `segment`.
fn fill_responses(segment: &Segment) {
    for k in 0..8 {
        segment
            .tables()
            .responses
            .put(response_key(k), &response_value(k))
            .expect("put");
    }
}

/// [`response_log`] on the kept copy `segment` of its image.
fn damaged_responses(segment: &Segment, data: &[u8]) {
    let _discard = Discard(segment);
    let t = segment.tables();
    let header = segment.header();
    let (index, log) = (
        header.region(RegionKind::ResponseIndex),
        header.region(RegionKind::ResponseLog),
    );
    let mut ops = data;
    while ops.len() >= 6 {
        let r = if ops[0] & 1 == 0 { index } else { log };
        let offset = u64::from(u32::from_le_bytes(ops[1..5].try_into().expect("4 bytes"))) % r.bytes.max(1);
        let len = usize::from(ops[5]).min(ops.len() - 6);
        for (i, b) in ops[6..6 + len].iter().enumerate() {
            poke(segment, (r.offset + (offset + i as u64) % r.bytes) as usize, &[*b]);
        }
        ops = &ops[6 + len..];
    }
    let mut buf = Vec::new();
    for k in 0..8 {
        if let Some(got) = t.responses.get_into(response_key(k), &mut buf) {
            assert_eq!(
                got,
                &response_value(k)[..],
                "key {k} read back a value that was never put under it"
            );
        }
    }
    let _ = t.responses.stats();
    let _ = t.responses.put(response_key(9), b"after the damage");
    if let Some(got) = t.responses.get_into(response_key(9), &mut buf) {
        assert_eq!(got, b"after the damage");
    }
}
