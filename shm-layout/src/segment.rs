//! The segment: POSIX shared memory (or a heap buffer with the same format),
//! its creation, validation on open, and the typed views of its regions.
//!
//! Creation is exclusive (`O_CREAT | O_EXCL`, mode 0600), the memory is
//! reserved up front with `posix_fallocate` (a full /dev/shm is a clear
//! [`CreateError::NoSpace`] at start, never a SIGBUS later), the header is
//! written, and its `state` word is stored last. [`Segment::open`] checks
//! everything before handing out tables.
//!
//! [`Segment::heap`] gives the same format in private memory: unit tests run
//! one body against both backings.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::OnceLock;

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::mman::{shm_open, shm_unlink};
use nix::sys::stat::{Mode, fchmod, fstat};

use crate::bucket::Bucket;
use crate::completion_ring::{CompletionRing, RingControl};
use crate::error::{CreateError, NameError, OpenError, RemoveError};
use crate::header::{HeaderInfo, HeaderInit, LAYOUT_VERSION, MAGIC, RawHeader, STATE_READY};
use crate::limit_table::LimitTable;
use crate::plan::{HEADER_BYTES, LOG_CONTROL_BYTES, LayoutPlan, PAGE, RING_CONTROL_BYTES, RegionKind};
use crate::prefix_table::{PrefixTable, Stamp};
use crate::registry::{ProcessSlot, Registry};
use crate::response_log::{LogControl, ResponseLog};
use crate::server_table::{LedgerCell, ServerSlot, ServerTable};
use crate::stats::{StatBlock, Stats};
use crate::sync::{AtomicU64, u128_is_lock_free};
use crate::usage_table::{UsageEntry, UsageTable};

/// Longest segment name accepted (without the leading `/`).
pub const MAX_NAME_LEN: usize = 200;

/// Checks a segment name and returns it with its leading `/`.
pub fn shm_path(name: &str) -> Result<String, NameError> {
    let bare = name.strip_prefix('/').unwrap_or(name);
    let reason = if bare.is_empty() {
        Some("it is empty")
    } else if bare.len() > MAX_NAME_LEN {
        Some("it is longer than 200 bytes")
    } else if bare.contains('/') {
        Some("it contains '/' after the first character")
    } else if bare.contains('\0') {
        Some("it contains a NUL byte")
    } else if bare == "." || bare == ".." {
        Some("it is '.' or '..'")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(NameError {
            name: name.to_owned(),
            reason,
        }),
        None => Ok(format!("/{bare}")),
    }
}

enum Memory {
    Heap {
        ptr: NonNull<u8>,
        layout: Layout,
    },
    Shm(memmap2::MmapRaw),
    /// A private, copy-on-write mapping ([`Segment::open_copy`]).
    Copy(memmap2::MmapRaw),
}

/// A mapped segment with a validated header.
pub struct Segment {
    memory: Memory,
    len: usize,
    info: HeaderInfo,
    name: Option<String>,
    /// The views of [`Segment::tables`], made once `info` is final (a
    /// dispatcher asks for them several times per request).
    views: OnceLock<Tables<'static>>,
}

// SAFETY: the segment's memory is only ever accessed through atomics (the
// views in `tables()` are slices of atomic types), which are Sync; the
// mapping itself is immutable once made.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment")
            .field("name", &self.name)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if let Memory::Heap { ptr, layout } = self.memory {
            // SAFETY: allocated in `heap` with this layout and not freed since.
            unsafe { dealloc(ptr.as_ptr(), layout) };
        }
    }
}

fn monotonic_ns() -> u64 {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).expect("CLOCK_MONOTONIC is always available");
    t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn random_seed() -> [u64; 4] {
    let mut buf = [0u8; 32];
    let mut filled = 0;
    while filled < buf.len() {
        // SAFETY: the pointer and length describe the unfilled tail of `buf`.
        let n = unsafe { libc::getrandom(buf[filled..].as_mut_ptr().cast(), buf.len() - filled, 0) };
        if n > 0 {
            filled += n as usize;
        } else if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            // No entropy source: fall back to time and pid (still unique per segment).
            let t = monotonic_ns() ^ unix_ms().rotate_left(32) ^ u64::from(std::process::id());
            return std::array::from_fn(|i| crate::mix::mix64(t.wrapping_add(i as u64 * 0x9e37_79b9_7f4a_7c15)));
        }
    }
    std::array::from_fn(|i| u64::from_le_bytes(buf[i * 8..i * 8 + 8].try_into().expect("8 bytes")))
}

