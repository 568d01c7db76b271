//! The request body, parsed once: a JSON tree that borrows its strings from
//! the body's bytes.
//!
//! A dispatcher needs a request's JSON for several things: the routing
//! text ([`crate::openai::prompt`]), the response-cache key and cacheability
//! ([`crate::response_cache`]), the session key, the stream options. It
//! parses the body into a [`Json`] once and every consumer reads that
//! tree. Strings without escapes are slices of the body (no copy); only
//! strings with escapes are unescaped into owned copies. Objects keep their
//! entries in document order in a vector (request objects are small, so a
//! linear search beats a map); a key given twice resolves to its last
//! value, as `serde_json::Value` resolves it. Nesting is limited by
//! serde_json's recursion limit (128), so a hostile body cannot overflow the
//! stack.
//!
//! The body itself is forwarded upstream as the client sent it: the tree is
//! only read.

use std::borrow::Cow;
use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Number;

/// A JSON value borrowing from the text it was parsed from.
#[derive(Debug, Clone, PartialEq)]
pub enum Json<'a> {
    /// `null`.
    Null,
    /// `true` or `false`.
    Bool(bool),
    /// A number.
    Number(Number),
    /// A string (borrowed unless it had escapes).
    String(Cow<'a, str>),
    /// An array.
    Array(Vec<Json<'a>>),
    /// An object.
    Object(Object<'a>),
}

/// A JSON object: its entries in document order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Object<'a> {
    entries: Vec<(Cow<'a, str>, Json<'a>)>,
}

impl<'a> Object<'a> {
    /// The value of `key` (its last one, if it is given twice).
    pub fn get(&self, key: &str) -> Option<&Json<'a>> {
        self.entries.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// The entries in document order (a repeated key appears each time).
    pub fn entries(&self) -> impl Iterator<Item = (&str, &Json<'a>)> {
        self.entries.iter().map(|(k, v)| (k.as_ref(), v))
    }

    /// The entries sorted by key, each key once (with its last value): the
    /// object as `serde_json::Map` holds it.
    pub fn canonical(&self) -> Vec<(&str, &Json<'a>)> {
        let mut sorted: Vec<(&str, &Json<'a>)> = self.entries().collect();
        // Stable: of equal keys, the last in document order stays last.
        sorted.sort_by(|a, b| a.0.cmp(b.0));
        let mut out: Vec<(&str, &Json<'a>)> = Vec::with_capacity(sorted.len());
        for entry in sorted {
            match out.last_mut() {
                Some(last) if last.0 == entry.0 => *last = entry,
                _ => out.push(entry),
            }
        }
        out
    }

    /// Whether it has no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Appends it as compact JSON ([`Json::write_compact`]).
    pub fn write_compact(&self, out: &mut String) {
        out.push('{');
        for (i, (k, v)) in self.entries.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(&serde_json::to_string(&**k).expect("a string serializes"));
            out.push(':');
            v.write_compact(out);
        }
        out.push('}');
    }

    /// Removes every member named `key`.
    pub fn remove(&mut self, key: &str) {
        self.entries.retain(|(k, _)| k != key);
    }

    /// The object with every string copied out of the body it borrows.
    pub fn into_owned(self) -> Object<'static> {
        Object {
            entries: self
                .entries
                .into_iter()
                .map(|(k, v)| (Cow::Owned(k.into_owned()), v.into_owned()))
                .collect(),
        }
    }
}

impl<'a> Json<'a> {
    /// Parses `text` (JSON), borrowing its unescaped strings.
    pub fn parse(text: &'a [u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(text)
    }

    /// The string, if it is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Json::String(s) => Some(s),
            _ => None,
        }
    }

    /// The boolean, if it is one.
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Json::Bool(b) => Some(*b),
            _ => None,
        }
    }

    /// The number, if it is one.
    pub fn as_number(&self) -> Option<&Number> {
        match self {
            Json::Number(n) => Some(n),
            _ => None,
        }
    }

    /// The number as an `f64`, if it is one.
    pub fn as_f64(&self) -> Option<f64> {
        self.as_number().and_then(Number::as_f64)
    }

    /// The number as a `u64`, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_number().and_then(Number::as_u64)
    }

    /// Whether it is an integer (of either sign).
    pub fn is_integer(&self) -> bool {
        self.as_number().is_some_and(|n| n.is_i64() || n.is_u64())
    }

    /// The array, if it is one.
    pub fn as_array(&self) -> Option<&[Json<'a>]> {
        match self {
            Json::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The object, if it is one.
    pub fn as_object(&self) -> Option<&Object<'a>> {
        match self {
            Json::Object(o) => Some(o),
            _ => None,
        }
    }

    /// Whether it is `null`.
    pub fn is_null(&self) -> bool {
        matches!(self, Json::Null)
    }

    /// The value with every string copied out of the body it borrows (to
    /// keep a request parsed on another thread).
    pub fn into_owned(self) -> Json<'static> {
        match self {
            Json::Null => Json::Null,
            Json::Bool(b) => Json::Bool(b),
            Json::Number(n) => Json::Number(n),
            Json::String(s) => Json::String(Cow::Owned(s.into_owned())),
            Json::Array(a) => Json::Array(a.into_iter().map(Json::into_owned).collect()),
            Json::Object(o) => Json::Object(o.into_owned()),
        }
    }

    /// About how many bytes it takes written as compact JSON (its strings
    /// unescaped, numbers as 4): what a prompt part the gateway does not
    /// tokenize (tools, a response format) is estimated from.
    pub fn text_bytes(&self) -> usize {
        match self {
            Json::Null | Json::Bool(_) | Json::Number(_) => 4,
            Json::String(s) => s.len() + 2,
            Json::Array(items) => 2 + items.iter().map(|v| v.text_bytes() + 1).sum::<usize>(),
            Json::Object(o) => 2 + o.entries().map(|(k, v)| k.len() + 4 + v.text_bytes()).sum::<usize>(),
        }
    }

    /// Appends it as compact JSON: objects in document order (a repeated
    /// key each time), numbers as serde_json writes them (the same value).
    pub fn write_compact(&self, out: &mut String) {
        use std::fmt::Write as _;
        match self {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Number(n) => write!(out, "{n}").expect("a String takes writes"),
            Json::String(s) => out.push_str(&serde_json::to_string(&**s).expect("a string serializes")),
            Json::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    item.write_compact(out);
                }
                out.push(']');
            }
            Json::Object(o) => o.write_compact(out),
        }
    }

    /// What it is, for error messages ("a string", "an array", ...).
    pub fn kind(&self) -> &'static str {
        match self {
            Json::Null => "null",
            Json::Bool(_) => "a boolean",
            Json::Number(_) => "a number",
            Json::String(_) => "a string",
            Json::Array(_) => "an array",
            Json::Object(_) => "an object",
        }
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Json<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(JsonVisitor)
    }
}

