//! The `semlb` commands other than the gateway's own processes: each
//! subcommand's work, one file each, called from `main` with its parsed
//! arguments ([`crate::cli`]).
//!
//! | module | command |
//! | --- | --- |
//! | [`shm`] | `semlb shm create / inspect / remove` over [`shm_layout::Segment`] |
//! | [`report`] | a snapshot of a segment, rendered as text or JSON (for `shm inspect`, `demo`, `status`) |
//! | [`demo`] | `semlb demo`: synthetic conversations routed through a throw-away segment |
//! | [`status`] | `semlb status`: a live view of a running gateway from its segment |
//! | [`keys`] | `semlb keys`: add, list and revoke the clients' API keys |
//! | [`tokenize`] | `semlb tokenize`: a request's prompt text, segments, token ids, block hashes and their holders |

pub mod demo;
pub mod keys;
pub mod report;
pub mod shm;
pub mod status;
pub mod tokenize;
