"""CuPy arrays in, CuPy arrays out: allocation, one-time copies and streams for the kernels.

Arrays run where they live (``problem.device``) on CuPy's current stream of that device.
An input the kernels cannot read in place (last axis not unit-stride, rows not 16-byte
aligned, negative strides) is copied once into a contiguous array; inputs are never
written. The public API's forward checks and plans once per call signature
(:func:`prepare`) and then only allocates, writes pointers and launches.
"""
from __future__ import annotations

from . import capability, launch, validate


def _ref(a) -> launch.ArrayRef:
    return launch.ArrayRef(a.data.ptr, _elems(a))


def _ready(a) -> bool:
    return launch.kernel_ready(a.shape, _elems(a), a.data.ptr, a.itemsize)


def _readable(a):
    """``a`` if the kernels can read it in place, else a fresh contiguous copy.

    ``cupy.ascontiguousarray`` returns ``a`` itself when it is already C-contiguous, even
    when its data pointer is not 16-byte aligned (a view at an odd offset); a fresh
    allocation (pool blocks are 512-byte aligned) is made then.
    """
    import cupy

    if _ready(a):
        return a
    c = cupy.ascontiguousarray(a)
    if c is a or not _ready(c):
        c = a.copy(order="C")
    return c


def _workspace(nbytes: int):
    """Split-KV scratch from CuPy's pool (stream-ordered reuse on the current stream)."""
    import cupy

    buf = cupy.empty(nbytes, dtype=cupy.uint8)
    return buf, buf.data.ptr


# ---------------------------------------------------------------------------
# Per-signature memo: validation and the prepared forward launches (as torch_ops does).

_CALLS: dict = {}
_CALLS_MAX = 4096


def _key(q1, k1, q2, k2, v, w, causal, sm_scale):
    return (
        q1.shape, k1.shape, q2.shape, k2.shape, v.shape,
        q1.strides, k1.strides, q2.strides, k2.strides, v.strides,
        q1.dtype, k1.dtype, q2.dtype, k2.dtype, v.dtype,
        q1.device.id, k1.device.id, q2.device.id, k2.device.id, v.device.id,
        type(w), w, type(causal), causal, type(sm_scale), sm_scale, capability.env_override(),
    )


def prepare(q1, k1, q2, k2, v, w, causal, sm_scale):
    """``(problem, launches)`` for CuPy inputs: checked by
    :func:`~cupy_piecewise.validate.check_inputs` and
    :func:`~cupy_piecewise.validate.check_gpu_support`, with the forward's
    :class:`~cupy_piecewise.launch.Launches` when the kernels can read the inputs in place
    by their strides (``None`` otherwise). Memoised per signature (shapes, strides, dtypes,
    devices, scalar values and types, tile override). Raises what the checks raise."""
    try:
        key = _key(q1, k1, q2, k2, v, w, causal, sm_scale)
        hit = _CALLS.get(key)
    except (AttributeError, TypeError):  # not CuPy arrays, or an unhashable scalar
        key = hit = None
    if hit is not None:
        return hit
    problem = validate.check_inputs(q1, k1, q2, k2, v, w, causal, sm_scale)
    validate.check_gpu_support(problem)
    launches = None
    ins = (q1, k1, q2, k2, v)
    if problem.M and problem.N and problem.B * problem.H and all(
            launch.kernel_ready(a.shape, _elems(a), 0, a.itemsize) for a in ins):
        H, M, D = problem.H, problem.M, problem.D
        strides = tuple(_elems(a) for a in ins) + ((H * M * D, M * D, D, 1),)
        launches = launch.forward_launches(problem, strides, split=True)
    hit = (problem, launches)
    if key is not None:
        if len(_CALLS) >= _CALLS_MAX:
            _CALLS.clear()
        _CALLS[key] = hit
    return hit


def _elems(a) -> tuple:
    return tuple(s // a.itemsize for s in a.strides)


def forward(problem, q1, k1, q2, k2, v, *, out=None, launches=None, need_lse=True):
    """Run the forward kernel on CuPy arrays; returns ``(o, lse)``.

    ``o``: (B, H, M, D), the inputs' dtype; ``lse``: (B, H, M) float32. Shapes and dtypes
    must already be validated (:func:`cupy_piecewise.validate.check_inputs`). ``out``, an
    optional preallocated ``(o, lse)`` pair of that shape, dtype and device, receives the
    result (the tests pass NaN-filled arrays to prove every element is written).
    ``launches``: the prepared launches from :func:`prepare` (used when ``out`` is not
    given and the data pointers are 16-byte aligned); with them, ``need_lse=False`` skips
    ``lse`` (returned as ``None``).
    """
    import cupy

    B, H, M, D = problem.B, problem.H, problem.M, problem.D
    with cupy.cuda.Device(problem.device):
        if launches is not None and out is None:
            p = (q1.data.ptr, k1.data.ptr, q2.data.ptr, k2.data.ptr, v.data.ptr)
            if not (p[0] | p[1] | p[2] | p[3] | p[4]) & 15:
                o = cupy.empty((B, H, M, D), dtype=q1.dtype)
                lse = cupy.empty((B, H, M), dtype=cupy.float32) if need_lse else None
                ptrs = p + (o.data.ptr, 0 if lse is None else lse.data.ptr)
                stream = cupy.cuda.get_current_stream().ptr
                if launches.workspace_bytes:
                    ws = cupy.empty(launches.workspace_bytes, dtype=cupy.uint8)
                    launches.run(ptrs, stream, ws.data.ptr)
                    del ws  # the pool reuses it only for work queued after the kernels
                else:
                    launches.run(ptrs, stream)
                return o, lse
        # `arrays` keeps any copies alive until the launch is enqueued: a copy freed
        # earlier goes back to the pool and may become o or lse before the kernel reads it.
        arrays = [_readable(x) for x in (q1, k1, q2, k2, v)]
        ins = [_ref(a) for a in arrays]
        if out is None:
            o = cupy.empty((B, H, M, D), dtype=q1.dtype)
            lse = cupy.empty((B, H, M), dtype=cupy.float32)
        else:
            o, lse = out
        launch.forward(problem, *ins, _ref(o), lse.data.ptr,
                       stream=cupy.cuda.get_current_stream().ptr, workspace=_workspace)
        del arrays
    return o, lse


def backward(problem, q1, k1, q2, k2, v, o, lse, do, *, out=None):
    """Run the backward kernels on CuPy arrays; returns ``(dq1, dk1, dq2, dk2, dv)``.

    dq1, dq2: (B, H, M, D); dk1, dk2, dv: (B, Hkv, N, D); all in the inputs' dtype.
    ``out``: optional preallocated five-tuple in that order.
    """
    import cupy

    B, H, Hkv, M, N, D = problem.B, problem.H, problem.Hkv, problem.M, problem.N, problem.D
    with cupy.cuda.Device(problem.device):
        # `arrays` keeps any copies alive until the launches are enqueued (see forward).
        arrays = [_readable(x) for x in (q1, k1, q2, k2, v, o, do)]
        ins = [_ref(a) for a in arrays[:6]]
        dout = _ref(arrays[6])
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
        del arrays
    return dq1, dk1, dq2, dk2, dv
