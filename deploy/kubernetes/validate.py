#!/usr/bin/env python3
"""Renders the Kubernetes manifests and checks them, offline.

For each way of running semlb (the kustomize overlays `standalone` and
`epp` beside this file):

1. `kubectl kustomize` renders it (kubectl is required: without it this
   fails, it does not skip).
2. Every object of a kind Kubernetes itself defines is validated against
   that version's OpenAPI schema in strict mode (an unknown field is an
   error) by PyPI's `kubernetes-validate`, with the schemas it bundles (no
   API server, no network): the version is kubectl's own (v1.32 on CI's
   machine) unless `--kubernetes-version` says otherwise.
3. The kinds it has no schema for are checked here field by field as their
   specifications define them: `InferencePool`
   (inference.networking.k8s.io/v1, the Gateway API Inference Extension's
   api/v1/inferencepool_types.go and its CRD) and `HTTPRoute`
   (gateway.networking.k8s.io/v1). An object of any other kind without a
   schema is an error.
4. What no schema can see is checked across objects: the Service and the
   PodDisruptionBudget select the Deployment's pods; the Service's target
   port and every probe's port are container ports; the probes' HTTP paths
   are routes of semlb's HTTP front (src/dispatcher/endpoints.rs); the
   container ports are the configuration's listen addresses; the memory-backed
   /dev/shm holds the configured segment (its sizeLimit at least shm_size,
   the memory limit above both); the grace period covers the preStop sleep,
   drain_timeout_secs and the 2 s before stragglers are killed; the
   ConfigMap's semlb.toml parses (tomllib) and uses only keys of
   docs/reference/configuration.md, and the flags in args are flags of
   docs/reference/cli.md; the RBAC lets the ServiceAccount read what
   discovery watches; the security context keeps the systemd unit's
   hardening; the InferencePool's endpointPickerRef names the EPP Service
   and its port, the HTTPRoute's backendRef names the pool.

Every problem is reported, not only the first; the exit status is 1 when
there is one, 2 when the check could not run (no kubectl, no schemas for
the version). .ci/run runs this in its step "Kubernetes manifests".

    target/pyenv/bin/python deploy/kubernetes/validate.py
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import kubernetes_validate
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, ValidationError, VersionNotSupportedError

# Each validation reads its kind's schema and the version's definitions
# (megabytes of JSON) from the package's files again; read each once.
kubernetes_validate.utils.schema_contents = functools.lru_cache(maxsize=None)(
    kubernetes_validate.utils.schema_contents)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

# The ways of running semlb, and what each must contain and configure.
OVERLAYS = {
    "standalone": {
        "kinds": {"ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service", "Deployment",
                  "PodDisruptionBudget"},
        "discovery_kind": "kubernetes",
        "epp": False,
    },
    "epp": {
        "kinds": {"ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service", "Deployment",
                  "PodDisruptionBudget", "InferencePool", "HTTPRoute"},
        "discovery_kind": "inference-pool",
        "epp": True,
    },
}

# Configuration keys and flags of issue 42 (Kubernetes discovery, the
# endpoint picker) not yet in the references ([discovery] is). A key is accepted
# while docs/reference/configuration.md documents nothing of its table
# ([discovery], [epp]); once it does, the reference alone decides. The
# flags are accepted beside docs/reference/cli.md's (drop them here once
# it lists them).
PENDING_KEYS: dict = {}
PENDING_FLAGS: set = set()
DISCOVERY_KINDS = {"kubernetes", "inference-pool", "file"}

# What discovery reads from the API server: (API group, resource).
DISCOVERY_READS = [("", "pods"), ("discovery.k8s.io", "endpointslices"),
                   ("inference.networking.k8s.io", "inferencepools")]
READ_VERBS = {"get", "list", "watch"}

# The supervisor kills the requests still running this long after
# drain_timeout_secs (docs/architecture/processes.md).
KILL_AFTER_DRAIN_SECS = 2

DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
GATEWAY_DURATION = re.compile(r"^([0-9]{1,5}(h|m|s|ms)){1,4}$")


class Problems:
    """The problems found, each prefixed with where it was found."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, where: str, what: str) -> None:
        self.items.append(f"{where}: {what}")


# ---------------------------------------------------------------- sizes


