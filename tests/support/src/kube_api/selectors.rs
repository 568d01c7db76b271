//! What a list or watch selects: label and field selectors, parsed as apimachinery parses them.

use std::collections::BTreeMap;

use bytes::Bytes;
use hyper::Response;
use serde_json::{Map, Value};

use super::*;

/// What a list or watch selects.
pub(super) struct Filter {
    pub(super) resource: Resource,
    pub(super) namespace: Option<String>,
    pub(super) labels: Vec<Requirement>,
    pub(super) fields: Vec<(String, bool, String)>,
}

impl Filter {
    #[allow(clippy::result_large_err)]
    pub(super) fn new(
        resource: Resource,
        namespace: Option<String>,
        query: &BTreeMap<String, String>,
    ) -> Result<Filter, Response<Body>> {
        let labels = parse_label_selector(query.get("labelSelector").map(String::as_str).unwrap_or(""))
            .map_err(|e| error(400, "BadRequest", &format!("unable to parse requirement: {e}")))?;
        let fields = parse_field_selector(query.get("fieldSelector").map(String::as_str).unwrap_or(""))
            .map_err(|e| error(400, "BadRequest", &e))?;
        Ok(Filter {
            resource,
            namespace,
            labels,
            fields,
        })
    }

    pub(super) fn unselective(&self) -> bool {
        self.labels.is_empty() && self.fields.is_empty()
    }

    pub(super) fn matches(&self, obj: &Value) -> bool {
        let meta = &obj["metadata"];
        let ns = meta["namespace"].as_str().unwrap_or("");
        if self.namespace.as_deref().is_some_and(|n| n != ns) {
            return false;
        }
        let fields_ok = self.fields.iter().all(|(field, eq, value)| {
            let actual = match field.as_str() {
                "metadata.name" => meta["name"].as_str().unwrap_or(""),
                _ => ns,
            };
            (actual == value) == *eq
        });
        let labels = meta["labels"].as_object();
        fields_ok && self.labels.iter().all(|r| r.matches(labels))
    }

    /// The events `change` makes on a watch with this filter (none, or one).
    pub(super) fn event(&self, change: &Change) -> Option<Bytes> {
        if change.resource != self.resource {
            return None;
        }
        let was = change.old.as_ref().is_some_and(|o| self.matches(o));
        let is = change.new.as_ref().is_some_and(|n| self.matches(n));
        match (was, is) {
            (true, true) => Some(event_line("MODIFIED", change.new.as_ref().unwrap())),
            (false, true) => Some(event_line("ADDED", change.new.as_ref().unwrap())),
            (true, false) => {
                // The previous content at the change's version (a deletion,
                // or an object that left the selection).
                let mut old = change.old.clone().unwrap();
                old["metadata"]["resourceVersion"] = change.rv.to_string().into();
                Some(event_line("DELETED", &old))
            }
            (false, false) => None,
        }
    }
}

/// One requirement of a label selector.
#[derive(Debug, PartialEq)]
pub(super) enum Requirement {
    Eq(String, String),
    NotEq(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
    Gt(String, i64),
    Lt(String, i64),
}

impl Requirement {
    pub(super) fn matches(&self, labels: Option<&Map<String, Value>>) -> bool {
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        match self {
            Requirement::Eq(k, v) => get(k) == Some(v.as_str()),
            Requirement::NotEq(k, v) => get(k) != Some(v.as_str()),
            Requirement::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            Requirement::NotIn(k, vs) => !get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            Requirement::Exists(k) => get(k).is_some(),
            Requirement::NotExists(k) => get(k).is_none(),
            Requirement::Gt(k, n) => get(k).and_then(|x| x.parse::<i64>().ok()).is_some_and(|x| x > *n),
            Requirement::Lt(k, n) => get(k).and_then(|x| x.parse::<i64>().ok()).is_some_and(|x| x < *n),
        }
    }
}

#[derive(Debug, PartialEq)]
pub(super) enum Token {
    Ident(String),
    In,
    NotIn,
    Not,
    NotEq,
    Eq,
    DoubleEq,
    Gt,
    Lt,
    Open,
    Close,
    Comma,
}

pub(super) fn lex(s: &str) -> Vec<Token> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    while let Some(&c) = chars.peek() {
        match c {
            c if c.is_whitespace() => {
                chars.next();
            }
            '!' | '=' => {
                chars.next();
                let double = chars.peek() == Some(&'=');
                if double {
                    chars.next();
                }
                out.push(match (c, double) {
                    ('!', true) => Token::NotEq,
                    ('!', false) => Token::Not,
                    (_, true) => Token::DoubleEq,
                    _ => Token::Eq,
                });
            }
            '>' | '<' | '(' | ')' | ',' => {
                chars.next();
                out.push(match c {
                    '>' => Token::Gt,
                    '<' => Token::Lt,
                    '(' => Token::Open,
                    ')' => Token::Close,
                    _ => Token::Comma,
                });
            }
            _ => {
                let mut ident = String::new();
                while let Some(&c) = chars.peek() {
                    if c.is_whitespace() || "!=><(),".contains(c) {
                        break;
                    }
                    ident.push(c);
                    chars.next();
                }
                out.push(match ident.as_str() {
                    "in" => Token::In,
                    "notin" => Token::NotIn,
                    _ => Token::Ident(ident),
                });
            }
        }
    }
    out
}

