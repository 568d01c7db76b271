//! `[[backend]]`: one inference server, its URL and its metrics flavour.

use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use serde::Deserialize;
use shm_layout::server_table::MAX_ADDRESS_BYTES;

use super::MAX_BACKEND_NAME_BYTES;

/// One inference server (a `[[backend]]` table).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    /// Its base URL: `http://host:port`, where host is a name, an IPv4
    /// address or a bracketed IPv6 address. The port is required (engines
    /// listen on 8000, 30000 or 8080, never on 80 by default), and there is
    /// no path: the client's path (`/v1/...`) is forwarded as it is.
    pub url: String,
    /// Its name in logs and metrics; default `host:port`.
    #[serde(default)]
    pub name: Option<String>,
    /// How its `/metrics` is read. Default `auto`.
    #[serde(default)]
    pub metrics_flavor: MetricsFlavor,
    /// Its engine takes vLLM's `cache_salt`: requests of tenants whose
    /// prefixes are kept apart carry their salt to it
    /// ([`crate::tenancy::auth`]'s `isolate_prefixes`). Default false.
    #[serde(default)]
    pub cache_salt: bool,
    /// Its engine's KV cache events: the ZeroMQ PUB endpoint it publishes
    /// on (vLLM's `--kv-events-config` `endpoint`, as this host reaches it:
    /// `tcp://host:port`). A response process subscribes and keeps the
    /// blocks the engine holds in the confirmed prefix table
    /// ([`crate::kv_events`]). Default none.
    #[serde(default)]
    pub kv_events: Option<String>,
    /// Its engine's replay socket for lost events (vLLM's
    /// `replay_endpoint`, `tcp://host:port`), if it has one. Default none.
    #[serde(default)]
    pub kv_events_replay: Option<String>,
}

impl BackendConfig {
    /// A backend with this URL, no name and `metrics_flavor = "auto"`
    /// (what `--backend URL` gives).
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            name: None,
            metrics_flavor: MetricsFlavor::Auto,
            cache_salt: false,
            kv_events: None,
            kv_events_replay: None,
        }
    }

    /// The backend of a `POST /admin/servers` body (`{"url": ..., "name":
    /// ...}`, `name` optional), with the defaults otherwise; not yet
    /// validated.
    pub fn from_admin_body(body: serde_json::Value) -> Result<Self, serde_json::Error> {
        let AdminServer { url, name } = serde_json::from_value(body)?;
        Ok(Self { name, ..Self::new(url) })
    }

    /// Whether `endpoint` is one a subscriber can connect to:
    /// `tcp://host:port`, host a name or an IP address. The error is the
    /// reason only.
    pub fn check_events_endpoint(endpoint: &str) -> Result<(), String> {
        let Some(rest) = endpoint.strip_prefix("tcp://") else {
            return Err("must be tcp://host:port (the address this host reaches the engine's socket at)".to_owned());
        };
        let (host, port) = rest
            .rsplit_once(':')
            .ok_or_else(|| "has no port (tcp://host:port)".to_owned())?;
        if host.is_empty() || host == "*" || host.contains('/') {
            return Err(
                "needs the engine's host name or address (an engine binds *, a subscriber connects to a host)"
                    .to_owned(),
            );
        }
        match port.parse::<u16>() {
            Ok(p) if p > 0 => Ok(()),
            _ => Err(format!("port {port:?} is not 1 to 65535")),
        }
    }

    /// Its URL taken apart; errors say what is wrong with it.
    pub fn parsed_url(&self) -> Result<BackendUrl, String> {
        self.url.parse()
    }

    /// How the server table names it: `http://host:port`, or the reason
    /// its URL does not parse.
    pub fn server_address(&self) -> Result<String, String> {
        self.parsed_url().map(|url| format!("http://{}", url.authority()))
    }

    /// Whether [`name`](Self::name), if given, is a valid name: 1 to
    /// [`MAX_BACKEND_NAME_BYTES`] letters, digits or `. _ : -`. The error
    /// is the reason only.
    pub fn check_name(&self) -> Result<(), String> {
        let Some(name) = &self.name else { return Ok(()) };
        let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-');
        if name.is_empty() || name.len() > MAX_BACKEND_NAME_BYTES || !name.chars().all(ok_char) {
            return Err(format!(
                "must be 1 to {MAX_BACKEND_NAME_BYTES} letters, digits or . _ : - (it is a metrics label)"
            ));
        }
        Ok(())
    }

    /// Its name: `name` if given, else the URL's `host:port` (the URL as
    /// written if it does not parse).
    pub fn display_name(&self) -> String {
        match (&self.name, self.parsed_url()) {
            (Some(name), _) => name.clone(),
            (None, Ok(url)) => url.authority(),
            (None, Err(_)) => self.url.clone(),
        }
    }
}

