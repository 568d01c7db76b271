//! The segment's create/open contract on real POSIX shared memory: a new
//! segment is `/dev/shm/<name>` with mode 0600, creation is exclusive, and
//! [`Segment::open`] refuses — with the precise error — a missing segment,
//! an invalid name, an object that was never initialised, a foreign magic,
//! another layout version, a corrupt header, a size that disagrees with the
//! header, group/other permissions and a truncated object; creation refuses
//! a plan below the minimum size and reports a full /dev/shm as `NoSpace`
//! up front, leaving nothing behind. Two mappings of one segment in one
//! process share their data; a private copy ([`Segment::open_copy`]) reads
//! it and keeps its own writes, until it discards them.

mod shm_support;

use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;
use std::sync::atomic::Ordering;

use nix::fcntl::OFlag;
use nix::sys::mman::shm_open;
use nix::sys::stat::{Mode, fchmod};
use nix::unistd::ftruncate;
use shm_layout::plan::{MAX_SEGMENT_BYTES, MIN_SEGMENT_BYTES};
use shm_layout::{
    CreateError, LAYOUT_VERSION, LayoutPlan, MAGIC, OpenError, PlanError, RegionKind, ResponseKey, Segment,
    ServerState, Stamp, shm_path,
};
use shm_support::{ShmGuard, create_shm, dev_shm_path, small_plan};

/// Word index of the header's `layout_version` (byte offset 8).
const VERSION_WORD: usize = 1;
/// Word index of the header's `header_checksum` (byte offset 56).
const CHECKSUM_WORD: usize = 7;
/// Word index of the first region descriptor (byte offset 96).
const REGIONS_WORD: usize = 12;

/// Opens the existing object `name` read-write, by hand.
fn open_raw(name: &str) -> OwnedFd {
    shm_open(format!("/{name}").as_str(), OFlag::O_RDWR, Mode::empty()).expect("shm_open")
}

/// Creates a new object `name` by hand: mode 0600, `bytes` long, all zero.
fn create_raw(name: &str, bytes: i64) -> OwnedFd {
    let fd = shm_open(
        format!("/{name}").as_str(),
        OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR,
        Mode::from_bits_truncate(0o600),
    )
    .expect("shm_open O_CREAT|O_EXCL");
    ftruncate(&fd, bytes).expect("ftruncate");
    fd
}

fn running_as_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn created_segment_is_a_private_dev_shm_file_of_the_planned_size() {
    let plan = small_plan();
    let (guard, seg) = create_shm("mode", &plan);
    assert_eq!(seg.name(), Some(format!("/{}", guard.name).as_str()));
    let meta = std::fs::metadata(dev_shm_path(&guard.name)).expect("the object is in /dev/shm");
    assert_eq!(meta.permissions().mode() & 0o7777, 0o600);
    assert_eq!(meta.len(), plan.segment_bytes());
    drop(seg);
    Segment::remove(&guard.name).unwrap();
    assert!(!dev_shm_path(&guard.name).exists(), "remove unlinks the object");
    assert!(matches!(
        Segment::remove(&guard.name),
        Err(shm_layout::RemoveError::NotFound { .. })
    ));
}

#[test]
fn creation_is_exclusive() {
    let plan = small_plan();
    let (guard, seg) = create_shm("twice", &plan);
    seg.tables()
        .prefix
        .insert(1, shm_layout::ServerRef { slot: 0, generation: 1 }, Stamp(0));
    match Segment::create(&guard.name, &plan) {
        Err(CreateError::AlreadyExists { name }) => assert_eq!(name, format!("/{}", guard.name)),
        other => panic!("expected AlreadyExists, got {other:?}"),
    }
    assert!(
        seg.tables().prefix.lookup(1).is_some(),
        "the failed create left the first segment alone"
    );
    Segment::open(&guard.name).expect("the first segment still opens");
}

#[test]
fn open_of_a_missing_segment_is_not_found() {
    let guard = ShmGuard::new("missing");
    match Segment::open(&guard.name) {
        Err(OpenError::NotFound { name }) => assert_eq!(name, format!("/{}", guard.name)),
        other => panic!("expected NotFound, got {other:?}"),
    }
}

#[test]
fn invalid_names_are_refused_everywhere() {
    let plan = small_plan();
    let long = "n".repeat(300);
    for bad in ["", "/", "a/b", "/a/b", ".", "..", "nul\0byte", long.as_str()] {
        assert!(shm_path(bad).is_err(), "{bad:?}");
        match Segment::create(bad, &plan) {
            Err(CreateError::Name(e)) => assert_eq!(e.name, bad),
            other => panic!("create {bad:?}: expected a NameError, got {other:?}"),
        }
        assert!(matches!(Segment::open(bad), Err(OpenError::Name(_))), "open {bad:?}");
        assert!(
            matches!(Segment::remove(bad), Err(shm_layout::RemoveError::Name(_))),
            "remove {bad:?}"
        );
    }
    // A leading '/' is optional; 200 bytes is the limit.
    assert_eq!(shm_path("/semlb").unwrap(), "/semlb");
    assert_eq!(shm_path("semlb").unwrap(), "/semlb");
    assert!(shm_path(&"n".repeat(200)).is_ok());
    assert!(shm_path(&"n".repeat(201)).is_err());
}

#[test]
fn an_uninitialised_object_is_not_ready() {
    let guard = ShmGuard::new("notready");
    let _fd = create_raw(&guard.name, 16 << 20);
    match Segment::open(&guard.name) {
        Err(OpenError::NotReady { creator_pid, .. }) => assert_eq!(creator_pid, 0),
        other => panic!("expected NotReady, got {other:?}"),
    }
}

#[test]
fn a_patched_version_is_a_version_mismatch() {
    let (guard, seg) = create_shm("version", &small_plan());
    seg.raw_words()[VERSION_WORD].store(LAYOUT_VERSION + 1, Ordering::Relaxed);
    match Segment::open(&guard.name) {
        Err(OpenError::VersionMismatch { found, expected, .. }) => {
            assert_eq!((found, expected), (LAYOUT_VERSION + 1, LAYOUT_VERSION))
        }
        other => panic!("expected VersionMismatch, got {other:?}"),
    }
}

#[test]
fn a_patched_magic_is_bad_magic() {
    let (guard, seg) = create_shm("magic", &small_plan());
    let foreign = u64::from_le_bytes(*b"NOTSEMLB");
    seg.raw_words()[0].store(foreign, Ordering::Relaxed);
    match Segment::open(&guard.name) {
        Err(OpenError::BadMagic { found, .. }) => assert_eq!(found, foreign),
        other => panic!("expected BadMagic, got {other:?}"),
    }
    seg.raw_words()[0].store(MAGIC, Ordering::Relaxed);
    Segment::open(&guard.name).expect("restoring the magic restores the segment");
}

#[test]
fn a_patched_region_is_corrupt() {
    let (guard, seg) = create_shm("corrupt", &small_plan());
    let words = seg.raw_words();
    // Any header field changed behind the checksum's back.
    let prefix_count = REGIONS_WORD + 4 * RegionKind::Prefix as usize + 2;
    let original = words[prefix_count].load(Ordering::Relaxed);
    words[prefix_count].store(original * 2, Ordering::Relaxed);
    match Segment::open(&guard.name) {
        Err(OpenError::Corrupt { reason, .. }) => assert!(reason.contains("checksum"), "{reason}"),
        other => panic!("expected Corrupt, got {other:?}"),
    }
    // The same change with a matching checksum: the region check catches it.
    let mut info = seg.header().clone();
    info.regions[RegionKind::Prefix as usize].count = original * 2;
    words[CHECKSUM_WORD].store(info.checksum(), Ordering::Relaxed);
    match Segment::open(&guard.name) {
        Err(OpenError::Corrupt { reason, .. }) => assert!(reason.contains("prefix table"), "{reason}"),
        other => panic!("expected Corrupt, got {other:?}"),
    }
}

