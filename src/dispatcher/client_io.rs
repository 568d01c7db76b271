//! The client side of a connection, bounded in time: a client that leaves
//! an answer unread is cut off.
//!
//! hyper writes a response body only as fast as the client reads it: when
//! the socket's buffers are full, it stops polling the body, and a relay
//! that is not polled cannot see its own deadline
//! ([`super::relay::Relay`]). A client that stops reading mid-stream would
//! so hold its upstream request and its in-flight count (which makes the
//! server look full to the holding policies) until the engine finished, or
//! for ever with an endless stream. [`StallLimited`] fails a write that
//! has made no progress for the client timeout: hyper then closes the
//! connection and drops the response body, which ends the upstream
//! request and releases its count. Reads pass through: the time a client
//! takes to send headers and body is bounded by hyper's header timeout and
//! the body deadline ([`super::http::read_body`]).
//!
//! A write that completes costs nothing more; a timer is made only when a
//! write has to wait.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// A stream whose writes fail once they have waited `stall` without
/// progress (see the [module docs](self)).
#[derive(Debug)]
pub(super) struct StallLimited<T> {
    inner: T,
    stall: Duration,
    /// Armed while a write waits: when it fires, the write fails.
    waiting: Option<Pin<Box<Sleep>>>,
}

impl<T> StallLimited<T> {
    pub(super) fn new(inner: T, stall: Duration) -> Self {
        Self {
            inner,
            stall,
            waiting: None,
        }
    }

    /// The outcome of a write that returned `result`: progress disarms the
    /// timer; a wait arms it, and an expired one is an error.
    fn after_write<R>(&mut self, cx: &mut Context<'_>, result: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        if result.is_ready() {
            self.waiting = None;
            return result;
        }
        let stall = self.stall;
        let timer = self.waiting.get_or_insert_with(|| Box::pin(tokio::time::sleep(stall)));
        if timer.as_mut().poll(cx).is_ready() {
            self.waiting = None;
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client read nothing for {} s", stall.as_secs()),
            )));
        }
        Poll::Pending
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for StallLimited<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for StallLimited<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.after_write(cx, result)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.after_write(cx, result)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let result = Pin::new(&mut self.inner).poll_flush(cx);
        self.after_write(cx, result)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[tokio::test(start_paused = true)]
    async fn a_write_nobody_reads_fails_after_the_stall_and_one_read_resets_it() {
        // A pipe of 64 bytes, never read: writes wait once it is full.
        let (reader, writer) = tokio::io::duplex(64);
        let mut w = StallLimited::new(writer, Duration::from_secs(5));
        w.write_all(&[0; 64]).await.unwrap();
        let started = tokio::time::Instant::now();
        let e = w.write_all(&[0; 1]).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        drop(reader);

        // Progress before the stall: no error.
        let (mut reader, writer) = tokio::io::duplex(64);
        let mut w = StallLimited::new(writer, Duration::from_secs(5));
        w.write_all(&[0; 64]).await.unwrap();
        let read = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(4)).await;
            let mut buf = [0u8; 64];
            tokio::io::AsyncReadExt::read_exact(&mut reader, &mut buf)
                .await
                .unwrap();
            reader
        });
        w.write_all(&[1; 8]).await.unwrap();
        let _reader = read.await.unwrap();
    }
}

/// Connections per client IP address (`limits.max_connections_per_ip`, 0:
/// no cap), counted by one dispatcher.
#[derive(Debug, Clone)]
pub(super) struct PerIp {
    cap: u32,
    open: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, u32>>>,
}

/// One connection counted for its address until dropped.
#[derive(Debug)]
pub(super) struct IpSlot {
    ip: std::net::IpAddr,
    open: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, u32>>>,
}

impl PerIp {
    /// A count capped at `cap` connections an address (0: none).
    pub fn new(cap: u32) -> Self {
        Self {
            cap,
            open: std::sync::Arc::default(),
        }
    }

    /// A place for one more connection from `ip` (`Some(None)`: no cap
    /// counts it), or `None` if `ip` has `cap` open already.
    pub fn admit(&self, ip: std::net::IpAddr) -> Option<Option<IpSlot>> {
        if self.cap == 0 {
            return Some(None);
        }
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let n = open.entry(ip).or_insert(0);
        if *n >= self.cap {
            return None;
        }
        *n += 1;
        Some(Some(IpSlot {
            ip,
            open: self.open.clone(),
        }))
    }
}

impl Drop for IpSlot {
    fn drop(&mut self) {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = open.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

#[cfg(test)]
mod per_ip_tests {
    use super::*;

    #[test]
    fn an_address_gets_its_cap_and_its_places_back() {
        let (a, b) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let per_ip = PerIp::new(2);
        let first = per_ip.admit(a).unwrap();
        let second = per_ip.admit(a).unwrap();
        assert!(per_ip.admit(a).is_none(), "a third from one address");
        assert!(per_ip.admit(b).is_some(), "another address is apart");
        drop(first);
        assert!(per_ip.admit(a).is_some(), "a place given back");
        drop(second);
        assert!(matches!(PerIp::new(0).admit(a), Some(None)), "no cap");
    }
}
