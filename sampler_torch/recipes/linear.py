"""Quantized replacements for the model's projection ``nn.Linear`` modules.

Each module is built from the tensors of one linear in a converter export (``parts``: the
suffix -> array dict the codec's ``quantize`` wrote) and computes ``y = x W^T`` the way the
recipe's serving kernel would:

- ``FP8BlockLinear`` (``fp8_block`` weights, e4m3 + fp32 scale per 128x128 block). With
  ``fp8_g128`` activations the product is, for each 128-wide input group ``g``,
  ``y += (s_a[:, g] * s_w[:, g]) * (q_a[:, g] @ q_w[:, g]^T)`` -- e4m3 x e4m3 products with
  float32 accumulation, exactly what DeepGEMM / SGLang's block-FP8 GEMM computes. ``native``
  runs each group through ``torch._scaled_mm`` with row-wise scales; ``emulate`` multiplies the
  dequantized operands in float32 (same products, float32 rounding of the scale multiply).
- ``DequantLinear``: weight-only recipes (W4A16 NVFP4/MXFP4, and FP8/INT8 weights with
  unquantized activations): the export is decoded once at load (the codec's ``dequantize``) to
  the compute dtype, as Marlin-style kernels decode in registers, and the matmul runs in the
  compute dtype.
- ``NVFP4Linear`` (W4A4): activations are quantized to NVFP4 at run time with the export's
  ``input_scale`` (``sampler_torch.recipes.numerics.fake_quant_nvfp4``); e2m1 x e2m1 products
  with their block scales, accumulated in float32 -- the FP4 tensor-core GEMM's arithmetic.
- ``Int8Linear`` (w8a8): per-token int8 activations times per-channel int8 weights, int32
  accumulation (``torch._int_mm`` when ``native``, exact float64 emulation otherwise), then
  ``y = acc * s_a * s_w``.

The output is cast back to the input's dtype (the compute dtype).
"""

from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from convert.formats import get_codec
from sampler_torch.recipes.numerics import (
    fake_quant_fp8_groups,
    fake_quant_nvfp4,
    quantize_fp8_groups,
    quantize_int8_tokens,
)
from sampler_torch.recipes.registry import Recipe, torch_dtype
from sampler_torch.tensors import to_torch

FP8_BLOCK = 128