def semlb_size(value) -> int:
    """A size as semlb's configuration reads it (src/config/size.rs): an
    integer number of bytes, or a number with K/KiB.. (binary) or KB..
    (decimal), case-insensitively."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    if not m:
        raise ValueError(f"not a size: {value!r}")
    number, unit = float(m.group(1)), m.group(2).lower()
    units = {"": 1, "b": 1}
    for i, p in enumerate("kmgt", start=1):
        units[p] = units[p + "ib"] = 1024**i
        units[p + "b"] = 1000**i
    if unit not in units:
        raise ValueError(f"unknown unit in {value!r}")
    return int(number * units[unit])


def quantity(value) -> float:
    """A Kubernetes resource quantity (`288Mi`, `1G`, `512e6`), in bytes."""
    m = re.fullmatch(r"([+-]?[0-9.]+)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m|[eE][+-]?[0-9]+)?", str(value))
    if not m:
        raise ValueError(f"not a quantity: {value!r}")
    number, suffix = float(m.group(1)), m.group(2) or ""
    binary = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
    decimal = {"k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18, "m": -3}
    if suffix in binary:
        return number * 1024 ** binary[suffix]
    if suffix in decimal:
        return number * 10 ** decimal[suffix]
    if suffix:
        return number * 10 ** int(suffix[1:])
    return number


def port_of(address: str) -> int:
    return int(str(address).rsplit(":", 1)[1])


# --------------------------------------------------- what the repo says


def documented_keys() -> set[str]:
    """Every key of docs/reference/configuration.md's tables: a row whose
    first cell is one code span (the rule tests/docs_book.rs checks that
    page against the configuration's Deserialize implementation by)."""
    keys = set()
    for line in (ROOT / "docs/reference/configuration.md").read_text().splitlines():
        m = re.match(r"^\| `([^` ]+)` \|", line)
        if m:
            keys.add(m.group(1))
    return keys


def documented_default(key: str) -> str:
    """The default cell of a key's row in docs/reference/configuration.md."""
    for line in (ROOT / "docs/reference/configuration.md").read_text().splitlines():
        if line.startswith(f"| `{key}` |"):
            return line.split("|")[3].strip().strip("`").strip('"')
    raise SystemExit(f"docs/reference/configuration.md has no row for {key}")


def documented_serve_flags() -> set[str]:
    """The flags of `semlb serve` in docs/reference/cli.md (checked against
    the binary's --help by tests/docs_book.rs)."""
    flags, inside = set(), False
    for line in (ROOT / "docs/reference/cli.md").read_text().splitlines():
        if line.startswith("#"):
            inside = line.strip() == "## `semlb serve`"
        elif inside:
            m = re.match(r"^\| `(--[a-z0-9-]+)", line)
            if m:
                flags.add(m.group(1))
    return flags


def http_routes() -> set[str]:
    """The paths the dispatchers' HTTP front routes (the `allowed` match of
    src/dispatcher/endpoints.rs)."""
    source = (ROOT / "src/dispatcher/endpoints.rs").read_text()
    m = re.search(r"let allowed = match path\.as_str\(\) \{(.*?)\n    \};", source, re.S)
    if not m:
        raise SystemExit("src/dispatcher/endpoints.rs: the route match (`let allowed = match ...`) was not found")
    return set(re.findall(r'"(/[^"]*)"', m.group(1)))


# ------------------------------------------------------ the config file


def flatten(table: dict, prefix: str = ""):
    """(dotted key, value) of every key and table of a TOML document; an
    array of tables counts as its table ([[backend]] -> backend.url)."""
    for key, value in table.items():
        path = f"{prefix}{key}"
        yield path, value
        if isinstance(value, dict):
            yield from flatten(value, path + ".")
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for item in value:
                yield from flatten(item, path + ".")


def check_config(where: str, text: str, known: set[str], problems: Problems) -> dict | None:
    try:
        config = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        problems.add(where, f"semlb.toml does not parse: {e}")
        return None
    for key, _ in flatten(config):
        # A [model.policy] table is a whole [policy] table (documented once).
        lookup = key[len("model."):] if key.startswith("model.policy") else key
        if lookup in known:
            continue
        table = lookup.split(".")[0]
        pending = PENDING_KEYS.get(table, set())
        if lookup in pending and not any(k == table or k.startswith(table + ".") for k in known):
            continue
        problems.add(where, f"semlb.toml: unknown key {key} (not in docs/reference/configuration.md)")
    discovery = config.get("discovery", {})
    kind = discovery.get("kind")
    if kind not in DISCOVERY_KINDS:
        problems.add(where, f"semlb.toml: discovery.kind is {kind!r}, not one of {sorted(DISCOVERY_KINDS)}")
    required = {"kubernetes": ["selector"], "inference-pool": ["inference_pool"], "file": ["path"]}
    for key in required.get(kind, []):
        if key not in discovery:
            problems.add(where, f"semlb.toml: discovery.kind = {kind!r} needs discovery.{key}")
    if kind == "kubernetes" and "port" not in discovery and "port_name" not in discovery:
        problems.add(where, "semlb.toml: discovery.kind = 'kubernetes' needs discovery.port or port_name")
    selector = discovery.get("selector")
    if selector is not None:
        for term in str(selector).split(","):
            if not re.fullmatch(r"\s*[A-Za-z0-9./_-]+\s*(==?|!=)\s*[A-Za-z0-9._-]*\s*", term):
                problems.add(where, f"semlb.toml: discovery.selector term {term!r} is not a label selector")
    return config


# --------------------------------------------- kinds without a schema


def allowed_keys(where: str, what: dict, allowed: set[str], problems: Problems) -> None:
    if not isinstance(what, dict):
        problems.add(where, f"must be an object, is {what!r}")
        return
    for key in what:
        if key not in allowed:
            problems.add(where, f"unknown field {key!r} (allowed: {', '.join(sorted(allowed))})")


def port_number(where: str, value, problems: Problems) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65535:
        problems.add(where, f"must be an integer from 1 to 65535, is {value!r}")


def check_metadata(where: str, obj: dict, problems: Problems) -> None:
    allowed_keys(where, obj, {"apiVersion", "kind", "metadata", "spec", "status"}, problems)
    name = obj.get("metadata", {}).get("name", "")
    if not DNS_SUBDOMAIN.match(name) or len(name) > 253:
        problems.add(where, f"metadata.name {name!r} is not a DNS subdomain")
    if "spec" not in obj:
        problems.add(where, "spec is required")


def check_inference_pool(where: str, pool: dict, problems: Problems) -> None:
    """inference.networking.k8s.io/v1 InferencePool (GIE api/v1,
    config/crd/bases/inference.networking.k8s.io_inferencepools.yaml)."""
    check_metadata(where, pool, problems)
    spec = pool.get("spec", {})
    allowed_keys(f"{where} spec", spec, {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}, problems)
    for key in ("selector", "targetPorts"):
        if key not in spec:
            problems.add(where, f"spec.{key} is required")
    selector = spec.get("selector", {})
    allowed_keys(f"{where} spec.selector", selector, {"matchLabels"}, problems)
    labels = selector.get("matchLabels") if isinstance(selector, dict) else None
    if not isinstance(labels, dict) or not 1 <= len(labels) <= 64:
        problems.add(where, "spec.selector.matchLabels is required, with 1 to 64 labels")
    else:
        for key, value in labels.items():
            if not LABEL_NAME.match(key.split("/")[-1]) or not LABEL_VALUE.match(str(value)) or len(str(value)) > 63:
                problems.add(where, f"spec.selector.matchLabels {key}={value!r} is not a valid label")
    ports = spec.get("targetPorts")
    if not isinstance(ports, list) or not 1 <= len(ports) <= 8:
        problems.add(where, "spec.targetPorts must list 1 to 8 ports")
    else:
        for i, port in enumerate(ports):
            allowed_keys(f"{where} spec.targetPorts[{i}]", port, {"number"}, problems)
            port_number(f"{where} spec.targetPorts[{i}].number", port.get("number"), problems)
        numbers = [p.get("number") for p in ports if isinstance(p, dict)]
        if len(set(numbers)) != len(numbers):
            problems.add(where, "spec.targetPorts: port numbers must be unique")
    if spec.get("appProtocol", "http") not in ("http", "kubernetes.io/h2c"):
        problems.add(where, f"spec.appProtocol {spec['appProtocol']!r} is not http or kubernetes.io/h2c")
    # Optional since GIE v1.1 (required in v1.0); here semlb is the picker.
    ref = spec.get("endpointPickerRef")
    if not isinstance(ref, dict):
        problems.add(where, "spec.endpointPickerRef is required: semlb is the pool's endpoint picker")
        return
    allowed_keys(f"{where} spec.endpointPickerRef", ref, {"group", "kind", "name", "port", "failureMode"}, problems)
    name = ref.get("name")
    if not isinstance(name, str) or not 1 <= len(name) <= 253:
        problems.add(where, "spec.endpointPickerRef.name is required (1 to 253 characters)")
    kind = ref.get("kind", "Service")
    if not re.fullmatch(r"[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?", str(kind)):
        problems.add(where, f"spec.endpointPickerRef.kind {kind!r} is not a kind")
    if not re.fullmatch(r"|[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", str(ref.get("group", ""))):
        problems.add(where, f"spec.endpointPickerRef.group {ref.get('group')!r} is not an API group")
    if kind == "Service" and "port" not in ref:
        problems.add(where, "spec.endpointPickerRef.port is required when kind is Service (the default)")
    if "port" in ref:
        allowed_keys(f"{where} spec.endpointPickerRef.port", ref["port"], {"number"}, problems)
        port_number(f"{where} spec.endpointPickerRef.port.number", (ref["port"] or {}).get("number"), problems)
    if ref.get("failureMode", "FailClose") not in ("FailOpen", "FailClose"):
        problems.add(where, f"spec.endpointPickerRef.failureMode {ref['failureMode']!r} is not FailOpen or FailClose")


def check_httproute(where: str, route: dict, problems: Problems) -> None:
    """gateway.networking.k8s.io/v1 HTTPRoute (Gateway API, standard
    channel): the fields this project uses, their required parts and
    limits; an unknown field is an error."""
    check_metadata(where, route, problems)
    spec = route.get("spec", {})
    allowed_keys(f"{where} spec", spec, {"parentRefs", "hostnames", "rules"}, problems)
    parents = spec.get("parentRefs") or []
    if not parents or len(parents) > 32:
        problems.add(where, "spec.parentRefs must list 1 to 32 parents (a route with none is attached to no Gateway)")
    for i, ref in enumerate(parents):
        at = f"{where} spec.parentRefs[{i}]"
        allowed_keys(at, ref, {"group", "kind", "namespace", "name", "sectionName", "port"}, problems)
        if not ref.get("name"):
            problems.add(at, "name is required")
        if "port" in ref:
            port_number(f"{at}.port", ref["port"], problems)
    rules = spec.get("rules") or []
    if not 1 <= len(rules) <= 16:
        problems.add(where, "spec.rules must list 1 to 16 rules")
    for i, rule in enumerate(rules):
        at = f"{where} spec.rules[{i}]"
        allowed_keys(at, rule, {"name", "matches", "filters", "backendRefs", "timeouts", "retry",
                                "sessionPersistence"}, problems)
        for j, match in enumerate(rule.get("matches") or []):
            allowed_keys(f"{at}.matches[{j}]", match, {"path", "headers", "queryParams", "method"}, problems)
            path = match.get("path")
            if path is not None:
                allowed_keys(f"{at}.matches[{j}].path", path, {"type", "value"}, problems)
                if path.get("type", "PathPrefix") not in ("Exact", "PathPrefix", "RegularExpression"):
                    problems.add(at, f"matches[{j}].path.type {path.get('type')!r} is not Exact, PathPrefix or RegularExpression")
                value = path.get("value", "/")
                if not isinstance(value, str) or not value.startswith("/") or len(value) > 1024:
                    problems.add(at, f"matches[{j}].path.value {value!r} must be an absolute path")
        if len(rule.get("matches") or []) > 64:
            problems.add(at, "at most 64 matches")
        for j, ref in enumerate(rule.get("backendRefs") or []):
            bat = f"{at}.backendRefs[{j}]"
            allowed_keys(bat, ref, {"group", "kind", "name", "namespace", "port", "weight", "filters"}, problems)
            if not ref.get("name"):
                problems.add(bat, "name is required")
            if ref.get("kind", "Service") == "Service" and ref.get("group", "") == "" and "port" not in ref:
                problems.add(bat, "port is required for a Service reference")
            if "port" in ref:
                port_number(f"{bat}.port", ref["port"], problems)
            weight = ref.get("weight", 1)
            if not isinstance(weight, int) or not 0 <= weight <= 1_000_000:
                problems.add(bat, f"weight {weight!r} is not 0 to 1000000")
        timeouts = rule.get("timeouts")
        if timeouts is not None:
            allowed_keys(f"{at}.timeouts", timeouts, {"request", "backendRequest"}, problems)
            for key, value in timeouts.items():
                if not GATEWAY_DURATION.match(str(value)):
                    problems.add(at, f"timeouts.{key} {value!r} is not a Gateway API duration (e.g. 600s, 1h)")


HAND_CHECKED = {
    ("inference.networking.k8s.io/v1", "InferencePool"): check_inference_pool,
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): check_httproute,
}


