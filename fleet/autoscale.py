"""Which replica to move between groups, from the trainer's per-group signals (pure; no Ray).

The signals come from the rollout service's ``Status`` (``pb.GroupStatus``, read over gRPC by
the controller): a group's accepted policy tokens per second, its samplers and the samples they
hold leased now. Where the trainer reports a group's ``useful_share`` (policy tokens kept by the
objective: not dropped, importance ratio in range) or ``idle_share`` on the wire, those are used;
otherwise the useful share is unknown (taken as 1: nothing known to be masked) and a group's idle
share is ``1 - leased / (samplers x capacity)``, the part of its lease slots holding no work (a
group the router starves, or whose samplers wait on the trainer). The controller smooths both
over its ticks (``smooth``) before ``decide``.

One move per decision, from a *donor* to a *receiver*: donors are groups above ``min_processes``
whose samples are mostly masked or which are mostly idle (``shrink_at``), the worst first;
the receiver is the group below ``max_processes`` (not itself a donor) with the most useful
tokens per second per replica per USD/h (per replica where a group has no price). No donor, no
move: the fleet's size and cost stay what the config (or the plan) bought.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

SHRINK_AT = 0.5


@dataclasses.dataclass
class GroupSignal:
    """One group's state for a decision; ``None``: not measured."""

    name: str
    replicas: int
    lo: int
    hi: int
    price: float | None
    tokens_per_s: float | None = None  # accepted policy tokens per second, the whole group
    useful_share: float | None = None
    idle_share: float | None = None

    @property
    def masked(self) -> float | None:
        return None if self.useful_share is None else 1.0 - self.useful_share

    def useful_per_replica_usd(self) -> float | None:
        """Useful tokens per second per replica per USD/h (per replica when unpriced)."""
        if self.tokens_per_s is None or self.replicas <= 0:
            return None
        useful = self.tokens_per_s * (1.0 if self.useful_share is None else self.useful_share)
        return useful / self.replicas / (self.price if self.price else 1.0)


@dataclasses.dataclass(frozen=True)
class Move:
    donor: str
    receiver: str
    why: str


def _has(msg, field: str) -> bool:
    """Whether ``msg`` carries ``field``: set, for an optional field; a trainer whose wire predates
    the field has none."""
    return field in msg.DESCRIPTOR.fields_by_name and msg.HasField(field)


def read_status(status, capacity: Mapping[str, int]) -> dict[str, dict[str, float | None]]:
    """``{group: {tokens_per_s, useful_share, idle_share}}`` from a ``pb.StatusResponse``;
    ``capacity``: the samples a replica of each group leases per round."""
    out: dict[str, dict[str, float | None]] = {}
    for g in status.groups:
        useful = float(g.useful_share) if _has(g, "useful_share") else None  # 0: all masked
        if _has(g, "idle_share"):
            idle: float | None = float(g.idle_share)
        elif g.samplers > 0 and capacity.get(g.name):
            idle = max(0.0, 1.0 - g.outstanding / (g.samplers * capacity[g.name]))
        else:
            idle = None
        out[g.name] = {"tokens_per_s": float(g.tokens_per_s), "useful_share": useful, "idle_share": idle}
    return out


def smooth(old: float | None, new: float | None, alpha: float = 0.3) -> float | None:
    """An exponential moving average that keeps the old value when nothing new was measured."""
    if new is None:
        return old
    return new if old is None else alpha * new + (1 - alpha) * old


def decide(groups: list[GroupSignal], shrink_at: float = SHRINK_AT) -> Move | None:
    """The one replica to move now, or None."""
    def badness(g: GroupSignal) -> float:
        return max(g.masked or 0.0, g.idle_share or 0.0)

    donors = sorted((g for g in groups if g.replicas > g.lo and badness(g) >= shrink_at),
                    key=badness, reverse=True)
    if not donors:
        return None
    donor = donors[0]
    bad = {g.name for g in groups if badness(g) >= shrink_at}
    receivers = [(g.useful_per_replica_usd(), g) for g in groups
                 if g.name not in bad and g.replicas < g.hi and g.useful_per_replica_usd() is not None]
    if not receivers:
        return None
    _, receiver = max(receivers, key=lambda r: r[0])
    reason = ("masked" if (donor.masked or 0.0) >= (donor.idle_share or 0.0) else "idle")
    return Move(donor.name, receiver.name,
                f"{donor.name} is {badness(donor):.0%} {reason}; {receiver.name} has the most useful "
                f"tokens/s per replica per USD/h ({receiver.useful_per_replica_usd():.3g})")