def _dequantized(fmt: str, parts: Mapping[str, np.ndarray]) -> torch.Tensor:
    """The float32 weight ``[out, in]`` the export encodes, decoded by the converter's codec."""
    return torch.from_numpy(np.ascontiguousarray(get_codec(fmt).dequantize(parts), np.float32))


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A host copy of ``t`` (a dtype numpy has: the caller views fp8 bytes)."""
    return t.detach().contiguous().cpu().numpy().copy()


def _flatten(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class QuantLinear(nn.Module):
    """Common shape bookkeeping; subclasses implement ``_matmul(x2d) -> float32 [M, out]``."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(_flatten(x))
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def stored_parts(self) -> dict[str, np.ndarray] | None:
        """The export's parts this module was built from, recovered exactly from its buffers
        (what a delta's changes are applied to when the engine reloads in place); ``None``
        where the buffers do not determine them (a decoded weight)."""
        return None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class DequantLinear(QuantLinear):
    """Weight-only quantization: the decoded weight in the compute dtype, a plain matmul."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, fmt: str):
        super().__init__(weight.shape[1], weight.shape[0])
        self.register_buffer("weight", weight.to(dtype))
        self.fmt = fmt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", format={self.fmt}, activations=none"


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _padded(x: torch.Tensor, rows: int, cols: int, fill: float = 0.0) -> torch.Tensor:
    """``x [r, c]`` in the top-left corner of a ``[rows, cols]`` tensor of ``fill`` (padding
    through float32, so fp8 / int8 codes come back exactly)."""
    if tuple(x.shape) == (rows, cols):
        return x
    out = torch.full((rows, cols), fill, dtype=torch.float32, device=x.device)
    out[: x.shape[0], : x.shape[1]] = x.float()
    return out.to(x.dtype)


class FP8BlockLinear(QuantLinear):
    """``pad``: CUDA's ``_scaled_mm`` takes only dimensions that are multiples of 16, so the
    weight groups are zero-padded to them at load and each call pads its activations (zero rows
    and columns add exact zeros; the padding is sliced off the output)."""

    def __init__(self, parts: Mapping[str, np.ndarray], native: bool, pad: bool = False):
        q = to_torch(np.asarray(parts["weight"]))
        scale_inv = torch.from_numpy(np.asarray(parts["weight_scale_inv"], np.float32).copy())
        super().__init__(q.shape[1], q.shape[0])
        self.native = native
        self.pad = 16 if pad else 1
        if native:
            # Per input group g: the e4m3 weight columns (contiguous, so ``.t()`` is the
            # column-major operand _scaled_mm wants) and one float32 scale per output row.
            n_groups = scale_inv.shape[1]
            row_scales = scale_inv.repeat_interleave(FP8_BLOCK, dim=0)[: self.out_features]
            n_out = _round_up(self.out_features, self.pad)
            for g in range(n_groups):
                cols = self._group(g)
                w = _padded(q[:, cols], n_out, _round_up(cols.stop - cols.start, self.pad))
                self.register_buffer(f"weight_g{g}", w.contiguous())
                self.register_buffer(f"scale_g{g}", _padded(row_scales[:, g].contiguous().view(1, -1),
                                                            1, n_out, 1.0).contiguous())
            self.n_groups = n_groups
        else:
            self.register_buffer("weight", _dequantized("fp8_block", parts))

    def _group(self, g: int) -> slice:
        return slice(g * FP8_BLOCK, min(self.in_features, (g + 1) * FP8_BLOCK))

    def stored_parts(self) -> dict[str, np.ndarray] | None:
        """The e4m3 codes (the groups side by side, padding cut) and one scale per 128x128
        block (row ``128 b`` of each group's row scales): the native kernel keeps both as
        stored. The emulated kernel keeps the decoded weight: ``None``."""
        if not self.native:
            return None
        out_f = self.out_features
        groups = [self._group(g) for g in range(self.n_groups)]
        codes = torch.cat([getattr(self, f"weight_g{g}").view(torch.uint8)[:out_f, : c.stop - c.start]
                           for g, c in enumerate(groups)], dim=1)  # bytes: fp8 cat is not everywhere
        scales = torch.cat([getattr(self, f"scale_g{g}")[0, :out_f:FP8_BLOCK, None]
                            for g in range(self.n_groups)], dim=1)
        return {"weight": _numpy(codes).view(ml_dtypes.float8_e4m3fn),
                "weight_scale_inv": _numpy(scales)}

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if not self.native:
            return fake_quant_fp8_groups(x.float(), FP8_BLOCK) @ self.weight.t()
        out_dtype = scaled_mm_out_dtype(x.device)
        if out_dtype is None:
            raise RuntimeError(f"torch runs no fp8 _scaled_mm with row-wise scales on {x.device}; "
                               "use the recipe's kernel: emulate")
        m = x.shape[0]
        # Zero columns up to a multiple of 16 change no group's maximum (nor the group count).
        xp = _padded(x.float(), _round_up(m, self.pad), _round_up(self.in_features, self.pad))
        q, s = quantize_fp8_groups(xp, FP8_BLOCK)
        out = None
        for g in range(self.n_groups):
            start = g * FP8_BLOCK
            cols = slice(start, start + getattr(self, f"weight_g{g}").shape[1])
            part = torch._scaled_mm(q[:, cols].contiguous(), getattr(self, f"weight_g{g}").t(),
                                    scale_a=s[:, g:g + 1].contiguous(),
                                    scale_b=getattr(self, f"scale_g{g}"), out_dtype=out_dtype).float()
            out = part if out is None else out + part
        return out[:m, : self.out_features]

    def extra_repr(self) -> str:
        return (super().extra_repr() + ", format=fp8_block, activations=fp8_g128, kernel="
                + ("_scaled_mm" if self.native else "emulate"))


class NVFP4Linear(QuantLinear):
    def __init__(self, parts: Mapping[str, np.ndarray]):
        w = _dequantized("nvfp4", parts)
        super().__init__(w.shape[1], w.shape[0])
        self.register_buffer("weight", w)
        self.register_buffer("input_scale",
                             torch.tensor(float(np.asarray(parts["input_scale"]).reshape(())),
                                          dtype=torch.float32))

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quant_nvfp4(x.float(), self.input_scale) @ self.weight.t()

    def extra_repr(self) -> str:
        return super().extra_repr() + ", format=nvfp4, activations=nvfp4"


class Int8Linear(QuantLinear):
    """``pad``: CUDA's ``_int_mm`` wants more than 16 rows and multiples of 8, so the weight is
    zero-padded at load and each call pads its activations (sliced off the output)."""

    def __init__(self, parts: Mapping[str, np.ndarray], native: bool, pad: bool = False):
        q = torch.from_numpy(np.asarray(parts["weight"], np.int8).copy())
        scale = torch.from_numpy(np.asarray(parts["weight_scale"], np.float32).copy())
        super().__init__(q.shape[1], q.shape[0])
        self.native = native
        self.pad = native and pad
        if self.pad:
            q = _padded(q, _round_up(q.shape[0], 8), _round_up(q.shape[1], 8))
            scale = _padded(scale.view(1, -1), 1, q.shape[0], 1.0)
        self.register_buffer("weight", q.contiguous())
        self.register_buffer("weight_scale", scale.view(1, -1))

    def stored_parts(self) -> dict[str, np.ndarray]:
        """The int8 codes and the per-row scales, as stored (any padding cut)."""
        out_f, in_f = self.out_features, self.in_features
        return {"weight": _numpy(self.weight[:out_f, :in_f]),
                "weight_scale": _numpy(self.weight_scale[0, :out_f, None])}

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if self.pad:  # zero rows / columns: scale 1, codes 0, exact zero products
            x = _padded(x.float(), max(32, _round_up(m, 8)), self.weight.shape[1])
        q, s = quantize_int8_tokens(x.float())
        if self.native:
            acc = torch._int_mm(q, self.weight.t()).float()
        else:
            # float64 holds every int32 partial sum exactly.
            acc = (q.double() @ self.weight.double().t()).float()
        return (acc * s * self.weight_scale)[:m, : self.out_features]

    def extra_repr(self) -> str:
        return (super().extra_repr() + ", format=w8a8_int8, activations=int8_token, kernel="
                + ("_int_mm" if self.native else "emulate"))


def _device_key(device: torch.device | str) -> str:
    """``cuda`` and ``cuda:<current>`` are one device: one probe, one cache entry."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def _capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


_SCALED_MM_OUT: dict[str, torch.dtype | None] = {}


def scaled_mm_out_dtype(device: torch.device | str = "cpu") -> torch.dtype | None:
    """The output dtype ``torch._scaled_mm`` takes on ``device`` with row-wise scales, the form
    ``FP8BlockLinear`` calls it in (probed once per device): float32 where it runs (CPU; CUDA
    with recent cuBLAS), else bfloat16 (CUDA's row-wise kernels accept only that output on many
    torch / cuBLAS versions; each group's partial is then rounded to bf16 before the float32
    sum), None when there is no fp8 GEMM there (CUDA below compute capability 8.9: no FP8
    tensor cores, whatever a probe might get away with)."""
    key = _device_key(device)
    if key not in _SCALED_MM_OUT:
        device = torch.device(key)
        _SCALED_MM_OUT[key] = None
        cap = _capability(device)
        for dtype in (torch.float32, torch.bfloat16):
            if cap is not None and cap < (8, 9):
                break
            try:
                # 16 x 32 by 32 x 16: the smallest shapes CUDA's fp8 GEMM accepts (multiples of 16).
                a = torch.zeros(16, 32, dtype=torch.float8_e4m3fn, device=device)
                b = torch.zeros(16, 32, dtype=torch.float8_e4m3fn, device=device)
                torch._scaled_mm(a, b.t(), scale_a=torch.ones(16, 1, device=device),
                                 scale_b=torch.ones(1, 16, device=device), out_dtype=dtype)
                _SCALED_MM_OUT[key] = dtype
                break
            except (RuntimeError, AttributeError, NotImplementedError, TypeError):
                continue
    return _SCALED_MM_OUT[key]


def _has_scaled_mm(device: torch.device | str = "cpu") -> bool:
    return scaled_mm_out_dtype(device) is not None


def _has_int_mm(device: torch.device | str = "cpu") -> bool:
    """Whether ``torch._int_mm`` runs on ``device`` in the shapes ``Int8Linear`` calls it with
    (CUDA wants more than 16 rows and multiples of 8: the module pads to that there)."""
    device = torch.device(device)
    try:
        a = torch.zeros(32, 32, dtype=torch.int8, device=device)
        torch._int_mm(a, a.t())
        return True
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


_PROBES: dict[tuple[str, str], bool] = {}


def native_kernel_available(kind: str, device: torch.device | str = "cpu") -> bool:
    """Whether torch runs the ``fp8`` (``_scaled_mm``) or ``int8`` (``_int_mm``) kernel on
    ``device``; probed on that device once and cached per (kind, device), since a GPU without
    FP8 tensor cores must not inherit the CPU's (or another GPU's) answer."""
    if kind not in ("fp8", "int8"):
        raise ValueError(f"no native kernel kind {kind!r} (fp8, int8)")
    key = (kind, _device_key(device))
    if key not in _PROBES:
        _PROBES[key] = (_has_scaled_mm if kind == "fp8" else _has_int_mm)(key[1])
    return _PROBES[key]


#: (kind, device type) where ``kernel: auto`` emulates although torch runs the native kernel:
#: torch's CPU ``_scaled_mm`` is a reference loop, 2.2x slower than the float32 emulation of the
#: same block products (``benchmarks/bench_sampler.py --size small``: 899 vs 1,970 tok/s), while
#: the CPU's ``_int_mm`` beats its emulation (3,534 vs 2,017 tok/s).
SLOWER_THAN_EMULATION = {("fp8", "cpu")}


def use_native(kind: str, kernel: str, device: torch.device | str = "cpu") -> bool:
    """Whether a recipe with ``kernel`` (``auto``/``native``/``emulate``) runs the native ``kind``
    kernel on ``device``: ``auto`` where torch runs it and it is the faster path there;
    ``native`` insists (``RuntimeError`` where torch has none)."""
    device = torch.device(device)
    if kernel == "emulate":
        return False
    available = native_kernel_available(kind, device)
    if kernel == "native":
        if not available:
            raise RuntimeError(f"the native {kind} kernel was asked for; torch does not run it on "
                               f"{device}")
        return True
    return available and (kind, device.type) not in SLOWER_THAN_EMULATION


def matmul_kernel(recipe: Recipe, device: torch.device | str = "cpu") -> str:
    """``native``, ``emulate`` or ``unavailable``: how ``recipe``'s projections multiply on ``device``.

    ``native``: the GEMM the serving kernel runs (bf16 / fp32 weights in the compute dtype;
    fp8 ``_scaled_mm`` and int8 ``_int_mm`` where the probe passes and ``use_native`` picks it:
    ``kernel: auto`` emulates fp8 on the CPU, where that is faster). ``emulate``: the same
    arithmetic in float kernels -- quantized activations through fake quantization (NVFP4 W4A4
    always: no FP4 GEMM is wired here, not even on 10.x parts where torch has one), and
    weight-only recipes whose export is decoded once at load to the compute dtype instead of in a
    fused dequantizing kernel. ``unavailable``: ``kernel: native`` where torch has none.
    """
    act, fmt = recipe.activations, recipe.weight_format
    if fmt == "bf16":
        return "native"
    if act in ("none", "nvfp4"):
        return "emulate"
    kind = "fp8" if act == "fp8_g128" else "int8"
    try:
        return "native" if use_native(kind, recipe.kernel, device) else "emulate"
    except RuntimeError:  # kernel: native where there is none: the recipe cannot load here
        return "unavailable"


def recipe_kernels(device: torch.device | str = "cpu") -> dict[str, str]:
    """``matmul_kernel`` of every registered recipe on ``device`` (what a registration reports)."""
    from sampler_torch.recipes.registry import RECIPES

    return {name: matmul_kernel(r, device) for name, r in RECIPES.items()}


def make_linear(recipe: Recipe, parts: Mapping[str, np.ndarray],
                device: torch.device | str = "cpu") -> nn.Module:
    """The module a recipe runs for one exported linear (``parts`` as the codec wrote them), with
    the native kernels chosen by probing ``device`` (the module is still built on the CPU: the
    caller moves it)."""
    fmt, act = recipe.weight_format, recipe.activations
    device = torch.device(device)

    def native(kind: str) -> bool:
        try:
            return use_native(kind, recipe.kernel, device)
        except RuntimeError as e:
            raise RuntimeError(f"recipe {recipe.name!r}: {e}") from None

    if fmt == "fp8_block" and act == "fp8_g128":
        return FP8BlockLinear(parts, native=native("fp8"), pad=device.type == "cuda")
    if fmt == "nvfp4" and act == "nvfp4":
        return NVFP4Linear(parts)
    if fmt == "w8a8_int8" and act == "int8_token":
        return Int8Linear(parts, native=native("int8"), pad=device.type == "cuda")
    if act == "none" and fmt != "bf16":
        return DequantLinear(_dequantized(fmt, parts), torch_dtype(recipe), fmt)
    raise AssertionError(f"no linear for weights {fmt!r} with activations {act!r}")
