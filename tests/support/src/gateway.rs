//! `semlb serve` in front of simulated engines: [`Gateway`] (a real
//! supervisor with its dispatchers and responder, started by a
//! [`GatewayBuilder`] with options: configuration file, admin API, Redis
//! store, policy, sizes, a wrapper program), the simulated engines of
//! [`crate::engines`] (re-exported here), chat requests, Prometheus text
//! and SSE helpers.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::http::{Response, http};
use crate::process::{Proc, ProcBuilder, Stderr};
use crate::{Error, TempDir, TempFile};

pub use crate::engines::*;

/// Asserts that `r` is the gateway's own `status` answer, given without
/// asking an engine (no `x-semlb-backend`), and returns its JSON error
/// body; `what` names the case in failures.
pub fn answered_by_gateway(r: &Response, status: u16, what: &str) -> Value {
    let text = String::from_utf8_lossy(&r.body);
    assert_eq!(r.status, status, "{what}: {text}");
    assert_eq!(
        r.header("x-semlb-backend"),
        None,
        "{what}: answered by the gateway: {text}"
    );
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{what}: not a JSON error ({e}): {text}"))
}

/// Which of `engines` (a name and its process each) answered `r`,
/// asserting a 200 from one of them (`x-semlb-backend` names it).
pub fn engine_of<'a>(r: &Response, engines: &'a [(&str, &Proc)], what: &str) -> &'a str {
    assert_eq!(r.status, 200, "{what}: {}", String::from_utf8_lossy(&r.body));
    let backend = r.header("x-semlb-backend").expect("x-semlb-backend");
    engines
        .iter()
        .find(|(_, p)| backend.ends_with(&p.addr))
        .map(|(n, _)| *n)
        .unwrap_or_else(|| panic!("{what}: answered by {backend}, no engine of the test"))
}

/// A key for `tenant` added to the keys file `file` with `semlb keys`,
/// limited to `models` (none: every model): (the key, its id).
pub fn add_key(file: &str, tenant: &str, models: &[&str]) -> (String, String) {
    let mut args = vec!["keys", "--file", file, "--json", "add", "--tenant", tenant];
    for m in models {
        args.extend(["--model", m]);
    }
    let v: Value = serde_json::from_str(&crate::process::assert_ok(&crate::process::run(&args))).unwrap();
    (
        v["key"].as_str().unwrap().to_owned(),
        v["id"].as_str().unwrap().to_owned(),
    )
}

/// Sets `tenant`'s settings in the keys file `file` with `semlb keys
/// limit` (`settings`: its flags, e.g. `["--tokens-per-minute", "1000"]`);
/// what it printed.
pub fn limit_tenant(file: &str, tenant: &str, settings: &[&str]) -> String {
    let mut args = vec!["keys", "--file", file, "limit", "--tenant", tenant];
    args.extend_from_slice(settings);
    crate::process::assert_ok(&crate::process::run(&args))
}

/// How to start a [`Gateway`]: `semlb serve --listen 127.0.0.1:0` with a
/// unique shm segment of 32 MiB, 2 dispatchers, 1 responder and the
/// backends, unless told otherwise.
#[derive(Debug, Clone)]
pub struct GatewayBuilder {
    shm: Option<String>,
    tag: String,
    shm_size: String,
    dispatchers: Option<usize>,
    responders: usize,
    backends: Vec<String>,
    config: Option<String>,
    policy: Option<String>,
    redis: Option<(String, String)>,
    admin_token: Option<String>,
    args: Vec<String>,
    stderr: Stderr,
    within: Duration,
    tls: Option<crate::tls::TlsClient>,
    /// A program `semlb` runs under (`unshare`, ...), with its arguments
    /// before semlb's path.
    wrapper: Option<(String, Vec<String>)>,
    env: Vec<(String, String)>,
}

