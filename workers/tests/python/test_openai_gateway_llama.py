#!/usr/bin/env python3
"""semlb in front of real llama.cpp engines, through the official `openai`
Python client.

Starts two `llama-server` processes (the binary and model named by the
environment variables LLAMA_SERVER and LLAMA_MODEL, as
`workers/recipes/llama-cpp/get.sh` prints them) with the command line of
the recipe, then `semlb serve` (SEMLB, default target/debug/semlb) in front
of them with `--tokenizer` the model file, reads the gateway's address from
its first stdout line (`semlb listening on http://ADDR`), runs the checks
with `openai.OpenAI(base_url=..., api_key=...)` (the key also sent as an
`api-key` header, as Azure-style clients do), and stops everything.
Prints one line per check and a final `N passed, M failed`; exits non-zero
when a check failed.

    eval "$(workers/recipes/llama-cpp/get.sh | tail -2)"; export LLAMA_SERVER LLAMA_MODEL
    target/pyenv/bin/python workers/tests/python/test_openai_gateway_llama.py

Only loopback traffic.
"""

import os
import re
import select
import socket
import subprocess
import sys
import time
import traceback
import urllib.request

import openai

LISTEN_LINE = re.compile(r"^semlb listening on (http://\S+)\s*$")
RESULTS = []


def check(cond, what):
    RESULTS.append((bool(cond), what))
    print(("ok    " if cond else "FAIL  ") + what, flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engine(server, model):
    port = free_port()
    cmd = [server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", "1", "-np", "2", "-c", "4096",
           "--metrics"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("llama-server not healthy after 120 s")


def start_gateway(semlb, backends, model):
    cmd = [semlb, "serve", "--listen", "127.0.0.1:0", "--shm-name", f"semlb-pyllama-{os.getpid()}",
           "--shm-size", "32MiB", "--tokenizer", model]
    for b in backends:
        cmd += ["--backend", b]
    print("starting: " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if ready else ""
    match = LISTEN_LINE.match(line)
    if not match:
        proc.kill()
        raise RuntimeError(f"no listening line from semlb serve (got {line!r})")
    base = match.group(1).rstrip("/")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            return proc, base
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("the gateway is not healthy after 30 s")


def checks(client):
    system = {"role": "system", "content": "You are a terse assistant."}
    question = {"role": "user", "content": "Name one planet."}

    r = client.chat.completions.create(model="smollm2", messages=[system, question], max_tokens=12, temperature=0)
    text = r.choices[0].message.content
    check(isinstance(text, str) and text.strip(), f"chat: an answer ({text!r})")
    check(r.choices[0].finish_reason in ("stop", "length"), f"chat: finish_reason {r.choices[0].finish_reason}")
    check(r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 12,
          f"chat: usage {r.usage.prompt_tokens} + {r.usage.completion_tokens}, at most max_tokens")

    # The next turn, streamed, sent as soon as the answer is there: the
    # engine finds the conversation's prefix.
    turn2 = [system, question, {"role": "assistant", "content": text}, {"role": "user", "content": "Another one?"}]
    chunks = list(client.chat.completions.create(model="smollm2", messages=turn2, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage]
    check(streamed.strip(), f"chat stream: text ({streamed!r})")
    check(finishes and finishes[-1] in ("stop", "length"), f"chat stream: a final finish_reason {finishes}")
    check(len(usage) == 1, "chat stream: one usage chunk")
    cached = usage and usage[0].prompt_tokens_details and usage[0].prompt_tokens_details.cached_tokens
    check(cached and cached > 0, f"chat stream: the second turn found its prefix cached ({cached} tokens)")

    c = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=6, temperature=0)
    check(c.choices[0].text.strip(), f"completions: text ({c.choices[0].text!r})")
    check(c.usage.prompt_tokens > 0 and c.usage.completion_tokens <= 6, "completions: usage")
    parts = list(client.completions.create(model="smollm2", prompt="Count: one, two,", max_tokens=6, stream=True))
    check("".join(p.choices[0].text for p in parts if p.choices).strip(), "completions stream: text")

    try:
        client.chat.completions.create(model="smollm2", messages="not a list", max_tokens=4)
        check(False, "a malformed body is refused")
    except openai.BadRequestError as e:
        body = e.body if isinstance(e.body, dict) else {}
        check(e.status_code == 400 and "message" in body, f"a malformed body: 400 with an OpenAI error ({body})")


def main():
    server, model = os.environ.get("LLAMA_SERVER"), os.environ.get("LLAMA_MODEL")
    if not (server and model):
        print("LLAMA_SERVER and LLAMA_MODEL must be set (workers/recipes/llama-cpp/get.sh prints them)")
        return 2
    semlb = os.environ.get("SEMLB", "target/debug/semlb")
    procs = []
    try:
        engines = [start_engine(server, model) for _ in range(2)]
        procs += [p for p, _ in engines]
        gateway, base = start_gateway(semlb, [u for _, u in engines], model)
        procs.append(gateway)
        client = openai.OpenAI(base_url=base + "/v1", api_key="team-a", default_headers={"api-key": "team-a"},
                               max_retries=0, timeout=120)
        checks(client)
    except Exception:
        traceback.print_exc()
        check(False, "the run completed")
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        # The supervisor leaves its segment for a next start (keep_segment):
        # this run has none.
        try:
            os.unlink(f"/dev/shm/semlb-pyllama-{os.getpid()}")
        except FileNotFoundError:
            pass
    failed = sum(1 for ok, _ in RESULTS if not ok)
    print(f"{len(RESULTS) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
