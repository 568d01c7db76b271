//! `[peering]` and `[[peer]]`: this gateway as one region of a group of
//! peer gateways (SkyLB's two-layer forwarding, [`crate::peers`]).
//!
//! ```toml
//! [peering]
//! region = "eu-west"
//! token_file = "/etc/semlb/peer-token"   # what peers must present to read our load
//!
//! [[peer]]
//! url = "http://gw.us-east.internal:8080"
//! region = "us-east"
//! token_file = "/etc/semlb/us-east-token"  # what we present to it
//! ```
//!
//! Tokens are read from files only its owner may read (as `admin.token_file`),
//! never written in the configuration.

use std::path::PathBuf;

use serde::Deserialize;

use super::sections::read_token_file;
use super::{BackendUrl, BackendUrlError, ConfigError, quoted};

/// At most this many peers.
pub const MAX_PEERS: usize = 16;

/// `[peering]`: this gateway's region and how it works with its peers.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PeeringConfig {
    /// This gateway's region name (in the load summary it serves, and in
    /// the hop header of the requests it forwards). Required with peers or
    /// a token.
    pub region: Option<String>,
    /// A file holding the token peers present (`x-semlb-peer-token`) to read
    /// this gateway's load summary (`GET /semlb/peer/load`). `None`: the
    /// summary is not served (404), and no peer can forward here by load.
    pub token_file: Option<PathBuf>,
    /// How often each dispatcher asks each peer for its load (ms).
    pub poll_ms: u64,
    /// A peer's summary older than this (ms since it was received) is not
    /// used: the peer is treated as unknown, and nothing is forwarded to it.
    pub max_age_ms: u64,
    /// Forward a request (rather than queue it) only when the local queue's
    /// expected wait is longer than this (ms), and longer than the peer's
    /// round trip.
    pub forward_after_ms: u64,
    /// A peer's round trip that costs as much as all of its servers'
    /// spare capacity, when peers are ranked (ms): a peer scores its free
    /// share of servers less its round trip over this.
    pub delay_penalty_ms: u64,
    /// A conversation forwarded to a peer keeps going there (its next turn
    /// is forwarded even when a local server has room) while its last turn
    /// there is at most this old (s) and the peer says its engines keep
    /// entries that long ([`crate::peers::affinity`]). 0: no affinity
    /// (every request is served here while a local server has room).
    pub affinity_secs: u64,
}

impl Default for PeeringConfig {
    fn default() -> Self {
        Self {
            region: None,
            token_file: None,
            poll_ms: 250,
            max_age_ms: 1500,
            forward_after_ms: 500,
            delay_penalty_ms: 200,
            affinity_secs: 300,
        }
    }
}

/// One `[[peer]]`: another region's gateway.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerConfig {
    /// Its OpenAI-compatible front: `http://host:port` or, over TLS,
    /// `https://host:port`; no path.
    pub url: String,
    /// Its region name (logs, metrics, the summary check).
    pub region: String,
    /// A file holding the token it expects (its `peering.token_file`'s
    /// contents). Required.
    pub token_file: PathBuf,
    /// Latency added before every request to it, load polls and forwarded
    /// requests alike (ms): an inter-region delay for tests and benchmarks
    /// on one machine. Default 0.
    #[serde(default)]
    pub delay_ms: u64,
    /// With `https://`: the CA (PEM) its certificate must chain to.
    /// Default: the system's roots.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// With `https://`: this gateway's client certificate (PEM), for a
    /// peer that asks for one (its `tls.client_ca_file`).
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    /// The client certificate's private key (PEM, mode 0600).
    #[serde(default)]
    pub key_file: Option<PathBuf>,
}

impl PeerConfig {
    /// Its base URL as requests are sent to it: `http://host:port` or
    /// `https://host:port`.
    pub fn address(&self) -> Result<String, BackendUrlError> {
        match self.url.split_once("://") {
            Some((scheme, rest)) if scheme.eq_ignore_ascii_case("https") => format!("http://{rest}")
                .parse::<BackendUrl>()
                .map(|u| format!("https://{}", u.authority())),
            _ => self.url.parse::<BackendUrl>().map(|u| u.to_string()),
        }
    }

