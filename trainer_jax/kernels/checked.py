"""Which fused kernels ``scripts/device_check.sh`` verified, and where: what ``auto`` may pick.

A fused kernel (Pallas, cuDNN, splash) that compiles is not one that computes the right thing on
every chip and every JAX release: Pallas lowering changes between JAX minors and Triton tiles that
fit one GPU's shared memory overflow another's. So ``objective.impl: auto`` and
``model.attention: auto`` pick a fused kernel only where the device check compared it with the
plain reference and it passed -- same platform, same device kind (``NVIDIA H200``) and same JAX
minor version (``0.10``) -- and otherwise the portable XLA path (``xla`` loss, ``blocked``
attention). The check's results live in ``checked.json`` next to this file (package data, so an
installed wheel carries them); ``$MIXRL_CHECKED_KERNELS`` names another file (a site's own
registry, or a test's).

One entry per (kernel, platform, device kind, JAX minor). Merging a new result: a fail replaces a
pass; a pass replaces a fail only when it comes from a newer JAX release than the fail (a kernel
that failed once on a release stays off there: flaky correctness is a failure); otherwise the
newer result replaces the older. Entries from ``--tiny`` runs (toy shapes) are kept as a record
but never enable a kernel.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import tempfile
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

REGISTRY = Path(__file__).with_name("checked.json")
ENV = "MIXRL_CHECKED_KERNELS"

# The fused candidates ``auto`` considers per kind and JAX platform, in order of preference when
# the check measured no time; with times, the fastest passed candidate wins. Platforms not listed
# (CPU) have no fused candidate: interpreted Pallas is far slower than XLA there.
CANDIDATES: dict[str, dict[str, tuple[str, ...]]] = {
    "attention": {"gpu": ("cudnn", "pallas_gpu"), "tpu": ("splash",)},
    "linear_logsumexp": {"gpu": ("pallas",), "tpu": ("pallas",)},
}
# What ``auto`` runs without a passed check (every platform; CPU's long-standing choices).
FALLBACK: dict[str, str] = {"attention": "blocked", "linear_logsumexp": "xla"}
# The config key each kind is chosen by, for the start-up line.
CONFIG_KEY: dict[str, str] = {"attention": "model.attention", "linear_logsumexp": "objective.impl"}


@dataclass(frozen=True)
class Where:
    """The hardware and software a kernel runs on: what a check result is keyed by."""

    platform: str  # JAX's platform: cpu | gpu | tpu
    device_kind: str  # jax.Device.device_kind, e.g. "NVIDIA H200", "TPU v5 lite", "cpu"
    jax_minor: str  # "0.10"

    def describe(self) -> str:
        return f"{self.device_kind} with jax {self.jax_minor}"


def jax_minor(version: str) -> str:
    """``"0.10.2"`` -> ``"0.10"``: results hold across patch releases, not across minors."""
    return ".".join(version.split(".")[:2])


def normalize_platform(platform: str) -> str:
    return "gpu" if platform in ("cuda", "rocm") else platform


@functools.lru_cache(maxsize=8)
def here(platform: str | None = None) -> Where:
    """Where this process runs (``platform``: JAX's default backend unless named). A named
    platform this process has no device for has device kind ``"unknown"`` (never checked)."""
    import jax

    platform = normalize_platform(platform or jax.default_backend())
    try:
        kind = jax.devices(platform)[0].device_kind
    except (RuntimeError, ValueError):  # no such backend in this process
        kind = "unknown"
    return Where(platform, kind, jax_minor(jax.__version__))


def registry_path(path: str | os.PathLike | None = None) -> Path:
    """``path``, else ``$MIXRL_CHECKED_KERNELS``, else the package's ``checked.json``."""
    return Path(path or os.environ.get(ENV) or REGISTRY)


def entry_key(entry: dict) -> tuple[str, str, str, str]:
    return (entry["kernel"], entry["platform"], entry["device_kind"], entry["jax_minor"])


@functools.lru_cache(maxsize=16)
def _load_cached(path: str, mtime_ns: int) -> tuple[dict, ...]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        # An unreadable registry checks nothing: auto takes the XLA paths, and says why once.
        warnings.warn(f"checked-kernel registry {path} is unreadable ({e}); treating it as empty",
                      stacklevel=2)
        return ()
    entries = data.get("entries", []) if isinstance(data, dict) else []
    keys = ("kernel", "platform", "device_kind", "jax_minor")
    return tuple(e for e in entries if isinstance(e, dict) and all(isinstance(e.get(k), str) for k in keys))


def load(path: str | os.PathLike | None = None) -> list[dict]:
    """The registry's entries; an absent file is an empty registry (nothing checked)."""
    p = registry_path(path)
    try:
        mtime = p.stat().st_mtime_ns
    except FileNotFoundError:
        return []
    return list(_load_cached(str(p), mtime))


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("."):
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def _keep_old(old: dict, new: dict) -> bool:
    """Whether merging ``new`` over ``old`` (same key) keeps ``old`` (module docstring)."""
    if old.get("result") == "fail" and new.get("result") == "pass":
        return _version_tuple(new.get("jax", "0")) <= _version_tuple(old.get("jax", "0"))
    return False


def merge(entries: Iterable[dict], new: Iterable[dict]) -> list[dict]:
    """``entries`` with ``new`` merged in, one per key, sorted by key (a stable file to diff)."""
    by_key = {entry_key(e): e for e in entries}
    for e in new:
        k = entry_key(e)
        if k not in by_key or not _keep_old(by_key[k], e):
            by_key[k] = e
    return [by_key[k] for k in sorted(by_key)]


def write(entries: Sequence[dict], path: str | os.PathLike) -> None:
    """Write the registry atomically: a reader sees the old file or the new one, never half."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    body = {"about": "fused kernels checked by scripts/device_check.sh against the reference; "
                     "trainer_jax/kernels/checked.py reads it", "entries": list(entries)}
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(body, f, indent=1, sort_keys=True)
            f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def record(new: Iterable[dict], path: str | os.PathLike | None = None) -> list[dict]:
    """Merge ``new`` results into the registry at ``path`` (see ``registry_path``); return it."""
    p = registry_path(path)
    merged = merge(load(p), new)
    write(merged, p)
    return merged


def make_entry(kernel: str, where: Where, *, passed: bool, max_err: float | None, tolerance: float,
               versions: dict[str, str], tiny: bool = False, **extra) -> dict:
    """One check result. ``versions``: ``jax``, ``jaxlib`` and ``torch`` as installed."""
    return {"kernel": kernel, "platform": where.platform, "device_kind": where.device_kind,
            "jax_minor": where.jax_minor, **versions,
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "result": "pass" if passed else "fail", "max_err": max_err, "tolerance": tolerance,
            "tiny": tiny, **extra}


def lookup(kernel: str, where: Where, path: str | os.PathLike | None = None) -> dict | None:
    """The entry for ``kernel`` (``"attention:pallas_gpu"``) at ``where``, if any."""
    key = (kernel, where.platform, where.device_kind, where.jax_minor)
    return next((e for e in load(path) if entry_key(e) == key), None)


def verdict(kernel: str, where: Where, path: str | os.PathLike | None = None) -> tuple[bool, str]:
    """(passed, why): whether ``kernel`` may be picked by ``auto`` at ``where``, and the reason.
    A kernel that passed but was measured slower than the XLA fallback (``fwd_bwd_s`` >
    ``fallback_s``, both timed by the check) is not picked either: auto is the fast path."""
    name = kernel.split(":", 1)[-1]
    e = lookup(kernel, where, path)
    if e is None:
        return False, f"{name} not checked on {where.describe()}"
    if e.get("tiny"):
        return False, f"{name} checked only at toy shapes (--tiny) on {where.describe()}"
    err, tol = e.get("max_err"), e.get("tolerance")
    numbers = isinstance(err, int | float) and isinstance(tol, int | float)
    if e.get("result") != "pass":
        detail = str(e.get("error") or (f"max err {err:.2g} > {tol:.2g}" if numbers
                                        else "no error figure"))
        return False, f"{name} failed its check on {where.describe()} ({detail[:120]})"
    if not numbers:
        return False, f"{name} has a pass on {where.describe()} without its error figures"
    fused, fallback = e.get("fwd_bwd_s"), e.get("fallback_s")
    if isinstance(fused, int | float) and isinstance(fallback, int | float) and fused > fallback:
        return False, (f"{name} passed on {where.describe()} but was slower than the XLA path "
                       f"({fused * 1e3:.3g} ms vs {fallback * 1e3:.3g} ms forward+backward)")
    return True, (f"{name} checked on {where.describe()} {str(e.get('date', ''))[:10]}, "
                  f"max err {err:.2g} <= {tol:.2g}")


def choose(kind: str, where: Where, path: str | os.PathLike | None = None) -> tuple[str, str]:
    """(implementation, why) that ``auto`` picks for ``kind`` (``attention`` /
    ``linear_logsumexp``) at ``where``: the fastest fused candidate that passed, else the
    fallback, with the reason (every candidate's verdict when none passed)."""
    candidates = CANDIDATES[kind].get(where.platform, ())
    if not candidates:
        return FALLBACK[kind], f"auto: no fused {kind} kernel is a candidate on {where.platform}"
    passed, refused = [], []
    for rank, name in enumerate(candidates):
        ok, why = verdict(f"{kind}:{name}", where, path)
        if ok:
            seconds = (lookup(f"{kind}:{name}", where, path) or {}).get("fwd_bwd_s")
            passed.append((seconds if isinstance(seconds, int | float) else float("inf"), rank, name, why))
        else:
            refused.append(why)
    if passed:
        _, _, name, why = min(passed)
        return name, f"auto: {why}"
    return FALLBACK[kind], "auto: " + "; ".join(refused)


def describe_choice(kind: str, configured: str, where: Where | None = None,
                    path: str | os.PathLike | None = None) -> str:
    """The start-up line's part for ``kind``: what runs and why (``auto``'s reason, or the key
    that named it), e.g. ``attention: blocked (auto: pallas_gpu not checked on NVIDIA H200 with
    jax 0.10)``."""
    label = "attention" if kind == "attention" else "loss kernel"
    if configured != "auto":
        return f"{label}: {configured} (set by {CONFIG_KEY[kind]})"
    name, why = choose(kind, where or here(), path)
    return f"{label}: {name} ({why})"


__all__ = ["CANDIDATES", "ENV", "FALLBACK", "REGISTRY", "Where", "choose", "describe_choice", "here",
           "jax_minor", "load", "lookup", "make_entry", "merge", "record", "registry_path", "verdict",
           "write"]
