"""Reading a sweep's run directories: one ``RunResult`` per cell, and the numbers pooled over cells.

Layout read: ``OUT/{pool}/{condition}/seed{N}/`` as written by ``experiments.sweep`` (``metrics.jsonl``,
``summary.json``, ``cell.json``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from experiments.report.growth import NO_TREND, Trend, k3_trend
from trainer_jax.diagnostics import CollapseAlarms, alarm_settle_steps, read_metrics

# Reward this close to 0 (moving average) after having been clearly above it counts as collapsed.
REWARD_FLOOR = 0.02
# Held-out pass@1 falling below this share of its start counts as a collapse of the policy, whatever
# the training reward's scale (issue 20's chain task pays partial credit of a few hundredths, too
# small for REWARD_FLOOR's absolute test; the seed's collapse is pass@4 going to 0).
EVAL_COLLAPSE = 0.5
# ...and by more than this many standard errors of the difference of two pass rates over the
# run's held-out samples (tasks x eval_k, taken as independent, which if anything understates the
# noise): 15 -> 7 passes of 128 halves pass@1 but is sampling noise (1.8 s.e.).
EVAL_COLLAPSE_SE = 2.0


@dataclasses.dataclass
class RunResult:
    """One cell's numbers (NaN where the run has no such value)."""

    pool: str
    condition: str
    seed: int
    run_dir: Path
    ok: bool
    steps: int = 0
    wall_s: float = math.nan
    eval_start: float = math.nan
    eval_final: float = math.nan
    eval_best: float = math.nan
    collapse_step: int | None = None
    collapse_reason: str = ""
    kl_alarm_step: int | None = None
    mean_k3: float = math.nan
    k3_growth: float = math.nan  # last-third mean k3 / first-third mean k3
    mean_oor: float = math.nan
    k3_start: float = math.nan  # mean k3 of the first 2 steps: before the policy (and staleness) moves
    mean_staleness: float = math.nan
    max_grad_norm: float = math.nan
    entropy_first: float = math.nan
    entropy_last: float = math.nan
    reward_first: float = math.nan
    reward_last: float = math.nan
    #: ln k3 against step over the whole run, and over the steps before the collapse (growth.py)
    trend: Trend = NO_TREND
    pre_collapse: Trend = NO_TREND
    #: the mismatch dial's logit-noise sigma of the run's sampler groups (NaN when not set)
    sigma: float = math.nan
    records: list[dict] = dataclasses.field(default_factory=list, repr=False)
    groups: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    #: per sampler group, its numerics (recipe / KV dtype / attention / logit noise), from the config
    group_recipes: dict[str, str] = dataclasses.field(default_factory=dict)
    error: str = ""
    #: held-out samples behind each pass@1 (eval tasks x eval_k; 0 when unknown)
    eval_samples: int = 0

    @property
    def eval_collapsed(self) -> bool:
        """Held-out pass@1 at the end below ``EVAL_COLLAPSE`` x its start and lower by more than
        ``EVAL_COLLAPSE_SE`` standard errors (False when either is missing)."""
        a, b = self.eval_start, self.eval_final
        if math.isnan(a) or math.isnan(b) or a <= 0 or b >= EVAL_COLLAPSE * a:
            return False
        if self.eval_samples <= 0:  # the sample count is unknown: the ratio alone decides
            return True
        p = (a + b) / 2
        se = math.sqrt(2 * p * (1 - p) / self.eval_samples)
        return a - b > EVAL_COLLAPSE_SE * se

    @property
    def collapsed(self) -> bool:
        """A reward collapse (``collapse_step``) or a held-out collapse (``eval_collapsed``)."""
        return self.collapse_step is not None or self.eval_collapsed


def nanmean(xs: Sequence[float | None]) -> float:
    """Mean of the values that are neither None nor NaN (NaN if there are none)."""
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(np.mean(xs)) if xs else math.nan


def mean_over_seeds(runs: list[RunResult], attr: str) -> float:
    """Mean of ``attr`` over the finished runs among ``runs`` (NaN values skipped)."""
    return nanmean([getattr(r, attr) for r in runs if r.ok])


