#!/usr/bin/env python3
"""semlb's KV event subscriber against libzmq, the ZeroMQ that vLLM runs.

A publisher written with pyzmq plays the engine's side exactly as vLLM's
ZmqEventPublisher does it: a PUB socket sending [topic, seq (8 bytes,
big-endian), msgpack batch], a ROUTER socket answering replay requests
[identity, "", start] with [identity, "", seq, payload] per buffered batch
and [identity, "", -1, ""] at the end, batches encoded by msgspec from
vLLM's event structs (restated in `vllm_kv_events.py`). `semlb serve` follows it for a
simulated engine's backend (`kv_events`, `kv_events_replay`), so its own
ZMTP client (src/kv_events/zmtp.rs) is checked against libzmq's sockets,
not only against the simulator's.

Checks:
  * stored blocks are applied (semlb_kv_event_blocks_stored_total);
  * a batch the PUB socket never sent (seq 2, kept for replay) is fetched
    from the ROUTER when seq 3 shows the gap
    (semlb_kv_event_gaps_replayed_total), and its blocks route a request
    by prefix (x-semlb-route: prefix);
  * removed blocks are removed (semlb_kv_event_blocks_removed_total).

Run (pyzmq and msgspec in the venv CI makes):

    SEMLB=target/debug/semlb target/pyenv/bin/python workers/tests/python/test_kv_events_gateway.py
"""

import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import msgspec
import zmq

from vllm_kv_events import END_SEQ, BlockRemoved, BlockStored, EventBatch

BLOCK = 16
ENCODER = msgspec.msgpack.Encoder()


def start(cmd, what):
    """Starts `cmd`; returns (process, the http address of its first line)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    if not select.select([proc.stdout], [], [], 120)[0]:
        proc.kill()
        raise RuntimeError(f"{what} printed nothing within 120 s")
    line = proc.stdout.readline()
    m = re.search(r"http://(\S+)\s*$", line)
    if m is None:
        proc.kill()
        raise RuntimeError(f"{what}: no address in {line!r}")
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return proc, m.group(1)


def get(addr, path):
    with urllib.request.urlopen(f"http://{addr}{path}", timeout=10) as r:
        return r.read().decode()


def metric(addr, name):
    for line in get(addr, "/metrics").splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def wait(what, probe, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Publisher:
    """vLLM's publisher protocol on libzmq sockets."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer = []
        self.lock = threading.Lock()
        self.replays = 0
        self.running = True
        self.thread = threading.Thread(target=self.serve_replays, daemon=True)
        self.thread.start()

    def serve_replays(self):
        while self.running:
            if not self.router.poll(50):
                continue
            client, empty, start = self.router.recv_multipart()
            start = int.from_bytes(start, "big")
            with self.lock:
                self.replays += 1
                batches = [(s, p) for s, p in self.buffer if s >= start]
            for seq, payload in batches:
                self.router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([client, b"", END_SEQ, b""])

    def publish(self, seq, events, send=True):
        payload = ENCODER.encode(EventBatch(ts=time.time(), events=events))
        with self.lock:
            self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    def close(self):
        self.running = False
        self.thread.join()
        self.ctx.destroy(linger=0)


def stored(hashes, parent, tokens):
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BLOCK,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


def main():
    semlb = os.environ.get("SEMLB", "target/debug/semlb")
    sim, sim_addr = start([semlb, "__sim", "--listen", "127.0.0.1:0", "--time-scale", "0.01"], "semlb __sim")
    publisher = Publisher()
    tmp = tempfile.mkdtemp(prefix="semlb-kv-")
    config = os.path.join(tmp, "semlb.toml")
    with open(config, "w") as f:
        f.write(
            f'[[backend]]\nurl = "http://{sim_addr}"\n'
            f'kv_events = "tcp://127.0.0.1:{publisher.pub_port}"\n'
            f'kv_events_replay = "tcp://127.0.0.1:{publisher.router_port}"\n'
            '[policy.prefix]\nsource = "precise"\n'
        )
    shm = f"semlb-kvpy-{os.getpid()}"
    gw, gw_addr = start(
        [semlb, "serve", "--config", config, "--listen", "127.0.0.1:0", "--shm-name", shm,
         "--shm-size", "64MiB", "--dispatchers", "1"],
        "semlb serve",
    )
    failed = False
    try:
        wait("the gateway's health", lambda: get(gw_addr, "/health") is not None)
        # The subscriber asks a replay from 0 once it is connected.
        wait("the subscriber's first replay request", lambda: publisher.replays >= 1)
        tokens = list(range(5000, 5000 + 6 * BLOCK))
        publisher.publish(0, [stored([11, 12, 13, 14], None, tokens[: 4 * BLOCK])])
        publisher.publish(1, [stored([15, 16], 14, tokens[4 * BLOCK :])])
        other = list(range(9000, 9000 + 3 * BLOCK + 5))
        publisher.publish(2, [stored([21, 22, 23], None, other[: 3 * BLOCK])], send=False)
        publisher.publish(3, [BlockRemoved(block_hashes=[15, 16], medium="GPU", group_idx=0)])
        wait("9 blocks stored, 2 removed", lambda: metric(gw_addr, "semlb_kv_event_blocks_stored_total") == 9
             and metric(gw_addr, "semlb_kv_event_blocks_removed_total") == 2)
        print("ok: libzmq batches applied (9 blocks stored, 2 removed)")
        assert metric(gw_addr, "semlb_kv_event_gaps_replayed_total") >= 1, "the gap was not filled by a replay"
        print("ok: the batch the PUB socket never sent came from the ROUTER's replay")
        body = json.dumps({"model": "semlb-sim", "prompt": other, "max_tokens": 2}).encode()
        req = urllib.request.Request(f"http://{gw_addr}/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            route = r.headers.get("x-semlb-route")
        assert route == "prefix", f"the replayed blocks did not route the prompt (route {route!r})"
        print("ok: the replayed blocks route a request by prefix")
    except AssertionError as e:
        failed = True
        print(f"FAILED: {e}")
    finally:
        gw.send_signal(signal.SIGTERM)
        gw.wait(timeout=30)
        sim.send_signal(signal.SIGTERM)
        sim.wait(timeout=15)
        publisher.close()
        subprocess.run([semlb, "shm", "remove", "--shm-name", shm], capture_output=True)
    print("a check failed" if failed else "all checks passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
