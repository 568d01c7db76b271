//! JSON values as a chat template sees them, and Python's `json.dumps`.
//!
//! An engine hands its chat template Python objects: `tools` as dicts, a
//! tool call's `arguments` parsed with `json.loads` (vLLM and SGLang do),
//! and templates print them with `tojson`, which `transformers` defines as
//! `json.dumps(x, ensure_ascii=False, indent=indent,
//! separators=separators, sort_keys=sort_keys)`. Byte for byte, that
//! means: keys in the order they came, `", "` and `": "` between items
//! (`","` with an indent), non-ASCII text written as it is, floats as
//! Python's `repr` writes them (`1.0`, `1e-05`, `1e+16`), no HTML escapes.
//! minijinja's own `tojson` does none of this, so the environment gets
//! [`python_tojson`] instead, and [`TemplateValue`] keeps what `json.loads`
//! keeps (key order, integers apart from floats).

use std::borrow::Cow;
use std::fmt::Write as _;

use minijinja::value::{Kwargs, Value, ValueKind};

/// A JSON value as `json.loads` gives it to a template: objects keep their
/// keys' order, integers stay integers.
#[derive(Debug, Clone, PartialEq)]
pub enum TemplateValue<'a> {
    /// `null` (`None`).
    Null,
    /// `true` / `false`.
    Bool(bool),
    /// A number without fraction or exponent (Python `int`; one beyond
    /// 64 bits is read as a float, where Python keeps it exact).
    Int(i128),
    /// Any other number (Python `float`).
    Float(f64),
    /// A string.
    String(Cow<'a, str>),
    /// A list.
    Array(Vec<TemplateValue<'a>>),
    /// An object, its keys in order.
    Object(Vec<(Cow<'a, str>, TemplateValue<'a>)>),
}

impl<'a> TemplateValue<'a> {
    /// `text` parsed as JSON, the way `json.loads` parses it (key order
    /// kept; a later duplicate key replaces the earlier one's value).
    pub fn parse(text: &str) -> Result<TemplateValue<'static>, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// The value with strings of its own.
    pub fn into_owned(self) -> TemplateValue<'static> {
        match self {
            TemplateValue::Null => TemplateValue::Null,
            TemplateValue::Bool(b) => TemplateValue::Bool(b),
            TemplateValue::Int(i) => TemplateValue::Int(i),
            TemplateValue::Float(f) => TemplateValue::Float(f),
            TemplateValue::String(s) => TemplateValue::String(Cow::Owned(s.into_owned())),
            TemplateValue::Array(items) => TemplateValue::Array(items.into_iter().map(Self::into_owned).collect()),
            TemplateValue::Object(pairs) => TemplateValue::Object(
                pairs
                    .into_iter()
                    .map(|(k, v)| (Cow::Owned(k.into_owned()), v.into_owned()))
                    .collect(),
            ),
        }
    }

    /// The value's field `key`, if it is an object that has one.
    pub fn get(&self, key: &str) -> Option<&TemplateValue<'a>> {
        match self {
            TemplateValue::Object(pairs) => pairs.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// The string, if it is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            TemplateValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// `json.dumps(self)` (compact separators only with `compact`).
    pub fn to_json(&self) -> String {
        let mut out = String::new();
        dumps(&self.to_template(), &Dumps::default(), 0, &mut out).expect("plain data always serialises");
        out
    }

    /// The value as minijinja holds it (maps keep their order: the crate
    /// is built with minijinja's `preserve_order`).
    pub fn to_template(&self) -> Value {
        match self {
            TemplateValue::Null => Value::from(()),
            TemplateValue::Bool(b) => Value::from(*b),
            TemplateValue::Int(i) => match i64::try_from(*i) {
                Ok(small) => Value::from(small),
                Err(_) => Value::from(*i),
            },
            TemplateValue::Float(f) => Value::from(*f),
            TemplateValue::String(s) => Value::from(&**s),
            TemplateValue::Array(items) => items.iter().map(Self::to_template).collect(),
            TemplateValue::Object(pairs) => pairs.iter().map(|(k, v)| (&**k, v.to_template())).collect(),
        }
    }
}

impl<'de> serde::Deserialize<'de> for TemplateValue<'static> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(Visitor)
    }
}

/// Builds a [`TemplateValue`] as serde_json reads, keeping key order.
struct Visitor;

