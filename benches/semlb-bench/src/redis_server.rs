//! The Redis a benchmark talks to: a private `redis-server` on a free
//! loopback port (`semlb-test-support`'s [`RedisServer`]: no persistence,
//! killed when dropped), or one the user names with `--redis-url`.

use anyhow::{Context, Result};
use semlb_test_support::redis::RedisServer;

use super::Common;

/// A Redis for one benchmark run.
pub struct BenchRedis {
    url: String,
    _server: Option<RedisServer>,
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
                _server: None,
            }));
        }
        let server = RedisServer::try_start(&common.redis_server)
            .context("install Debian's redis-server, pass --redis-url, or --no-redis")?;
        Ok(Some(Self {
            url: server.url(),
            _server: Some(server),
        }))
    }

    /// Its URL.
    pub fn url(&self) -> &str {
        &self.url
    }
}
