"""``mixrl-fleet render``: one Kubernetes Deployment or one SkyPilot task per fleet group.

Kubernetes (``--target k8s``): ``<out>/<run>-<group>.deployment.yaml``, ``replicas`` = the
group's ``processes``; the container runs ``mixrl-fleet replica`` (fetch the trainer's current
version, then exec ``mixrl-sample``), the token from a Secret (``--token-secret``, key
``token``) as ``MIXRL_TOKEN``; ``nvidia.com/gpu`` = the group's ``resources.num_gpus`` (a group
with a GPU ``accelerator`` and no count: 1), CPU and memory requests from ``num_cpus`` /
``memory``; a node selector ``<--node-selector-key>: <value>`` where the value is the group's
``accelerator``, or what ``--node-selector-value ACCELERATOR=VALUE`` maps it to (default key
``nvidia.com/gpu.product``, whose values NVIDIA's GPU feature discovery writes as e.g.
``NVIDIA-H100-80GB-HBM3``: the config's ``accelerator`` stays the short price key and SkyPilot
name, the flag gives the label). The tests check every Deployment against the Kubernetes
client's ``V1Deployment`` model.

SkyPilot (``--target skypilot``): ``<out>/<run>-<group>.sky.yaml``, ``num_nodes`` = the
group's ``processes`` (one replica per node; a group of 0 is not written: SkyPilot needs at
least one node), ``accelerators: <accelerator>:<num_gpus or 1>``, ``workdir: .`` with a setup
that installs this checkout, the token as a SkyPilot secret (``sky launch --secret
MIXRL_TOKEN``). Checked against SkyPilot's task and resources schemas (``validate_skypilot``:
vendored from skypilot 0.14.1, ``fleet/skypilot_schema.json``, because skypilot's own pins
downgrade click and uvicorn below this project's).

A group that declares neither an ``accelerator`` nor ``resources.num_gpus`` asks for nothing a
scheduler could place it by: ``render`` writes it and prints one warning line for it
(``unplaced_warnings``); ``accelerator: cpu`` says so on purpose and is not warned about.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from importlib import resources as pkg_resources
from pathlib import Path

import yaml

from fleet.spec import FleetError, GroupSpec, fleet_groups, load_fleet_config

_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_CPU_NAMES = {"cpu", "none"}


def dns_name(*parts: str) -> str:
    """A DNS-1123 name (lower case, digits, '-', at most 63) from ``parts``."""
    name = re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")
    return name[:63].rstrip("-") or "mixrl"


def replica_command(g: GroupSpec, trainer: str) -> list[str]:
    """What a rendered replica runs: fetch the current version, then ``mixrl-sample``."""
    return ["mixrl-fleet", "replica", "--trainer", trainer, "--", *g.sampler_args]


def _gpu_accelerator(g: GroupSpec) -> bool:
    return bool(g.accelerator) and g.accelerator.lower() not in _CPU_NAMES


def _gpus(g: GroupSpec) -> float:
    """GPUs per replica: ``resources.num_gpus``; absent on a group with a GPU accelerator, 1 (a
    group named for an H100 that asked for none would be scheduled without one)."""
    if "num_gpus" in g.resources:
        return float(g.resources["num_gpus"] or 0)
    return 1.0 if _gpu_accelerator(g) else 0.0


def unplaced_warnings(groups: list[GroupSpec]) -> list[str]:
    """One line per group that requests no accelerator (neither ``accelerator`` nor
    ``resources.num_gpus``): its replicas would land on any node."""
    return [f"warning: group {g.name} requests no accelerator (set its accelerator: and "
            "resources.num_gpus, or accelerator: cpu): its replicas may be scheduled on any node"
            for g in groups if not g.accelerator and not g.resources.get("num_gpus")]


def parse_selector_values(pairs: list[str]) -> dict[str, str]:
    """``--node-selector-value ACCELERATOR=VALUE`` pairs as a mapping (bad form: FleetError)."""
    out = {}
    for pair in pairs:
        accel, sep, value = pair.partition("=")
        if not sep or not accel or not value:
            raise FleetError(f"--node-selector-value {pair!r}: expected ACCELERATOR=LABEL_VALUE, "
                             "e.g. H100=NVIDIA-H100-80GB-HBM3")
        out[accel] = value
    return out


def k8s_deployment(g: GroupSpec, run: str, *, trainer: str, image: str, node_selector_key: str,
                   token_secret: str, selector_values: dict[str, str] | None = None) -> dict:
    """The Deployment of group ``g`` as plain data (``apps/v1``); ``selector_values`` maps an
    accelerator to its node label value (default: the accelerator itself)."""
    labels = {"app.kubernetes.io/name": "mixrl-sampler", "mixrl.run": dns_name(run),
              "mixrl.group": dns_name(g.name)}
    limits: dict[str, str] = {}
    requests: dict[str, str] = {}
    if _gpus(g):
        if not _gpus(g).is_integer():
            raise FleetError(f"group {g.name}: resources.num_gpus {_gpus(g):g} is not a whole number "
                             "(Kubernetes schedules whole GPUs)")
        limits["nvidia.com/gpu"] = str(int(_gpus(g)))
    if "num_cpus" in g.resources:
        requests["cpu"] = f"{g.resources['num_cpus']:g}"
    if "memory" in g.resources:
        requests["memory"] = str(int(g.resources["memory"]))
    pod: dict = {
        "terminationGracePeriodSeconds": 60,  # the sampler returns its leases on SIGTERM
        "containers": [{
            "name": "sampler", "image": image, "command": replica_command(g, trainer),
            "env": [{"name": "MIXRL_TOKEN",
                     "valueFrom": {"secretKeyRef": {"name": token_secret, "key": "token"}}}],
            "resources": {k: v for k, v in (("limits", limits), ("requests", requests)) if v},
        }],
    }
    if _gpu_accelerator(g):
        value = (selector_values or {}).get(g.accelerator, g.accelerator)
        if not _LABEL_VALUE.match(value) or len(value) > 63:
            what = "--node-selector-value for" if value != g.accelerator else "accelerator"
            raise FleetError(f"group {g.name}: {what} {g.accelerator!r}: {value!r} is not a Kubernetes "
                             "label value (letters, digits, '-', '_', '.'; at most 63)")
        pod["nodeSelector"] = {node_selector_key: value}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": dns_name(run, g.name), "labels": dict(labels)},  # copies: no YAML anchors
        "spec": {"replicas": g.replicas, "selector": {"matchLabels": dict(labels)},
                 "template": {"metadata": {"labels": dict(labels)}, "spec": pod}},
    }


def skypilot_task(g: GroupSpec, run: str, *, trainer: str) -> dict:
    """The SkyPilot task of group ``g`` as plain data."""
    res: dict = {}
    if _gpu_accelerator(g) and _gpus(g):
        n = _gpus(g)
        res["accelerators"] = f"{g.accelerator}:{int(n) if n.is_integer() else n:g}"
    if "num_cpus" in g.resources:
        res["cpus"] = f"{g.resources['num_cpus']:g}+"
    if "memory" in g.resources:
        res["memory"] = f"{g.resources['memory'] / 2**30:g}+"  # GiB
    cmd = ["mixrl-fleet", "replica", "--trainer", "$MIXRL_TRAINER", "--", *g.sampler_args]
    return {
        "name": dns_name(run, g.name),
        "num_nodes": g.replicas,
        "resources": res,
        "workdir": ".",
        "envs": {"MIXRL_TRAINER": trainer},
        "secrets": {"MIXRL_TOKEN": None},
        "setup": "python -m pip install -e .",
        "run": " ".join(a if a == "$MIXRL_TRAINER" else shlex.quote(a) for a in cmd),
    }


def skypilot_schema() -> dict:
    """The vendored schemas: ``{"source", "task", "resources"}``."""
    return json.loads(pkg_resources.files("fleet").joinpath("skypilot_schema.json").read_text())


def validate_skypilot(task: dict) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``task`` (and its ``resources``) matches
    SkyPilot's schemas, validated as SkyPilot does (Draft 7 plus its case-(in)sensitive enums)."""
    import jsonschema

    def enum(case: bool):
        def check(validator, enums, instance, schema):
            if (instance if case else instance.lower()) not in [e if case else e.lower() for e in enums]:
                yield jsonschema.ValidationError(f"{instance!r} is not one of {enums!r}")
        return check

    cls = jsonschema.validators.extend(jsonschema.Draft7Validator, validators={
        "case_insensitive_enum": enum(False), "case_sensitive_enum": enum(True)})
    schema = skypilot_schema()
    cls(schema["task"]).validate({k: v for k, v in task.items() if v is not None})
    cls(schema["resources"]).validate(task.get("resources") or {})


