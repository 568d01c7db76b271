#!/usr/bin/env python3
"""The APIs agents speak through semlb, with the official clients: OpenAI's
Responses API (`openai`) and Anthropic's Messages API (`anthropic`).

Starts three simulated engines (SEMLB_SIM, default target/debug/semlb-sim,
`--listen 127.0.0.1:0 --time-scale 0.001`) and `semlb serve` (SEMLB,
default target/debug/semlb) with 2 dispatchers in front of them, reads the
addresses from their first stdout lines, and checks, through the gateway:

- `responses.create`, not streamed and streamed, with a tool: the engine's
  function call, its result sent back with `previous_response_id`, the
  answer; usage (`input_tokens`, `output_tokens`,
  `input_tokens_details.cached_tokens`); each continuation on the engine
  that stored the response (`x-semlb-route: stored_response`);
- a Responses conversation resent whole: its second turn on the first
  turn's engine, routed by prefix, with cached tokens;
- `messages.create` and `messages.stream` with a tool: `tool_use`, the
  `tool_result` sent back, the text answer; usage (`input_tokens`,
  `output_tokens`, `cache_read_input_tokens`) and the second turn on the
  first's engine by prefix; the key in `x-api-key`;
- errors in each API's shape (an unknown model: `NotFoundError`, with
  Anthropic's `not_found_error` type on `/v1/messages`; an unknown
  `previous_response_id`: 404 `response_not_found`).

Prints one line per check and `N passed, M failed`; exits non-zero when a
check failed.

    SEMLB=target/debug/semlb SEMLB_SIM=target/debug/semlb-sim \\
        target/pyenv/bin/python workers/tests/python/test_agents_gateway.py

Only loopback traffic.
"""

import json
import os
import re
import select
import subprocess
import sys
import traceback

import anthropic
import openai

RESULTS = []
SYSTEM = "You are a coding agent working in a large repository. Be precise. " * 8


def check(cond, what):
    RESULTS.append((bool(cond), what))
    print(("ok    " if cond else "FAIL  ") + what, flush=True)


def listening(proc, pattern, what):
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if ready else ""
    match = re.match(pattern, line)
    if not match:
        proc.kill()
        raise RuntimeError(f"no listening line from {what} (got {line!r})")
    return match.group(1).rstrip("/")


def start_sim(binary):
    proc = subprocess.Popen([binary, "--listen", "127.0.0.1:0", "--time-scale", "0.001"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    return proc, listening(proc, r"^semlb-sim listening on (http://\S+)\s*$", "semlb-sim")


def start_gateway(binary, backends):
    cmd = [binary, "serve", "--listen", "127.0.0.1:0", "--shm-name", f"semlb-pyagents-{os.getpid()}",
           "--shm-size", "32MiB", "--dispatchers", "2"]
    for b in backends:
        cmd += ["--backend", b]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    return proc, listening(proc, r"^semlb listening on (http://\S+)\s*$", "semlb serve")


RESPONSES_TOOL = {"type": "function", "name": "grep", "description": "Searches the repository.",
                  "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}},
                                 "required": ["pattern"]}}
MESSAGES_TOOL = {"name": "grep", "description": "Searches the repository.",
                 "input_schema": {"type": "object", "properties": {"pattern": {"type": "string"}},
                                  "required": ["pattern"]}}


def routed(raw):
    return raw.headers.get("x-semlb-backend"), raw.headers.get("x-semlb-route")


def responses_checks(base):
    client = openai.OpenAI(base_url=base + "/v1", api_key="agent-key", max_retries=0)
    raw = client.responses.with_raw_response.create(
        model="semlb-sim", instructions=SYSTEM, input="Find the parser's entry point.", tools=[RESPONSES_TOOL],
        max_output_tokens=64)
    first = raw.parse()
    engine, _ = routed(raw)
    call = next((o for o in first.output if o.type == "function_call"), None)
    check(call is not None and call.name == "grep" and "pattern" in json.loads(call.arguments),
          "responses.create with a tool: a function call")
    check(first.usage.input_tokens > 0 and first.usage.output_tokens > 0
          and first.usage.input_tokens_details.cached_tokens == 0, "responses usage on the first turn")
    raw = client.responses.with_raw_response.create(
        model="semlb-sim", previous_response_id=first.id, tools=[RESPONSES_TOOL], max_output_tokens=32,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "src/parse.rs:12"}])
    second = raw.parse()
    check(routed(raw) == (engine, "stored_response"),
          f"previous_response_id goes to the storing engine ({routed(raw)} vs {engine})")
    check(second.output_text.strip() != "" and second.usage.input_tokens_details.cached_tokens > 0,
          "the tool result answered from the engine's cache")
    # Streamed, continuing the same chain.
    events = []
    with client.responses.stream(model="semlb-sim", previous_response_id=second.id, max_output_tokens=32,
                                 input="And its tests?") as stream:
        for event in stream:
            events.append(event.type)
        final = stream.get_final_response()
    check(events[0] == "response.created" and events[-1] == "response.completed"
          and "response.output_text.delta" in events, "a streamed Responses answer's events")
    check(final.output_text.strip() != "" and final.usage.output_tokens > 0, "the stream's final response")
    # A conversation resent whole (no store): its second turn by prefix.
    history = [{"role": "user", "content": "Explain the tokenizer's cache."}]
    raw = client.responses.with_raw_response.create(model="semlb-sim", instructions=SYSTEM + " (whole)",
                                                    input=history, store=False, max_output_tokens=48)
    one = raw.parse()
    engine, _ = routed(raw)
    history += [{"role": "assistant", "content": one.output_text}, {"role": "user", "content": "Shorter?"}]
    raw = client.responses.with_raw_response.create(model="semlb-sim", instructions=SYSTEM + " (whole)",
                                                    input=history, store=False, max_output_tokens=48)
    two = raw.parse()
    check(routed(raw) == (engine, "prefix") and two.usage.input_tokens_details.cached_tokens > 0,
          f"a resent conversation stays by prefix ({routed(raw)}, cached {two.usage.input_tokens_details.cached_tokens})")
    try:
        client.responses.create(model="no-such-model", input="x")
        check(False, "an unknown model is refused")
    except openai.NotFoundError as e:
        check(e.status_code == 404, "an unknown model: 404 in OpenAI's shape")
    try:
        client.responses.create(model="semlb-sim", input="x", previous_response_id="resp_nobody")
        check(False, "an unknown previous_response_id is refused")
    except openai.NotFoundError as e:
        check(e.body.get("code") == "response_not_found", f"an unknown previous_response_id: {e.body}")


