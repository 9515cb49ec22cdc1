"""Calibrated activation and KV-cache maxima, and the scales each format derives from them.

A calibration is what a forward pass over a few hundred real tokens measured (the trainer's
JAX policy, ``trainer_jax.calibration``, or the sampler's torch model for KV only,
``sampler_torch.kv_calibration``): the largest ``|x|`` entering each quantized linear
(``input_amax``, by HF module name) and the largest ``|K|`` (after q/k-norm and RoPE, what a KV
cache stores) and ``|V|`` per layer (``kv_amax``). This module turns them into scales the way
NVIDIA ModelOpt's export does and says what was calibrated in the export's manifest:

- NVFP4 ``input_scale = input_amax / (6 * 448)`` (``NVFP4QTensor.get_activation_scaling_factor``:
  the activations' global scale, so a block whose amax equals the calibrated one gets the largest
  e4m3 block scale, 448, and its largest element lands on e2m1's 6). Applied by the codec
  (``convert.formats.nvfp4``), for codecs with ``calibrated_inputs``.
- FP8 (e4m3) KV ``k_scale = max(k_amax / 448, floor)``, likewise ``v_scale`` (``kv_scale``):
  with floor 0 the largest calibrated entry maps to e4m3's largest finite value and small
  entries move out of e4m3's subnormal range (below 2^-6 they keep fewer than 3 mantissa bits),
  but entries beyond the calibrated maximum saturate. ModelOpt's HF export floors the scale at
  1.0, so it only guards against overflow; the trainer does the same by default
  (``train.weights.kv_scale_floor``; the measurement is in ``convert/README.md``).

Calibration is never silent: a value that is not a positive finite number is an error naming
the module or layer, and the ``manifest.json`` of every export it went into carries a
``calibration`` record (method, tokens, sequences, source version, what it set).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from convert.formats.numerics import E2M1_MAX, E4M3_MAX

#: ``method`` of the trainer's calibration: the running max of ``|x|`` (ModelOpt's "max")
METHOD_MAX = "max"
#: a layer whose K or V is all zero on the batch still gets a usable (tiny) scale
MIN_KV_SCALE = 1e-6


def kv_scale(amax: float, *, floor: float = 0.0) -> float:
    """FP8 e4m3 KV-cache scale for a calibrated ``amax``: ``max(amax / 448, floor, 1e-6)``."""
    if not (math.isfinite(amax) and amax >= 0):
        raise ValueError(f"KV amax must be a finite number >= 0, got {amax}")
    return max(float(amax) / float(E4M3_MAX), floor, MIN_KV_SCALE)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What one calibration forward measured, and where its data came from.

    ``input_amax``: HF module name (``model.layers.0.self_attn.q_proj``) -> max ``|input|``.
    ``kv_amax``: layer -> (max ``|K|``, max ``|V|``). ``tokens``/``sequences``: the batch.
    ``source_version``: the weights version the forward ran with (the version being published).
    ``data``: where the token ids came from (``trajectories``: recent training samples;
    ``prompts``: task prompts, before any trajectory exists). ``kv_floor``: see ``kv_scale``.
    """

    input_amax: Mapping[str, float]
    kv_amax: Mapping[int, tuple[float, float]]
    tokens: int
    sequences: int
    source_version: int
    data: str = "trajectories"
    method: str = METHOD_MAX
    kv_floor: float = 0.0

    def __post_init__(self):
        for module, value in self.input_amax.items():
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"calibration: input amax of {module} is {value}; expected a "
                                 "positive finite number")
        for layer, pair in self.kv_amax.items():
            if len(pair) != 2 or not all(math.isfinite(v) and v >= 0 for v in pair):
                raise ValueError(f"calibration: K/V amax of layer {layer} is {pair!r}; expected "
                                 "two finite numbers >= 0")
        if self.tokens <= 0 or self.sequences <= 0:
            raise ValueError(f"calibration over {self.tokens} tokens in {self.sequences} "
                             "sequences: expected at least one of each")

    def kv_scales(self) -> dict[int, tuple[float, float]]:
        """``{layer: (k_scale, v_scale)}`` for an FP8 e4m3 KV cache (``kv_scale``)."""
        return {layer: (kv_scale(k, floor=self.kv_floor), kv_scale(v, floor=self.kv_floor))
                for layer, (k, v) in sorted(self.kv_amax.items())}

    def record(self, *, input_scales: bool, kv_scales: bool) -> dict:
        """The manifest's ``calibration`` entry for an export that took ``input_scales``
        (NVFP4 ``input_scale`` from ``input_amax``) and/or ``kv_scales``."""
        sets = []
        if input_scales:
            sets.append(f"input_scale = amax / {E2M1_MAX * E4M3_MAX:g} ({len(self.input_amax)} "
                        "linears)")
        if kv_scales:
            floor = f", floored at {self.kv_floor:g}" if self.kv_floor else ""
            sets.append(f"k_scale/v_scale = amax / {E4M3_MAX:g}{floor} ({len(self.kv_amax)} "
                        "layers)")
        return {"method": self.method, "tokens": self.tokens, "sequences": self.sequences,
                "source_version": self.source_version, "data": self.data, "sets": sets}


__all__ = ["METHOD_MAX", "MIN_KV_SCALE", "Calibration", "kv_scale"]
