//! One inference request, from its body to its answer, through the leg
//! of disaggregated serving it is ([`crate::pd`]):
//!
//! 1. the body is read and recorded ([`crate::request_log`]), the fault
//!    decision applied, the prompt prepared ([`prepare`]) and the leg
//!    named ([`Leg`]);
//! 2. the output is planned ([`Plan`]): its length, its finish reason
//!    (a vLLM prefill leg checks EOS before its length cap), whether its
//!    prompt is held for a decode; a conversation with tools is answered
//!    with a tool call, whose tokens are its rendering (`tools`); a
//!    Responses answer to be stored gets the hook that stores it when
//!    the engine finishes;
//! 3. before the engine, a decode leg pulls its prompt's KV (vLLM: from
//!    the prefill's side channel, else it recomputes; SGLang: through
//!    the bootstrap rendezvous) and an SGLang prefill leg waits for its
//!    decode in the room;
//! 4. the engine runs it; the answer's head goes out with the first
//!    token (streamed) or the whole answer; a vLLM prefill leg's answer
//!    carries its `kv_transfer_params`; an SGLang prefill leg answers
//!    once its decode has taken the KV.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};

use semlb_tokenizer::chat::ChatMessage;

use super::sse::{OnFinish, SseStream, StreamSpec};
use super::tokens::{Continued, Prepared, prepare, prompt_seed};
use super::{Body, BoxError, Completion, Sim, error_response, read_body, reset_error, tools, unix_now};
use crate::api::{self, AnswerSpec, ApiError, Ending, Endpoint, FinishReason, GenParams, ResponseMeta};
use crate::engine::{BlockKeys, Engine, EngineRequest, EngineStream, Event, KvHandoff, SubmitError, Usage};
use crate::faults::Decision;
use crate::pd::{Leg, PrefillSeat};
use crate::request_log::Recorded;
use crate::response_store::StoredResponse;

/// Answers an inference request (after the hang and delay faults), and
/// records it.
pub(super) async fn inference(
    sim: &Arc<Sim>,
    request: Request<Incoming>,
    endpoint: Endpoint,
    decision: Decision,
    completion: Completion,
) -> Response<Body> {
    let path = request.uri().path().to_owned();
    let headers = request.headers();
    let request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let override_header = headers.get(api::OUTPUT_TOKENS_HEADER).cloned();
    let (body, read) = match read_body(request.into_body()).await {
        Ok(body) => (body, Ok(())),
        Err(e) => (Bytes::new(), Err(e)),
    };
    let mut recorded = Some(sim.requests().record(&path, request_id, &body));
    if read.is_ok() && streamed_sglang_decode_leg(sim, &body) {
        return head_first(
            sim.clone(),
            endpoint,
            decision,
            completion,
            override_header,
            body,
            recorded,
        );
    }
    let answered = match read {
        Ok(()) => {
            answer(
                sim,
                endpoint,
                decision,
                completion,
                override_header,
                &body,
                &mut recorded,
            )
            .await
        }
        Err(e) => Err(e),
    };
    answered.unwrap_or_else(|e| {
        failed(&mut recorded, &e);
        error_response(in_shape(endpoint, e))
    })
}

/// The error in the shape of `endpoint`'s API (Anthropic's on `/v1/messages`).
pub(super) fn in_shape(endpoint: Endpoint, e: ApiError) -> ApiError {
    match endpoint {
        Endpoint::Messages => e.in_anthropic_format(),
        _ => e,
    }
}

/// The request's record says it failed with `e` (unless its body took it).
fn failed(recorded: &mut Option<Recorded>, e: &ApiError) {
    if let Some(recorded) = recorded.take() {
        recorded.fail(Some(e.status.as_u16()), e.message.clone());
    }
}

/// Whether `body` is a streamed SGLang decode leg (a room, `stream: true`).
fn streamed_sglang_decode_leg(sim: &Sim, body: &Bytes) -> bool {
    let streams = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("stream")?.as_bool())
        .unwrap_or(false);
    streams && matches!(sim.pd().leg(body), Ok(Leg::SglangDecode(_)))
}

