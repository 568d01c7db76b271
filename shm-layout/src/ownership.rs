//! Who uses a segment: the supervisor that owns it and the processes that
//! belong to it, as open-file-description locks on the shm object
//! (`F_OFD_SETLK`), never as pids compared.
//!
//! ```text
//! shm object byte 0: OWNER lock  (write)  held by the live supervisor
//! shm object byte 1: MEMBER lock (read)   held by each of its children
//! ```
//!
//! The kernel drops a lock when the last descriptor of its open file
//! description closes, which happens when its process dies, however it
//! dies. So a lock is held exactly while its holder lives: a reused pid
//! cannot look like a live supervisor, and a segment whose lock is free
//! has no supervisor, whatever its header says. Locks belong to the open
//! file description, not the process: a descriptor passed to another
//! process (inherited across exec, or sent over a socket) carries its lock
//! with it, which is how an upgrade hands a segment over.
//!
//! A starting supervisor takes the owner lock ([`Segment::claim`]): if it
//! is held, the segment is in use and the start is refused. Holding it,
//! the supervisor waits until no member lock is left (children of a
//! previous supervisor still draining), so that when it adopts the segment
//! every process that wrote to it is gone and what they left (in-flight
//! counts, registry slots) may be reclaimed. Then it either adopts the
//! segment, if it was made by this layout with the same plan, or replaces
//! it, saying why ([`Claim`]).
//!
//! [`Segment::claim`]: crate::Segment::claim

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{FcntlArg, fcntl};

use nix::sys::mman::shm_unlink;

use crate::error::{ClaimError, CreateError, OpenError};
use crate::plan::LayoutPlan;
use crate::segment::{Segment, create_object, open_object, owner_pid, shm_path};

/// The byte of the shm object the owner lock covers.
const OWNER_BYTE: i64 = 0;
/// The byte of the shm object the member locks cover.
const MEMBER_BYTE: i64 = 1;
/// How often [`Ownership::wait_for_members`] looks again.
const MEMBER_POLL: Duration = Duration::from_millis(20);

/// A lock of one byte of an open shm object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lock {
    Read,
    Write,
}

impl Lock {
    /// The `flock` record of this lock on byte `byte` (`l_pid` 0, as OFD
    /// locks need).
    fn on_byte(self, byte: i64) -> libc::flock {
        // SAFETY: `flock` is a plain C struct for which all-zero is a valid
        // value; the fields that matter are set below.
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = match self {
            Lock::Read => libc::F_RDLCK,
            Lock::Write => libc::F_WRLCK,
        } as libc::c_short;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
        fl.l_start = byte;
        fl.l_len = 1;
        fl
    }
}

