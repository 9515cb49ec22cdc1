"""Checks of a loaded config against the files and devices it names, before anything starts
(``mixrl-train``). The checks ``load_config`` runs on every config (they need no files:
``check_kept_sets``, ``check_wire_limits``, ``check_context_rows``) are ``config.shape_checks``,
re-exported here.

``load_config`` validates what a config says; some keys name files that only the machine that
trains has (a model directory: the shipped configs name ones that do not exist here), so they are
checked by the command that is about to train, right after the config loads and before JAX, the
model or the run directory: the model directory's tokenizer, and the chat template the tasks need
with it. Each problem is a ``ConfigError`` of one line naming the key.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from trainer_jax.config import ConfigError, RunConfig
from trainer_jax.config.shape_checks import (
    check_context_rows,
    check_kept_sets,
    check_wire_limits,
    trajectory_wire_bytes,
)
from trainer_jax.config.yaml_safe import short

# Environments that speak through a model's chat template when the tokenizer is a model's own
# (without one they fall back to the character tokenizer's <bos>/<eos> framing).
TEMPLATE_ENVS = ("dataset", "chat_math", "shell")


def check_model_files(cfg: RunConfig) -> None:
    """``model.hf_dir`` holds a readable ``tokenizer.json``; a task mix with a chat-template
    environment has a template there (or a tokenizer with ``<bos>`` and ``<eos>``, the framing
    those environments fall back to). Raises ``ConfigError``."""
    if not cfg.model.hf_dir:
        return
    from convert.tokenizer import load_chat_template, load_tokenizer, special_token_ids

    d = Path(cfg.model.hf_dir)
    if not d.is_dir():
        raise ConfigError(f"model.hf_dir {str(d)!r} is not a directory")
    if not (d / "tokenizer.json").is_file():
        raise ConfigError(f"model.hf_dir {str(d)!r} has no tokenizer.json")
    try:
        template = load_chat_template(d)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.hf_dir {str(d)!r}: tokenizer_config.json cannot be read: {e}") from None
    needing = sorted({m.env for m in cfg.tasks.mix_entries() if m.env in TEMPLATE_ENVS})
    if template is not None or not needing:
        return
    try:
        specials = special_token_ids(load_tokenizer(d))
    except Exception as e:  # noqa: BLE001  (a corrupt tokenizer.json: the tokenizers error, one line)
        raise ConfigError(f"model.hf_dir {str(d)!r}: tokenizer.json cannot be loaded: "
                          f"{' '.join(str(e).split())[:200]}") from None
    if specials.get("bos") is None or specials.get("eos") is None:
        raise ConfigError(f"model.hf_dir {str(d)!r}: the tokenizer has no chat template "
                          f"(chat_template.jinja or tokenizer_config.json chat_template), which "
                          f"tasks env {'/'.join(needing)} needs")


def host_gpus(env: Mapping[str, str] = os.environ, proc: str | os.PathLike = "/proc/driver/nvidia/gpus",
              dev: str | os.PathLike = "/dev") -> tuple[int | None, str]:
    """How many CUDA devices a process started here with ``env`` sees, and how that was counted,
    without torch: the NVIDIA driver's ``/proc/driver/nvidia/gpus/<bus id>`` entries and the
    ``/dev/nvidiaN`` nodes (the fewer of the two: a container may show one and not the other),
    then ``CUDA_VISIBLE_DEVICES`` (CUDA numbers only the devices it lists, up to its first entry
    that names none). None when the host may have GPUs this cannot count (ROCm's ``/dev/kfd``)."""
    counts, how = [], []
    proc, dev = Path(proc), Path(dev)
    if proc.is_dir():
        counts.append(sum(1 for _ in proc.iterdir()))
        how.append(f"{counts[-1]} in {proc}")
    else:
        how.append(f"no {proc}")
    try:
        nodes = sum(1 for p in dev.iterdir() if re.fullmatch(r"nvidia\d+", p.name))
    except OSError:
        nodes = 0
    if nodes or not counts:
        counts.append(nodes)
        how.append(f"{nodes} {dev}/nvidiaN device nodes")
    found = min(counts)
    if found == 0 and (dev / "kfd").exists():
        return None, f"no NVIDIA GPU, but {dev}/kfd (ROCm) is there"
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return found, ", ".join(how)
    listed = 0
    for entry in (e.strip() for e in visible.split(",")):
        if not (entry.isdigit() and int(entry) < found or entry.startswith(("GPU-", "MIG-"))):
            break  # CUDA ignores this entry and every one after it
        listed += 1
    count = min(listed, found)
    return count, f"{', '.join(how)}; CUDA_VISIBLE_DEVICES={short(visible, 60)} leaves {count}"


def check_host_devices(cfg: RunConfig, env: Mapping[str, str] = os.environ) -> None:
    """Every spawned group's ``device`` exists on this host: ``cuda:N`` needs more than N CUDA
    devices, ``cuda`` at least one (``host_gpus``); ``cpu`` and ``auto`` always exist. Checked by
    the command that spawns samplers, before anything starts (a sampler on a missing GPU failed
    with a traceback half a minute in). Raises ``ConfigError`` naming the group."""
    spawned = [g for g in cfg.groups if g.spawn and g.processes > 0 and g.device.startswith("cuda")]
    if not spawned:
        return
    count, how = host_gpus(env)
    if count is None:
        return
    for g in spawned:
        need = int(g.device.split(":")[1]) + 1 if ":" in g.device else 1
        if need > count:
            raise ConfigError(f"groups[{g.name}].device {g.device}: this host has {count} CUDA "
                              f"device(s) ({how}), so there is no {g.device} here (use device: auto or "
                              "cpu, an index below the count, or spawn: false for samplers elsewhere)")


__all__ = ["TEMPLATE_ENVS", "check_context_rows", "check_host_devices", "check_kept_sets",
           "check_model_files", "check_wire_limits", "host_gpus", "trajectory_wire_bytes"]
