//! A [`RedisStore`]: the routing state in one Redis server under one
//! namespace, over one synchronous connection. Opening it (the scripts
//! loaded on every new connection), its keys, and every round trip it
//! makes: counted, with the connection dropped when a failure may leave it
//! out of step and a script reloaded on `NOSCRIPT`. The operations are in
//! the files of their concern (prefix entries, responses, in-flight
//! counts, the one-round-trip pipelines of [`super::client`]).

use std::time::Duration;

use redis::{Cmd, Connection, ErrorKind, FromRedisValue, RedisError, Script, Value};

use super::error::StoreError;
use super::scripts::{INSERT_SCRIPT, LPM_SCRIPT, PUBLISH_SCRIPT, SUM_SCRIPT};
use super::server_id::ServerId;

/// Connect, read and write timeout of [`RedisStore::connect`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(200);

/// A unique name for this process as an in-flight owner: host, pid and a
/// random part (a restarted process with a reused pid is another owner).
pub fn owner_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let host = host.trim();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let random = seahash::hash(&[nanos.to_le_bytes(), u64::from(std::process::id()).to_le_bytes()].concat());
    format!(
        "{}:{}:{:08x}",
        if host.is_empty() { "host" } else { host },
        std::process::id(),
        random as u32
    )
}

/// The routing state in one Redis server, under one namespace.
///
/// One connection, used synchronously; open one store per thread.
pub struct RedisStore {
    pub(super) client: redis::Client,
    pub(super) conn: Option<Connection>,
    pub(super) namespace: String,
    pub(super) ttl: Duration,
    pub(super) timeout: Duration,
    pub(super) insert: Script,
    pub(super) lpm: Script,
    pub(super) publish: Script,
    pub(super) sum: Script,
    pub(super) owner: String,
    /// This process's in-flight counts: (server, requests, tokens).
    pub(super) counts: Vec<(ServerId, i64, i64)>,
    pub(super) round_trips: u64,
    pub(super) connects: u64,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("namespace", &self.namespace)
            .field("ttl", &self.ttl)
            .field("timeout", &self.timeout)
            .field("connected", &self.conn.is_some())
            .field("round_trips", &self.round_trips)
            .field("connects", &self.connects)
            .finish()
    }
}

