//! # semlb-test-support
//!
//! The one set of helpers the workspace's multi-process tests
//! (`tests/*.rs`), its criterion benches (`benches/*.rs`) and the
//! `semlb-bench` reports share, so that none of them keeps a copy:
//!
//! | module | what |
//! | --- | --- |
//! | [`attack`] | the figures of an attack: a well-behaved client's share answered and latencies ([`attack::Polite`]), restarts, each process's peak memory |
//! | [`process`] | a child of the `semlb` binary that prints its address ([`process::Proc`]), found next to the running executable ([`process::semlb_exe`]) |
//! | [`gateway`] | `semlb serve` in front of simulated engines ([`gateway::Gateway`], built with options by [`gateway::GatewayBuilder`]), chat requests, Prometheus text, SSE text |
//! | [`engines`] | simulated engines (`semlb __sim`) at a time scale, on an address, publishing KV events; what their first line says |
//! | [`http`] | a minimal HTTP/1.1 client, one request per connection |
//! | [`kube_api`] | a stand-in of the Kubernetes API server's list and watch (Pods, EndpointSlices, InferencePools) for discovery tests ([`kube_api::KubeApi`]), with object builders |
//! | [`keepalive`] | a blocking HTTP/1.1 client on one keep-alive connection, reconnecting when the server says `connection: close`, as agents' clients do |
//! | [`notify`] | the `$NOTIFY_SOCKET` a test owns in systemd's place: every datagram, and waits for lines |
//! | [`client`] | the async HTTP/1.1 client of in-process tests (a dispatcher or the simulator on the test's runtime), with deadlines |
//! | [`sse`] | server-sent events: framing checked, payloads and streamed text |
//! | [`redis`] | a private `redis-server` on a free port ([`redis::RedisServer`]) |
//! | [`llama`] | a real engine: llama.cpp's `llama-server` with SmolLM2-135M on a free port ([`llama::LlamaServer`]) |
//! | [`rng`] | splitmix64: deterministic randomness a failing run can be replayed from |
//! | [`segment`] | a uniquely named shm segment removed on drop, and table population |
//! | [`tls`] | certificate authorities and certificates made with `openssl`, HTTPS requests with a trusted CA and a client certificate |
//!
//! It depends on `shm-layout` but not on the `semlb` library: it starts the
//! gateway as a process, so any crate's tests can use it without a cycle.
//! Tests call the panicking short forms (`Proc::start`,
//! `GatewayBuilder::start`); the bench calls the `try_` forms, which return
//! an [`Error`].

pub mod attack;
pub mod client;
pub mod engines;
pub mod gateway;
pub mod http;
pub mod keepalive;
pub mod kube_api;
pub mod llama;
pub mod notify;
pub mod process;
pub mod redis;
pub mod rng;
pub mod segment;
pub mod sse;
pub mod tls;

pub use rng::{Rng, mix};

/// Why a process could not be started or did not become ready.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The running executable's path is unknown.
    #[error("cannot find the running executable: {0}")]
    CurrentExe(#[source] std::io::Error),
    /// No `semlb` binary next to the running executable.
    #[error(
        "no semlb binary at {} (build it with `cargo build -p semlb`, `--release` for target/release, or name it in $SEMLB_EXE)",
        .tried.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(" or ")
    )]
    NoSemlb {
        /// The paths looked at.
        tried: Vec<std::path::PathBuf>,
    },
    /// The program could not be started.
    #[error("cannot start {what}: {source}")]
    Spawn {
        /// What it is and its path.
        what: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// It printed no `http://ADDR` line (it exited, or took too long).
    #[error("{what} did not start: {why}{stderr}")]
    NoAddress {
        /// What it is.
        what: String,
        /// What went wrong.
        why: String,
        /// Its last stderr lines (`:\n  …`), when captured.
        stderr: String,
    },
    /// It started but did not become ready (`/health`, the admin API).
    #[error("{what}{stderr}")]
    NotReady {
        /// What it did not do.
        what: String,
        /// Its last stderr lines (`:\n  …`), when captured.
        stderr: String,
    },
    /// A file it needs could not be written.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// A private temporary directory, removed on drop.
pub struct TempDir(pub std::path::PathBuf);

impl TempDir {
    /// A new directory under the system's temporary directory.
    pub fn new(tag: &str) -> TempDir {
        let dir = std::env::temp_dir().join(process::unique("dir", tag));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A file removed when dropped.
pub struct TempFile(std::path::PathBuf);

impl TempFile {
    /// A new file `<unique>.toml` in the system's temporary directory with
    /// `contents`.
    pub fn try_new(tag: &str, contents: &str) -> Result<TempFile, Error> {
        let path = std::env::temp_dir().join(format!("{}.toml", process::unique("gw", tag)));
        std::fs::write(&path, contents).map_err(|source| Error::Write {
            path: path.clone(),
            source,
        })?;
        Ok(TempFile(path))
    }

    /// [`TempFile::try_new`], panicking on failure. For tests.
    pub fn new(tag: &str, contents: &str) -> TempFile {
        TempFile::try_new(tag, contents).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Its path, as text.
    pub fn path(&self) -> &str {
        self.0.to_str().expect("a UTF-8 temp path")
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
