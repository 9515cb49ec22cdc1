"""Run-time activation quantizers in torch (weights are never quantized here: they come decoded
from the converter's export).

All functions take float32 ``x [M, K]`` (tokens x inputs) and work per row, so a token's
quantization never depends on which other tokens share the batch.

- FP8 per token-group (DeepSeek-V3 / SGLang ``per_token_group_quant_fp8``): for each row and
  each group of ``g`` consecutive inputs (the last group may be partial), ``s = amax / 448``
  (``s = 1`` for an all-zero group), ``q = e4m3(clamp(x / s, +-448))`` with round-to-nearest-
  even. Dequantized value ``q * s``.
- NVFP4 (ModelOpt / SGLang ``scaled_fp4_quant``): with the export's global ``input_scale``
  ``g_s``, per group of 16: ``s = e4m3(amax / 6 / g_s)``, ``q = e2m1(x / (s * g_s))``
  (round-to-nearest-even, saturating at +-6; a group whose scale is 0 encodes as zeros).
  Dequantized value ``q * s * g_s``.
- INT8 per token (SGLang ``per_token_quant_int8``): ``s = amax(row) / 127`` (1 for a zero row),
  ``q = clamp(round_half_even(x / s), +-127)``.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
E2M1_MAX = 6.0
INT8_MAX = 127.0


def _grouped(x: torch.Tensor, group: int) -> tuple[torch.Tensor, int]:
    """``[M, K]`` -> ``[M, G, group]`` zero-padded (zeros change no group maximum)."""
    m, k = x.shape
    n_groups = -(-k // group)
    pad = n_groups * group - k
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.view(m, n_groups, group), k


def quantize_fp8_groups(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[M, K]`` -> (e4m3 codes ``[M, K]``, float32 scales ``[M, ceil(K/group)]``)."""
    xg, k = _grouped(x.float(), group)
    amax = xg.abs().amax(-1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (xg / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(x.shape[0], -1)[:, :k], scale


def fake_quant_fp8_groups(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """The float32 values ``quantize_fp8_groups`` represents (codes times their scale)."""
    q, scale = quantize_fp8_groups(x, group)
    return q.float() * scale.repeat_interleave(group, dim=1)[:, : x.shape[1]]


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round float32 to the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} (and negatives), RNE, +-6.

    The grid spacing is 0.5 below 2, 1 in [2, 4) and 2 in [4, 6]; ``torch.round`` rounds half
    to even, and on each segment "even" multiples of the spacing are the codes with mantissa
    bit 0, so ties go to the even code as the format requires (e.g. 0.25 -> 0, 0.75 -> 1,
    2.5 -> 2, 5 -> 4).
    """
    a = x.abs().clamp(max=E2M1_MAX)
    low = torch.round(a * 2) / 2
    mid = torch.round(a)
    high = torch.round(a / 2) * 2
    mag = torch.where(a < 2, low, torch.where(a < 4, mid, high))
    return torch.copysign(mag, x)


def fake_quant_nvfp4(x: torch.Tensor, global_scale: float | torch.Tensor,
                     group: int = 16) -> torch.Tensor:
    """float32 ``[M, K]`` -> the float32 values of its NVFP4 encoding (see the module doc)."""
    g_s = torch.as_tensor(global_scale, dtype=torch.float32)
    xg, k = _grouped(x.float(), group)
    amax = xg.abs().amax(-1)
    block = (amax / E2M1_MAX / g_s).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float()
    divisor = block * g_s
    safe = torch.where(divisor > 0, divisor, torch.ones_like(divisor))
    q = round_e2m1(xg / safe[..., None])
    q = torch.where(divisor[..., None] > 0, q, torch.zeros_like(q))
    return (q * divisor[..., None]).view(x.shape[0], -1)[:, :k]


def quantize_int8_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[M, K]`` -> (int8 codes ``[M, K]``, float32 scales ``[M, 1]``)."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(x / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale
