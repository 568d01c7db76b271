#!/usr/bin/env python3
"""semlb-sim's `POST /v1/messages` against the official `anthropic` Python client.

Starts the simulator itself (the binary named by the environment variable
SEMLB_SIM, default target/debug/semlb-sim) with
`--listen 127.0.0.1:0 --time-scale 0.001`, reads the address from its first
stdout line (`semlb-sim listening on http://ADDR`), runs the checks with
`anthropic.Anthropic(base_url=..., api_key="x")` (`messages.create`, streamed
and not, `messages.stream`, a tool-use loop, errors), stops the simulator
with SIGTERM and waits for it. Prints one line per check and a final
`N passed, M failed`; exits non-zero when a check failed.

Plain python3, no pytest:

    python3 -m venv target/pyenv && target/pyenv/bin/pip install anthropic
    SEMLB_SIM=target/debug/semlb-sim target/pyenv/bin/python workers/tests/python/test_anthropic_client.py

Only loopback traffic: the simulator listens on 127.0.0.1.
"""

import os
import re
import sys
import traceback

import anthropic

from simproc import SHUTDOWN_TIMEOUT_S, check, start_sim, stop_sim

# What the simulator generates: common English words, each with a leading space.
WORDS_TEXT = re.compile(r"^\s*[a-z]+( [a-z]+)*\s*$")
SYSTEM = "You are a careful assistant who looks things up before answering. " * 6
TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


def check_text(text):
    check(isinstance(text, str) and text.strip() != "", f"empty text {text!r}")
    check(WORDS_TEXT.match(text) is not None, f"text is not generated words: {text!r}")


def check_usage(usage, output_tokens=None):
    check(usage.input_tokens >= 0 and usage.output_tokens > 0, f"usage {usage}")
    check(usage.cache_read_input_tokens is not None, "cache_read_input_tokens missing")
    if output_tokens is not None:
        check(usage.output_tokens == output_tokens, f"output_tokens {usage.output_tokens} != {output_tokens}")