/// Sets `lock` on byte `byte` of `fd`'s object, without waiting
/// (`wait == false`: `Ok(false)` if another description holds a
/// conflicting lock) or waiting for it.
fn set_lock(fd: BorrowedFd<'_>, byte: i64, lock: Lock, wait: bool) -> Result<bool, Errno> {
    let fl = lock.on_byte(byte);
    loop {
        let arg = if wait {
            FcntlArg::F_OFD_SETLKW(&fl)
        } else {
            FcntlArg::F_OFD_SETLK(&fl)
        };
        match fcntl(fd, arg) {
            Ok(_) => return Ok(true),
            Err(Errno::EAGAIN | Errno::EACCES) if !wait => return Ok(false),
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Whether byte `byte` of `fd`'s object is free of locks that conflict
/// with `lock` (held by other open file descriptions).
fn is_free(fd: BorrowedFd<'_>, byte: i64, lock: Lock) -> Result<bool, Errno> {
    let mut fl = lock.on_byte(byte);
    fcntl(fd, FcntlArg::F_OFD_GETLK(&mut fl))?;
    Ok(fl.l_type == libc::F_UNLCK as libc::c_short)
}

/// The owner lock of one segment, held for as long as this value (or a
/// descriptor duplicated from [`Ownership::fd`]) lives.
#[derive(Debug)]
pub struct Ownership {
    fd: OwnedFd,
    name: String,
}

impl Ownership {
    /// Takes the owner lock on the open shm object `fd` (named `name`),
    /// without waiting: `Ok(None)` if a live supervisor holds it.
    pub(crate) fn try_take(fd: OwnedFd, name: &str) -> Result<Option<Self>, ClaimError> {
        match set_lock(fd.as_fd(), OWNER_BYTE, Lock::Write, false) {
            Ok(true) => Ok(Some(Self {
                fd,
                name: name.to_owned(),
            })),
            Ok(false) => Ok(None),
            Err(e) => Err(ClaimError::Os {
                name: name.to_owned(),
                step: "fcntl(F_OFD_SETLK)",
                source: e.into(),
            }),
        }
    }

    /// Takes the owner lock of the existing segment `name`, without
    /// waiting; [`ClaimError::Owned`] if a live supervisor holds it. For
    /// tools that must not touch a segment in use (`semlb shm remove`).
    pub fn take(name: &str) -> Result<Self, ClaimError> {
        let path = shm_path(name)?;
        let fd = open_object(&path)?;
        Self::try_take(fd, &path)?.ok_or_else(|| ClaimError::Owned {
            pid: owner_pid(&path),
            name: path,
        })
    }

    /// The ownership carried by `fd`, a descriptor of the segment `name`
    /// handed over by the supervisor that owns it (an upgrade: the same
    /// open file description, so the same lock). Checks that `fd` is that
    /// segment's object and that no other description holds the lock.
    pub fn inherit(fd: OwnedFd, name: &str) -> Result<Self, ClaimError> {
        let path = shm_path(name)?;
        let named = open_object(&path)?;
        let os = |step: &'static str, e: Errno| ClaimError::Os {
            name: path.clone(),
            step,
            source: e.into(),
        };
        let (a, b) = (
            nix::sys::stat::fstat(&fd).map_err(|e| os("fstat", e))?,
            nix::sys::stat::fstat(&named).map_err(|e| os("fstat", e))?,
        );
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino) {
            return Err(os("the inherited descriptor is another object", Errno::EBADF));
        }
        Self::try_take(fd, &path)?.ok_or_else(|| ClaimError::Owned {
            pid: owner_pid(&path),
            name: path.clone(),
        })
    }

    /// Waits up to `patience` until no process holds a member lock (the
    /// children of an earlier supervisor have exited); returns how long
    /// it waited, or [`ClaimError::MembersRemain`].
    pub fn wait_for_members(&self, patience: Duration) -> Result<Duration, ClaimError> {
        let start = Instant::now();
        loop {
            match is_free(self.fd.as_fd(), MEMBER_BYTE, Lock::Write) {
                Ok(true) => return Ok(start.elapsed()),
                Ok(false) if start.elapsed() < patience => std::thread::sleep(MEMBER_POLL),
                Ok(false) => {
                    return Err(ClaimError::MembersRemain {
                        name: self.name.clone(),
                        waited: start.elapsed(),
                    });
                }
                Err(e) => {
                    return Err(ClaimError::Os {
                        name: self.name.clone(),
                        step: "fcntl(F_OFD_GETLK)",
                        source: e.into(),
                    });
                }
            }
        }
    }

    /// The segment's name, with its leading `/`.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// A member lock: held by each process a supervisor starts, so that a
/// later supervisor knows when they are all gone.
#[derive(Debug)]
pub struct Membership {
    _fd: OwnedFd,
}

impl Membership {
    /// Joins the segment `name` as a member, for as long as the value
    /// lives (or the process does).
    pub fn join(name: &str) -> Result<Self, OpenError> {
        let path = shm_path(name)?;
        let fd = open_object(&path)?;
        // A read lock waits only while a starting supervisor checks for
        // members, a few system calls.
        set_lock(fd.as_fd(), MEMBER_BYTE, Lock::Read, true).map_err(|e| OpenError::Os {
            name: path.clone(),
            step: "fcntl(F_OFD_SETLKW)",
            source: e.into(),
        })?;
        Ok(Self { _fd: fd })
    }
}

/// Whether a live supervisor holds the owner lock of the segment `name`
/// (`None` if there is no such segment or it cannot be opened).
pub fn is_owned(name: &str) -> Option<bool> {
    let path = shm_path(name).ok()?;
    let fd = open_object(&path).ok()?;
    is_free(fd.as_fd(), OWNER_BYTE, Lock::Write).ok().map(|free| !free)
}

/// The raw descriptor of an ownership, for passing it on (kept here so the
/// lock's representation stays private).
impl AsRawFd for Ownership {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.fd.as_raw_fd()
    }
}

/// How [`Segment::claim`] came by its segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// There was none: a new, empty segment.
    Created,
    /// The segment an earlier supervisor left, kept with its tables,
    /// after waiting `waited` for that supervisor's children to exit.
    Adopted {
        /// How long the children of the earlier supervisor took to exit.
        waited: Duration,
    },
    /// An earlier segment that could not be kept, replaced by an empty one.
    Replaced {
        /// Why it could not be kept, in one sentence.
        reason: String,
    },
}

