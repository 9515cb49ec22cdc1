"""One metrics sink (JSONL + TensorBoard), collapse alarms, and plots of a run directory.

Every step writes one flat record ``{"step": s, "name": value, ...}``: per-group values are named
``group/{name}/{metric}`` and termination shares ``termination/{reason}``, so a record is easy to
grep, to load with pandas, and to plot.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

METRICS_FILE = "metrics.jsonl"

# The curves `mixrl-train plot` draws, each a list of metric-name prefixes (one line per match).
PLOTS = {
    "reward": ["reward_mean", "pass_rate", "eval/pass@1"],
    "kl": ["k3", "group/*/k3"],
    # The version probe (trainer_jax.service.probe_report) beside the k3 of trained samples.
    "probe_kl": ["group/*/probe_kl", "group/*/k3"],
    "grad_norm": ["grad_norm"],
    "entropy": ["entropy"],
    "out_of_range": ["out_of_range", "group/*/out_of_range"],
    "loss": ["loss"],
    "throughput": ["tokens_per_s", "trainer_idle_share"],
    # What the fleet costs and buys (trainer_jax.cost; only with prices).
    "cost": ["cost/usd_total"],
    "usd_per_useful_sample": ["cost/usd_per_useful_sample", "group/*/usd_per_useful_sample"],
    "useful_share": ["group/*/useful_share"],
    "terminations": ["termination/*"],
    # Tool episodes in the model's format: shares of turns (the seed's collapse signatures).
    "tool_calls": ["tool/*", "group/*/tool_malformed", "group/*/tool_empty", "group/*/tool_toolless"],
    # Long agentic episodes (trainer_jax.episode_log): length, turns, tool-call outcomes, version lag.
    "episode_length": ["episode/tokens", "episode/tokens_max"],
    "episode_turns": ["episode/turns", "episode/turns_max"],
    "tool_outcomes": ["tool/outcome/*", "tool/call_rate"],
    "version_lag": ["episode/version_lag", "episode/version_lag_max", "episode/versions",
                    "episode/spans_reload"],
    "reward_failures": ["reward_errors", "reward_timeouts", "group/*/reward_errors",
                        "group/*/reward_timeouts"],
}


class _TensorBoardEvents:
    """A TensorBoard event file written in the caller's thread: one event per step, flushed.

    tensorboardX's ``SummaryWriter`` writes from a thread behind a bounded queue; when that
    thread dies (a full disk) the next ``add_scalar`` blocks forever on the full queue and the
    run hangs instead of stopping. Here a failed write raises ``OSError`` where the step is
    written, like the JSONL beside it.

    tensorboardX imports torch when it is installed (only to accept torch tensors as values); the
    trainer process must not load torch (it would contend with JAX for accelerator memory), so a
    ``None`` entry in ``sys.modules`` makes that import fail as if torch were absent.
    """

    def __init__(self, path: Path):
        import sys

        hide = "torch" not in sys.modules
        if hide:
            sys.modules["torch"] = None  # type: ignore[assignment]
        try:
            from tensorboardX.event_file_writer import EventsWriter
            from tensorboardX.proto.event_pb2 import Event
            from tensorboardX.proto.summary_pb2 import Summary
        finally:
            if hide:
                del sys.modules["torch"]
        path.mkdir(parents=True, exist_ok=True)
        self._event, self._summary = Event, Summary
        self._writer = EventsWriter(str(path / "events"))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        values = [self._summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
        event = self._event(wall_time=time.time(), step=step, summary=self._summary(value=values))
        self._writer.write_event(event)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MetricsSink:
    """``metrics.jsonl``, TensorBoard, and Weights & Biases when ``wandb`` (``{project, mode}``,
    the config's ``logging.wandb``) is given."""

    def __init__(self, run_dir: str | os.PathLike, *, tensorboard: bool = True, wandb: dict | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.run_dir / METRICS_FILE, "a", buffering=1)
        self._tb = None
        if tensorboard:
            self._tb = _TensorBoardEvents(self.run_dir / "tensorboard")
        self._wandb, self._wandb_step = None, -1
        if wandb is not None:
            import wandb as wb

            # Files under the run directory; resuming the run directory resumes the W&B run.
            self._wandb = wb.init(project=wandb["project"], mode=wandb.get("mode", "offline"),
                                  dir=str(self.run_dir), name=self.run_dir.name, resume="allow",
                                  id=f"{self.run_dir.name}-{_digest(self.run_dir.absolute())}")

    def write(self, step: int, values: dict[str, float]) -> None:
        record = {"step": int(step)}
        record.update({k: _plain(v) for k, v in values.items()})
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            self._tb.write(int(step), {k: float(v) for k, v in record.items() if k != "step"
                                       and isinstance(v, (int, float)) and math.isfinite(v)})
        # W&B steps only move forward: warm-start records (negative steps) stay in the JSONL.
        if self._wandb is not None and step >= max(0, self._wandb_step):
            self._wandb.log({k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))},
                            step=int(step))
            self._wandb_step = int(step)

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _digest(path: Path) -> str:
    import hashlib

    return hashlib.sha1(str(path).encode()).hexdigest()[:8]


