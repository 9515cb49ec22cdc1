"""Every attention implementation against the plain reference, on packed rows with padding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer_jax.models.attention import IMPLS, attention, default_impl


def _packed_segments(b: int, t: int, seed: int) -> np.ndarray:
    """Rows of contiguous segments of random lengths (some 1 token), ending in padding (0)."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((b, t), np.int32)
    for row in range(b):
        pos, sid = 0, 1
        while pos < t - 3:
            n = int(rng.choice([1, 2, 5, 17, 40]))
            seg[row, pos:pos + n] = sid
            pos, sid = pos + n, sid + 1
        seg[row, pos:] = 0  # trailing padding (the last row may be nearly all one segment)
    seg[-1, : t - 2] = 7
    return seg


def _inputs(b, t, h, kh, hd, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal(s), dtype)
               for s in [(b, t, h, hd), (b, t, kh, hd), (b, t, kh, hd)])
    return q, k, v, jnp.asarray(_packed_segments(b, t, seed))


def _loss(impl, seg, **options):
    # Padding positions' outputs are unspecified: weight them out, so gradients compare too.
    real = (seg > 0)[:, :, None, None]

    def f(q, k, v):
        return jnp.sum(jnp.sin(attention(q, k, v, seg, impl=impl, **options)) * real)
    return f


def _compare(impl, shape, tol, **options):
    q, k, v, seg = _inputs(*shape)
    real = np.asarray(seg > 0)[:, :, None, None]
    ref = np.asarray(attention(q, k, v, seg, impl="reference"))
    out = np.asarray(attention(q, k, v, seg, impl=impl, **options))
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out * real, ref * real, atol=tol, rtol=tol)
    g_ref = jax.grad(_loss("reference", seg), argnums=(0, 1, 2))(q, k, v)
    g = jax.grad(_loss(impl, seg, **options), argnums=(0, 1, 2))(q, k, v)
    for a, r in zip(g, g_ref, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=tol, rtol=tol)


def test_reference_matches_a_per_sequence_loop():
    """The oracle itself: each segment attended alone, causally, with plain numpy softmax."""
    q, k, v, seg = _inputs(2, 37, 4, 2, 8)
    out = np.asarray(attention(q, k, v, seg, impl="reference"))
    qn, kn, vn, sn = map(np.asarray, (q, k, v, seg))
    for b in range(2):
        for sid in set(sn[b].tolist()) - {0}:
            idx = np.nonzero(sn[b] == sid)[0]
            for h in range(4):
                s = qn[b, idx, h] @ kn[b, idx, h // 2].T / np.sqrt(8)
                s = np.where(np.tril(np.ones((len(idx), len(idx)), bool)), s, -np.inf)
                p = np.exp(s - s.max(-1, keepdims=True))
                want = (p / p.sum(-1, keepdims=True)) @ vn[b, idx, h // 2]
                np.testing.assert_allclose(out[b, idx, h], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape,block", [
    ((2, 45, 4, 2, 8), 8),     # T not a multiple of the block, GQA 2
    ((2, 64, 8, 2, 16), 16),   # GQA 4, exact blocks
    ((1, 50, 4, 4, 8), 128),   # one block larger than T, no grouping
    ((3, 96, 6, 1, 8), 32),    # MQA
])
def test_blocked_matches_reference(shape, block):
    _compare("blocked", shape, 2e-5, block=block)


def test_blocked_bf16_close_to_reference():
    q, k, v, seg = _inputs(2, 64, 4, 2, 16, dtype=jnp.bfloat16)
    real = np.asarray(seg > 0)[:, :, None, None]
    ref = np.asarray(attention(q, k, v, seg, impl="reference").astype(jnp.float32))
    out = attention(q, k, v, seg, impl="blocked", block=16)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)) * real, ref * real, atol=3e-2)


def test_blocked_never_builds_the_score_matrix():
    """Forward+backward temporaries stay far below one [T, T] fp32 matrix per head."""
    b, t, h, kh, hd = 1, 2048, 4, 2, 16
    q, k, v, seg = _inputs(b, t, h, kh, hd)
    per_head_scores = b * h * t * t * 4

    def temp_bytes(impl):
        f = jax.jit(jax.grad(_loss(impl, seg, **({"block": 128} if impl == "blocked" else {})),
                             argnums=(0, 1, 2)))
        return f.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes("reference") >= per_head_scores  # the measure sees the matrix when it exists
    assert temp_bytes("blocked") < per_head_scores / 8


@pytest.mark.parametrize("block, backward_block", [(16, 32), (32, 8)])
def test_pallas_gpu_kernel_in_interpret_mode(block, backward_block):
    _compare("pallas_gpu", (2, 40, 4, 2, 16), 2e-5, interpret=True, block=block,
             backward_block=backward_block)


def test_splash_kernel_in_interpret_mode():
    _compare("splash", (1, 40, 4, 2, 8), 2e-5, interpret=True, block=128)


def test_cudnn_call_honours_segments_through_its_mask():
    """The cuDNN impl's mask and padding (odd T) through the same jax.nn call on XLA: cuDNN itself
    needs a GPU (scripts/device_check.sh compares it there)."""
    _compare("cudnn", (2, 45, 4, 2, 8), 2e-5, implementation="xla")


def test_auto_choice_per_platform(tmp_path, monkeypatch):
    """Without a passed device check every platform gets ``blocked``; with one, the kernel."""
    from trainer_jax.kernels import checked

    monkeypatch.setenv(checked.ENV, str(tmp_path / "checked.json"))  # an empty registry
    assert default_impl(256, "cpu") == "blocked"  # faster than the dense matrix on CPU at any T
    assert default_impl(32768, "cpu") == "blocked"
    h200 = checked.Where("gpu", "NVIDIA H200", "0.10")
    assert default_impl(4096, "gpu") == "blocked"  # this process has no GPU: never checked
    assert default_impl(4096, where=h200) == "blocked"
    versions = {"jax": "0.10.2", "jaxlib": "0.10.2", "torch": "2.13.0"}
    checked.record([checked.make_entry("attention:pallas_gpu", h200, passed=True, max_err=1e-3,
                                       tolerance=2e-2, versions=versions)])
    assert default_impl(4096, where=h200) == "pallas_gpu"
    assert default_impl(4096, where=checked.Where("gpu", "NVIDIA H100", "0.10")) == "blocked"
    assert default_impl(4096, where=checked.Where("gpu", "NVIDIA H200", "0.11")) == "blocked"
    assert set(IMPLS) == {"reference", "blocked", "pallas_gpu", "splash", "cudnn"}


def test_bad_arguments_are_rejected():
    q, k, v, seg = _inputs(1, 8, 4, 2, 8)
    with pytest.raises(ValueError, match="impl"):
        attention(q, k, v, seg, impl="flash")
    with pytest.raises(ValueError, match="multiple"):
        attention(q[:, :, :3], k, v, seg)
    with pytest.raises(ValueError, match="segment_ids"):
        attention(q, k, v, seg[:, :4])
