#!/usr/bin/env python3
"""semlb-sim against the official `openai` Python client.

Starts the simulator itself (the binary named by the environment variable
SEMLB_SIM, default target/debug/semlb-sim) with
`--listen 127.0.0.1:0 --time-scale 0.001`, reads the address from its first
stdout line (`semlb-sim listening on http://ADDR`), runs the checks with
`openai.OpenAI(base_url=..., api_key="x")` (completions, chat with and
without tools, `responses.create` streamed and not, with tools and
`previous_response_id`, `responses.stream`), stops the simulator with SIGTERM
and waits for it. Prints one line per check and a final
`N passed, M failed`; exits non-zero when a check failed.

Plain python3, no pytest:

    python3 -m venv target/pyenv && target/pyenv/bin/pip install openai
    SEMLB_SIM=target/debug/semlb-sim target/pyenv/bin/python workers/tests/python/test_openai_client.py

Only loopback traffic: the simulator listens on 127.0.0.1.
"""

import json
import os
import re
import sys
import traceback

import openai

from simproc import SHUTDOWN_TIMEOUT_S, check, start_sim, stop_sim

# What the simulator generates: common English words, each with a leading space.
WORDS_TEXT = re.compile(r"^\s*[a-z]+( [a-z]+)*\s*$")
# The simulator's default KV block size (vLLM's --block-size 16).
BLOCK_SIZE = 16


def check_usage(usage, max_completion=None):
    check(usage is not None, "usage is missing")
    check(usage.prompt_tokens > 0, f"prompt_tokens = {usage.prompt_tokens}")
    check(usage.completion_tokens > 0, f"completion_tokens = {usage.completion_tokens}")
    if max_completion is not None:
        check(usage.completion_tokens <= max_completion, f"completion_tokens {usage.completion_tokens} > max_tokens")
    check(
        usage.total_tokens == usage.prompt_tokens + usage.completion_tokens,
        f"total_tokens {usage.total_tokens} != {usage.prompt_tokens} + {usage.completion_tokens}",
    )


def check_text(text):
    check(isinstance(text, str) and text.strip() != "", f"empty text {text!r}")
    check(WORDS_TEXT.match(text) is not None, f"text is not generated words: {text!r}")


def check_answer(text, reason, usage, max_tokens):
    """A max_tokens below the default output length (128): exactly max_tokens words, "length"."""
    check_text(text)
    check(usage.completion_tokens == max_tokens, f"completion_tokens {usage.completion_tokens} != {max_tokens}")
    # Every generated token is one word with its leading space.
    check(len(text.split()) == usage.completion_tokens, f"{len(text.split())} words for {max_tokens} tokens")
    check(reason == "length", f"finish_reason {reason!r} at max_tokens")


def cached_tokens(usage):
    details = getattr(usage, "prompt_tokens_details", None)
    return 0 if details is None or details.cached_tokens is None else details.cached_tokens


