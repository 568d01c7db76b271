//! Redis over TLS with a password, as a managed Redis is reached: a real
//! `redis-server` with a TLS port only, a certificate from a private CA
//! (made here with `openssl`) and `requirepass`, and gateways configured
//! with `rediss://`, `ca_file` and the password in a private file or in
//! the URL.
//!
//! Shown here: the gateway routes a conversation's next turn by prefix
//! through that Redis (its entries are there); the password is on no
//! process's command line and in no log line, whichever way it was given;
//! a wrong password leaves the gateway serving on load alone, its log
//! saying Redis is not reachable.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

use semlb_test_support as support;
use shm_layout::ProcessState;
use support::TempDir;
use support::gateway::{Gateway, chat, routed, sim, stream_text, user};
use support::process::{Proc, Stderr};

const PASSWORD: &str = "correct-horse-battery-staple-42";

/// A `redis-server` listening with TLS only, requiring [`PASSWORD`].
struct TlsRedis {
    child: Child,
    port: u16,
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A CA and a server certificate for 127.0.0.1 signed by it, in `dir`
/// (`ca.crt`, `redis.crt`, `redis.key`).
fn certificates(dir: &Path) {
    let ca = support::tls::ca(dir, "ca");
    support::tls::signed(dir, &ca, "redis");
}

fn start_tls_redis(dir: &Path) -> Option<TlsRedis> {
    if !support::redis::installed() {
        return None;
    }
    let port = support::redis::free_port();
    let file = |name: &str| dir.join(name).display().to_string();
    let child = Command::new("redis-server")
        .args(["--port", "0", "--tls-port", &port.to_string()])
        .args([
            "--tls-cert-file",
            &file("redis.crt"),
            "--tls-key-file",
            &file("redis.key"),
        ])
        .args(["--tls-ca-cert-file", &file("ca.crt"), "--tls-auth-clients", "no"])
        .args([
            "--requirepass",
            PASSWORD,
            "--save",
            "",
            "--appendonly",
            "no",
            "--bind",
            "127.0.0.1",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server");
    let redis = TlsRedis { child, port };
    let deadline = Instant::now() + Duration::from_secs(10);
    while redis.connection(dir).is_err() {
        assert!(Instant::now() < deadline, "the TLS redis-server did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    Some(redis)
}

impl TlsRedis {
    fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}/", self.port)
    }

    /// A connection as a client with the CA and the password.
    fn connection(&self, dir: &Path) -> redis::RedisResult<redis::Connection> {
        let mut info: redis::ConnectionInfo = redis::IntoConnectionInfo::into_connection_info(self.url().as_str())?;
        info.redis.password = Some(PASSWORD.into());
        let certificates = redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(std::fs::read(dir.join("ca.crt")).expect("the CA")),
        };
        redis::Client::build_with_tls(info, certificates)?.get_connection_with_timeout(Duration::from_secs(1))
    }

    fn count(&self, dir: &Path, pattern: &str) -> usize {
        let mut c = self.connection(dir).expect("a TLS connection");
        let keys: Vec<String> = redis::cmd("KEYS").arg(pattern).query(&mut c).unwrap_or_default();
        keys.len()
    }
}

/// Writes `text` to `dir/name`, readable by its owner only.
fn private_file(dir: &Path, name: &str, text: &str) -> String {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path.display().to_string()
}

fn gateway(engines: &[&Proc], redis_table: &str) -> Gateway {
    Gateway::builder()
        .tag("redis-tls")
        .backends(engines)
        .config(&format!("[store]\nkind = \"redis\"\n\n[store.redis]\n{redis_table}"))
        .stderr(Stderr::CaptureEcho)
        .start()
}

/// Asserts no process of `gw` (supervisor and children) has `secret` on
/// its command line, nor its log.
fn secret_kept(gw: &Gateway, secret: &str) {
    let pids = gw
        .segment
        .tables()
        .registry
        .processes()
        .filter(|p| p.state == ProcessState::Running)
        .map(|p| p.pid)
        .collect::<Vec<_>>();
    assert!(pids.len() >= 3, "supervisor and children: {pids:?}");
    for pid in pids {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        assert!(
            !String::from_utf8_lossy(&cmdline).contains(secret),
            "pid {pid} has the password on its command line"
        );
    }
    assert!(!gw.proc.stderr_text().contains(secret), "the password is in the log");
}

/// Two streamed turns through `gw`: the second's (engine, route), and the first's engine.
fn two_turns(gw: &Gateway) -> (String, (String, String)) {
    let mut messages = vec![user(
        "Explain, with examples, how TLS session resumption works in detail.",
    )];
    let extra = json!({"stream": true, "max_tokens": 32});
    let r = chat(gw.addr(), &messages, extra.clone(), &[("api-key", "agent")]);
    assert_eq!(r.status, 200);
    let (text, done) = stream_text(&r);
    assert!(done);
    let first = routed(&r).0;
    messages.push(json!({"role": "assistant", "content": text}));
    messages.push(user("And with TLS 1.3 tickets?"));
    let r = chat(gw.addr(), &messages, extra, &[("api-key", "agent")]);
    assert_eq!(r.status, 200);
    (first, routed(&r))
}

#[test]
fn a_gateway_reaches_redis_over_tls_with_a_password_it_never_shows() {
    let dir = TempDir::new("redis-tls");
    certificates(&dir.0);
    let Some(redis) = start_tls_redis(&dir.0) else { return };
    let ca = dir.0.join("ca.crt").display().to_string();
    let password_file = private_file(&dir.0, "redis.password", &format!("{PASSWORD}\n"));
    let engines = [sim(), sim()];
    let refs: Vec<&Proc> = engines.iter().collect();

    // The password in a private file.
    let gw = gateway(
        &refs,
        &format!(
            "url = \"{}\"\nnamespace = \"tls\"\npassword_file = \"{password_file}\"\nca_file = \"{ca}\"\n",
            redis.url()
        ),
    );
    let (first, (second, route)) = two_turns(&gw);
    assert_eq!((second.as_str(), route.as_str()), (first.as_str(), "prefix"));
    assert!(
        redis.count(&dir.0, "tls:p:*") > 0,
        "the prefix entries are in the TLS Redis"
    );
    assert!(
        gw.proc
            .stderr_text()
            .contains("routing state in Redis at rediss://127.0.0.1")
    );
    secret_kept(&gw, PASSWORD);
    drop(gw);

    // The password in the URL (the old way): still off command lines and logs.
    let url = format!("rediss://:{PASSWORD}@127.0.0.1:{}/", redis.port);
    let gw = gateway(
        &refs,
        &format!("url = \"{url}\"\nnamespace = \"tls-url\"\nca_file = \"{ca}\"\n"),
    );
    let (first, (second, route)) = two_turns(&gw);
    assert_eq!((second.as_str(), route.as_str()), (first.as_str(), "prefix"));
    assert!(
        gw.proc.stderr_text().contains(":***@127.0.0.1"),
        "the log shows the URL redacted"
    );
    secret_kept(&gw, PASSWORD);
    drop(gw);

    // A wrong password: serving on load alone, and saying why.
    let wrong = private_file(&dir.0, "wrong.password", "not-the-password-7\n");
    let gw = gateway(
        &refs,
        &format!(
            "url = \"{}\"\nnamespace = \"tls-wrong\"\npassword_file = \"{wrong}\"\nca_file = \"{ca}\"\n",
            redis.url()
        ),
    );
    let (_, (_, route)) = two_turns(&gw);
    assert_ne!(route, "prefix", "no Redis, no prefix");
    assert!(gw.proc.stderr_text().contains("not reachable now"));
    secret_kept(&gw, "not-the-password-7");
}
