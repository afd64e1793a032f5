"""prepare / run_forward / run_backward: the one path from arrays to kernel launches.

An adapter describes its array library with an :class:`ArrayOps` (pointer, strides,
allocation, fill, copy, stream); nothing here imports CuPy or torch. The semantics of
the empty cases follow docs/semantics.md ("Edge cases"): a row with no admissible key
gives ``o = 0`` and ``lse = -inf``; with no query rows or no keys every gradient is 0.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, NamedTuple, Optional

from .. import capability, launch, validate
from .memo import Memo

__all__ = ["ArrayOps", "Call", "prepare", "run_forward", "run_backward", "clamp_w", "signature",
           "MEMO", "SharedRows", "shared_rows", "finish_dq"]


class ArrayOps(NamedTuple):
    """What the core needs from one array library (an adapter builds one).

    Every field is a plain callable, so the hot path pays one call per use:

    - ``ptr(a) -> int``: device address of ``a``'s first element;
    - ``strides(a) -> tuple``: strides in elements; ``shape(a) -> tuple``;
      ``itemsize(a) -> int``;
    - ``empty(shape, dtype, device) -> array``: an uninitialised output (``dtype`` a name:
      the inputs' dtype or ``'float32'``), contiguous, 16-byte aligned;
    - ``empty_like(a, device) -> array``: the same for ``a``'s shape and dtype on
      ``device`` (``a``'s own; the forward's ``o``, shaped like ``q1``: libraries make
      these cheaper than ``empty``);
    - ``scratch(nbytes, device) -> array``: bytes of workspace, stream-ordered;
    - ``fill(a, value)``: set every element (0.0 or -inf);
    - ``copy(a) -> array``: a fresh contiguous, 16-byte aligned copy of ``a``;
    - ``as_f32(a) -> array``: ``a`` as a contiguous float32 array (``a`` itself when it is);
    - ``stream(device) -> int``: the library's current ``cudaStream_t`` on ``device``.
    """

    library: str
    ptr: Callable
    strides: Callable
    shape: Callable
    itemsize: Callable
    empty: Callable
    empty_like: Callable
    scratch: Callable
    fill: Callable
    copy: Callable
    as_f32: Callable
    stream: Callable


class Call(NamedTuple):
    """One checked call signature: the problem (``w`` clamped) and, when the kernels can
    read inputs with these strides in place and there is work, the prepared forward
    launches (``None`` otherwise: the general path, which copies what it must)."""

    problem: validate.Problem
    fwd: Optional[launch.Launches]


#: Every prepared signature of every adapter (the key starts with the library's name).
MEMO = Memo(4096)


def signature(library: str, strides_of, device_of, q1, k1, q2, k2, v, w, causal, sm_scale,
              q_offset=None, k_offset=0):
    """The memo key of a call: everything :func:`prepare` decides from (data pointers
    excluded: :func:`run_forward` checks their alignment at every call). ``strides_of`` and
    ``device_of`` read an array's strides and device (C-level callables keep this cheap).
    The scalars' types are part of it so that ``w=3.0`` (rejected) never hits ``w=3``'s
    entry. Raises AttributeError for non-arrays."""
    return (
        library,
        q1.shape, k1.shape, q2.shape, k2.shape, v.shape,
        strides_of(q1), strides_of(k1), strides_of(q2), strides_of(k2), strides_of(v),
        q1.dtype, k1.dtype, q2.dtype, k2.dtype, v.dtype,
        device_of(q1), device_of(k1), device_of(q2), device_of(k2), device_of(v),
        type(w), w, type(causal), causal, type(sm_scale), sm_scale,
        type(q_offset), q_offset, type(k_offset), k_offset,
    )


def clamp_w(problem: validate.Problem) -> validate.Problem:
    """``problem`` with ``w`` (and a position shift) brought into a small range that
    changes no comparison the kernels make.

    Default alignment (``shift`` None, ``P = N - M``): every distance ``d = i + P - j``
    lies in ``[1 - M, N - 1]``, so ``w`` clamped to ``[-(M + N + 1), M + N + 1]`` decides
    every ``d >= w`` as before.

    With position offsets (``shift = q_offset - k_offset``, any int64): with
    ``x = i - j`` in ``[1 - N, M - 1]`` the two comparisons are ``x >= w - P`` (second
    projection) and ``x >= -P`` (causal), so ``P`` clamped to ``[-M, N]`` and
    ``w - P`` clamped to ``[-N, M]`` decide them as before; the result carries
    ``shift = P'`` and ``w = P' + clamp(w - P)``, both within ``M + N`` in magnitude (32-bit
    in the kernels). A shift equal to ``N - M`` is stored as None (the default form)."""
    M, N = problem.M, problem.N
    if problem.shift is None or problem.shift == N - M:
        bound = M + N + 1
        w = max(-bound, min(bound, problem.w))
        if w == problem.w and problem.shift is None:
            return problem
        return replace(problem, w=w, shift=None)
    P = max(-M, min(N, problem.shift))
    t = max(-N, min(M, problem.w - problem.shift))
    if P == N - M:  # the clamp landed on the default alignment
        return replace(problem, w=P + t, shift=None)
    return replace(problem, w=P + t, shift=P)


def _contiguous(shape) -> tuple:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(out))


def _has_work(p) -> bool:
    return bool(p.B and p.H and p.M and p.N)


def prepare(ops: ArrayOps, key, q1, k1, q2, k2, v, w, causal, sm_scale, q_offset=None,
            k_offset=0) -> Call:
    """Check a forward call and plan it, memoised per signature.

    ``key``: the adapter's hashable signature of the call (shapes, strides, dtypes,
    devices, the scalars with their types), or ``None`` to skip the memo; the tile
    override (``CUPY_PIECEWISE_TILES``) is added here. Raises what
    :func:`~cupy_piecewise.validate.check_inputs` and, for GPU arrays,
    :func:`~cupy_piecewise.validate.check_gpu_support` raise, and TypeError when the
    arrays are not of ``ops``' library.
    """
    if key is not None:
        key = (key, capability.plan_switches())
        try:
            hit = MEMO.get(key)
        except TypeError:  # an unhashable scalar: checked (and rejected) below
            key = hit = None
        if hit is not None:
            return hit
    problem = validate.check_inputs(q1, k1, q2, k2, v, w, causal, sm_scale, q_offset, k_offset)
    if problem.library != ops.library:
        raise TypeError(f"q1 is a {problem.library} array; expected {ops.library} arrays here")
    fwd = None
    problem = clamp_w(problem)
    if problem.device is not None:
        validate.check_gpu_support(problem)
        ins = (q1, k1, q2, k2, v)
        if _has_work(problem) and all(
                launch.kernel_ready(ops.shape(a), ops.strides(a), 0, ops.itemsize(a)) for a in ins):
            strides = tuple(ops.strides(a) for a in ins) + (
                _contiguous((problem.B, problem.H, problem.M, problem.D)),)
            fwd = launch.forward_launches(problem, strides, split=True)
    call = Call(problem, fwd)
    if key is not None:
        MEMO.put(key, call)
    return call


def _readable(ops: ArrayOps, a):
    """``a`` when the kernels can read it in place, else a fresh contiguous copy."""
    if launch.kernel_ready(ops.shape(a), ops.strides(a), ops.ptr(a), ops.itemsize(a)):
        return a
    return ops.copy(a)


def _ref(ops: ArrayOps, a) -> launch.ArrayRef:
    return launch.ArrayRef(ops.ptr(a), ops.strides(a))


def run_forward(call: Call, ops: ArrayOps, q1, k1, q2, k2, v, *, need_lse: bool = True):
    """Forward of a prepared call -> ``(o, lse)`` in the adapter's array type.

    ``o``: (B, H, M, D), the inputs' dtype, contiguous; ``lse``: (B, H, M) float32, or
    ``None`` when ``need_lse`` is False and the prepared launches ran (the kernels skip a
    null lse). Launched on the library's current stream of the inputs' device; no
    host-device synchronisation.
    """
    p = call.problem
    dev = p.device
    o = ops.empty_like(q1, dev)
    launches = call.fwd
    ptr = ops.ptr
    if launches is not None:
        ptrs = (ptr(q1), ptr(k1), ptr(q2), ptr(k2), ptr(v))
        if not (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4]) & 15:
            lse = ops.empty((p.B, p.H, p.M), "float32", dev) if need_lse else None
            ptrs += (ptr(o), 0 if lse is None else ptr(lse))
            if launches.workspace_bytes:
                # freed on return: stream-ordered allocators reuse it only for work queued
                # after these kernels
                ws = ops.scratch(launches.workspace_bytes, dev)
                launches.run(ptrs, ops.stream(dev), ptr(ws))
            else:
                launches.run(ptrs, ops.stream(dev))
            return o, lse
    lse = ops.empty((p.B, p.H, p.M), "float32", dev)
    if not (p.B and p.H and p.M):
        return o, lse
    if p.N == 0:  # no keys: every row is empty
        ops.fill(o, 0.0)
        ops.fill(lse, -math.inf)
        return o, lse
    # `keep` holds any copies until the launch is enqueued: a copy freed earlier could be
    # handed out again (as o, say) before the kernel has read it.
    keep = [_readable(ops, a) for a in (q1, k1, q2, k2, v)]
    refs = [_ref(ops, a) for a in keep]

    def workspace(nbytes):
        buf = ops.scratch(nbytes, dev)
        return buf, ptr(buf)

    launch.forward(p, *refs, _ref(ops, o), ptr(lse), stream=ops.stream(dev), workspace=workspace)
    del keep
    return o, lse


def run_backward(call: Call, ops: ArrayOps, do, q1, k1, q2, k2, v, o, lse, *,
                 deterministic: bool = False, dlse=None, shared=None):
    """Gradients of a prepared call -> ``(dq1, dk1, dq2, dk2, dv)``, the inputs' dtype,
    contiguous: dq of shape (B, H, M, D), dk/dv (B, Hkv, N, D) summed over each group's
    query heads. ``o``, ``lse``: the forward's outputs (``lse`` float32 (B, H, M)); ``do``:
    the gradient of ``o``. Shapes and dtypes must already be checked
    (:func:`~cupy_piecewise.validate.check_backward_inputs`). ``deterministic``: bitwise
    reproducible gradients (the Hopper backward then computes dQ without atomics).
    ``dlse``: (B, H, M) gradient of the loss with respect to ``lse``, or None (zero):
    ``ds = p * (dp - delta + dlse)``, folded into the kernels' delta pre-pass.

    ``shared``: a :class:`SharedRows` of these query rows (:func:`shared_rows`): dQ is then
    added into its accumulator and ``dq1``, ``dq2`` come back as ``None``
    (:func:`finish_dq` makes them), and the rows' statistics are computed only by the
    first call that uses it."""
    p = call.problem
    dev, dt = p.device, p.dtype
    q_shape, k_shape = (p.B, p.H, p.M, p.D), (p.B, p.Hkv, p.N, p.D)
    acc = shared is not None
    grads = (None if acc else ops.empty(q_shape, dt, dev), ops.empty(k_shape, dt, dev),
             None if acc else ops.empty(q_shape, dt, dev), ops.empty(k_shape, dt, dev),
             ops.empty(k_shape, dt, dev))
    if not _has_work(p):  # nothing attends: every gradient is zero (and dQ adds nothing)
        for g in grads:
            if g is not None:
                ops.fill(g, 0.0)
        return grads
    delta = ops.empty((p.B, p.H, p.M), "float32", dev)
    keep = [_readable(ops, a) for a in (q1, k1, q2, k2, v, o, do)]
    lse = ops.as_f32(lse)
    if dlse is not None:
        dlse = ops.as_f32(dlse)
    refs = [_ref(ops, a) for a in keep]
    def workspace(nbytes):
        buf = ops.scratch(nbytes, dev)
        return buf, ops.ptr(buf)

    q_free = launch.ArrayRef(0, _contiguous(q_shape))  # dq1, dq2 unwritten with an accumulator
    launch.backward(p, *refs[:6], ops.ptr(lse), refs[6],
                    *[q_free if g is None else _ref(ops, g) for g in grads],
                    ops.ptr(delta), stream=ops.stream(dev), workspace=workspace,
                    deterministic=deterministic, dlse=0 if dlse is None else ops.ptr(dlse),
                    **({} if not acc else dict(dq_accumulator=ops.ptr(shared.dq_acc),
                                               statistics=ops.ptr(shared.stats),
                                               statistics_ready=shared.ready)))
    if acc:
        shared.ready = True
    del keep
    return grads


def _all_contiguous(p) -> tuple:
    """Strides of q1, k1, q2, k2, v, o, dout, dq1, dk1, dq2, dk2, dv, all contiguous."""
    q, k = _contiguous((p.B, p.H, p.M, p.D)), _contiguous((p.B, p.Hkv, p.N, p.D))
    return (q, k, q, k, k, q, q, q, k, q, k, k)


class SharedRows:
    """What backward calls over the same query rows share when a caller splits the keys into
    blocks (context parallelism): the Hopper backward's float32 dQ accumulator, which every
    call adds into and :func:`finish_dq` rounds once (instead of once per block), and the
    rows' statistics (lse in base 2, delta), which the first call computes and the others
    reuse (the pre-pass reads all of o and dO: once per block it would cost as much as a
    small block's main kernel). Made by :func:`shared_rows`. Every call given one must have
    the same query rows, ``o``, ``dO``, ``lse``, ``dlse`` and ``sm_scale``."""

    __slots__ = ("call", "dq_acc", "stats", "ready")

    def __init__(self, call, dq_acc, stats):
        self.call, self.dq_acc, self.stats, self.ready = call, dq_acc, stats, False


def shared_rows(call: Call, ops: ArrayOps, do, q1, k1, q2, k2, v, o) -> Optional[SharedRows]:
    """A new :class:`SharedRows` for :func:`run_backward` calls like ``call`` (these
    arrays' strides, not deterministic), its accumulator zeroed; None when the call's path
    has no dQ accumulator (CPU arrays, the mma.sync kernels, no work)."""
    p = call.problem
    if p.device is None or not _has_work(p):
        return None

    def st(a):  # the strides run_backward's kernels see (non-ready arrays are copied)
        ready = launch.kernel_ready(ops.shape(a), ops.strides(a), ops.ptr(a), ops.itemsize(a))
        return tuple(ops.strides(a)) if ready else _contiguous(ops.shape(a))

    c = _all_contiguous(p)
    strides = tuple(st(a) for a in (q1, k1, q2, k2, v, o, do)) + c[7:]
    acc_bytes, stats_bytes = launch.backward_shared_bytes(p, strides)
    if not acc_bytes:
        return None
    acc = ops.empty((acc_bytes // 4,), "float32", p.device)
    ops.fill(acc, 0.0)
    return SharedRows(call, acc, ops.empty((stats_bytes // 4,), "float32", p.device))


def finish_dq(shared: SharedRows, ops: ArrayOps, out=None):
    """``(dq1, dq2)`` of the sum that :func:`run_backward` calls added into ``shared``'s
    accumulator, in the inputs' dtype: new contiguous arrays, or written into ``out`` (two
    (B, H, M, D) arrays of that dtype with 16-byte aligned rows, e.g. views of larger ones)."""
    p = shared.call.problem
    if out is None:
        q_shape = (p.B, p.H, p.M, p.D)
        out = (ops.empty(q_shape, p.dtype, p.device), ops.empty(q_shape, p.dtype, p.device))
    dq1, dq2 = out
    strides = list(_all_contiguous(p))
    strides[7], strides[9] = tuple(ops.strides(dq1)), tuple(ops.strides(dq2))
    launch.backward_dq_convert(p, tuple(strides), ops.ptr(shared.dq_acc), _ref(ops, dq1),
                               _ref(ops, dq2), stream=ops.stream(p.device))
    return dq1, dq2