/// Milliseconds and prefix stamps relative to the segment's creation, from
/// `CLOCK_MONOTONIC`, which every process on the host shares.
#[derive(Debug, Clone, Copy)]
pub struct SegmentClock {
    origin_ns: u64,
}

impl SegmentClock {
    /// Nanoseconds since the segment was created (the rate limits' clock).
    pub fn now_ns(&self) -> u64 {
        monotonic_ns().saturating_sub(self.origin_ns)
    }

    /// Milliseconds since the segment was created.
    pub fn now_ms(&self) -> u64 {
        monotonic_ns().saturating_sub(self.origin_ns) / 1_000_000
    }

    /// The current prefix-table stamp (seconds since creation, mod 2^16).
    pub fn stamp(&self) -> Stamp {
        Stamp((self.now_ms() / 1000) as u16)
    }
}

/// Typed views of every region of one segment.
#[derive(Debug, Clone, Copy)]
pub struct Tables<'a> {
    /// Prefix hash → servers: the gateway's estimate, from what it sent.
    pub prefix: PrefixTable<'a>,
    /// Prefix hash → servers whose engines said they hold it (their KV
    /// cache events, `semlb::kv_events`): written only by the event
    /// subscribers, so the estimate never overwrites what an engine
    /// confirmed, nor the other way round.
    pub confirmed: PrefixTable<'a>,
    /// Exact request → cached response.
    pub responses: ResponseLog<'a>,
    /// Digest of a text segment → its token ids (the tokenizer's store
    /// shared by every process; the same keyed-log structure as
    /// `responses`, in regions of its own).
    pub segments: ResponseLog<'a>,
    /// Inference servers and their load.
    pub servers: ServerTable<'a>,
    /// Child processes.
    pub registry: Registry<'a>,
    /// Per-process counters (metrics), one block per registry slot.
    pub stats: Stats<'a>,
    /// Rate-limit buckets.
    pub limits: LimitTable<'a>,
    /// Usage per tenant and model.
    pub usage: UsageTable<'a>,
    /// The rings region as atomic words: other processes write it through
    /// atomics, so it is never viewed as plain bytes (which would claim it
    /// does not change while borrowed).
    rings: &'a [AtomicU64],
    ring_bytes: usize,
    ring_count: usize,
    seed: [u64; 4],
}

impl<'a> Tables<'a> {
    /// Number of completion rings.
    pub fn ring_count(&self) -> usize {
        self.ring_count
    }

    /// Completion ring `i` (panics if `i >= ring_count()`).
    pub fn ring(&self, i: usize) -> CompletionRing<'a> {
        assert!(i < self.ring_count, "ring {i} out of {}", self.ring_count);
        let control_words = RING_CONTROL_BYTES as usize / 8;
        let stride = control_words + self.ring_bytes / 8;
        let at = &self.rings[i * stride..(i + 1) * stride];
        let (head, data) = at.split_at(control_words);
        // SAFETY: `head` lies inside the validated rings region, is 64-byte
        // aligned (region and stride are multiples of 64 bytes) and
        // `RING_CONTROL_BYTES` long, the size of `RingControl`, a repr(C)
        // aggregate of atomics, valid for any bit pattern and shared through
        // atomics only, as the words it is cast from.
        let control = unsafe { &*(head.as_ptr() as *const RingControl) };
        CompletionRing::new(control, data, self.seed)
    }
}

/// Creates the shm object `path` (with its leading `/`), exclusively,
/// mode 0600, empty.
pub(crate) fn create_object(path: &str) -> Result<OwnedFd, CreateError> {
    if !u128_is_lock_free() {
        return Err(CreateError::Unsupported);
    }
    match shm_open(
        path,
        OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR,
        Mode::from_bits_truncate(0o600),
    ) {
        Ok(fd) => Ok(fd),
        Err(Errno::EEXIST) => Err(CreateError::AlreadyExists { name: path.to_owned() }),
        Err(Errno::EACCES) => Err(CreateError::PermissionDenied { name: path.to_owned() }),
        Err(e) => Err(CreateError::Os {
            name: path.to_owned(),
            step: "shm_open",
            source: e.into(),
        }),
    }
}

