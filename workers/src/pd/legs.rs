//! Which leg of disaggregated serving a request body is ([`Leg::of`]),
//! from the fields each protocol adds to the OpenAI body: vLLM's
//! `kv_transfer_params`, SGLang's `bootstrap_host`, `bootstrap_port` and
//! `bootstrap_room`.
//!
//! | protocol | role | body | leg |
//! | --- | --- | --- | --- |
//! | vllm-nixl | any | `kv_transfer_params.do_remote_prefill: true` | decode: pull (complete params) or recompute (incomplete) |
//! | vllm-nixl | any | `kv_transfer_params.do_remote_decode: true` | prefill: hold the prompt for a puller |
//! | vllm-nixl | any | neither | plain |
//! | sglang | prefill | a `bootstrap_room` | prefill: meet the decode in the room |
//! | sglang | prefill | no `bootstrap_room` | **400** |
//! | sglang | decode | `bootstrap_room`, `bootstrap_host`, `bootstrap_port` | decode: meet the prefill in the room |
//! | sglang | decode | no `bootstrap_room` | plain (a real SGLang decode server cannot serve it; see [`crate::pd`]) |
//! | sglang | both | anything | plain (SGLang's `null` mode ignores the bootstrap fields) |
//!
//! vLLM's NixlConnector behaves alike whatever its `kv_role`, and so does
//! the simulator: in vLLM mode the role changes only what the simulator
//! reports. Parameters count as complete when `remote_engine_id`,
//! `remote_request_id` and `remote_host` are strings, `remote_port` a
//! port number and `remote_block_ids` a list (vLLM's own check names the
//! same fields).

use serde_json::{Map, Value};

use super::{PdProtocol, Role};
use crate::api::{ApiError, parse_object, wrong_type};
use crate::request_log::LegKind;

/// Where a vLLM decode leg pulls its prompt's KV from: the prefill's
/// `kv_transfer_params`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemotePrefill {
    /// `remote_engine_id`.
    pub engine_id: String,
    /// `remote_request_id`.
    pub request_id: String,
    /// `remote_host`.
    pub host: String,
    /// `remote_port`.
    pub port: u16,
}

/// Where an SGLang decode leg meets its prefill.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bootstrap {
    /// `bootstrap_host` (an IPv6 address in brackets).
    pub host: String,
    /// `bootstrap_port`.
    pub port: u16,
    /// `bootstrap_room`.
    pub room: u64,
}

/// A request's leg.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leg {
    /// No handoff.
    Plain,
    /// vLLM's prefill leg (`do_remote_decode`).
    NixlPrefill,
    /// vLLM's decode leg (`do_remote_prefill`): its remote prefill, if the
    /// parameters are complete.
    NixlDecode(Option<RemotePrefill>),
    /// SGLang's prefill leg, with its room.
    SglangPrefill {
        /// `bootstrap_room`.
        room: u64,
    },
    /// SGLang's decode leg.
    SglangDecode(Bootstrap),
}

impl Leg {
    /// The leg of `body` (a JSON object: the request was parsed before)
    /// for an engine of `role` speaking `protocol`. A wrong type in the
    /// protocol's fields is a 400, and so is an SGLang prefill request
    /// without a room.
    pub fn of(body: &[u8], role: Role, protocol: PdProtocol) -> Result<Leg, ApiError> {
        let obj = parse_object(body)?;
        match protocol {
            PdProtocol::VllmNixl => nixl_leg(&obj),
            PdProtocol::Sglang => sglang_leg(&obj, role),
        }
    }

    /// What `/sim/requests` calls it.
    pub fn kind(&self) -> LegKind {
        match self {
            Leg::Plain => LegKind::Plain,
            Leg::NixlPrefill | Leg::SglangPrefill { .. } => LegKind::Prefill,
            Leg::NixlDecode(_) | Leg::SglangDecode(_) => LegKind::Decode,
        }
    }
}

fn nixl_leg(obj: &Map<String, Value>) -> Result<Leg, ApiError> {
    let params = match obj.get("kv_transfer_params") {
        None | Some(Value::Null) => return Ok(Leg::Plain),
        Some(Value::Object(params)) => params,
        Some(other) => return Err(wrong_type("kv_transfer_params", "an object", other)),
    };
    let flag = |key: &str| params.get(key).and_then(Value::as_bool).unwrap_or(false);
    Ok(if flag("do_remote_prefill") {
        Leg::NixlDecode(remote_prefill(params))
    } else if flag("do_remote_decode") {
        Leg::NixlPrefill
    } else {
        Leg::Plain
    })
}

/// The remote prefill of complete parameters.
fn remote_prefill(params: &Map<String, Value>) -> Option<RemotePrefill> {
    let text = |key: &str| params.get(key).and_then(Value::as_str).filter(|s| !s.is_empty());
    params.get("remote_block_ids").filter(|ids| ids.is_array())?;
    Some(RemotePrefill {
        engine_id: text("remote_engine_id")?.to_owned(),
        request_id: text("remote_request_id")?.to_owned(),
        host: text("remote_host")?.to_owned(),
        port: params
            .get("remote_port")
            .and_then(Value::as_u64)
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p > 0)?,
    })
}

