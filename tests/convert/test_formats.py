"""Codec round trips, edge cases and an independent decode per weight format.

Each round-trip bound below is the format's own rounding bound, derived in the test from the
scales the codec stored (which are separately checked against the documented scale rule), plus
a float32 slack of a few ulps for the division by the scale and the multiplication back.
"""

import ml_dtypes
import numpy as np
import pytest

from convert.formats import FORMATS, QuantizationError, fp4_tiles, fp8_block, get_codec

F32_SLACK = 2.0**-20  # relative: x / s and q * s each add <= 2**-24

rng = np.random.default_rng(1234)


def weights(shape, scale=0.02, dtype=np.float32, outliers=True):
    """Gaussian weights with a few large outliers, as trained LLM weights have."""
    w = rng.standard_normal(shape).astype(np.float32) * scale
    if outliers:
        w.reshape(-1)[rng.integers(0, w.size, max(1, w.size // 500))] *= 20
    return w.astype(dtype)


def e2m1_half_spacing(v):
    """Half the e2m1 grid spacing at |v| (grid 0 .5 1 1.5 2 3 4 6), or the clip error past 6."""
    a = np.abs(v)
    return np.where(a <= 2, 0.25, np.where(a <= 4, 0.5, np.where(a <= 6, 1.0, a - 6)))


def bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


# ---------------------------------------------------------------------------------------------
# Independent decoders: ml_dtypes views, no codec code.


def ref_decode_fp8(parts, shape):
    q = parts["weight"].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    s = parts["weight_scale_inv"]
    return q * np.repeat(np.repeat(s, 128, 0), 128, 1)[: shape[0], : shape[1]]


def ref_unpack(packed):
    lo, hi = packed & 0xF, packed >> 4
    nib = np.stack([lo, hi], axis=-1).reshape(packed.shape[0], -1)
    return nib.view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def ref_decode_nvfp4(parts, shape):
    s = parts["weight_scale"].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    s = s * np.float32(parts["weight_scale_2"])
    return ref_unpack(parts["weight"]) * np.repeat(s, 16, 1)[:, : shape[1]]


def ref_decode_mxfp4(parts, shape):
    s = parts["weight_scale"].view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    return ref_unpack(parts["weight"]) * np.repeat(s, 32, 1)[:, : shape[1]]


def ref_decode_int8(parts, shape):
    return parts["weight"].astype(np.float32) * parts["weight_scale"]


def ref_decode_bf16(parts, shape):
    return parts["weight"].astype(np.float32)


REF_DECODE = {"fp8_block": ref_decode_fp8, "nvfp4": ref_decode_nvfp4, "mxfp4": ref_decode_mxfp4,
              "w8a8_int8": ref_decode_int8, "bf16": ref_decode_bf16}

# Shapes: tile- and block-aligned, partial edge blocks, and larger than one tile in both axes
# (fp8 tiles are 128 x 1024, fp4 tiles 32 x 2048) so every tiling path runs.
SHAPES = [(256, 512), (130, 300), (33, 2100), (7, 18)]


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("shape", SHAPES)
def test_independent_decode_is_bit_identical(fmt, shape):
    codec = get_codec(fmt)
    w = weights(shape, dtype=ml_dtypes.bfloat16)
    parts = codec.quantize(w)
    specs = codec.tensor_specs(shape)
    assert set(parts) == set(specs) == set(codec.parts)
    for k, (dtype, s) in specs.items():
        assert parts[k].dtype == dtype and parts[k].shape == s, k
    got = codec.dequantize(parts)
    ref = REF_DECODE[fmt](parts, shape)
    assert got.dtype == np.float32 and got.shape == shape
    assert np.array_equal(bits(got), bits(ref))


@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_block_round_trip_bound_and_scale_rule(shape):
    # e4m3 keeps 3 mantissa bits: round-to-nearest errs by <= 2**-4 of the scaled value in the
    # normal range, and by <= 2**-10 (half the subnormal step 2**-9) below it, both times s.
    codec = get_codec("fp8_block")
    w = weights(shape)
    parts = codec.quantize(w)
    s = parts["weight_scale_inv"]
    blocks = np.zeros((s.shape[0] * 128, s.shape[1] * 128), np.float32)
    blocks[: shape[0], : shape[1]] = np.abs(w)
    amax = blocks.reshape(s.shape[0], 128, s.shape[1], 128).max(axis=(1, 3))
    assert np.array_equal(s, np.where(amax > 0, amax / np.float32(448), 1).astype(np.float32))
    s_full = np.repeat(np.repeat(s, 128, 0), 128, 1)[: shape[0], : shape[1]]
    err = np.abs(codec.dequantize(parts) - w)
    bound = np.abs(w) * (2.0**-4 + F32_SLACK) + s_full * 2.0**-10
    assert (err <= bound).all(), float((err / bound).max())
    # The codes are exactly the reference RNE cast of w / s.
    ref = (w / s_full).astype(ml_dtypes.float8_e4m3fn)
    assert np.array_equal(ref.view(np.uint8), parts["weight"].view(np.uint8))


@pytest.mark.parametrize("shape", [(64, 256), (33, 2100), (7, 18)])
def test_nvfp4_round_trip_bound_and_modelopt_scales(shape):
    codec = get_codec("nvfp4")
    w = weights(shape)
    parts = codec.quantize(w)
    # ModelOpt: global scale amax / (6 * 448); group scale e4m3((group amax / 6) / global).
    amax = np.float32(np.abs(w).max())
    scale_2 = amax / np.float32(6 * 448)
    assert parts["weight_scale_2"].shape == () and parts["weight_scale_2"] == scale_2
    assert parts["input_scale"] == 1.0
    padded = np.zeros((shape[0], -(-shape[1] // 16) * 16), np.float32)
    padded[:, : shape[1]] = np.abs(w)
    group_amax = padded.reshape(shape[0], -1, 16).max(axis=2)
    rel = (group_amax / np.float32(6)) / scale_2
    rel[group_amax == 0] = 1
    expect = rel.astype(ml_dtypes.float8_e4m3fn)
    assert np.array_equal(expect.view(np.uint8), parts["weight_scale"].view(np.uint8))
    # Bound: half the e2m1 spacing at the scaled value (or the clip past 6), times the divisor.
    divisor = np.repeat(expect.astype(np.float32) * scale_2, 16, 1)[:, : shape[1]]
    v = w / divisor
    bound = divisor * e2m1_half_spacing(v) + np.abs(w) * F32_SLACK
    err = np.abs(codec.dequantize(parts) - w)
    assert (err <= bound).all(), float((err / bound).max())
    # The e4m3 rounding of a group scale can push a scaled value to at most 6 * (1 + 2**-4).
    assert np.abs(v).max() <= 6 * (1 + 2.0**-4) * (1 + F32_SLACK)


@pytest.mark.parametrize("shape", [(64, 256), (33, 2100), (5, 34)])
def test_mxfp4_round_trip_bound_and_ocp_scales(shape):
    codec = get_codec("mxfp4")
    w = weights(shape)
    parts = codec.quantize(w)
    padded = np.zeros((shape[0], -(-shape[1] // 32) * 32), np.float32)
    padded[:, : shape[1]] = np.abs(w)
    group_amax = padded.reshape(shape[0], -1, 32).max(axis=2).astype(np.float64)
    # OCP MX: shared exponent floor(log2 amax) - emax(e2m1) = floor(log2 amax) - 2.
    shared = np.floor(np.log2(group_amax)) - 2
    assert np.array_equal(parts["weight_scale"].astype(np.int64) - 127, shared.astype(np.int64))
    x_scale = np.repeat(2.0**shared, 32, 1)[:, : shape[1]].astype(np.float32)
    v = w / x_scale
    assert np.abs(v).max() < 8  # amax / 2**(floor(log2 amax) - 2) < 8; (6, 8) clips to 6
    bound = x_scale * e2m1_half_spacing(v)  # power-of-two scaling is exact: no float slack
    err = np.abs(codec.dequantize(parts) - w)
    assert (err <= bound).all(), float((err / bound).max())


@pytest.mark.parametrize("shape", [(64, 256), (3, 7000)])
def test_w8a8_int8_round_trip_bound(shape):
    # Symmetric per-row int8: rint errs by <= s / 2 with s = row amax / 127.
    codec = get_codec("w8a8_int8")
    w = weights(shape)
    parts = codec.quantize(w)
    s = np.abs(w).max(axis=1, keepdims=True) / np.float32(127)
    assert np.array_equal(parts["weight_scale"], s.astype(np.float32))
    assert parts["weight"].min() >= -127
    err = np.abs(codec.dequantize(parts) - w)
    assert (err <= s / 2 + np.abs(w) * F32_SLACK).all()


def test_bf16_round_trip_bound():
    # bf16 keeps 8 significant bits: round-to-nearest errs by <= 2**-8 relative.
    w = weights((64, 100))
    got = get_codec("bf16").dequantize(get_codec("bf16").quantize(w))
    assert (np.abs(got - w) <= np.abs(w) * 2.0**-8).all()


def test_fp4_error_is_what_four_bits_give():
    # A sanity check of the overall level on plain Gaussian weights: ~9-11 % RMS in 4 bits,
    # ~2.6 % in fp8, < 1 % in int8 (the per-element bounds above are the real contract).
    w = weights((256, 1024), outliers=False)
    rel = {}
    for fmt in FORMATS:
        codec = get_codec(fmt)
        d = codec.dequantize(codec.quantize(w)) - w
        rel[fmt] = float(np.sqrt((d**2).mean() / (w**2).mean()))
    assert rel["bf16"] < 0.003 and rel["w8a8_int8"] < 0.02 and rel["fp8_block"] < 0.04
    assert rel["nvfp4"] < 0.12 and rel["mxfp4"] < 0.15


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_all_zero_blocks_and_tensors_are_exact(fmt):
    codec = get_codec(fmt)
    w = weights((256, 256))
    w[:128, :128] = 0.0  # one whole fp8 block, 128 rows of fp4 groups, half the int8 rows
    w[:128, 128:] = 0.0
    got = codec.dequantize(codec.quantize(w))
    assert (got[:128] == 0).all()
    zero = np.zeros((130, 40), np.float32)
    parts = codec.quantize(zero)
    assert (codec.dequantize(parts) == 0).all()
    if fmt == "fp8_block":
        assert (parts["weight_scale_inv"] == 1).all()
    if fmt == "nvfp4":
        assert parts["weight_scale_2"] == 1 and (
            parts["weight_scale"].astype(np.float32) == 1).all()
    if fmt == "mxfp4":
        assert (parts["weight_scale"] == 0).all()  # 2**-127, the clamp for an all-zero group


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_signed_zero(fmt):
    codec = get_codec(fmt)
    w = weights((128, 64))
    w[3, :8] = -0.0
    w[4, :8] = 0.0
    got = codec.dequantize(codec.quantize(w))
    assert (got[3, :8] == 0).all() and (got[4, :8] == 0).all()
    assert not np.signbit(got[4, :8]).any()
    if fmt == "w8a8_int8":
        assert not np.signbit(got[3, :8]).any()  # int8 has no -0: documented
    else:
        assert np.signbit(got[3, :8]).all()


def _grid_tensor(fmt):
    """A tensor whose values lie exactly on the format's grid, including +-max."""
    k = -5  # any power of two
    if fmt in ("fp8_block", "bf16"):
        g = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        g = g[np.isfinite(g)]
        w = np.resize(g, (128, 256)) * np.float32(2.0**k)
        w[0, 0], w[0, 1] = 448 * 2.0**k, -448 * 2.0**k
        return w
    if fmt == "nvfp4":
        e2m1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float32)
        vals = np.resize(np.concatenate([e2m1, -e2m1]), (32, 64))
        w = vals * np.float32(2.0**k) * np.float32(448)  # group scale 448, global 2**k
        w[:, ::16] = 6 * 448 * 2.0**k  # every group reaches the max, so its scale is exact
        w[1, 0] = -6 * 448 * 2.0**k
        return w
    if fmt == "mxfp4":
        e2m1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float32)
        w = np.resize(np.concatenate([e2m1, -e2m1]), (32, 64)) * np.float32(2.0**k)
        w[:, ::32] = -6 * 2.0**k
        return w
    ints = np.resize(np.arange(-127, 128, dtype=np.float32), (16, 255))
    return ints * np.float32(2.0**k)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_values_on_the_grid_including_the_max_round_trip_exactly(fmt):
    codec = get_codec(fmt)
    w = _grid_tensor(fmt)
    got = codec.dequantize(codec.quantize(w))
    assert np.array_equal(got, w)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [(0, 0), (129, 299)])  # first element; inside a partial block
def test_nan_and_inf_are_rejected(fmt, bad, where):
    w = weights((130, 300))
    w[where] = bad
    with pytest.raises(QuantizationError, match="NaN or Inf"):
        get_codec(fmt).quantize(w, what="model.layers.0.mlp.up_proj.weight")
    with pytest.raises(QuantizationError, match="NaN or Inf"):
        get_codec(fmt).quantize(w.astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_needs_an_even_input_dimension(fmt):
    with pytest.raises(QuantizationError, match="even"):
        get_codec(fmt).quantize(weights((4, 33)))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_rejects_non_matrices_and_non_floats(fmt):
    codec = get_codec(fmt)
    with pytest.raises(QuantizationError, match="2-D"):
        codec.quantize(np.ones(16, np.float32))
    with pytest.raises(QuantizationError, match="float"):
        codec.quantize(np.ones((4, 4), np.int32))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_bf16_and_f32_inputs_and_thread_counts_agree(fmt, monkeypatch):
    codec = get_codec(fmt)
    w = weights((300, 2100), dtype=ml_dtypes.bfloat16)
    a = codec.quantize(w)
    monkeypatch.setenv("MIXRL_CONVERT_THREADS", "1")
    b = codec.quantize(w.astype(np.float32))
    for k in a:
        assert np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes(), k


def test_dequantize_rejects_mismatched_parts():
    parts = get_codec("fp8_block").quantize(weights((256, 256)))
    parts["weight_scale_inv"] = parts["weight_scale_inv"][:1]
    with pytest.raises(QuantizationError, match="do not match"):
        get_codec("fp8_block").dequantize(parts)


def test_tile_constants_are_multiples_of_the_blocks():
    assert fp8_block.TILE_COLS % fp8_block.BLOCK == 0
    assert fp4_tiles.TILE_COLS % 32 == 0 and fp4_tiles.TILE_COLS % 16 == 0
