//! A tiny client of systemd's notification protocol (`sd_notify(3)`), for
//! a supervisor run as a `Type=notify` service.
//!
//! systemd passes the address of a datagram socket in `$NOTIFY_SOCKET`: a
//! path (`/run/systemd/notify`) or, starting with `@`, a Linux abstract
//! socket name. Each notification is one datagram of newline-separated
//! `KEY=VALUE` assignments: `READY=1` when the service is up, `RELOADING=1`
//! (with `MONOTONIC_USEC=`, which systemd 253 and later use to match the
//! reload) and `READY=1` again around a reload, `STOPPING=1` when it
//! begins to stop, `STATUS=` a one-line summary for `systemctl status`, and
//! `WATCHDOG=1` at least once per `$WATCHDOG_USEC` when the unit has
//! `WatchdogSec=` (only for the process `$WATCHDOG_PID` names, if set),
//! and `MAINPID=` when an upgrade hands the service to a new process.
//!
//! Without `$NOTIFY_SOCKET` (not under systemd) every call is a no-op.
//! Sending is best-effort: a failure is logged once and never stops the
//! gateway. The variables are not removed from this process's environment
//! (that is unsafe in a threaded program); the supervisor removes them from
//! its children's environment instead ([`ENV_VARS`]), so only it notifies.

use std::cell::Cell;
use std::io;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;

/// The variables of the protocol, which children must not inherit.
pub const ENV_VARS: [&str; 3] = ["NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"];

/// Where notifications go, and the watchdog interval systemd asked for.
#[derive(Debug)]
pub struct Notifier {
    /// The socket and systemd's address; `None` when not under systemd.
    target: Option<(UnixDatagram, SocketAddr)>,
    /// `$WATCHDOG_USEC` when it is meant for this process.
    watchdog: Option<Duration>,
    /// Whether a send failure was already logged.
    failed: Cell<bool>,
}

impl Notifier {
    /// A notifier from `$NOTIFY_SOCKET`, `$WATCHDOG_USEC` and
    /// `$WATCHDOG_PID`. An address that cannot be used is logged and
    /// ignored.
    pub fn from_env() -> Self {
        let var = |name: &str| std::env::var_os(name).and_then(|v| v.into_string().ok());
        let target = var("NOTIFY_SOCKET").and_then(|addr| match connect(&addr) {
            Ok(target) => Some(target),
            Err(e) => {
                tracing::warn!(error = %e, "NOTIFY_SOCKET={addr} cannot be used ({e}); not notifying systemd");
                None
            }
        });
        let watchdog = watchdog_interval(
            var("WATCHDOG_USEC").as_deref(),
            var("WATCHDOG_PID").as_deref(),
            std::process::id(),
        );
        Self {
            target,
            watchdog,
            failed: Cell::new(false),
        }
    }

    /// The watchdog interval (`$WATCHDOG_USEC`), if systemd expects pings
    /// from this process; ping at half of it.
    pub fn watchdog_interval(&self) -> Option<Duration> {
        self.watchdog
    }

    /// `READY=1` with a status line: startup or a reload is complete.
    pub fn ready(&self, status: &str) {
        self.send(&format!("READY=1\nSTATUS={}", one_line(status)));
    }

    /// `RELOADING=1` with `MONOTONIC_USEC=` (now on `CLOCK_MONOTONIC`);
    /// follow with [`Self::ready`] once the reload is done (or rejected).
    pub fn reloading(&self) {
        self.send(&format!(
            "RELOADING=1\nMONOTONIC_USEC={}\nSTATUS=reloading the configuration",
            monotonic_usec()
        ));
    }

    /// `STOPPING=1`: the service is shutting down.
    pub fn stopping(&self, status: &str) {
        self.send(&format!("STOPPING=1\nSTATUS={}", one_line(status)));
    }

    /// `STATUS=`: a one-line summary for `systemctl status`.
    pub fn status(&self, line: &str) {
        self.send(&format!("STATUS={}", one_line(line)));
    }

    /// `MAINPID=pid` with a status line: the service's main process is now
    /// `pid` (the successor an upgrade started).
    /// systemd takes it from the main process only; after it, this
    /// process's notifications are ignored.
    pub fn main_pid(&self, pid: u32, status: &str) {
        self.send(&format!("MAINPID={pid}\nSTATUS={}", one_line(status)));
    }

    /// `WATCHDOG=1`: the service is alive and well.
    pub fn watchdog(&self) {
        self.send("WATCHDOG=1");
    }