/// A label selector's requirements (the syntax of apimachinery's
/// `labels.Parse`); the error says what is wrong.
pub(super) fn parse_label_selector(s: &str) -> Result<Vec<Requirement>, String> {
    let tokens = lex(s);
    let mut reqs = Vec::new();
    if tokens.is_empty() {
        return Ok(reqs);
    }
    let mut i = 0;
    loop {
        let (req, next) = parse_requirement(&tokens, i)?;
        reqs.push(req);
        match tokens.get(next) {
            None => return Ok(reqs),
            Some(Token::Comma) if next + 1 < tokens.len() => i = next + 1,
            Some(t) => return Err(format!("found '{t:?}', expected: ',' or end of string")),
        }
    }
}

pub(super) fn parse_requirement(t: &[Token], i: usize) -> Result<(Requirement, usize), String> {
    let key = |j: usize| match t.get(j) {
        Some(Token::Ident(k)) => valid_key(k).map(|()| k.clone()),
        other => Err(format!("found '{other:?}', expected: identifier")),
    };
    if t.get(i) == Some(&Token::Not) {
        return Ok((Requirement::NotExists(key(i + 1)?), i + 2));
    }
    let k = key(i)?;
    // A single value: an identifier, or empty before ',' or the end.
    let value = |j: usize| match t.get(j) {
        Some(Token::Ident(v)) => valid_value(v).map(|()| (v.clone(), j + 1)),
        None | Some(Token::Comma) => Ok((String::new(), j)),
        Some(other) => Err(format!("found '{other:?}', expected: identifier")),
    };
    match t.get(i + 1) {
        None | Some(Token::Comma) => Ok((Requirement::Exists(k), i + 1)),
        Some(Token::Eq | Token::DoubleEq) => value(i + 2).map(|(v, n)| (Requirement::Eq(k, v), n)),
        Some(Token::NotEq) => value(i + 2).map(|(v, n)| (Requirement::NotEq(k, v), n)),
        Some(op @ (Token::Gt | Token::Lt)) => match t.get(i + 2) {
            Some(Token::Ident(v)) => {
                let n: i64 = v
                    .parse()
                    .map_err(|_| format!("for 'Gt', 'Lt' operators, the value must be an integer: {v}"))?;
                let r = if *op == Token::Gt {
                    Requirement::Gt(k, n)
                } else {
                    Requirement::Lt(k, n)
                };
                Ok((r, i + 3))
            }
            other => Err(format!("found '{other:?}', expected: identifier")),
        },
        Some(op @ (Token::In | Token::NotIn)) => {
            if t.get(i + 2) != Some(&Token::Open) {
                return Err("found no '(', expected: '(' after 'in' or 'notin'".into());
            }
            let mut values = Vec::new();
            let mut j = i + 3;
            loop {
                match t.get(j) {
                    Some(Token::Ident(v)) => {
                        valid_value(v)?;
                        values.push(v.clone());
                        j += 1;
                    }
                    Some(Token::Comma | Token::Close) => values.push(String::new()),
                    other => return Err(format!("found '{other:?}', expected: ',', ')' or identifier")),
                }
                match t.get(j) {
                    Some(Token::Comma) => j += 1,
                    Some(Token::Close) => break,
                    other => return Err(format!("found '{other:?}', expected: ',' or ')'")),
                }
            }
            if values == [String::new()] && t.get(i + 3) == Some(&Token::Close) {
                return Err("for 'in', 'notin' operators, values set can't be empty".into());
            }
            let r = if *op == Token::In {
                Requirement::In(k, values)
            } else {
                Requirement::NotIn(k, values)
            };
            Ok((r, j + 1))
        }
        Some(other) => Err(format!("found '{other:?}', expected: in, notin, =, ==, !=, gt, lt")),
    }
}

pub(super) fn name_part_ok(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(c))
}

pub(super) fn valid_key(k: &str) -> Result<(), String> {
    let (prefix, name) = match k.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, k),
    };
    let prefix_ok = prefix.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 253
            && p.split('.').all(|l| {
                !l.is_empty()
                    && l.len() <= 63
                    && l.bytes()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
                    && !l.starts_with('-')
                    && !l.ends_with('-')
            })
    });
    if prefix_ok && name_part_ok(name) {
        Ok(())
    } else {
        Err(format!("invalid label key \"{k}\""))
    }
}

pub(super) fn valid_value(v: &str) -> Result<(), String> {
    if v.is_empty() || name_part_ok(v) {
        Ok(())
    } else {
        Err(format!("invalid label value: \"{v}\""))
    }
}

/// `metadata.name` / `metadata.namespace` with `=`, `==` or `!=`.
pub(super) fn parse_field_selector(s: &str) -> Result<Vec<(String, bool, String)>, String> {
    let mut out = Vec::new();
    for term in s.split(',').filter(|t| !t.trim().is_empty()) {
        let (field, eq, value) = if let Some((f, v)) = term.split_once("!=") {
            (f, false, v)
        } else if let Some((f, v)) = term.split_once("==") {
            (f, true, v)
        } else if let Some((f, v)) = term.split_once('=') {
            (f, true, v)
        } else {
            return Err(format!("invalid selector: '{s}'; can't understand '{term}'"));
        };
        let field = field.trim();
        if field != "metadata.name" && field != "metadata.namespace" {
            return Err(format!("field label not supported: {field}"));
        }
        out.push((field.to_owned(), eq, value.trim().to_owned()));
    }
    Ok(out)
}