def messages_checks(base):
    client = anthropic.Anthropic(base_url=base, api_key="agent-key", max_retries=0)
    history = [{"role": "user", "content": "Where is the retry logic?"}]
    raw = client.messages.with_raw_response.create(model="semlb-sim", system=SYSTEM, max_tokens=64,
                                                   tools=[MESSAGES_TOOL], messages=history)
    first = raw.parse()
    engine, _ = routed(raw)
    use = next((b for b in first.content if b.type == "tool_use"), None)
    check(first.stop_reason == "tool_use" and use is not None and "pattern" in use.input,
          "messages.create with a tool: tool_use")
    check(first.usage.input_tokens > 0 and first.usage.output_tokens > 0, "messages usage")
    history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                              "content": "src/proxy/send.rs:88"}]}]
    with client.messages.stream(model="semlb-sim", system=SYSTEM, max_tokens=48, tools=[MESSAGES_TOOL],
                                messages=history) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
        headers = stream.response.headers
    check(text.strip() != "" and final.stop_reason in ("end_turn", "max_tokens"), "messages.stream: the answer")
    check((headers.get("x-semlb-backend"), headers.get("x-semlb-route")) == (engine, "prefix"),
          f"the tool result's turn on the first turn's engine ({headers.get('x-semlb-backend')} vs {engine})")
    check((final.usage.cache_read_input_tokens or 0) > 0, f"cache_read_input_tokens: {final.usage}")
    try:
        client.messages.create(model="no-such-model", max_tokens=8, messages=[{"role": "user", "content": "x"}])
        check(False, "an unknown model is refused")
    except anthropic.NotFoundError as e:
        check(e.status_code == 404 and e.body.get("error", {}).get("type") == "not_found_error",
              f"an unknown model: Anthropic's not_found_error ({e.body})")


def main():
    sim = os.environ.get("SEMLB_SIM", "target/debug/semlb-sim")
    semlb = os.environ.get("SEMLB", "target/debug/semlb")
    procs = []
    try:
        engines = [start_sim(sim) for _ in range(3)]
        procs += [p for p, _ in engines]
        gateway, base = start_gateway(semlb, [a for _, a in engines])
        procs.append(gateway)
        for step in (responses_checks, messages_checks):
            try:
                step(base)
            except Exception:  # noqa: BLE001 (a failed step is a failed check)
                traceback.print_exc()
                check(False, f"{step.__name__} ran to its end")
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
    failed = sum(1 for ok, _ in RESULTS if not ok)
    print(f"{len(RESULTS) - failed} passed, {failed} failed", flush=True)
    sys.exit(1 if failed or not RESULTS else 0)


if __name__ == "__main__":
    main()
