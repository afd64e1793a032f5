"""Packed variable-length batches on the GPU: checks, planning and the calls, for any array
library an :class:`~cupy_piecewise.core.ArrayOps` describes (CuPy, torch CUDA).

:func:`prepare` checks a call (metadata; the running totals' values only when it must read
them anyway to find a missing ``max_seqlen``) and :func:`forward` / :func:`backward` launch
:mod:`cupy_piecewise.varlen_launch`'s kernels on the library's current stream, without a
host synchronisation when both ``max_seqlen_q`` and ``max_seqlen_k`` are given.
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from . import core, launch, validate, varlen_launch
from .varlen import _check_max, check_backward_shapes, check_packed
from .core import ArrayOps
from .core.memo import Memo

__all__ = ["Packed", "prepare", "forward", "backward"]

#: Planned packed calls, per signature (shapes, strides, dtypes, devices, scalars).
_MEMO = Memo(1024)


class Packed(NamedTuple):
    """A checked packed call: ``problem`` with ``B`` sequences, ``M`` / ``N`` the longest
    query / key sequence, ``w`` clamped for them; ``shape`` the packed row counts."""

    problem: validate.Problem
    shape: varlen_launch.VarlenShape


def _check_cu(cu, name: str, library: str, device: int) -> int:
    """Check a running-totals array's metadata; returns B + 1."""
    lib = validate.library_of(cu, name)
    if lib != library:
        raise TypeError(f"{name} is a {lib} array but the inputs are {library} arrays")
    if len(cu.shape) != 1 or int(cu.shape[0]) < 2:
        raise ValueError(f"{name} must be 1-D with B + 1 >= 2 entries, got shape {tuple(cu.shape)}")
    dt = validate.dtype_name(cu)
    if dt != "int32":
        raise TypeError(f"{name} must be int32 running totals on the GPU (the kernels read "
                        f"int32), got {dt}")
    dev = validate._device_key(cu, library)
    if dev != ("cuda", device):
        raise ValueError(f"{name} is on device {validate._describe_device(dev)}; the running "
                         f"totals must be on the inputs' device (cuda:{device})")
    return int(cu.shape[0])


def _longest(cu, name: str, total: int) -> int:
    """Reads ``cu`` on the host (a synchronisation), checks its values, returns the longest
    sequence."""
    values = [int(x) for x in cu.tolist()]
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    for a, b in zip(values, values[1:]):
        if b < a:
            raise ValueError(f"{name} must be non-decreasing (running totals), got {values}")
    if values[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total}, got {values[-1]}")
    return max(b - a for a, b in zip(values, values[1:]))


def prepare(ops: ArrayOps, q1, k1, q2, k2, v, cu_q, cu_k, w, max_q, max_k, causal,
            sm_scale) -> Packed:
    """Check a packed call on the GPU and plan it (memoised per signature).

    The arrays' metadata is checked as :func:`cupy_piecewise.validate.check_inputs` checks
    a (1, H, total, D) call, plus: ``cu_seqlens_*`` int32, 1-D, equal lengths, on the
    inputs' device; ``max_seqlen_*`` ints in [0, total]. A ``max_seqlen`` left None is
    found by reading the totals on the host (a synchronisation), which also checks their
    values (start 0, non-decreasing, end at the packed length). With both given the host
    reads nothing: totals that break those rules, or sequences longer than ``max_seqlen``,
    are the caller's error and give undefined results (rows past max_seqlen unwritten).

    Raises TypeError / ValueError naming the argument.
    """
    library = ops.library
    key = None
    if max_q is not None and max_k is not None:
        try:
            key = (library, tuple(q1.shape), tuple(k1.shape), tuple(q2.shape), tuple(k2.shape),
                   tuple(v.shape), tuple(ops.strides(q1)), tuple(ops.strides(k1)),
                   tuple(ops.strides(q2)), tuple(ops.strides(k2)), tuple(ops.strides(v)),
                   str(q1.dtype), str(k1.dtype), str(q2.dtype), str(k2.dtype), str(v.dtype),
                   str(q1.device), str(k1.device), str(q2.device), str(k2.device), str(v.device),
                   tuple(cu_q.shape), tuple(cu_k.shape), str(cu_q.dtype), str(cu_k.dtype),
                   str(cu_q.device), str(cu_k.device), type(w), w, type(max_q), max_q,
                   type(max_k), max_k, type(causal), causal, type(sm_scale), sm_scale,
                   launch.capability.plan_switches())
            hit = _MEMO.get(key)
        except (AttributeError, TypeError):
            key = hit = None
        if hit is not None:
            return hit
    dense = check_packed(library, q1, k1, q2, k2, v, w, causal, sm_scale)
    if dense.library != library:
        raise TypeError(f"q1 is a {dense.library} array; expected {library} arrays here")
    validate.check_gpu_support(dense)
    total_q, total_k = dense.M, dense.N
    nq = _check_cu(cu_q, "cu_seqlens_q", library, dense.device)
    nk = _check_cu(cu_k, "cu_seqlens_k", library, dense.device)
    if nq != nk:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of "
                         f"sequences, got {nq - 1} and {nk - 1}")
    longest_q = _longest(cu_q, "cu_seqlens_q", total_q) if max_q is None else None
    longest_k = _longest(cu_k, "cu_seqlens_k", total_k) if max_k is None else None
    max_q = longest_q if max_q is None else _check_max(max_q, "max_seqlen_q", total_q)
    max_k = longest_k if max_k is None else _check_max(max_k, "max_seqlen_k", total_k)
    problem = core.clamp_w(replace(dense, B=nq - 1, M=max_q, N=max_k))
    packed = Packed(problem, varlen_launch.VarlenShape(total_q, total_k))
    if key is not None:
        _MEMO.put(key, packed)
    return packed