def render(args) -> list[Path]:
    """Write the files for ``args`` (``mixrl-fleet render``); their paths."""
    cfg = load_fleet_config(args.config, getattr(args, "plan", None))
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FleetError(f"--out {out}: cannot be made a directory ({e.strerror or e})") from None
    groups = fleet_groups(cfg)
    values = parse_selector_values(getattr(args, "node_selector_value", None) or [])
    unknown = sorted(set(values) - {g.accelerator for g in groups})
    if unknown:
        have = ", ".join(sorted({str(g.accelerator) for g in groups}))
        raise FleetError(f"--node-selector-value {unknown[0]}=...: no group of the config has accelerator "
                         f"{unknown[0]!r} (they have: {have})")
    written = []
    for g in groups:
        if args.target == "k8s":
            doc = k8s_deployment(g, cfg.run.name, trainer=args.trainer, image=args.image,
                                 node_selector_key=args.node_selector_key, token_secret=args.token_secret,
                                 selector_values=values)
            path = out / f"{dns_name(cfg.run.name, g.name)}.deployment.yaml"
        else:
            if g.replicas == 0:
                continue
            doc = skypilot_task(g, cfg.run.name, trainer=args.trainer)
            path = out / f"{dns_name(cfg.run.name, g.name)}.sky.yaml"
        try:
            path.write_text(yaml.safe_dump(doc, sort_keys=False, width=1 << 16))
        except OSError as e:
            raise FleetError(f"--out {out}: cannot write {path.name} ({e.strerror or e})") from None
        written.append(path)
    for line in unplaced_warnings(groups):
        print(f"mixrl-fleet render: {line}", file=sys.stderr)
    return written