/// The header checksum is not a secret (it is an unkeyed seahash), so the
/// region checks are what stands between arbitrary header bytes and the
/// tables: `open` must answer `Corrupt`, not panic on an arithmetic
/// overflow (debug builds) nor accept the header because the product
/// wrapped (release builds), whatever the ring size field holds.
#[test]
fn a_huge_ring_size_with_a_valid_checksum_is_corrupt() {
    let (guard, seg) = create_shm("ringsize", &small_plan());
    let words = seg.raw_words();
    let ring_param = REGIONS_WORD + 4 * RegionKind::Rings as usize + 3;
    let huge = 1u64 << 58; // a power of two; 64 × (256 + 2^58) wraps to 16 KiB
    let mut info = seg.header().clone();
    info.regions[RegionKind::Rings as usize].param = huge;
    words[ring_param].store(huge, Ordering::Relaxed);
    words[CHECKSUM_WORD].store(info.checksum(), Ordering::Relaxed);
    let opened = std::panic::catch_unwind(|| Segment::open(&guard.name).map(drop));
    match opened {
        Ok(Err(OpenError::Corrupt { .. })) => {}
        Ok(other) => panic!("expected Corrupt, got {other:?}"),
        Err(_) => panic!("open panicked on a header with ring size 2^58 instead of returning Corrupt"),
    }
}

#[test]
fn a_grown_object_is_a_size_mismatch() {
    let plan = small_plan();
    let (guard, _seg) = create_shm("grown", &plan);
    let fd = open_raw(&guard.name);
    let grown = plan.segment_bytes() + 4096;
    ftruncate(&fd, grown as i64).unwrap();
    match Segment::open(&guard.name) {
        Err(OpenError::SizeMismatch { header, actual, .. }) => {
            assert_eq!((header, actual), (plan.segment_bytes(), grown))
        }
        other => panic!("expected SizeMismatch, got {other:?}"),
    }
}

#[test]
fn group_or_other_permissions_are_insecure() {
    let (guard, _seg) = create_shm("insecure", &small_plan());
    let fd = open_raw(&guard.name);
    fchmod(&fd, Mode::from_bits_truncate(0o644)).unwrap();
    match Segment::open(&guard.name) {
        Err(OpenError::InsecureMode { mode, .. }) => assert_eq!(mode, 0o644),
        other => panic!("expected InsecureMode, got {other:?}"),
    }
    fchmod(&fd, Mode::from_bits_truncate(0o600)).unwrap();
    Segment::open(&guard.name).expect("0600 again opens");
}

#[test]
fn a_tiny_object_is_truncated() {
    let guard = ShmGuard::new("tiny");
    let _fd = create_raw(&guard.name, 100);
    match Segment::open(&guard.name) {
        Err(OpenError::Truncated { bytes, .. }) => assert_eq!(bytes, 100),
        other => panic!("expected Truncated, got {other:?}"),
    }
}

#[test]
fn permission_denied_on_another_users_segment() {
    if running_as_root() {
        // Root bypasses file permission checks (CAP_DAC_OVERRIDE), so the
        // EACCES path cannot be reached here; run the suite as a normal
        // user to cover it.
        eprintln!("skipped: running as root, which bypasses permission checks");
        return;
    }
    let (guard, _seg) = create_shm("denied", &small_plan());
    let fd = open_raw(&guard.name);
    fchmod(&fd, Mode::empty()).unwrap();
    match Segment::open(&guard.name) {
        Err(OpenError::PermissionDenied { .. }) => {}
        other => panic!("expected PermissionDenied, got {other:?}"),
    }
}

/// The plan constructor refuses a size below the minimum; the error
/// converts into the create error the CLI reports.
#[test]
fn a_plan_below_the_minimum_is_too_small() {
    let guard = ShmGuard::new("small");
    let result = LayoutPlan::for_size(MIN_SEGMENT_BYTES - 1)
        .map_err(CreateError::from)
        .and_then(|plan| Segment::create(&guard.name, &plan));
    match result {
        Err(CreateError::Plan(PlanError::TooSmall { requested, min })) => {
            assert_eq!((requested, min), (MIN_SEGMENT_BYTES - 1, MIN_SEGMENT_BYTES))
        }
        other => panic!("expected Plan(TooSmall), got {other:?}"),
    }
    assert!(!dev_shm_path(&guard.name).exists());
}

