//! The Redis a benchmark talks to: a private `redis-server` on a free
//! loopback port (no persistence, killed when dropped), or one the user
//! names with `--redis-url`.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::Common;

/// A Redis for one benchmark run.
#[derive(Debug)]
pub struct BenchRedis {
    url: String,
    child: Option<Child>,
}

impl BenchRedis {
    /// The Redis `common` asks for: `None` with `--no-redis`, the given URL,
    /// or a private server (an error if `redis-server` cannot be started).
    pub fn for_run(common: &Common) -> Result<Option<Self>> {
        if common.no_redis {
            return Ok(None);
        }
        if let Some(url) = &common.redis_url {
            return Ok(Some(Self {
                url: url.clone(),
                child: None,
            }));
        }
        Self::start(&common.redis_server).map(Some)
    }

    /// Starts `binary` on a free loopback port and waits until it answers.
    pub fn start(binary: &Path) -> Result<Self> {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let child = Command::new(binary)
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| {
                format!(
                    "cannot start {} (install Debian's redis-server, pass --redis-url, or --no-redis)",
                    binary.display()
                )
            })?;
        let mut redis = Self {
            url: format!("redis://127.0.0.1:{port}/"),
            child: Some(child),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if redis.ping() {
                return Ok(redis);
            }
            if let Some(status) = redis.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                bail!("{} exited at start: {status}", binary.display());
            }
            if Instant::now() > deadline {
                bail!("{} did not answer on port {port} within 10 s", binary.display());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Its URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// True when it answers `PING`.
    pub fn ping(&self) -> bool {
        let Ok(client) = redis::Client::open(self.url.as_str()) else {
            return false;
        };
        client
            .get_connection_with_timeout(Duration::from_millis(200))
            .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
            .is_ok()
    }
}

impl Drop for BenchRedis {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
