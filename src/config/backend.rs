//! `[[backend]]`: one inference server, its URL and its metrics flavour.

use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use serde::Deserialize;
use shm_layout::server_table::MAX_ADDRESS_BYTES;

use super::MAX_BACKEND_NAME_BYTES;
use super::disaggregation::BackendRole;

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
    /// Its part in disaggregated serving. Default `both`.
    #[serde(default)]
    pub role: BackendRole,
    /// SGLang: the port of its engine's bootstrap server, when it
    /// prefills (default: what its `/server_info` says, else 8998).
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
    /// Its capacity relative to the other backends' (1 to
    /// [`MAX_WEIGHT`]): the routing policies compare loads per unit of
    /// weight. Default 1.
    #[serde(default = "one")]
    pub weight: u32,
}

/// The largest backend weight.
pub const MAX_WEIGHT: u32 = 1000;

fn one() -> u32 {
    1
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
            role: BackendRole::Both,
            bootstrap_port: None,
            weight: 1,
        }
    }

    /// The backend of a `POST /admin/servers` body (`{"url": ..., "name":
    /// ..., "role": ..., "bootstrap_port": ..., "cache_salt": ...,
    /// "metrics_flavor": ...}`, all but `url` optional), with the defaults
    /// otherwise; not yet validated.
    pub fn from_admin_body(body: serde_json::Value) -> Result<Self, serde_json::Error> {
        let AdminServer {
            url,
            name,
            role,
            bootstrap_port,
            cache_salt,
            metrics_flavor,
            weight,
            kv_events,
            kv_events_replay,
        } = serde_json::from_value(body)?;
        Ok(Self {
            name,
            role,
            bootstrap_port,
            cache_salt,
            metrics_flavor,
            weight,
            kv_events,
            kv_events_replay,
            ..Self::new(url)
        })
    }

    /// What its registration carries for the request path and the health
    /// checker ([`shm_layout::EngineSettings`]).
    pub fn engine_settings(&self) -> shm_layout::EngineSettings {
        shm_layout::EngineSettings {
            cache_salt: self.cache_salt,
            metrics: self.metrics_flavor.code(),
            weight: u16::try_from(self.weight.clamp(1, MAX_WEIGHT)).unwrap_or(1),
            kv_events_port: self.kv_events.as_deref().and_then(|e| self.port_on_own_host(e)),
            kv_replay_port: self.kv_events_replay.as_deref().and_then(|e| self.port_on_own_host(e)),
        }
    }

    /// The port of `endpoint` (`tcp://host:port`) if its host is this
    /// backend's (what a registration can carry: the subscriber of an
    /// engine found at run time connects to the engine's host).
    pub fn port_on_own_host(&self, endpoint: &str) -> Option<u16> {
        let url = self.parsed_url().ok()?;
        let (host, port) = endpoint.strip_prefix("tcp://")?.rsplit_once(':')?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let ip = |h: &str| h.parse::<std::net::IpAddr>().ok();
        let same = host.eq_ignore_ascii_case(&url.host) || (ip(host).is_some() && ip(host) == ip(&url.host));
        same.then(|| port.parse().ok()).flatten().filter(|p| *p != 0)
    }

    /// Whether its KV events endpoints, if any, are `tcp://host:port` on
    /// its own host: what a backend registered at run time (the admin
    /// API, discovery) can carry. The error is the reason only.
    pub fn check_events_on_own_host(&self) -> Result<(), BackendError> {
        for endpoint in [&self.kv_events, &self.kv_events_replay].into_iter().flatten() {
            Self::check_events_endpoint(endpoint)?;
            if self.port_on_own_host(endpoint).is_none() {
                return Err(BackendError::EventsElsewhere);
            }
        }
        Ok(())
    }

    /// Whether its weight is 1 to [`MAX_WEIGHT`]. The error is the reason
    /// only.
    pub fn check_weight(&self) -> Result<(), BackendError> {
        if (1..=MAX_WEIGHT).contains(&self.weight) {
            Ok(())
        } else {
            Err(BackendError::Weight)
        }
    }

    /// Whether `endpoint` is one a subscriber can connect to:
    /// `tcp://host:port`, host a name or an IP address. The error is the
    /// reason only.
    pub fn check_events_endpoint(endpoint: &str) -> Result<(), BackendError> {
        let Some(rest) = endpoint.strip_prefix("tcp://") else {
            return Err(BackendError::EventsScheme);
        };
        let (host, port) = rest.rsplit_once(':').ok_or(BackendError::EventsNoPort)?;
        if host.is_empty() || host == "*" || host.contains('/') {
            return Err(BackendError::EventsHost);
        }
        match port.parse::<u16>() {
            Ok(p) if p > 0 => Ok(()),
            _ => Err(BackendError::EventsPort(port.to_owned())),
        }
    }

    /// Its URL taken apart; errors say what is wrong with it.
    pub fn parsed_url(&self) -> Result<BackendUrl, BackendUrlError> {
        self.url.parse()
    }

    /// How the server table names it: `http://host:port`, or the reason
    /// its URL does not parse.
    pub fn server_address(&self) -> Result<String, BackendUrlError> {
        self.parsed_url().map(|url| format!("http://{}", url.authority()))
    }

    /// Whether [`name`](Self::name), if given, is a valid name: 1 to
    /// [`MAX_BACKEND_NAME_BYTES`] letters, digits or `. _ : -`. The error
    /// is the reason only.
    pub fn check_name(&self) -> Result<(), BackendError> {
        let Some(name) = &self.name else { return Ok(()) };
        let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-');
        if name.is_empty() || name.len() > MAX_BACKEND_NAME_BYTES || !name.chars().all(ok_char) {
            return Err(BackendError::Name);
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

/// What is wrong with a backend's name or KV events endpoint: the reason
/// only (the caller names the field and the value).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// `name` is not 1 to [`MAX_BACKEND_NAME_BYTES`] of `A-Z a-z 0-9 . _ : -`.
    #[error("must be 1 to {MAX_BACKEND_NAME_BYTES} letters, digits or . _ : - (it is a metrics label)")]
    Name,
    /// An events endpoint that is not `tcp://`.
    #[error("must be tcp://host:port (the address this host reaches the engine's socket at)")]
    EventsScheme,
    /// An events endpoint without a port.
    #[error("has no port (tcp://host:port)")]
    EventsNoPort,
    /// An events endpoint without a host to connect to (`*` is a bind address).
    #[error("needs the engine's host name or address (an engine binds *, a subscriber connects to a host)")]
    EventsHost,
    /// An events endpoint's port (as written) that is not 1 to 65535.
    #[error("port {0:?} is not 1 to 65535")]
    EventsPort(String),
    /// A backend registered at run time whose events endpoint is not on
    /// its own host.
    #[error("must be on the engine's own host (tcp://<the url's host>:port) for an engine added at run time")]
    EventsElsewhere,
    /// A weight that is not 1 to [`MAX_WEIGHT`].
    #[error("must be 1 to {MAX_WEIGHT}")]
    Weight,
}

/// Why a URL is not a backend's `http://host:port`: the reason only (the
/// caller names the field and the value).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendUrlError {
    /// Longer than the server table's address field.
    #[error("it is longer than {MAX_ADDRESS_BYTES} bytes (the server table's address limit)")]
    TooLong,
    /// No `scheme://`.
    #[error("expected http://host:port")]
    NoScheme,
    /// A scheme other than `http` (as written).
    #[error("the scheme must be http, not {0:?} (semlb speaks plain HTTP to inference servers)")]
    Scheme(String),
    /// A path, query or fragment (as written, from its `/`, `?` or `#`).
    #[error("it must not have a path, query or fragment (found {0:?}): the client's path is forwarded as it is")]
    Path(String),
    /// `user@` in the authority.
    #[error("it must not contain user information (user@)")]
    UserInfo,
    /// `[` without its `]`.
    #[error("an IPv6 address must be closed with ']'")]
    UnclosedIpv6,
    /// The text in brackets (as written) is not an IPv6 address.
    #[error("{0:?} is not an IPv6 address")]
    NotIpv6(String),
    /// Something other than `:port` (as written) after `]`.
    #[error("expected ':port' after the IPv6 address, found {0:?}")]
    AfterIpv6(String),
    /// No host.
    #[error("the host is missing")]
    NoHost,
    /// An IPv6 address without brackets.
    #[error("an IPv6 address must be in brackets: http://[::1]:8000")]
    Ipv6Brackets,
    /// The host (lower-cased) is neither a DNS name nor an IPv4 address.
    #[error("{0:?} is not a host name or IP address")]
    Host(String),
    /// No port.
    #[error("the port is missing (expected http://host:port)")]
    NoPort,
    /// The port (as written) is not digits.
    #[error("port {0:?} is not a number")]
    PortNotNumber(String),
    /// The port (as written) is 0 or above 65535.
    #[error("port {0} is not in 1..=65535")]
    PortRange(String),
}