    /// Its TLS settings, when its URL is `https://`.
    pub fn tls(&self) -> Option<PeerTls> {
        self.address()
            .ok()
            .filter(|a| a.starts_with("https://"))
            .map(|_| PeerTls {
                ca_file: self.ca_file.clone(),
                cert_file: self.cert_file.clone(),
                key_file: self.key_file.clone(),
            })
    }

    /// The token it expects, read from its file.
    pub fn read_token(&self) -> Result<String, ConfigError> {
        read_token_file("peer.token_file", &self.token_file)
    }
}

impl PeeringConfig {
    /// The token peers must present, if this gateway serves its summary.
    pub fn read_token(&self) -> Result<Option<String>, ConfigError> {
        self.token_file
            .as_ref()
            .map(|p| read_token_file("peering.token_file", p))
            .transpose()
    }
}

/// A region name that is not 1 to 64 of `A-Z a-z 0-9 . _ : -` (the
/// reason only: the caller names the field and the value).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("must be 1 to 64 letters, digits or . _ : - (it is a header value and a metrics label)")]
struct RegionError;

/// Whether `name` is a region name: 1 to 64 of `A-Z a-z 0-9 . _ : -`.
fn check_region(name: &str) -> Result<(), RegionError> {
    let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-');
    if name.is_empty() || name.len() > 64 || !name.chars().all(ok) {
        return Err(RegionError);
    }
    Ok(())
}

/// Checks `[peering]` and the `[[peer]]` list (not the token files, which
/// are read when the dispatchers start).
pub(super) fn validate_peering(peering: &PeeringConfig, peers: &[PeerConfig]) -> Result<(), ConfigError> {
    use ConfigError as E;
    if (!peers.is_empty() || peering.token_file.is_some()) && peering.region.is_none() {
        return Err(E::invalid(
            "peering.region",
            "(not set)",
            "is required with [[peer]] tables or peering.token_file: name this gateway's region",
        ));
    }
    if let Some(region) = &peering.region {
        check_region(region).map_err(|r| E::invalid("peering.region", quoted(region), r))?;
    }
    for (field, value, range) in [
        ("peering.poll_ms", peering.poll_ms, 10..=60_000),
        ("peering.max_age_ms", peering.max_age_ms, 10..=600_000),
        ("peering.forward_after_ms", peering.forward_after_ms, 0..=3_600_000),
        ("peering.delay_penalty_ms", peering.delay_penalty_ms, 1..=3_600_000),
        ("peering.affinity_secs", peering.affinity_secs, 0..=3_600),
    ] {
        if !range.contains(&value) {
            return Err(E::invalid(
                field,
                value,
                format!("must be between {} and {}", range.start(), range.end()),
            ));
        }
    }
    if peering.max_age_ms < peering.poll_ms {
        return Err(E::invalid(
            "peering.max_age_ms",
            peering.max_age_ms,
            format!(
                "must be at least peering.poll_ms = {} (else every summary is stale before the next)",
                peering.poll_ms
            ),
        ));
    }
    if peers.len() > MAX_PEERS {
        return Err(E::invalid("peer", peers.len(), format!("at most {MAX_PEERS} peers")));
    }
    let mut seen = Vec::new();
    for p in peers {
        let address = p.address().map_err(|r| E::invalid("peer.url", quoted(&p.url), r))?;
        if seen.contains(&address) {
            return Err(E::invalid("peer.url", quoted(&p.url), "is listed twice"));
        }
        seen.push(address);
        check_region(&p.region).map_err(|r| E::invalid("peer.region", quoted(&p.region), r))?;
        if peering.region.as_deref() == Some(p.region.as_str()) {
            return Err(E::invalid(
                "peer.region",
                quoted(&p.region),
                "is this gateway's own region (peering.region); a peer is another region's gateway",
            ));
        }
        if p.delay_ms > 60_000 {
            return Err(E::invalid("peer.delay_ms", p.delay_ms, "must be at most 60000"));
        }
        let tls_files = [
            ("peer.ca_file", &p.ca_file),
            ("peer.cert_file", &p.cert_file),
            ("peer.key_file", &p.key_file),
        ];
        if p.tls().is_none()
            && let Some((field, Some(path))) = tls_files.iter().find(|(_, f)| f.is_some())
        {
            return Err(E::invalid(
                *field,
                quoted(&path.display().to_string()),
                "is for an https:// peer; this one's url is http://",
            ));
        }
        if p.cert_file.is_some() != p.key_file.is_some() {
            return Err(E::invalid(
                "peer.cert_file",
                quoted(&format!("{:?}", p.cert_file)),
                "peer.cert_file and peer.key_file go together",
            ));
        }
    }
    Ok(())
}