/// A segment a supervisor claimed, with the lock that makes it the owner.
#[derive(Debug)]
pub struct Claimed {
    /// The segment.
    pub segment: Segment,
    /// The owner lock: dropping it gives the segment up.
    pub ownership: Ownership,
    /// Whether it is new, adopted or a replacement.
    pub claim: Claim,
}

/// Attempts before [`Segment::claim`] gives up on starters racing it.
const CLAIM_ATTEMPTS: usize = 8;

impl Segment {
    /// Claims the shm segment `name` for a starting supervisor: takes its
    /// owner lock ([`ClaimError::Owned`] if a live supervisor holds it),
    /// waits up to `patience` for processes of an earlier supervisor to
    /// leave, then adopts the segment if it has `plan`'s layout (this
    /// layout version, the same size and regions), and otherwise replaces
    /// it with a new one, saying why. With no segment of that name, it
    /// creates one.
    pub fn claim(name: &str, plan: &LayoutPlan, patience: Duration) -> Result<Claimed, ClaimError> {
        let path = shm_path(name)?;
        for _ in 0..CLAIM_ATTEMPTS {
            let fd = match open_object(&path) {
                Ok(fd) => fd,
                Err(OpenError::NotFound { .. }) => match create_owned(&path, plan)? {
                    Some((segment, ownership)) => {
                        return Ok(Claimed {
                            segment,
                            ownership,
                            claim: Claim::Created,
                        });
                    }
                    None => continue,
                },
                Err(e) => return Err(e.into()),
            };
            let Some(ownership) = Ownership::try_take(fd, &path)? else {
                return Err(ClaimError::Owned {
                    pid: owner_pid(&path),
                    name: path,
                });
            };
            let waited = ownership.wait_for_members(patience)?;
            let reason = match Segment::open_object(&ownership.fd, &path) {
                Ok(segment) => match unlike(&segment, plan) {
                    None => {
                        return Ok(Claimed {
                            segment,
                            ownership,
                            claim: Claim::Adopted { waited },
                        });
                    }
                    Some(reason) => reason,
                },
                Err(e) => e.to_string(),
            };
            // The old object stays locked (by `ownership`) until the new one
            // is: a starter racing this one finds either no name or a
            // locked object.
            match shm_unlink(path.as_str()) {
                Ok(()) | Err(Errno::ENOENT) => {}
                Err(e) => {
                    return Err(ClaimError::Os {
                        name: path,
                        step: "shm_unlink",
                        source: e.into(),
                    });
                }
            }
            if let Some((segment, ownership)) = create_owned(&path, plan)? {
                return Ok(Claimed {
                    segment,
                    ownership,
                    claim: Claim::Replaced { reason },
                });
            }
        }
        Err(ClaimError::Os {
            name: path,
            step: "claim",
            source: std::io::Error::other("other processes kept creating and removing the segment"),
        })
    }
}