/// Opens the existing shm object at `path` (with its leading `/`).
pub(crate) fn open_object(path: &str) -> Result<OwnedFd, OpenError> {
    match shm_open(path, OFlag::O_RDWR, Mode::empty()) {
        Ok(fd) => Ok(fd),
        Err(Errno::ENOENT) => Err(OpenError::NotFound { name: path.to_owned() }),
        Err(Errno::EACCES) => Err(OpenError::PermissionDenied { name: path.to_owned() }),
        Err(e) => Err(OpenError::Os {
            name: path.to_owned(),
            step: "shm_open",
            source: e.into(),
        }),
    }
}

/// The pid of the supervisor registered in the segment at `path` (its
/// registry slot 0, else the header's creator), if the segment opens.
pub(crate) fn owner_pid(path: &str) -> Option<u32> {
    let segment = Segment::open(path).ok()?;
    let registered = segment
        .tables()
        .registry
        .get(crate::SUPERVISOR_SLOT)
        .filter(|p| p.role == Some(crate::Role::Supervisor) && p.pid != 0)
        .map(|p| p.pid);
    registered.or(u32::try_from(segment.header().creator_pid).ok())
}

impl Segment {
    /// Creates the shm segment `name` with `plan`'s layout, exclusively,
    /// mode 0600, with all of its memory reserved.
    pub fn create(name: &str, plan: &LayoutPlan) -> Result<Self, CreateError> {
        let path = shm_path(name)?;
        let fd = create_object(&path)?;
        Self::format_object(&fd, &path, plan)
    }

    /// Lays `plan` out in the new, empty shm object `fd` (named `path`);
    /// the object is removed again if that fails.
    pub(crate) fn format_object(fd: &OwnedFd, path: &str, plan: &LayoutPlan) -> Result<Self, CreateError> {
        let result = Self::format(fd, path, plan);
        if result.is_err() {
            let _ = shm_unlink(path);
        }
        result
    }

