//! Reading a request's JSON: the body as an object, and typed, optional
//! fields, each problem a 400 naming the field (`param`) at fault.

use serde_json::{Map, Value};

use super::ApiError;

/// Parses the body as a JSON object.
pub(crate) fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(ApiError::bad_request("The request body must be a JSON object", None)),
        Err(e) => Err(ApiError::bad_request(
            format!("The request body is not valid JSON: {e}"),
            None,
        )),
    }
}

/// The JSON type name of `v`, for messages.
fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

pub(crate) fn wrong_type(param: &str, expected: &str, got: &Value) -> ApiError {
    ApiError::bad_request(
        format!("`{param}` must be {expected}, not {}", type_name(got)),
        Some(param),
    )
}

/// A field that is absent or `null` → `None`.
pub(crate) fn field<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

pub(crate) fn opt_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, ApiError> {
    match field(obj, key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(wrong_type(key, "a boolean", other)),
    }
}

pub(crate) fn opt_string(obj: &Map<String, Value>, key: &str) -> Result<Option<String>, ApiError> {
    match field(obj, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(wrong_type(key, "a string", other)),
    }
}

pub(crate) fn opt_int(obj: &Map<String, Value>, key: &str) -> Result<Option<i64>, ApiError> {
    match field(obj, key) {
        None => Ok(None),
        Some(v @ Value::Number(n)) => match n.as_i64() {
            Some(i) => Ok(Some(i)),
            // Integers beyond i64 saturate; fractions are refused.
            None if n.as_u64().is_some() => Ok(Some(i64::MAX)),
            None => Err(wrong_type(key, "an integer", v)),
        },
        Some(other) => Err(wrong_type(key, "an integer", other)),
    }
}

pub(super) fn opt_number(obj: &Map<String, Value>, key: &str) -> Result<(), ApiError> {
    match field(obj, key) {
        None | Some(Value::Number(_)) => Ok(()),
        Some(other) => Err(wrong_type(key, "a number", other)),
    }
}

/// A token-count limit: integer ≥ 1.
pub(super) fn opt_limit(obj: &Map<String, Value>, key: &str) -> Result<Option<u32>, ApiError> {
    match opt_int(obj, key)? {
        None => Ok(None),
        Some(i) if i < 1 => Err(ApiError::bad_request(
            format!("`{key}` must be at least 1, got {i}"),
            Some(key),
        )),
        Some(i) => Ok(Some(u32::try_from(i).unwrap_or(u32::MAX))),
    }
}

/// Checks `n` / `best_of`: only 1 is supported.
pub(super) fn check_n(obj: &Map<String, Value>, key: &str) -> Result<(), ApiError> {
    match opt_int(obj, key)? {
        None | Some(1) => Ok(()),
        Some(n) if n > 1 => Err(ApiError::bad_request(format!("{key} > 1 is not supported"), Some(key))),
        Some(n) => Err(ApiError::bad_request(
            format!("`{key}` must be at least 1, got {n}"),
            Some(key),
        )),
    }
}
