//! A fleet: fresh simulated engines in the roles of a [`Topology`] and
//! one `semlb serve` in front of them ([`Fleet::start`]), stopped when
//! dropped; and what its gateway counted of P/D paths
//! ([`Fleet::pd_paths`]).
//!
//! Every engine has the same parameters (the simulator's defaults, plus
//! `--sim-args`); only `--role` differs. The gateway runs the pool's
//! policy `cache_aware` and `pd.decode_by = "load"` (the defaults), or,
//! for random pairing, `--policy random` with `pd.decode_by = "policy"`:
//! both engines of a pair drawn at random.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use anyhow::{Context, Result};
use semlb::config::PdProtocol;
use semlb_test_support::gateway::{Gateway, samples};
use semlb_test_support::process::{Proc, Stderr};

use super::args::{PdArgs, Topology};

/// How a P/D gateway chooses the two engines of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pairing {
    /// Prefill by `cache_aware`, decode by load with the prompt it holds
    /// as the tie-breaker (semlb's defaults).
    CacheAware,
    /// Both at random (`--policy random`, `pd.decode_by = "policy"`).
    Random,
}

/// Engines and their gateway.
pub(super) struct Fleet {
    /// Declared first: stopped before the engines.
    gateway: Gateway,
    _engines: Vec<Proc>,
}

impl Fleet {
    /// Starts `topology`'s engines at `time_scale` and a gateway pairing
    /// by `pairing`.
    pub(super) fn start(args: &PdArgs, topology: Topology, pairing: Pairing, time_scale: f64) -> Result<Fleet> {
        let scale = time_scale.to_string();
        let protocol = args.pd_protocol.name();
        let engines = |n: usize, role: &str| -> Result<Vec<Proc>> {
            let mut extra = vec!["--role", role, "--pd-protocol", protocol];
            if role == "prefill" && args.pd_protocol == PdProtocol::Sglang {
                extra.extend(["--bootstrap-port", "0"]);
            }
            extra.extend(args.sim_args.split_whitespace());
            crate::state::start_sims(n, &scale, &extra).context("starting the simulated engines")
        };
        let url = |p: &Proc| format!("http://{}", p.addr);
        let mut flags: Vec<String> = Vec::new();
        let all = match topology {
            Topology::Aggregated => {
                let all = engines(args.engines, "both")?;
                for e in &all {
                    flags.extend(["--backend".into(), url(e)]);
                }
                all
            }
            Topology::Split { prefill, decode } => {
                let (p, d) = (engines(prefill, "prefill")?, engines(decode, "decode")?);
                for e in &p {
                    flags.extend(["--prefill".into(), url(e)]);
                }
                for e in &d {
                    flags.extend(["--decode".into(), url(e)]);
                }
                flags.extend(["--pd-protocol".into(), protocol.into()]);
                p.into_iter().chain(d).collect()
            }
        };
        let mut builder = Gateway::builder()
            .tag("bench-pd")
            .shm_size("64MiB")
            .dispatchers(args.dispatchers)
            .stderr(Stderr::Tail(40))
            .args(&flags);
        builder = match pairing {
            Pairing::CacheAware => builder.policy("cache_aware"),
            Pairing::Random => builder.policy("random").config("[pd]\ndecode_by = \"policy\"\n"),
        };
        let gateway = builder.try_start().context("starting the gateway")?;
        Ok(Fleet { gateway, _engines: all })
    }

    /// The gateway's address.
    pub(super) fn addr(&self) -> Result<SocketAddr> {
        Ok(self.gateway.addr().parse()?)
    }

    /// `semlb_pd_requests_total` by `path` (`split`, `bypass`,
    /// `decode_only`); empty if `/metrics` did not answer.
    pub(super) fn pd_paths(&self) -> BTreeMap<String, f64> {
        let Ok(r) = self.gateway.request("GET", "/metrics", None, &[]) else {
            return BTreeMap::new();
        };
        samples(&String::from_utf8_lossy(&r.body), "semlb_pd_requests_total")
            .into_iter()
            .map(|(labels, v)| {
                let path = labels.trim_start_matches("path=\"").trim_end_matches('"').to_owned();
                (path, v)
            })
            .collect()
    }
}