# ------------------------------------------------- across the objects


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def container_port(container: dict, port) -> dict | None:
    for p in container.get("ports", []):
        if port == p.get("name") or port == p.get("containerPort"):
            return p
    return None


def flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def check_overlay(name: str, objects: list[dict], problems: Problems, facts: dict) -> None:
    expect = OVERLAYS[name]
    where = name
    by_kind: dict[str, list[dict]] = {}
    for obj in objects:
        by_kind.setdefault(obj.get("kind"), []).append(obj)
    missing = expect["kinds"] - by_kind.keys()
    if missing:
        problems.add(where, f"missing kinds: {', '.join(sorted(missing))}")
    extra = by_kind.keys() - expect["kinds"]
    if extra:
        problems.add(where, f"unexpected kinds: {', '.join(sorted(extra))}")
    named = {(o.get("kind"), o.get("metadata", {}).get("name")): o for o in objects}

    deployments = by_kind.get("Deployment", [])
    if len(deployments) != 1:
        problems.add(where, f"expected one Deployment, found {len(deployments)}")
        return
    deploy = deployments[0]
    dname = deploy["metadata"]["name"]
    dat = f"{where} Deployment/{dname}"
    pod = deploy["spec"]["template"]
    pod_labels = pod.get("metadata", {}).get("labels", {})
    dselector = deploy["spec"].get("selector", {}).get("matchLabels", {})
    if not selects(dselector, pod_labels) or deploy["spec"]["selector"].get("matchExpressions"):
        problems.add(dat, f"spec.selector {dselector} does not select its own pod labels {pod_labels}")
    spec = pod["spec"]
    containers = [c for c in spec.get("containers", []) if c.get("name") == "semlb"]
    if len(containers) != 1:
        problems.add(dat, "expected one container named semlb")
        return
    c = containers[0]
    args = c.get("args", [])

    # Services and the PodDisruptionBudget select exactly these pods: at
    # least the Deployment's selector (no pods it does not own), at most
    # the pod labels.
    for kind in ("Service", "PodDisruptionBudget"):
        for obj in by_kind.get(kind, []):
            at = f"{where} {kind}/{obj['metadata']['name']}"
            sel = obj["spec"].get("selector", {})
            if kind == "PodDisruptionBudget":
                if sel.get("matchExpressions"):
                    problems.add(at, "matchExpressions are not checked: use matchLabels")
                sel = sel.get("matchLabels", {})
            if not selects(sel, pod_labels):
                problems.add(at, f"selector {sel} does not select the pods of Deployment/{dname} (labels {pod_labels})")
            elif not all(sel.get(k) == v for k, v in dselector.items()):
                problems.add(at, f"selector {sel} lacks labels of the Deployment's selector {dselector}: it may select other pods")
    for svc in by_kind.get("Service", []):
        at = f"{where} Service/{svc['metadata']['name']}"
        for p in svc["spec"].get("ports", []):
            target = p.get("targetPort", p.get("port"))
            if container_port(c, target) is None:
                problems.add(at, f"port {p.get('name')}: targetPort {target!r} is not a container port of semlb")

    # Configuration: the ConfigMap mounted where --config points.
    config_path = flag_value(args, "--config")
    config = None
    if not config_path:
        problems.add(dat, "args give no --config")
    else:
        mount_dir, file_name = os.path.split(config_path)
        mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
        volume = next((v for v in spec.get("volumes", [])
                       if v["name"] in mounts and mounts[v["name"]]["mountPath"].rstrip("/") == mount_dir), None)
        cm = named.get(("ConfigMap", (volume or {}).get("configMap", {}).get("name")))
        if volume is None or "configMap" not in volume:
            problems.add(dat, f"no ConfigMap volume is mounted at {mount_dir} (for --config {config_path})")
        elif cm is None:
            problems.add(dat, f"volume {volume['name']}: ConfigMap {volume['configMap']['name']} is not in the manifests")
        elif file_name not in cm.get("data", {}):
            problems.add(dat, f"ConfigMap {cm['metadata']['name']} has no key {file_name}")
        else:
            config = check_config(f"{where} ConfigMap/{cm['metadata']['name']}", cm["data"][file_name],
                                  facts["known_keys"], problems)
    config = config or {}

    # Flags: known ones, and every $(VAR) defined.
    known_flags = facts["serve_flags"] | PENDING_FLAGS
    if args[:1] != ["serve"]:
        problems.add(dat, f"args must start with the subcommand serve, not {args[:1]}")
    env = {e["name"] for e in c.get("env", [])}
    for arg in args[1:]:
        if arg.startswith("--") and arg.split("=")[0] not in known_flags:
            problems.add(dat, f"args: {arg.split('=')[0]} is not a flag of semlb serve (docs/reference/cli.md)")
        for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
            if var not in env:
                problems.add(dat, f"args use $({var}), which env does not define (it would stay as text)")

    # The configuration as semlb will run it: flags over the file over the defaults.
    shm_size = semlb_size(flag_value(args, "--shm-size") or config.get("shm_size") or documented_default("shm_size"))
    listen = flag_value(args, "--listen") or config.get("listen") or documented_default("listen")
    drain = int(config.get("drain_timeout_secs", documented_default("drain_timeout_secs")))
    epp_listen = flag_value(args, "--epp-listen") or config.get("epp", {}).get("listen")
    discovery_kind = flag_value(args, "--discovery") or config.get("discovery", {}).get("kind")
    facts["summary"].append(f"{name}: shm_size {shm_size >> 20} MiB, listen {listen}"
                            + (f", epp {epp_listen}" if epp_listen else "") + f", discovery {discovery_kind}")
    if discovery_kind != expect["discovery_kind"]:
        problems.add(where, f"discovery kind is {discovery_kind!r}, expected {expect['discovery_kind']!r}")

    http = container_port(c, "http")
    if http is None or http.get("containerPort") != port_of(listen):
        problems.add(dat, f"container port http must be listen's port {port_of(listen)}, is {http}")
    if expect["epp"]:
        grpc = container_port(c, "grpc")
        if not epp_listen:
            problems.add(where, "the endpoint picker needs [epp] listen (or --epp-listen)")
        elif grpc is None or grpc.get("containerPort") != port_of(epp_listen):
            problems.add(dat, f"container port grpc must be [epp] listen's port {port_of(epp_listen)}, is {grpc}")
    elif epp_listen:
        problems.add(where, "the standalone gateway configures [epp]")

    # Probes: one handler each, on a container port; HTTP paths that are
    # routes; gRPC on the picker's port.
    routes = facts["http_routes"]
    for probe_name in ("readinessProbe", "livenessProbe"):
        probe = c.get(probe_name)
        at = f"{dat} {probe_name}"
        if probe is None:
            problems.add(at, "missing")
            continue
        handlers = [h for h in ("httpGet", "tcpSocket", "grpc", "exec") if probe.get(h) is not None]
        if len(handlers) != 1:
            problems.add(at, f"must have exactly one handler, has {handlers}")
            continue
        handler = probe[handlers[0]]
        if handlers[0] == "exec":
            problems.add(at, "exec probes need a shell or a tool in the image; the image has only semlb")
            continue
        if container_port(c, handler.get("port")) is None:
            problems.add(at, f"port {handler.get('port')!r} is not a container port")
        if handlers[0] == "httpGet":
            port = container_port(c, handler.get("port")) or {}
            if port.get("name") != "http":
                problems.add(at, "an HTTP probe must ask the dispatchers' port (http)")
            if handler.get("path") not in routes:
                problems.add(at, f"path {handler.get('path')!r} is not a route of the HTTP front "
                                 f"(src/dispatcher/endpoints.rs: {', '.join(sorted(routes))})")
        if handlers[0] == "grpc" and (not epp_listen or handler.get("port") != port_of(epp_listen)):
            problems.add(at, f"gRPC probe on port {handler.get('port')!r}: semlb serves gRPC health only on [epp] listen")
    if c.get("livenessProbe", {}).get("httpGet", {}).get("path") == "/health":
        problems.add(f"{dat} livenessProbe", "GET /health answers 503 while no engine is live: "
                     "as liveness it would restart every semlb whenever the engines are down")

    # /dev/shm: memory-backed, holds the segment; the memory limit holds it.
    mounts = {m["mountPath"].rstrip("/"): m["name"] for m in c.get("volumeMounts", [])}
    shm_volume = next((v for v in spec.get("volumes", []) if v["name"] == mounts.get("/dev/shm")), None)
    if shm_volume is None or shm_volume.get("emptyDir", {}).get("medium") != "Memory":
        problems.add(dat, "/dev/shm must be an emptyDir volume with medium: Memory")
    else:
        limit = shm_volume["emptyDir"].get("sizeLimit")
        if limit is None:
            problems.add(dat, "the /dev/shm emptyDir needs a sizeLimit (else it may take all the node's memory)")
        else:
            facts["summary"].append(f"{name}: /dev/shm sizeLimit {limit}")
            if quantity(limit) < shm_size:
                problems.add(dat, f"/dev/shm sizeLimit {limit} ({quantity(limit) / 2**20:.0f} MiB) is smaller than "
                                  f"the segment, shm_size {shm_size / 2**20:.0f} MiB")
            memory = c.get("resources", {}).get("limits", {}).get("memory")
            if memory is None or quantity(memory) <= quantity(limit):
                problems.add(dat, f"memory limit {memory} must be set and above the /dev/shm sizeLimit {limit}: "
                                  "the tmpfs pages count against it")

    # Drain: the grace period covers preStop, drain_timeout_secs and the kill.
    grace = spec.get("terminationGracePeriodSeconds", 30)
    pre_stop = (c.get("lifecycle", {}).get("preStop") or {}).get("sleep", {}).get("seconds", 0)
    need = pre_stop + drain + KILL_AFTER_DRAIN_SECS
    if grace < need:
        problems.add(dat, f"terminationGracePeriodSeconds {grace} < preStop sleep {pre_stop} + "
                          f"drain_timeout_secs {drain} + {KILL_AFTER_DRAIN_SECS} = {need}")

    # RBAC: the ServiceAccount may read what discovery watches.
    sa_name = spec.get("serviceAccountName")
    if ("ServiceAccount", sa_name) not in named:
        problems.add(dat, f"serviceAccountName {sa_name!r} is not a ServiceAccount of the manifests")
    if spec.get("automountServiceAccountToken") is False or \
            named.get(("ServiceAccount", sa_name), {}).get("automountServiceAccountToken") is False:
        problems.add(dat, "the ServiceAccount token must be mounted: discovery reads the API")
    granted = set()
    for rb in by_kind.get("RoleBinding", []):
        if not any(s.get("kind") == "ServiceAccount" and s.get("name") == sa_name for s in rb.get("subjects", [])):
            continue
        role = named.get((rb["roleRef"]["kind"], rb["roleRef"]["name"]))
        if role is None:
            problems.add(f"{where} RoleBinding/{rb['metadata']['name']}", f"roleRef {rb['roleRef']['name']} is not in the manifests")
            continue
        for rule in role.get("rules", []):
            for group in rule.get("apiGroups", []):
                for resource in rule.get("resources", []):
                    if READ_VERBS <= set(rule.get("verbs", [])):
                        granted.add((group, resource))
            if set(rule.get("verbs", [])) - READ_VERBS:
                problems.add(f"{where} Role/{role['metadata']['name']}", f"grants more than reading: {rule['verbs']}")
    for need_read in DISCOVERY_READS:
        if need_read not in granted:
            problems.add(where, f"ServiceAccount {sa_name} may not get/list/watch {need_read[1]} ({need_read[0] or 'core'})")

    # The systemd unit's hardening, as securityContext.
    psc, csc = spec.get("securityContext", {}), c.get("securityContext", {})
    if not (psc.get("runAsNonRoot") or csc.get("runAsNonRoot")):
        problems.add(dat, "runAsNonRoot must be true (systemd: User=semlb)")
    if csc.get("runAsUser", psc.get("runAsUser")) in (None, 0):
        problems.add(dat, "runAsUser must be a non-zero uid (runAsNonRoot refuses an image's named user)")
    if csc.get("seccompProfile", psc.get("seccompProfile", {})).get("type") != "RuntimeDefault":
        problems.add(dat, "seccompProfile must be RuntimeDefault (systemd: SystemCallFilter=@system-service)")
    if csc.get("allowPrivilegeEscalation") is not False:
        problems.add(dat, "allowPrivilegeEscalation must be false (systemd: NoNewPrivileges=yes)")
    if csc.get("readOnlyRootFilesystem") is not True:
        problems.add(dat, "readOnlyRootFilesystem must be true (systemd: ProtectSystem=strict)")
    if "ALL" not in csc.get("capabilities", {}).get("drop", []) or csc.get("capabilities", {}).get("add"):
        problems.add(dat, "capabilities must drop ALL and add none (systemd: CapabilityBoundingSet=)")
    if csc.get("privileged"):
        problems.add(dat, "privileged must not be set")

    # The endpoint picker: the pool names semlb's Service and port, the
    # route names the pool, the configuration names the pool.
    if expect["epp"]:
        pools = by_kind.get("InferencePool", [])
        pool_name = flag_value(args, "--inference-pool") or config.get("discovery", {}).get("inference_pool")
        if pool_name not in {p["metadata"]["name"] for p in pools}:
            problems.add(where, f"discovery.inference_pool {pool_name!r} names no InferencePool of the manifests")
        for pool in pools:
            at = f"{where} InferencePool/{pool['metadata']['name']}"
            ref = pool["spec"].get("endpointPickerRef") or {}
            svc = named.get(("Service", ref.get("name"))) if ref.get("kind", "Service") == "Service" \
                and ref.get("group", "") == "" else None
            if svc is None:
                problems.add(at, f"endpointPickerRef names {ref.get('kind', 'Service')}/{ref.get('name')}, "
                                 "which is not a Service of the manifests")
                continue
            sport = next((p for p in svc["spec"]["ports"] if p["port"] == (ref.get("port") or {}).get("number")), None)
            if sport is None:
                problems.add(at, f"endpointPickerRef.port {ref.get('port')} is not a port of Service/{ref['name']}")
            else:
                target = container_port(c, sport.get("targetPort", sport["port"]))
                if not epp_listen or target is None or target.get("containerPort") != port_of(epp_listen):
                    problems.add(at, f"Service/{ref['name']} port {sport['port']} does not lead to [epp] listen ({epp_listen})")
                if sport.get("appProtocol") != "http2":
                    problems.add(at, f"Service/{ref['name']} port {sport['port']}: appProtocol must be http2 (gRPC)")
            if selects(pool["spec"].get("selector", {}).get("matchLabels", {}), pod_labels):
                problems.add(at, "the pool's selector selects semlb's own pods, not the engines")
        for route in by_kind.get("HTTPRoute", []):
            at = f"{where} HTTPRoute/{route['metadata']['name']}"
            refs = [r for rule in route["spec"].get("rules", []) for r in rule.get("backendRefs", [])]
            for r in refs:
                pool = named.get(("InferencePool", r.get("name")))
                if r.get("group") != "inference.networking.k8s.io" or r.get("kind") != "InferencePool" or pool is None:
                    problems.add(at, f"backendRef {r} is not an InferencePool of the manifests")
                elif "port" in r and r["port"] not in [p.get("number") for p in pool["spec"].get("targetPorts", [])]:
                    problems.add(at, f"backendRef port {r['port']} is not a target port of the pool")
            if not refs:
                problems.add(at, "no backendRefs")