impl Default for GatewayBuilder {
    fn default() -> Self {
        GatewayBuilder {
            shm: None,
            tag: "gateway".into(),
            shm_size: "32MiB".into(),
            dispatchers: None,
            responders: 1,
            backends: Vec::new(),
            config: None,
            policy: None,
            redis: None,
            admin_token: None,
            args: Vec::new(),
            stderr: Stderr::Inherit,
            within: Duration::from_secs(30),
            tls: None,
            wrapper: None,
            env: Vec::new(),
        }
    }
}

impl GatewayBuilder {
    /// Runs `semlb` under `program` `args` (then semlb's path and its
    /// arguments): a process it execs, such as `unshare`.
    pub fn wrapped(mut self, program: &str, args: &[&str]) -> Self {
        self.wrapper = Some((program.to_owned(), args.iter().map(|a| (*a).to_owned()).collect()));
        self
    }

    /// One more environment variable for `semlb`.
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_owned(), value.to_owned()));
        self
    }

    /// The shm segment's name (default: a unique one from the tag).
    pub fn shm(mut self, name: &str) -> Self {
        self.shm = Some(name.to_owned());
        self
    }

    /// The gateway serves HTTPS (its configuration has `[tls]`): its
    /// readiness probe and [`Gateway::metrics`] reach it as `client`.
    pub fn tls(mut self, client: crate::tls::TlsClient) -> Self {
        self.tls = Some(client);
        self
    }

    /// A tag for the unique shm name and for messages.
    pub fn tag(mut self, tag: &str) -> Self {
        self.tag = tag.to_owned();
        self
    }

    /// `--shm-size` (default `32MiB`).
    pub fn shm_size(mut self, size: &str) -> Self {
        self.shm_size = size.to_owned();
        self
    }

    /// `--dispatchers` (default 2, unless `--dispatchers` is among the
    /// extra arguments).
    pub fn dispatchers(mut self, n: usize) -> Self {
        self.dispatchers = Some(n);
        self
    }

    /// One `--backend http://ADDR` (`host:port`).
    pub fn backend(mut self, addr: &str) -> Self {
        self.backends.push(addr.to_owned());
        self
    }

    /// A `--backend` for each engine.
    pub fn backends(mut self, engines: &[&Proc]) -> Self {
        self.backends.extend(engines.iter().map(|e| e.addr.clone()));
        self
    }

    /// A configuration file with this TOML text, passed with `--config`
    /// (removed when the gateway stops); flags still override it.
    pub fn config(mut self, toml: &str) -> Self {
        self.config = Some(toml.to_owned());
        self
    }

    /// `--policy`.
    pub fn policy(mut self, policy: &str) -> Self {
        self.policy = Some(policy.to_owned());
        self
    }

    /// `--store redis --redis-url URL --redis-namespace NS`.
    pub fn redis(mut self, url: &str, namespace: &str) -> Self {
        self.redis = Some((url.to_owned(), namespace.to_owned()));
        self
    }

    /// The admin API on a free loopback port with `token` (written to a
    /// private file, mode 0600); its address is read from the log, so the
    /// stderr is captured ([`Stderr::CaptureEcho`]) unless kept as a tail.
    pub fn admin(mut self, token: &str) -> Self {
        self.admin_token = Some(token.to_owned());
        if self.stderr == Stderr::Inherit {
            self.stderr = Stderr::CaptureEcho;
        }
        self
    }

    /// More flags, after all of the above.
    pub fn args<S: AsRef<str>>(mut self, args: &[S]) -> Self {
        self.args.extend(args.iter().map(|a| a.as_ref().to_owned()));
        self
    }

    /// What happens to the supervisor's stderr (default inherited).
    pub fn stderr(mut self, stderr: Stderr) -> Self {
        self.stderr = stderr;
        self
    }

    /// How long it may take to print its address and then to answer
    /// `/health` with 200 (default 30 s each).
    pub fn within(mut self, within: Duration) -> Self {
        self.within = within;
        self
    }

    /// `semlb serve`'s arguments for segment `shm`, without a configuration
    /// file or admin API (those need files that a started [`Gateway`]
    /// owns): for a caller that starts the process its own way (the proxy
    /// report pins it to CPUs).
    pub fn serve_args(&self, shm: &str) -> Vec<String> {
        self.command_line(shm, None, None)
    }

    fn command_line(&self, shm: &str, config: Option<&str>, admin_token_file: Option<&str>) -> Vec<String> {
        let mut args: Vec<String> = [
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--shm-name",
            shm,
            "--shm-size",
            &self.shm_size,
        ]
        .map(str::to_owned)
        .into();
        match self.dispatchers {
            Some(n) => args.extend(["--dispatchers".into(), n.to_string()]),
            None if !self.args.iter().any(|a| a == "--dispatchers") => {
                args.extend(["--dispatchers".into(), "2".into()])
            }
            None => {}
        }
        args.extend(["--responders".into(), self.responders.to_string()]);
        if let Some(path) = config {
            args.extend(["--config".into(), path.to_owned()]);
        }
        if let Some(policy) = &self.policy {
            args.extend(["--policy".into(), policy.clone()]);
        }
        if let Some((url, ns)) = &self.redis {
            args.extend(["--store", "redis", "--redis-url", url, "--redis-namespace", ns].map(str::to_owned));
        }
        if let Some(path) = admin_token_file {
            args.extend(["--admin-listen", "127.0.0.1:0", "--admin-token-file", path].map(str::to_owned));
        }
        for b in &self.backends {
            args.extend(["--backend".into(), format!("http://{b}")]);
        }
        args.extend(self.args.iter().cloned());
        args
    }

    /// Starts it and waits until `/health` answers 200 (and the admin API
    /// is up, when asked for).
    pub fn try_start(self) -> Result<Gateway, Error> {
        let shm = self
            .shm
            .clone()
            .unwrap_or_else(|| crate::process::unique("gw", &self.tag));
        // With `[auth]`, `/metrics` on the gateway's address needs a token
        // (metrics.token_file): one is made for [`Gateway::metrics`] unless
        // the test configures `[metrics]` itself.
        let mut metrics_token = None;
        let mut config_text = self.config.clone();
        if let Some(text) = config_text.as_mut()
            && text.contains("[auth]")
            && !text.contains("[metrics]")
        {
            let dir = TempDir::new(&format!("{}-metrics", self.tag));
            let path = dir.0.join("metrics.token");
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            let token = format!("metrics-token-{:016x}{nanos:016x}", std::process::id());
            write_private(&path, &format!("{token}\n"))?;
            text.push_str(&format!("\n[metrics]\ntoken_file = \"{}\"\n", path.display()));
            metrics_token = Some((dir, token));
        }
        let config = config_text
            .as_deref()
            .map(|t| TempFile::try_new(&self.tag, t))
            .transpose()?;
        let admin = match &self.admin_token {
            Some(token) => {
                let dir = TempDir::new(&self.tag);
                let path = dir.0.join("admin.token");
                write_private(&path, &format!("{token}\n"))?;
                Some((dir, path.display().to_string(), token.clone()))
            }
            None => None,
        };
        let args = self.command_line(
            &shm,
            config.as_ref().map(TempFile::path),
            admin.as_ref().map(|(_, path, _)| path.as_str()),
        );
        let arg_value = |flag: &str| {
            args.iter()
                .position(|a| a == flag)
                .and_then(|i| args.get(i + 1))
                .cloned()
        };
        let redis = arg_value("--redis-url").zip(arg_value("--redis-namespace"));
        let what = format!("the gateway ({}; semlb serve)", self.tag);
        let mut builder = match &self.wrapper {
            Some((program, before)) => {
                let mut wrapped: Vec<String> = before.clone();
                wrapped.push(crate::process::exe().to_owned());
                wrapped.extend(args.iter().cloned());
                ProcBuilder::new(&wrapped).program(program)
            }
            None => ProcBuilder::new(&args),
        };
        for (k, v) in &self.env {
            builder = builder.env(k, v);
        }
        let proc = match builder
            .what(what.clone())
            .stderr(self.stderr)
            .within(self.within)
            .try_start()
        {
            Ok(p) => p,
            Err(e) => {
                let _ = shm_layout::Segment::remove(&shm);
                return Err(e);
            }
        };
        let not_ready = |proc: &Proc, what: String| Error::NotReady {
            what,
            stderr: proc.stderr_tail(),
        };
        // From here on, dropping the gateway stops it and removes the
        // segment and files.
        let segment = match shm_layout::Segment::open(&shm) {
            Ok(s) => s,
            Err(e) => {
                let err = not_ready(&proc, format!("{what}: cannot open its segment {shm}: {e}"));
                drop(proc);
                let _ = shm_layout::Segment::remove(&shm);
                return Err(err);
            }
        };
        let mut gw = Gateway {
            proc,
            shm,
            segment,
            expected_records: std::cell::Cell::new(0),
            redis,
            admin: None,
            _config: config,
            _admin_dir: None,
            keep_segment: false,
            tls: self.tls.clone(),
            metrics_token,
        };
        let deadline = Instant::now() + self.within;
        if let Some((dir, _, token)) = admin {
            gw._admin_dir = Some(dir);
            loop {
                let found = gw
                    .proc
                    .stderr_text()
                    .lines()
                    .find_map(|l| l.split_once("admin API on http://").map(|(_, a)| a.trim().to_owned()));
                if let Some(addr) = found {
                    gw.admin = Some((addr, token));
                    break;
                }
                if !gw.proc.running() || Instant::now() >= deadline {
                    return Err(not_ready(&gw.proc, format!("{what}: the admin API did not start")));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        loop {
            if gw.request("GET", "/health", None, &[]).is_ok_and(|r| r.status == 200) {
                return Ok(gw);
            }
            if !gw.proc.running() {
                return Err(not_ready(&gw.proc, format!("{what} exited before it was ready")));
            }
            if Instant::now() >= deadline {
                return Err(not_ready(
                    &gw.proc,
                    format!("{what} did not become ready within {:?}", self.within),
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// [`GatewayBuilder::try_start`], panicking on failure. For tests.
    pub fn start(self) -> Gateway {
        self.try_start().unwrap_or_else(|e| panic!("{e}"))
    }
}

/// Writes `text` to a new file `path` readable by its owner only.
fn write_private(path: &std::path::Path, text: &str) -> Result<(), Error> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text)
        .and_then(|()| std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)))
        .map_err(|source| Error::Write {
            path: path.to_owned(),
            source,
        })
}

/// A running `semlb serve` (supervisor, dispatchers, responder) and its
/// segment, opened read-write; stopped with SIGTERM and its segment and
/// files removed when dropped.
pub struct Gateway {
    /// The supervisor.
    pub proc: Proc,
    /// The shm segment's name.
    pub shm: String,
    /// The segment the supervisor created.
    pub segment: shm_layout::Segment,
    /// Completion records the dispatchers should have pushed so far.
    expected_records: std::cell::Cell<u64>,
    /// With `--store redis`: the Redis and the namespace.
    redis: Option<(String, String)>,
    /// With the admin API: its address and token.
    admin: Option<(String, String)>,
    _config: Option<TempFile>,
    _admin_dir: Option<TempDir>,
    /// Leave the segment when dropped ([`Gateway::stop_keeping_segment`]).
    keep_segment: bool,
    /// It serves HTTPS: how to reach it.
    tls: Option<crate::tls::TlsClient>,
    /// With `[auth]`: the token `/metrics` needs (and its file's dir).
    metrics_token: Option<(TempDir, String)>,
}

impl Gateway {
    /// The options, to start one with.
    pub fn builder() -> GatewayBuilder {
        GatewayBuilder::default()
    }

    /// `shm` in front of `backends` with `extra` flags; the defaults otherwise.
    pub fn start(shm: &str, backends: &[&Proc], extra: &[&str]) -> Gateway {
        Gateway::launch(shm, backends, extra, false)
    }

    /// [`Gateway::start`], optionally capturing the supervisor's stderr.
    /// `--dispatchers` in `extra` replaces the default of 2.
    pub fn launch(shm: &str, backends: &[&Proc], extra: &[&str], capture_stderr: bool) -> Gateway {
        Gateway::builder()
            .shm(shm)
            .backends(backends)
            .args(extra)
            .stderr(if capture_stderr {
                Stderr::CaptureEcho
            } else {
                Stderr::Inherit
            })
            .start()
    }

    /// [`Gateway::start`] with `config` (TOML) written to a temp file of
    /// its own and passed with `--config`; `extra` flags still override it.
    pub fn with_config(shm: &str, backends: &[&Proc], config: &str, extra: &[&str]) -> Gateway {
        Gateway::builder()
            .shm(shm)
            .backends(backends)
            .config(config)
            .args(extra)
            .start()
    }

    /// Stops the supervisor with SIGTERM and leaves its segment for the
    /// next gateway on the same name; returns the exit code.
    pub fn stop_keeping_segment(mut self) -> Option<i32> {
        self.keep_segment = true;
        self.proc.stop()
    }

    /// The gateway's listener address.
    pub fn addr(&self) -> &str {
        &self.proc.addr
    }

    /// One request to the gateway: over HTTPS when it serves it
    /// ([`GatewayBuilder::tls`]), else as [`http`].
    pub fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        headers: &[(&str, &str)],
    ) -> Result<Response, String> {
        match &self.tls {
            Some(tls) => tls.request(&self.proc.addr, method, path, body, headers),
            None => http(&self.proc.addr, method, path, body, headers),
        }
    }

    /// The gateway's `/metrics` text.
    pub fn metrics(&self) -> String {
        let bearer = self.metrics_token.as_ref().map(|(_, t)| format!("Bearer {t}"));
        let headers: Vec<(&str, &str)> = bearer.iter().map(|b| ("authorization", b.as_str())).collect();
        let r = self
            .request("GET", "/metrics", None, &headers)
            .expect("gateway metrics");
        assert_eq!(r.status, 200, "/metrics: {}", String::from_utf8_lossy(&r.body));
        String::from_utf8_lossy(&r.body).into_owned()
    }

    /// Counts one more answered request whose record the dispatcher pushes,
    /// then waits until every pushed record was applied by the response
    /// process (pushed >= expected, no ring holds anything, and `applied`,
    /// the responders' count of records written, e.g.
    /// `semlb::metrics::responder_records`, has them all): the state a
    /// client's next turn should find.
    pub fn written_back(&self, applied: impl Fn(&shm_layout::Tables<'_>) -> u64) {
        self.expected_records.set(self.expected_records.get() + 1);
        let t = self.segment.tables();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (pushed, used) = (0..t.ring_count())
                .map(|i| t.ring(i).stats())
                .fold((0, 0), |(p, u), s| (p + s.pushed, u + s.used));
            // Popped from the rings is not yet written: the responders count
            // a record once its write is done.
            // Every record pushed so far, not only as many as were
            // expected: an earlier answer may have pushed more than one
            // (a retry, a cache refresh), and counting those would let
            // this return before the last one is written.
            if pushed >= self.expected_records.get()
                && used == 0
                && applied(&t) >= pushed.max(self.expected_records.get())
                && self.redis_written()
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "records not written back: pushed {pushed}, in rings {used} bytes"
            );
            std::thread::yield_now();
        }
    }

    /// With Redis: whether Redis counts every expected record as written
    /// (`{ns}:written`, bumped by each write-back pipeline). Without: true.
    fn redis_written(&self) -> bool {
        let Some((url, ns)) = &self.redis else { return true };
        let written: Option<u64> = redis::Client::open(url.as_str())
            .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(1)))
            .and_then(|mut c| redis::cmd("GET").arg(format!("{ns}:written")).query(&mut c))
            .ok()
            .flatten();
        written.is_some_and(|n| n >= self.expected_records.get())
    }

    /// Until a request goes through (the dispatchers are up).
    pub fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if http(&self.proc.addr, "GET", "/health", None, &[]).map(|r| r.status) == Ok(200) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the gateway did not become ready");
    }

    /// The admin API's address (`host:port`); panics without one.
    pub fn admin_addr(&self) -> &str {
        &self.admin.as_ref().expect("a gateway with the admin API").0
    }

    /// An admin request with the right token; panics without the admin API.
    pub fn admin(&self, method: &str, path: &str, body: Option<&str>) -> Response {
        let (addr, token) = self.admin.as_ref().expect("a gateway with the admin API");
        let auth = format!("Bearer {token}");
        crate::http::http_bytes(addr, method, path, body.map(str::as_bytes), &[("Authorization", &auth)])
            .expect("admin request")
    }

    /// `engine`'s entry in the segment's server table (`None`: not
    /// registered).
    pub fn listed(&self, engine: &Proc) -> Option<shm_layout::ServerInfo> {
        let address = format!("http://{}", engine.addr);
        self.segment.tables().servers.servers().find(|s| s.address == address)
    }

    /// `GET /admin/servers`: the server list.
    pub fn admin_servers(&self) -> Vec<Value> {
        let r = self.admin("GET", "/admin/servers", None);
        assert_eq!(r.status, 200, "{r:?}");
        r.json()["servers"].as_array().expect("a list").clone()
    }

    /// Its running children of `role`, as the registry lists them.
    pub fn running(&self, role: shm_layout::Role) -> Vec<shm_layout::ProcessInfo> {
        self.segment
            .tables()
            .registry
            .processes()
            .filter(|p| p.role == Some(role) && p.state == shm_layout::ProcessState::Running)
            .collect()
    }

    /// The admin API's entry for the backend `address` (`http://…`).
    pub fn admin_server(&self, address: &str) -> Option<Value> {
        self.admin_servers().into_iter().find(|s| s["address"] == address)
    }

    /// Waits (20 s at most) until the admin API lists exactly `engines`,
    /// each `up` and managed by discovery: the gateway routes to them and
    /// has retired every other backend it found.
    pub fn wait_discovered(&self, engines: &[&Proc], what: &str) {
        let want: std::collections::BTreeSet<String> = engines.iter().map(|e| format!("http://{}", e.addr)).collect();
        wait_for(what, Duration::from_secs(20), || {
            let servers = self.admin_servers();
            let address = |s: &Value| s["address"].as_str().unwrap_or_default().to_owned();
            let listed: std::collections::BTreeSet<String> = servers.iter().map(address).collect();
            let up: std::collections::BTreeSet<String> = servers
                .iter()
                .filter(|s| s["state"] == "up" && s["managed"] == "discovery")
                .map(address)
                .collect();
            (up == want && listed == want, (up, listed))
        });
    }

    /// Sends `n` new conversations (each its own prompt, so load decides
    /// where each goes), each answered 200; the backends that answered.
    pub fn served_by(&self, n: usize, tag: &str) -> std::collections::BTreeSet<String> {
        (0..n)
            .map(|i| {
                let r = chat(
                    self.addr(),
                    &[user(&format!("{tag} conversation {i}: tell me about rivers"))],
                    json!({}),
                    &[],
                );
                assert_eq!(r.status, 200, "{}", r.text());
                routed(&r).0
            })
            .collect()
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.proc.stop();
        if !self.keep_segment {
            let _ = shm_layout::Segment::remove(&self.shm);
        }
    }
}

