"""linear_logsumexp: every implementation held against the full-logits reference.

Checks lse, entropy and the gradients of sum(g * lse) (fp32 within 1e-5 relative), bf16 inputs,
that entropy carries no gradient, that the streaming XLA kernel's temporary memory does not grow
with the vocabulary (no [N, V] logits, no padded copy of w), that the Pallas kernels lower for
GPU (Triton) and TPU (Mosaic), and input validation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer_jax.kernels import linear_logsumexp
from trainer_jax.kernels.linear_logsumexp import IMPL_NAMES, IMPLS, BlockSizes
from trainer_jax.kernels.linear_logsumexp.pallas import LAYOUTS, default_blocks, linear_logsumexp_pallas

# (impl, options). Small tiles so that a few-hundred vocabulary has several tiles plus a ragged
# one; the pallas grid layout needs vocab tiles that are multiples of 128 and token blocks of 8.
CASES = {
    "xla": ("xla", {"block_v": 256}),
    "pallas-loop": ("pallas", {"layout": "loop", "block_n": 16, "block_v": 128}),
    "pallas-grid": ("pallas", {"layout": "grid", "block_n": 8, "block_v": 256}),
}

# (N, D, V, logit scale): ragged N and V; V < tile and N < block (and D not a power of two);
# tile-aligned N and V; large logits (|z| ~ 100) for the online rescaling.
SHAPES = [(13, 32, 1000, 1.0), (5, 48, 100, 1.0), (32, 16, 512, 1.0), (21, 16, 700, 30.0)]


def _inputs(n, d, v, scale, dtype=jnp.float32, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    h = (jax.random.normal(k1, (n, d)) * scale / np.sqrt(d)).astype(dtype)
    w = jax.random.normal(k2, (d, v)).astype(dtype)
    g = jax.random.normal(k3, (n,))
    return h, w, g


def _lse_ent_grads(impl, options, h, w, g, temperature):
    """(lse, entropy, dh, dw) of sum(g * lse), jitted, with temperature a traced argument."""

    def loss(h, w, t):
        lse, ent = linear_logsumexp(h, w, temperature=t, impl=impl, **options)
        return jnp.sum(g * lse), (lse, ent)

    fn = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    (dh, dw), (lse, ent) = fn(h, w, jnp.float32(temperature))
    return lse, ent, dh, dw


@functools.cache
def _reference_fp32(shape, temperature):
    h, w, g = _inputs(*shape)
    return _lse_ent_grads("reference", {}, h, w, g, temperature)


def _assert_rel(actual, expected, rtol, name):
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert np.all(np.isfinite(actual)), f"{name}: non-finite values"
    err = np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30)
    assert err <= rtol, f"{name}: max error {err:.2e} relative to max |ref| exceeds {rtol:.0e}"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_fp32(case, shape):
    impl, options = CASES[case]
    n, d, v, scale = shape
    h, w, g = _inputs(n, d, v, scale)
    temperature = 0.7
    got = _lse_ent_grads(impl, options, h, w, g, temperature)
    want = _reference_fp32(shape, temperature)
    for name, a, b in zip(("lse", "entropy", "dh", "dw"), got, want, strict=True):
        assert a.dtype == jnp.float32 and a.shape == b.shape, name
        _assert_rel(a, b, 1e-5, f"{case} {name}")


@pytest.mark.parametrize("temperature", [1.7])
@pytest.mark.parametrize("case", list(CASES))
def test_python_float_temperature(case, temperature):
    """A plain float temperature (closed over, so static under jit) against float64 numpy."""
    impl, options = CASES[case]
    h, w, _ = _inputs(13, 32, 1000, 1.0, seed=1)
    lse, ent = jax.jit(
        lambda h, w: linear_logsumexp(h, w, temperature=temperature, impl=impl, **options)
    )(h, w)
    z = np.asarray(h, np.float64) @ np.asarray(w, np.float64) / temperature
    zmax = z.max(-1, keepdims=True)
    lse64 = (zmax + np.log(np.exp(z - zmax).sum(-1, keepdims=True)))[:, 0]
    p = np.exp(z - lse64[:, None])
    ent64 = -(p * np.log(p)).sum(-1)
    _assert_rel(lse, lse64, 1e-5, f"{case} lse")
    _assert_rel(ent, ent64, 1e-5, f"{case} entropy")


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_inputs_close_to_fp32_reference(case):
    """bf16 h and w: fp32 accumulation, fp32 outputs; compared with the fp32 reference applied
    to the same (bf16-representable) values. Tolerances: lse/entropy 1e-4 relative (only the
    accumulation order differs); dh/dw 1e-2 relative to max |ref| (dZ is rounded to bf16 for
    the backward matmuls and the gradients are returned in bf16, 2^-8 each)."""
    impl, options = CASES[case]
    h, w, g = _inputs(13, 32, 1000, 1.0, dtype=jnp.bfloat16, seed=2)
    lse, ent, dh, dw = _lse_ent_grads(impl, options, h, w, g, 0.9)
    assert lse.dtype == ent.dtype == jnp.float32
    assert dh.dtype == dw.dtype == jnp.bfloat16
    want = _lse_ent_grads(
        "reference", {}, h.astype(jnp.float32), w.astype(jnp.float32), g, 0.9
    )
    for name, a, b, tol in zip(
        ("lse", "entropy", "dh", "dw"), (lse, ent, dh, dw), want, (1e-4, 1e-4, 1e-2, 1e-2),
        strict=True,
    ):
        _assert_rel(a, b, tol, f"{case} bf16 {name}")


@pytest.mark.parametrize("case", ["reference", *CASES])
def test_entropy_carries_no_gradient(case):
    """grad of sum(entropy) is zero, and adding an entropy term leaves the lse gradient as is."""
    impl, options = CASES.get(case, (case, {}))
    h, w, _ = _inputs(13, 32, 1000, 1.0, seed=3)

    def grads(h, w):
        def f(h, w, c_lse, c_ent):
            lse, ent = linear_logsumexp(h, w, temperature=0.8, impl=impl, **options)
            return c_lse * jnp.sum(lse) + c_ent * jnp.sum(ent)

        ent_only = jax.grad(f, (0, 1))(h, w, 0.0, 1.0)
        both = jax.grad(f, (0, 1))(h, w, 1.0, 3.0)
        lse_only = jax.grad(f, (0, 1))(h, w, 1.0, 0.0)
        return ent_only, both, lse_only

    (dh, dw), both, lse_only = jax.jit(grads)(h, w)
    assert not np.any(np.asarray(dh)) and not np.any(np.asarray(dw))
    for a, b in zip(both, lse_only, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_temperature_is_not_differentiated():
    h, w, _ = _inputs(5, 16, 300, 1.0, seed=4)
    for impl in ("reference", "xla"):
        dt = jax.jit(jax.grad(lambda t, impl=impl: jnp.sum(linear_logsumexp(h, w, temperature=t,
                                                                             impl=impl)[0])))(1.3)
        assert float(dt) == 0.0, impl


def _temp_bytes(fn, *shapes) -> int:
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def _fwd_bwd(impl, **options):
    def f(h, w, g):
        def loss(h, w):
            return jnp.sum(g * linear_logsumexp(h, w, temperature=0.7, impl=impl, **options)[0])

        return jax.value_and_grad(loss, argnums=(0, 1))(h, w)

    return f


def test_xla_temp_memory_independent_of_vocab():
    """Compiled forward+backward: the streaming kernel's temporaries stay one tile wide while
    the reference's grow with V; a ragged V (not a multiple of the tile) costs no padded copy
    of w or dw (each would be D * V * 4 bytes = 4 MiB at V=16k, 16 MiB at 64k)."""
    n, d, tile = 64, 64, 1024
    xla = _fwd_bwd("xla", block_v=tile)
    ref = _fwd_bwd("reference")
    temp = {}
    for v in (16384, 65536, 65536 + 384):
        temp["xla", v] = _temp_bytes(xla, (n, d), (d, v), (n,))
    for v in (16384, 65536):
        temp["ref", v] = _temp_bytes(ref, (n, d), (d, v), (n,))
    tile_bytes = n * tile * 4
    assert temp["xla", 65536] <= temp["xla", 16384] + tile_bytes // 4, temp
    # The separate remainder step may hold its own tile-sized buffers, never a [D, V'] copy.
    assert temp["xla", 65536 + 384] <= temp["xla", 65536] + 2 * tile_bytes < d * 65536 * 4, temp
    assert temp["xla", 65536] <= 8 * tile_bytes, temp
    # The oracle holds [N, V] logits (and their softmax): it grows with V.
    assert temp["ref", 65536] >= 3 * temp["ref", 16384] >= 3 * n * 16384 * 4, temp
    assert temp["ref", 65536] >= 10 * temp["xla", 65536], temp


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("platform,layout", [("cuda", "loop"), ("tpu", "grid")])
def test_pallas_lowers_for_accelerators(platform, layout, dtype):
    """Forward + backward lower to Triton (GPU) / Mosaic (TPU) IR from this CPU-only machine,
    with ragged N and V and a hidden size that is not a power of two. (Lowering only: the
    device compilers and numerics need the hardware.)"""
    export = pytest.importorskip("jax.export")

    def f(h, w, t):
        def loss(h, w):
            lse, ent = linear_logsumexp_pallas(h, w, t, layout=layout, interpret=False)
            return jnp.sum(lse), ent

        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(h, w)

    d = 96 if layout == "loop" else 256
    args = (
        jax.ShapeDtypeStruct((300, d), dtype),
        jax.ShapeDtypeStruct((d, 1000), dtype),
        jax.ShapeDtypeStruct((), jnp.float32),
    )
    # Triton kernels are an XLA custom call without a serialisation-stability guarantee.
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    exported = export.export(jax.jit(f), platforms=[platform], disabled_checks=checks)(*args)
    text = exported.mlir_module()
    assert ("xla.gpu.triton" if platform == "cuda" else "tpu_custom_call") in text


def test_dispatcher_defaults_and_registry():
    assert tuple(IMPLS) == IMPL_NAMES
    assert "reference" in IMPL_NAMES
    h, w, _ = _inputs(4, 8, 50, 1.0)
    lse, ent = jax.jit(linear_logsumexp)(h, w)  # impl="xla", temperature=1.0
    want_lse, want_ent = IMPLS["reference"](h, w, jnp.float32(1.0))
    _assert_rel(lse, want_lse, 1e-5, "default lse")
    _assert_rel(ent, want_ent, 1e-5, "default entropy")
    empty = linear_logsumexp(jnp.zeros((0, 8)), w)
    assert empty[0].shape == empty[1].shape == (0,)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(h=np.zeros((4, 8), np.float32), w=np.zeros((9, 20), np.float32)), "hidden size"),
        (dict(h=np.zeros((8,), np.float32)), r"h must be rank 2"),
        (dict(w=np.zeros((8, 20, 2), np.float32)), r"w must be rank 2"),
        (dict(impl="cuda"), "unknown impl 'cuda'"),
        (dict(impl="xla", block_n=8), "does not take option"),
        (dict(h=np.zeros((4, 8), np.int32)), "float32, bfloat16 or float16"),
        (dict(w=np.zeros((8, 20), jnp.bfloat16)), "share a dtype"),
        (dict(w=np.zeros((8, 0), np.float32)), "empty vocabulary"),
        (dict(temperature=0.0), "temperature must be finite and > 0"),
        (dict(temperature=jnp.ones((2,))), "temperature must be a scalar"),
        (dict(impl="pallas", layout="warp"), "unknown pallas layout"),
        (dict(h=np.ones((40, 8), np.float32), impl="pallas", layout="grid", block_n=12),
         "multiple of 8"),
        (dict(impl="xla", block_v=0), "block_v must be a positive"),
        (dict(impl="pallas", block_n=0), "block sizes must be positive"),
        (dict(impl="pallas", block_v=1.5), "block_v must be a positive int"),
        (dict(impl="pallas", blocks=(16, 128)), "blocks must be a BlockSizes"),
    ],
)
def test_invalid_inputs_raise_value_error(kwargs, match):
    args = dict(h=np.ones((4, 8), np.float32), w=np.ones((8, 200), np.float32))
    args.update(kwargs)
    h, w = args.pop("h"), args.pop("w")
    with pytest.raises(ValueError, match=match):
        linear_logsumexp(h, w, **args)


def test_objective_config_uses_the_kernel_names():
    """The objective's config takes exactly the kernel's implementation names (one definition)."""
    import pydantic

    from trainer_jax.objective import KERNEL_IMPLS, ObjectiveConfig

    assert KERNEL_IMPLS == IMPL_NAMES
    for name in IMPL_NAMES:
        assert ObjectiveConfig(impl=name).impl == name
    with pytest.raises(pydantic.ValidationError, match="impl"):
        ObjectiveConfig(impl="cuda")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(block_n=0, block_v=64), "block sizes must be positive"),
        (dict(block_n=16, block_v=-1), "block sizes must be positive"),
        (dict(block_n=16.0, block_v=64), "block_n must be a positive int"),
        (dict(block_n=True, block_v=64), "block_n must be a positive int"),
        (dict(block_n=16, block_v="64"), "block_v must be a positive int"),
    ],
)
def test_block_sizes_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockSizes(**kwargs)


def test_block_sizes_value_semantics():
    blocks = BlockSizes(block_n=np.int64(16), block_v=128)
    assert type(blocks.block_n) is int and blocks == BlockSizes(16, 128)
    assert hash(blocks) == hash(BlockSizes(16, 128))  # a static jit argument: same cache entry
    assert blocks.replace(block_v=256) == BlockSizes(16, 256)
    assert blocks.replace() == blocks
    assert blocks.as_options() == (("block_n", 16), ("block_v", 128))
    for layout in LAYOUTS:
        for interpret in (False, True):
            assert isinstance(default_blocks(layout, interpret), BlockSizes)


def test_pallas_blocks_option_matches_scalar_options():
    """``blocks=BlockSizes(...)``, the scalar ``block_n``/``block_v`` a config passes, and a
    scalar overriding one size of ``blocks`` all run the same tiles (bit-identical results)."""
    h, w, g = _inputs(13, 32, 1000, 1.0, seed=6)
    scalar = _lse_ent_grads("pallas", {"layout": "loop", "block_n": 16, "block_v": 128},
                            h, w, g, 0.7)
    typed = _lse_ent_grads("pallas", {"layout": "loop", "blocks": BlockSizes(16, 128)},
                           h, w, g, 0.7)
    override = _lse_ent_grads(
        "pallas", {"layout": "loop", "blocks": BlockSizes(16, 512), "block_v": 128}, h, w, g, 0.7
    )
    for a, b, c in zip(scalar, typed, override, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


@pytest.mark.gpu
@pytest.mark.skipif(
    jax.default_backend() not in ("gpu", "tpu"), reason="needs a GPU or TPU backend"
)
def test_pallas_compiled_on_accelerator():
    """The compiled (not interpreted) kernels on real hardware, ragged N and V, fp32."""
    h, w, g = _inputs(300, 128, 5000, 1.0, seed=5)
    got = _lse_ent_grads("pallas", {"interpret": False}, h, w, g, 0.8)
    with jax.default_matmul_precision("highest"):
        want = _lse_ent_grads("reference", {}, h, w, g, 0.8)
    for name, a, b in zip(("lse", "entropy", "dh", "dw"), got, want, strict=True):
        _assert_rel(a, b, 1e-5, f"accelerator {name}")


def test_auto_picks_the_portable_kernel_until_pallas_is_checked_on_a_platform(tmp_path, monkeypatch):
    """``objective.impl: auto`` (the default) resolves per platform; ``pallas`` only where the
    device check recorded a pass (``trainer_jax/kernels/checked.py``; tests/kernels/test_checked.py
    feeds it passes). With an empty registry every platform gets ``xla``."""
    from trainer_jax.kernels import checked
    from trainer_jax.kernels.linear_logsumexp.names import AUTO_IMPL, IMPL_NAMES, resolve_impl

    monkeypatch.setenv(checked.ENV, str(tmp_path / "none.json"))
    assert {p: resolve_impl("auto", p) for p in ("cpu", "gpu", "tpu")} == {
        "cpu": "xla", "gpu": "xla", "tpu": "xla"}
    assert set(AUTO_IMPL.values()) == {checked.FALLBACK["linear_logsumexp"]} <= set(IMPL_NAMES)
    assert resolve_impl("pallas", "cpu") == "pallas"  # a named kernel is taken as named