/// SGLang's decode server answers a streamed request's head at once (its
/// `StreamingResponse` starts before the prefill's KV arrives), so a
/// router sees the head long before the first token; the answer follows
/// in the body, and an error after the head as an OpenAI-style error
/// event and `data: [DONE]` (as SGLang streams one).
fn head_first(
    sim: Arc<Sim>,
    endpoint: Endpoint,
    decision: Decision,
    completion: Completion,
    override_header: Option<HeaderValue>,
    body: Bytes,
    mut recorded: Option<Recorded>,
) -> Response<Body> {
    use futures_util::StreamExt;
    let rest = async move {
        match answer(
            &sim,
            endpoint,
            decision,
            completion,
            override_header,
            &body,
            &mut recorded,
        )
        .await
        {
            Ok(response) => response.into_body(),
            Err(e) => {
                failed(&mut recorded, &e);
                let error = serde_json::json!({"object": "error", "message": e.message, "code": e.status.as_u16()});
                let events = format!("data: {error}\n\ndata: [DONE]\n\n");
                http_body_util::Full::new(Bytes::from(events))
                    .map_err(|never| match never {})
                    .boxed_unsync()
            }
        }
    };
    let frames = futures_util::stream::once(rest).flat_map(http_body_util::BodyStream::new);
    let mut response = Response::new(StreamBody::new(frames).boxed_unsync());
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// What the engine is to generate for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Plan {
    /// Output tokens.
    n: u32,
    /// Why it ends.
    finish: FinishReason,
    /// Hold its prompt for a decode engine when it ends.
    hold: bool,
}

impl Plan {
    /// The plan of a request of `leg`: as [`api::output_length`] has it,
    /// except that a vLLM prefill leg stops on EOS when its natural
    /// length is within its cap (vLLM checks EOS first) and holds its
    /// prompt only when it ended on the cap and is not streamed, and an
    /// SGLang prefill leg generates one token and always holds.
    fn of(leg: &Leg, params: &GenParams, override_tokens: Option<u32>, default_output: u32) -> Plan {
        let (n, finish) = api::output_length(params, override_tokens, default_output);
        match leg {
            Leg::NixlPrefill => {
                let natural = api::natural_length(params, override_tokens, default_output);
                let eos = matches!((natural, params.max_tokens), (Some(l), Some(max)) if l <= max);
                let finish = if eos { FinishReason::Stop } else { finish };
                Plan {
                    n,
                    finish,
                    hold: finish == FinishReason::Length && !params.stream,
                }
            }
            Leg::SglangPrefill { .. } => Plan {
                n: 1,
                finish: FinishReason::Length,
                hold: true,
            },
            _ => Plan { n, finish, hold: false },
        }
    }
}

/// Releases a held prompt unless disarmed: a leg whose client leaves
/// between the engine's end and the handoff leaves no pin behind.
struct PinGuard {
    engine: Engine,
    key: Option<u64>,
}

impl Drop for PinGuard {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            self.engine.release_pin(key);
        }
    }
}

/// The request's record, taken by the body that will say how it ended.
fn taken(recorded: &mut Option<Recorded>) -> Result<Recorded, ApiError> {
    recorded
        .take()
        .ok_or_else(|| server_error("the request's record was taken twice"))
}

fn server_error(e: impl ToString) -> ApiError {
    ApiError::server_error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
}

/// What the engine is to generate, and what the answer is.
struct Planned {
    plan: Plan,
    /// The prompt's seed (a continued answer's: its first prompt's).
    seed: u64,
    /// Tokens drawn from the seed that the answer continues.
    skip: u32,
    /// A tool call's output tokens.
    call_tokens: Option<Vec<u32>>,
    /// The answer's API, id, finish reason, tool call and length.
    answer: AnswerSpec,
}

/// Step 2: the output of a request of `leg` (its length; a tool call's
/// tokens, its rendering) and the answer it makes.
fn plan_output(
    sim: &Arc<Sim>,
    prepared: &Prepared,
    leg: &Leg,
    override_tokens: Option<u32>,
    endpoint: Endpoint,
) -> Planned {
    let Prepared {
        prompt, params, chat, ..
    } = prepared;
    let config = sim.engine().config();
    // A continued answer goes on from the one drawn for the prompt it
    // began in, when its text is how that one begins.
    let (seed, skip) = match prepared
        .continued
        .as_ref()
        .and_then(|c| Some((c.seed, drawn_prefix(sim, c)?)))
    {
        Some(continued) => continued,
        None => (prompt_seed(prompt), 0),
    };
    let meta = ResponseMeta {
        endpoint,
        id: sim.response_id(endpoint),
        created: unix_now(),
        model: prepared.model.clone(),
    };
    // A prefill leg generates no call: its decode leg answers.
    let call = match (leg, chat) {
        (Leg::NixlPrefill | Leg::SglangPrefill { .. }, _) | (_, None) => None,
        // Nor does an answer that continues a text.
        (_, Some(chat)) if chat.conversation.ending == Ending::ContinueFinal => None,
        (_, Some(chat)) => tools::tool_answer(sim, chat, seed, &meta),
    };
    // A call that would not fit in max_tokens is not made: the answer is text.
    let call = call.filter(|(_, tokens)| params.max_tokens.is_none_or(|max| max as usize >= tokens.len()));
    let (plan, call, call_tokens) = match call {
        Some((call, tokens)) => {
            let plan = Plan {
                n: u32::try_from(tokens.len()).unwrap_or(u32::MAX),
                finish: FinishReason::ToolCalls,
                hold: false,
            };
            (plan, Some(call), Some(tokens))
        }
        // What is left of its natural length (at least a token).
        None => {
            let rest = |n: u32| n.saturating_sub(skip).max(1);
            let plan = Plan::of(
                leg,
                params,
                override_tokens.map(rest),
                rest(config.default_output_tokens),
            );
            (plan, None, None)
        }
    };
    Planned {
        plan,
        seed,
        skip,
        call_tokens,
        answer: AnswerSpec {
            meta,
            finish: plan.finish,
            call,
            include_usage: params.include_usage,
            expected: plan.n,
            echo: prepared.echo.clone(),
        },
    }
}

