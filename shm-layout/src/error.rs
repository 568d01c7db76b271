//! Error enums, one per operation, in the style of iceoryx2: each names what
//! went wrong precisely enough for an operator to act on it.
//!
//! Cache misses are not errors: lookups return `Option`s or outcome enums.

use std::io;

/// Why a segment could not be planned for the requested size.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// Below the smallest segment that holds every region.
    #[error("shm size {requested} bytes is too small: at least {min} bytes are needed")]
    TooSmall {
        /// The size asked for.
        requested: u64,
        /// The smallest size accepted.
        min: u64,
    },
    /// Above the largest segment this layout version addresses.
    #[error("shm size {requested} bytes is too large: at most {max} bytes are supported")]
    TooLarge {
        /// The size asked for.
        requested: u64,
        /// The largest size accepted.
        max: u64,
    },
    /// The fraction of the response log one value may take is out of range.
    #[error("max response fraction {value} is out of range: it must be in (0, 0.5]")]
    BadResponseFraction {
        /// The fraction asked for.
        value: f64,
    },
}

/// A segment name that POSIX `shm_open` would not accept as a portable name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid shm name {name:?}: {reason}")]
pub struct NameError {
    /// The name as given.
    pub name: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

/// Why a new segment could not be created.
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    /// The name is not a valid shm name.
    #[error(transparent)]
    Name(#[from] NameError),
    /// The size does not give a valid layout.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A segment of that name exists already (another supervisor, or a
    /// leftover of a crashed one: `semlb shm inspect` tells which).
    #[error("shm segment {name:?} already exists")]
    AlreadyExists {
        /// The segment name.
        name: String,
    },
    /// Not allowed to create objects in /dev/shm.
    #[error("permission denied creating shm segment {name:?}")]
    PermissionDenied {
        /// The segment name.
        name: String,
    },
    /// /dev/shm cannot hold the segment: caught at start, never as SIGBUS later.
    #[error(
        "not enough shared memory for segment {name:?}: {requested} bytes requested, {available} bytes free in /dev/shm"
    )]
    NoSpace {
        /// The segment name.
        name: String,
        /// Bytes asked for.
        requested: u64,
        /// Bytes free in the shm file system when it failed.
        available: u64,
    },
    /// This CPU has no lock-free 128-bit compare-and-swap.
    #[error("this CPU has no lock-free 128-bit atomics (cmpxchg16b); semlb's shm tables need them")]
    Unsupported,
    /// Any other operating-system error, with the step that failed.
    #[error("creating shm segment {name:?}: {step}: {source}")]
    Os {
        /// The segment name.
        name: String,
        /// Which system call failed.
        step: &'static str,
        /// The error.
        source: io::Error,
    },
}

/// Why an existing segment could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The name is not a valid shm name.
    #[error(transparent)]
    Name(#[from] NameError),
    /// No segment of that name.
    #[error("shm segment {name:?} does not exist")]
    NotFound {
        /// The segment name.
        name: String,
    },
    /// The segment belongs to another user or has other permissions.
    #[error("permission denied opening shm segment {name:?}")]
    PermissionDenied {
        /// The segment name.
        name: String,
    },
    /// The segment is readable by group or others: semlb never creates such
    /// a segment, so somebody changed it; refuse to trust its contents.
    #[error("shm segment {name:?} has mode {mode:#o}; semlb requires 0600")]
    InsecureMode {
        /// The segment name.
        name: String,
        /// The permission bits found.
        mode: u32,
    },
    /// Smaller than a header: not a semlb segment.
    #[error("shm segment {name:?} is {bytes} bytes, too small to be a semlb segment")]
    Truncated {
        /// The segment name.
        name: String,
        /// Its size.
        bytes: u64,
    },
    /// The first word is not semlb's magic.
    #[error("shm segment {name:?} is not a semlb segment (magic {found:#018x})")]
    BadMagic {
        /// The segment name.
        name: String,
        /// The word found where the magic belongs.
        found: u64,
    },
    /// Written by a semlb with another layout.
    #[error("shm segment {name:?} has layout version {found}, this semlb expects {expected}")]
    VersionMismatch {
        /// The segment name.
        name: String,
        /// Version in the segment.
        found: u64,
        /// Version this build writes.
        expected: u64,
    },
    /// The creator has not finished initialising it (or died doing so).
    #[error("shm segment {name:?} is not ready (its creator, pid {creator_pid}, has not finished initialising it)")]
    NotReady {
        /// The segment name.
        name: String,
        /// Pid recorded by the creator.
        creator_pid: u64,
    },
    /// The header's size disagrees with the object's size.
    #[error("shm segment {name:?}: header says {header} bytes but the object has {actual}")]
    SizeMismatch {
        /// The segment name.
        name: String,
        /// Size recorded in the header.
        header: u64,
        /// Size of the shm object.
        actual: u64,
    },
    /// The header fails its checksum or describes impossible regions.
    #[error("shm segment {name:?} has a corrupt header: {reason}")]
    Corrupt {
        /// The segment name.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// This CPU has no lock-free 128-bit compare-and-swap.
    #[error("this CPU has no lock-free 128-bit atomics (cmpxchg16b); semlb's shm tables need them")]
    Unsupported,
    /// Any other operating-system error, with the step that failed.
    #[error("opening shm segment {name:?}: {step}: {source}")]
    Os {
        /// The segment name.
        name: String,
        /// Which system call failed.
        step: &'static str,
        /// The error.
        source: io::Error,
    },
}

/// Why a segment could not be removed.
#[derive(Debug, thiserror::Error)]
pub enum RemoveError {
    /// The name is not a valid shm name.
    #[error(transparent)]
    Name(#[from] NameError),
    /// No segment of that name.
    #[error("shm segment {name:?} does not exist")]
    NotFound {
        /// The segment name.
        name: String,
    },
    /// Any other operating-system error.
    #[error("removing shm segment {name:?}: {source}")]
    Os {
        /// The segment name.
        name: String,
        /// The error.
        source: io::Error,
    },
}

/// Why a supervisor could not claim a segment ([`crate::Segment::claim`]).
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// The name is not a valid shm name.
    #[error(transparent)]
    Name(#[from] NameError),
    /// A live supervisor holds the segment's owner lock.
    #[error("shm segment {name:?} is in use by a running semlb supervisor{}", pid.map(|p| format!(" (pid {p})")).unwrap_or_default())]
    Owned {
        /// The segment name.
        name: String,
        /// The supervisor's pid, if its registry slot tells.
        pid: Option<u32>,
    },
    /// Processes of an earlier supervisor still use the segment.
    #[error(
        "shm segment {name:?} is still used by processes of an earlier supervisor after waiting {waited:?} for them to exit"
    )]
    MembersRemain {
        /// The segment name.
        name: String,
        /// How long the claim waited.
        waited: std::time::Duration,
    },
    /// The existing segment could not be opened.
    #[error(transparent)]
    Open(#[from] OpenError),
    /// A new segment could not be created.
    #[error(transparent)]
    Create(#[from] CreateError),
    /// Any other operating-system error, with the step that failed.
    #[error("claiming shm segment {name:?}: {step}: {source}")]
    Os {
        /// The segment name.
        name: String,
        /// Which system call failed.
        step: &'static str,
        /// The error.
        source: io::Error,
    },
}
