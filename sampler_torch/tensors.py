"""numpy (ml_dtypes) <-> torch without copies through float32, for every dtype the exports use."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

# numpy dtypes torch.from_numpy cannot take, with the same-width integer to reinterpret through.
_VIEW_AS = {
    np.dtype(ml_dtypes.bfloat16): (np.uint16, torch.bfloat16),
    np.dtype(ml_dtypes.float8_e4m3fn): (np.uint8, torch.float8_e4m3fn),
    np.dtype(ml_dtypes.float8_e5m2): (np.uint8, torch.float8_e5m2),
    np.dtype(ml_dtypes.float8_e8m0fnu): (np.uint8, torch.float8_e8m0fnu),
}


def to_torch(arr: np.ndarray) -> torch.Tensor:
    """A torch tensor with the same dtype and bytes as ``arr`` (bf16 and fp8 included)."""
    arr = np.ascontiguousarray(arr)
    view = _VIEW_AS.get(arr.dtype)
    if view is None:
        return torch.from_numpy(arr)
    int_dtype, torch_dtype = view
    return torch.from_numpy(arr.view(int_dtype)).view(torch_dtype)
