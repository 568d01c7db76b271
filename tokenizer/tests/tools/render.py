"""The reference renderings of tokenizer/tests/tools/cases.json: each case
rendered with each template by Python's jinja2, set up as `transformers`
renders chat templates (ImmutableSandboxedEnvironment, trim_blocks,
lstrip_blocks, the loopcontrols extension, its `tojson` =
json.dumps(ensure_ascii=False, ...), raise_exception, strftime_now), given
what vLLM gives a template: `tools` as model_dump()s, tool call arguments
parsed with json.loads, add_generation_prompt=True.

    python3 render.py [--shared DIR] > expected.json     # write
    python3 render.py --check expected.json [--shared DIR] # compare

Templates read from shared/data (Qwen3's) are rendered when the directory
is there; their entries are kept, and checked, only then.
"""
import argparse, json, os, sys
from datetime import datetime
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.exceptions import TemplateError

HERE = os.path.dirname(os.path.abspath(__file__))


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def raise_exception(message):
    raise TemplateError(message)


def environment():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda f: datetime.now().strftime(f)
    return env


def template_source(entry, shared):
    if "file" in entry:
        with open(os.path.join(HERE, "..", "templates", entry["file"]), encoding="utf-8") as f:
            return entry["file"], f.read(), entry
    path = os.path.join(shared, entry["shared"])
    if not os.path.isfile(path):
        return entry["shared"], None, entry
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    return entry["shared"], config["chat_template"], {**entry, "bos_token": config.get("bos_token"), "eos_token": config.get("eos_token")}


def renderings(shared):
    with open(os.path.join(HERE, "cases.json"), encoding="utf-8") as f:
        spec = json.load(f)
    env = environment()
    out = []
    for entry in spec["templates"]:
        name, source, entry = template_source(entry, shared)
        if source is None:
            print(f"SKIPPED: {name} is absent", file=sys.stderr)
            continue
        template = env.from_string(source)
        for case in spec["cases"]:
            if case.get("qwen_only") and "qwen" not in name:
                continue
            variables = {"messages": case["messages"], "add_generation_prompt": True}
            if case["tools"]:
                variables["tools"] = spec["tool_sets"][case["tools"]]
            for token in ("bos_token", "eos_token"):
                if entry.get(token):
                    variables[token] = entry[token]
            try:
                out.append({"template": name, "case": case["name"], "text": template.render(**variables)})
            except Exception as e:  # noqa: BLE001 (any failure of the template)
                # The template refuses the conversation: so must the gateway.
                out.append({"template": name, "case": case["name"], "error": str(e)})
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--check")
    parser.add_argument("--shared", default=os.environ.get("SEMLB_TOKENIZERS_DIR", os.path.join(HERE, "..", "..", "..", "..", "shared", "data", "tokenizers")))
    args = parser.parse_args()
    got = renderings(args.shared)
    if not args.check:
        json.dump(got, sys.stdout, ensure_ascii=False, indent=1)
        print()
        return
    with open(args.check, encoding="utf-8") as f:
        expected = {(e["template"], e["case"]): e for e in json.load(f)}
    bad = [(g["template"], g["case"]) for g in got if expected.get((g["template"], g["case"])) != g]
    for b in bad:
        print(f"differs: {b}", file=sys.stderr)
    print(f"{len(got) - len(bad)} of {len(got)} renderings match {args.check}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