    fn send(&self, message: &str) {
        let Some((socket, addr)) = &self.target else { return };
        if let Err(e) = socket.send_to_addr(message.as_bytes(), addr)
            && !self.failed.replace(true)
        {
            tracing::warn!(error = %e, "cannot notify systemd ({e}); later failures are not logged");
        }
    }
}

/// An unbound datagram socket and the address `$NOTIFY_SOCKET` names.
fn connect(addr: &str) -> io::Result<(UnixDatagram, SocketAddr)> {
    let address = if let Some(name) = addr.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt;
        SocketAddr::from_abstract_name(name.as_bytes())?
    } else if addr.starts_with('/') {
        SocketAddr::from_pathname(addr)?
    } else {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "only absolute paths and @abstract names are supported",
        ));
    };
    Ok((UnixDatagram::unbound()?, address))
}

/// The watchdog interval from `$WATCHDOG_USEC`, unless `$WATCHDOG_PID`
/// names another process (or either is malformed or zero).
fn watchdog_interval(usec: Option<&str>, pid: Option<&str>, me: u32) -> Option<Duration> {
    let usec: u64 = usec?.trim().parse().ok().filter(|u| *u > 0)?;
    if let Some(pid) = pid
        && pid.trim().parse::<u32>().ok() != Some(me)
    {
        return None;
    }
    Some(Duration::from_micros(usec))
}

/// `text` with line breaks turned into spaces (a status is one line).
fn one_line(text: &str) -> String {
    text.replace(['\n', '\r'], " ")
}

/// `CLOCK_MONOTONIC` in microseconds, as `MONOTONIC_USEC=` wants it.
fn monotonic_usec() -> u64 {
    match nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC) {
        Ok(t) => (t.tv_sec() as u64) * 1_000_000 + (t.tv_nsec() as u64) / 1_000,
        Err(_) => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages_to(addr: &str, server: &UnixDatagram, send: impl FnOnce(&Notifier)) -> String {
        let n = Notifier {
            target: Some(connect(addr).unwrap()),
            watchdog: None,
            failed: Cell::new(false),
        };
        send(&n);
        let mut buf = [0u8; 512];
        let len = server.recv(&mut buf).unwrap();
        String::from_utf8_lossy(&buf[..len]).into_owned()
    }

    #[test]
    fn sends_to_a_path_socket() {
        let dir = std::env::temp_dir().join(format!("semlb-notify-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("notify.sock");
        let _ = std::fs::remove_file(&path);
        let server = UnixDatagram::bind(&path).unwrap();
        let got = messages_to(path.to_str().unwrap(), &server, |n| n.ready("2/2 up\nok"));
        assert_eq!(got, "READY=1\nSTATUS=2/2 up ok");
        let got = messages_to(path.to_str().unwrap(), &server, Notifier::reloading);
        assert!(got.starts_with("RELOADING=1\nMONOTONIC_USEC="), "{got}");
        let usec: u64 = got.lines().nth(1).unwrap()["MONOTONIC_USEC=".len()..].parse().unwrap();
        assert!(usec > 0);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn sends_to_an_abstract_socket() {
        use std::os::linux::net::SocketAddrExt;
        let name = format!("semlb-notify-test-{}", std::process::id());
        let server = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
        let got = messages_to(&format!("@{name}"), &server, Notifier::watchdog);
        assert_eq!(got, "WATCHDOG=1");
        let got = messages_to(&format!("@{name}"), &server, |n| n.stopping("draining"));
        assert_eq!(got, "STOPPING=1\nSTATUS=draining");
    }

    #[test]
    fn the_watchdog_is_for_the_named_process_only() {
        assert_eq!(
            watchdog_interval(Some("2000000"), None, 7),
            Some(Duration::from_secs(2))
        );
        assert_eq!(
            watchdog_interval(Some("2000000"), Some("7"), 7),
            Some(Duration::from_secs(2))
        );
        assert_eq!(watchdog_interval(Some("2000000"), Some("8"), 7), None);
        assert_eq!(watchdog_interval(Some("0"), None, 7), None);
        assert_eq!(watchdog_interval(Some("x"), None, 7), None);
        assert_eq!(watchdog_interval(None, Some("7"), 7), None);
    }

    #[test]
    fn unusable_addresses_are_errors_and_without_a_socket_nothing_is_sent() {
        assert!(connect("vsock:2:1234").is_err());
        assert!(connect("relative/path").is_err());
        let n = Notifier {
            target: None,
            watchdog: None,
            failed: Cell::new(false),
        };
        n.ready("nothing");
        n.watchdog();
        assert!(!n.failed.get());
    }
}