def _plain(v):
    try:
        v = float(v)
    except (TypeError, ValueError):
        return v
    return v if math.isfinite(v) else None


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (not a run directory?)")
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            # A run killed mid-write leaves a partial last line; anything else is corruption.
            if n != len(path.read_text().splitlines()):
                raise ValueError(f"{path}:{n} is not valid JSON") from None
    return records


def alarm_settle_steps(warmup_steps: int) -> int:
    """Steps before the KL alarm takes its baseline: the learning-rate warmup plus the first round
    trips of weights, during which k3 measures little but the precision mismatch."""
    return warmup_steps + 5


class CollapseAlarms:
    """The failure signs of the seed experiment, checked every step.

    - reward collapse: the moving average falls below ``reward_drop`` x its best after warmup;
    - KL blow-up: the moving average of k3 exceeds ``kl_factor`` x its level over the
      ``baseline_steps`` steps after the first ``settle_steps`` (the learning-rate warmup and the
      first round trip of weights, during which k3 is still far below its working level); once
      raised it holds until the average falls below ``kl_clear_factor`` x that level, so a k3 that
      hovers around the threshold does not raise and clear it every few steps;
    - empty replies: their share rises above ``empty_share``;
    - tool calls stopping (the write-up's collapse signature: an agent that stops calling tools):
      the moving average of ``tool/call_rate`` falls below ``call_rate_drop`` x its best.
    """

    def __init__(self, *, baseline_steps: int = 5, window: int = 5, reward_drop: float = 0.5,
                 kl_factor: float = 3.0, kl_clear_factor: float = 2.0, empty_share: float = 0.3,
                 settle_steps: int = 0, call_rate_drop: float = 0.5):
        if not 0 < kl_clear_factor <= kl_factor:
            raise ValueError(f"kl_clear_factor must lie in (0, kl_factor={kl_factor}], got {kl_clear_factor}")
        self.baseline_steps, self.window, self.settle_steps = baseline_steps, window, settle_steps
        self.reward_drop, self.kl_factor, self.empty_share = reward_drop, kl_factor, empty_share
        self.kl_clear_factor = kl_clear_factor
        self._kl_raised = False
        self.rewards: list[float] = []
        self.kls: list[float] = []
        self.best_reward = -math.inf
        self._raised: set[str] = set()
        self.call_rate_drop, self.call_rates, self.best_call_rate = call_rate_drop, [], -math.inf

    def update(self, reward: float | None, k3: float | None, empty_share: float | None, *,
               call_rate: float | None = None) -> list[str]:
        alarms = []
        if call_rate is not None:
            self.call_rates.append(call_rate)
            recent = self.call_rates[-self.window:]
            avg = sum(recent) / len(recent)
            if len(self.call_rates) >= self.window:
                self.best_call_rate = max(self.best_call_rate, avg)
            if self.best_call_rate > 0 and avg < self.call_rate_drop * self.best_call_rate:
                alarms.append(f"tool calls falling: call rate {avg:.2f} vs best {self.best_call_rate:.2f}")
        if reward is not None:
            self.rewards.append(reward)
            avg = sum(self.rewards[-self.window:]) / len(self.rewards[-self.window:])
            if len(self.rewards) >= self.window:
                self.best_reward = max(self.best_reward, avg)
            if (len(self.rewards) > self.baseline_steps + self.window and self.best_reward > 0
                    and avg < self.reward_drop * self.best_reward):
                alarms.append(f"reward collapsing: {avg:.3f} vs best {self.best_reward:.3f}")
        if k3 is not None:
            self.kls.append(k3)
            early = self.kls[self.settle_steps: self.settle_steps + self.baseline_steps]
            if len(self.kls) > self.settle_steps + self.baseline_steps + self.window:
                base = sum(early) / self.baseline_steps
                avg = sum(self.kls[-self.window:]) / self.window
                limit = self.kl_clear_factor if self._kl_raised else self.kl_factor
                self._kl_raised = base > 0 and avg > limit * base
                if self._kl_raised:
                    alarms.append(f"KL blow-up: k3 at {avg / base:.1f}x its early level ({avg:.2e})")
        if empty_share is not None and empty_share > self.empty_share:
            alarms.append(f"empty replies: {empty_share:.0%} of episodes")
        return alarms

    def transitions(self, alarms: list[str]) -> list[str]:
        """What changed since the last call: alarms newly raised, and ``cleared: ...`` for ended ones.

        ``update`` reports every active alarm every step (the metrics count them); a console wants
        only the edges, or a long KL excursion prints the same line hundreds of times.
        """
        kinds = {a.split(":", 1)[0]: a for a in alarms}  # "KL blow-up: ..." -> "KL blow-up"
        raised = [a for kind, a in kinds.items() if kind not in self._raised]
        cleared = [f"cleared: {kind}" for kind in sorted(self._raised - kinds.keys())]
        self._raised = set(kinds)
        return raised + cleared


