//! A real inference engine per test: llama.cpp's `llama-server` with a
//! real small model (SmolLM2-135M), as `workers/recipes/llama-cpp/get.sh`
//! builds and fetches them, on a free loopback port, killed on drop.
//!
//! Where the engine is: `$LLAMA_SERVER` and `$LLAMA_MODEL` (what the
//! script prints, and `.ci/run` exports), else the script's cache under
//! `target/llama-cpp/`. When neither has it, the first test that asks runs
//! the script itself (once: the others wait on a lock; about 7 minutes on
//! 2 cores, then cached), so that `cargo test --workspace` on a fresh
//! machine tests against the real engine too. `$SEMLB_NO_LLAMA_BUILD`
//! turns that off. Tests take `None` (after a loud message naming the one
//! command that enables them) when the engine is still not there, unless
//! `$SEMLB_REQUIRE_LLAMA` is set (as in CI): then its absence fails the
//! test.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::http::http;
use crate::redis::free_port;

/// The engine binary and the model file.
#[derive(Debug, Clone)]
pub struct LlamaInstall {
    /// `llama-server`.
    pub server: PathBuf,
    /// The GGUF model (also the gateway's `--tokenizer`).
    pub model: PathBuf,
}

impl LlamaInstall {
    /// Where the engine should be: `$LLAMA_SERVER` and `$LLAMA_MODEL`,
    /// else `get.sh`'s cache under the target directory (which may not
    /// hold them yet: see [`is_there`](Self::is_there)).
    pub fn located() -> Self {
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| workspace().join("target"));
        let cached = target.join("llama-cpp");
        Self {
            server: std::env::var_os("LLAMA_SERVER")
                .map_or_else(|| cached.join("build/bin/llama-server"), PathBuf::from),
            model: std::env::var_os("LLAMA_MODEL")
                .map_or_else(|| cached.join("SmolLM2-135M-Instruct.Q4_1.gguf"), PathBuf::from),
        }
    }

    /// Whether both files exist.
    pub fn is_there(&self) -> bool {
        self.server.is_file() && self.model.is_file()
    }

    /// Where `get.sh` put them ([`located`](Self::located)), or `None`
    /// (after a loud message; a panic when `$SEMLB_REQUIRE_LLAMA` is set).
    pub fn find() -> Option<Self> {
        let install = Self::located();
        if install.is_there() {
            return Some(install);
        }
        let given = std::env::var_os("LLAMA_SERVER").is_some() || std::env::var_os("LLAMA_MODEL").is_some();
        if !given
            && std::env::var_os("SEMLB_NO_LLAMA_BUILD").is_none()
            && let Some(built) = Self::build()
        {
            return Some(built);
        }
        let why = format!(
            "no llama.cpp engine at {} and {}: the real-engine tests need it; \
             `workers/recipes/llama-cpp/get.sh` builds it (log of the last try: target/llama-cpp/get.log)",
            install.server.display(),
            install.model.display()
        );
        assert!(std::env::var_os("SEMLB_REQUIRE_LLAMA").is_none(), "{why}");
        // Straight to the process's stderr: a skip must not be silent.
        let _ = writeln!(std::io::stderr(), "SKIPPED: {why}");
        None
    }
}

/// The workspace's root (this crate is `tests/support`).
fn workspace() -> PathBuf {
    let here = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    here.ancestors().nth(2).unwrap_or(here).to_path_buf()
}

/// A failed build is not tried again by other tests within this long (a
/// test run), but is by a later run.
const RETRY_FAILED_BUILD: Duration = Duration::from_secs(30 * 60);

impl LlamaInstall {
    /// Runs `workers/recipes/llama-cpp/get.sh` into the cache under the
    /// target directory, once for all the tests of all the test binaries
    /// running now: the first takes a file lock and builds, the others wait
    /// for it and then find the engine (or the failure it left).
    fn build() -> Option<Self> {
        let cached = Self::located().server.ancestors().nth(3)?.to_path_buf();
        std::fs::create_dir_all(&cached).ok()?;
        let lock = std::fs::File::create(cached.join(".get.lock")).ok()?;
        lock.lock().ok()?;
        let install = Self::located();
        if install.is_there() {
            return Some(install);
        }
        let failed = cached.join("get.failed");
        let recent = |p: &std::path::Path| {
            std::fs::metadata(p)
                .and_then(|m| m.modified())
                .is_ok_and(|t| t.elapsed().is_ok_and(|age| age < RETRY_FAILED_BUILD))
        };
        if recent(&failed) {
            return None;
        }
        let script = workspace().join("workers/recipes/llama-cpp/get.sh");
        let log_path = cached.join("get.log");
        let _ = writeln!(
            std::io::stderr(),
            "building llama.cpp's llama-server for the real-engine tests, once (about 7 minutes on 2 cores; \
             cached in {}; log {}; SEMLB_NO_LLAMA_BUILD=1 skips it)",
            cached.display(),
            log_path.display()
        );
        let log = std::fs::File::create(&log_path).ok()?;
        let status = Command::new("bash")
            .arg(&script)
            .env("SEMLB_LLAMA_DIR", &cached)
            .stdin(Stdio::null())
            .stdout(log.try_clone().ok()?)
            .stderr(log)
            .status();
        let install = Self::located();
        if status.is_ok_and(|s| s.success()) && install.is_there() {
            let _ = std::fs::remove_file(&failed);
            return Some(install);
        }
        let _ = std::fs::write(&failed, b"see get.log\n");
        None
    }
}

/// A running `llama-server`, killed on drop.
pub struct LlamaServer {
    child: Child,
    /// `127.0.0.1:<port>`.
    pub addr: String,
}

/// How a [`LlamaServer`] is started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LlamaOptions {
    /// CPU threads (`-t`).
    pub threads: u32,
    /// Parallel slots (`-np`): requests decoded together.
    pub slots: u32,
    /// Context tokens shared by the slots (`-c`).
    pub context: u32,
}

impl Default for LlamaOptions {
    /// As `.ci/run` and the recipe start it: one thread, two slots, 4 096
    /// tokens of context.
    fn default() -> Self {
        Self {
            threads: 1,
            slots: 2,
            context: 4096,
        }
    }
}

impl LlamaServer {
    /// The engine with [`LlamaOptions::default`] and metrics on, once
    /// `/health` answers 200; panics if it does not come up.
    pub fn start(install: &LlamaInstall) -> Self {
        Self::try_start_with(install, &LlamaOptions::default()).unwrap_or_else(|e| panic!("{e}"))
    }

    /// The engine with `options` and metrics on, once `/health` answers
    /// 200 (at most 120 s: it loads the model first).
    pub fn try_start_with(install: &LlamaInstall, options: &LlamaOptions) -> Result<Self, String> {
        let port = free_port();
        let child = Command::new(&install.server)
            .arg("-m")
            .arg(&install.model)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["-t", &options.threads.to_string(), "-np", &options.slots.to_string()])
            .args(["-c", &options.context.to_string(), "--metrics"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", install.server.display()))?;
        let mut server = Self {
            child,
            addr: format!("127.0.0.1:{port}"),
        };
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if http(&server.addr, "GET", "/health", None, &[]).is_ok_and(|r| r.status == 200) {
                return Ok(server);
            }
            if let Ok(Some(status)) = server.child.try_wait() {
                return Err(format!("llama-server on port {port} exited: {status}"));
            }
            if Instant::now() >= deadline {
                return Err(format!("llama-server on port {port} not healthy after 120 s"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills it with SIGKILL and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        self.kill();
    }
}
