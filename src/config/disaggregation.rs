//! Disaggregated prefill and decode: a backend's role (`[[backend]]
//! role`, `bootstrap_port`) and how a split request's legs are driven
//! (`[pd]`).

use std::fmt;
use std::str::FromStr;

use serde::Deserialize;
use shm_layout::{Disaggregation, ServerRole};

/// A backend's part in disaggregated serving (`[[backend]] role`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendRole {
    /// Prefill and decode: an ordinary engine.
    #[default]
    Both,
    /// Prefill only (vLLM's `kv_producer`, SGLang's `--disaggregation-mode prefill`).
    Prefill,
    /// Decode only (vLLM's `kv_consumer`, SGLang's `--disaggregation-mode decode`).
    Decode,
}

impl BackendRole {
    /// The role as the server table keeps it.
    pub const fn server_role(self) -> ServerRole {
        match self {
            Self::Both => ServerRole::Both,
            Self::Prefill => ServerRole::Prefill,
            Self::Decode => ServerRole::Decode,
        }
    }

    /// With the engine's bootstrap port, what the server table keeps.
    pub const fn with_port(self, bootstrap_port: Option<u16>) -> Disaggregation {
        Disaggregation {
            role: self.server_role(),
            bootstrap_port,
        }
    }
}

/// How a split request's two legs are driven (`pd.protocol`,
/// `--pd-protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize)]
pub enum PdProtocol {
    /// vLLM with its NixlConnector: the prefill leg first (one output
    /// token, `kv_transfer_params` asking for a remote decode), then the
    /// decode leg with the parameters the prefill answered.
    #[default]
    #[serde(rename = "vllm-nixl")]
    VllmNixl,
    /// SGLang: both legs at once, meeting at the prefill engine's
    /// bootstrap server (`bootstrap_host`, `bootstrap_port`, `bootstrap_room`).
    #[serde(rename = "sglang")]
    Sglang,
}

impl PdProtocol {
    /// The name in configuration and on the command line.
    pub const fn name(self) -> &'static str {
        match self {
            Self::VllmNixl => "vllm-nixl",
            Self::Sglang => "sglang",
        }
    }
}

impl fmt::Display for PdProtocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A protocol name (`--pd-protocol`) that names no [`PdProtocol`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown P/D protocol {0:?}: expected vllm-nixl or sglang")]
pub struct UnknownPdProtocol(pub String);

impl FromStr for PdProtocol {
    type Err = UnknownPdProtocol;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "vllm-nixl" => Ok(Self::VllmNixl),
            "sglang" => Ok(Self::Sglang),
            _ => Err(UnknownPdProtocol(s.to_owned())),
        }
    }
}

/// How the decode engine of a request in a pool with prefill engines is
/// chosen (`pd.decode_by`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DecodeBy {
    /// By load, the prompt it holds breaking ties
    /// ([`crate::routing::decode_leg`]).
    #[default]
    Load,
    /// By the pool's policy, as the prefill engine is (a `random` policy
    /// then pairs at random: the baseline of `semlb bench pd`).
    Policy,
}

/// SGLang's default `--disaggregation-bootstrap-port`.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// Most `pd.prefill_timeout_secs`: an hour.
pub const MAX_PREFILL_TIMEOUT_SECS: u64 = 3600;

/// Disaggregated serving (`[pd]`): it applies to the pools that have
/// backends of role `prefill` and of a role that decodes.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PdConfig {
    /// How the legs are driven. Default `vllm-nixl`.
    pub protocol: PdProtocol,
    /// A request whose chosen decode engine already holds all but at most
    /// this many of its prompt tokens skips prefill: it goes to the decode
    /// engine alone (a conversation's later turn). Default 256.
    pub bypass_uncached_tokens: u32,
    /// How long a prefill leg may take before the request is served by
    /// its decode engine alone (vLLM), or its decode leg is ended and the
    /// request split again on another prefill engine (SGLang). Default 60.
    pub prefill_timeout_secs: u64,
    /// How the decode engine is chosen. Default `load`.
    pub decode_by: DecodeBy,
}

impl Default for PdConfig {
    fn default() -> Self {
        Self {
            protocol: PdProtocol::VllmNixl,
            bypass_uncached_tokens: 256,
            prefill_timeout_secs: 60,
            decode_by: DecodeBy::Load,
        }
    }
}

impl PdConfig {
    /// [`prefill_timeout_secs`](Self::prefill_timeout_secs) as a duration.
    pub fn prefill_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.prefill_timeout_secs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_and_protocols_read_as_written() {
        #[derive(Deserialize)]
        struct T {
            role: BackendRole,
            pd: PdConfig,
        }
        let t: T = toml::from_str("role = \"prefill\"\n[pd]\nprotocol = \"sglang\"\n").unwrap();
        assert_eq!(t.role, BackendRole::Prefill);
        assert_eq!(t.pd.protocol, PdProtocol::Sglang);
        assert_eq!(t.pd.bypass_uncached_tokens, 256);
        assert!(toml::from_str::<T>("role = \"producer\"\n[pd]\n").is_err());
        assert_eq!("vllm-nixl".parse::<PdProtocol>(), Ok(PdProtocol::VllmNixl));
        assert!("nixl".parse::<PdProtocol>().is_err());
        assert_eq!(
            BackendRole::Decode.with_port(Some(9)),
            Disaggregation {
                role: ServerRole::Decode,
                bootstrap_port: Some(9)
            }
        );
    }
}
