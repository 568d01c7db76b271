#!/usr/bin/env python3
"""An outside check of semlb's tokenizer: `semlb tokenize` against the Python
`tokenizers` package (PyPI), on the same tokenizer.json.

The interface checked (the gateway's `semlb tokenize` command):

    semlb tokenize --tokenizer FILE --jsonl

reads one JSON string per line on stdin and writes, for each, one JSON object
per line on stdout with at least `{"ids": [...]}` (other fields are allowed
and ignored). The ids must be `Tokenizer.from_file(FILE).encode(text,
add_special_tokens=False).ids`.

Corpus: `--corpus FILE` (JSON Lines: a string, or an object with `text` and
optionally `source`, per line; the Rust test
`export_corpus_for_the_python_checker` writes the full conformance corpus in
this form), else a built-in corpus of generated edge cases, plus the HH-RLHF
dialogues and Mooncake trace lines when `--data DIR` (default: shared/data
next to the repository) has them.

Lines alternate between raw UTF-8 JSON and ASCII-only JSON (`\\uXXXX`
escapes, surrogate pairs for astral characters), so both are exercised.

With `--engine URL` the reference is a running llama.cpp `llama-server`
instead (no Python `tokenizers` needed): its `/tokenize` for each string, and
for chat bodies built from the corpus (`{"messages": [...]}`, one JSON object
per line to `semlb tokenize`) its `/apply-template` then `/tokenize`. Give
`--tokenizer` the GGUF file the engine serves: the check is then that the
gateway computes the engine's own ids, chat template included. A string
with an unassigned code point (Unicode category Cn) may differ without
failing the check: llama.cpp's pre-tokenizer cuts runs of them where HF's
regex, which semlb reproduces, does not; such strings are counted apart.

Exit status: 0 when every string's ids are equal, 1 on any mismatch, 2 when
`semlb tokenize` misbehaves (exits non-zero, writes the wrong number of
lines, or writes something that is not a JSON object with `ids`). The last
line is always `N strings, M mismatches`.

Usage:

    python3 -m venv target/pyenv && target/pyenv/bin/pip install tokenizers
    target/pyenv/bin/python tokenizer/tests/python/check_tokenize.py \\
        --semlb target/debug/semlb --tokenizer tokenizer/assets/phi2-tokenizer.json

    python3 tokenizer/tests/python/check_tokenize.py --semlb target/debug/semlb \\
        --tokenizer target/llama-cpp/SmolLM2-135M-Instruct.Q4_1.gguf --engine http://127.0.0.1:8081
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import threading
import unicodedata
import urllib.request
from collections import Counter, OrderedDict
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

QWEN3_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
]
FRAGMENTS = ["<|", "|>", "<|im_start", "im_start|>", "|im_start|>", "<|endoftext", "<think", "</",
             "<|im_start|><|im_end|>", "foo<|endoftext|>bar", "<|IM_START|>", "<|begin_of_text|>"]
WHITESPACE = [" ", "\t", "\n", "\r", "\x0b", "\x0c", "\x85", "\xa0", "\u1680", "\u2000", "\u2003",
              "\u2009", "\u200a", "\u2028", "\u2029", "\u202f", "\u205f", "\u3000", "\u200b", "\ufeff"]
EMOJI = ["😀", "👍", "👍🏽", "👨\u200d👩\u200d👧\u200d👦", "👩🏽\u200d💻", "🏳️\u200d🌈", "🇫🇷", "🇺🇸🇬🇧",
         "🏴\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f", "☺︎", "☺️", "1️⃣", "\u200d",
         "\ufe0f", "\U0001f3fb"]
COMBINING = ["e\u0301", "a\u0323\u0301", "a\u0301\u0323", "\u1100\u1161\u11a8", "\u212b", "\u2126",
             "Vie\u0323\u0302t", "\u0301", " \u0301", "\u0958", "\uf900", "\ufb01", "i\u0307", "\u0130"]
SCRIPTS = ["负载均衡器把请求发送到缓存命中率最高的服务器。", "東京の天気は晴れです。",
           "서울의 날씨는 맑습니다.", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "สวัสดีครับ",
           "Καλημέρα κόσμε", "Привет, мир!", "Xin chào thế giới", "Straße ẞ ß", "İstanbul ığdır"]
UNUSUAL = ["\ufffd", "\ufffe", "\uffff", "\ufdd0", "\U0010ffff", "\U0010fffd", "\ue000", "\ud7ff",
           "\ufeff", "\u200b", "\u200c", "\u200d", "\x00", "\x01", "\x7f", "\x80", "\x9f", "\u202e"]
CONTRACTIONS = ["'s", "'S", "'ſ", "'t", "'re", "'Re", "'RE", "'ve", "'m", "'ll", "'LL", "'d", "’s", "''s"]


def builtin_corpus(seed: int = 2026) -> "OrderedDict[str, list[str]]":
    """Generated edge cases (a smaller cousin of tests/support/corpus.rs)."""
    rng = random.Random(seed)
    out: "OrderedDict[str, list[str]]" = OrderedDict()
    out["gen:empty"] = [""]
    runs = []
    for unit in WHITESPACE + [" \t", "\t ", " \xa0", "\r\n", " \n", "\n\r"]:
        for n in list(range(1, 36)) + [62, 63, 64, 70]:
            run = (unit * n)[:n]
            for before, after in [("", ""), ("a", "b"), ("", "x"), ("x", "\n"), ("1", "2"), ("", "<|endoftext|>")]:
                runs.append(before + run + after)
    out["gen:whitespace"] = runs
    alphabet = ["\r", "\n", " ", "\t", "a", "\xa0"]
    strings = [""]
    nl = []
    for _ in range(5):
        strings = [s + c for s in strings for c in alphabet]
        nl.extend(strings)
    out["gen:newlines"] = nl
    out["gen:contractions"] = [w + c + t for w in ["it", "IT", "we", "", " "] for c in CONTRACTIONS
                               for t in ["", " ", "s", "."]]
    out["gen:emoji"] = [b + e * n + a for e in EMOJI for n in (1, 2, 5)
                        for b, a in [("", ""), ("ok", ""), (" ", " "), ("2", "3")]]
    out["gen:combining"] = [b + c + a for c in COMBINING for b, a in [("", ""), ("caf", ""), (" ", ""), ("<|im_start|>", "")]]
    out["gen:scripts"] = SCRIPTS + [" " + s for s in SCRIPTS] + [w for s in SCRIPTS for w in s.split(" ")]
    nums = []
    zeros = [0x30, 0x660, 0x6F0, 0x966, 0xFF10, 0x1D7CE]
    for n in range(1, 41):
        for _ in range(3):
            d = "".join(rng.choice("0123456789") for _ in range(n))
            nums += [d, " " + d, "-" + d + ".5", d + "e-7", "x" + d + "y", f"{int(d):,}"]
            nums += ["".join(chr(z + int(c)) for c in d) for z in zeros]
    nums += ["ⅠⅡⅢⅫ", "①②③", "½ ⅓ ¾", "x² + y³", "H₂O", "٣.١٤"]
    out["gen:numbers"] = nums
    out["gen:specials"] = [p + s + q for s in QWEN3_SPECIALS + FRAGMENTS
                           for p in ["", " ", "\n", "a", "  "] for q in ["", " ", "\n", "a", "\u0301"]]
    out["gen:unusual"] = [b + c + a for c in UNUSUAL for b, a in [("", ""), ("a", "b"), (" ", " "), ("'", "s")]]
    out["gen:long"] = ["a" * 10_000, "".join(rng.choice("0123456789") for _ in range(5_000)), " " * 5_000,
                       "\n" * 2_000, "👍" * 1_000, "a" + "\u0301" * 2_000,
                       "".join(rng.choice(SCRIPTS + EMOJI + [" ", "\n"]) for _ in range(3_000))]
    pieces = (WHITESPACE + EMOJI + COMBINING + SCRIPTS + UNUSUAL + CONTRACTIONS + QWEN3_SPECIALS + FRAGMENTS
              + ["the", " the", "Hello", ",", ".", "!", "123", "x = 1;", "\t\t", "    "])
    mixes = []
    for _ in range(8_000):
        if rng.random() < 0.7:
            mixes.append("".join(rng.choice(pieces) for _ in range(rng.randint(1, 15))))
        else:
            chars = []
            for _ in range(rng.randint(1, 60)):
                c = rng.randint(0, 0x10FFFF)
                if 0xD800 <= c <= 0xDFFF:
                    c = 0xFFFD
                chars.append(chr(c) if rng.random() < 0.3 else chr(rng.randint(0x20, 0x7E)))
            mixes.append("".join(chars))
    out["gen:random-mixes"] = mixes
    return out


def shared_corpus(data: Path) -> "OrderedDict[str, list[str]]":
    out: "OrderedDict[str, list[str]]" = OrderedDict()
    hh = data / "prompts" / "hh-rlhf-helpful-base-test.jsonl"
    if hh.is_file():
        dialogues, lines = [], []
        for line in hh.read_text(encoding="utf-8").splitlines():
            obj = json.loads(line)
            for key in ("chosen", "rejected"):
                if isinstance(obj.get(key), str):
                    dialogues.append(obj[key])
                    lines.extend(l for l in obj[key].split("\n") if l)
        out["hh-rlhf:dialogues"] = dialogues
        out["hh-rlhf:lines"] = lines
    else:
        print(f"SKIPPED: {hh} is absent; HH-RLHF strings left out")
    trace = data / "traces" / "conversation_trace.jsonl"
    if trace.is_file():
        out["mooncake:json-lines"] = trace.read_text(encoding="utf-8").splitlines()
    else:
        print(f"SKIPPED: {trace} is absent; Mooncake lines left out")
    return out


def read_corpus(path: Path) -> "OrderedDict[str, list[str]]":
    out: "OrderedDict[str, list[str]]" = OrderedDict()
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            value = json.loads(line)
            if isinstance(value, str):
                source, text = "corpus", value
            elif isinstance(value, dict) and isinstance(value.get("text"), str):
                source, text = str(value.get("source", "corpus")), value["text"]
            else:
                sys.exit(f"{path}:{n}: neither a JSON string nor an object with a string `text`")
            out.setdefault(source, []).append(text)
    return out


def deduplicated(sources: "OrderedDict[str, list[str]]") -> "list[tuple[str, str]]":
    seen: set[str] = set()
    items = []
    for source, texts in sources.items():
        for text in texts:
            if text not in seen:
                seen.add(text)
                items.append((source, text))
    return items


class ProtocolError(Exception):
    """`semlb tokenize` did not keep to its interface."""


def run_semlb(command: "list[str]", texts: "list[str]") -> "list[list[int]]":
    """Feeds `texts` to `semlb tokenize` (one JSON string per line) and reads
    one `{"ids": [...]}` per line back. Writes from a thread so neither pipe
    can fill up and block."""
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    write_error: list[BaseException] = []

    def write() -> None:
        try:
            assert proc.stdin is not None
            for i, text in enumerate(texts):
                # Alternate raw UTF-8 and \\u-escaped JSON.
                line = json.dumps(text, ensure_ascii=(i % 2 == 1)) + "\n"
                proc.stdin.write(line.encode("utf-8"))
            proc.stdin.close()
        except BrokenPipeError as e:  # the command exited early; reported below
            write_error.append(e)

    stderr_chunks: list[bytes] = []
    writer = threading.Thread(target=write, daemon=True)
    reader = threading.Thread(target=lambda: stderr_chunks.append(proc.stderr.read()), daemon=True)  # type: ignore[union-attr]
    writer.start()
    reader.start()
    results: list[list[int]] = []
    assert proc.stdout is not None
    for n, raw in enumerate(proc.stdout, 1):
        try:
            obj = json.loads(raw)
        except ValueError as e:
            proc.kill()
            raise ProtocolError(f"output line {n} is not JSON ({e}): {raw[:200]!r}") from None
        ids = obj.get("ids") if isinstance(obj, dict) else None
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            proc.kill()
            raise ProtocolError(f"output line {n} has no list of integer `ids`: {raw[:200]!r}")
        results.append(ids)
    status = proc.wait()
    writer.join()
    reader.join()
    stderr = b"".join(stderr_chunks).decode("utf-8", "replace").strip()
    if status != 0:
        raise ProtocolError(f"{shlex.join(command)} exited with status {status}: {stderr[-2000:]}")
    if write_error:
        raise ProtocolError(f"{shlex.join(command)} stopped reading its input: {write_error[0]}")
    if len(results) != len(texts):
        raise ProtocolError(f"{len(texts)} strings in, {len(results)} lines out")
    return results


def first_difference(a: "list[int]", b: "list[int]") -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def excerpt(ids: "list[int]", pos: int, width: int = 24) -> str:
    if len(ids) <= width:
        return f"{ids} ({len(ids)} ids)"
    start = max(0, min(pos - width // 2, len(ids) - width))
    return f"...{ids[start:start + width]}... (ids {start}..{start + width} of {len(ids)})"


def text_excerpt(text: str, at: int, width: int = 240) -> str:
    if len(text) <= width:
        return repr(text)
    start = max(0, at - width // 2)
    return f"...{text[start:start + width]!r}... (chars {start}..{start + width} of {len(text)})"


def engine_post(url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.load(r)


def chat_bodies(texts: "list[str]", seed: int = 2027) -> "list[dict]":
    """Conversations of 1 to 4 turns, with and without a system message,
    their contents drawn from `texts`."""
    rng = random.Random(seed)
    pool = [t for t in texts if 0 < len(t) < 2_000]
    bodies = []
    for n in range(300):
        messages = []
        if n % 3:
            messages.append({"role": "system", "content": rng.choice(pool)})
        for turn in range(rng.randint(1, 4)):
            if turn:
                messages.append({"role": "assistant", "content": rng.choice(pool)})
            messages.append({"role": "user", "content": rng.choice(pool)})
        bodies.append({"model": "m", "messages": messages})
    return bodies


def check_against_engine(args: argparse.Namespace) -> int:
    """`semlb tokenize` against a llama.cpp server (`--engine`)."""
    from concurrent.futures import ThreadPoolExecutor

    sources = read_corpus(args.corpus) if args.corpus else OrderedDict(
        list(builtin_corpus().items()) + list(shared_corpus(args.data).items()))
    items = deduplicated(sources)
    texts = [t for _, t in items]
    bodies = chat_bodies(texts)
    props = engine_post(args.engine, "/tokenize", {"content": ""})  # reachable?
    del props
    print(f"engine {args.engine}, {args.tokenizer}: {len(texts)} strings, {len(bodies)} chat bodies")

    def tokenize(text: str) -> "list[int]":
        return engine_post(args.engine, "/tokenize", {"content": text})["tokens"]

    def render(body: dict) -> "list[int]":
        prompt = engine_post(args.engine, "/apply-template", {"messages": body["messages"]})["prompt"]
        return tokenize(prompt)

    with ThreadPoolExecutor(4) as pool:
        expected = list(pool.map(tokenize, texts)) + list(pool.map(render, bodies))
    command = shlex.split(args.semlb) + ["tokenize", "--tokenizer", str(args.tokenizer), "--jsonl"]
    try:
        ours = run_semlb(command, texts + bodies)  # type: ignore[operator]
    except (ProtocolError, OSError) as e:
        print(f"error: {e}")
        print(f"{len(texts) + len(bodies)} strings, {len(texts) + len(bodies)} mismatches (semlb tokenize failed)")
        return 2
    labelled = items + [("chat:bodies", json.dumps(b, ensure_ascii=False)) for b in bodies]

    def detail(text: str, got: "list[int]", want: "list[int]", pos: int) -> None:
        print(f"text:      {text_excerpt(text, 0)}")
        print(f"first difference at id #{pos}")
        print(f"semlb:     {excerpt(got, pos)}")
        print(f"engine:    {excerpt(want, pos)}")

    # llama.cpp's pre-tokenizer cuts runs of unassigned code points where
    # HF's regex (and semlb, which matches HF) does not.
    def unassigned(text: str) -> bool:
        return any(unicodedata.category(c) == "Cn" for c in text)

    return compare(labelled, ours, expected, args.show, detail, ("with unassigned code points", unassigned))


def compare(items: "list[tuple[str, str]]", ours: "list[list[int]]", expected: "list[list[int]]", show: int,
            detail, known: "tuple[str, object] | None" = None) -> int:
    """Counts (per source) and prints the strings whose ids differ; returns
    the exit status. `detail(text, got, want, pos)` prints a shown
    mismatch; `known` = (label, predicate): differences whose text the
    predicate accepts are known, counted apart and not failed on."""
    per_source: "OrderedDict[str, Counter]" = OrderedDict()
    shown = mismatches = known_count = 0
    for (source, text), got, want in zip(items, ours, expected):
        count = per_source.setdefault(source, Counter())
        count["strings"] += 1
        count["ids"] += len(want)
        if got == want:
            continue
        if known is not None and known[1](text):  # type: ignore[operator]
            known_count += 1
            count["known"] += 1
            continue
        mismatches += 1
        count["mismatches"] += 1
        if shown < show:
            shown += 1
            print(f"--- mismatch {shown} ({source}) ---")
            detail(text, got, want, first_difference(got, want))
    for source, count in per_source.items():
        line = f"  {source:<28} {count['strings']:>7} strings {count['ids']:>9} ids {count['mismatches']:>5} mismatches"
        print(line + (f" {count['known']:>3} {known[0]}" if known else ""))
    summary = f"{len(items)} strings, {mismatches} mismatches"
    print(summary + (f", {known_count} known differences {known[0]} (not counted)" if known else ""))
    return 1 if mismatches else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True, type=Path, help="the tokenizer.json both sides load")
    parser.add_argument("--semlb", default=os.environ.get("SEMLB_BIN", str(REPO / "target" / "debug" / "semlb")),
                        help="the semlb binary, or a command line (default: $SEMLB_BIN or target/debug/semlb)")
    parser.add_argument("--corpus", type=Path, help="JSON Lines corpus (strings or {source, text} objects)")
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data",
                        help="data folder with prompts/ and traces/ for the built-in corpus")
    parser.add_argument("--show", type=int, default=5, help="mismatches shown in full")
    parser.add_argument("--engine", help="a llama.cpp server's URL: the reference (see above)")
    args = parser.parse_args()
    if args.engine:
        return check_against_engine(args)

    from tokenizers import Tokenizer  # PyPI `tokenizers`

    sources = read_corpus(args.corpus) if args.corpus else OrderedDict(
        list(builtin_corpus().items()) + list(shared_corpus(args.data).items()))
    items = deduplicated(sources)
    texts = [t for _, t in items]
    reference = Tokenizer.from_file(str(args.tokenizer))
    print(f"tokenizers {__import__('tokenizers').__version__}, {args.tokenizer}: {len(texts)} strings")

    command = shlex.split(args.semlb) + ["tokenize", "--tokenizer", str(args.tokenizer), "--jsonl"]
    try:
        ours = run_semlb(command, texts)
    except (ProtocolError, OSError) as e:
        print(f"error: {e}")
        print(f"{len(texts)} strings, {len(texts)} mismatches (semlb tokenize failed)")
        return 2

    expected: list[list[int]] = []
    for start in range(0, len(texts), 2048):
        expected.extend(e.ids for e in reference.encode_batch(texts[start:start + 2048], add_special_tokens=False))

    def detail(text: str, got: "list[int]", want: "list[int]", pos: int) -> None:
        offsets = reference.encode(text, add_special_tokens=False).offsets
        at = offsets[pos][0] if pos < len(offsets) else len(text)
        print(f"text:      {text_excerpt(text, at)}")
        print(f"first difference at id #{pos}")
        print(f"semlb:     {excerpt(got, pos)}")
        print(f"reference: {excerpt(want, pos)}")
        print(f"tokens from there: semlb {[reference.id_to_token(i) for i in got[pos:pos + 4]]}, "
              f"reference {[reference.id_to_token(i) for i in want[pos:pos + 4]]}")

    return compare(items, ours, expected, args.show, detail)


if __name__ == "__main__":
    sys.exit(main())
