//! A real inference engine per test: llama.cpp's `llama-server` with a
//! real small model (SmolLM2-135M), as `workers/recipes/llama-cpp/get.sh`
//! builds and fetches them, on a free loopback port, killed on drop.
//!
//! Where the engine is: `$LLAMA_SERVER` and `$LLAMA_MODEL` (what the
//! script prints, and `.ci/run` exports), else the script's cache under
//! `target/llama-cpp/`. Tests take `None` (after a loud message) when it is
//! not there, unless `$SEMLB_REQUIRE_LLAMA` is set (as in CI): then its
//! absence fails the test.

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
    /// Where `get.sh` put them, or `None` (after a loud message; a panic
    /// when `$SEMLB_REQUIRE_LLAMA` is set).
    pub fn find() -> Option<Self> {
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target"));
        let cached = target.join("llama-cpp");
        let install = Self {
            server: std::env::var_os("LLAMA_SERVER")
                .map_or_else(|| cached.join("build/bin/llama-server"), PathBuf::from),
            model: std::env::var_os("LLAMA_MODEL")
                .map_or_else(|| cached.join("SmolLM2-135M-Instruct.Q4_1.gguf"), PathBuf::from),
        };
        if install.server.is_file() && install.model.is_file() {
            return Some(install);
        }
        let why = format!(
            "no llama.cpp engine at {} and {} (run workers/recipes/llama-cpp/get.sh)",
            install.server.display(),
            install.model.display()
        );
        assert!(std::env::var_os("SEMLB_REQUIRE_LLAMA").is_none(), "{why}");
        // Straight to the process's stderr: a skip must not be silent.
        let _ = writeln!(std::io::stderr(), "SKIPPED: {why}");
        None
    }
}

/// A running `llama-server`, killed on drop.
pub struct LlamaServer {
    child: Child,
    /// `127.0.0.1:<port>`.
    pub addr: String,
}

impl LlamaServer {
    /// The engine as `.ci/run` and the recipe start it (one thread, two
    /// slots, 4 096 tokens of context, metrics on), once `/health` answers
    /// 200 (at most 120 s: it loads the model first).
    pub fn start(install: &LlamaInstall) -> Self {
        let port = free_port();
        let child = Command::new(&install.server)
            .arg("-m")
            .arg(&install.model)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["-t", "1", "-np", "2", "-c", "4096", "--metrics"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", install.server.display()));
        let mut server = Self {
            child,
            addr: format!("127.0.0.1:{port}"),
        };
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if http(&server.addr, "GET", "/health", None, &[]).is_ok_and(|r| r.status == 200) {
                return server;
            }
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!("llama-server on port {port} exited: {status}");
            }
            assert!(
                Instant::now() < deadline,
                "llama-server on port {port} not healthy after 120 s"
            );
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