class Checks:
    def __init__(self, client):
        self.client = client
        self.model = None

    def test_models_list(self):
        models = self.client.models.list().data
        check(len(models) >= 1, "no model listed")
        self.model = models[0].id
        check(isinstance(self.model, str) and self.model, f"model id {self.model!r}")

    def test_chat(self):
        resp = self.client.chat.completions.create(
            model=self.model,
            messages=[
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Say something."},
            ],
            max_tokens=8,
        )
        check(resp.object == "chat.completion", f"object {resp.object!r}")
        check(len(resp.choices) == 1, f"{len(resp.choices)} choices")
        choice = resp.choices[0]
        check(choice.message.role == "assistant", f"role {choice.message.role!r}")
        check_usage(resp.usage, max_completion=8)
        check_answer(choice.message.content, choice.finish_reason, resp.usage, 8)

    def test_chat_without_max_tokens_stops(self):
        resp = self.client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": "Talk freely."}]
        )
        check_text(resp.choices[0].message.content)
        check_usage(resp.usage)
        check(resp.choices[0].finish_reason == "stop", f"finish_reason {resp.choices[0].finish_reason!r}")

    def test_chat_stream(self):
        stream = self.client.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": "Stream something."}],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, finish, usage, chunks = "", None, None, 0
        for chunk in stream:
            chunks += 1
            check(chunk.object == "chat.completion.chunk", f"object {chunk.object!r}")
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    text += choice.delta.content
                if choice.finish_reason is not None:
                    check(finish is None, "two finish_reasons")
                    finish = choice.finish_reason
        check(chunks >= 2, f"only {chunks} chunk(s)")
        check_usage(usage, max_completion=12)
        check_answer(text, finish, usage, 12)

    def test_completions(self):
        resp = self.client.completions.create(model=self.model, prompt="Once upon a time", max_tokens=10)
        check(resp.object == "text_completion", f"object {resp.object!r}")
        check(len(resp.choices) == 1, f"{len(resp.choices)} choices")
        check_usage(resp.usage, max_completion=10)
        check_answer(resp.choices[0].text, resp.choices[0].finish_reason, resp.usage, 10)

    def test_completions_stream(self):
        stream = self.client.completions.create(
            model=self.model,
            prompt="The weather today is",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, finish, usage = "", None, None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text += choice.text or ""
                if choice.finish_reason is not None:
                    finish = choice.finish_reason
        check_usage(usage, max_completion=6)
        check_answer(text, finish, usage, 6)

    def test_repeated_prompt_is_cached(self):
        # A prompt of many KV blocks, sent twice: the second is a cache hit.
        question = "Please summarise the following notes. " + " ".join(
            f"Note {i}: the river flows past the old stone house near the city." for i in range(30)
        )
        messages = [{"role": "user", "content": question}]
        first = self.client.chat.completions.create(model=self.model, messages=messages, max_tokens=4)
        second = self.client.chat.completions.create(model=self.model, messages=messages, max_tokens=4)
        check_usage(first.usage)
        check_usage(second.usage)
        check(first.usage.prompt_tokens == second.usage.prompt_tokens, "same prompt, different prompt_tokens")
        check(first.usage.prompt_tokens >= 8 * BLOCK_SIZE, f"prompt only {first.usage.prompt_tokens} tokens")
        cached = cached_tokens(second.usage)
        check(second.usage.prompt_tokens_details is not None, "prompt_tokens_details missing")
        check(0 < cached <= second.usage.prompt_tokens, f"cached_tokens {cached} of {second.usage.prompt_tokens}")
        # Everything but the last partial block is reusable.
        reusable = (second.usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
        check(cached >= reusable, f"cached_tokens {cached} < {reusable} (whole blocks of the prompt)")

    def test_next_turn_reuses_previous_turn(self):
        # Turn 2 = turn 1 + the answer + a new question: the KV cache of turn
        # 1's prompt (and of the generated answer) is reused.
        turn1 = [
            {"role": "system", "content": "You answer in long detail. " * 8},
            {"role": "user", "content": "Describe a quiet morning by the lake, please, in many words."},
        ]
        first = self.client.chat.completions.create(model=self.model, messages=turn1, max_tokens=48)
        answer = first.choices[0].message.content
        turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And the evening?"}]
        second = self.client.chat.completions.create(model=self.model, messages=turn2, max_tokens=4)
        check(
            second.usage.prompt_tokens > first.usage.prompt_tokens,
            f"turn 2 prompt {second.usage.prompt_tokens} not longer than turn 1's {first.usage.prompt_tokens}",
        )
        # The answer re-tokenizes to the generated ids, so the whole blocks of
        # turn 1's prompt + answer are cache hits (as in vLLM, which caches
        # the blocks filled during decoding too).
        cached = cached_tokens(second.usage)
        turn1_tokens = first.usage.prompt_tokens + first.usage.completion_tokens
        whole_blocks = turn1_tokens // BLOCK_SIZE * BLOCK_SIZE
        check(
            cached >= whole_blocks,
            f"turn 2 cached_tokens {cached} < {whole_blocks} (whole blocks of turn 1's {turn1_tokens} tokens)",
        )

    def test_bad_request_raises(self):
        try:
            self.client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": "hi"}], max_tokens=-1
            )
        except openai.BadRequestError as err:
            check(err.status_code == 400, f"status {err.status_code}")
            return
        raise AssertionError("max_tokens=-1 was accepted")

    def test_bad_completion_request_raises(self):
        try:
            self.client.completions.create(model=self.model, prompt="hi", max_tokens=-1)
        except openai.BadRequestError as err:
            check(err.status_code == 400, f"status {err.status_code}")
            return
        raise AssertionError("max_tokens=-1 was accepted")

    # ----- tools through chat completions -----

    def test_chat_tool_call_loop(self):
        # Tool call, tool result, text, next question: from the second turn
        # on, each prompt hits the cached blocks of the one before.
        messages = [
            {"role": "system", "content": "You look things up before answering. " * 6},
            {"role": "user", "content": "What is the weather in Paris?"},
        ]
        cached = []
        for turn in range(4):
            resp = self.client.chat.completions.create(model=self.model, messages=messages, tools=TOOLS)
            choice = resp.choices[0]
            check_usage(resp.usage)
            cached.append(cached_tokens(resp.usage))
            if turn % 2 == 0:
                check(choice.finish_reason == "tool_calls", f"turn {turn}: finish_reason {choice.finish_reason!r}")
                call = choice.message.tool_calls[0]
                check(call.function.name == "get_weather", f"tool {call.function.name!r}")
                check(set(json.loads(call.function.arguments)) == {"city"}, f"arguments {call.function.arguments!r}")
                check(choice.message.content is None, f"content {choice.message.content!r}")
                messages.append(choice.message.model_dump(exclude_none=True))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C."})
            else:
                check(choice.finish_reason == "stop", f"turn {turn}: finish_reason {choice.finish_reason!r}")
                check_text(choice.message.content)
                messages.append({"role": "assistant", "content": choice.message.content})
                messages.append({"role": "user", "content": "And in Rome?"})
        check(all(c > 0 for c in cached[1:]), f"cached_tokens {cached}")
        check(cached == sorted(cached) and len(set(cached[1:])) == 3, f"cached_tokens do not grow: {cached}")

    def test_chat_tool_call_stream(self):
        stream = self.client.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=TOOLS,
            stream=True,
        )
        name, arguments, finish = None, "", None
        for chunk in stream:
            for choice in chunk.choices:
                for call in choice.delta.tool_calls or []:
                    name = call.function.name or name
                    arguments += call.function.arguments or ""
                finish = choice.finish_reason or finish
        check(name == "get_weather", f"name {name!r}")
        check(set(json.loads(arguments)) == {"city"}, f"arguments {arguments!r}")
        check(finish == "tool_calls", f"finish_reason {finish!r}")

    # ----- the Responses API -----

    def test_responses(self):
        resp = self.client.responses.create(
            model=self.model, instructions="Be brief.", input="Say something.", max_output_tokens=8
        )
        check(resp.object == "response", f"object {resp.object!r}")
        check(resp.id.startswith("resp_"), f"id {resp.id!r}")
        check(resp.status == "incomplete", f"status {resp.status!r} at max_output_tokens")
        check_text(resp.output_text)
        check(resp.usage.output_tokens == 8, f"output_tokens {resp.usage.output_tokens}")
        check(resp.usage.total_tokens == resp.usage.input_tokens + 8, "total_tokens")
        check(resp.output[0].type == "message" and resp.output[0].role == "assistant", f"output {resp.output}")

    def test_responses_stream(self):
        stream = self.client.responses.create(model=self.model, input="Stream something.", stream=True)
        kinds, text, final = [], "", None
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
            if event.type == "response.completed":
                final = event.response
        check(kinds[:2] == ["response.created", "response.in_progress"], f"first events {kinds[:2]}")
        check(kinds[-1] == "response.completed", f"last event {kinds[-1]}")
        check(final is not None and final.output_text == text, "the deltas add up to the output")
        check(final.status == "completed", f"status {final.status!r}")
        check_text(text)
        with self.client.responses.stream(model=self.model, input="Stream something.") as helper:
            for _ in helper:
                pass
            again = helper.get_final_response()
        check(again.output_text == text, "the stream helper reads the same answer")

    def test_responses_tool_loop_continues_stored_responses(self):
        tools = [
            {
                "type": "function",
                "name": "get_weather",
                "description": "The weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            }
        ]
        first = self.client.responses.create(
            model=self.model, instructions="You look things up. " * 8, input="Weather in Paris?", tools=tools
        )
        call = first.output[0]
        check(call.type == "function_call" and call.name == "get_weather", f"output {first.output}")
        check(set(json.loads(call.arguments)) == {"city"}, f"arguments {call.arguments!r}")
        second = self.client.responses.create(
            model=self.model,
            instructions="You look things up. " * 8,
            previous_response_id=first.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."}],
            tools=tools,
        )
        check(second.output[0].type == "message", f"after the result: {second.output}")
        check_text(second.output_text)
        cached = second.usage.input_tokens_details.cached_tokens
        check(cached > 0, f"cached_tokens {cached} after a stored response")
        # Instructions do not carry over: the same ones again keep the prefix.
        stream = self.client.responses.create(
            model=self.model,
            instructions="You look things up. " * 8,
            previous_response_id=second.id,
            input="And in Rome?",
            tools=tools,
            stream=True,
        )
        arguments, done = "", None
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                arguments += event.delta
            if event.type == "response.completed":
                done = event.response
        check(done.output[0].type == "function_call", f"streamed output {done.output}")
        check(arguments == done.output[0].arguments, "the argument deltas add up")
        check(done.usage.input_tokens_details.cached_tokens > cached, "cached tokens grow")

    def test_responses_unknown_previous_id_is_404(self):
        try:
            self.client.responses.create(model=self.model, input="hi", previous_response_id="resp_unknown")
        except openai.NotFoundError as err:
            check(err.status_code == 404, f"status {err.status_code}")
            check("resp_unknown" in str(err), f"message {err}")
            return
        raise AssertionError("an unknown previous_response_id was accepted")


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


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
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=30.0)
        checks = Checks(client)
        names = [name for name in Checks.__dict__ if name.startswith("test_")]
        for name in names:
            if checks.model is None and name != "test_models_list":
                checks.model = "semlb-sim"
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