/// A chat completion request of `messages` (`extra` merged into the body).
pub fn chat(addr: &str, messages: &[Value], extra: Value, headers: &[(&str, &str)]) -> Response {
    let mut body = json!({"model": "semlb-sim", "messages": messages, "max_tokens": 24});
    if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
        b.extend(e);
    }
    http(addr, "POST", "/v1/chat/completions", Some(&body), headers).expect("request")
}

/// A user message.
pub fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

/// Sum of a counter over the engines' /metrics.
pub fn engine_counter(engines: &[&Proc], name: &str) -> f64 {
    engines
        .iter()
        .map(|e| {
            let r = http(&e.addr, "GET", "/metrics", None, &[]).expect("metrics");
            String::from_utf8_lossy(&r.body)
                .lines()
                .filter(|l| l.starts_with(name))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>()
        })
        .sum()
}

/// The value of the sample `series` (name and labels exactly as exposed,
/// e.g. `semlb_queue_requests_total{outcome="routed"}`) in a Prometheus
/// text; `None` when absent.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.rsplit_once(' ').filter(|(k, _)| *k == series))
        .and_then(|(_, v)| v.parse().ok())
}

/// Every sample of the family `name` as (labels, value), labels as in the
/// text without braces (`server="http://..."`).
pub fn samples(text: &str, name: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let labels = match series.split_once('{') {
                Some((n, rest)) if n == name => rest.strip_suffix('}')?.to_owned(),
                None if series == name => String::new(),
                _ => return None,
            };
            Some((labels, value.parse().ok()?))
        })
        .collect()
}