def grid_order(results: list[RunResult], labels: dict[str, str]) -> tuple[list[str], list[str]]:
    """Pools (mixed first, then by name) and conditions (in ``labels``' order, then by name) present."""
    pools = sorted({r.pool for r in results}, key=lambda p: (p != "mixed", p))
    conds = [c for c in labels if any(r.condition == c for r in results)]
    conds += sorted({r.condition for r in results} - set(conds))
    return pools, conds


def _thirds(xs: list[float]) -> tuple[float, float]:
    """Means of the first and last third (at least one value each) of a series."""
    if not xs:
        return math.nan, math.nan
    k = max(1, len(xs) // 3)
    return float(np.mean(xs[:k])), float(np.mean(xs[-k:]))


def collapse_step(records: list[dict], settle_steps: int = 0) -> tuple[int | None, str, int | None]:
    """First step of a sustained reward collapse, its reason, and the first KL alarm step.

    A collapse is CollapseAlarms' reward alarm (only once its best moving average rose above
    ``REWARD_FLOOR``: a reward that never left ~0 has nothing to collapse from) or empty-reply
    alarm, or the reward's moving average at ~0 after having been above it, holding at *every* step
    from there to the end of the run (and for at least the alarm window): a dip the run recovers
    from is noise of a small batch, not a collapse.
    The KL alarm is the first step at which it fired, with the baseline taken after
    ``settle_steps`` (``alarm_settle_steps``, as the trainer does: before then k3 measures only the
    precision mismatch, and the first stale batches multiply it).

    The alarms' windows (5 steps baseline, 5 steps moving average) are shrunk for short runs, to a
    quarter of the run (at least 2), and so is the settling: with the defaults a run under 11 steps
    could never alarm.
    """
    w = max(2, min(5, len(records) // 4))
    alarms = CollapseAlarms(baseline_steps=w, window=w, settle_steps=min(settle_steps, len(records) // 4))
    rewards: list[float] = []
    first_kl = None
    down: list[tuple[int, str]] = []  # per step: why the run is collapsed there ("" if it is not)
    for r in records:
        fired = alarms.update(r.get("reward_mean"), r.get("k3"), r.get("termination/empty_reply", 0.0))
        if first_kl is None and any(a.startswith("KL") for a in fired):
            first_kl = r["step"]
        noise = alarms.best_reward <= REWARD_FLOOR  # half of a best that never left ~0 is noise
        why = next((a for a in fired if not a.startswith("KL") and not (noise and a.startswith("reward"))),
                   "")
        if r.get("reward_mean") is not None:
            rewards.append(r["reward_mean"])
            window = rewards[-alarms.window :]
            if (
                not why
                and len(rewards) > alarms.window
                and max(rewards) > 5 * REWARD_FLOOR
                and np.mean(window) <= REWARD_FLOOR
            ):
                why = f"reward moving average {np.mean(window):.3f} ~ 0"
        down.append((r["step"], why))
    first_collapse, reason, held = None, "", 0
    for step, why in reversed(down):  # the last run of collapsed steps, if it reaches the end
        if not why:
            break
        first_collapse, reason, held = step, why, held + 1
    if held < w:  # the last few steps of a run dipping: too short to tell from noise
        first_collapse, reason = None, ""
    return first_collapse, reason, first_kl


def _cell_config(cell: dict):
    """The run config a cell ran with (its ``--config`` and overrides), or None when unknown."""
    cmd = [str(c) for c in cell.get("command", [])]
    if "--config" not in cmd:
        return None
    from trainer_jax.config import ConfigError, load_config

    overrides = [c for c in cmd[cmd.index("--config") + 2 :] if "=" in c and not c.startswith("-")]
    try:
        return load_config(cmd[cmd.index("--config") + 1], overrides)
    except (ConfigError, OSError, IndexError, ValueError):
        return None


def _warmup_steps(cfg) -> int:
    """The run's learning-rate warmup (0 if unknown)."""
    return cfg.optimizer.warmup_steps if cfg is not None else 0


def _group_recipes(cfg) -> dict[str, str]:
    """Per sampler group, what sets its numerics: recipe, KV-cache dtype, attention, logit noise."""
    if cfg is None:
        return {}
    return {
        g.name: (f"{g.recipe}/kv={g.kv_cache_dtype or 'default'}/attn={g.attention or 'default'}"
                 f"/noise={g.logit_noise or 0}")
        for g in cfg.groups
    }


def group_attribution(records: list[dict]) -> dict[str, dict[str, float]]:
    """Per sampler group over a run: share of samples, share of tokens, share of the out-of-range
    tokens, and its own token-weighted mean k3 and out-of-range rate."""
    names = sorted(
        {k.split("/")[1] for r in records for k in r if k.startswith("group/") and k.count("/") == 2}
    )
    samples, tokens, oor, k3w = ({g: 0.0 for g in names} for _ in range(4))
    for r in records:
        for g in names:
            share = r.get(f"group/{g}/sample_share")
            n_trained = r.get("samples_trained") or 0
            if share is not None:
                samples[g] += share * max(n_trained, 1)
            t = r.get(f"group/{g}/tokens") or 0.0
            tokens[g] += t
            if r.get(f"group/{g}/out_of_range") is not None:
                oor[g] += r[f"group/{g}/out_of_range"] * t
            if r.get(f"group/{g}/k3") is not None:
                k3w[g] += r[f"group/{g}/k3"] * t
    tot_s, tot_t, tot_o = sum(samples.values()), sum(tokens.values()), sum(oor.values())
    out = {}
    for g in names:
        out[g] = {
            "sample_share": samples[g] / tot_s if tot_s else math.nan,
            "token_share": tokens[g] / tot_t if tot_t else math.nan,
            "oor_share": oor[g] / tot_o if tot_o else math.nan,
            "oor_rate": oor[g] / tokens[g] if tokens[g] else math.nan,
            "k3": k3w[g] / tokens[g] if tokens[g] else math.nan,
            "tokens": tokens[g],
        }
    return out


def pooled_attribution(runs: list[RunResult]) -> dict[str, dict[str, float]]:
    """Attribution pooled over runs: token/sample/out-of-range totals summed, then shares (sample
    share: the runs' shares summed, each run weighing the same; policy-token share: tokens summed)."""
    acc: dict[str, dict[str, float]] = {}
    for run in runs:
        if not run.ok:
            continue
        for g, v in run.groups.items():
            a = acc.setdefault(g, {"samples": 0.0, "tokens": 0.0, "oor": 0.0, "k3": 0.0})
            a["samples"] += v["sample_share"] if not math.isnan(v["sample_share"]) else 0.0
            a["tokens"] += v["tokens"]
            a["oor"] += (v["oor_rate"] * v["tokens"]) if not math.isnan(v["oor_rate"]) else 0.0
            a["k3"] += (v["k3"] * v["tokens"]) if not math.isnan(v["k3"]) else 0.0
    ts = sum(a["samples"] for a in acc.values())
    to = sum(a["oor"] for a in acc.values())
    tt = sum(a["tokens"] for a in acc.values())
    return {
        g: {
            "sample_share": a["samples"] / ts if ts else math.nan,
            # policy tokens scored (the loss's valid tokens, ``group/{g}/tokens``): the unit the
            # out-of-range rate is counted in, so claim 4's over-representation uses it too
            "token_share": a["tokens"] / tt if tt else math.nan,
            "tokens": a["tokens"],
            "oor_share": a["oor"] / to if to else math.nan,
            "oor_rate": a["oor"] / a["tokens"] if a["tokens"] else math.nan,
            "k3": a["k3"] / a["tokens"] if a["tokens"] else math.nan,
        }
        for g, a in sorted(acc.items())
    }


_SIGMA = re.compile(r"logit_noise[\"']?\s*[:=]\s*([0-9.eE+-]+)")


def dial_sigma(cell: dict) -> float:
    """The ``logit_noise`` of a cell's sampler groups, read off its command (NaN when none is set;
    the largest when groups differ)."""
    found = [float(m) for c in cell.get("command", []) for m in _SIGMA.findall(str(c))]
    return max(found) if found else math.nan


ARCHIVED_METRICS = "metrics.jsonl.gz"
# The report's module commands as an archived sweep.json may have recorded them: the package moved
# from trainer_jax.report to experiments.report (issue 47).
_OLD_MODULE = re.compile(r"(-m\s+)trainer_jax\.report\.")


def current_command(command: str) -> str:
    """A recorded command as it runs today: ``python -m trainer_jax.report.X`` becomes ``python -m
    experiments.report.X``. The archive keeps what was run; a report prints what to run."""
    return _OLD_MODULE.sub(r"\1experiments.report.", command)


def run_metrics(run_dir: Path) -> list[dict]:
    """A run's metrics records: ``metrics.jsonl``, or the gzipped copy ``report.archive`` keeps in
    the repository (a 192-step run's records are ~1 MB of JSON, ~10x less compressed)."""
    gz = Path(run_dir) / ARCHIVED_METRICS
    if not (Path(run_dir) / "metrics.jsonl").exists() and gz.exists():
        import gzip

        with gzip.open(gz, "rt") as f:
            return [json.loads(line) for line in f if line.strip()]
    return read_metrics(run_dir)


def summarize_run(run_dir: Path, pool: str, condition: str, seed: int) -> RunResult:
    """Read one cell's directory into a ``RunResult`` (a failed cell keeps ``ok=False``)."""
    cell = {}
    if (run_dir / "cell.json").exists():
        cell = json.loads((run_dir / "cell.json").read_text())
    res = RunResult(
        pool,
        condition,
        seed,
        run_dir,
        ok=bool(cell.get("ok", (run_dir / "summary.json").exists())),
        wall_s=float(cell.get("wall_s", math.nan)),
    )
    if not res.ok:
        res.error = (cell.get("log_tail") or "no cell.json / summary.json").strip().splitlines()[-1:][0:1]
        res.error = res.error[0] if res.error else "failed"
    try:
        records = run_metrics(run_dir)
    except (FileNotFoundError, ValueError) as e:
        res.ok, res.error = False, res.error or str(e)
        return res
    steps = [r for r in records if r.get("step", 0) > 0 and "loss" in r]
    res.records, res.steps = steps, len(steps)
    summary = {}
    if (run_dir / "summary.json").exists():
        summary = json.loads((run_dir / "summary.json").read_text())
    res.eval_start = summary.get("eval_start", {}).get("eval/pass@1", math.nan)
    evals = [r["eval/pass@1"] for r in records if r.get("step", 0) > 0 and r.get("eval/pass@1") is not None]
    res.eval_final = summary.get("eval_end", {}).get("eval/pass@1", evals[-1] if evals else math.nan)
    res.eval_best = max(evals) if evals else res.eval_final
    # The same KL baseline as the trainer's own alarm.
    cfg = _cell_config(cell)
    settle = alarm_settle_steps(_warmup_steps(cfg))
    res.group_recipes = _group_recipes(cfg)
    if cfg is not None:
        res.eval_samples = cfg.train.eval_tasks * cfg.train.eval_k
    res.collapse_step, res.collapse_reason, res.kl_alarm_step = collapse_step(steps, settle)
    k3 = [r["k3"] for r in steps if r.get("k3") is not None]
    res.mean_k3 = nanmean(k3)
    a, b = _thirds(k3)
    res.k3_growth = b / a if a and a > 0 else math.nan
    res.mean_oor = nanmean([r.get("out_of_range") for r in steps])
    res.k3_start = nanmean(k3[:2])
    res.mean_staleness = nanmean([r.get("staleness") for r in steps])
    gn = [r["grad_norm"] for r in steps if r.get("grad_norm") is not None]
    res.max_grad_norm = max(gn) if gn else math.nan
    res.entropy_first, res.entropy_last = _thirds(
        [r["entropy"] for r in steps if r.get("entropy") is not None]
    )
    res.reward_first, res.reward_last = _thirds(
        [r["reward_mean"] for r in steps if r.get("reward_mean") is not None]
    )
    res.groups = group_attribution(steps)
    res.trend = k3_trend(steps)
    if res.collapse_step is not None:
        res.pre_collapse = k3_trend(steps, until=res.collapse_step)
    res.sigma = dial_sigma(cell)
    return res


def collect(out: str | os.PathLike) -> list[RunResult]:
    """Every ``{pool}/{condition}/seed{N}`` directory under ``out`` (the warm start excluded)."""
    out = Path(out)
    results = []
    for seed_dir in sorted(out.glob("*/*/seed*")):  # pool/condition/seedN
        pool, condition = seed_dir.parent.parent.name, seed_dir.parent.name
        if pool == "warm_start" or not seed_dir.is_dir():
            continue
        try:
            seed = int(seed_dir.name[4:])
        except ValueError:
            continue
        results.append(summarize_run(seed_dir, pool, condition, seed))
    return results
