"""What the trainer waits for, said while it waits.

A step waits for ``train.prompts_per_step`` complete prompt groups. Every ``MIXRL_WAIT_REPORT_S``
seconds (30 by default, ``trainer_jax.progress.report_every_s``) while it waits, the console gets
one line per sampler group saying how many samplers are registered and what the group lacks (a
``spawn: false`` group with none says how to start them), and the ``train.take_timeout_s`` error
names the same counts, or that no sampler ever registered. Each registration (spawned, external
or fleet alike) is one console line as it happens (``trainer_jax.service.sessions.registration_line``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from trainer_jax.config import RunConfig
from trainer_jax.cost import illustrative_line, illustrative_prices
from trainer_jax.progress import report_every_s
from trainer_jax.service.sessions import registration_line

#: a complete prompt group as the buffer hands it out (``trainer_jax.service.buffer``)
Groups = list


def announce_registrations(service, cfg: RunConfig, print_line: Callable[[str], None]) -> None:
    """From now on every registration with ``service`` is one line, as it happens; groups the
    config runs on this CPU yet prices as accelerators are said once here instead of a warning
    per registering sampler (``trainer_jax.cost.illustrative_prices``)."""
    service.scheduler.on_register.append(lambda s: print_line(registration_line(s)))
    for name in illustrative_prices(cfg.groups):
        service.accelerators[name] = None  # the registration check's expected accelerator
    if line := illustrative_line(cfg.groups):
        print_line(line)


def group_lines(cfg: RunConfig, status: dict, address: str, logs: str) -> list[str]:
    """One line per sampler group: its registered samplers and what it lacks; then any group
    that registered without being in the config."""
    live = Counter(s["group"] for s in status["samplers"] if not s["revoked"])
    samplers = {g: [s for s in status["samplers"] if s["group"] == g and not s["revoked"]] for g in live}
    lines = []
    for g in cfg.groups:
        n = live.get(g.name, 0)
        if g.spawn:
            text = f"group {g.name}: {n} of {g.processes} spawned samplers registered"
            if n < g.processes:
                text += f" (the others are starting or restarting; their logs: {logs}/{g.name}-*.log)"
        else:
            text = f"group {g.name}: {n} samplers registered"
            if n == 0:
                text += (f" (spawn: false — start them with mixrl-sample --trainer {address} --group "
                         f"{g.name} --recipe {g.recipe} ... or mixrl-fleet up)")
        if n:
            accepted = sum(s["accepted"] for s in samplers[g.name])
            leased = sum(s["outstanding"] for s in samplers[g.name])
            text += f", {leased} samples leased, {accepted} accepted"
        lines.append(text)
    known = {g.name for g in cfg.groups}
    for name in sorted(set(live) - known):
        lines.append(f"group {name} (not in the config): {live[name]} samplers registered")
    return lines


def counts(cfg: RunConfig, status: dict) -> str:
    """``bf16=2 fp8=0`` registered samplers per group, and the note that none ever registered."""
    live = Counter(s["group"] for s in status["samplers"] if not s["revoked"])
    names = [g.name for g in cfg.groups] + sorted(set(live) - {g.name for g in cfg.groups})
    text = "registered samplers per group: " + " ".join(f"{n}={live.get(n, 0)}" for n in names)
    if not status["totals"].get("sessions"):
        text += "; no sampler ever registered"
    return text


def take(service, samplers, cfg: RunConfig, n: int, *, print_line: Callable[[str], None],
         every_s: float | None = None) -> Groups:
    """``n`` complete prompt groups from ``service``'s buffer, restarting dead local samplers while
    it waits and saying every ``every_s`` what it waits for; ``TimeoutError`` after
    ``train.take_timeout_s`` naming the counts, ``RuntimeError`` once every local sampler is gone."""
    every_s = report_every_s() if every_s is None else every_s
    start = time.monotonic()
    deadline, report_at = start + cfg.train.take_timeout_s, start + every_s
    groups: Groups = []
    while len(groups) < n:
        groups += service.buffer.take_groups(n - len(groups), timeout=min(1.0, every_s))
        for event in samplers.restart_dead():  # a sampler that died is restarted, with backoff
            print_line(event)
        if samplers.all_dead():
            raise RuntimeError(f"every sampler process exited; see {samplers.logs}")
        now = time.monotonic()
        if len(groups) < n and now >= report_at:
            status = service.status()
            print_line(f"waiting {now - start:.0f}s for {n} complete prompt groups (have {len(groups)}, "
                       f"{status['buffer']['ready_groups']} more ready; train.take_timeout_s="
                       f"{cfg.train.take_timeout_s:g}):")
            for line in group_lines(cfg, status, service.address, str(samplers.logs)):
                print_line(f"  {line}")
            report_at = now + every_s
        if len(groups) < n and now > deadline:
            raise TimeoutError(f"no {n} complete prompt groups within train.take_timeout_s="
                               f"{cfg.train.take_timeout_s:g}s (got {len(groups)}); "
                               f"{counts(cfg, service.status())}")
    return groups


__all__ = ["announce_registrations", "counts", "group_lines", "take"]