/// Waits until `cond` holds, polling every 20 ms; panics after `within`
/// with `what` and the last value `cond` saw.
pub fn wait_for<T: std::fmt::Debug>(what: &str, within: Duration, mut probe: impl FnMut() -> (bool, T)) -> T {
    let deadline = Instant::now() + within;
    loop {
        let (ok, seen) = probe();
        if ok {
            return seen;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; last seen: {seen:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The routed backend and route reason of an answer.
pub fn routed(r: &Response) -> (String, String) {
    (
        r.header("x-semlb-backend").unwrap_or_default().to_owned(),
        r.header("x-semlb-route").unwrap_or_default().to_owned(),
    )
}

/// A streamed answer's text and whether it ended with `data: [DONE]`.
pub fn stream_text(r: &Response) -> (String, bool) {
    let body = String::from_utf8_lossy(&r.body);
    let mut text = String::new();
    let mut done = false;
    for data in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data.trim() == "[DONE]" {
            done = true;
            continue;
        }
        if let Ok(v) = serde_json::from_str::<Value>(data)
            && let Some(t) = v["choices"][0]["delta"]["content"].as_str()
        {
            text.push_str(t);
        }
    }
    (text, done)
}

/// One turn of a [`converse`] conversation, as the client saw it.
#[derive(Debug, Clone)]
pub struct Turn {
    /// `x-semlb-backend`.
    pub backend: String,
    /// `x-semlb-route`.
    pub route: String,
    /// The usage chunk's `prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u64,
}

/// A streamed conversation of `turns` turns through the gateway at
/// `addr`, starting from `messages`, each turn sent with `extra` and an
/// `api-key` header the instant the previous stream ended; after each
/// answer, the answer and the user message `next(turn)` are appended.
/// Asserts each turn is a 200 whose stream ends with `data: [DONE]` and
/// whose usage chunk reports `cached_tokens`.
pub fn converse(
    addr: &str,
    mut messages: Vec<Value>,
    extra: &Value,
    turns: usize,
    next: impl Fn(usize) -> String,
) -> Vec<Turn> {
    (0..turns)
        .map(|t| {
            let r = chat(addr, &messages, extra.clone(), &[("api-key", "agent")]);
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            let (backend, route) = routed(&r);
            let body = String::from_utf8_lossy(&r.body);
            assert!(body.trim_end().ends_with("data: [DONE]"), "a whole stream: {body}");
            let (text, _) = stream_text(&r);
            let cached_tokens = body
                .lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .filter_map(|data| serde_json::from_str::<Value>(data).ok())
                .filter_map(|v| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64())
                .next_back();
            messages.push(json!({"role": "assistant", "content": text}));
            messages.push(user(&next(t)));
            Turn {
                backend,
                route,
                cached_tokens: cached_tokens.expect("the usage chunk reports cached_tokens"),
            }
        })
        .collect()
}
