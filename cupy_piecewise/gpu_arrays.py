"""Host <-> GPU arrays for the accuracy checks (``check`` and the GPU tests).

CuPy has no bfloat16 dtype, so bfloat16 data travels as uint16 arrays holding bfloat16
bit patterns (the CuPy back end hands them to the kernels as they are). Host data is
float32 arrays whose values are already rounded to the dtype under test, so the float64
reference and the kernels see exactly the same inputs.
"""
from __future__ import annotations

import numpy as np

from . import reference

__all__ = ["NAN_BITS", "round_to", "to_device", "to_host", "poisoned"]

#: A quiet NaN's bit pattern in each 16-bit dtype.
NAN_BITS = {"float16": 0x7E00, "bfloat16": 0x7FC0}


def round_to(x, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` ('float16', 'bfloat16' or 'float32'), as float32."""
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return reference.round_to_bf16(x)
    return x.astype(np.float32)


def to_device(x, dtype: str, transposed: bool = False):
    """A CuPy array of ``x`` (float32 holding ``dtype`` values, shape (B, H, L, D)):
    float16, or uint16 bfloat16 bit patterns. ``transposed``: stored as (B, L, H, D)
    memory and returned as a (B, H, L, D) view of it (strided, still kernel-readable)."""
    import cupy

    host = x.astype(np.float16) if dtype == "float16" else \
        (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    if transposed:
        return cupy.asarray(np.ascontiguousarray(host.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
    return cupy.asarray(host)


def to_host(a, dtype: str) -> np.ndarray:
    """A float64 NumPy copy of a CuPy array of ``dtype`` (bfloat16 as uint16 bit patterns)."""
    import cupy

    h = cupy.asnumpy(a)
    if dtype == "bfloat16":
        h = (h.astype(np.uint32) << 16).view(np.float32)
    return h.astype(np.float64)


def poisoned(shape, dtype: str):
    """A CuPy array of ``shape`` filled with NaN ('float16', 'bfloat16' as uint16 bit
    patterns, or 'float32'), so that an element a kernel leaves unwritten shows."""
    import cupy

    if dtype == "float32":
        return cupy.full(shape, np.nan, dtype=cupy.float32)
    bits = cupy.full(shape, NAN_BITS[dtype], dtype=cupy.uint16)
    return bits.view(cupy.float16) if dtype == "float16" else bits
