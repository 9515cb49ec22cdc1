"""Checks of a loaded config against the files it names, before anything starts (``mixrl-train``),
and ``check_kept_sets`` / ``check_wire_limits``, which ``load_config`` runs on every config (they
need no files).

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


def check_kept_sets(cfg: RunConfig) -> None:
    """Every kept set a sampler records must fit the learner's ``train.support_k`` columns.

    Top-p alone bounds a kept set by nothing but the vocabulary, so ``tasks.sampling.top_p < 1``
    with ``objective.top_p_replay`` needs ``0 < tasks.sampling.top_k <= train.support_k`` (SGLang
    also returns a kept set only with a finite top-k); a top-k above ``train.support_k`` would have
    every truncated sample refused. Evaluation samples with ``tasks.sampling`` too. A set that
    still does not fit is refused at submission (``trainer_jax.service.validation``). Raises
    ``ConfigError`` naming the keys.
    """
    s, k = cfg.tasks.sampling, cfg.train.support_k
    if s.top_p < 1 and cfg.objective.top_p_replay and not 0 < s.top_k <= k:
        raise ConfigError(f"tasks.sampling.top_p {s.top_p} < 1 with objective.top_p_replay needs "
                          f"0 < tasks.sampling.top_k <= train.support_k ({k}), got top_k {s.top_k}: "
                          "top-p alone does not bound the kept set")
    if s.top_k > k:
        raise ConfigError(f"tasks.sampling.top_k {s.top_k} > train.support_k {k}: every kept set "
                          "of top_k ids would be refused; raise train.support_k or lower top_k")


def trajectory_wire_bytes(tokens: int, head_k: int, support_k: int) -> int:
    """An upper bound of one trajectory's serialized size when every one of its ``tokens`` is a
    policy token with a full support set: per token the id, mask, two log-probs, version and
    support offset (21 bytes) plus ``head_k`` and ``support_k`` (id, log-prob) pairs (``support_k``
    0 when the sampling does not truncate); 1 KiB of tags and scalars
    (``mixrl_wire.encoder.size_bound``). head_k 20, support_k 64: 693 bytes per token."""
    return 1024 + tokens * (21 + 8 * head_k + 8 * support_k)


def check_wire_limits(cfg: RunConfig) -> None:
    """A trajectory that fills one row must pass the wire: ``train.row_len`` against
    ``service.limits.max_trajectory_tokens`` and ``max_message_bytes`` (at the bound above).

    Long rows (context parallelism) need the limits raised in the config; the error names the
    values and what they cost: the service holds each accepted trajectory's arrays until its step
    takes it, and gRPC holds a message whole while it arrives.
    """
    limits, row_len, sampling = cfg.service.limits, cfg.train.row_len, cfg.tasks.sampling
    truncates = sampling.top_p < 1 or sampling.top_k > 0  # else no support sets are sent
    head_k, support_k = sampling.head_k, cfg.train.support_k if truncates else 0
    need = trajectory_wire_bytes(row_len, head_k, support_k)
    if row_len > limits.max_trajectory_tokens:
        raise ConfigError(f"train.row_len {row_len} > service.limits.max_trajectory_tokens "
                          f"{limits.max_trajectory_tokens}: trajectories that fill a row would be "
                          f"refused; set service.limits.max_trajectory_tokens: {row_len} and "
                          f"max_message_bytes >= {need} ({need / 2**20:.0f} MiB per trajectory "
                          f"at head_k {head_k}, support_k {support_k}, held in the service's memory)")
    if need > limits.max_message_bytes:
        raise ConfigError(f"service.limits.max_message_bytes {limits.max_message_bytes} < {need}: a "
                          f"trajectory of train.row_len {row_len} tokens (head_k {head_k}, support_k "
                          f"{support_k}: {need // row_len} bytes per token) would be refused; raise it "
                          f"({need / 2**20:.0f} MiB per trajectory, held in the service's memory)")


def check_context_rows(cfg: RunConfig) -> None:
    """With ``mesh.context`` > 1 every row is cut into 2 x context zigzag chunks
    (``trainer_jax.parallel.sequence``): ``train.row_len`` and ``sft.row_len`` must divide."""
    context = cfg.mesh.context
    for key, row_len in (("train.row_len", cfg.train.row_len),
                         ("sft.row_len", cfg.sft.row_len if cfg.sft.steps else None)):
        if context > 1 and row_len is not None and row_len % (2 * context):
            raise ConfigError(f"{key} {row_len} is not a multiple of 2 x mesh.context = {2 * context} "
                              "(context parallelism cuts every row into 2 x context chunks)")


__all__ = ["TEMPLATE_ENVS", "check_context_rows", "check_host_devices", "check_kept_sets",
           "check_model_files", "check_wire_limits", "host_gpus", "trajectory_wire_bytes"]