/// The TLS settings of an `https://` peer, as configured.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerTls {
    /// The CA its certificate must chain to (`None`: the system's roots).
    pub ca_file: Option<PathBuf>,
    /// This gateway's client certificate chain, for a peer that asks.
    pub cert_file: Option<PathBuf>,
    /// Its private key.
    pub key_file: Option<PathBuf>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(url: &str, region: &str) -> PeerConfig {
        PeerConfig {
            url: url.into(),
            region: region.into(),
            token_file: "/nonexistent".into(),
            delay_ms: 0,
            ca_file: None,
            cert_file: None,
            key_file: None,
        }
    }

    #[test]
    fn https_peers_keep_their_scheme_and_tls_files_need_it() {
        let peering = PeeringConfig {
            region: Some("a".into()),
            ..PeeringConfig::default()
        };
        let https = peer("https://gw.b.internal:8443", "b");
        assert_eq!(https.address().unwrap(), "https://gw.b.internal:8443");
        assert!(https.tls().is_some());
        assert!(validate_peering(&peering, std::slice::from_ref(&https)).is_ok());
        let plain = PeerConfig {
            ca_file: Some("/etc/ca.pem".into()),
            ..peer("http://127.0.0.1:9000", "b")
        };
        assert!(plain.tls().is_none());
        let e = validate_peering(&peering, &[plain]).unwrap_err().to_string();
        assert!(e.contains("peer.ca_file") && e.contains("https://"), "{e}");
        let half = PeerConfig {
            cert_file: Some("/etc/c.pem".into()),
            ..https
        };
        let e = validate_peering(&peering, &[half]).unwrap_err().to_string();
        assert!(e.contains("go together"), "{e}");
        assert!(peer("ftp://x:1", "b").address().is_err());
    }

    #[test]
    fn peers_need_a_region_of_our_own_and_distinct_urls() {
        let mut peering = PeeringConfig::default();
        let peers = vec![peer("http://127.0.0.1:9000", "b")];
        let e = validate_peering(&peering, &peers).unwrap_err().to_string();
        assert!(e.contains("peering.region"), "{e}");
        peering.region = Some("a".into());
        validate_peering(&peering, &peers).unwrap();
        let twice = vec![peer("http://127.0.0.1:9000", "b"), peer("http://127.0.0.1:9000/", "c")];
        let e = validate_peering(&peering, &twice).unwrap_err().to_string();
        assert!(e.contains("twice"), "{e}");
        let own = vec![peer("http://127.0.0.1:9000", "a")];
        let e = validate_peering(&peering, &own).unwrap_err().to_string();
        assert!(e.contains("own region"), "{e}");
        let bad = vec![peer("ftp://x", "b")];
        assert!(validate_peering(&peering, &bad).is_err());
        peering.max_age_ms = 100;
        let e = validate_peering(&peering, &peers).unwrap_err().to_string();
        assert!(e.contains("max_age_ms"), "{e}");
    }
}