impl Planned {
    /// The output tokens (a call's, or words drawn from the prompt's
    /// seed), and what stores a Responses answer once it is finished:
    /// the conversation and the answer (the call, or its text).
    fn draw(&mut self, sim: &Arc<Sim>, prepared: &Prepared) -> (Vec<u32>, Option<OnFinish>) {
        let output = match self.call_tokens.take() {
            Some(tokens) => tokens,
            None => {
                let skip = self.skip as usize;
                let mut drawn = sim.vocab().generate(self.seed, skip + self.plan.n as usize);
                drawn.split_off(skip)
            }
        };
        let on_finish = match (&prepared.echo, &prepared.chat) {
            (Some(echo), Some(chat)) if echo.store => {
                let message = match &self.answer.call {
                    Some(call) => call.message(),
                    None => {
                        let text: String = output.iter().map(|&id| sim.tokenizer().decode(&[id])).collect();
                        ChatMessage::new("assistant", text)
                    }
                };
                let stored = StoredResponse {
                    messages: chat.conversation.messages.clone(),
                    output: message,
                };
                let (sim, id) = (sim.clone(), self.answer.meta.id.clone());
                Some(Box::new(move || sim.responses().insert(id, stored)) as OnFinish)
            }
            _ => None,
        };
        (output, on_finish)
    }
}

/// How many tokens drawn from `continued`'s seed make its text; `None`
/// when the text is not how that answer begins.
fn drawn_prefix(sim: &Sim, continued: &Continued) -> Option<u32> {
    let want = continued.text.as_str();
    let (mut text, mut count) = (String::new(), 0);
    // Every drawn word is at least a byte long.
    for id in sim.vocab().generate(continued.seed, want.len()) {
        if text.len() >= want.len() {
            break;
        }
        text.push_str(&sim.tokenizer().decode(&[id]));
        count += 1;
        if !want.starts_with(&text) {
            return None;
        }
    }
    (text == want).then_some(count)
}

