//! The notification socket systemd would own (`$NOTIFY_SOCKET`), bound by
//! a test: every datagram a supervisor sends, in order, and waits for the
//! lines the `sd_notify` protocol has.

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The notification socket systemd would own: every datagram, in order.
pub struct NotifySocket {
    path: PathBuf,
    messages: Arc<Mutex<Vec<String>>>,
}

impl NotifySocket {
    /// Binds `notify.sock` in `dir` and collects what arrives.
    pub fn bind(dir: &Path) -> NotifySocket {
        let path = dir.join("notify.sock");
        let socket = UnixDatagram::bind(&path).expect("bind the notification socket");
        let messages = Arc::new(Mutex::new(Vec::new()));
        let sink = messages.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 4096];
            while let Ok(n) = socket.recv(&mut buf) {
                sink.lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(&buf[..n]).into_owned());
            }
        });
        NotifySocket { path, messages }
    }

    /// The value for `$NOTIFY_SOCKET`.
    pub fn env(&self) -> String {
        self.path.display().to_string()
    }

    /// Every message so far.
    pub fn all(&self) -> Vec<String> {
        self.messages.lock().unwrap().clone()
    }

    /// How many messages so far.
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        self.messages.lock().unwrap().len()
    }

    /// The index of the first message at or after `from` with the line
    /// `line`, waiting (bounded) for it.
    pub fn wait_for(&self, from: usize, line: &str, within: Duration) -> usize {
        let deadline = Instant::now() + within;
        loop {
            let all = self.all();
            if let Some(i) = (from..all.len()).find(|i| all[*i].lines().any(|l| l == line)) {
                return i;
            }
            assert!(
                Instant::now() < deadline,
                "no {line:?} after message {from} within {within:?}: {all:#?}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The index of the first message at or after `from` with a line
    /// starting with `prefix` and containing `needle`.
    pub fn wait_for_containing(&self, from: usize, prefix: &str, needle: &str, within: Duration) -> usize {
        let deadline = Instant::now() + within;
        loop {
            let all = self.all();
            if let Some(i) =
                (from..all.len()).find(|i| all[*i].lines().any(|l| l.starts_with(prefix) && l.contains(needle)))
            {
                return i;
            }
            assert!(
                Instant::now() < deadline,
                "no {prefix}...{needle}... after message {from}: {all:#?}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// `RELOADING=1` (with `MONOTONIC_USEC=`) and then `READY=1`, at or
    /// after `from`; the index of the `READY=1`.
    pub fn wait_reload(&self, from: usize) -> usize {
        let reloading = self.wait_for(from, "RELOADING=1", Duration::from_secs(10));
        let message = &self.all()[reloading];
        assert!(
            message.lines().any(|l| l.starts_with("MONOTONIC_USEC=")
                && l["MONOTONIC_USEC=".len()..].parse::<u64>().is_ok_and(|u| u > 0)),
            "RELOADING=1 without MONOTONIC_USEC: {message:?}"
        );
        self.wait_for(reloading + 1, "READY=1", Duration::from_secs(10))
    }
}