/// Creates the segment at `path` and takes its owner lock before laying
/// it out; `None` if another starter created it first (or locked it
/// first).
fn create_owned(path: &str, plan: &LayoutPlan) -> Result<Option<(Segment, Ownership)>, ClaimError> {
    let fd = match create_object(path) {
        Ok(fd) => fd,
        Err(CreateError::AlreadyExists { .. }) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let Some(ownership) = Ownership::try_take(fd, path)? else {
        return Ok(None);
    };
    let segment = Segment::format_object(&ownership.fd, path, plan)?;
    Ok(Some((segment, ownership)))
}

/// Why `segment` cannot be adopted for `plan`, if it cannot.
fn unlike(segment: &Segment, plan: &LayoutPlan) -> Option<String> {
    let header = segment.header();
    if header.segment_bytes != plan.segment_bytes() {
        Some(format!(
            "it is {} bytes, and this start asks for {} (shm_size changed)",
            header.segment_bytes,
            plan.segment_bytes()
        ))
    } else if header.regions != *plan.regions() {
        Some("its regions are laid out for other settings (response_cache.max_value_fraction changed)".to_owned())
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LayoutPlan, Segment};

    fn unique(tag: &str) -> String {
        format!("semlb-own-{tag}-{}", std::process::id())
    }

    struct Removed(String);
    impl Drop for Removed {
        fn drop(&mut self) {
            let _ = Segment::remove(&self.0);
        }
    }

    #[test]
    fn one_owner_at_a_time_and_the_lock_goes_with_its_holder() {
        let name = unique("one");
        let _guard = Removed(name.clone());
        let plan = LayoutPlan::for_size(8 << 20).unwrap();
        let _segment = Segment::create(&name, &plan).unwrap();
        assert_eq!(is_owned(&name), Some(false));
        let first = Ownership::take(&name).unwrap();
        assert_eq!(is_owned(&name), Some(true));
        // Another open file description, even in the same process, is refused.
        assert!(matches!(Ownership::take(&name), Err(ClaimError::Owned { .. })));
        drop(first);
        assert_eq!(is_owned(&name), Some(false));
        let _second = Ownership::take(&name).unwrap();
        assert_eq!(is_owned("semlb-own-no-such-segment"), None);
    }

    #[test]
    fn members_hold_a_new_owner_until_they_leave() {
        let name = unique("members");
        let _guard = Removed(name.clone());
        let plan = LayoutPlan::for_size(8 << 20).unwrap();
        let _segment = Segment::create(&name, &plan).unwrap();
        let a = Membership::join(&name).unwrap();
        let b = Membership::join(&name).unwrap();
        let owner = Ownership::take(&name).unwrap();
        assert!(matches!(
            owner.wait_for_members(Duration::ZERO),
            Err(ClaimError::MembersRemain { .. })
        ));
        drop(a);
        assert!(owner.wait_for_members(Duration::ZERO).is_err(), "one member is left");
        let leaving = std::thread::spawn(move || drop(b));
        owner.wait_for_members(Duration::from_secs(10)).unwrap();
        leaving.join().unwrap();
        // Members may join an owned segment (the owner's own children).
        let _c = Membership::join(&name).unwrap();
    }

    #[test]
    fn a_claim_creates_adopts_and_replaces() {
        let name = unique("claim");
        let _guard = Removed(name.clone());
        let plan = LayoutPlan::for_size(8 << 20).unwrap();
        let patience = Duration::from_secs(5);
        let first = Segment::claim(&name, &plan, patience).unwrap();
        assert_eq!(first.claim, Claim::Created);
        let t = first.segment.tables();
        let server = t.servers.register(7, "http://10.0.0.1:8000", 0).unwrap();
        t.prefix.insert_chain(&[1, 2, 3], server, first.segment.clock().stamp());
        let seed = first.segment.header().seed;
        // Held: refused, naming no pid (no supervisor registered).
        assert!(matches!(
            Segment::claim(&name, &plan, patience),
            Err(ClaimError::Owned { pid: _, .. })
        ));
        drop(first);

        // Free: adopted with its tables and seed.
        let second = Segment::claim(&name, &plan, patience).unwrap();
        assert!(matches!(second.claim, Claim::Adopted { .. }), "{:?}", second.claim);
        assert_eq!(second.segment.header().seed, seed);
        let t = second.segment.tables();
        let m = t.prefix.longest_prefix_match(&[1, 2, 3], |s| t.servers.is_live(s));
        assert_eq!(m.best(), Some((server.tag(), 3)));
        drop(second);

        // Another size: replaced, empty, with the reason.
        let bigger = LayoutPlan::for_size(16 << 20).unwrap();
        let third = Segment::claim(&name, &bigger, patience).unwrap();
        let Claim::Replaced { reason } = &third.claim else {
            panic!("{:?}", third.claim)
        };
        assert!(reason.contains("shm_size changed"), "{reason}");
        assert_ne!(third.segment.header().seed, seed);
        assert_eq!(third.segment.tables().prefix.occupancy(), 0);
        drop(third);

        // Another layout version (the header's second word): replaced.
        let file = format!("/dev/shm/{name}");
        let mut bytes = std::fs::read(&file).unwrap();
        bytes[8..16].copy_from_slice(&(crate::LAYOUT_VERSION - 1).to_le_bytes());
        std::fs::write(&file, &bytes).unwrap();
        let fourth = Segment::claim(&name, &bigger, patience).unwrap();
        let Claim::Replaced { reason } = &fourth.claim else {
            panic!("{:?}", fourth.claim)
        };
        assert!(reason.contains("layout version"), "{reason}");
    }

    #[test]
    fn a_claim_waits_for_the_members_of_an_earlier_owner() {
        let name = unique("wait");
        let _guard = Removed(name.clone());
        let plan = LayoutPlan::for_size(8 << 20).unwrap();
        let first = Segment::claim(&name, &plan, Duration::ZERO).unwrap();
        let member = Membership::join(&name).unwrap();
        drop(first);
        assert!(matches!(
            Segment::claim(&name, &plan, Duration::ZERO),
            Err(ClaimError::MembersRemain { .. })
        ));
        drop(member);
        let again = Segment::claim(&name, &plan, Duration::ZERO).unwrap();
        assert!(matches!(again.claim, Claim::Adopted { .. }));
    }
}
