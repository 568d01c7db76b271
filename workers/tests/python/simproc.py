"""The simulator as a process, for the Python client tests
(`test_openai_client.py`, `test_anthropic_client.py`,
`test_resume_gateway.py`): started on a free
loopback port with its address read from its first stdout line, its output
drained, stopped with SIGTERM; and the tests' `check`.
"""

import re
import select
import signal
import subprocess
import threading
import time

STARTUP_TIMEOUT_S = 60.0
SHUTDOWN_TIMEOUT_S = 15.0
LISTEN_LINE = re.compile(r"^semlb-sim listening on (http://\S+)\s*$")


def start_sim(binary, extra=(), time_scale="0.001"):
    """Starts the simulator at `time_scale` with `extra` flags; returns
    (process, base URL of the API)."""
    cmd = [binary, "--listen", "127.0.0.1:0", "--time-scale", time_scale, *extra]
    print("starting: " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    line = ""
    while not line.endswith("\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            stop_sim(proc)
            raise RuntimeError(f"no listening line within {STARTUP_TIMEOUT_S:.0f} s (got {line!r})")
        ready, _, _ = select.select([proc.stdout], [], [], remaining)
        if not ready:
            continue
        chunk = proc.stdout.readline()
        if chunk == "":
            code = proc.wait()
            raise RuntimeError(f"semlb-sim exited with {code} before listening (stdout {line!r})")
        line += chunk
    match = LISTEN_LINE.match(line)
    if not match:
        stop_sim(proc)
        raise RuntimeError(f"unexpected first stdout line {line!r}")

    # Keep draining stdout so that the simulator never blocks on a full pipe.
    def drain():
        for rest in proc.stdout:
            print("  [sim] " + rest.rstrip("\n"), flush=True)

    threading.Thread(target=drain, daemon=True).start()
    return proc, match.group(1).rstrip("/")


def stop_sim(proc):
    """SIGTERM, then wait; SIGKILL if it does not exit in time. Returns the exit code or None."""
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=SHUTDOWN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def check(cond, what):
    if not cond:
        raise AssertionError(what)
