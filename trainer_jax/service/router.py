"""The router: splits the lease budget across sampler groups by a pluggable policy.

Samplers pull work, so a faster group already asks more often; what the router bounds is how many
samples each group may hold leased at once (its *quota*): ``share_g * budget``. Shares come from a
small pluggable policy over per-group statistics. ``throughput`` (the default) is proportional to a
moving average of accepted policy tokens per second, with unmeasured groups treated as average (so
they get work and are measured) and a floor so a slow group is never starved of the samples that
would show it has sped up. ``cost`` weighs each group by the useful samples a dollar buys there *at
full use* (samples per busy replica-second x the useful share the trainer feeds back each step,
over the price per replica-hour, times the group's replicas), within ``min_share``/``max_share`` and
the stability bounds ``max_k3``, ``max_out_of_range`` and ``train.max_staleness`` (a group over a
bound falls to the floor). Busy time, not wall time, is the denominator: a starved group's idle
replicas would otherwise make it look ever dearer and starve it further (realised cost, idle time
included, is reported by ``trainer_jax.cost``, not routed on).

An evaluation-only group (``groups[].eval_only``, named to ``Router.configure``) takes no part in
the split: the policies see only the training groups, its share and quota are 0, and it leases
evaluation tasks alone (which never count against a quota).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Mapping

from trainer_jax.config.base import check_registry
from trainer_jax.config.service import ROUTER_POLICIES, RouterConfig


@dataclasses.dataclass
class GroupStats:
    """What a policy sees of one sampler group."""

    name: str
    samplers: int = 0                 # live sessions
    capacity: int = 0                 # sum of the sessions' declared capacities
    tokens_per_s: float | None = None  # moving average; None until first measured
    outstanding: int = 0              # samples leased now
    accepted: int = 0                 # samples accepted so far
    eval_accepted: int = 0            # of which evaluation samples (never trained)
    tokens: int = 0                   # policy tokens accepted so far
    busy_replica_s: float = 0.0       # integral of busy replicas (samplers x leased / capacity)
    samples_per_busy_s: float | None = None  # moving average: samples per busy replica-second
    price_per_hour: float | None = None      # USD per replica-hour (the run config's price)
    # Fed by the trainer each step (Router.observe); None until then.
    useful_share: float | None = None  # policy tokens inside [c_min, c_max], not dropped
    k3: float | None = None            # the group's probe KL (else its trained samples' k3)
    out_of_range: float | None = None  # share of its trained tokens outside [c_min, c_max]
    stale: bool = False                # its trained samples' mean staleness above max_staleness

    def busy_replicas(self) -> float:
        """Replicas at work now: live samplers times the leased share of their capacity."""
        if self.samplers <= 0 or self.capacity <= 0:
            return 0.0
        return self.samplers * min(1.0, self.outstanding / self.capacity)


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


def _capped(shares: dict[str, float], max_share: float) -> dict[str, float]:
    """Shares with none above ``max_share``: the excess goes to the others in proportion (a few
    rounds, as a share lifted by the excess may cross the cap in turn)."""
    if max_share >= 1 or len(shares) * max_share < 1:
        return shares
    shares = dict(shares)
    for _ in range(len(shares)):
        over = {g for g, s in shares.items() if s > max_share + 1e-12}
        if not over:
            break
        excess = sum(shares[g] - max_share for g in over)
        free = {g: s for g, s in shares.items() if s < max_share}
        room = sum(free.values())
        for g in over:
            shares[g] = max_share
        for g, s in free.items():  # equal parts when the rest have no weight at all
            shares[g] = s + excess * (s / room if room > 0 else 1.0 / len(free))
    return shares


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


def over_bounds(g: GroupStats, cfg: RouterConfig) -> str | None:
    """Why ``g`` breaks a stability bound of ``cfg`` (then policy cost floors it), else None."""
    if cfg.max_k3 is not None and g.k3 is not None and g.k3 > cfg.max_k3:
        return f"k3 {g.k3:.3g} > max_k3 {cfg.max_k3:g}"
    oor = g.out_of_range
    if cfg.max_out_of_range is not None and oor is not None and oor > cfg.max_out_of_range:
        return f"out_of_range {g.out_of_range:.3g} > max_out_of_range {cfg.max_out_of_range:g}"
    if g.stale:
        return "staleness above train.max_staleness"
    return None


def _mean_or(values: list[float | None], default: float) -> float:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else default


@register_policy("cost")
def cost_policy(groups: Mapping[str, GroupStats], cfg: RouterConfig) -> dict[str, float]:
    """Shares proportional to useful samples per dollar at full use, times the group's replicas.

    weight = samplers x samples_per_busy_s x useful_share / price_per_hour. Unmeasured rates and
    shares count as the measured mean (so a new group gets work and is measured); a group without
    a price, or over a stability bound (``over_bounds``), gets weight 0 and so the floor
    ``min_share``; no group exceeds ``max_share``.
    """
    live = {g: s for g, s in groups.items() if s.samplers > 0}
    rate = _mean_or([s.samples_per_busy_s for s in live.values()], 1.0)
    useful = _mean_or([s.useful_share for s in live.values()], 1.0)
    weights = {}
    for name, s in live.items():
        if not s.price_per_hour or over_bounds(s, cfg):  # None or 0: no price to weigh by
            weights[name] = 0.0
            continue
        r = s.samples_per_busy_s if s.samples_per_busy_s is not None else rate
        u = s.useful_share if s.useful_share is not None else useful
        weights[name] = s.samplers * r * u / s.price_per_hour
    return _capped(_normalise(weights, cfg.min_share), cfg.max_share)


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
        self._window_samples: dict[str, int] = {}
        self._window_busy: dict[str, float] = {}
        self._last = clock()
        self.prices: dict[str, float | None] = {}
        self.max_staleness: int | None = None
        self.eval_only: frozenset[str] = frozenset()

    def configure(self, prices: Mapping[str, float | None], max_staleness: int | None = None,
                  eval_only: Iterable[str] = ()) -> None:
        """The run config's prices per group (USD per replica-hour), ``train.max_staleness`` and
        the evaluation-only groups (``groups[].eval_only``: no training share)."""
        self.prices = dict(prices)
        self.max_staleness = max_staleness
        self.eval_only = frozenset(eval_only)
        for name, g in self.groups.items():
            g.price_per_hour = self.prices.get(name)

    def group(self, name: str) -> GroupStats:
        if name not in self.groups:
            self.groups[name] = GroupStats(name, price_per_hour=self.prices.get(name))
            self._window_tokens[name] = 0
            self._window_samples[name] = 0
            self._window_busy[name] = 0.0
        return self.groups[name]

    def record(self, group: str, tokens: int, evaluation: bool = False) -> None:
        """Count an accepted sample of ``tokens`` policy tokens from ``group``. An evaluation
        sample counts towards tokens/s but not samples per busy replica-second: its lease is not
        in ``outstanding``, so its time is not in the busy integral either."""
        self._integrate()
        g = self.group(group)
        g.accepted += 1
        g.eval_accepted += evaluation
        g.tokens += tokens
        self._window_tokens[group] += tokens
        self._window_samples[group] += not evaluation
        self._tick()

    def observe(self, group: str, *, useful_share: float | None = None, k3: float | None = None,
                out_of_range: float | None = None, staleness: float | None = None) -> None:
        """The trainer's per-step feedback on ``group``'s trained samples (policy cost routes on
        it). A share is smoothed like the rates; bounds are judged on the newest value."""
        g = self.group(group)
        if useful_share is not None and math.isfinite(useful_share):
            a = self.cfg.ema_alpha
            g.useful_share = (useful_share if g.useful_share is None
                              else a * useful_share + (1 - a) * g.useful_share)
        if k3 is not None and math.isfinite(k3):
            g.k3 = k3
        if out_of_range is not None and math.isfinite(out_of_range):
            g.out_of_range = out_of_range
        if staleness is not None and self.max_staleness is not None and math.isfinite(staleness):
            g.stale = staleness > self.max_staleness

    def _integrate(self) -> None:
        """Busy replica-seconds since the last event, at the outstanding counts held since then
        (called before every change the scheduler makes through the router)."""
        now = self.clock()
        dt = now - self._last
        self._last = now
        if dt <= 0:
            return
        for name, g in self.groups.items():
            busy = g.busy_replicas() * dt
            g.busy_replica_s += busy
            self._window_busy[name] += busy

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
            if self._window_busy[name] > 0 and self._window_samples[name]:
                per_busy = self._window_samples[name] / self._window_busy[name]
                g.samples_per_busy_s = (per_busy if g.samples_per_busy_s is None
                                        else a * per_busy + (1 - a) * g.samples_per_busy_s)
            self._window_tokens[name] = 0
            self._window_samples[name] = 0
            self._window_busy[name] = 0.0
        self._window_start = now

    def is_eval_only(self, group: str) -> bool:
        """Whether ``group`` leases evaluation tasks only (never training tasks)."""
        return group in self.eval_only

    def shares(self) -> dict[str, float]:
        """Training shares: the policy over the training groups; evaluation-only groups get 0."""
        self._integrate()
        self._tick()
        training = {g: s for g, s in self.groups.items() if g not in self.eval_only}
        self._shares = self.policy(training, self.cfg)
        self._shares.update({g: 0.0 for g in self.groups if g in self.eval_only})
        return self._shares

    def quota(self, group: str, budget: int, unit: int) -> int:
        """Training samples ``group`` may hold leased out of ``budget``: at least one ``unit``
        when live, 0 for an evaluation-only group."""
        if group in self.eval_only:
            return 0
        share = self.shares().get(group, 0.0)
        return max(unit, math.ceil(share * budget))

    def snapshot(self) -> dict[str, dict]:
        shares = self.shares()
        return {name: {"samplers": g.samplers, "capacity": g.capacity,
                       "tokens_per_s": g.tokens_per_s or 0.0, "share": shares.get(name, 0.0),
                       "outstanding": g.outstanding, "accepted": g.accepted, "tokens": g.tokens,
                       "eval_accepted": g.eval_accepted, "eval_only": name in self.eval_only,
                       "busy_replica_s": g.busy_replica_s,
                       "samples_per_busy_s": g.samples_per_busy_s or 0.0,
                       "useful_share": g.useful_share, "over_bounds": over_bounds(g, self.cfg)}
                for name, g in self.groups.items()}


check_registry("router policy", POLICIES, ROUTER_POLICIES)