impl<'de> serde::de::Visitor<'de> for Visitor {
    type Value = TemplateValue<'static>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(TemplateValue::Null)
    }
    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(TemplateValue::Null)
    }
    fn visit_bool<E>(self, b: bool) -> Result<Self::Value, E> {
        Ok(TemplateValue::Bool(b))
    }
    fn visit_i64<E>(self, i: i64) -> Result<Self::Value, E> {
        Ok(TemplateValue::Int(i.into()))
    }
    fn visit_u64<E>(self, u: u64) -> Result<Self::Value, E> {
        Ok(TemplateValue::Int(u.into()))
    }
    fn visit_f64<E>(self, f: f64) -> Result<Self::Value, E> {
        Ok(TemplateValue::Float(f))
    }
    fn visit_str<E>(self, s: &str) -> Result<Self::Value, E> {
        Ok(TemplateValue::String(Cow::Owned(s.to_owned())))
    }
    fn visit_string<E>(self, s: String) -> Result<Self::Value, E> {
        Ok(TemplateValue::String(Cow::Owned(s)))
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(TemplateValue::Array(items))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut pairs: Vec<(Cow<'static, str>, TemplateValue<'static>)> = Vec::new();
        while let Some((key, value)) = map.next_entry::<String, TemplateValue<'static>>()? {
            // Python's dict: a repeated key keeps its first place, the last value.
            match pairs.iter_mut().find(|(k, _)| *k == key) {
                Some(pair) => pair.1 = value,
                None => pairs.push((Cow::Owned(key), value)),
            }
        }
        Ok(TemplateValue::Object(pairs))
    }
}

/// How [`python_tojson`] writes: `json.dumps`'s arguments.
#[derive(Debug, Clone)]
struct Dumps {
    /// `indent`: `None` for one line.
    indent: Option<String>,
    /// Between items.
    item_separator: String,
    /// Between a key and its value.
    key_separator: String,
    /// `sort_keys`.
    sort_keys: bool,
    /// `ensure_ascii`.
    ensure_ascii: bool,
}

impl Default for Dumps {
    /// `transformers`' `tojson` with no arguments.
    fn default() -> Self {
        Self {
            indent: None,
            item_separator: ", ".into(),
            key_separator: ": ".into(),
            sort_keys: false,
            ensure_ascii: false,
        }
    }
}

/// The `tojson` filter of `transformers`' template environment:
/// `json.dumps(value, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, each argument taken by keyword (or `indent` as the
/// first positional one).
pub(super) fn python_tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let invalid = |what: String| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, what);
    let mut options = Dumps::default();
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        Some(v) => Some(v),
        None => indent,
    };
    match indent {
        None => {}
        Some(v) if v.is_none() || v.is_undefined() => {}
        Some(v) if v.is_integer() => {
            let n = i64::try_from(v).map_err(|e| invalid(e.to_string()))?;
            options.indent = Some(" ".repeat(usize::try_from(n).unwrap_or(0)));
        }
        Some(v) => match v.as_str() {
            Some(s) => options.indent = Some(s.to_owned()),
            None => {
                return Err(invalid(format!(
                    "tojson: indent must be an integer or a string, not {v}"
                )));
            }
        },
    }
    if options.indent.is_some() {
        options.item_separator = ",".into();
    }
    if let Some(separators) = kwargs.get::<Option<Value>>("separators")?
        && !separators.is_none()
    {
        let pair: Vec<String> = separators
            .try_iter()?
            .map(|s| s.as_str().map(str::to_owned))
            .collect::<Option<_>>()
            .ok_or_else(|| invalid("tojson: separators must be two strings".into()))?;
        let [item, key] =
            <[String; 2]>::try_from(pair).map_err(|_| invalid("tojson: separators must be two strings".into()))?;
        (options.item_separator, options.key_separator) = (item, key);
    }
    options.sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    options.ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    let mut out = String::new();
    dumps(value, &options, 0, &mut out)?;
    Ok(Value::from(out))
}

/// Writes `value` as `json.dumps` with `options` would, at nesting `depth`.
fn dumps(value: &Value, options: &Dumps, depth: usize, out: &mut String) -> Result<(), minijinja::Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number if value.is_integer() => write!(out, "{value}").expect("a String takes writes"),
        ValueKind::Number => {
            let f = f64::try_from(value.clone())?;
            out.push_str(&python_float_repr(f));
        }
        ValueKind::String => write_string(value.as_str().unwrap_or_default(), options.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            container(out, options, depth, '[', ']', &items, |item, out| {
                dumps(item, options, depth + 1, out)
            })?;
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if options.sort_keys {
                keys.sort();
            }
            container(out, options, depth, '{', '}', &keys, |key, out| {
                match key.as_str() {
                    Some(k) => write_string(k, options.ensure_ascii, out),
                    // Python writes int, float, bool and None keys as strings.
                    None if key.is_none() => out.push_str("\"null\""),
                    None => write_string(&key.to_string(), options.ensure_ascii, out),
                }
                out.push_str(&options.key_separator);
                dumps(&value.get_item(key)?, options, depth + 1, out)
            })?;
        }
        ValueKind::Bytes | ValueKind::Plain | ValueKind::Invalid | _ => {
            return Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                format!("Object of type {} is not JSON serializable", value.kind()),
            ));
        }
    }
    Ok(())
}

