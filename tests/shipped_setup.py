"""What the shipped-config test (tests/test_shipped_configs.py) writes before it launches a config.

A tiny Qwen3 model directory (dense, and a MoE sibling for the expert mesh) holding a real
byte-level BPE tokenizer trained here and a ChatML template (tests/envs/chat_dir.py's); a GSM8K-format
dataset; a stand-in ``gcloud`` that runs every TPU worker's command on this machine; and the
bookkeeping for the paths a shipped config names outside the test's tmp dir (``runs/...`` in the
checkout, ``/mnt/disks/runs/...``), so the test removes exactly what it created and never touches
what was there before.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

ROOT = Path(__file__).parent.parent
MARKER = ".mixrl-shipped-config-test"  # in every directory this test creates outside its tmp dir

# The tiny models: 512 ids (the tokenizer's ~400 and padding, as Qwen pads to 151,936), heads and
# experts that split over 2-way tensor / expert axes.
DENSE = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
MOE = dict(DENSE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)


def load_test_module(relative: str):
    """A helper module of another test directory (tests/envs, tests/service are not packages:
    tests/envs would shadow the top-level envs), loaded by path."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(f"shipped_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# What the tokenizer learns its merges from: chat turns and math word problems in the shipped
# configs' style, so a prompt takes a realistic ~60-100 tokens (a character-like vocabulary would
# make it several hundred and every step slower).
_WORDS = ["Solve the problem. Give the final answer as \\boxed{n}.",
          "Solve the problem step by step, then give the final answer as \\boxed{n}.",
          "Ava has 12 marbles and wins 7 more. How many marbles does Ava have now?",
          "A farm picked 340 apples on Monday and 125 on Tuesday. How many apples did it pick in all?",
          "A library owns 812 books and lends out 95 of them. How many books are still on its shelves?",
          "Ben saved 64 dollars and spent 18 dollars on a bike. How many dollars are left?",
          "A crate holds 487 bottles. How many bottles are in 63 crates?",
          "Chloe reads 25 pages a day for 14 days. How many pages does Chloe read?",
          "Diego Emma Farid Grace Hiro Tom buys more apples. He has 3 + 4 = 7 apples. #### 7",
          "The answer is \\boxed{42}. 0 1 2 3 4 5 6 7 8 9 10 100 1000"]


def activated(env: dict[str, str]) -> dict[str, str]:
    """``env`` as ``. .venv/bin/activate`` leaves it for this interpreter's venv: what a user who
    installed the project runs the launch scripts from (they find Python through $VIRTUAL_ENV)."""
    import sys

    return {**env, "VIRTUAL_ENV": sys.prefix, "PATH": f"{sys.prefix}/bin:{env.get('PATH', '')}"}


def make_tokenizer_dir(path: Path, vocab_size: int = 500) -> Path:
    """A byte-level BPE ``tokenizer.json`` trained here, tests/envs/chat_dir.py's specials and
    ChatML template (Qwen3-like: ``enable_thinking``), and a generation config naming both stops."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    chat_dir = load_test_module("tests/envs/chat_dir.py")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=chat_dir.SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((_WORDS + chat_dir.CORPUS) * 10, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": chat_dir.TEMPLATE}))
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return path


def make_tiny_model(path: Path, *, moe: bool = False) -> Path:
    """An HF directory: random Qwen3 (or Qwen3-MoE) weights beside the tokenizer and template."""
    import torch
    from tokenizers import Tokenizer
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    make_tokenizer_dir(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.get_vocab_size() <= DENSE["vocab_size"], tok.get_vocab_size()
    generation = (path / "generation_config.json").read_text()
    special = dict(bos_token_id=tok.token_to_id("<|endoftext|>"), eos_token_id=tok.token_to_id("<|im_end|>"),
                   pad_token_id=tok.token_to_id("<|endoftext|>"))
    torch.manual_seed(0)
    if moe:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**MOE, **special))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**DENSE, **special))
    model.save_pretrained(path)
    (path / "generation_config.json").write_text(generation)  # both stop ids, as Qwen3's
    return path


def write_gsm8k(root: Path, train_rows: int = 64, test_rows: int = 8) -> None:
    """``data/gsm8k/{train,test}.jsonl`` under ``root`` in GSM8K's format ("... #### n")."""
    out = root / "data" / "gsm8k"
    out.mkdir(parents=True, exist_ok=True)
    for name, n, offset in (("train", train_rows, 0), ("test", test_rows, 1000)):
        lines = []
        for i in range(n):
            a, b = 3 + (i + offset) % 17, 2 + (i * 7 + offset) % 13
            lines.append(json.dumps({
                "question": f"Tom has {a} apples and buys {b} more. How many apples does he have now?",
                "answer": f"He has {a} + {b} = {a + b} apples.\n#### {a + b}"}))
        (out / f"{name}.jsonl").write_text("\n".join(lines) + "\n")


