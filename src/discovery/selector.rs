//! Kubernetes label selectors, as `kubectl -l` writes them: parsed to
//! check a configuration, and matched against a Pod's labels (the P/D
//! role selectors, which the gateway applies itself to the Pods the main
//! selector's watch returns).
//!
//! The grammar is Kubernetes' (`k8s.io/apimachinery/pkg/labels`):
//! requirements separated by commas, each one of `key`, `!key`,
//! `key=value`, `key==value`, `key!=value`, `key in (v1,v2)`,
//! `key notin (v1,v2)`. Every requirement must hold. (`key>n` and
//! `key<n`, which only the API server's field of numeric labels uses, are
//! refused.)

use std::collections::BTreeMap;

/// One requirement of a selector.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Requirement {
    /// The label is set (`key`).
    Exists(String),
    /// The label is not set (`!key`).
    Absent(String),
    /// The label is one of the values (`=`, `==`, `in`).
    In(String, Vec<String>),
    /// The label is not set or not one of the values (`!=`, `notin`).
    NotIn(String, Vec<String>),
}

/// Why a selector does not parse: what is wrong, quoting the part.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SelectorError(String);

impl From<String> for SelectorError {
    fn from(s: String) -> Self {
        Self(s)
    }
}

impl From<&str> for SelectorError {
    fn from(s: &str) -> Self {
        Self(s.to_owned())
    }
}

/// A parsed label selector; the empty one matches everything.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Selector(Vec<Requirement>);

impl Selector {
    /// Parses `text`; the error says what is wrong.
    pub fn parse(text: &str) -> Result<Self, SelectorError> {
        let mut requirements = Vec::new();
        for part in split_requirements(text).map_err(SelectorError)? {
            let part = part.trim();
            if part.is_empty() {
                if text.trim().is_empty() {
                    continue;
                }
                return Err("an empty requirement (two commas, or a trailing one)".into());
            }
            requirements.push(requirement(part).map_err(SelectorError)?);
        }
        Ok(Self(requirements))
    }

    /// Whether `labels` satisfy every requirement.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.0.iter().all(|r| match r {
            Requirement::Exists(k) => labels.contains_key(k),
            Requirement::Absent(k) => !labels.contains_key(k),
            Requirement::In(k, values) => labels.get(k).is_some_and(|v| values.contains(v)),
            Requirement::NotIn(k, values) => labels.get(k).is_none_or(|v| !values.contains(v)),
        })
    }
}

/// Splits at the commas outside parentheses.
fn split_requirements(text: &str) -> Result<Vec<&str>, String> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0u32, 0);
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.checked_sub(1).ok_or("a ')' without its '('")?,
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("a '(' without its ')'".into());
    }
    parts.push(&text[start..]);
    Ok(parts)
}

/// One requirement (trimmed, not empty).
fn requirement(part: &str) -> Result<Requirement, String> {
    if let Some(key) = part.strip_prefix('!') {
        return Ok(Requirement::Absent(key_of(key.trim())?));
    }
    for (op, negated) in [("!=", true), ("==", false), ("=", false)] {
        if let Some((k, v)) = part.split_once(op) {
            return Ok(set(negated, key_of(k.trim())?, vec![value_of(v.trim())?]));
        }
    }
    if part.contains(['<', '>']) {
        return Err(format!("{part:?}: numeric comparisons (< and >) are not supported"));
    }
    let words: Vec<&str> = part.splitn(2, char::is_whitespace).collect();
    match words.as_slice() {
        [key] => Ok(Requirement::Exists(key_of(key)?)),
        [key, rest] => {
            let rest = rest.trim_start();
            let (negated, list) = if let Some(l) = rest.strip_prefix("notin") {
                (true, l)
            } else if let Some(l) = rest.strip_prefix("in") {
                (false, l)
            } else {
                return Err(format!("{part:?}: expected =, ==, !=, in or notin after the key"));
            };
            let list = list
                .trim()
                .strip_prefix('(')
                .and_then(|l| l.strip_suffix(')'))
                .ok_or_else(|| format!("{part:?}: the values of in and notin go in parentheses"))?;
            let values = list
                .split(',')
                .map(|v| value_of(v.trim()))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(set(negated, key_of(key)?, values))
        }
        _ => Err(format!("{part:?}: not a requirement")),
    }
}

fn set(negated: bool, key: String, values: Vec<String>) -> Requirement {
    if negated {
        Requirement::NotIn(key, values)
    } else {
        Requirement::In(key, values)
    }
}

/// A label key: an optional DNS-subdomain prefix and `/`, then a name of
/// at most 63 characters (alphanumerics, `-`, `_`, `.`, alphanumeric at
/// both ends).
fn key_of(key: &str) -> Result<String, String> {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if let Some(p) = prefix
        && (p.is_empty()
            || p.len() > 253
            || !p
                .split('.')
                .all(|l| !l.is_empty() && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')))
    {
        return Err(format!("{key:?}: the key's prefix must be a DNS subdomain"));
    }
    if name.is_empty() || !is_label_text(name) {
        return Err(format!(
            "{key:?}: a label key's name is 1 to 63 of A-Z a-z 0-9 - _ ., alphanumeric at both ends"
        ));
    }
    Ok(key.to_owned())
}

/// A label value: empty, or text as a key's name.
fn value_of(value: &str) -> Result<String, String> {
    if !value.is_empty() && !is_label_text(value) {
        return Err(format!(
            "{value:?}: a label value is at most 63 of A-Z a-z 0-9 - _ ., alphanumeric at both ends"
        ));
    }
    Ok(value.to_owned())
}

fn is_label_text(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        && b.first().is_some_and(u8::is_ascii_alphanumeric)
        && b.last().is_some_and(u8::is_ascii_alphanumeric)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn selectors_match_as_kubernetes_does() {
        let pod = labels(&[("app", "vllm"), ("llm-d.ai/role", "prefill"), ("tier", "gpu")]);
        for (selector, matches) in [
            ("", true),
            ("app=vllm", true),
            ("app==vllm", true),
            ("app!=vllm", false),
            ("app=sglang", false),
            ("app=vllm,llm-d.ai/role=prefill", true),
            ("app=vllm, llm-d.ai/role=decode", false),
            ("llm-d.ai/role in (prefill,both)", true),
            ("llm-d.ai/role notin (prefill, both)", false),
            ("tier", true),
            ("!tier", false),
            ("!zone", true),
            ("zone!=eu", true),
            ("zone notin (eu)", true),
            ("zone in (eu)", false),
            ("app in (vllm),tier notin (cpu)", true),
        ] {
            let s = Selector::parse(selector).unwrap_or_else(|e| panic!("{selector:?}: {e}"));
            assert_eq!(s.matches(&pod), matches, "{selector:?}");
        }
    }

    #[test]
    fn bad_selectors_say_what_is_wrong() {
        for (selector, says) in [
            ("app=", ""),
            ("app=vllm,", "empty requirement"),
            ("role in prefill", "parentheses"),
            ("role in (a", "without its ')'"),
            ("a)", "without its '('"),
            ("role like x", "expected"),
            ("gpu>2", "numeric"),
            ("-app=x", "label key"),
            ("app=x y", "label value"),
            ("/app=x", "prefix"),
        ] {
            match Selector::parse(selector) {
                Ok(s) if says.is_empty() => assert!(s.matches(&labels(&[("app", "")]))),
                Ok(s) => panic!("{selector:?} parsed: {s:?}"),
                Err(e) => assert!(e.to_string().contains(says), "{selector:?}: {e}"),
            }
        }
    }
}
