"""Host <-> GPU arrays for the accuracy checks (``check`` and the GPU tests).

bfloat16 CuPy arrays use ml_dtypes' ``bfloat16`` (CuPy 14). Host data is float32 arrays
whose values are already rounded to the dtype under test, so the float64 reference and
the kernels see exactly the same inputs. :func:`poisoned_outputs` makes the CuPy
adapter's outputs start as NaN, so an element a kernel leaves unwritten shows.
"""
from __future__ import annotations

import contextlib

import numpy as np

from . import reference

__all__ = ["NAN_BITS", "round_to", "to_device", "to_host", "poisoned", "poisoned_outputs",
           "bfloat16"]

#: A quiet NaN's bit pattern in each 16-bit dtype.
NAN_BITS = {"float16": 0x7E00, "bfloat16": 0x7FC0}


def bfloat16():
    """ml_dtypes' bfloat16 NumPy dtype (what CuPy's bfloat16 arrays hold)."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _np_dtype(dtype: str):
    return bfloat16() if dtype == "bfloat16" else np.dtype(dtype)


def round_to(x, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` ('float16', 'bfloat16' or 'float32'), as float32."""
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return reference.round_to_bf16(x)
    return x.astype(np.float32)


def to_device(x, dtype: str, transposed: bool = False):
    """A CuPy array of ``x`` (float32 holding ``dtype`` values, shape (B, H, L, D)) in
    ``dtype`` (float16, bfloat16 or float32). ``transposed``: stored as (B, L, H, D) memory and
    returned as a (B, H, L, D) view of it (strided, still kernel-readable)."""
    import cupy

    host = x.astype(_np_dtype(dtype))
    if transposed:
        return cupy.asarray(np.ascontiguousarray(host.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
    return cupy.asarray(host)


def to_host(a, dtype: str = "") -> np.ndarray:
    """A float64 NumPy copy of a CuPy array (``dtype`` is accepted for old callers)."""
    import cupy

    return cupy.asnumpy(a).astype(np.float64)


def poisoned(shape, dtype: str):
    """A CuPy array of ``shape`` and ``dtype`` ('float16', 'bfloat16', 'float32') filled
    with NaN."""
    import cupy

    if dtype == "float32":
        return cupy.full(shape, np.nan, dtype=cupy.float32)
    return cupy.full(shape, NAN_BITS[dtype], dtype=cupy.uint16).view(_np_dtype(dtype))


@contextlib.contextmanager
def poisoned_outputs():
    """Inside the block, every output (and the backward's delta scratch) the CuPy adapter
    allocates starts as NaN."""
    import cupy

    from .adapters import cupy as adapter

    real = adapter._empty

    def empty(shape, dtype):
        name = "float32" if dtype == np.float32 else ("float16" if dtype == np.float16 else "bfloat16")
        assert np.dtype(dtype) == np.dtype(_np_dtype(name)), dtype
        return poisoned(shape, name)

    adapter._empty = empty
    try:
        yield
    finally:
        adapter._empty = real
        cupy.cuda.get_current_stream().synchronize()
