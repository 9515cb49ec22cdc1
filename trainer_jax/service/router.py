"""The router: splits the lease budget across sampler groups in proportion to measured throughput.

Samplers pull work, so a faster group already asks more often; what the router bounds is how many
samples each group may hold leased at once (its *quota*): ``share_g * budget``. Shares come from a
small pluggable policy over per-group statistics — the default is proportional to a moving average
of accepted policy tokens per second, with unmeasured groups treated as average (so they get work
and are measured) and a floor so a slow group is never starved of the samples that would show it
has sped up. A later issue adds mismatch- and cost-aware policies with ``register_policy``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping

from trainer_jax.config import RouterConfig


@dataclasses.dataclass
class GroupStats:
    """What a policy sees of one sampler group."""

    name: str
    samplers: int = 0                 # live sessions
    capacity: int = 0                 # sum of the sessions' declared capacities
    tokens_per_s: float | None = None  # moving average; None until first measured
    outstanding: int = 0              # samples leased now
    accepted: int = 0                 # samples accepted so far
    tokens: int = 0                   # policy tokens accepted so far


_SILENT_WINDOWS = 5

RouterPolicy = Callable[[Mapping[str, GroupStats], RouterConfig], dict[str, float]]
POLICIES: dict[str, RouterPolicy] = {}


def register_policy(name: str) -> Callable[[RouterPolicy], RouterPolicy]:
    def deco(fn: RouterPolicy) -> RouterPolicy:
        if name in POLICIES:
            raise ValueError(f"router policy {name!r} is already registered")
        POLICIES[name] = fn
        return fn
    return deco


def _normalise(weights: dict[str, float], min_share: float) -> dict[str, float]:
    total = sum(weights.values())
    if not weights:
        return {}
    if total <= 0:
        return {g: 1.0 / len(weights) for g in weights}
    shares = {g: w / total for g, w in weights.items()}
    if min_share > 0 and len(shares) > 1:
        floor = min(min_share, 1.0 / len(shares))
        # Raise groups below the floor to it and scale the rest down to keep the sum at 1.
        low = {g for g, s in shares.items() if s < floor}
        rest = sum(s for g, s in shares.items() if g not in low)
        scale = (1.0 - floor * len(low)) / rest if rest > 0 else 0.0
        shares = {g: floor if g in low else s * scale for g, s in shares.items()}
    return shares


@register_policy("throughput")
def throughput_policy(groups: Mapping[str, GroupStats], cfg: RouterConfig) -> dict[str, float]:
    """Shares proportional to measured tokens/s; unmeasured groups count as the measured mean."""
    live = {g: s for g, s in groups.items() if s.samplers > 0}
    measured = [s.tokens_per_s for s in live.values() if s.tokens_per_s is not None]
    default = sum(measured) / len(measured) if measured else 1.0
    weights = {g: (s.tokens_per_s if s.tokens_per_s is not None else default) for g, s in live.items()}
    if all(w <= 0 for w in weights.values()):
        weights = {g: 1.0 for g in weights}
    return _normalise(weights, cfg.min_share)


@register_policy("uniform")
def uniform_policy(groups: Mapping[str, GroupStats], cfg: RouterConfig) -> dict[str, float]:
    """Equal shares for every group with a live sampler."""
    return _normalise({g: 1.0 for g, s in groups.items() if s.samplers > 0}, 0.0)


@register_policy("capacity")
def capacity_policy(groups: Mapping[str, GroupStats], cfg: RouterConfig) -> dict[str, float]:
    """Shares proportional to the capacity the groups' samplers declared."""
    return _normalise({g: float(s.capacity) for g, s in groups.items() if s.samplers > 0}, cfg.min_share)


class Router:
    """Per-group throughput (EMA of tokens/s over ``interval_s`` windows) and lease quotas.

    Not thread-safe: the scheduler calls it under its own lock.
    """

    def __init__(self, cfg: RouterConfig, clock: Callable[[], float] = time.monotonic):
        if cfg.policy not in POLICIES:
            raise ValueError(f"service.router.policy: unknown policy {cfg.policy!r}; "
                             f"known: {sorted(POLICIES)}")
        self.cfg = cfg
        self.policy = POLICIES[cfg.policy]
        self.clock = clock
        self.groups: dict[str, GroupStats] = {}
        self._window_tokens: dict[str, int] = {}
        self._window_start = clock()
        self._shares: dict[str, float] = {}
        self._silent: dict[str, int] = {}

    def group(self, name: str) -> GroupStats:
        if name not in self.groups:
            self.groups[name] = GroupStats(name)
            self._window_tokens[name] = 0
        return self.groups[name]

    def record(self, group: str, tokens: int) -> None:
        """Count an accepted sample of ``tokens`` policy tokens from ``group``."""
        g = self.group(group)
        g.accepted += 1
        g.tokens += tokens
        self._window_tokens[group] += tokens
        self._tick()

    def _tick(self) -> None:
        now = self.clock()
        dt = now - self._window_start
        if dt < self.cfg.interval_s:
            return
        a = self.cfg.ema_alpha
        for name, g in self.groups.items():
            rate = self._window_tokens[name] / dt
            if g.tokens_per_s is None:
                # Unmeasured groups count as average; one that stays silent for a few windows
                # while live is measured at 0 (and then lives on the floor share).
                self._silent[name] = self._silent.get(name, 0) + (g.samplers > 0)
                if self._window_tokens[name]:
                    g.tokens_per_s = rate
                elif self._silent[name] >= _SILENT_WINDOWS:
                    g.tokens_per_s = 0.0
            else:
                g.tokens_per_s = a * rate + (1 - a) * g.tokens_per_s
            self._window_tokens[name] = 0
        self._window_start = now

    def shares(self) -> dict[str, float]:
        self._tick()
        self._shares = self.policy(self.groups, self.cfg)
        return self._shares

    def quota(self, group: str, budget: int, unit: int) -> int:
        """Samples ``group`` may hold leased out of ``budget``; at least one ``unit`` when live."""
        share = self.shares().get(group, 0.0)
        return max(unit, math.ceil(share * budget))

    def snapshot(self) -> dict[str, dict]:
        shares = self.shares()
        return {name: {"samplers": g.samplers, "capacity": g.capacity,
                       "tokens_per_s": g.tokens_per_s or 0.0, "share": shares.get(name, 0.0),
                       "outstanding": g.outstanding, "accepted": g.accepted, "tokens": g.tokens}
                for name, g in self.groups.items()}