class Checks:
    def __init__(self, client):
        self.client = client
        self.model = "semlb-sim"

    def test_create(self):
        msg = self.client.messages.create(
            model=self.model,
            max_tokens=8,
            system="Be brief.",
            messages=[{"role": "user", "content": "Say something."}],
        )
        check(msg.type == "message" and msg.role == "assistant", f"{msg.type} {msg.role}")
        check(msg.id.startswith("msg_"), f"id {msg.id!r}")
        check(msg.stop_reason == "max_tokens", f"stop_reason {msg.stop_reason!r} at max_tokens")
        check(len(msg.content) == 1 and msg.content[0].type == "text", f"content {msg.content}")
        check_text(msg.content[0].text)
        check_usage(msg.usage, 8)

    def test_create_stream(self):
        stream = self.client.messages.create(
            model=self.model,
            max_tokens=1024,
            messages=[{"role": "user", "content": "Stream something."}],
            stream=True,
        )
        kinds, text = [], ""
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta":
                text += event.delta.text
        check(kinds[0] == "message_start" and kinds[-1] == "message_stop", f"events {kinds[:2]} ... {kinds[-1:]}")
        check("message_delta" in kinds, "no message_delta")
        check_text(text)

    def test_stream_helper(self):
        with self.client.messages.stream(
            model=self.model,
            max_tokens=12,
            system=[{"type": "text", "text": SYSTEM}],
            messages=[{"role": "user", "content": "Stream something else."}],
        ) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        check_text(text)
        check(final.content[0].text == text, "the final message is the streamed text")
        check(final.stop_reason == "max_tokens", f"stop_reason {final.stop_reason!r}")
        check_usage(final.usage, 12)

    def test_second_turn_reads_the_cache(self):
        turn1 = [{"role": "user", "content": "Describe a quiet lake at dawn in many words."}]
        first = self.client.messages.create(model=self.model, max_tokens=48, system=SYSTEM, messages=turn1)
        turn2 = turn1 + [
            {"role": "assistant", "content": first.content[0].text},
            {"role": "user", "content": "And at dusk?"},
        ]
        second = self.client.messages.create(model=self.model, max_tokens=4, system=SYSTEM, messages=turn2)
        cached = second.usage.cache_read_input_tokens
        prompt1 = first.usage.input_tokens + first.usage.cache_read_input_tokens
        check(cached >= prompt1 // 16 * 16, f"cache_read_input_tokens {cached} < whole blocks of turn 1's {prompt1}")

    def test_tool_use_loop(self):
        # tool_use, tool_result, text, next question: the cache reads grow.
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        cached = []
        for turn in range(4):
            msg = self.client.messages.create(
                model=self.model, max_tokens=1024, system=SYSTEM, messages=messages, tools=TOOLS
            )
            cached.append(msg.usage.cache_read_input_tokens)
            if turn % 2 == 0:
                check(msg.stop_reason == "tool_use", f"turn {turn}: stop_reason {msg.stop_reason!r}")
                block = msg.content[0]
                check(block.type == "tool_use" and block.name == "get_weather", f"content {msg.content}")
                check(block.id.startswith("toolu_"), f"id {block.id!r}")
                check(set(block.input) == {"city"}, f"input {block.input!r}")
                messages.append({"role": "assistant", "content": [b.model_dump() for b in msg.content]})
                messages.append(
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "Sunny."}]}
                )
            else:
                check(msg.stop_reason == "end_turn", f"turn {turn}: stop_reason {msg.stop_reason!r}")
                check_text(msg.content[0].text)
                messages.append({"role": "assistant", "content": msg.content[0].text})
                messages.append({"role": "user", "content": "And in Rome?"})
        check(all(c > 0 for c in cached[1:]), f"cache_read_input_tokens {cached}")
        check(cached == sorted(cached) and len(set(cached[1:])) == 3, f"cache reads do not grow: {cached}")

    def test_tool_use_stream(self):
        with self.client.messages.stream(
            model=self.model,
            max_tokens=1024,
            messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=TOOLS,
        ) as stream:
            final = stream.get_final_message()
        check(final.stop_reason == "tool_use", f"stop_reason {final.stop_reason!r}")
        block = final.content[0]
        check(block.type == "tool_use" and set(block.input) == {"city"}, f"content {final.content}")

    def test_tool_choice_none_answers_text(self):
        msg = self.client.messages.create(
            model=self.model,
            max_tokens=6,
            messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=TOOLS,
            tool_choice={"type": "none"},
        )
        check(msg.content[0].type == "text", f"content {msg.content}")

    def test_bad_request_raises(self):
        try:
            self.client.messages.create(model=self.model, max_tokens=0, messages=[{"role": "user", "content": "x"}])
        except anthropic.BadRequestError as err:
            check(err.status_code == 400, f"status {err.status_code}")
            check(err.body["type"] == "error", f"body {err.body}")
            check(err.body["error"]["type"] == "invalid_request_error", f"body {err.body}")
            return
        raise AssertionError("max_tokens=0 was accepted")

    def test_unknown_model_raises(self):
        try:
            self.client.messages.create(model="claude-x", max_tokens=5, messages=[{"role": "user", "content": "x"}])
        except anthropic.NotFoundError as err:
            check(err.body["error"]["type"] == "not_found_error", f"body {err.body}")
            return
        raise AssertionError("an unknown model was accepted")


def main():
    binary = os.environ.get("SEMLB_SIM", "target/debug/semlb-sim")
    passed, failed = 0, 0
    try:
        proc, base = start_sim(binary)
    except Exception as err:  # noqa: BLE001 - reported as a failed check
        print(f"FAIL start semlb-sim: {err}", flush=True)
        print("0 passed, 1 failed")
        return 1
    print(f"semlb-sim at {base}", flush=True)
    try:
        client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=30.0)
        checks = Checks(client)
        for name in [name for name in Checks.__dict__ if name.startswith("test_")]:
            try:
                getattr(checks, name)()
            except Exception:  # noqa: BLE001 - every failure is reported
                failed += 1
                print(f"FAIL {name}", flush=True)
                traceback.print_exc(file=sys.stdout)
            else:
                passed += 1
                print(f"ok   {name}", flush=True)
    finally:
        code = stop_sim(proc)
    if code is None:
        failed += 1
        print(f"FAIL semlb-sim did not exit within {SHUTDOWN_TIMEOUT_S:.0f} s of SIGTERM (killed)")
    else:
        print(f"semlb-sim exited with {code} after SIGTERM")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
