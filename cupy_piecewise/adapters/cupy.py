"""CuPy arrays for the core: pointers, strides, allocation on the arrays' device, stream.

Arrays run where they live, on CuPy's current stream of that device. float16 and
bfloat16 (CuPy 14's ``bfloat16`` dtype, backed by ml_dtypes) run the kernels; an input
the kernels cannot read in place (last axis not unit-stride, rows not 16-byte aligned,
negative strides) is copied once; inputs are never written.
"""
from __future__ import annotations

import operator

import cupy
import numpy as np
from cupy_backends.cuda.api import runtime as _rt

from .. import validate
from ..capability import plan_switches
from ..core import MEMO, ArrayOps, prepare, run_backward, run_forward, signature

__all__ = ["OPS", "key", "attention", "attention_backward", "bfloat16"]


def _bfloat16():
    try:
        import ml_dtypes  # registers the NumPy dtype CuPy's bfloat16 arrays use
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


#: The bfloat16 dtype of CuPy arrays (``None`` without ml_dtypes).
bfloat16 = _bfloat16()
_DTYPES = {"float16": np.dtype(np.float16), "float32": np.dtype(np.float32),
           "float64": np.dtype(np.float64), "bfloat16": bfloat16}

_memo_get = MEMO.get

#: Allocator of the outputs (and the backward's delta scratch): ``(shape, dtype) ->
#: cupy.ndarray`` on the current device. Tests swap in a NaN-filling version.
_empty = cupy.empty


class _on:
    """``with _on(device):`` makes ``device`` CuPy's current device when it is not."""

    __slots__ = ("device", "prev")

    def __init__(self, device: int):
        self.device = device

    def __enter__(self):
        self.prev = _rt.getDevice()
        if self.prev != self.device:
            _rt.setDevice(self.device)

    def __exit__(self, *exc):
        if self.prev != self.device:
            _rt.setDevice(self.prev)


def _empty_out(shape, dtype: str, device: int):
    if _rt.getDevice() == device:
        return _empty(shape, _DTYPES[dtype])
    with _on(device):
        return _empty(shape, _DTYPES[dtype])


def _empty_like(a, device: int):
    if _rt.getDevice() == device:
        return _empty(a.shape, a.dtype)
    with _on(device):
        return _empty(a.shape, a.dtype)


def _scratch(nbytes: int, device: int):
    with _on(device):
        return cupy.empty(nbytes, dtype=cupy.uint8)


def _fill(a, value) -> None:
    with _on(a.device.id):
        a.fill(value)


def _copy(a):
    """A fresh C-contiguous copy (``cupy.ascontiguousarray`` returns ``a`` itself when it
    is contiguous even with a pointer the kernels cannot use; pool blocks are aligned)."""
    with _on(a.device.id):
        return a.copy(order="C")


def _as_f32(a):
    if a.dtype == cupy.float32 and a.flags.c_contiguous:
        return a
    with _on(a.device.id):
        return cupy.ascontiguousarray(a, dtype=cupy.float32)


def _strides(a) -> tuple:
    n = a.itemsize
    return tuple(s // n for s in a.strides)


def _stream(device: int) -> int:
    return cupy.cuda.get_current_stream(device).ptr


OPS = ArrayOps(
    library="cupy",
    ptr=lambda a: a.data.ptr,
    strides=_strides,
    shape=lambda a: a.shape,
    itemsize=lambda a: a.itemsize,
    empty=_empty_out,
    empty_like=_empty_like,
    scratch=_scratch,
    fill=_fill,
    copy=_copy,
    as_f32=_as_f32,
    stream=_stream,
)


_strides_of = operator.attrgetter("strides")
_device_of = operator.attrgetter("device.id")


def key(q1, k1, q2, k2, v, w, causal, sm_scale, q_offset=None, k_offset=0):
    """The memo key of a call (:func:`cupy_piecewise.core.signature`)."""
    return signature("cupy", _strides_of, _device_of, q1, k1, q2, k2, v, w, causal, sm_scale,
                     q_offset, k_offset)


def _call(q1, k1, q2, k2, v, w, causal, sm_scale, q_offset=None, k_offset=0):
    try:
        k = key(q1, k1, q2, k2, v, w, causal, sm_scale, q_offset, k_offset)
        hit = _memo_get((k, plan_switches()))
    except (AttributeError, TypeError):  # not CuPy arrays (check_inputs says which), or
        k = hit = None                   # an unhashable scalar
    if hit is not None:
        return hit
    return prepare(OPS, k, q1, k1, q2, k2, v, w, causal, sm_scale, q_offset, k_offset)


def attention(q1, k1, q2, k2, v, dist_threshold, *, causal=False, sm_scale=None, return_lse=False,
              deterministic=False, q_offset=None, k_offset=0):
    """Forward of CuPy arrays; arguments, results and errors as
    :func:`cupy_piecewise.attention` (CuPy arrays out, on the inputs' device;
    ``deterministic`` is checked and has nothing to change: the forward is deterministic)."""
    validate.check_deterministic(deterministic)
    call = _call(q1, k1, q2, k2, v, dist_threshold, causal, sm_scale, q_offset, k_offset)
    o, lse = run_forward(call, OPS, q1, k1, q2, k2, v, need_lse=return_lse)
    return (o, lse) if return_lse else o


def attention_backward(do, q1, k1, q2, k2, v, o, lse, dist_threshold, *, causal=False, sm_scale=None,
                       deterministic=False, q_offset=None, k_offset=0, dlse=None):
    """Backward of CuPy arrays; arguments, results and errors as
    :func:`cupy_piecewise.attention_backward`."""
    det = validate.check_deterministic(deterministic)
    call = _call(q1, k1, q2, k2, v, dist_threshold, causal, sm_scale, q_offset, k_offset)
    validate.check_backward_inputs(call.problem, o, lse, do, dlse)
    return tuple(run_backward(call, OPS, do, q1, k1, q2, k2, v, o, lse, deterministic=det,
                              dlse=dlse))