    fn format(fd: &OwnedFd, path: &str, plan: &LayoutPlan) -> Result<Self, CreateError> {
        let os = |step: &'static str, e: Errno| CreateError::Os {
            name: path.to_owned(),
            step,
            source: e.into(),
        };
        fchmod(fd, Mode::from_bits_truncate(0o600)).map_err(|e| os("fchmod", e))?;
        let size = plan.segment_bytes();
        nix::unistd::ftruncate(fd, size as i64).map_err(|e| os("ftruncate", e))?;
        match nix::fcntl::posix_fallocate(fd, 0, size as i64) {
            Ok(()) => {}
            Err(Errno::ENOSPC | Errno::ENOMEM) => {
                let available = nix::sys::statvfs::fstatvfs(fd)
                    .map(|s| s.blocks_available() * s.fragment_size())
                    .unwrap_or(0);
                return Err(CreateError::NoSpace {
                    name: path.to_owned(),
                    requested: size,
                    available,
                });
            }
            Err(e) => return Err(os("posix_fallocate", e)),
        }
        let map = memmap2::MmapOptions::new()
            .len(size as usize)
            .map_raw(fd.as_raw_fd())
            .map_err(|e| CreateError::Os {
                name: path.to_owned(),
                step: "mmap",
                source: e,
            })?;
        let mut seg = Self {
            len: size as usize,
            memory: Memory::Shm(map),
            info: placeholder_info(),
            name: Some(path.to_owned()),
            views: OnceLock::new(),
        };
        seg.write_header(plan);
        Ok(seg)
    }

    /// A segment with `plan`'s layout in private heap memory: the same format
    /// and tables, for unit tests and single-process tools.
    pub fn heap(plan: &LayoutPlan) -> Self {
        let layout = Layout::from_size_align(plan.segment_bytes() as usize, PAGE as usize).expect("valid layout");
        // SAFETY: the layout has a non-zero size (plans are at least 8 MiB).
        let ptr =
            NonNull::new(unsafe { alloc_zeroed(layout) }).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        let mut seg = Self {
            len: layout.size(),
            memory: Memory::Heap { ptr, layout },
            info: placeholder_info(),
            name: None,
            views: OnceLock::new(),
        };
        seg.write_header(plan);
        seg
    }

    /// Writes a new header (this process as creator, now, a fresh seed) and
    /// publishes the segment.
    fn write_header(&mut self, plan: &LayoutPlan) {
        let init = HeaderInit {
            created_unix_ms: unix_ms(),
            created_monotonic_ns: monotonic_ns(),
            creator_pid: u64::from(std::process::id()),
            seed: random_seed(),
        };
        let header = self.raw_header();
        header.write(plan, &init);
        // Every region's empty state is all-zero, which a new shm object
        // and `alloc_zeroed` both are: nothing else to initialise.
        header.publish();
        self.info = header.read();
        self.views = OnceLock::new();
    }

    /// Opens the existing shm segment `name` and validates it.
    pub fn open(name: &str) -> Result<Self, OpenError> {
        let path = shm_path(name)?;
        let fd = open_object(&path)?;
        Self::open_object(&fd, &path)
    }

    /// Opens the existing shm segment `name` as a private copy: validated
    /// as [`open`](Self::open) validates it, but mapped copy-on-write, so
    /// its tables read what the segment holds and their writes stay in this
    /// mapping (neither the segment nor the processes sharing it see them).
    /// For looking into a segment without disturbing it, and for fuzzing
    /// many damaged copies of one image (`semlb::fuzzing`).
    pub fn open_copy(name: &str) -> Result<Self, OpenError> {
        let path = shm_path(name)?;
        let fd = open_object(&path)?;
        Self::map_validated(&fd, &path, true)
    }

    /// Throws away what was written to this private copy
    /// ([`open_copy`](Self::open_copy)) since it was opened: its tables
    /// read what the segment holds again, as a new copy would, without a
    /// new mapping. `false` (and nothing done) for a segment that is not
    /// a private copy.
    pub fn discard_copy_writes(&self) -> bool {
        let Memory::Copy(map) = &self.memory else {
            return false;
        };
        // SAFETY: dropping the private pages of a copy-on-write mapping
        // only makes them read the shm object again; every view reads
        // through atomics, which may see any bytes.
        unsafe { map.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) }
            .expect("madvise(MADV_DONTNEED) of a mapping it made");
        true
    }

    /// Maps the open shm object `fd` (named `path`) and validates it.
    pub(crate) fn open_object(fd: &OwnedFd, path: &str) -> Result<Self, OpenError> {
        Self::map_validated(fd, path, false)
    }

    /// Maps `fd` (named `path`), shared or (`private`) copy-on-write, and
    /// validates it.
    fn map_validated(fd: &OwnedFd, path: &str, private: bool) -> Result<Self, OpenError> {
        let path = path.to_owned();
        let os = |step: &'static str, e: io::Error| OpenError::Os {
            name: path.clone(),
            step,
            source: e,
        };
        let st = fstat(fd).map_err(|e| os("fstat", e.into()))?;
        let mode = st.st_mode & 0o777;
        if mode & 0o077 != 0 {
            return Err(OpenError::InsecureMode { name: path, mode });
        }
        let actual = st.st_size as u64;
        if actual < HEADER_BYTES {
            return Err(OpenError::Truncated {
                name: path,
                bytes: actual,
            });
        }
        let options = memmap2::MmapOptions::new().len(actual as usize).clone();
        let memory = if private {
            // SAFETY: a private mapping of a shm object whose size was just
            // read; like the shared one it is read and written only through
            // atomics, and lives as long as the segment.
            unsafe { options.map_copy(fd.as_raw_fd()) }.map(|map| Memory::Copy(map.into()))
        } else {
            options.map_raw(fd.as_raw_fd()).map(Memory::Shm)
        }
        .map_err(|e| os("mmap", e))?;
        let mut seg = Self {
            len: actual as usize,
            memory,
            info: placeholder_info(),
            name: Some(path.clone()),
            views: OnceLock::new(),
        };
        let info = seg.raw_header().read();
        if info.state != STATE_READY && (info.magic == 0 || info.magic == MAGIC) {
            return Err(OpenError::NotReady {
                name: path,
                creator_pid: info.creator_pid,
            });
        }
        if info.magic != MAGIC {
            return Err(OpenError::BadMagic {
                name: path,
                found: info.magic,
            });
        }
        if info.layout_version != LAYOUT_VERSION {
            return Err(OpenError::VersionMismatch {
                name: path,
                found: info.layout_version,
                expected: LAYOUT_VERSION,
            });
        }
        if info.segment_bytes != actual {
            return Err(OpenError::SizeMismatch {
                name: path,
                header: info.segment_bytes,
                actual,
            });
        }
        if info.checksum() != info.header_checksum {
            return Err(OpenError::Corrupt {
                name: path,
                reason: "header checksum mismatch".into(),
            });
        }
        info.check_regions().map_err(|reason| OpenError::Corrupt {
            name: path.clone(),
            reason: reason.to_string(),
        })?;
        if !u128_is_lock_free() {
            return Err(OpenError::Unsupported);
        }
        seg.info = info;
        seg.views = OnceLock::new();
        Ok(seg)
    }

    /// Removes the shm segment `name`. Processes that have it mapped keep
    /// their mapping; new opens fail with [`OpenError::NotFound`].
    pub fn remove(name: &str) -> Result<(), RemoveError> {
        let path = shm_path(name)?;
        match shm_unlink(path.as_str()) {
            Ok(()) => Ok(()),
            Err(Errno::ENOENT) => Err(RemoveError::NotFound { name: path }),
            Err(e) => Err(RemoveError::Os {
                name: path,
                source: e.into(),
            }),
        }
    }

    fn base(&self) -> *mut u8 {
        match &self.memory {
            Memory::Heap { ptr, .. } => ptr.as_ptr(),
            Memory::Shm(map) | Memory::Copy(map) => map.as_mut_ptr(),
        }
    }

    fn raw_header(&self) -> &RawHeader {
        // SAFETY: every segment is at least HEADER_BYTES long and page
        // aligned; RawHeader is a repr(C) struct of atomics, valid for any
        // bit pattern.
        unsafe { &*(self.base() as *const RawHeader) }
    }

    /// The shm name (with its leading `/`), or `None` for a heap segment.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// The header as validated when the segment was created or opened.
    pub fn header(&self) -> &HeaderInfo {
        &self.info
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: segments are at least 8 MiB.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The segment's clock.
    pub fn clock(&self) -> SegmentClock {
        SegmentClock {
            origin_ns: self.info.created_monotonic_ns,
        }
    }

    /// A region as a slice of `T`, checked against the segment's bounds.
    fn region<T>(&self, kind: RegionKind, skip_bytes: u64, count: u64) -> &[T] {
        let r = self.info.region(kind);
        let start = r.offset + skip_bytes;
        let bytes = count * std::mem::size_of::<T>() as u64;
        assert!(
            start + bytes <= r.offset + r.bytes && r.offset + r.bytes <= self.len as u64,
            "region out of bounds"
        );
        // SAFETY: `base + start` is in bounds (asserted above; the header
        // was validated at open), aligned for T (regions start on a page,
        // `skip_bytes` is a multiple of 64 and T's alignment is at most 64;
        // debug-asserted below), and T is a repr(C) aggregate of atomics,
        // valid for any bit pattern and safe to share across threads and
        // processes. The mapping lives as long as `self`.
        unsafe {
            let ptr = self.base().add(start as usize);
            assert_eq!(ptr as usize % std::mem::align_of::<T>(), 0, "misaligned region");
            std::slice::from_raw_parts(ptr as *const T, count as usize)
        }
    }

    /// Typed views of every region.
    pub fn tables(&self) -> Tables<'_> {
        let views = self.views.get_or_init(|| {
            let views = self.make_tables();
            // SAFETY: the views borrow the segment's memory, which is mapped
            // (or allocated) once and stays at the same address until the
            // segment is dropped, whatever happens to the `Segment` value
            // itself (it owns the mapping, not the bytes inline). The cached
            // copy is `'static` only inside `self.views`, which is dropped
            // with the segment (`Tables` has no drop glue that reads the
            // memory), and it is handed out with `&self`'s lifetime below.
            unsafe { std::mem::transmute::<Tables<'_>, Tables<'static>>(views) }
        });
        *views
    }

    /// The views of every region, computed from the header's placement
    /// (bounds-checked).
    fn make_tables(&self) -> Tables<'_> {
        let seed = self.info.seed;
        let servers = self.info.region(RegionKind::Servers);
        let ledger = self.info.region(RegionKind::Ledger);
        let registry = self.info.region(RegionKind::Registry);
        let stats = self.info.region(RegionKind::Stats);
        let rings = self.info.region(RegionKind::Rings);
        let index = self.info.region(RegionKind::ResponseIndex);
        let log = self.info.region(RegionKind::ResponseLog);
        let segment_index = self.info.region(RegionKind::SegmentIndex);
        let segment_log = self.info.region(RegionKind::SegmentLog);
        let prefix = self.info.region(RegionKind::Prefix);
        let confirmed = self.info.region(RegionKind::Confirmed);
        let limits = self.info.region(RegionKind::Limits);
        let usage = self.info.region(RegionKind::Usage);
        let control: &[LogControl] = self.region(RegionKind::ResponseLog, 0, 1);
        let segment_control: &[LogControl] = self.region(RegionKind::SegmentLog, 0, 1);
        Tables {
            prefix: PrefixTable::new(self.region::<Bucket>(RegionKind::Prefix, 0, prefix.count), seed[0]),
            // Another seed: an entry of one table never checks out in the
            // other (a bit flip in a region offset reads as misses).
            confirmed: PrefixTable::new(
                self.region::<Bucket>(RegionKind::Confirmed, 0, confirmed.count),
                seed[0].rotate_left(23) ^ seed[2],
            ),
            responses: ResponseLog::new(
                &control[0],
                self.region::<Bucket>(RegionKind::ResponseIndex, 0, index.count),
                self.region::<AtomicU64>(RegionKind::ResponseLog, LOG_CONTROL_BYTES, log.count / 8),
                log.param as usize,
                seed,
            ),
            // Another seed order: a record of one log never checks out in
            // the other.
            segments: ResponseLog::new(
                &segment_control[0],
                self.region::<Bucket>(RegionKind::SegmentIndex, 0, segment_index.count),
                self.region::<AtomicU64>(RegionKind::SegmentLog, LOG_CONTROL_BYTES, segment_log.count / 8),
                segment_log.param as usize,
                [seed[1], seed[0], seed[3], seed[2]],
            ),
            servers: ServerTable::new(
                self.region::<ServerSlot>(RegionKind::Servers, 0, servers.count),
                self.region::<LedgerCell>(RegionKind::Ledger, 0, ledger.count),
                seed[2],
            ),
            registry: Registry::new(self.region::<ProcessSlot>(RegionKind::Registry, 0, registry.count)),
            stats: Stats::new(self.region::<StatBlock>(RegionKind::Stats, 0, stats.count)),
            limits: LimitTable::new(self.region::<Bucket>(RegionKind::Limits, 0, limits.count), seed[3]),
            usage: UsageTable::new(
                self.region::<UsageEntry>(RegionKind::Usage, 0, usage.count),
                seed[3].rotate_left(29),
            ),
            rings: self.region::<AtomicU64>(
                RegionKind::Rings,
                0,
                rings.count * (RING_CONTROL_BYTES + rings.param) / 8,
            ),
            ring_bytes: rings.param as usize,
            ring_count: rings.count as usize,
            seed,
        }
    }

    /// The whole segment as atomic words, for diagnostics and
    /// fault-injection tests (e.g. flipping bits of a live segment).
    #[doc(hidden)]
    pub fn raw_words(&self) -> &[AtomicU64] {
        // SAFETY: the mapping is `len` bytes (a multiple of 8), page aligned,
        // and only ever accessed through atomics.
        unsafe { std::slice::from_raw_parts(self.base() as *const AtomicU64, self.len / 8) }
    }
}

fn placeholder_info() -> HeaderInfo {
    HeaderInfo {
        magic: 0,
        layout_version: 0,
        segment_bytes: 0,
        state: 0,
        created_unix_ms: 0,
        created_monotonic_ns: 0,
        creator_pid: 0,
        header_checksum: 0,
        seed: [0; 4],
        regions: Default::default(),
    }
}
