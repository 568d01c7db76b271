//! Envoy's messages as the picker reads and writes them: headers in and
//! out, the destination's header and dynamic metadata, streamed body
//! mutations, immediate responses, the subset hint.

use crate::dispatcher::http::PREFILL_HEADER;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap as EnvoyHeaders, HeaderValue, HeaderValueOption, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse, ProcessingResponse,
    StreamedBodyResponse, TrailersResponse, body_mutation, processing_response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use http::HeaderMap;

/// The header (and dynamic-metadata key) that names the endpoints picked:
/// the pick, then its fallbacks, comma-separated.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// The dynamic-metadata namespace the destination goes in, and the filter
/// metadata namespace of the subset hint.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The filter metadata namespace of the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The subset hint's key: the endpoints the pick must be among.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";

/// Most bytes of body in one streamed body response (Envoy's gRPC
/// messages stay well under their 4 MiB default limit).
const BODY_CHUNK: usize = 62_000;

/// An HTTP message's head as Envoy sends it: its pseudo-headers
/// (`:path`, `:method`, `:status`) apart from the others.
#[derive(Debug, Default)]
pub struct Head {
    /// The headers that are not pseudo-headers.
    pub headers: HeaderMap,
    /// `:method`.
    pub method: String,
    /// `:path`.
    pub path: String,
    /// `:status`.
    pub status: Option<u16>,
}

/// Reads Envoy's header list (a value in `raw_value`, else in `value`);
/// names or values HTTP does not take are left out.
pub fn read_head(envoy: Option<&EnvoyHeaders>) -> Head {
    let mut head = Head::default();
    for h in envoy.map_or(&[][..], |m| &m.headers[..]) {
        let value: &[u8] = if h.raw_value.is_empty() {
            h.value.as_bytes()
        } else {
            &h.raw_value
        };
        match h.key.as_str() {
            ":method" => head.method = String::from_utf8_lossy(value).into_owned(),
            ":path" => head.path = String::from_utf8_lossy(value).into_owned(),
            ":status" => head.status = std::str::from_utf8(value).ok().and_then(|s| s.parse().ok()),
            key if key.starts_with(':') => {}
            key => {
                if let (Ok(name), Ok(value)) = (
                    http::header::HeaderName::from_bytes(key.as_bytes()),
                    http::header::HeaderValue::from_bytes(value),
                ) {
                    head.headers.append(name, value);
                }
            }
        }
    }
    head
}

/// The subset hint of a request's filter metadata: the `ip:port`
/// endpoints it must be picked among (`None`: no hint).
pub fn subset_hint(metadata: Option<&Metadata>) -> Option<Vec<String>> {
    let hint = metadata?.filter_metadata.get(SUBSET_NAMESPACE)?;
    let list = hint.fields.get(SUBSET_KEY)?;
    Some(match &list.kind {
        Some(Kind::ListValue(list)) => list
            .values
            .iter()
            .filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(s.trim().to_owned()),
                _ => None,
            })
            .collect(),
        Some(Kind::StringValue(s)) => s.split(',').map(|s| s.trim().to_owned()).collect(),
        _ => Vec::new(),
    })
}

/// Envoy's header list of `pairs` (name, value), as Envoy sends them
/// (values in `raw_value`); for clients that play Envoy (tests, benches).
pub fn header_list(pairs: &[(&str, &str)]) -> EnvoyHeaders {
    EnvoyHeaders {
        headers: pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: (*k).to_owned(),
                raw_value: v.as_bytes().to_vec(),
                ..HeaderValue::default()
            })
            .collect(),
    }
}

fn header(key: &str, value: &[u8]) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            raw_value: value.to_vec(),
            ..HeaderValue::default()
        }),
        ..HeaderValueOption::default()
    }
}

/// The answer to the request's headers once the pick is made: the
/// destination header (and `content-length` for a body of `body_len`
/// bytes), the route cache cleared, the destination in the dynamic
/// metadata.
pub fn routed_headers(endpoints: &str, body_len: Option<usize>) -> ProcessingResponse {
    let mut set_headers = vec![header(DESTINATION_HEADER, endpoints.as_bytes())];
    if let Some(len) = body_len {
        set_headers.push(header("content-length", len.to_string().as_bytes()));
    }
    let destination = Struct {
        fields: [(
            DESTINATION_HEADER.to_owned(),
            Value {
                kind: Some(Kind::StringValue(endpoints.to_owned())),
            },
        )]
        .into(),
    };
    let metadata = Struct {
        fields: [(
            LB_NAMESPACE.to_owned(),
            Value {
                kind: Some(Kind::StructValue(destination)),
            },
        )]
        .into(),
    };
    ProcessingResponse {
        response: Some(processing_response::Response::RequestHeaders(HeadersResponse {
            response: Some(CommonResponse {
                header_mutation: Some(HeaderMutation {
                    set_headers,
                    ..HeaderMutation::default()
                }),
                clear_route_cache: true,
                ..CommonResponse::default()
            }),
        })),
        dynamic_metadata: Some(metadata),
        ..ProcessingResponse::default()
    }
}

