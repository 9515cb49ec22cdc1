"""``sampler_torch/engine/sampling.py`` against an independent reference (issue 37): the mutation
run found the random streams and the untruncated paths checked only statistically, so a changed
constant or operator that kept the streams uniform / normal went unnoticed. A request's samples
must be a pure function of its seed (docs/design.md): here the exact SplitMix64 streams are
recomputed with Python integers, and the eager untruncated paths compared with ``sample_step``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sampler_torch.engine.sampling import (
    _sample_untruncated,
    logit_noise,
    sample_step,
    sample_untruncated,
    uniforms,
)

MASK = (1 << 64) - 1
GOLDEN, M1, M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
SALT = 0x6C6F676974204E53


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * M1) & MASK
    z = ((z ^ (z >> 27)) * M2) & MASK
    return z ^ (z >> 31)


def _uniform(seed: int, n: int) -> float:
    return (_mix((_mix(seed) + (n + 1) * GOLDEN) & MASK) >> 11) / 2**53


def _normal(seed: int, n: int, j: int) -> float:
    key = _mix((_mix(seed ^ SALT) + (n + 1) * GOLDEN) & MASK)
    z1 = _mix((key + (2 * j + 1) * GOLDEN) & MASK)
    z2 = _mix((key + (2 * j + 2) * GOLDEN) & MASK)
    u1, u2 = ((z1 >> 11) + 1) / 2**53, (z2 >> 11) / 2**53
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


def test_uniforms_are_the_splitmix64_stream_of_each_seed():
    seeds = [0, 1, 7, 2**63 + 5, MASK]
    counters = [0, 3, 1, 1000, 2**40]
    got = uniforms(np.array(seeds, np.uint64), np.array(counters, np.uint64))
    assert got.dtype == np.float64
    assert got.tolist() == [_uniform(s, n) for s, n in zip(seeds, counters, strict=True)]


def test_logit_noise_is_the_salted_stream_through_box_muller():
    seeds, counters, vocab = [3, 3, 2**62], [0, 9, 4], 37
    got = logit_noise(np.array(seeds, np.uint64), np.array(counters, np.uint64), vocab)
    assert got.shape == (3, vocab) and got.dtype == np.float32
    want = np.array([[_normal(s, n, j) for j in range(vocab)] for s, n in zip(seeds, counters, strict=True)],
                    np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert (got < 0).any() and (got > 0).any()


def _logits(b: int = 3, vocab: int = 11) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(5).normal(0, 2, (b, vocab)).astype(np.float32))


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_the_compiled_paths_function_samples_what_sample_step_does(temperature):
    logits, b = _logits(), 3
    u = torch.from_numpy(uniforms(np.arange(b), np.zeros(b)))
    # the last row at u just below 1: the pick must stay inside the vocabulary
    u[-1] = 1.0 - 2**-53
    temp = torch.full((b,), temperature)
    ref = sample_step(logits, temp, torch.ones(b), torch.zeros(b, dtype=torch.long), 4, u)
    tokens, lq, head_lp, head_ids = _sample_untruncated(logits, temp, u, 4)
    assert tokens.tolist() == ref.tokens.tolist() and int(tokens.max()) < logits.shape[1]
    torch.testing.assert_close(lq, ref.logprob_full)
    torch.testing.assert_close(head_lp, ref.head_logprobs)
    assert head_ids.tolist() == ref.head_ids.tolist()
    eager = sample_untruncated(logits, temp if temperature != 1.0 else None, u, 4)
    assert eager.tokens.tolist() == ref.tokens.tolist()
    torch.testing.assert_close(eager.head_logprobs, ref.head_logprobs)
    # the records are of q = softmax(z / T) per row (each row sums to one)
    q = torch.softmax(logits / temperature, dim=-1)
    torch.testing.assert_close(lq, q.gather(1, tokens[:, None])[:, 0].log())


def test_no_head_is_recorded_unless_head_k_is_positive():
    logits, b = _logits(), 3
    u = torch.from_numpy(uniforms(np.arange(b), np.zeros(b)))
    for head_k in (0, -1):
        r = sample_step(logits, torch.ones(b), torch.ones(b), torch.zeros(b, dtype=torch.long), head_k, u)
        assert r.head_ids.shape == (b, 0) and r.head_logprobs.shape == (b, 0)