def _contiguous3(shape) -> tuple:
    return (shape[1] * shape[2], shape[2], 1)


_launch_memo = Memo(1024)


def _launches(kind: str, pk: Packed, strides, deterministic: bool = False):
    key = (kind, pk, strides, deterministic, launch.capability.plan_switches())
    hit = _launch_memo.get(key)
    if hit is None:
        if kind == "fwd":
            made = varlen_launch.forward_launches(pk.problem, pk.shape, strides)
        else:
            made = varlen_launch.backward_launches(pk.problem, pk.shape, strides,
                                                   deterministic=deterministic)
        hit = _launch_memo.put(key, made)
    return hit


def _ready(ops: ArrayOps, a):
    if launch.kernel_ready(ops.shape(a), ops.strides(a), ops.ptr(a), ops.itemsize(a)):
        return a
    return ops.copy(a)


def forward(pk: Packed, ops: ArrayOps, q1, k1, q2, k2, v, cu_q, cu_k):
    """``(o, lse)``: o ``(total_q, H, D)`` in the inputs' dtype, lse ``(H, total_q)``
    float32, on the library's current stream. Every row is written (a sequence without
    keys gives o = 0, lse = -inf)."""
    p, s = pk.problem, pk.shape
    dev = p.device
    o = ops.empty((s.total_q, p.H, p.D), p.dtype, dev)
    lse = ops.empty((p.H, s.total_q), "float32", dev)
    if not (s.total_q and p.H and p.B and p.M):
        return o, lse
    keep = [_ready(ops, a) for a in (q1, k1, q2, k2, v)] + [_cu(ops, cu_q), _cu(ops, cu_k)]
    strides = tuple(tuple(ops.strides(a)) for a in keep[:5]) + (_contiguous3(o.shape),)
    ptrs = tuple(ops.ptr(a) for a in keep[:5]) + (ops.ptr(o), ops.ptr(lse),
                                                  ops.ptr(keep[5]), ops.ptr(keep[6]))
    _launches("fwd", pk, strides).run(ptrs, ops.stream(dev))
    del keep  # stream-ordered: freed copies are reused only by later work
    return o, lse


def backward(pk: Packed, ops: ArrayOps, do, q1, k1, q2, k2, v, o, lse, cu_q, cu_k, dlse=None,
             deterministic: bool = False):
    """``(dq1, dk1, dq2, dk2, dv)``, packed like the inputs, in their dtype. ``o``, ``lse``:
    the forward's outputs; ``do`` of o's shape; ``dlse`` (H, total_q) or None. Shapes are
    checked here. ``deterministic``: bitwise-identical gradients run to run (the Hopper
    backward then takes dQ from the mma.sync dq kernel instead of float32 atomics; the
    mma.sync path always is)."""
    p, s = pk.problem, pk.shape
    dev, dt = p.device, p.dtype
    q_shape, k_shape = (s.total_q, p.H, p.D), (s.total_k, p.Hkv, p.D)
    check_backward_shapes(s.total_q, p.H, p.D, do, o, lse, dlse)
    for name, x in (("do", do), ("o", o)):
        if validate.dtype_name(x) != dt:
            raise TypeError(f"{name} has dtype {validate.dtype_name(x)}; expected {dt} (q1's)")
    grads = tuple(ops.empty(sh, dt, dev) for sh in (q_shape, k_shape, q_shape, k_shape, k_shape))
    if not (p.H and p.B and (s.total_q or s.total_k)):
        return grads
    if not s.total_q or not p.M:  # no queries anywhere: every gradient is zero
        for g in grads:
            ops.fill(g, 0.0)
        return grads
    keep = [_ready(ops, a) for a in (q1, k1, q2, k2, v, o, do)]
    keep += [_cu(ops, cu_q), _cu(ops, cu_k), ops.as_f32(lse)]
    if dlse is not None:
        keep.append(ops.as_f32(dlse))
    delta = ops.empty((p.H, s.total_q), "float32", dev)
    strides = tuple(tuple(ops.strides(a)) for a in keep[:7]) + tuple(
        _contiguous3(sh) for sh in (q_shape, k_shape, q_shape, k_shape, k_shape))
    q1r, k1r, q2r, k2r, vr, or_, dor, cq, ck, lse32 = keep[:10]
    ptr = ops.ptr
    ptrs = (ptr(q1r), ptr(k1r), ptr(q2r), ptr(k2r), ptr(vr), ptr(or_), ptr(lse32), ptr(dor),
            *(ptr(g) for g in grads), ptr(delta), ptr(keep[10]) if dlse is not None else 0,
            ptr(cq), ptr(ck))
    run = _launches("bwd", pk, strides, bool(deterministic))
    ws = ops.scratch(run.workspace_bytes, dev) if run.workspace_bytes else None
    run.run(ptrs, ops.stream(dev), 0 if ws is None else ops.ptr(ws))
    del keep, ws  # stream-ordered: reused only by later work
    return grads


def _cu(ops: ArrayOps, cu):
    """The running totals with unit stride (the kernels index them directly)."""
    if int(ops.strides(cu)[0]) == 1:
        return cu
    return ops.copy(cu)