/// Steps 1 to 4 of the module docs; an error is answered by the caller.
async fn answer(
    sim: &Arc<Sim>,
    endpoint: Endpoint,
    decision: Decision,
    completion: Completion,
    override_header: Option<HeaderValue>,
    body: &Bytes,
    recorded: &mut Option<Recorded>,
) -> Result<Response<Body>, ApiError> {
    if decision.fail {
        return Err(server_error("Injected failure (semlb-sim --fail-rate)"));
    }
    let override_tokens = override_header
        .map(|value| api::parse_output_override(value.as_bytes()))
        .transpose()?;
    let prepared = prepare(sim, endpoint, body)?;
    let (engine, pd) = (sim.engine(), sim.pd());
    let leg = pd.leg(body)?;
    if let Some(recorded) = recorded {
        recorded.leg(leg.kind());
    }
    let config = engine.config();
    // Refuse an impossible length before drawing (and allocating) the output.
    let prompt_len = u32::try_from(prepared.prompt.len()).unwrap_or(u32::MAX);
    let mut planned = plan_output(sim, &prepared, &leg, override_tokens, endpoint);
    let plan = planned.plan;
    if u64::from(prompt_len) + u64::from(plan.n) > u64::from(config.max_model_len) {
        let error = SubmitError::TooLong {
            prompt: prompt_len,
            output: plan.n,
            max: config.max_model_len,
        };
        return Err(ApiError::from_submit(&error, endpoint.prompt_param()));
    }
    let (output, on_finish) = planned.draw(sim, &prepared);
    let Prepared {
        prompt,
        params,
        model,
        root,
        ..
    } = prepared;
    let key = pd.pin_key();
    let (handoff, seat) = before_engine(sim, &leg, plan.hold.then_some(key), root, &prompt).await?;
    let pin = PinGuard {
        engine: engine.clone(),
        key: plan.hold.then_some(key),
    };
    let request = EngineRequest {
        prompt,
        output,
        root,
        keys: BlockKeys {
            // The base model's blocks name no adapter.
            lora_name: (model != config.model_name).then(|| model.clone()),
            // The simulator keeps a salt's hash, not the salt: its
            // events name the hash (a gateway only needs to see that
            // the block has extra keys).
            salt: params.cache_salt.map(|h| format!("{h:016x}")),
        },
    };
    let mut events = engine
        .submit_with(request, handoff)
        .map_err(|e| ApiError::from_submit(&e, endpoint.prompt_param()))?;
    let Some(Event::FirstToken {
        id: first,
        cached_tokens,
        ttft_s,
    }) = events.next().await
    else {
        return Err(engine_gone());
    };
    let spec = StreamSpec {
        answer: planned.answer,
        tokenizer: sim.tokenizer().clone(),
        prompt_tokens: prompt_len,
        cached_tokens,
        reset: decision.reset,
        fault: params.stream.then(|| sim.faults().stream_begins()).flatten(),
        on_finish,
    };
    let head = Response::builder()
        .header(api::SIM_TTFT_HEADER, format!("{:.3}", ttft_s * 1000.0))
        .header(api::SIM_CACHED_TOKENS_HEADER, cached_tokens);
    let answering = Answering {
        spec,
        head,
        stream: params.stream,
        reset: decision.reset,
        recorded,
        completion,
    };
    answering.respond(sim, events, first, seat, (pin, key)).await
}

fn engine_gone() -> ApiError {
    server_error("The engine dropped the request")
}

/// An answer under way: the engine has sent its first token.
struct Answering<'r> {
    spec: StreamSpec,
    head: http::response::Builder,
    stream: bool,
    reset: bool,
    recorded: &'r mut Option<Recorded>,
    completion: Completion,
}

impl Answering<'_> {
    /// Step 4: the answer streamed as the engine's events come, or whole
    /// once the engine has finished (an SGLang prefill leg's once its
    /// decode has taken the KV; a vLLM prefill leg's with its
    /// `kv_transfer_params`).
    async fn respond(
        mut self,
        sim: &Arc<Sim>,
        mut events: EngineStream,
        first: u32,
        seat: Option<PrefillSeat>,
        (mut pin, key): (PinGuard, u64),
    ) -> Result<Response<Body>, ApiError> {
        let (engine, pd) = (sim.engine(), sim.pd());
        if self.stream && seat.is_none() {
            let stream = SseStream::start(self.spec, events, first, taken(self.recorded)?, self.completion);
            return streamed(self.head, stream);
        }
        let mut tokens = vec![first];
        let usage = loop {
            match events.next().await {
                Some(Event::Token { id }) => tokens.push(id),
                Some(Event::Finished { usage }) => break usage,
                Some(Event::FirstToken { .. }) => {}
                None => return Err(engine_gone()),
            }
        };
        let mut transfer_params = None;
        if let Some(mut seat) = seat {
            pd.sglang_hand_over(&mut seat, engine, key).await?;
            pin.key = None;
            if self.stream {
                let stream = SseStream::finished(self.spec, &tokens, usage, taken(self.recorded)?, self.completion);
                return streamed(self.head, stream);
            }
        } else if let Some(key) = pin.key.take() {
            transfer_params = pd.nixl_hold(engine, key, &self.spec.answer.meta.id);
        }
        if let Some(on_finish) = self.spec.on_finish.take() {
            on_finish();
        }
        let json = json_answer(sim, &self.spec, &tokens, usage, transfer_params);
        let head = self.head.header(CONTENT_TYPE, "application/json");
        let body = whole_body(json, self.reset, taken(self.recorded)?, self.completion);
        head.body(body).map_err(server_error)
    }
}

/// A streamed answer's response.
fn streamed(head: http::response::Builder, stream: SseStream) -> Result<Response<Body>, ApiError> {
    let head = head
        .header(CONTENT_TYPE, "text/event-stream")
        .header(CACHE_CONTROL, "no-cache");
    let body = StreamBody::new(futures_util::stream::unfold(stream, SseStream::next_frame)).boxed_unsync();
    head.body(body).map_err(server_error)
}