/// `d` in whole milliseconds, at least 1 (what `PX` and `PEXPIRE` take).
pub(super) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl RedisStore {
    /// A store through `client` that has not connected yet (it connects
    /// at its first round trip).
    fn unconnected(client: redis::Client, namespace: &str, ttl: Duration, timeout: Duration) -> Self {
        Self {
            client,
            conn: None,
            namespace: namespace.to_owned(),
            ttl,
            timeout: timeout.max(Duration::from_millis(1)),
            insert: Script::new(INSERT_SCRIPT),
            lpm: Script::new(LPM_SCRIPT),
            publish: Script::new(PUBLISH_SCRIPT),
            sum: Script::new(SUM_SCRIPT),
            owner: owner_id(),
            counts: Vec::new(),
            round_trips: 0,
            connects: 0,
        }
    }

    /// Connects to `url` (`redis://host:port/db`), with prefix entries
    /// expiring `ttl` after their last insert (at least 1 ms) and
    /// [`DEFAULT_TIMEOUT`] on connect, read and write.
    pub fn connect(url: &str, namespace: &str, ttl: Duration) -> Result<Self, StoreError> {
        Self::connect_with_timeout(url, namespace, ttl, DEFAULT_TIMEOUT)
    }

    /// [`RedisStore::connect`] with another timeout (at least 1 ms).
    pub fn connect_with_timeout(
        url: &str,
        namespace: &str,
        ttl: Duration,
        timeout: Duration,
    ) -> Result<Self, StoreError> {
        let client = redis::Client::open(url).map_err(|source| StoreError::Url {
            url: super::url::redacted(url),
            source,
        })?;
        Self::with_client(client, namespace, ttl, timeout)
    }

    /// [`RedisStore::connect_with_timeout`] through `client` (made with
    /// credentials and certificates: [`super::credentials::client`]).
    pub fn with_client(
        client: redis::Client,
        namespace: &str,
        ttl: Duration,
        timeout: Duration,
    ) -> Result<Self, StoreError> {
        let mut store = Self::unconnected(client, namespace, ttl, timeout);
        store.connection()?;
        Ok(store)
    }

    /// The namespace every key starts with.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Round trips made so far (commands or pipelines sent and answered,
    /// script reloads included; connection handshakes not).
    pub fn round_trips(&self) -> u64 {
        self.round_trips
    }

    /// Connections opened so far (1 after [`RedisStore::connect`]; one more
    /// per recovery from a failure).
    pub fn connects(&self) -> u64 {
        self.connects
    }

    /// Whether a connection is open (false after an error, until the next
    /// call reconnects).
    pub fn is_connected(&self) -> bool {
        self.conn.is_some()
    }

    /// The key of prefix entry `hash`.
    pub fn prefix_key(&self, hash: u64) -> String {
        format!("{}:p:{hash:016x}", self.namespace)
    }

    /// The key of cached response `key`.
    pub fn response_key(&self, key: u128) -> String {
        format!("{}:r:{key:032x}", self.namespace)
    }

    /// The key of the owner set (in-flight publishers and their leases).
    pub fn owners_key(&self) -> String {
        format!("{}:owners", self.namespace)
    }

    /// The key prefix of the owners' in-flight hashes (`<prefix><owner>`).
    pub fn inflight_prefix(&self) -> String {
        format!("{}:if:", self.namespace)
    }

    /// The key of the records-written counter.
    pub fn written_key(&self) -> String {
        format!("{}:written", self.namespace)
    }

    /// This store's name as an in-flight owner.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// The open connection, opening one (and loading the scripts) if none is.
    pub(super) fn connection(&mut self) -> Result<&mut Connection, StoreError> {
        let conn = match self.conn.take() {
            Some(conn) => conn,
            None => {
                let mut conn = self
                    .client
                    .get_connection_with_timeout(self.timeout)
                    .map_err(StoreError::Connect)?;
                conn.set_read_timeout(Some(self.timeout))
                    .and_then(|()| conn.set_write_timeout(Some(self.timeout)))
                    .map_err(StoreError::Connect)?;
                for script in [&self.insert, &self.lpm, &self.publish, &self.sum] {
                    script.load(&mut conn).map_err(StoreError::Connect)?;
                }
                self.connects += 1;
                conn
            }
        };
        Ok(self.conn.insert(conn))
    }

    /// The error of a failed round trip of `op`; drops the connection
    /// unless the failure left it in step.
    pub(super) fn fail(&mut self, op: &'static str, source: RedisError) -> StoreError {
        // An error reply leaves the connection in step; anything else (I/O,
        // timeout, unparsable reply) may leave a stale reply in flight:
        // never reuse such a connection.
        let in_step = matches!(
            source.kind(),
            ErrorKind::ResponseError
                | ErrorKind::ExtensionError
                | ErrorKind::NoScriptError
                | ErrorKind::TypeError
                | ErrorKind::ExecAbortError
                | ErrorKind::BusyLoadingError
                | ErrorKind::ReadOnly
        ) && !source.is_io_error()
            && !source.is_timeout();
        if !in_step {
            self.conn = None;
        }
        if source.is_timeout() {
            StoreError::Timeout {
                op,
                timeout: self.timeout,
            }
        } else {
            StoreError::Command { op, source }
        }
    }

    /// Sends `cmd` (one round trip) and converts the reply.
    pub(super) fn query<T: FromRedisValue>(&mut self, op: &'static str, cmd: &Cmd) -> Result<T, StoreError> {
        let conn = self.connection()?;
        let reply = cmd.query(conn);
        self.round_trips += 1;
        reply.map_err(|e| self.fail(op, e))
    }

    fn script(&self, which: ScriptId) -> &Script {
        match which {
            ScriptId::Insert => &self.insert,
            ScriptId::Lpm => &self.lpm,
            ScriptId::Publish => &self.publish,
            ScriptId::Sum => &self.sum,
        }
    }

    /// Runs `script` over `keys` with `args`: one `EVALSHA`, plus a reload
    /// and a retry on `NOSCRIPT`.
    pub(super) fn eval(
        &mut self,
        op: &'static str,
        which: ScriptId,
        keys: &[String],
        args: &[String],
    ) -> Result<Value, StoreError> {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.script(which).get_hash())
            .arg(keys.len())
            .arg(keys)
            .arg(args);
        match self.query::<Value>(op, &cmd) {
            Err(StoreError::Command { source, .. }) if source.kind() == ErrorKind::NoScriptError => {
                // Rare (server restart, SCRIPT FLUSH): the clone is fine here.
                let script = self.script(which).clone();
                let conn = self.connection()?;
                let loaded = script.load(conn);
                self.round_trips += 1;
                loaded.map_err(|e| self.fail(op, e))?;
                self.query(op, &cmd)
            }
            other => other,
        }
    }
}

/// The scripts a store loads on every connection.
#[derive(Debug, Clone, Copy)]
pub(super) enum ScriptId {
    Insert,
    Lpm,
    Publish,
    Sum,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_carry_the_namespace_and_fixed_width_hex() {
        let client = redis::Client::open("redis://127.0.0.1:1").unwrap();
        let store = RedisStore::unconnected(client, "ns", Duration::from_secs(1), DEFAULT_TIMEOUT);
        assert_eq!(store.prefix_key(0xab), "ns:p:00000000000000ab");
        assert_eq!(store.response_key(1), format!("ns:r:{}1", "0".repeat(31)));
        assert_eq!(store.owners_key(), "ns:owners");
        assert_eq!(store.inflight_prefix(), "ns:if:");
        assert_ne!(owner_id(), owner_id(), "owners are unique");
    }

    #[test]
    fn connect_to_a_closed_port_is_a_quick_error() {
        let t = std::time::Instant::now();
        let err = RedisStore::connect("redis://127.0.0.1:1", "ns", Duration::from_secs(1)).unwrap_err();
        assert!(matches!(err, StoreError::Connect(_)), "{err}");
        assert!(t.elapsed() < Duration::from_secs(2));
        let err = RedisStore::connect("not a url", "ns", Duration::from_secs(1)).unwrap_err();
        assert!(matches!(err, StoreError::Url { .. }), "{err}");
    }
}