GCLOUD = r"""#!/usr/bin/env bash
# Stand-in for `gcloud compute tpus tpu-vm ssh TPU --zone Z --worker=all --command CMD`, what
# scripts/launch_tpu_slice.sh run|check use: every "worker" is a local process with its own HOME
# (the launcher's ~/mixrl is its own checkout), its own hostname and its jax.distributed place.
set -euo pipefail
[[ "${1:-} ${2:-} ${3:-}" == "compute tpus tpu-vm" ]] || { echo "stand-in gcloud: $*?" >&2; exit 2; }
verb=$4; shift 4
command=
while [[ $# -gt 0 ]]; do
  case $1 in
    --command) command=$2; shift 2 ;;
    --zone) shift 2 ;;
    --worker=all) shift ;;
    *) shift ;;  # the TPU name
  esac
done
root=${GCLOUD_STANDIN_ROOT:?} n=${GCLOUD_STANDIN_WORKERS:?}
case $verb in
  ssh)
    pids=()
    for ((i = 0; i < n; i++)); do
      home=$root/worker-$i
      HOME=$home PATH=$home/bin:$PATH MIXRL_NUM_PROCESSES=$n MIXRL_PROCESS_ID=$i \
        MIXRL_COORDINATOR_ADDRESS=${GCLOUD_STANDIN_COORDINATOR:?} bash -c "$command" &
      pids+=($!)
    done
    rc=0
    for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
    exit $rc ;;
  *) echo "stand-in gcloud: unsupported verb $verb" >&2; exit 2 ;;
esac
"""


def make_tpu_workers(root: Path, workers: int) -> Path:
    """The stand-in ``gcloud`` in ``root/bin`` and each worker's HOME: ``~/mixrl`` holds the
    checkout's ``.venv`` and ``configs`` (what ``launch_tpu_slice.sh setup`` would have copied),
    ``bin/hostname`` names the worker. Returns the directory to put first on PATH."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "gcloud").write_text(GCLOUD)
    (bin_dir / "gcloud").chmod(0o755)
    for i in range(workers):
        home = root / f"worker-{i}"
        checkout = home / "mixrl"
        checkout.mkdir(parents=True, exist_ok=True)
        for name in (".venv", "configs"):
            (checkout / name).symlink_to(ROOT / name)
        (home / "bin").mkdir(exist_ok=True)
        (home / "bin" / "hostname").write_text(f"#!/bin/sh\necho tpu-worker-{i}\n")
        (home / "bin" / "hostname").chmod(0o755)
    return bin_dir


class Claims:
    """Paths outside the tmp dir a config writes: claimed before the run, removed after it.

    A path that exists already and was not made by this test (no marker file) is a clear failure
    rather than something to overwrite: it may be a real run or a real secret. A directory this
    test created carries a marker, so a leftover of an interrupted earlier test is removed.
    """

    def __init__(self) -> None:
        self.created: list[tuple[Path, str]] = []  # (path, "tree" | "file" | "parent")

    def directory(self, path: Path) -> Path:
        """``path`` as a new, empty directory this test owns (parents made as needed)."""
        path = path.absolute()
        if path.exists():
            if not (path / MARKER).exists():
                raise AssertionError(f"{path} exists and was not made by this test (an earlier run?): "
                                     "the shipped config writes there; move it away first")
            shutil.rmtree(path)
        self._make_parents(path)
        path.mkdir()
        (path / MARKER).touch()
        self.created.append((path, "tree"))
        return path

    def file(self, path: Path) -> Path:
        """``path`` as a file this test may create: its parents exist, it does not."""
        path = path.absolute()
        if path.exists() and not (path.parent / MARKER).exists():
            raise AssertionError(f"{path} exists and was not made by this test: the shipped config "
                                 "writes it; move it away first")
        path.unlink(missing_ok=True)
        self._make_parents(path)
        self.created.append((path, "file"))
        return path

    def _make_parents(self, path: Path) -> None:
        for p in reversed(path.parents):
            if p.exists():
                continue
            try:
                p.mkdir()
            except OSError as e:
                raise AssertionError(f"cannot create {p} (the shipped config writes under it): "
                                     f"{e.strerror}") from None
            (p / MARKER).touch()
            self.created.append((p, "parent"))

    def release(self) -> None:
        """Remove everything claimed, newest first: a claimed tree whole, a parent made for it only
        once empty (something else may have put files there meanwhile)."""
        for path, kind in reversed(self.created):
            if kind == "tree":
                shutil.rmtree(path, ignore_errors=True)
            elif kind == "file":
                path.unlink(missing_ok=True)
            else:
                (path / MARKER).unlink(missing_ok=True)
                try:
                    path.rmdir()
                except OSError:
                    pass
        self.created.clear()


# Brings the loopback interface of a new network namespace up (SIOCGIFFLAGS / SIOCSIFFLAGS, no
# `ip` needed), then runs the command in it.
_LO_UP = ("import fcntl, os, socket, struct, sys; s = socket.socket(); "
          "f = struct.unpack('16sH14s', fcntl.ioctl(s, 0x8913, struct.pack('16sH14s', b'lo', 0, b'')))[1]; "
          "fcntl.ioctl(s, 0x8914, struct.pack('16sH14s', b'lo', f | 1, b'')); "
          "os.execvp(sys.argv[1], sys.argv[1:])")


def own_network_available() -> bool:
    """Whether this process may make network namespaces (root with CAP_SYS_ADMIN: CI, here)."""
    import subprocess
    import sys

    try:
        return subprocess.run(["unshare", "--net", "--", sys.executable, "-c", _LO_UP, "true"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def in_own_network(cmd: list[str]) -> list[str]:
    """``cmd`` in a new network namespace with its own loopback: a slice's hosts have their own
    network, so its service can listen on the port another config's also uses. Its pid's
    ``/proc/PID/ns/net`` is the namespace (unshare and the loopback step exec in place)."""
    import sys

    return ["unshare", "--net", "--", sys.executable, "-c", _LO_UP, *cmd]


def join_network(pid: int, cmd: list[str]) -> list[str]:
    """``cmd`` in the network namespace of process ``pid``."""
    return ["nsenter", f"--net=/proc/{pid}/ns/net", "--", *cmd]
