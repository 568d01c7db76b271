//! The client half of ZeroMQ's wire protocol (ZMTP 3.0, RFC 23, with the
//! NULL mechanism) that a subscriber to an engine's KV events needs: a SUB
//! socket's connection to the engine's PUB socket, and a DEALER's to its
//! replay ROUTER. One TCP connection each, nothing else of ZeroMQ.
//!
//! Why not a ZeroMQ library: the gateway must notice at once when an
//! engine goes away or restarts (its sequence starts over, its cache is
//! empty), and a library socket reconnects or stalls behind the caller's
//! back. Here a closed or broken connection is an error the subscriber
//! sees, and it starts over ([`super::subscriber`]); TCP keepalive finds a
//! peer that vanished without closing.
//!
//! ```text
//! greeting (64 bytes, each side): FF 00×8 7F | 03 00 | "NULL" 00×16 | as-server 00 | 00×31
//! READY command, each side:       04 len | 05 "READY" | 0B "Socket-Type" | u32 len | "SUB"/"DEALER"
//! frame:                          flags (MORE 1, LONG 2, COMMAND 4) | size (1 byte, or 8 big-endian if LONG) | body
//! subscribe (3.0 message form):   00 len | 01 topic
//! ```
//!
//! Checked against libzmq (pyzmq's publisher in
//! `workers/tests/python/`) and against the simulator's publisher.

use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// Largest frame read (a batch of events is kilobytes to a few megabytes).
const MAX_FRAME: u64 = 16 << 20;
/// A frame's body is read in steps of this much (see `read_frame`).
const FRAME_CHUNK: usize = 64 << 10;
/// Most frames in one message.
const MAX_FRAMES: usize = 64;
/// Most bytes of one message, its frames together: a publisher cannot
/// make a subscriber hold more (64 frames of the largest size would be
/// 1 GiB).
const MAX_MESSAGE: usize = 32 << 20;
/// TCP keepalive: a silent peer is probed after this long.
const KEEPALIVE: Duration = Duration::from_secs(10);

const MORE: u8 = 1;
const LONG: u8 = 2;
const COMMAND: u8 = 4;

/// Why a connection failed or ended.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    /// The endpoint is not `tcp://host:port`.
    #[error("not a tcp://host:port endpoint: {0}")]
    Endpoint(String),
    /// The connection failed, or the peer closed it.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The peer does not speak ZMTP 3 with the NULL mechanism, or sent
    /// something malformed.
    #[error("not a ZMTP 3 peer: {0}")]
    Protocol(String),
}

/// The socket type a connection announces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SocketType {
    /// A subscriber (to a PUB socket).
    Sub,
    /// A dealer (to a ROUTER socket).
    Dealer,
}

impl SocketType {
    fn name(self) -> &'static [u8] {
        match self {
            Self::Sub => b"SUB",
            Self::Dealer => b"DEALER",
        }
    }

    /// The peer types it talks to.
    fn peers(self) -> &'static [&'static [u8]] {
        match self {
            Self::Sub => &[b"PUB", b"XPUB"],
            Self::Dealer => &[b"ROUTER", b"DEALER", b"REP"],
        }
    }
}

/// One ZMTP connection: over TCP, or (for the fuzz target) any byte
/// stream.
#[derive(Debug)]
pub struct Connection<S = TcpStream> {
    stream: BufReader<S>,
}