/// The answer to the response's headers: passed on as they are, with
/// `x-semlb-prefill` naming the prefill engine of a split request.
pub fn response_headers(prefill: Option<&http::HeaderValue>) -> ProcessingResponse {
    let header_mutation = prefill.map(|p| HeaderMutation {
        set_headers: vec![header(PREFILL_HEADER, p.as_bytes())],
        ..HeaderMutation::default()
    });
    ProcessingResponse {
        response: Some(processing_response::Response::ResponseHeaders(HeadersResponse {
            response: Some(CommonResponse {
                header_mutation,
                ..CommonResponse::default()
            }),
        })),
        ..ProcessingResponse::default()
    }
}

/// `body` as streamed body responses of the request (`request`) or the
/// response, the last one ending the stream when `end`.
pub fn streamed_body(request: bool, body: &[u8], end: bool) -> Vec<ProcessingResponse> {
    let mut chunks: Vec<&[u8]> = body.chunks(BODY_CHUNK).collect();
    if chunks.is_empty() {
        chunks.push(&[]);
    }
    let last = chunks.len() - 1;
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, chunk)| {
            let mutation = BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(StreamedBodyResponse {
                    body: chunk.to_vec(),
                    end_of_stream: end && i == last,
                    ..StreamedBodyResponse::default()
                })),
            };
            let answer = BodyResponse {
                response: Some(CommonResponse {
                    body_mutation: Some(mutation),
                    ..CommonResponse::default()
                }),
            };
            ProcessingResponse {
                response: Some(if request {
                    processing_response::Response::RequestBody(answer)
                } else {
                    processing_response::Response::ResponseBody(answer)
                }),
                ..ProcessingResponse::default()
            }
        })
        .collect()
}

/// The answer to trailers of the request (`request`) or the response:
/// passed on as they are.
pub fn trailers(request: bool) -> ProcessingResponse {
    let answer = TrailersResponse::default();
    ProcessingResponse {
        response: Some(if request {
            processing_response::Response::RequestTrailers(answer)
        } else {
            processing_response::Response::ResponseTrailers(answer)
        }),
        ..ProcessingResponse::default()
    }
}

/// Envoy answers the client itself: `status`, `headers` (the gateway's
/// answer's `content-type`, `retry-after`, `x-ratelimit-*`), `body`.
pub fn immediate(status: u16, headers: &HeaderMap, body: Vec<u8>) -> ProcessingResponse {
    let set_headers = headers
        .iter()
        .filter(|(name, _)| *name != http::header::CONTENT_LENGTH)
        .map(|(name, value)| header(name.as_str(), value.as_bytes()))
        .collect();
    ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(status),
            }),
            headers: Some(HeaderMutation {
                set_headers,
                ..HeaderMutation::default()
            }),
            body,
            details: "semlb_endpoint_picker".to_owned(),
            ..ImmediateResponse::default()
        })),
        ..ProcessingResponse::default()
    }
}

/// `address` (a backend's base URL) as `host:port`: the scheme's port when
/// it names none.
pub fn host_port(address: &str) -> String {
    let (rest, default_port) = match address.split_once("://") {
        Some(("https", rest)) => (rest, 443),
        Some((_, rest)) => (rest, 80),
        None => (address, 80),
    };
    let authority = rest.split('/').next().unwrap_or(rest);
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    let has_port = match authority.rfind(']') {
        Some(close) => authority[close..].contains(':'),
        None => authority.contains(':'),
    };
    if has_port {
        authority.to_owned()
    } else {
        format!("{authority}:{default_port}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backend_url_becomes_host_and_port() {
        assert_eq!(host_port("http://127.0.0.1:8001"), "127.0.0.1:8001");
        assert_eq!(host_port("http://10.0.0.2:8000/"), "10.0.0.2:8000");
        assert_eq!(host_port("https://engine.local/v1"), "engine.local:443");
        assert_eq!(host_port("http://[::1]:9000"), "[::1]:9000");
        assert_eq!(host_port("http://[::1]"), "[::1]:80");
    }

    #[test]
    fn a_long_body_goes_in_chunks_and_only_the_last_ends_the_stream() {
        let body = vec![b'x'; BODY_CHUNK * 2 + 5];
        let out = streamed_body(true, &body, true);
        assert_eq!(out.len(), 3);
        let ends: Vec<bool> = out
            .iter()
            .map(|r| match &r.response {
                Some(processing_response::Response::RequestBody(b)) => match &b
                    .response
                    .as_ref()
                    .and_then(|c| c.body_mutation.as_ref())
                    .and_then(|m| m.mutation.as_ref())
                {
                    Some(body_mutation::Mutation::StreamedResponse(s)) => s.end_of_stream,
                    _ => panic!("not streamed"),
                },
                _ => panic!("not a request body answer"),
            })
            .collect();
        assert_eq!(ends, [false, false, true]);
        assert_eq!(streamed_body(false, b"", true).len(), 1);
    }
}