fn sglang_leg(obj: &Map<String, Value>, role: Role) -> Result<Leg, ApiError> {
    let room = match obj.get("bootstrap_room") {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) if n.as_u64().is_some_and(|r| r < 1 << 63) => n.as_u64(),
        Some(Value::Array(_)) => {
            return Err(ApiError::bad_request(
                "A list of bootstrap rooms (a batch) is not supported",
                Some("bootstrap_room"),
            )
            .in_sglang_format());
        }
        Some(other) => {
            return Err(wrong_type("bootstrap_room", "an integer in [0, 2^63 - 1]", other).in_sglang_format());
        }
    };
    match (role, room) {
        (Role::Both, _) | (Role::Decode, None) => Ok(Leg::Plain),
        (Role::Prefill, None) => Err(ApiError::bad_request(
            "bootstrap_room is required in prefill mode (--disaggregation-mode prefill): send the request \
             through a prefill/decode router",
            Some("bootstrap_room"),
        )
        .in_sglang_format()),
        (Role::Prefill, Some(room)) => Ok(Leg::SglangPrefill { room }),
        (Role::Decode, Some(room)) => {
            let host = obj
                .get("bootstrap_host")
                .and_then(Value::as_str)
                .filter(|h| !h.is_empty());
            let port = obj
                .get("bootstrap_port")
                .and_then(Value::as_u64)
                .and_then(|p| u16::try_from(p).ok())
                .filter(|p| *p > 0);
            match (host, port) {
                (Some(host), Some(port)) => Ok(Leg::SglangDecode(Bootstrap {
                    host: host.to_owned(),
                    port,
                    room,
                })),
                _ => Err(ApiError::bad_request(
                    "bootstrap_host and bootstrap_port (an integer port) are required with bootstrap_room",
                    Some("bootstrap_host"),
                )
                .in_sglang_format()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn leg(body: Value, role: Role, protocol: PdProtocol) -> Result<Leg, ApiError> {
        Leg::of(body.to_string().as_bytes(), role, protocol)
    }

    #[test]
    fn vllm_legs_come_from_kv_transfer_params() {
        let nixl = |params: Value| {
            leg(
                json!({"prompt": "x", "kv_transfer_params": params}),
                Role::Both,
                PdProtocol::VllmNixl,
            )
        };
        assert_eq!(nixl(Value::Null), Ok(Leg::Plain));
        assert_eq!(nixl(json!({})), Ok(Leg::Plain));
        assert_eq!(
            nixl(json!({"do_remote_decode": true, "do_remote_prefill": false})),
            Ok(Leg::NixlPrefill)
        );
        // vLLM's own proxy sends the remote fields as null.
        assert_eq!(
            nixl(
                json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                        "remote_block_ids": null, "remote_host": null, "remote_port": null})
            ),
            Ok(Leg::NixlPrefill)
        );
        let complete = json!({"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "e",
                              "remote_request_id": "r", "remote_block_ids": [[1, 2]], "remote_host": "10.0.0.1",
                              "remote_port": 8000, "tp_size": 1});
        assert_eq!(
            nixl(complete.clone()),
            Ok(Leg::NixlDecode(Some(RemotePrefill {
                engine_id: "e".into(),
                request_id: "r".into(),
                host: "10.0.0.1".into(),
                port: 8000
            })))
        );
        for missing in [
            "remote_engine_id",
            "remote_request_id",
            "remote_block_ids",
            "remote_host",
            "remote_port",
        ] {
            let mut incomplete = complete.clone();
            incomplete[missing] = Value::Null;
            assert_eq!(nixl(incomplete), Ok(Leg::NixlDecode(None)), "{missing}");
        }
        let refused = nixl(json!([1])).unwrap_err();
        assert_eq!(refused.param.as_deref(), Some("kv_transfer_params"));
        // SGLang's fields mean nothing to vLLM.
        assert_eq!(
            leg(json!({"bootstrap_room": 5}), Role::Prefill, PdProtocol::VllmNixl),
            Ok(Leg::Plain)
        );
    }

    #[test]
    fn sglang_legs_come_from_the_bootstrap_fields() {
        let boot = json!({"prompt": "x", "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 42});
        assert_eq!(
            leg(boot.clone(), Role::Prefill, PdProtocol::Sglang),
            Ok(Leg::SglangPrefill { room: 42 })
        );
        assert_eq!(
            leg(boot.clone(), Role::Decode, PdProtocol::Sglang),
            Ok(Leg::SglangDecode(Bootstrap {
                host: "10.0.0.1".into(),
                port: 8998,
                room: 42
            }))
        );
        assert_eq!(leg(boot, Role::Both, PdProtocol::Sglang), Ok(Leg::Plain));
        let no_room = leg(json!({"prompt": "x"}), Role::Prefill, PdProtocol::Sglang).unwrap_err();
        assert_eq!(no_room.status, http::StatusCode::BAD_REQUEST);
        let body: Value = serde_json::from_slice(&no_room.body()).unwrap();
        assert_eq!(body["object"], "error");
        assert_eq!(body["code"], 400);
        assert_eq!(body["type"], "BadRequestError");
        assert!(body["message"].as_str().unwrap().contains("bootstrap_room"));
        assert_eq!(
            leg(json!({"prompt": "x"}), Role::Decode, PdProtocol::Sglang),
            Ok(Leg::Plain)
        );
        for bad in [json!(-1), json!(1u64 << 63), json!("7"), json!([1, 2])] {
            assert!(
                leg(json!({"bootstrap_room": bad}), Role::Prefill, PdProtocol::Sglang).is_err(),
                "{bad}"
            );
        }
        assert!(leg(json!({"bootstrap_room": 1}), Role::Decode, PdProtocol::Sglang).is_err());
    }
}
