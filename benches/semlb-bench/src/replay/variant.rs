//! `--variant LABEL=POLICY[@FILE]`: one more row of a bench's table, a
//! policy with a gateway configuration of its own (TOML appended to the
//! run's), shared by `bench replay` and `bench llama`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use semlb::routing::PolicyKind;

/// `--variant`: a policy with a configuration of its own.
#[derive(Debug, Clone)]
pub struct Variant {
    /// The row's name.
    pub label: String,
    /// The policy it runs.
    pub policy: PolicyKind,
    /// Its configuration file, if any.
    pub config: Option<PathBuf>,
}

/// Parses `LABEL=POLICY[@FILE]`.
pub fn parse_variant(text: &str) -> Result<Variant, String> {
    let (label, rest) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?}: expected LABEL=POLICY[@FILE]"))?;
    let (policy, config) = match rest.split_once('@') {
        Some((p, f)) => (p, Some(PathBuf::from(f))),
        None => (rest, None),
    };
    if label.is_empty() {
        return Err(format!("{text:?}: the label is empty"));
    }
    Ok(Variant {
        label: label.to_owned(),
        policy: policy.parse().map_err(|e| format!("{text:?}: {e}"))?,
        config,
    })
}

impl Variant {
    /// The configuration text the row appends (empty without a file).
    pub fn config_text(&self) -> Result<String> {
        match &self.config {
            Some(path) => std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display())),
            None => Ok(String::new()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_variant_is_a_label_a_policy_and_perhaps_a_file() {
        let v = parse_variant("ca/abs1=cache_aware@/tmp/abs1.toml").unwrap();
        assert_eq!(
            (v.label.as_str(), v.policy, v.config),
            ("ca/abs1", PolicyKind::CacheAware, Some(PathBuf::from("/tmp/abs1.toml")))
        );
        let v = parse_variant("plain=least_load").unwrap();
        assert_eq!((v.policy, v.config), (PolicyKind::LeastLoad, None));
        for bad in ["cache_aware", "=cache_aware", "x=no_such_policy"] {
            assert!(parse_variant(bad).is_err(), "{bad}");
        }
    }
}
