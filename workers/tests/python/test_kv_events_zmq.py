#!/usr/bin/env python3
"""semlb-sim's KV cache events read the way vLLM's own subscribers read them.

A real libzmq peer (pyzmq) subscribes to the simulator's PUB socket and asks
its ROUTER socket for a replay through a DEALER, as vLLM's example
subscriber and llm-d do; every payload is decoded by msgspec into vLLM's
event structs (restated in `vllm_kv_events.py` from `vllm/distributed/kv_events.py`,
the layout its main branch writes: maps tagged by "type"). So the simulator's
wire format and ZeroMQ framing are checked against the implementations
real engines and routers use, not against semlb's own decoder.

Starts the simulator itself (SEMLB_SIM, default target/debug/semlb-sim)
with `--kv-events-config`, reads the bound endpoints from its stdout,
sends completions over HTTP, and checks:

  * live batches come with sequence numbers 0, 1, 2, ... and decode;
  * each BlockStored carries block_size token ids per block hash, the
    first block of a prompt has no parent, and a later block's parent is
    the block before it;
  * a prompt sent twice stores nothing the second time (a cache hit);
  * a replay from 0 returns the same payloads, then the end marker;
  * /reset_prefix_cache publishes AllBlocksCleared.

Plain python3 with pyzmq and msgspec (CI installs them in target/pyenv):

    SEMLB_SIM=target/debug/semlb-sim target/pyenv/bin/python workers/tests/python/test_kv_events_zmq.py
"""

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request

import msgspec
import zmq

from vllm_kv_events import AllBlocksCleared, BlockStored, END_SEQ, KVEventBatch

BLOCK_SIZE = 16
START_LINE = re.compile(r"^semlb-sim kv events on (tcp://\S+) replay (tcp://\S+); listening on (http://\S+)\s*$")

DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def start_sim(binary):
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:0",
        "replay_endpoint": "tcp://127.0.0.1:0",
    }
    cmd = [binary, "--listen", "127.0.0.1:0", "--time-scale", "0.001", "--kv-events-config", json.dumps(config)]
    print("starting: " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    if not select.select([proc.stdout], [], [], 60)[0]:
        proc.kill()
        raise RuntimeError("semlb-sim did not say where it listens within 60 s")
    line = proc.stdout.readline()
    m = START_LINE.match(line)
    if m is None:
        proc.kill()
        raise RuntimeError(f"semlb-sim's first line names no KV event endpoints: {line!r}")
    return proc, m.group(3), (m.group(1), m.group(2))


def post(url, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST", headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read()


def completion(url, tokens):
    post(url, "/v1/completions", {"model": "semlb-sim", "prompt": tokens, "max_tokens": 2})


def receive(sub, timeout_ms=5000):
    if not sub.poll(timeout_ms):
        raise AssertionError("no KV event batch within %d ms" % timeout_ms)
    topic, seq, payload = sub.recv_multipart()
    return int.from_bytes(seq, "big"), payload


def main():
    binary = os.environ.get("SEMLB_SIM", "target/debug/semlb-sim")
    proc, url, (endpoint, replay_endpoint) = start_sim(binary)
    ctx = zmq.Context()
    failures = 0
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        time.sleep(0.3)  # a PUB socket drops what is sent before the subscription lands
        prompts = [list(range(1000 * i, 1000 * i + 3 * BLOCK_SIZE + 5)) for i in (1, 2, 3)]
        live = []
        for p in prompts:
            completion(url, p)
            live.append(receive(sub))
        completion(url, prompts[0])  # a hit: nothing new is stored
        post(url, "/reset_prefix_cache")
        cleared_seq, cleared = receive(sub)

        seqs = [s for s, _ in live] + [cleared_seq]
        assert seqs == list(range(len(seqs))), f"sequence numbers {seqs}"
        print("ok: sequence numbers 0..%d, no batch for the repeated prompt" % (len(seqs) - 1))

        for (seq, payload), prompt in zip(live, prompts):
            batch = DECODER.decode(payload)
            stored = [e for e in batch.events if isinstance(e, BlockStored)]
            assert stored, f"batch {seq} stored nothing: {batch}"
            first = stored[0]
            assert first.parent_block_hash is None, first
            assert first.block_size == BLOCK_SIZE
            assert len(first.token_ids) == BLOCK_SIZE * len(first.block_hashes), first
            assert first.token_ids == prompt[: len(first.token_ids)], "the stored tokens are the prompt's"
            assert first.kv_cache_spec_kind == "full_attention" and first.group_idx == 0
        print("ok: BlockStored carries the prompt's tokens, block_size per hash, no parent at the start")

        assert DECODER.decode(cleared).events == [AllBlocksCleared()]
        print("ok: /reset_prefix_cache published AllBlocksCleared")

        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            if not dealer.poll(5000):
                raise AssertionError("the replay did not end")
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                break
            replayed.append((int.from_bytes(seq, "big"), payload))
        assert replayed == live + [(cleared_seq, cleared)], "the replay is what was published"
        print("ok: a replay from 0 returns the %d batches, then the end marker" % len(replayed))
    except AssertionError as e:
        failures += 1
        print(f"FAILED: {e}")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
        ctx.destroy(linger=0)
    print("all checks passed" if failures == 0 else "a check failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
