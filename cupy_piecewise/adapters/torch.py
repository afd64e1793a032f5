"""torch CUDA tensors for the core: pointers, strides, allocation, stream.

The kernels read the tensors in place from ``data_ptr()`` and element strides (zero
copy); outputs come from torch's caching allocator on torch's current stream of the
tensors' device, read at every call, with no host-device synchronisation (CUDA-graph
safe). The custom op, autograd and routing live in :mod:`cupy_piecewise.torch_ops`, the
CPU implementation in :mod:`cupy_piecewise.torch_cpu`.
"""
from __future__ import annotations

import operator

import torch

from ..core import ArrayOps, run_backward, run_forward, signature

Tensor = torch.Tensor

__all__ = ["OPS", "key", "forward", "backward"]

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
           "float64": torch.float64}


class _Devices(dict):
    """index -> torch.device, made on first use (a lookup costs no Python frame)."""

    def __missing__(self, index):
        d = self[index] = torch.device("cuda", index)
        return d


_devices = _Devices()

#: Allocator of the outputs (and of the backward's delta scratch). Tests swap in a
#: NaN-filling version to show that the kernels write every element.
_empty = torch.empty


def _empty_out(shape, dtype: str, device: int):
    return _empty(shape, dtype=_DTYPES[dtype], device=_devices[device])


_CONTIGUOUS = torch.contiguous_format


def _empty_like(t, device=None):
    if _empty is torch.empty:  # ~0.6 us cheaper than torch.empty(shape, dtype=, device=)
        return torch.empty_like(t, memory_format=_CONTIGUOUS)
    return _empty(t.shape, dtype=t.dtype, device=t.device)  # the tests' NaN-filling hook


def _scratch(nbytes: int, device: int):
    return torch.empty(nbytes, dtype=torch.uint8, device=_devices[device])


def _fill(t, value) -> None:
    t.fill_(value)


def _copy(t):
    """A fresh contiguous copy (``Tensor.contiguous()`` may return ``t`` itself even when
    the kernels cannot read it: a storage offset breaking 16-byte alignment)."""
    c = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    c.copy_(t)
    return c


def _as_f32(t):
    if t.dtype == torch.float32 and t.is_contiguous():
        return t
    # not t.to(float32, memory_format=contiguous_format): for a float32 tensor with an
    # expanded (stride 0) axis, such as the gradient autograd gives ``lse.sum()``, that
    # returns the tensor itself, and the kernels would read past its one element
    return t.to(torch.float32).contiguous()


# torch's current raw stream without building a torch.cuda.Stream (what Inductor's
# generated code calls); the public route is the fallback if the private name moves.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(index: int) -> int:
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


OPS = ArrayOps(
    library="torch",
    ptr=torch.Tensor.data_ptr,
    strides=torch.Tensor.stride,
    shape=lambda t: t.shape,
    itemsize=torch.Tensor.element_size,
    empty=_empty_out,
    empty_like=_empty_like,
    scratch=_scratch,
    fill=_fill,
    copy=_copy,
    as_f32=_as_f32,
    stream=_stream,
)


_device_of = operator.attrgetter("device")


def key(q1, k1, q2, k2, v, w, causal, sm_scale, q_offset=None, k_offset=0):
    """The memo key of a call (:func:`cupy_piecewise.core.signature`)."""
    return signature("torch", Tensor.stride, _device_of, q1, k1, q2, k2, v, w, causal, sm_scale,
                     q_offset, k_offset)


def forward(call, q1, k1, q2, k2, v, need_lse=True):
    """CUDA forward of a prepared call -> ``(o, lse)`` (see :func:`cupy_piecewise.core.run_forward`)."""
    return run_forward(call, OPS, q1, k1, q2, k2, v, need_lse=need_lse)


def backward(call, do, q1, k1, q2, k2, v, o, lse, deterministic=False, dlse=None):
    """CUDA backward of a prepared call -> ``(dq1, dk1, dq2, dk2, dv)``."""
    return run_backward(call, OPS, do, q1, k1, q2, k2, v, o, lse, deterministic=deterministic,
                        dlse=dlse)
