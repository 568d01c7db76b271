#!/usr/bin/env python3
"""Stream resumption through semlb, as the official `openai` client sees it.

Starts two simulated engines (SEMLB_SIM, default target/debug/semlb-sim),
one of which kills itself with SIGKILL after 30 tokens of its first
stream (`--stream-fault die --stream-fault-after 30 --stream-fault-count
1`), and `semlb serve` (SEMLB, default target/debug/semlb) with 2
dispatchers in front of them, and checks, through the gateway:

- `chat.completions.create(stream=True)` sent until one lands on the
  faulty engine: the client iterates to the end without an exception, every
  chunk has one `id`, the text is the whole answer (equal to what the
  surviving engine gives the same request), and the usage counts all 80
  output tokens;
- a stream that may not be resumed (`logprobs`) on an engine that breaks
  every stream: the client raises `openai.APIError` with the gateway's
  message, after the 30 tokens that came, never a silent end.

Prints one line per check and `N passed, M failed`; exits non-zero when a
check failed.

    SEMLB=target/debug/semlb SEMLB_SIM=target/debug/semlb-sim \\
        target/pyenv/bin/python workers/tests/python/test_resume_gateway.py

Only loopback traffic.
"""

import os
import re
import select
import subprocess
import sys
import traceback

import openai

import simproc

RESULTS = []


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


def start_sim(binary, extra):
    """A simulated engine at 3 ms a token (simproc's), with `extra` flags."""
    return simproc.start_sim(binary, extra, time_scale="0.3")


def start_gateway(binary, backends, tag):
    cmd = [binary, "serve", "--listen", "127.0.0.1:0", "--shm-name", f"semlb-pyresume-{tag}-{os.getpid()}",
           "--shm-size", "32MiB", "--dispatchers", "2", "--policy", "least_load"]
    for b in backends:
        cmd += ["--backend", b]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    return proc, listening(proc, r"^semlb listening on (http://\S+)\s*$", "semlb serve")


def read(stream):
    """The ids, the text and the usage of a chat stream."""
    ids, text, usage = set(), "", None
    for chunk in stream:
        ids.add(chunk.id)
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.usage:
            usage = chunk.usage
    return ids, text, usage


def ask(client, topic, **extra):
    return client.chat.completions.with_raw_response.create(
        model="semlb-sim", max_tokens=80, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": f"Write a long report on {topic}."}], **extra)


def resumed(sim, semlb, procs):
    faulty = start_sim(sim, ["--stream-fault", "die", "--stream-fault-after", "30", "--stream-fault-count", "1"])
    good = start_sim(sim, [])
    procs += [faulty[0], good[0]]
    gateway, base = start_gateway(semlb, [faulty[1], good[1]], "die")
    procs.append(gateway)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    direct = openai.OpenAI(base_url=f"{good[1]}/v1", api_key="unused", max_retries=0)
    for i in range(6):
        raw = ask(client, f"harbours {i}")
        backend = raw.headers.get("x-semlb-backend")
        ids, text, usage = read(raw.parse())
        if backend != faulty[1]:
            continue
        _, whole, _ = read(ask(direct, f"harbours {i}").parse())
        check(len(ids) == 1, f"one id across the resumption ({ids})")
        check(text == whole, "the text is the whole answer")
        check(usage is not None and usage.completion_tokens == 80, f"usage counts all the output ({usage})")
        return
    check(False, "a request reached the faulty engine")


def not_resumed(sim, semlb, procs):
    faulty = start_sim(sim, ["--stream-fault", "error", "--stream-fault-after", "30"])
    procs.append(faulty[0])
    gateway, base = start_gateway(semlb, [faulty[1]], "blocked")
    procs.append(gateway)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    got = ""
    try:
        for chunk in ask(client, "tides", logprobs=True).parse():
            if chunk.choices and chunk.choices[0].delta.content:
                got += chunk.choices[0].delta.content
        check(False, "a stream that cannot be resumed raises")
    except openai.APIError as e:
        check("logprobs" in str(e), f"APIError names why it was not resumed ({e})")
        check(len(got.split()) == 30, f"after the 30 tokens that came ({len(got.split())})")


def main():
    sim = os.environ.get("SEMLB_SIM", "target/debug/semlb-sim")
    semlb = os.environ.get("SEMLB", "target/debug/semlb")
    procs = []
    try:
        for step in (resumed, not_resumed):
            try:
                step(sim, semlb, procs)
            except Exception:  # noqa: BLE001 (a failed step is a failed check)
                traceback.print_exc()
                check(False, f"{step.__name__} ran to its end")
    finally:
        for p in reversed(procs):
            simproc.stop_sim(p)
    failed = sum(1 for ok, _ in RESULTS if not ok)
    print(f"{len(RESULTS) - failed} passed, {failed} failed", flush=True)
    sys.exit(1 if failed or not RESULTS else 0)


if __name__ == "__main__":
    main()
