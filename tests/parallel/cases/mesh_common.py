"""Shared by the mesh cases: the tiny models, a packed batch, comparisons."""

from __future__ import annotations

import jax
import numpy as np

from convert.qwen3_config import Qwen3Config
from trainer_jax.batching import Sample, pack

assert jax.device_count() >= 8, (
    f"the mesh cases need 8 devices, JAX has {jax.device_count()}: run them through "
    "tests/parallel/test_mesh_cases.py or with XLA_FLAGS=--xla_force_host_platform_device_count=8")

VOCAB = 128
# Layer 0 dense MLP, layer 1 MoE (4 experts, top-2); untied LM head; GQA 4 heads / 2 KV heads.
MOE = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[0])
# Dense with the LM head tied to the embedding (the vocabulary split then comes from embed_tokens).
DENSE_TIED = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                         tie_word_embeddings=True)

MESHES = {
    "8data": dict(data=8),
    "2fsdp_4tensor": dict(fsdp=2, tensor=4),
    "2data_2fsdp_2expert": dict(data=2, fsdp=2, expert=2),
}


def _sample(rng: np.random.Generator, length: int, policy: int, truncated: bool) -> Sample:
    ids = rng.integers(0, VOCAB, length).astype(np.int32)
    mask = np.zeros(length, np.int32)
    mask[length - policy:] = 1
    lp = rng.normal(-4.8, 0.3, policy).astype(np.float32)
    if truncated:  # top-p support sets that contain the sampled token (replay + exact head)
        support = np.stack([np.concatenate([[ids[length - policy + j]], rng.integers(0, VOCAB, 3)])
                            for j in range(policy)]).astype(np.int32)
        indptr = np.arange(policy + 1, dtype=np.int32) * 4
        sup_ids, sup_lp = support.reshape(-1), np.full(policy * 4, np.log(0.25), np.float32)
    else:
        indptr = np.zeros(policy + 1, np.int32)
        sup_ids, sup_lp = np.zeros(0, np.int32), np.zeros(0, np.float32)
    return Sample(token_ids=ids, loss_mask=mask, logprobs=lp,
                  head_ids=rng.integers(0, VOCAB, (policy, 4)).astype(np.int32),
                  head_logprobs=np.full((policy, 4), -4.8, np.float32), support_indptr=indptr,
                  support_ids=sup_ids, support_logprobs=sup_lp, versions=np.zeros(policy, np.int32))


def packed_batch(seed: int = 0, rows: int = 8, row_len: int = 16, max_tokens: int = 64):
    """(PackedInputs, TokenBatch): 8 rows x 16, 64 policy tokens, a quarter with top-p support."""
    rng = np.random.default_rng(seed)
    samples = [_sample(rng, int(rng.integers(6, 16)), 4, truncated=i % 4 == 0) for i in range(16)]
    adv = rng.normal(size=len(samples)).astype(np.float32)
    inputs, batch, _ = pack(samples, adv, rows=rows, row_len=row_len, max_tokens=max_tokens, head_k=4,
                            support_k=4, temperature=0.9, trainer_version=0)
    return inputs, batch


def host(tree):
    return jax.tree.map(np.asarray, tree)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b|| (0 when both are 0)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    den = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / den) if den else float(np.linalg.norm(a))


def worst_leaf(tree_a, tree_b) -> tuple[float, str]:
    """The largest ``rel_err`` over matching leaves, with its path."""
    flat_a = jax.tree_util.tree_flatten_with_path(tree_a)[0]
    flat_b = jax.tree.leaves(tree_b)
    assert len(flat_a) == len(flat_b)
    worst = max((rel_err(a, b), jax.tree_util.keystr(p)) for (p, a), b in zip(flat_a, flat_b, strict=True))
    return worst