/// An object key, borrowed when it has no escapes.
struct Key<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Key<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object key")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Key(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Key(Cow::Owned(v)))
            }
        }
        deserializer.deserialize_str(KeyVisitor)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Json::Null)
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
        Ok(Json::Bool(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Ok(Json::Number(v.into()))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        Ok(Json::Number(v.into()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        // JSON text has no NaN or infinity, so this always holds a value.
        Ok(Number::from_f64(v).map_or(Json::Null, Json::Number))
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Json::String(Cow::Borrowed(v)))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Json::String(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(Json::String(Cow::Owned(v)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Json::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut entries = Vec::with_capacity(map.size_hint().unwrap_or(0).min(16));
        while let Some(Key(key)) = map.next_key()? {
            entries.push((key, map.next_value()?));
        }
        Ok(Json::Object(Object { entries }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn borrows_plain_strings_and_unescapes_the_others() {
        let text =
            br#"{"model":"m","messages":[{"role":"user","content":"a\nb \u00e9"}],"n":-2,"t":0.5,"ok":true,"x":null}"#;
        let json = Json::parse(text).unwrap();
        let body = json.as_object().unwrap();
        assert!(matches!(body.get("model"), Some(Json::String(Cow::Borrowed("m")))));
        let content = &body.get("messages").unwrap().as_array().unwrap()[0]
            .as_object()
            .unwrap()
            .get("content")
            .unwrap();
        assert!(matches!(content, Json::String(Cow::Owned(s)) if s == "a\nb é"));
        assert_eq!(body.get("n").unwrap().as_number().unwrap().as_i64(), Some(-2));
        assert_eq!(body.get("t").unwrap().as_f64(), Some(0.5));
        assert_eq!(body.get("ok").unwrap().as_bool(), Some(true));
        assert!(body.get("x").unwrap().is_null());
        assert!(body.get("absent").is_none());
    }

    #[test]
    fn a_repeated_key_resolves_to_its_last_value_like_serde_json() {
        let text = br#"{"b":1,"a":2,"b":3}"#;
        let json = Json::parse(text).unwrap();
        let body = json.as_object().unwrap();
        let value: serde_json::Value = serde_json::from_slice(text).unwrap();
        assert_eq!(body.get("b").unwrap().as_u64(), value["b"].as_u64());
        let canonical: Vec<_> = body.canonical().into_iter().map(|(k, v)| (k, v.as_u64())).collect();
        assert_eq!(canonical, [("a", Some(2)), ("b", Some(3))]);
    }

    #[test]
    fn refuses_what_serde_json_refuses() {
        for bad in [&b""[..], b"{", b"[1,]", b"{\"a\" 1}", b"nul", b"\"\\ud800\""] {
            assert!(Json::parse(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        let deep = "[".repeat(10_000);
        assert!(Json::parse(deep.as_bytes()).is_err(), "recursion is limited");
    }
}