/// Step 3: what the engine is to know of the leg's KV (the decode leg's
/// pulled prompt, the key a prefill's prompt is held under), and the
/// SGLang prefill's seat in its room, once its decode has joined.
async fn before_engine(
    sim: &Sim,
    leg: &Leg,
    hold: Option<u64>,
    root: u64,
    prompt: &[u32],
) -> Result<(KvHandoff, Option<PrefillSeat>), ApiError> {
    let (engine, pd) = (sim.engine(), sim.pd());
    let hold = KvHandoff {
        hold_prompt: hold,
        ..KvHandoff::default()
    };
    Ok(match leg {
        Leg::Plain | Leg::NixlPrefill => (hold, None),
        Leg::NixlDecode(remote) => (pd.nixl_decode(engine, remote.as_ref(), root, prompt).await, None),
        Leg::SglangDecode(boot) => (pd.sglang_decode(engine, boot, root, prompt).await?, None),
        Leg::SglangPrefill { room } => (hold, Some(pd.sglang_prefill_seat(engine, *room).await?)),
    })
}

/// The JSON answer of `tokens`, with the prefill's `kv_transfer_params`
/// at the top level if there are any (as vLLM writes them).
fn json_answer(sim: &Sim, spec: &StreamSpec, tokens: &[u32], usage: Usage, params: Option<serde_json::Value>) -> Bytes {
    let text: String = tokens.iter().map(|&id| sim.tokenizer().decode(&[id])).collect();
    let body = spec.answer.body(text, usage);
    match params {
        None => body,
        Some(params) => {
            let mut value: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            value["kv_transfer_params"] = params;
            Bytes::from(serde_json::to_vec(&value).unwrap_or_default())
        }
    }
}

/// A non-streamed body: `json` in one frame, the request complete once
/// hyper asks past it; or, with `reset`, the head alone, then an abort.
fn whole_body(json: Bytes, reset: bool, recorded: Recorded, completion: Completion) -> Body {
    if reset {
        // Head out (hyper flushes while the body is pending), then abort.
        let cut = futures_util::stream::once(async move {
            tokio::task::yield_now().await;
            recorded.fail(Some(200), "cut on purpose (--reset-rate)");
            drop(completion);
            Err::<Frame<Bytes>, BoxError>(reset_error())
        });
        return StreamBody::new(cut).boxed_unsync();
    }
    let state = (Some(json), Some(recorded), completion);
    let frames = futures_util::stream::unfold(state, |(json, mut recorded, completion)| async move {
        match json {
            Some(json) => Some((Ok::<_, BoxError>(Frame::data(json)), (None, recorded, completion))),
            None => {
                if let Some(recorded) = recorded.take() {
                    recorded.complete(200);
                }
                None
            }
        }
    });
    StreamBody::new(frames).boxed_unsync()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pd::RemotePrefill;

    fn params(max_tokens: Option<u32>, stream: bool) -> GenParams {
        GenParams {
            max_tokens,
            stream,
            ..GenParams::default()
        }
    }

    #[test]
    fn a_vllm_prefill_leg_checks_eos_before_its_cap() {
        let plan = |p: &GenParams, o| Plan::of(&Leg::NixlPrefill, p, o, 128);
        // Capped at 1 by the router: held, ends on the cap.
        let capped = plan(&params(Some(1), false), None);
        assert_eq!((capped.n, capped.finish, capped.hold), (1, FinishReason::Length, true));
        // Its natural length is 1: EOS at prefill, nothing held.
        let eos = plan(&params(Some(1), false), Some(1));
        assert_eq!((eos.n, eos.finish, eos.hold), (1, FinishReason::Stop, false));
        // Streamed: nothing held.
        assert!(!plan(&params(Some(1), true), None).hold);
        // ignore_eos: never stops by itself.
        let ignore = GenParams {
            ignore_eos: true,
            ..params(Some(1), false)
        };
        assert!(plan(&ignore, None).hold);
        // A plain request with the same numbers keeps the simulator's rule.
        let plain = Plan::of(&Leg::Plain, &params(Some(1), false), Some(1), 128);
        assert_eq!((plain.finish, plain.hold), (FinishReason::Length, false));
    }

    #[test]
    fn an_sglang_prefill_leg_generates_one_token_and_holds() {
        let plan = Plan::of(&Leg::SglangPrefill { room: 1 }, &params(Some(500), true), None, 128);
        assert_eq!(
            plan,
            Plan {
                n: 1,
                finish: FinishReason::Length,
                hold: true
            }
        );
        let decode = Leg::NixlDecode(Some(RemotePrefill {
            engine_id: "e".into(),
            request_id: "r".into(),
            host: "h".into(),
            port: 1,
        }));
        assert_eq!(Plan::of(&decode, &params(Some(500), false), None, 128).n, 128);
    }
}
