"""The ablation sweep: conditions x sampler pools x seeds, one isolated training run per cell.

A sweep file (``configs/ablation.yaml``) names the pools (each a base run config: the mixed pool and
the homogeneous bf16 pool differ in their ``groups`` list; a pool may also be ``{config: PATH,
overrides: [...]}``, e.g. a whole ``groups=[...]`` list, or the mismatch dial's ``logit_noise`` in
each group, as in ``configs/ablation_dial.yaml``), the
conditions (lists of ``key=value`` overrides of the objective / sampling), the seeds, overrides
shared by every cell, and a ``quick`` section (a reduced grid for the CI smoke test).

Each cell runs as its own ``mixrl-train`` subprocess in ``OUT/{pool}/{condition}/seed{N}``, so a
crash, a hang or a leaked sampler in one cell cannot take the others down; the cell's exit status,
wall time and command are written to ``cell.json`` next to its ``metrics.jsonl`` and a failed cell
is reported, not fatal. A cell whose ``cell.json`` says it finished is skipped on a rerun, so an
interrupted sweep continues where it stopped.

With ``warm_start: true`` the supervised warm start runs once per seed (``mixrl-train sft``) and
every cell of that seed starts RL from the same weights: the comparison is then between objectives
and pools from an identical policy, and the SFT cost is paid once instead of once per cell. With
``warm_start: shared`` it runs once for the whole grid (with ``run.seed`` = ``warm_start_seed``,
default 0) and every cell of every seed starts from it: seeds then vary only the RL part (sampling,
batching, initial routing), so seed-to-seed spread is RL's own, not the warm start's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CELL_FILE = "cell.json"
SWEEP_FILE = "sweep.json"


class SweepError(ValueError):
    """A malformed sweep file."""


@dataclasses.dataclass(frozen=True)
class Condition:
    name: str
    label: str
    overrides: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Cell:
    pool: str
    condition: str
    seed: int
    config: Path
    overrides: tuple[str, ...]
    run_dir: Path

    def command(self) -> list[str]:
        return [
            str(_bin("mixrl-train")),
            "--config",
            str(self.config),
            "--run-dir",
            str(self.run_dir),
            *self.overrides,
        ]


@dataclasses.dataclass
class SweepSpec:
    """A parsed sweep file; ``select(quick=...)`` gives the grid actually run."""

    path: Path
    pools: dict[str, Path]
    conditions: dict[str, Condition]
    seeds: list[int]
    overrides: list[str]
    warm_start: bool = True
    #: with ``warm_start: shared``, the one warm start's seed (None: one warm start per seed)
    warm_start_seed: int | None = None
    save_trajectories: int = 0
    cell_timeout_s: float = 3600.0
    out: Path = Path("runs/ablation")
    quick: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: per pool, overrides applied after the shared ones (before the condition's)
    pool_overrides: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def select(self, *, quick: bool) -> SweepSpec:
        """The full grid, or the ``quick`` subset (its pools/conditions/seeds, extra overrides)."""
        if not quick:
            return self
        q = self.quick
        pools = {k: self.pools[k] for k in q.get("pools", list(self.pools))}
        conds = {k: self.conditions[k] for k in q.get("conditions", list(self.conditions))}
        return dataclasses.replace(
            self,
            pools=pools,
            conditions=conds,
            seeds=list(q.get("seeds", self.seeds[:1])),
            overrides=self.overrides + list(q.get("overrides", [])),
            cell_timeout_s=float(q.get("cell_timeout_s", self.cell_timeout_s)),
            out=Path(q["out"]) if "out" in q else self.out / "quick",
            quick={},
        )

    def labels(self) -> dict[str, str]:
        return {k: c.label for k, c in self.conditions.items()}


def _bin(name: str) -> Path:
    """The console script next to this interpreter (the venv's), so cells use the same install."""
    return Path(sys.executable).parent / name


def _resolve(path: str, base: Path) -> Path:
    """Config paths are relative to the sweep file's directory's parent (the repo root) or cwd."""
    p = Path(path)
    if p.is_absolute():
        return p
    for root in (Path.cwd(), base.parent.parent, base.parent):
        if (root / p).exists():
            return (root / p).absolute()
    raise SweepError(f"config {path!r} not found (relative to {Path.cwd()} or {base.parent.parent})")


def load_sweep(path: str | os.PathLike) -> SweepSpec:
    """Parse and check a sweep file (names, override syntax, config paths)."""
    from trainer_jax.config.yaml_safe import YamlError, read_yaml

    path = Path(path)
    if not path.exists():
        raise SweepError(f"sweep file {path} does not exist")
    try:  # bounded like a config: aliases, depth, size, duplicate keys
        tree = read_yaml(path, f"sweep file {path}") or {}
    except YamlError as e:
        raise SweepError(str(e)) from None
    if not isinstance(tree, dict):
        raise SweepError(f"{path}: top level must be a mapping")
    unknown = set(tree) - {
        "pools",
        "conditions",
        "seeds",
        "overrides",
        "warm_start",
        "warm_start_seed",
        "save_trajectories",
        "cell_timeout_s",
        "out",
        "quick",
    }
    if unknown:
        raise SweepError(f"{path}: unknown keys {sorted(unknown)}")
    if not tree.get("pools") or not tree.get("conditions"):
        raise SweepError(f"{path}: needs non-empty 'pools' and 'conditions'")
    pools, pool_overrides = {}, {}
    for name, value in tree["pools"].items():
        if isinstance(value, dict):
            unknown_keys = set(value) - {"config", "overrides"}
            if "config" not in value or unknown_keys:
                raise SweepError(f"{path}: pool {name}: takes 'config' and optional 'overrides', got "
                                 f"{sorted(value)}")
        cfg = value["config"] if isinstance(value, dict) else value
        pools[str(name)] = _resolve(cfg, path)
        extra = tuple(str(o) for o in (value.get("overrides") or [] if isinstance(value, dict) else []))
        bad = [o for o in extra if "=" not in o]
        if bad:
            raise SweepError(f"{path}: pool {name}: overrides must be key=value, got {bad}")
        pool_overrides[str(name)] = extra
    conditions = {}
    for name, value in tree["conditions"].items():
        if isinstance(value, list):
            value = {"overrides": value}
        overrides = tuple(str(o) for o in value.get("overrides", []))
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise SweepError(f"{path}: condition {name}: overrides must be key=value, got {bad}")
        conditions[str(name)] = Condition(str(name), str(value.get("label", name)), overrides)
    quick = tree.get("quick") or {}
    for key, known in (("pools", pools), ("conditions", conditions)):
        missing = set(quick.get(key, [])) - set(known)
        if missing:
            raise SweepError(f"{path}: quick.{key} names unknown entries {sorted(missing)}")
    spec = SweepSpec(
        path=path.absolute(),
        pools=pools,
        conditions=conditions,
        seeds=[int(s) for s in tree.get("seeds", [0])],
        overrides=[str(o) for o in tree.get("overrides", [])],
        warm_start=bool(tree.get("warm_start", True)),
        warm_start_seed=_warm_start_seed(tree, path),
        save_trajectories=int(tree.get("save_trajectories", 0)),
        cell_timeout_s=float(tree.get("cell_timeout_s", 3600.0)),
        out=Path(tree.get("out", "runs/ablation")),
        quick=quick,
        pool_overrides=pool_overrides,
    )
    # Every cell's config must validate before anything runs: a typo fails the sweep up front.
    from trainer_jax.config import ConfigError, load_config

    for sel in (spec, spec.select(quick=True)):
        for pool, cfg in sel.pools.items():
            for cond in sel.conditions.values():
                try:
                    load_config(cfg, [*sel.overrides, *sel.pool_overrides.get(pool, ()), *cond.overrides])
                except ConfigError as e:
                    raise SweepError(f"{path}: pool {pool} x condition {cond.name}: {e}") from None
    return spec


def _warm_start_seed(tree: dict, path: Path) -> int | None:
    """``warm_start: shared``'s seed (``warm_start_seed``, default 0), or None for one per seed."""
    mode, seed = tree.get("warm_start", True), tree.get("warm_start_seed")
    if mode == "shared":
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise SweepError(f"{path}: warm_start_seed must be an integer, got {seed!r}")
        return 0 if seed is None else seed
    if not isinstance(mode, bool):
        raise SweepError(f"{path}: warm_start must be true, false or 'shared', got {mode!r}")
    if seed is not None:
        raise SweepError(f"{path}: warm_start_seed goes with warm_start: shared")
    return None


def warm_start_seeds(spec: SweepSpec) -> list[int]:
    """The seeds whose warm start the grid needs: none, each seed's, or the one shared seed."""
    if not spec.warm_start:
        return []
    return [spec.warm_start_seed] if spec.warm_start_seed is not None else list(spec.seeds)


def cells(spec: SweepSpec, out: Path) -> list[Cell]:
    """Every (pool, condition, seed) cell of ``spec`` with its command-line overrides."""
    result = []
    for seed in spec.seeds:
        warm_seed = seed if spec.warm_start_seed is None else spec.warm_start_seed
        warm = [f"model.hf_dir={warm_start_dir(out, warm_seed)}", "sft.steps=0"] if spec.warm_start else []
        for pool, cfg in spec.pools.items():
            for cond in spec.conditions.values():
                overrides = (
                    *spec.overrides,
                    *spec.pool_overrides.get(pool, ()),
                    f"run.seed={seed}",
                    f"run.name={pool}-{cond.name}-s{seed}",
                    *cond.overrides,
                    *warm,
                )
                result.append(
                    Cell(pool, cond.name, seed, cfg, overrides, out / pool / cond.name / f"seed{seed}")
                )
    return result


def warm_start_dir(out: Path, seed: int) -> Path:
    return out / "warm_start" / f"seed{seed}"


def _run_logged(cmd: list[str], log: Path, timeout: float, env: dict[str, str]) -> tuple[int, float]:
    """Run ``cmd`` with output to ``log``; (exit status or -9 on timeout, wall seconds)."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        # Its own session, so a timeout kills the trainer *and* the sampler processes it spawned.
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = -9
    return rc, time.perf_counter() - t0


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except FileNotFoundError:
        return ""


def run_warm_start(spec: SweepSpec, out: Path, seed: int, log=print) -> dict:
    """``mixrl-train sft`` once per seed (with the first pool's config: SFT ignores the groups)."""
    target = warm_start_dir(out, seed)
    if (target / "config.json").exists():
        return {"seed": seed, "skipped": True}
    target.parent.mkdir(parents=True, exist_ok=True)
    cfg = next(iter(spec.pools.values()))
    cmd = [
        str(_bin("mixrl-train")),
        "sft",
        "--config",
        str(cfg),
        "--out",
        str(target),
        *spec.overrides,
        f"run.seed={seed}",
    ]
    log(f"warm start seed {seed}: {' '.join(cmd)}")
    rc, wall = _run_logged(cmd, target.parent / f"seed{seed}.log", spec.cell_timeout_s, dict(os.environ))
    if rc != 0:
        raise RuntimeError(
            f"warm start for seed {seed} failed (exit {rc}):\n{_tail(target.parent / f'seed{seed}.log')}"
        )
    record = {"seed": seed, "wall_s": wall, "command": cmd}
    # Kept beside the weights: a later (resumed) invocation skips the warm start, and the report
    # still counts its time.
    (target.parent / f"seed{seed}.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def run_cell(cell: Cell, *, timeout: float, save_trajectories: int = 0) -> dict:
    """Run one cell in a subprocess; write and return its ``cell.json`` record (never raises)."""
    cell.run_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if save_trajectories:
        env["MIXRL_SAVE_TRAJECTORIES"] = str(save_trajectories)
    cmd = cell.command()
    rc, wall = _run_logged(cmd, cell.run_dir / "train.log", timeout, env)
    record = {
        "pool": cell.pool,
        "condition": cell.condition,
        "seed": cell.seed,
        "returncode": rc,
        "ok": rc == 0,
        "timed_out": rc == -9,
        "wall_s": round(wall, 1),
        "command": cmd,
    }
    if rc != 0:
        record["log_tail"] = _tail(cell.run_dir / "train.log")
    (cell.run_dir / CELL_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


def run_sweep(
    spec: SweepSpec, out: str | os.PathLike | None = None, *, log=print, command: str | None = None
) -> dict:
    """Run every cell of ``spec`` (already ``select``-ed) sequentially; write ``OUT/sweep.json``."""
    out_dir = Path(out or spec.out).absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    warm = [run_warm_start(spec, out_dir, seed, log) for seed in warm_start_seeds(spec)]
    records = []
    grid = cells(spec, out_dir)
    for n, cell in enumerate(grid, 1):
        done = cell.run_dir / CELL_FILE
        if done.exists() and json.loads(done.read_text()).get("ok"):
            records.append(json.loads(done.read_text()) | {"skipped": True})
            log(f"[{n}/{len(grid)}] {cell.pool}/{cell.condition}/seed{cell.seed}: done earlier, skipped")
            continue
        if cell.run_dir.exists():  # a failed or interrupted attempt: start the cell clean
            import shutil

            shutil.rmtree(cell.run_dir)
        log(f"[{n}/{len(grid)}] {cell.pool}/{cell.condition}/seed{cell.seed} ...")
        rec = run_cell(cell, timeout=spec.cell_timeout_s, save_trajectories=spec.save_trajectories)
        log(
            f"[{n}/{len(grid)}] {cell.pool}/{cell.condition}/seed{cell.seed}: "
            f"{'ok' if rec['ok'] else 'FAILED (exit ' + str(rec['returncode']) + ')'} in {rec['wall_s']:.0f}s"
        )
        records.append(rec)
    manifest = {
        "sweep_file": str(spec.path),
        "command": command,
        "out": str(out_dir),
        "pools": {k: str(v) for k, v in spec.pools.items()},
        "pool_overrides": {k: list(spec.pool_overrides.get(k, ())) for k in spec.pools},
        "conditions": {
            k: {"label": c.label, "overrides": list(c.overrides)} for k, c in spec.conditions.items()
        },
        "seeds": spec.seeds,
        "overrides": spec.overrides,
        "warm_start": warm,
        "cells": records,
        "wall_s": round(time.perf_counter() - t0, 1),
        "finished_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }
    previous = out_dir / SWEEP_FILE
    if previous.exists():
        # Wall time of a resumed sweep: what earlier invocations spent plus this one.
        try:
            manifest["wall_s_total"] = round(
                json.loads(previous.read_text()).get("wall_s_total", 0.0) + manifest["wall_s"], 1
            )
        except (json.JSONDecodeError, AttributeError):
            manifest["wall_s_total"] = manifest["wall_s"]
    else:
        manifest["wall_s_total"] = manifest["wall_s"]
    previous.write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


__all__ = ["Cell", "Condition", "SweepError", "SweepSpec", "cells", "load_sweep", "run_cell", "run_sweep",
           "warm_start_seeds"]
