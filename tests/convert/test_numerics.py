"""The bit-level kernels the codecs share, checked against ml_dtypes' reference casts."""

import ml_dtypes
import numpy as np
import pytest

from convert.formats import numerics as nm


def _float32_sweep() -> np.ndarray:
    # Every 4093rd float32 bit pattern (a prime stride hits every mantissa/sticky combination),
    # plus every bf16-truncated pattern, plus ties around the e4m3/e2m1 grids.
    bits = np.arange(0, 1 << 32, 4093, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate([bits.view(np.float32),
                        (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)])
    grid8 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid8 = np.unique(grid8[np.isfinite(grid8)])
    mids = (grid8[1:] + grid8[:-1]) / 2
    grid4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    mids4 = (grid4[1:] + grid4[:-1]) / 2
    extra = np.concatenate([mids, mids4, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf)])
    x = np.concatenate([x, extra, -extra])
    return x[np.isfinite(x)]


@pytest.mark.parametrize("target,max_value,encode", [
    (ml_dtypes.float8_e4m3fn, 448.0, nm.encode_e4m3),
    (ml_dtypes.float4_e2m1fn, 6.0, nm.encode_e2m1),
])
def test_table_encoders_equal_the_reference_rne_cast(target, max_value, encode):
    x = _float32_sweep()
    ref = np.clip(x, -max_value, max_value).astype(target).view(np.uint8)
    got = encode(x)
    mismatch = np.flatnonzero(ref != got)
    assert mismatch.size == 0, (x[mismatch[:5]], ref[mismatch[:5]], got[mismatch[:5]])


def test_encoders_saturate_and_keep_the_sign_of_zero():
    x = np.array([448.0, 449.0, 1e30, -1e30, -0.0, 0.0], np.float32)
    assert list(nm.encode_e4m3(x)) == [0x7E, 0x7E, 0x7E, 0xFE, 0x80, 0x00]
    y = np.array([6.0, 6.9, 7.0, 100.0, -100.0, -0.0, 0.25, 0.75, 2.5, 5.0], np.float32)
    # ties go to the even code: 0.25 -> 0, 0.75 -> 1.0, 2.5 -> 2, 5 -> 4
    assert list(nm.encode_e2m1(y)) == [7, 7, 7, 7, 15, 8, 0, 2, 4, 6]


def test_decode_tables_equal_ml_dtypes_views():
    codes = np.arange(256, dtype=np.uint8)
    ref = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = nm.decode_e4m3(codes)
    assert np.array_equal(np.isnan(ref), np.isnan(got))
    finite = ~np.isnan(ref)
    assert np.array_equal(ref[finite].view(np.uint32), got[finite].view(np.uint32))  # signed 0
    nib = np.arange(16, dtype=np.uint8)
    ref4 = nib.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert np.array_equal(ref4.view(np.uint32), nm.decode_e2m1(nib).view(np.uint32))
    ref_e8 = codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    got_e8 = nm.decode_e8m0(codes)
    assert np.array_equal(ref_e8, got_e8, equal_nan=True)


def test_pack_order_is_low_nibble_first():
    codes = np.array([[1, 2, 3, 15]], np.uint8)
    packed = nm.pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0xF3]]
    assert np.array_equal(nm.unpack_nibbles(packed), codes)


def test_bf16_conversions_are_exact_and_rne():
    x = _float32_sweep()
    x = x[np.abs(x) < 3e38]
    assert np.array_equal(nm.to_bf16(x).view(np.uint16),
                          x.astype(ml_dtypes.bfloat16).view(np.uint16))
    b = x.astype(ml_dtypes.bfloat16)
    assert np.array_equal(nm.load_f32(b).view(np.uint32), b.astype(np.float32).view(np.uint32))


def test_check_finite_catches_nan_and_inf_in_any_dtype():
    for dtype in (np.float32, ml_dtypes.bfloat16, np.float16):
        x = np.zeros(3000, dtype)
        nm.check_finite(x)
        for bad in (np.nan, np.inf, -np.inf):
            y = x.copy()
            y[2999] = bad
            with pytest.raises(nm.QuantizationError, match="NaN or Inf"):
                nm.check_finite(y, "t")


def test_parallel_map_matches_serial_and_propagates_errors():
    assert nm.parallel_map(lambda i: i * i, range(50)) == [i * i for i in range(50)]

    def boom(i):
        if i == 7:
            raise RuntimeError("seven")
        return i

    with pytest.raises(RuntimeError, match="seven"):
        nm.parallel_map(boom, range(20))


def test_parallel_map_raises_only_once_every_started_task_ended(monkeypatch):
    """A failed delta apply left a temp directory behind: the caller removed it while another
    file's task was still writing into it. The error now waits for the running tasks."""
    import threading
    import time

    monkeypatch.setenv("MIXRL_CONVERT_THREADS", "2")
    started, ended = threading.Event(), threading.Event()

    def task(i):
        if i == 0:
            started.set()
            time.sleep(0.5)
            ended.set()
            return i
        started.wait(5)
        raise RuntimeError("fails while item 0 runs")

    with pytest.raises(RuntimeError, match="while item 0"):
        nm.parallel_map(task, [1, 0])  # the failing item first: its error is the first in order
    assert ended.is_set()
