"""CuPy arrays in, CuPy arrays out: allocation, one-time copies and streams for the kernels.

Arrays run where they live (``problem.device``) on CuPy's current stream of that device.
An input the kernels cannot read in place (last axis not unit-stride, rows not 16-byte
aligned, negative strides) is copied once into a contiguous array; inputs are never
written.
"""
from __future__ import annotations

from . import launch


def _ref(a) -> launch.ArrayRef:
    return launch.ArrayRef(a.data.ptr, tuple(s // a.itemsize for s in a.strides))


def _readable(a):
    import cupy

    if launch.kernel_ready(a.shape, tuple(s // a.itemsize for s in a.strides), a.data.ptr,
                           a.itemsize):
        return a
    return cupy.ascontiguousarray(a)


def _workspace(nbytes: int):
    """Split-KV scratch from CuPy's pool (stream-ordered reuse on the current stream)."""
    import cupy

    buf = cupy.empty(nbytes, dtype=cupy.uint8)
    return buf, buf.data.ptr


def forward(problem, q1, k1, q2, k2, v, *, out=None):
    """Run the forward kernel on CuPy arrays; returns ``(o, lse)``.

    ``o``: (B, H, M, D), the inputs' dtype; ``lse``: (B, H, M) float32. Shapes and dtypes
    must already be validated (:func:`cupy_piecewise.validate.check_inputs`). ``out``, an
    optional preallocated ``(o, lse)`` pair of that shape, dtype and device, receives the
    result (the tests pass NaN-filled arrays to prove every element is written).
    """
    import cupy

    B, H, M, D = problem.B, problem.H, problem.M, problem.D
    with cupy.cuda.Device(problem.device):
        ins = [_ref(_readable(x)) for x in (q1, k1, q2, k2, v)]
        if out is None:
            o = cupy.empty((B, H, M, D), dtype=q1.dtype)
            lse = cupy.empty((B, H, M), dtype=cupy.float32)
        else:
            o, lse = out
        launch.forward(problem, *ins, _ref(o), lse.data.ptr,
                       stream=cupy.cuda.get_current_stream().ptr, workspace=_workspace)
    return o, lse


def backward(problem, q1, k1, q2, k2, v, o, lse, do, *, out=None):
    """Run the backward kernels on CuPy arrays; returns ``(dq1, dk1, dq2, dk2, dv)``.

    dq1, dq2: (B, H, M, D); dk1, dk2, dv: (B, Hkv, N, D); all in the inputs' dtype.
    ``out``: optional preallocated five-tuple in that order.
    """
    import cupy

    B, H, Hkv, M, N, D = problem.B, problem.H, problem.Hkv, problem.M, problem.N, problem.D
    with cupy.cuda.Device(problem.device):
        ins = [_ref(_readable(x)) for x in (q1, k1, q2, k2, v, o)]
        dout = _ref(_readable(do))
        lse = cupy.ascontiguousarray(lse, dtype=cupy.float32)
        if out is None:
            dq1 = cupy.empty((B, H, M, D), dtype=q1.dtype)
            dq2 = cupy.empty_like(dq1)
            dk1 = cupy.empty((B, Hkv, N, D), dtype=q1.dtype)
            dk2 = cupy.empty_like(dk1)
            dv = cupy.empty_like(dk1)
        else:
            dq1, dk1, dq2, dk2, dv = out
        delta = cupy.empty((B, H, M), dtype=cupy.float32)
        launch.backward(problem, *ins[:5], ins[5], lse.data.ptr, dout, _ref(dq1), _ref(dk1),
                        _ref(dq2), _ref(dk2), _ref(dv), delta.data.ptr,
                        stream=cupy.cuda.get_current_stream().ptr)
    return dq1, dk1, dq2, dk2, dv
