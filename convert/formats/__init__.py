"""Weight formats: one codec module each, and the registry that names them.

=============  ==========================================================================
``bf16``       plain HF, bf16 (``convert.formats.bf16``)
``fp8_block``  e4m3 + fp32 scale per 128x128 block (``convert.formats.fp8_block``)
``nvfp4``      ModelOpt NVFP4: e2m1 + e4m3 scale per 16 + fp32 globals (``convert.formats.nvfp4``)
``mxfp4``      OCP MXFP4: e2m1 + e8m0 scale per 32 (``convert.formats.mxfp4``)
``w8a8_int8``  int8 + fp32 scale per output channel (``convert.formats.w8a8_int8``)
=============  ==========================================================================

Each module's docstring states its tensors, dtypes, shapes, scale rules and config block.
"""

from __future__ import annotations

from collections.abc import Mapping

from convert.formats.base import (
    ENGINES,
    Codec,
    ShapeRuleError,
    excluded_modules,
    is_quantized_weight,
    module_of,
    shape_exclusions,
    stores_quantized,
    unquantized_modules,
)
from convert.formats.bf16 import BF16Codec
from convert.formats.fp8_block import FP8BlockCodec
from convert.formats.mxfp4 import MXFP4Codec
from convert.formats.numerics import QuantizationError
from convert.formats.nvfp4 import NVFP4Codec
from convert.formats.w8a8_int8 import W8A8Int8Codec

FORMATS: dict[str, Codec] = {c.name: c for c in (
    BF16Codec(), FP8BlockCodec(), NVFP4Codec(), MXFP4Codec(), W8A8Int8Codec())}


class UnknownFormatError(ValueError):
    """A format name (or a config's quantization_config) that no codec implements."""


def get_codec(name: str, layout: str = "native") -> Codec:
    """The codec registered as ``name`` (``layout="compressed-tensors"``: that layout's scheme
    carrying format ``name``, ``convert.compressed_tensors``)."""
    if layout != "native":
        from convert.compressed_tensors import LAYOUT, LAYOUTS, get_scheme  # imports this package

        if layout != LAYOUT:
            raise UnknownFormatError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
        try:
            return get_scheme(name)
        except ValueError as e:
            raise UnknownFormatError(str(e)) from None
    try:
        return FORMATS[name]
    except KeyError:
        raise UnknownFormatError(f"unknown format {name!r}; known: {', '.join(FORMATS)}") from None


def detect_format(config: Mapping) -> Codec:
    """The codec whose ``quantization_config`` an HF ``config.json`` dict carries (either
    layout)."""
    from convert.compressed_tensors import SCHEMES

    qc = config.get("quantization_config")
    for codec in (*FORMATS.values(), *SCHEMES.values()):
        if codec.matches(qc):
            return codec
    raise UnknownFormatError(f"config.json quantization_config {qc!r} matches no known format "
                             f"({', '.join(FORMATS)})")


__all__ = ["ENGINES", "FORMATS", "Codec", "QuantizationError", "ShapeRuleError",
           "UnknownFormatError", "detect_format", "excluded_modules", "get_codec",
           "is_quantized_weight", "module_of", "shape_exclusions", "stores_quantized",
           "unquantized_modules"]