/// The body of `POST /admin/servers`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AdminServer {
    url: String,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    role: BackendRole,
    #[serde(default)]
    bootstrap_port: Option<u16>,
    #[serde(default)]
    cache_salt: bool,
    #[serde(default)]
    metrics_flavor: MetricsFlavor,
    #[serde(default = "one")]
    weight: u32,
    #[serde(default)]
    kv_events: Option<String>,
    #[serde(default)]
    kv_events_replay: Option<String>,
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

impl MetricsFlavor {
    /// Its code in a registration's settings ([`shm_layout::EngineSettings::metrics`]).
    pub const fn code(self) -> u8 {
        match self {
            Self::Auto => 0,
            Self::Vllm => 1,
            Self::Sglang => 2,
            Self::Llamacpp => 3,
        }
    }

    /// The flavor of `code` (an unknown code: `Auto`).
    pub const fn of_code(code: u8) -> Self {
        match code {
            1 => Self::Vllm,
            2 => Self::Sglang,
            3 => Self::Llamacpp,
            _ => Self::Auto,
        }
    }
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
        format!("{}:{}", self.bracketed_host(), self.port)
    }

    /// The host as a URL or `host:port` writes it: an IPv6 address in
    /// brackets.
    pub fn bracketed_host(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
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
    type Err = BackendUrlError;

    /// Parses `http://host:port` (an optional trailing `/` is allowed).
    /// The error is the reason only; the caller names the field and value.
    fn from_str(url: &str) -> Result<Self, BackendUrlError> {
        use BackendUrlError as E;
        if url.len() > MAX_ADDRESS_BYTES {
            return Err(E::TooLong);
        }
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err(E::NoScheme);
        };
        if !scheme.eq_ignore_ascii_case("http") {
            return Err(E::Scheme(scheme.to_owned()));
        }
        let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        if !tail.is_empty() && tail != "/" {
            return Err(E::Path(tail.to_owned()));
        }
        if authority.contains('@') {
            return Err(E::UserInfo);
        }
        let bracketed = authority.starts_with('[');
        let (host, port) = if let Some(inner) = authority.strip_prefix('[') {
            let Some((ip, port)) = inner.split_once(']') else {
                return Err(E::UnclosedIpv6);
            };
            let ip: Ipv6Addr = ip.parse().map_err(|_| E::NotIpv6(ip.to_owned()))?;
            match port.strip_prefix(':') {
                Some(port) => (ip.to_string(), Some(port)),
                None if port.is_empty() => (ip.to_string(), None),
                None => return Err(E::AfterIpv6(port.to_owned())),
            }
        } else {
            match authority.rsplit_once(':') {
                Some((host, port)) => (host.to_ascii_lowercase(), Some(port)),
                None => (authority.to_ascii_lowercase(), None),
            }
        };
        if host.is_empty() {
            return Err(E::NoHost);
        }
        if !bracketed && host.contains(':') {
            return Err(E::Ipv6Brackets);
        }
        if !bracketed && host.parse::<Ipv4Addr>().is_err() && !is_host_name(&host) {
            return Err(E::Host(host));
        }
        let Some(port) = port.filter(|p| !p.is_empty()) else {
            return Err(E::NoPort);
        };
        if !port.bytes().all(|b| b.is_ascii_digit()) {
            return Err(E::PortNotNumber(port.to_owned()));
        }
        let port = port
            .parse::<u16>()
            .ok()
            .filter(|&p| p != 0)
            .ok_or_else(|| E::PortRange(port.to_owned()))?;
        Ok(Self { host, port })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_flavors_round_trip_through_their_codes() {
        for flavor in [
            MetricsFlavor::Auto,
            MetricsFlavor::Vllm,
            MetricsFlavor::Sglang,
            MetricsFlavor::Llamacpp,
        ] {
            assert_eq!(MetricsFlavor::of_code(flavor.code()), flavor);
        }
        assert_eq!(MetricsFlavor::of_code(200), MetricsFlavor::Auto);
    }

    #[test]
    fn an_admin_body_carries_the_engine_settings() {
        let b = BackendConfig::from_admin_body(serde_json::json!({
            "url": "http://10.0.0.1:8000", "cache_salt": true, "metrics_flavor": "sglang"
        }))
        .unwrap();
        assert_eq!(
            b.engine_settings(),
            shm_layout::EngineSettings {
                cache_salt: true,
                metrics: MetricsFlavor::Sglang.code(),
                ..shm_layout::EngineSettings::default()
            }
        );
        assert!(BackendConfig::from_admin_body(serde_json::json!({"url": "http://a:1", "cache": 1})).is_err());
        let heavy = BackendConfig::from_admin_body(serde_json::json!({"url": "http://a:1", "weight": 3})).unwrap();
        assert_eq!((heavy.engine_settings().weight, heavy.check_weight()), (3, Ok(())));
        let none = BackendConfig::from_admin_body(serde_json::json!({"url": "http://a:1", "weight": 0})).unwrap();
        assert_eq!(none.check_weight(), Err(BackendError::Weight));
    }

    #[test]
    fn kv_events_ports_are_carried_only_on_the_engines_own_host() {
        let with = |url: &str, events: &str, replay: Option<&str>| BackendConfig {
            kv_events: Some(events.into()),
            kv_events_replay: replay.map(Into::into),
            ..BackendConfig::new(url)
        };
        let b = with(
            "http://10.0.0.7:8000",
            "tcp://10.0.0.7:5557",
            Some("tcp://10.0.0.7:5558"),
        );
        let s = b.engine_settings();
        assert_eq!((s.kv_events_port, s.kv_replay_port), (Some(5557), Some(5558)));
        assert_eq!(b.check_events_on_own_host(), Ok(()));
        let named = with("http://Engine-0.ns.svc:8000", "tcp://engine-0.ns.svc:5557", None);
        assert_eq!(named.engine_settings().kv_events_port, Some(5557));
        let v6 = with("http://[::1]:8000", "tcp://[0:0::1]:5557", None);
        assert_eq!(v6.engine_settings().kv_events_port, Some(5557));
        let elsewhere = with("http://10.0.0.7:8000", "tcp://10.0.0.8:5557", None);
        assert_eq!(elsewhere.engine_settings().kv_events_port, None);
        assert_eq!(elsewhere.check_events_on_own_host(), Err(BackendError::EventsElsewhere));
        let bound = with("http://10.0.0.7:8000", "tcp://*:5557", None);
        assert_eq!(bound.check_events_on_own_host(), Err(BackendError::EventsHost));
        assert_eq!(BackendConfig::new("http://a:1").engine_settings().kv_events_port, None);
    }
}