/// The body of `POST /admin/servers`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AdminServer {
    url: String,
    #[serde(default)]
    name: Option<String>,
}

/// Which metrics an engine exposes on `/metrics`, for the load figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MetricsFlavor {
    /// Tell from the metric names (`vllm:`, `sglang:`, `llamacpp:`).
    #[default]
    Auto,
    /// vLLM (`vllm:num_requests_running`, ...).
    Vllm,
    /// SGLang (`sglang:num_running_reqs`, ...).
    Sglang,
    /// llama.cpp's `llama-server --metrics` (`llamacpp:requests_processing`, ...).
    Llamacpp,
}

/// A backend URL taken apart: `http://host:port`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BackendUrl {
    /// Host name in lower case, or an IP address as Rust prints it
    /// (an IPv6 address without its brackets).
    pub host: String,
    /// Port.
    pub port: u16,
}

impl BackendUrl {
    /// `host:port`, with an IPv6 host in brackets: what to connect to and
    /// the `Host` header.
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

impl fmt::Display for BackendUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "http://{}", self.authority())
    }
}

/// Whether `host` is a DNS name: dot-separated labels of letters, digits,
/// `-` and `_` (container names), 1 to 63 bytes each, not starting or ending
/// with `-`; 253 bytes in all at most.
fn is_host_name(host: &str) -> bool {
    host.len() <= 253
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

impl FromStr for BackendUrl {
    type Err = String;

    /// Parses `http://host:port` (an optional trailing `/` is allowed).
    /// The error is the reason only; the caller names the field and value.
    fn from_str(url: &str) -> Result<Self, String> {
        if url.len() > MAX_ADDRESS_BYTES {
            return Err(format!(
                "it is longer than {MAX_ADDRESS_BYTES} bytes (the server table's address limit)"
            ));
        }
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err("expected http://host:port".into());
        };
        if !scheme.eq_ignore_ascii_case("http") {
            return Err(format!(
                "the scheme must be http, not {scheme:?} (semlb speaks plain HTTP to inference servers)"
            ));
        }
        let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        if !tail.is_empty() && tail != "/" {
            return Err(format!(
                "it must not have a path, query or fragment (found {tail:?}): the client's path is forwarded as it is"
            ));
        }
        if authority.contains('@') {
            return Err("it must not contain user information (user@)".into());
        }
        let bracketed = authority.starts_with('[');
        let (host, port) = if let Some(inner) = authority.strip_prefix('[') {
            let Some((ip, port)) = inner.split_once(']') else {
                return Err("an IPv6 address must be closed with ']'".into());
            };
            let ip: Ipv6Addr = ip.parse().map_err(|_| format!("{ip:?} is not an IPv6 address"))?;
            match port.strip_prefix(':') {
                Some(port) => (ip.to_string(), Some(port)),
                None if port.is_empty() => (ip.to_string(), None),
                None => return Err(format!("expected ':port' after the IPv6 address, found {port:?}")),
            }
        } else {
            match authority.rsplit_once(':') {
                Some((host, port)) => (host.to_ascii_lowercase(), Some(port)),
                None => (authority.to_ascii_lowercase(), None),
            }
        };
        if host.is_empty() {
            return Err("the host is missing".into());
        }
        if !bracketed && host.contains(':') {
            return Err("an IPv6 address must be in brackets: http://[::1]:8000".into());
        }
        if !bracketed && host.parse::<Ipv4Addr>().is_err() && !is_host_name(&host) {
            return Err(format!("{host:?} is not a host name or IP address"));
        }
        let Some(port) = port.filter(|p| !p.is_empty()) else {
            return Err("the port is missing (expected http://host:port)".into());
        };
        if !port.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!("port {port:?} is not a number"));
        }
        let port = port
            .parse::<u16>()
            .ok()
            .filter(|&p| p != 0)
            .ok_or_else(|| format!("port {port} is not in 1..=65535"))?;
        Ok(Self { host, port })
    }
}