#[test]
fn no_space_is_reported_at_creation_and_leaves_nothing_behind() {
    let fs = nix::sys::statvfs::statvfs("/dev/shm").expect("statvfs /dev/shm");
    let total = fs.blocks() * fs.fragment_size();
    if total == 0 {
        eprintln!("skipped: /dev/shm reports no size limit");
        return;
    }
    let size = 2 * total;
    if size > MAX_SEGMENT_BYTES {
        eprintln!("skipped: twice /dev/shm ({size} bytes) exceeds the largest segment ({MAX_SEGMENT_BYTES} bytes)");
        return;
    }
    let plan = LayoutPlan::for_size(size).unwrap();
    let guard = ShmGuard::new("nospace");
    match Segment::create(&guard.name, &plan) {
        Err(CreateError::NoSpace {
            requested, available, ..
        }) => {
            assert_eq!(requested, plan.segment_bytes());
            assert!(available <= total, "{available} free of {total}");
        }
        other => panic!("expected NoSpace for {size} bytes in a {total}-byte /dev/shm, got {other:?}"),
    }
    assert!(
        !dev_shm_path(&guard.name).exists(),
        "a failed create removes its object"
    );
    assert!(matches!(Segment::open(&guard.name), Err(OpenError::NotFound { .. })));
}

#[test]
fn two_mappings_in_one_process_share_the_data() {
    let (guard, writer) = create_shm("shared", &small_plan());
    let reader = Segment::open(&guard.name).expect("open");
    assert_eq!(reader.header(), writer.header());
    assert_eq!(reader.name(), writer.name());
    let (w, r) = (writer.tables(), reader.tables());

    let server = w.servers.register(9, "http://shared:1", 0).unwrap();
    assert_eq!(r.servers.current(server.slot), Some((server, ServerState::Up)));
    assert_eq!(r.servers.get(server.slot).unwrap().address, "http://shared:1");

    w.prefix.insert(0xabc, server, Stamp(1));
    assert!(r.prefix.lookup(0xabc).unwrap().servers.contains(server.tag()));

    w.responses.put(ResponseKey(5), b"cached").unwrap();
    assert_eq!(r.responses.get(ResponseKey(5)).as_deref(), Some(&b"cached"[..]));

    let inc = w.registry.claim(2, shm_layout::Role::Dispatcher, 0);
    assert!(r.registry.attach(2, inc, 1234, 1), "a write through the reader ...");
    assert_eq!(w.registry.get(2).unwrap().pid, 1234, "... is seen by the writer");

    w.ring(0).push(b"through the writer").unwrap();
    let mut out = Vec::new();
    assert_eq!(r.ring(0).pop(&mut out), shm_layout::Pop::Record);
    assert_eq!(out, b"through the writer");

    // Removing the name leaves both mappings working.
    drop(guard);
    assert!(matches!(
        Segment::open(writer.name().unwrap()),
        Err(OpenError::NotFound { .. })
    ));
    r.responses.put(ResponseKey(6), b"after unlink").unwrap();
    assert_eq!(w.responses.get(ResponseKey(6)).as_deref(), Some(&b"after unlink"[..]));
}

#[test]
fn a_copy_reads_the_segment_and_keeps_its_writes_to_itself() {
    let (guard, segment) = create_shm("copy", &small_plan());
    let t = segment.tables();
    t.responses.put(ResponseKey(1), b"in the segment").unwrap();
    assert!(!segment.discard_copy_writes(), "the segment is no copy");

    let copy = Segment::open_copy(&guard.name).expect("open a copy");
    assert_eq!(copy.header(), segment.header());
    let c = copy.tables();
    assert_eq!(c.responses.get(ResponseKey(1)).as_deref(), Some(&b"in the segment"[..]));
    c.responses.put(ResponseKey(2), b"in the copy").unwrap();
    assert_eq!(c.responses.get(ResponseKey(2)).as_deref(), Some(&b"in the copy"[..]));
    assert_eq!(
        t.responses.get(ResponseKey(2)),
        None,
        "the segment never sees the copy's writes"
    );

    // Discarded, the copy reads the segment again, what it wrote since too.
    t.responses.put(ResponseKey(3), b"written later").unwrap();
    assert!(copy.discard_copy_writes());
    assert_eq!(c.responses.get(ResponseKey(2)), None);
    assert_eq!(c.responses.get(ResponseKey(3)).as_deref(), Some(&b"written later"[..]));

    // It is validated as an open is.
    segment.raw_words()[VERSION_WORD].fetch_add(1, Ordering::Relaxed);
    assert!(matches!(
        Segment::open_copy(&guard.name),
        Err(OpenError::VersionMismatch { .. })
    ));
}