/// A list or dict: `open`, the items `each` writes with the separators
/// and indentation of `options`, `close`.
fn container(
    out: &mut String,
    options: &Dumps,
    depth: usize,
    open: char,
    close: char,
    items: &[Value],
    mut each: impl FnMut(&Value, &mut String) -> Result<(), minijinja::Error>,
) -> Result<(), minijinja::Error> {
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return Ok(());
    }
    let newline = |out: &mut String, depth: usize| {
        if let Some(indent) = &options.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(indent);
            }
        }
    };
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(&options.item_separator);
        }
        newline(out, depth + 1);
        each(item, out)?;
    }
    newline(out, depth);
    out.push(close);
    Ok(())
}

/// A string as `json.dumps` writes it.
fn write_string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => write!(out, "\\u{:04x}", c as u32).expect("a String takes writes"),
            c if ensure_ascii && !c.is_ascii() => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    write!(out, "\\u{unit:04x}").expect("a String takes writes");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// `repr(f)` of a Python float, as `json.dumps` writes it: the shortest
/// digits that read back as `f`, in positional notation for decimal
/// exponents from -4 to 15 (`0.0001`, `1e+16` beyond), `.0` on whole
/// numbers, and `NaN` / `Infinity` / `-Infinity`.
pub fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Rust's `{:e}` writes the shortest round-trip digits: `d[.ddd]e[-]x`.
    let sci = format!("{f:e}");
    let (mantissa, exponent) = sci.split_once('e').expect("{:e} has an exponent");
    let exponent: i32 = exponent.parse().expect("{:e}'s exponent is an integer");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    if !(-4..16).contains(&exponent) {
        let (first, rest) = digits.split_at(1);
        let dot = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let sign_e = if exponent < 0 { '-' } else { '+' };
        return format!("{sign}{first}{dot}e{sign_e}{:02}", exponent.abs());
    }
    let point = exponent + 1; // digits before the decimal point
    if point <= 0 {
        let zeros = "0".repeat(usize::try_from(-point).unwrap_or(0));
        return format!("{sign}0.{zeros}{digits}");
    }
    let point = usize::try_from(point).unwrap_or(0);
    if digits.len() <= point {
        let zeros = "0".repeat(point - digits.len());
        format!("{sign}{digits}{zeros}.0")
    } else {
        format!("{sign}{}.{}", &digits[..point], &digits[point..])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_are_written_as_python_writes_them() {
        let cases = [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (-2.25, "-2.25"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123456789.125, "123456789.125"),
            (1.5e300, "1.5e+300"),
            (0.1 + 0.2, "0.30000000000000004"),
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (f64::NAN, "NaN"),
            (f64::INFINITY, "Infinity"),
            (2.5e-7, "2.5e-07"),
        ];
        for (f, python) in cases {
            assert_eq!(python_float_repr(f), python, "{f}");
        }
    }

    #[test]
    fn json_loads_keeps_order_and_kinds() {
        let v = TemplateValue::parse(
            r#"{"b":1,"a":[1.0,2,"x\u00e9",null,true],"b":3,"big":18446744073709551615,"neg":-9223372036854775808}"#,
        )
        .unwrap();
        assert_eq!(
            v.to_json(),
            r#"{"b": 3, "a": [1.0, 2, "xé", null, true], "big": 18446744073709551615, "neg": -9223372036854775808}"#
        );
        assert_eq!(v.get("b"), Some(&TemplateValue::Int(3)));
    }

    #[test]
    fn tojson_takes_pythons_arguments() {
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", python_tojson);
        let v = TemplateValue::parse(r#"{"name":"f","p":{"x":[1,2],"e":{}},"s":"<a href='x'>\n"}"#).unwrap();
        let render = |src: &str| {
            env.render_str(src, minijinja::context! { v => v.to_template() })
                .unwrap()
        };
        assert_eq!(
            render("{{ v | tojson }}"),
            r#"{"name": "f", "p": {"x": [1, 2], "e": {}}, "s": "<a href='x'>\n"}"#
        );
        assert_eq!(
            render("{{ v.p | tojson(indent=2) }}"),
            "{\n  \"x\": [\n    1,\n    2\n  ],\n  \"e\": {}\n}"
        );
        assert_eq!(render("{{ v.p | tojson(4) }}").lines().count(), 7);
        assert_eq!(
            render("{{ v | tojson(separators=(',', ':'), sort_keys=true) }}"),
            r#"{"name":"f","p":{"e":{},"x":[1,2]},"s":"<a href='x'>\n"}"#
        );
        assert_eq!(
            render("{{ 'é😀' | tojson(ensure_ascii=true) }}"),
            r#""\u00e9\ud83d\ude00""#
        );
    }
}
