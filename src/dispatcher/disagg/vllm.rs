//! vLLM with its NixlConnector: the two legs' bodies and what passes
//! between them.
//!
//! - The prefill leg is the client's body with `kv_transfer_params`
//!   asking for a remote decode (with the other parameters null, as
//!   vLLM's own proxy sends them), not streamed, one output token in the
//!   field the client used (`max_completion_tokens` or `max_tokens`, never
//!   both), no `min_tokens`, `n` 1.
//! - Its answer carries `kv_transfer_params` at the top level (where the
//!   decode engine pulls the blocks from), or none when the prefill ended
//!   on a stop (then there is nothing to hand over).
//! - The decode leg is the client's body with those parameters, verbatim.

use bytes::Bytes;
use serde_json::{Map, Value, json};

/// The member both legs carry.
const PARAMS: &str = "kv_transfer_params";

/// The prefill leg's body made of `body` (the body the decode leg would
/// get without parameters); `None` if it is not a JSON object.
pub(in crate::dispatcher) fn prefill_body(body: &[u8]) -> Option<Bytes> {
    let Ok(Value::Object(mut object)) = serde_json::from_slice::<Value>(body) else {
        return None;
    };
    object.insert(
        PARAMS.into(),
        json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        }),
    );
    object.insert("stream".into(), Value::Bool(false));
    object.remove("stream_options");
    object.remove("min_tokens");
    object.insert("n".into(), json!(1));
    if object.contains_key("max_completion_tokens") {
        object.remove("max_tokens");
        object.insert("max_completion_tokens".into(), json!(1));
    } else {
        object.insert("max_tokens".into(), json!(1));
    }
    Some(Bytes::from(
        serde_json::to_vec(&object).expect("a JSON value serializes"),
    ))
}

/// The parameters a prefill answer hands to the decode leg: its top-level
/// `kv_transfer_params` object, if it has one (`None`: the prefill ended
/// on a stop, or the engine does not hand over).
pub(in crate::dispatcher) fn params_of(answer: &[u8]) -> Option<Map<String, Value>> {
    let Ok(Value::Object(mut object)) = serde_json::from_slice::<Value>(answer) else {
        return None;
    };
    match object.remove(PARAMS) {
        Some(Value::Object(params)) if !params.is_empty() => Some(params),
        _ => None,
    }
}

/// The decode leg's body: `body` with `params` as its
/// `kv_transfer_params` (a client's own is replaced); `body` as it is if
/// it is not a JSON object.
pub(in crate::dispatcher) fn decode_body(body: &Bytes, params: &Map<String, Value>) -> Bytes {
    let Ok(Value::Object(mut object)) = serde_json::from_slice::<Value>(body) else {
        return body.clone();
    };
    object.insert(PARAMS.into(), Value::Object(params.clone()));
    Bytes::from(serde_json::to_vec(&object).expect("a JSON value serializes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(b: &[u8]) -> Value {
        serde_json::from_slice(b).unwrap()
    }

    #[test]
    fn the_prefill_leg_asks_for_one_token_and_a_remote_decode() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,
            "stream_options":{"include_usage":true},"max_tokens":300,"min_tokens":10,"n":1,"temperature":0}"#;
        let p = parsed(&prefill_body(body).unwrap());
        assert_eq!(p["stream"], false);
        assert!(p.get("stream_options").is_none() && p.get("min_tokens").is_none());
        assert_eq!(p["max_tokens"], 1);
        assert!(p.get("max_completion_tokens").is_none());
        assert_eq!(p["n"], 1);
        assert_eq!(p["temperature"], 0);
        assert_eq!(p["messages"][0]["content"], "hi");
        assert_eq!(
            p[PARAMS],
            json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                   "remote_block_ids": null, "remote_host": null, "remote_port": null})
        );
        // The field the client used, never both.
        let p = parsed(&prefill_body(br#"{"model":"m","prompt":"x","max_completion_tokens":50}"#).unwrap());
        assert_eq!(p["max_completion_tokens"], 1);
        assert!(p.get("max_tokens").is_none());
        let p =
            parsed(&prefill_body(br#"{"model":"m","prompt":"x","max_completion_tokens":5,"max_tokens":9}"#).unwrap());
        assert_eq!(
            (p["max_completion_tokens"].clone(), p.get("max_tokens")),
            (json!(1), None)
        );
        let p = parsed(&prefill_body(br#"{"model":"m","prompt":"x"}"#).unwrap());
        assert_eq!(p["max_tokens"], 1);
        assert!(prefill_body(b"[1]").is_none());
    }

    #[test]
    fn the_decode_leg_carries_the_prefills_params_verbatim() {
        let answer = br#"{"id":"cmpl-1","choices":[{"text":"a","finish_reason":"length"}],
            "kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2,3]],
            "remote_engine_id":"e-1","remote_request_id":"r-1","remote_host":"10.0.0.1","remote_port":5600,"tp_size":1,
            "remote_num_tokens":40,"future_field":{"x":[1.5]}}}"#;
        let params = params_of(answer).unwrap();
        let body = Bytes::from_static(br#"{"model":"m","prompt":"x","stream":true,"kv_transfer_params":{"mine":1}}"#);
        let d = parsed(&decode_body(&body, &params));
        assert_eq!(d[PARAMS], parsed(answer)[PARAMS]);
        assert_eq!(d["stream"], true);
        assert_eq!(d["prompt"], "x");
        // An answer that ended on a stop hands nothing over.
        assert!(params_of(br#"{"choices":[{"finish_reason":"stop"}]}"#).is_none());
        assert!(params_of(br#"{"kv_transfer_params":null}"#).is_none());
        assert!(params_of(br#"{"kv_transfer_params":{}}"#).is_none());
        assert!(params_of(b"not json").is_none());
    }
}
