//! SGLang: both legs at once, with the same body, meeting at the prefill
//! engine's bootstrap server: `bootstrap_host` (its host; an IPv6 address
//! in brackets), `bootstrap_port` (its `--disaggregation-bootstrap-port`)
//! and `bootstrap_room` (a random number below 2^63 naming this pair).

use bytes::Bytes;
use serde_json::{Value, json};

/// Where a pair meets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::dispatcher) struct Rendezvous {
    /// The prefill engine's host.
    pub host: String,
    /// Its bootstrap server's port.
    pub port: u16,
    /// The pair's room.
    pub room: u64,
}

impl Rendezvous {
    /// The rendezvous at the prefill engine at `address` (`http://host:port`),
    /// whose bootstrap server listens on `port`, in a new random room.
    pub fn at(address: &str, port: u16) -> Self {
        Self {
            host: bootstrap_host(address),
            port,
            // Below 2^62: SGLang numbers the rooms of a request's `n`
            // sequences from it upward, within 2^63.
            room: super::random_u64() >> 2,
        }
    }

    /// `body` with the rendezvous (a client's own fields replaced); `None`
    /// if it is not a JSON object.
    pub fn body(&self, body: &[u8]) -> Option<Bytes> {
        let Ok(Value::Object(mut object)) = serde_json::from_slice::<Value>(body) else {
            return None;
        };
        object.insert("bootstrap_host".into(), json!(self.host));
        object.insert("bootstrap_port".into(), json!(self.port));
        object.insert("bootstrap_room".into(), json!(self.room));
        Some(Bytes::from(
            serde_json::to_vec(&object).expect("a JSON value serializes"),
        ))
    }
}

/// The host of `address` (`http://host:port`) as SGLang's bootstrap
/// client connects to it: a name or IPv4 address as it is, an IPv6
/// address in brackets.
fn bootstrap_host(address: &str) -> String {
    let authority = address.split_once("://").map_or(address, |(_, rest)| rest);
    let authority = authority.split('/').next().unwrap_or(authority);
    if let Some(end) = authority.strip_prefix('[').and_then(|a| a.find(']')) {
        return authority[..end + 2].to_owned();
    }
    authority
        .rsplit_once(':')
        .map_or(authority, |(host, _)| host)
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_written_as_the_bootstrap_client_connects() {
        assert_eq!(bootstrap_host("http://10.0.0.7:30000"), "10.0.0.7");
        assert_eq!(bootstrap_host("http://prefill-0.svc:30000"), "prefill-0.svc");
        assert_eq!(bootstrap_host("http://[fd00::7]:30000"), "[fd00::7]");
        assert_eq!(bootstrap_host("http://[::1]:8000/"), "[::1]");
    }

    #[test]
    fn both_legs_carry_the_same_rendezvous() {
        let r = Rendezvous::at("http://[::1]:30000", 8998);
        assert!(r.room < 1 << 63);
        let body = br#"{"model":"m","prompt":"x","stream":true,"bootstrap_room":7}"#;
        let v: Value = serde_json::from_slice(&r.body(body).unwrap()).unwrap();
        assert_eq!(v["bootstrap_host"], "[::1]");
        assert_eq!(v["bootstrap_port"], 8998);
        assert_eq!(v["bootstrap_room"], r.room);
        assert_eq!((v["prompt"].clone(), v["stream"].clone()), (json!("x"), json!(true)));
        assert!(r.body(b"[]").is_none());
        // Rooms differ between pairs.
        assert_ne!(
            Rendezvous::at("http://a:1", 1).room,
            Rendezvous::at("http://a:1", 1).room
        );
    }
}