def check_objects(name: str, objects: list[dict], version: str, facts: dict, problems: Problems,
                  counts: dict) -> None:
    """Schemas (or the hand-written checks), then the cross-references."""
    for obj in objects:
        at = f"{name} {obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        checker = HAND_CHECKED.get((obj.get("apiVersion"), obj.get("kind")))
        try:
            kubernetes_validate.validate(obj, version, strict=True)
            counts["schema"] += 1
            if checker:
                problems.add(at, "has a bundled schema now: drop its hand-written check")
        except SchemaNotFoundError:
            if checker is None:
                problems.add(at, f"no schema for {obj.get('apiVersion')} {obj.get('kind')} and no check of it here")
            else:
                checker(at, obj, problems)
                counts["hand"] += 1
        except ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            problems.add(at, f"Kubernetes {version} schema: {path}: {e.message}")
        except VersionNotSupportedError:
            problems.add(at, f"kubernetes-validate has no schemas for {version}")
    try:
        check_overlay(name, objects, problems, facts)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, StopIteration) as e:
        problems.add(name, f"malformed objects ({type(e).__name__}: {e})")


# ---------------------------------------------------------------- self-test


def find(objects: list[dict], kind: str) -> dict:
    return next(o for o in objects if o["kind"] == kind)


def semlb_container(objects: list[dict]) -> dict:
    return find(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def pod_spec(objects: list[dict]) -> dict:
    return find(objects, "Deployment")["spec"]["template"]["spec"]


def edit_config(objects: list[dict], old: str, new: str) -> None:
    cm = find(objects, "ConfigMap")
    assert old in cm["data"]["semlb.toml"], old
    cm["data"]["semlb.toml"] = cm["data"]["semlb.toml"].replace(old, new)


def shm_volume(objects: list[dict]) -> dict:
    return next(v for v in pod_spec(objects)["volumes"] if v["name"] == "dev-shm")


# (overlay, what is broken, how, a text the report must then contain)
MUTATIONS = [
    ("standalone", "an unknown field in the container", lambda o: semlb_container(o).update(bogus=1),
     "'bogus' was unexpected"),
    ("standalone", "a probe threshold of the wrong type",
     lambda o: semlb_container(o)["readinessProbe"].update(failureThreshold="2"), "is not of type"),
    ("standalone", "the Service selecting other pods",
     lambda o: find(o, "Service")["spec"]["selector"].update({"app.kubernetes.io/name": "other"}),
     "does not select the pods"),
    ("standalone", "the Service's target port not a container port",
     lambda o: find(o, "Service")["spec"]["ports"][0].update(targetPort="web"), "is not a container port"),
    ("standalone", "a probe on a port the container lacks",
     lambda o: semlb_container(o)["livenessProbe"]["tcpSocket"].update(port=8081), "is not a container port"),
    ("standalone", "a readiness path that is no route",
     lambda o: semlb_container(o)["readinessProbe"]["httpGet"].update(path="/ready"),
     "is not a route of the HTTP front"),
    ("standalone", "liveness on /health",
     lambda o: semlb_container(o).update(livenessProbe={"httpGet": {"path": "/health", "port": "http"}}),
     "would restart every semlb"),
    ("standalone", "/dev/shm smaller than the segment",
     lambda o: shm_volume(o)["emptyDir"].update(sizeLimit="128Mi"), "is smaller than the segment"),
    ("standalone", "a --shm-size flag larger than /dev/shm",
     lambda o: semlb_container(o)["args"].extend(["--shm-size", "1GiB"]), "is smaller than the segment"),
    ("standalone", "/dev/shm on disk", lambda o: shm_volume(o)["emptyDir"].pop("medium"), "medium: Memory"),
    ("standalone", "a memory limit the segment does not fit",
     lambda o: semlb_container(o)["resources"]["limits"].update(memory="256Mi"), "must be set and above"),
    ("standalone", "a grace period shorter than the drain",
     lambda o: pod_spec(o).update(terminationGracePeriodSeconds=30), "terminationGracePeriodSeconds 30 <"),
    ("standalone", "a longer drain_timeout_secs",
     lambda o: edit_config(o, "drain_timeout_secs = 30", "drain_timeout_secs = 60"), "drain_timeout_secs 60"),
    ("standalone", "semlb.toml that does not parse",
     lambda o: edit_config(o, 'shm_size = "256MiB"', "shm_size = 256MiB"), "does not parse"),
    ("standalone", "an unknown key in semlb.toml",
     lambda o: edit_config(o, "keep_segment = true", "keep_segment = true\nkeep_segmnet = true"),
     "unknown key keep_segmnet"),
    ("standalone", "an unknown key in [discovery]",
     lambda o: edit_config(o, 'selector = "app=vllm"', 'selector = "app=vllm"\nlabels = "x"'),
     "unknown key discovery.labels"),
    ("standalone", "a listen port that is not the container port",
     lambda o: edit_config(o, 'listen = "0.0.0.0:8080"', 'listen = "0.0.0.0:9090"'), "container port http"),
    ("standalone", "an unknown flag", lambda o: semlb_container(o)["args"].append("--shm-sise"),
     "is not a flag of semlb serve"),
    ("standalone", "an undefined $(VAR)", lambda o: semlb_container(o)["env"].clear(), "which env does not define"),
    ("standalone", "RBAC without EndpointSlices",
     lambda o: find(o, "Role")["rules"].pop(1), "may not get/list/watch endpointslices"),
    ("standalone", "RBAC that writes",
     lambda o: find(o, "Role")["rules"][0]["verbs"].append("delete"), "grants more than reading"),
    ("standalone", "root allowed", lambda o: pod_spec(o)["securityContext"].pop("runAsNonRoot"), "runAsNonRoot"),
    ("standalone", "a writable root file system",
     lambda o: semlb_container(o)["securityContext"].update(readOnlyRootFilesystem=False), "readOnlyRootFilesystem"),
    ("standalone", "privilege escalation allowed",
     lambda o: semlb_container(o)["securityContext"].pop("allowPrivilegeEscalation"), "allowPrivilegeEscalation"),
    ("standalone", "a capability added",
     lambda o: semlb_container(o)["securityContext"]["capabilities"].update(add=["NET_ADMIN"]), "capabilities"),
    ("standalone", "no seccomp profile",
     lambda o: pod_spec(o)["securityContext"].pop("seccompProfile"), "seccompProfile"),
    ("standalone", "the PodDisruptionBudget selecting other pods",
     lambda o: find(o, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].update(
         {"app.kubernetes.io/component": "x"}), "PodDisruptionBudget"),
    ("epp", "two probe handlers",
     lambda o: semlb_container(o)["readinessProbe"].update(tcpSocket={"port": 9002}), "exactly one handler"),
    ("epp", "the pool's picker another Service",
     lambda o: find(o, "InferencePool")["spec"]["endpointPickerRef"].update(name="semlb"),
     "which is not a Service of the manifests"),
    ("epp", "the pool's picker port not the Service's",
     lambda o: find(o, "InferencePool")["spec"]["endpointPickerRef"]["port"].update(number=9003),
     "is not a port of Service"),
    ("epp", "the pool without a picker port",
     lambda o: find(o, "InferencePool")["spec"]["endpointPickerRef"].pop("port"), "port is required"),
    ("epp", "a bad failureMode",
     lambda o: find(o, "InferencePool")["spec"]["endpointPickerRef"].update(failureMode="Open"),
     "is not FailOpen or FailClose"),
    ("epp", "an unknown field in the pool (v1alpha2's targetPortNumber)",
     lambda o: find(o, "InferencePool")["spec"].update(targetPortNumber=8000), "unknown field 'targetPortNumber'"),
    ("epp", "a pool without targetPorts",
     lambda o: find(o, "InferencePool")["spec"].pop("targetPorts"), "spec.targetPorts is required"),
    ("epp", "a pool selecting semlb itself",
     lambda o: find(o, "InferencePool")["spec"]["selector"].update(
         matchLabels={"app.kubernetes.io/name": "semlb"}), "selects semlb's own pods"),
    ("epp", "the route to another pool",
     lambda o: find(o, "HTTPRoute")["spec"]["rules"][0]["backendRefs"][0].update(name="other"),
     "is not an InferencePool of the manifests"),
    ("epp", "a route without a parent",
     lambda o: find(o, "HTTPRoute")["spec"].pop("parentRefs"), "spec.parentRefs must list"),
    ("epp", "a route timeout that is no duration",
     lambda o: find(o, "HTTPRoute")["spec"]["rules"][0]["timeouts"].update(request="10 minutes"),
     "is not a Gateway API duration"),
    ("epp", "the EPP Service without appProtocol http2",
     lambda o: find(o, "Service")["spec"]["ports"][0].pop("appProtocol"), "appProtocol must be http2"),
    ("epp", "[epp] listen on another port",
     lambda o: edit_config(o, 'listen = "0.0.0.0:9002"', 'listen = "0.0.0.0:9005"'), "[epp] listen"),
    ("epp", "the configuration naming another pool",
     lambda o: edit_config(o, 'inference_pool = "vllm"', 'inference_pool = "llama"'), "names no InferencePool"),
    ("epp", "a discovery kind semlb does not have",
     lambda o: edit_config(o, 'kind = "inference-pool"', 'kind = "inferencepool"'), "discovery.kind is"),
    ("epp", "RBAC without InferencePools",
     lambda o: find(o, "Role")["rules"].pop(2), "may not get/list/watch inferencepools"),
    ("epp", "an object of a kind nothing checks",
     lambda o: o.append({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
                         "metadata": {"name": "inference-gateway"}, "spec": {}}), "and no check of it here"),
]


def self_test(rendered: dict, version: str, facts: dict) -> int:
    """Each mutation of the rendered objects must be reported."""
    import copy
    missed = 0
    for name, what, mutate, expected in MUTATIONS:
        objects = copy.deepcopy(rendered[name])
        mutate(objects)
        problems = Problems()
        check_objects(name, objects, version, dict(facts, summary=[]), problems, {"schema": 0, "hand": 0})
        if not any(expected in p for p in problems.items):
            missed += 1
            print(f"self-test: NOT CAUGHT: {name}: {what} (expected {expected!r}; got {problems.items})",
                  file=sys.stderr)
    print(f"self-test: {len(MUTATIONS) - missed} of {len(MUTATIONS)} broken manifests caught")
    return 1 if missed else 0


# ---------------------------------------------------------------- main


def kubectl_minor(kubectl: str) -> str:
    out = subprocess.run([kubectl, "version", "--client", "-o", "json"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    client = json.loads(out)["clientVersion"]
    return f"{client['major']}.{re.sub(r'[^0-9]', '', client['minor'])}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubectl", default=os.environ.get("KUBECTL", "kubectl"))
    parser.add_argument("--kubernetes-version", help="schemas to validate against (default: kubectl's version)")
    parser.add_argument("--dir", default=str(HERE), help="where the overlays are (default: beside this file)")
    parser.add_argument("--self-test", action="store_true",
                        help="then break the rendered objects in known ways and check that each is caught")
    opts = parser.parse_args()

    kubectl = shutil.which(opts.kubectl)
    if kubectl is None:
        print(f"validate.py: kubectl ({opts.kubectl}) not found: it renders the manifests "
              "(`kubectl kustomize`); install kubectl 1.27 or later (kustomize 5)", file=sys.stderr)
        return 2

    version = opts.kubernetes_version or kubectl_minor(kubectl) + ".0"
    bundled = kubernetes_validate.utils.all_versions()
    if not any(v.startswith(version.rsplit(".", 1)[0] + ".") for v in bundled):
        print(f"validate.py: kubernetes-validate {kubernetes_validate.__version__} bundles no schemas for "
              f"Kubernetes {version} (it has {bundled[0]} to {bundled[-1]})", file=sys.stderr)
        return 2
    facts = {
        "known_keys": documented_keys(),
        "serve_flags": documented_serve_flags(),
        "http_routes": http_routes(),
        "summary": [],
    }
    problems = Problems()
    counts = {"schema": 0, "hand": 0}
    rendered = {}
    for name in OVERLAYS:
        start = time.monotonic()
        render = subprocess.run([kubectl, "kustomize", str(Path(opts.dir) / name)], capture_output=True,
                                text=True, timeout=60)
        if render.returncode != 0:
            problems.add(name, f"kubectl kustomize failed: {render.stderr.strip()}")
            continue
        objects = [o for o in yaml.safe_load_all(render.stdout) if o is not None]
        rendered[name] = objects
        check_objects(name, objects, version, facts, problems, counts)
        print(f"{name}: rendered {len(objects)} objects ({', '.join(sorted({o['kind'] for o in objects}))}), "
              f"checked in {time.monotonic() - start:.2f} s")
    for line in facts["summary"]:
        print(f"  {line}")
    print(f"{counts['schema']} objects validated against the Kubernetes {version} schemas "
          f"(kubernetes-validate {kubernetes_validate.__version__}, strict, bundled), "
          f"{counts['hand']} by their specifications here (InferencePool, HTTPRoute)")
    if problems.items:
        print(f"{len(problems.items)} problem(s):", file=sys.stderr)
        for p in problems.items:
            print(f"  {p}", file=sys.stderr)
        return 1
    print("manifests: no problem found")
    if opts.self_test:
        return self_test(rendered, version, facts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
