"""``mixrl-fleet``: run a run config's sampler groups on Ray, or render them for Kubernetes / SkyPilot.

    mixrl-fleet up --config C --trainer HOST:PORT [--token-file F] [--address RAY_ADDRESS]
                   [--name NAME] [--plan plan.yaml] [--autoscale]
    mixrl-fleet status [--address RAY_ADDRESS] [--name NAME]
    mixrl-fleet down [--address RAY_ADDRESS] [--name NAME]
    mixrl-fleet render --target k8s|skypilot --config C --out DIR [--node-selector-key K]
                       [--node-selector-value ACCELERATOR=VALUE ...]
    mixrl-fleet replica --trainer HOST:PORT -- MIXRL-SAMPLE-ARGS   (what a rendered replica runs)

``up`` starts (or, on a running fleet of that name, re-targets) the controller and returns once
every replica is placed; exit 1 if some are not within ``--wait-s`` (the fleet keeps trying).
``--address`` defaults to ``auto`` (the cluster this node joined): ``up`` never starts a
cluster of its own. Bad input: one line, exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from fleet.spec import FleetError

NAMESPACE = "mixrl"
HEAD_RESOURCE = "node:__internal_head__"  # Ray's resource of the head node only


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mixrl-fleet", description="Sampler fleets on Ray; manifests for "
                                "Kubernetes and SkyPilot.")
    sub = p.add_subparsers(dest="cmd", required=True)

    def ray_args(q: argparse.ArgumentParser) -> None:
        q.add_argument("--address", default="auto", help="Ray cluster address (default auto: this node's)")
        q.add_argument("--name", default=None, help="fleet (controller) name; default the config's "
                       "run.name (up), the cluster's only fleet (status, down)")

    up = sub.add_parser("up", help="start the fleet's replicas on Ray (or re-target a running fleet)")
    up.add_argument("--config", required=True, help="the run config the trainer runs")
    up.add_argument("--trainer", required=True, help="the trainer's rollout service HOST:PORT")
    up.add_argument("--token-file", default=None, help="bearer token file (default $MIXRL_TOKEN)")
    up.add_argument("--plan", default=None, help="plan.yaml (mixrl-train plan): replica counts per group")
    up.add_argument("--autoscale", action="store_true",
                    help="move replicas between groups by the trainer's per-group signals")
    up.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="config override, as mixrl-train's (repeatable)")
    up.add_argument("--weights-transfer", choices=("auto", "shared", "fetch"), default="auto",
                    help="replicas read the trainer's weights path (shared), fetch over gRPC, or auto")
    up.add_argument("--wait-s", type=float, default=300.0, help="how long to wait for placement")
    up.add_argument("--autoscale-every-s", type=float, default=60.0, help="seconds between moves")
    ray_args(up)
    for name, text in (("status", "replicas per group and their state"),
                       ("down", "stop every replica and the controller")):
        ray_args(sub.add_parser(name, help=text))

    r = sub.add_parser("render", help="write a Deployment / SkyPilot task per group")
    r.add_argument("--target", choices=("k8s", "skypilot"), required=True)
    r.add_argument("--config", required=True)
    r.add_argument("--out", required=True, help="directory for the files")
    r.add_argument("--plan", default=None, help="plan.yaml: replica counts per group")
    r.add_argument("--trainer", default="mixrl-trainer:50051",
                   help="the trainer address the replicas join (default mixrl-trainer:50051)")
    r.add_argument("--node-selector-key", default="nvidia.com/gpu.product",
                   help="k8s node label whose value is the group's accelerator")
    r.add_argument("--node-selector-value", action="append", default=[], metavar="ACCELERATOR=VALUE",
                   help="k8s: the label value of the nodes with ACCELERATOR, when it is not the "
                   "accelerator's name (e.g. H100=NVIDIA-H100-80GB-HBM3; repeatable)")
    r.add_argument("--image", default="mixrl:latest", help="k8s container image holding mixrl")
    r.add_argument("--token-secret", default="mixrl-token",
                   help="k8s Secret (key 'token') / SkyPilot secret name holding the bearer token")

    rep = sub.add_parser("replica", help="fetch the trainer's current weights, then run mixrl-sample")
    rep.add_argument("--trainer", required=True)
    rep.add_argument("--weights-dir", default="~/.cache/mixrl/initial")
    rep.add_argument("--weights-transfer", choices=("auto", "shared", "fetch"), default="auto")
    rep.add_argument("sampler_args", nargs=argparse.REMAINDER, help="-- then mixrl-sample's arguments")
    return p


def _reachable(address: str, timeout_s: float = 5.0) -> str | None:
    """Why ``HOST:PORT`` (or ``ray://HOST:PORT``) takes no TCP connection, or None. ``ray.init``
    on an address where nothing listens retries for minutes; this answers in seconds."""
    import socket

    host, sep, port = address.split("://", 1)[-1].rpartition(":")
    if not sep or not port.isdigit():
        return None  # "auto", or a form ray.init parses itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def _connect(address: str):
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    why = _reachable(address)
    if why:
        raise FleetError(f"no Ray cluster at --address {address} ({why}): start one with `ray start "
                         "--head` or pass its address")
    import ray

    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="WARNING")
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise FleetError(f"no Ray cluster at --address {address} ({' '.join(str(e).split())[:200]}): "
                         "start one with `ray start --head` or pass its address") from None
    return ray


def fleet_name(name: str | None, named: list[str]) -> str | None:
    """The fleet ``status`` / ``down`` act on: ``--name``, else the only fleet among ``named``
    (the cluster's named actors in the namespace: controllers only); None when there is none.
    ``up`` names a fleet after the config's ``run.name``, which these commands do not read;
    several fleets need ``--name``."""
    if name:
        return name
    if len(named) > 1:
        raise FleetError(f"{len(named)} fleets on this cluster ({', '.join(sorted(named))}): pass --name")
    return named[0] if named else None


def _controller(ray, name: str):
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def print_status(st: dict, out=sys.stdout) -> None:
    """The fleet's status as a table: one row per group, then one per replica."""
    planned = any(g["plan"] is not None for g in st["groups"])
    print(f"fleet {st['fleet']} -> trainer {st['trainer']}"
          + (" (autoscale)" if st["autoscale"] else "") + f"; replaced {st['replaced']}", file=out)
    head = f"{'group':<16}{'accel.':<10}{'target':>7}" + (f"{'plan':>6}" if planned else "")
    print(head + f"{'min-max':>9}{'running':>9}{'starting':>10}{'dead':>6}", file=out)
    for g in st["groups"]:
        row = f"{g['name']:<16}{g['accelerator'] or '-':<10}{g['target']:>7}"
        if planned:
            row += f"{'-' if g['plan'] is None else g['plan']:>6}"
        print(row + f"{str(g['min']) + '-' + str(g['max']):>9}{g['running']:>9}{g['starting']:>10}"
              f"{g['dead']:>6}", file=out)
    for r in sorted(st["replicas"], key=lambda r: r["name"]):
        node = (r.get("node") or "-")[:12]
        print(f"  {r['name']:<20}{r['state']:<10}node {node:<14}{r['detail']}", file=out)
    for e in st["events"][-5:]:
        print(f"  event: {e}", file=out)


def _placed(st: dict) -> bool:
    return all(g["running"] + g["starting"] >= g["target"] for g in st["groups"]) and all(
        r["state"] == "running" or r.get("pid") for r in st["replicas"] if r["state"] != "dead")


def up(args) -> int:
    from fleet.controller import Controller, group_dicts
    from fleet.spec import fleet_groups, load_fleet_config, python, read_token

    cfg = load_fleet_config(args.config, args.plan, args.override)
    specs = fleet_groups(cfg)
    token = read_token(args.token_file)
    plan = {s.name: s.replicas for s in specs} if args.plan else None
    name = args.name or cfg.run.name
    ray = _connect(args.address)
    groups = group_dicts(specs)
    ctrl = _controller(ray, name)
    if ctrl is not None:
        running = ray.get(ctrl.status.remote(), timeout=60)["trainer"]
        if running != args.trainer:
            raise FleetError(f"fleet {name} runs against trainer {running}, not {args.trainer}: "
                             f"`mixrl-fleet down --name {name}` first, or pick another --name")
        ray.get(ctrl.apply.remote(groups, plan, args.autoscale), timeout=60)
        print(f"mixrl-fleet: fleet {name} re-targeted: {', '.join(f'{s.name}={s.replicas}' for s in specs)}")
    else:
        # On the head node (Ray's `node:__internal_head__` resource): with num_cpus=0 alone Ray
        # may put it on any node, and the loss of that node would take the whole fleet with it.
        ctrl = ray.remote(Controller).options(
            name=name, namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_concurrency=8,
            resources={HEAD_RESOURCE: 0.001}, max_restarts=0).remote(
                name, args.trainer, token, groups, plan=plan, autoscale=args.autoscale,
                transfer=args.weights_transfer, python=python(), autoscale_every_s=args.autoscale_every_s)
        ray.get(ctrl.ping.remote(), timeout=60)
    deadline = time.monotonic() + args.wait_s
    st = ray.get(ctrl.status.remote(), timeout=60)
    while not _placed(st) and time.monotonic() < deadline:
        time.sleep(0.5)
        st = ray.get(ctrl.status.remote(), timeout=60)
    print_status(st)
    if not _placed(st):
        print(f"mixrl-fleet: not every replica placed within {args.wait_s:g} s (the fleet keeps "
              "trying; `mixrl-fleet status` shows which wait, `ray status` what the cluster has)",
              file=sys.stderr)
        return 1
    return 0


def _existing(args):
    """``(ray, name, controller)`` of the fleet ``args`` names (``--name``, else the cluster's
    only one); the controller is None, said in one line, when there is no such fleet."""
    ray = _connect(args.address)
    name = fleet_name(args.name, [] if args.name else ray.util.list_named_actors())
    if name is None:  # e.g. after `down`: no --name asked for one, and none runs
        print(f"mixrl-fleet: no fleet is running on this cluster (namespace {NAMESPACE}); "
              "`mixrl-fleet up` starts one", file=sys.stderr)
        return ray, name, None
    ctrl = _controller(ray, name)
    if ctrl is None:
        print(f"mixrl-fleet: no fleet named {name!r} on this cluster (namespace {NAMESPACE})",
              file=sys.stderr)
    return ray, name, ctrl


def status(args) -> int:
    ray, _, ctrl = _existing(args)
    if ctrl is None:
        return 1
    print_status(ray.get(ctrl.status.remote(), timeout=60))
    return 0


def down(args) -> int:
    ray, name, ctrl = _existing(args)
    if ctrl is None:
        return 1
    out = ray.get(ctrl.shutdown.remote(), timeout=120)
    ray.kill(ctrl, no_restart=True)
    print(f"mixrl-fleet: fleet {name} down: stopped {len(out['stopped'])} replicas "
          f"({', '.join(out['stopped']) or 'none'}) and the controller")
    return 0


def replica(args) -> int:
    """Fetch the current version, then become ``mixrl-sample`` (exec: same pid, same signals)."""
    from fleet.spec import read_token
    from fleet.weights import FetchError, fetch_current

    sargs = args.sampler_args[1:] if args.sampler_args[:1] == ["--"] else args.sampler_args
    try:
        group, recipe = sargs[sargs.index("--group") + 1], sargs[sargs.index("--recipe") + 1]
    except (ValueError, IndexError):
        raise FleetError("replica: mixrl-sample's arguments need --group and --recipe") from None
    token_file = sargs[sargs.index("--token-file") + 1] if "--token-file" in sargs else None
    token = read_token(token_file)
    name = sargs[sargs.index("--name") + 1] if "--name" in sargs else os.uname().nodename
    try:
        version, path = fetch_current(args.trainer, token, group=group, recipe=recipe, name=name,
                                      cache_dir=args.weights_dir, transfer=args.weights_transfer)
    except FetchError as e:
        print(f"mixrl-fleet replica: {e}", file=sys.stderr)
        return 1
    print(f"mixrl-fleet replica: starting from version {version} ({path})", flush=True)
    os.execv(sys.executable, [sys.executable, "-m", "sampler_torch.cli", "--trainer", args.trainer,
                              *sargs, "--model-dir", str(path), "--weights-transfer", args.weights_transfer])
    return 0  # not reached


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.cmd == "render":
            from fleet.render import render

            for path in render(args):
                print(path)
            return 0
        return {"up": up, "status": status, "down": down, "replica": replica}[args.cmd](args)
    except FleetError as e:
        print(f"mixrl-fleet: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
