"""NVFP4's per-tensor scales at ModelOpt's convention (issue 46, the human-style mutants of
``formats``; docs/testing.md).

vLLM's ModelOpt NVFP4 loader reads ``weight_scale_2`` and ``input_scale`` as amax / (6 * 448): the
largest e2m1 value (6) times the largest e4m3 group scale (448). An input scale divided by 448
alone would clip activations six times too early in a server that quantizes them.
"""

from __future__ import annotations

import numpy as np
import pytest

from convert.formats import FORMATS

E2M1_MAX, E4M3_MAX = 6.0, 448.0  # the formats' largest finite values (OCP MX / OCP FP8 specs)


@pytest.mark.parametrize("input_amax", [2688.0, 26.88, 3.5])
def test_nvfp4_per_tensor_scales_are_amax_over_6_times_448(input_amax):
    w = np.random.default_rng(46).standard_normal((4, 32)).astype(np.float32)
    w[1, 7] = -5.25  # the tensor's amax
    parts = FORMATS["nvfp4"].quantize(w, input_amax=input_amax)
    div = np.float32(E2M1_MAX * E4M3_MAX)
    assert parts["weight_scale_2"] == np.float32(5.25) / div
    assert parts["input_scale"] == np.float32(input_amax) / div
    assert parts["input_scale"].shape == () and parts["input_scale"].dtype == np.float32
    assert FORMATS["nvfp4"].quantize(w)["input_scale"] == 1.0  # no calibration: 1