class AdvantageAlarm:
    """Groups whose float32 advantages came out NaN or inf (``batching.non_finite_advantages``).

    The objective drops such tokens and counts them in ``dropped`` with every other inconsistent
    record; this names the reason. ``check`` returns the step's metrics,
    ``dropped/non_finite_advantage`` (the share of the step's policy tokens that belong to such
    groups, a part of ``dropped``) and ``dropped/non_finite_advantage_groups``, and the alarm: one
    line, the first time only, naming the group (its task, sampler groups and reward range).
    """

    def __init__(self) -> None:
        self.raised = False
        self.groups_total = 0

    def check(self, groups: list, advantages: np.ndarray) -> tuple[dict[str, float], list[str]]:
        """``groups``: the step's ``TrajectoryGroup`` s, in the order of ``advantages`` [P, G]."""
        from trainer_jax.batching import non_finite_advantages

        bad = non_finite_advantages(advantages)
        tokens = [[int(np.sum(t.loss_mask)) for t in g.trajectories] for g in groups]
        total = sum(map(sum, tokens))
        dropped = sum(sum(n) for n, b in zip(tokens, bad, strict=True) if b)
        values = {"dropped/non_finite_advantage": dropped / max(total, 1),
                  "dropped/non_finite_advantage_groups": float(bad.sum())}
        self.groups_total += int(bad.sum())
        alarms = []
        if bad.any() and not self.raised:
            self.raised = True
            i = int(np.argmax(bad))
            g = groups[i]
            rewards = [float(t.reward or 0.0) for t in g.trajectories]
            samplers = sorted({str(getattr(t, "group", "") or "?") for t in g.trajectories})
            alarms.append(
                f"non-finite advantages: the group of task {g.task_id} (sampler group "
                f"{', '.join(samplers)}; rewards {min(rewards):.3g} .. {max(rewards):.3g}) has NaN or "
                f"inf float32 advantages, its {sum(tokens[i])} tokens dropped; this and later "
                "groups are counted in dropped/non_finite_advantage")
        return values, alarms


def _matching(names: Iterable[str], pattern: str) -> list[str]:
    if "*" not in pattern:
        return [pattern] if pattern in names else []
    head, tail = pattern.split("*", 1)
    return sorted(n for n in names if n.startswith(head) and n.endswith(tail) and len(n) > len(head + tail))


def plot_run(run_dir: str | os.PathLike) -> list[Path]:
    """Write ``plots/{name}.png`` for each curve in ``PLOTS`` that the run has; return the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    names = {k for r in records for k in r}
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    for title, patterns in PLOTS.items():
        series = [n for p in patterns for n in _matching(names, p)]
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name in series:
            pts = [(r["step"], r[name]) for r in records if r.get(name) is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), label=name, marker="." if len(pts) < 30 else None)
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{title}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
