//! What the supervisor tells systemd, through [`crate::supervisor::sd_notify`]: readiness,
//! the watchdog, and the `STATUS=` line ([`Reports`]).
//!
//! Under a `Type=notify` unit (`systemd/semlb.service`): `READY=1` once
//! every child has attached to its registry slot and a dispatcher has
//! answered `GET /health` on the listener ([`probe`]); `STATUS=` a one-line
//! summary ([`status_line`]: children up, restarts, backends up and
//! draining, policy, a failed reload) whenever it changes and every 30 s;
//! `WATCHDOG=1` at half of `WatchdogSec=`, but only while it is healthy:
//! every child running its current incarnation with a heartbeat at most
//! 3 s old. A child being restarted, hung or crash looping stops the pings
//! until it runs again, and a stalled supervisor sends none, so systemd
//! restarts the service when that lasts. `STOPPING=1` on SIGTERM/SIGINT
//! (and on a fatal error), before draining; `RELOADING=1` and `READY=1`
//! around a reload; `MAINPID=` when an upgrade hands over to a successor.

use std::fmt::Display;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

use super::backends::Counts;
use crate::supervisor::sd_notify::Notifier;

/// A `STATUS=` line is sent when it changes, and at least this often.
const STATUS_EVERY: Duration = Duration::from_secs(30);

/// One line for `systemctl status`, from the dispatchers and responders up
/// (with a fresh heartbeat) of all (`(up, all)`), the children restarted
/// so far, the backends, the routing policy and the last reload's error.
pub(super) fn status_line(
    dispatchers: (usize, usize),
    responders: (usize, usize),
    restarts: u64,
    backends: Counts,
    policy: impl Display,
    reload_error: Option<&str>,
) -> String {
    let ((d_up, d), (r_up, r)) = (dispatchers, responders);
    let mut line = format!(
        "{d_up}/{d} dispatchers, {r_up}/{r} responders up, {restarts} restarts; backends {}/{} up",
        backends.up, backends.live
    );
    if backends.draining > 0 {
        line.push_str(&format!(", {} draining", backends.draining));
    }
    line.push_str(&format!("; policy {policy}"));
    if let Some(e) = reload_error {
        line.push_str(&format!("; last reload failed: {e}"));
    }
    line
}

/// The notifications of one supervisor run: whether it said `READY=1`
/// yet, its last watchdog ping, and its last `STATUS=` line.
#[derive(Debug)]
pub(super) struct Reports<'a> {
    notify: &'a Notifier,
    ready: bool,
    last_ping: Option<Instant>,
    last_status: (String, Instant),
}

impl<'a> Reports<'a> {
    /// Not ready yet.
    pub(super) fn new(notify: &'a Notifier) -> Self {
        Self {
            notify,
            ready: false,
            last_ping: None,
            last_status: (String::new(), Instant::now()),
        }
    }

    /// Whether `READY=1` was sent.
    pub(super) fn is_ready(&self) -> bool {
        self.ready
    }

    /// `READY=1` with the first `STATUS=` line, `status`.
    pub(super) fn ready(&mut self, status: String) {
        self.ready = true;
        tracing::info!("ready: {status}");
        self.notify.ready(&status);
        self.last_status = (status, Instant::now());
    }

    /// `RELOADING=1`, once ready.
    pub(super) fn reloading(&self) {
        if self.ready {
            self.notify.reloading();
        }
    }

    /// `READY=1` again after a reload, once ready.
    pub(super) fn reloaded(&self, status: &str) {
        if self.ready {
            self.notify.ready(status);
        }
    }

    /// One round of the supervisor's loop, once ready: `WATCHDOG=1` if one
    /// is due and the supervisor is `healthy`, and `status` if it changed
    /// or was last sent [`STATUS_EVERY`] ago.
    pub(super) fn tick(&mut self, healthy: impl FnOnce() -> bool, status: String) {
        if let Some(interval) = self.notify.watchdog_interval()
            && self.last_ping.is_none_or(|t| t.elapsed() >= interval / 2)
            && healthy()
        {
            self.notify.watchdog();
            self.last_ping = Some(Instant::now());
        }
        if status != self.last_status.0 || self.last_status.1.elapsed() >= STATUS_EVERY {
            self.notify.status(&status);
            self.last_status = (status, Instant::now());
        }
    }

    /// `STOPPING=1` with `status`.
    pub(super) fn stopping(&self, status: &str) {
        self.notify.stopping(status);
    }

    /// `MAINPID=pid`: the successor `pid` is the service now (an upgrade).
    pub(super) fn handed_over(&self, pid: u32) {
        self.notify.main_pid(
            pid,
            &format!("handed over to the upgraded supervisor (pid {pid}); draining"),
        );
    }
}

/// Where the supervisor asks its own listener for `/health`: the listening
/// address, loopback for a wildcard one.
pub(super) fn probe_address(listening: SocketAddr) -> SocketAddr {
    let ip = match listening.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    SocketAddr::new(ip, listening.port())
}

/// Whether a dispatcher answers `GET /health` on `addr` (any HTTP status:
/// 503 only says no backend is up) within a second.
pub(super) async fn probe(addr: SocketAddr) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let attempt = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream
            .write_all(b"GET /health HTTP/1.1\r\nHost: semlb\r\nConnection: close\r\n\r\n")
            .await?;
        let mut head = [0u8; 12];
        stream.read_exact(&mut head).await?;
        Ok::<bool, std::io::Error>(head.starts_with(b"HTTP/1.1 "))
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(1), attempt).await,
        Ok(Ok(true))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_line_names_children_backends_policy_and_a_failed_reload() {
        let backends = Counts {
            up: 2,
            live: 3,
            draining: 0,
        };
        assert_eq!(
            status_line((2, 2), (1, 1), 0, backends, "cache_aware", None),
            "2/2 dispatchers, 1/1 responders up, 0 restarts; backends 2/3 up; policy cache_aware"
        );
        let backends = Counts {
            draining: 1,
            ..backends
        };
        assert_eq!(
            status_line((1, 2), (0, 1), 4, backends, "least_load", Some("policy.kind: unknown")),
            "1/2 dispatchers, 0/1 responders up, 4 restarts; backends 2/3 up, 1 draining; policy least_load; last reload failed: policy.kind: unknown"
        );
    }

    #[test]
    fn a_wildcard_listener_is_probed_on_loopback() {
        let addr = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert_eq!(probe_address(addr("0.0.0.0:8080")), addr("127.0.0.1:8080"));
        assert_eq!(probe_address(addr("[::]:8080")), addr("[::1]:8080"));
        assert_eq!(probe_address(addr("10.0.0.1:80")), addr("10.0.0.1:80"));
    }
}