impl Connection {
    /// Connects to `endpoint` (`tcp://host:port`) as a `kind` socket and
    /// completes the handshake.
    pub async fn connect(endpoint: &str, kind: SocketType) -> Result<Self, ZmtpError> {
        let address = endpoint
            .strip_prefix("tcp://")
            .filter(|a| a.contains(':'))
            .ok_or_else(|| ZmtpError::Endpoint(endpoint.to_owned()))?;
        let tcp = TcpStream::connect(address).await?;
        tcp.set_nodelay(true)?;
        socket2::SockRef::from(&tcp).set_tcp_keepalive(
            &socket2::TcpKeepalive::new()
                .with_time(KEEPALIVE)
                .with_interval(KEEPALIVE),
        )?;
        Connection::over(tcp, kind).await
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Connection<S> {
    /// Completes the handshake as a `kind` socket over `stream`, an open
    /// byte stream to the peer.
    pub(crate) async fn over(stream: S, kind: SocketType) -> Result<Self, ZmtpError> {
        let mut conn = Self {
            stream: BufReader::new(stream),
        };
        conn.handshake(kind).await?;
        Ok(conn)
    }

    /// The stream under the connection (the fuzz target reads what was
    /// written to it).
    pub(crate) fn stream(&self) -> &S {
        self.stream.get_ref()
    }

    async fn handshake(&mut self, kind: SocketType) -> Result<(), ZmtpError> {
        let mut greeting = [0u8; 64];
        greeting[0] = 0xff;
        greeting[9] = 0x7f;
        greeting[10] = 3;
        greeting[12..16].copy_from_slice(b"NULL");
        self.stream.get_mut().write_all(&greeting).await?;
        let mut peer = [0u8; 64];
        self.stream.read_exact(&mut peer).await?;
        if peer[0] != 0xff || peer[9] != 0x7f {
            return Err(ZmtpError::Protocol("no ZMTP signature".into()));
        }
        if peer[10] < 3 {
            return Err(ZmtpError::Protocol(format!("ZMTP version {}.{}", peer[10], peer[11])));
        }
        if &peer[12..16] != b"NULL" || peer[16..32].iter().any(|b| *b != 0) {
            return Err(ZmtpError::Protocol("a security mechanism other than NULL".into()));
        }
        let mut ready = vec![5];
        ready.extend_from_slice(b"READY");
        ready.push(11);
        ready.extend_from_slice(b"Socket-Type");
        ready.extend_from_slice(&(kind.name().len() as u32).to_be_bytes());
        ready.extend_from_slice(kind.name());
        self.write_frame(COMMAND, &ready).await?;
        self.stream.get_mut().flush().await?;
        let (flags, body) = self.read_frame().await?;
        if flags & COMMAND == 0 || !body.starts_with(b"\x05READY") {
            return Err(ZmtpError::Protocol("no READY command".into()));
        }
        match property(&body[6..], b"Socket-Type") {
            Some(t) if kind.peers().contains(&t) => Ok(()),
            Some(t) => Err(ZmtpError::Protocol(format!(
                "a {} socket, not one a {} talks to",
                String::from_utf8_lossy(t),
                String::from_utf8_lossy(kind.name())
            ))),
            None => Err(ZmtpError::Protocol("READY without a Socket-Type".into())),
        }
    }

    /// Subscribes to messages whose first frame starts with `topic` (a SUB
    /// connection; ZMTP 3.0's message form, which 3.1 peers take too).
    pub async fn subscribe(&mut self, topic: &[u8]) -> Result<(), ZmtpError> {
        let mut body = vec![1];
        body.extend_from_slice(topic);
        self.send(&[&body]).await
    }

    /// Sends one message of `frames`.
    pub async fn send(&mut self, frames: &[&[u8]]) -> Result<(), ZmtpError> {
        for (i, frame) in frames.iter().enumerate() {
            let more = if i + 1 < frames.len() { MORE } else { 0 };
            self.write_frame(more, frame).await?;
        }
        self.stream.get_mut().flush().await?;
        Ok(())
    }

    /// The next message (commands, such as heartbeats, are skipped). An
    /// error when the peer closed the connection or broke the protocol.
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, ZmtpError> {
        let mut frames = Vec::new();
        let mut bytes = 0;
        loop {
            let (flags, body) = self.read_frame().await?;
            if flags & COMMAND != 0 {
                continue;
            }
            if frames.len() == MAX_FRAMES {
                return Err(ZmtpError::Protocol(format!("a message of over {MAX_FRAMES} frames")));
            }
            bytes += body.len();
            if bytes > MAX_MESSAGE {
                return Err(ZmtpError::Protocol(format!("a message of over {MAX_MESSAGE} bytes")));
            }
            frames.push(body);
            if flags & MORE == 0 {
                return Ok(frames);
            }
        }
    }

    async fn write_frame(&mut self, flags: u8, body: &[u8]) -> Result<(), ZmtpError> {
        let w = self.stream.get_mut();
        match u8::try_from(body.len()) {
            Ok(len) => w.write_all(&[flags, len]).await?,
            Err(_) => {
                w.write_all(&[flags | LONG]).await?;
                w.write_all(&(body.len() as u64).to_be_bytes()).await?;
            }
        }
        w.write_all(body).await?;
        Ok(())
    }

    async fn read_frame(&mut self) -> Result<(u8, Bytes), ZmtpError> {
        let flags = self.stream.read_u8().await?;
        if flags & !(MORE | LONG | COMMAND) != 0 {
            return Err(ZmtpError::Protocol(format!("frame flags {flags:#04x}")));
        }
        let size = if flags & LONG != 0 {
            self.stream.read_u64().await?
        } else {
            u64::from(self.stream.read_u8().await?)
        };
        if size > MAX_FRAME {
            return Err(ZmtpError::Protocol(format!("a frame of {size} bytes")));
        }
        // Grown as the bytes arrive, not allocated from the size the peer
        // announces: nine bytes claiming 64 MiB cost nothing.
        // Each step at most doubles what has arrived, and the body ends
        // exactly as large as announced.
        let size = size as usize;
        let mut body = Vec::new();
        while body.len() < size {
            let at = body.len();
            let step = (size - at).min(at.max(FRAME_CHUNK));
            body.reserve_exact(step);
            body.resize(at + step, 0);
            self.stream.read_exact(&mut body[at..]).await?;
        }
        Ok((flags, Bytes::from(body)))
    }
}

/// The value of property `name` in a READY command's metadata.
fn property<'a>(mut metadata: &'a [u8], name: &[u8]) -> Option<&'a [u8]> {
    while let Some((&len, rest)) = metadata.split_first() {
        let (key, rest) = rest.split_at_checked(usize::from(len))?;
        let (size, rest) = rest.split_at_checked(4)?;
        let size = u32::from_be_bytes(size.try_into().ok()?) as usize;
        let (value, rest) = rest.split_at_checked(size)?;
        if key.eq_ignore_ascii_case(name) {
            return Some(value);
        }
        metadata = rest;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_properties_are_read_and_bad_metadata_is_none() {
        let mut m = vec![11];
        m.extend_from_slice(b"Socket-Type");
        m.extend_from_slice(&3u32.to_be_bytes());
        m.extend_from_slice(b"PUB");
        m.push(8);
        m.extend_from_slice(b"Identity");
        m.extend_from_slice(&0u32.to_be_bytes());
        assert_eq!(property(&m, b"socket-type"), Some(&b"PUB"[..]));
        assert_eq!(property(&m, b"Identity"), Some(&b""[..]));
        assert_eq!(property(&m[..m.len() - 2], b"Identity"), None, "cut short");
        assert_eq!(property(&[200], b"x"), None);
    }

    /// A hostile publisher: after a proper handshake it sends frames of
    /// 15 MiB without end, then one frame announcing 1 TiB. The subscriber
    /// refuses the message once its frames pass [`MAX_MESSAGE`] (it holds
    /// at most that much, not 64 frames of 16 MiB), and the huge frame
    /// before reading it.
    #[tokio::test]
    async fn a_hostile_publisher_cannot_make_a_subscriber_hold_more_than_a_message() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        async fn publisher(frames: Vec<(u8, u64, usize)>) -> String {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            tokio::spawn(async move {
                let (mut s, _) = listener.accept().await.unwrap();
                let mut greeting = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0x7f, 3, 0];
                greeting.extend_from_slice(b"NULL");
                greeting.resize(64, 0);
                s.write_all(&greeting).await.unwrap();
                let mut ready = vec![5];
                ready.extend_from_slice(b"READY");
                ready.push(11);
                ready.extend_from_slice(b"Socket-Type");
                ready.extend_from_slice(&3u32.to_be_bytes());
                ready.extend_from_slice(b"PUB");
                s.write_all(&[COMMAND, ready.len() as u8]).await.unwrap();
                s.write_all(&ready).await.unwrap();
                // What the subscriber says is read away.
                let (mut r, mut w) = s.into_split();
                tokio::spawn(async move {
                    let mut sink = vec![0; 4096];
                    while r.read(&mut sink).await.is_ok_and(|n| n > 0) {}
                });
                let chunk = vec![7u8; 1 << 20];
                for (flags, size, send) in frames {
                    if w.write_all(&[flags | LONG]).await.is_err() || w.write_all(&size.to_be_bytes()).await.is_err() {
                        return;
                    }
                    for _ in 0..send {
                        if w.write_all(&chunk).await.is_err() {
                            return;
                        }
                    }
                }
            });
            format!("tcp://{addr}")
        }
        let endless = publisher(vec![(MORE, 15 << 20, 15); 10]).await;
        let mut sub = Connection::connect(&endless, SocketType::Sub).await.unwrap();
        match sub.recv().await {
            Err(ZmtpError::Protocol(why)) => assert!(why.contains("a message of over"), "{why}"),
            other => panic!("{:?}", other.map(|f| f.len())),
        }
        let huge = publisher(vec![(0, 1 << 40, 0)]).await;
        let mut sub = Connection::connect(&huge, SocketType::Sub).await.unwrap();
        match sub.recv().await {
            Err(ZmtpError::Protocol(why)) => assert!(why.contains("a frame of"), "{why}"),
            other => panic!("{:?}", other.map(|f| f.len())),
        }
    }

    /// A PUB peer's greeting and READY, then `frames` (flags, body).
    fn publisher_bytes(frames: &[(u8, &[u8])]) -> Vec<u8> {
        let mut out = vec![0u8; 64];
        out[0] = 0xff;
        out[9] = 0x7f;
        out[10] = 3;
        out[12..16].copy_from_slice(b"NULL");
        out.extend_from_slice(b"\x04\x19\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB");
        for (flags, body) in frames {
            out.push(flags | LONG);
            out.extend_from_slice(&(body.len() as u64).to_be_bytes());
            out.extend_from_slice(body);
        }
        out
    }

    #[tokio::test]
    async fn a_frame_is_read_as_it_arrives_not_as_large_as_it_says() {
        // A body of several read steps comes in whole, after a heartbeat.
        let body: Vec<u8> = (0..200_000u32).map(|i| i as u8).collect();
        let bytes = publisher_bytes(&[(COMMAND, b"\x04PING"), (MORE, b"topic"), (0, &body)]);
        let mut sub = Connection::over(tokio::io::join(&bytes[..], tokio::io::sink()), SocketType::Sub)
            .await
            .unwrap();
        let message = sub.recv().await.unwrap();
        assert_eq!(message, [&b"topic"[..], &body[..]]);
        // Nine bytes announcing 64 MiB are an end of stream, not 64 MiB
        // allocated up front (fuzz target zmtp,
        // tests/fuzz/regressions/zmtp).
        let mut bytes = publisher_bytes(&[]);
        bytes.push(LONG);
        bytes.extend_from_slice(&MAX_FRAME.to_be_bytes());
        bytes.extend_from_slice(b"short");
        let mut sub = Connection::over(tokio::io::join(&bytes[..], tokio::io::sink()), SocketType::Sub)
            .await
            .unwrap();
        assert!(matches!(sub.recv().await, Err(ZmtpError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof));
    }

    /// The simulator's publisher (the `zeromq` crate) as the peer: a
    /// subscription and a replay.
    #[tokio::test]
    async fn talks_to_a_pub_and_a_router() {
        use semlb_workers::kv_events::{KvEvent, KvEventsConfig, Publisher};
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let config = KvEventsConfig {
            endpoint: "tcp://127.0.0.1:0".into(),
            replay_endpoint: Some("tcp://127.0.0.1:0".into()),
            buffer_steps: 10,
            topic: "kv".into(),
        };
        let bound = Publisher::start(&config, rx).await.unwrap();
        let mut sub = Connection::connect(&bound.endpoint, SocketType::Sub).await.unwrap();
        sub.subscribe(b"").await.unwrap();
        // The subscription travels to the publisher: send until one lands.
        let message = loop {
            tx.send(vec![KvEvent::Cleared]).unwrap();
            if let Ok(m) = tokio::time::timeout(Duration::from_millis(50), sub.recv()).await {
                break m.unwrap();
            }
        };
        assert_eq!(message.len(), 3);
        assert_eq!(&message[0][..], b"kv");
        let mut dealer = Connection::connect(bound.replay_endpoint.as_deref().unwrap(), SocketType::Dealer)
            .await
            .unwrap();
        dealer.send(&[b"", &0u64.to_be_bytes()]).await.unwrap();
        let mut seqs = Vec::new();
        loop {
            let reply = dealer.recv().await.unwrap();
            assert_eq!((reply.len(), &reply[0][..]), (3, &b""[..]));
            if reply[1][..] == (-1i64).to_be_bytes() {
                break;
            }
            seqs.push(u64::from_be_bytes(reply[1][..].try_into().unwrap()));
        }
        assert!(
            !seqs.is_empty() && seqs.windows(2).all(|w| w[1] == w[0] + 1),
            "{seqs:?}"
        );
        // A SUB cannot talk to a ROUTER; a closed peer is an error.
        assert!(matches!(
            Connection::connect(bound.replay_endpoint.as_deref().unwrap(), SocketType::Sub).await,
            Err(ZmtpError::Protocol(_))
        ));
        drop(tx);
        assert!(Connection::connect("127.0.0.1:1", SocketType::Sub).await.is_err());
    }
}
