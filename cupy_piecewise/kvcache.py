"""Attention against a key/value cache: decode, chunked prefill and speculative verification.

:func:`attention_with_kvcache` attends ``M`` new query rows per sequence to the keys a
cache holds for that sequence (``cache_seqlens``, on the device), after writing ``M`` new
keys into the cache in place when they are given. Caches are contiguous
``(B, Hkv, N_max, D)`` arrays of any strides (FlashAttention's ``(B, N_max, Hkv, D)``
memory is a transposed view) or paged ``(num_blocks, Hkv, block_size, D)`` with a
``block_table``. The CUDA path reads the lengths on the device only: no host
synchronisation, and a grid that depends on shapes alone, so a decode step on torch
tensors captures in a CUDA graph and replays with new lengths (docs/kvcache.md; the CuPy
path's workspace is a pool temporary, so it is not for graph capture).

Paths: NumPy arrays run the float64 reference (:func:`reference_with_kvcache`); CuPy
arrays and torch CUDA tensors the kernels of ``kernels_cu/kvcache.cu`` (torch through the
``cupy_piecewise::kvcache`` operator, :mod:`cupy_piecewise.kvcache_torch`); torch CPU
tensors the reference, with the append done on the tensors themselves.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from . import reference, validate
from .validate import GPU_MAX_LENGTH, KV_DTYPES

#: Head dims of the KV-cache kernels (the capability table's kvcache and kvdecode rows;
#: 80, 96 and 256 have no KV-cache tiles yet).
KV_HEAD_DIMS = (16, 32, 64, 128)
#: dtypes a call may have on any library (the host paths compute in float64, NumPy's
#: bfloat16 being ml_dtypes'; the GPU further narrows to KV_DTYPES)
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")

__all__ = ["attention_with_kvcache", "reference_with_kvcache", "KVArgs", "check_kvcache_args"]

_CACHES = ("k1_cache", "k2_cache", "v_cache")
_NEW = ("k1_new", "k2_new", "v_new")


class KVArgs(NamedTuple):
    """A checked KV-cache call (metadata only)."""

    library: str
    device: int | None  # CUDA device index, None on the CPU
    dtype: str
    B: int
    H: int
    Hkv: int
    M: int
    D: int
    paged: bool
    block_size: int  # rows per page (paged) or N_max (contiguous)
    capacity: int  # keys one sequence can hold
    pages: int  # the caches' dim 0: pages (paged) or B (contiguous)
    appended: bool
    w: int
    causal: bool
    sm_scale: float


def _strides(x, library: str) -> tuple:
    if library == "torch":
        return tuple(int(s) for s in x.stride())
    return tuple(int(s) // x.itemsize for s in x.strides)


def check_kvcache_args(q1, q2, k1_cache, k2_cache, v_cache, dist_threshold, cache_seqlens,
                       k1_new=None, k2_new=None, v_new=None, block_table=None, causal=True,
                       sm_scale=None) -> KVArgs:
    """Check a call of :func:`attention_with_kvcache` from metadata alone (no values read).

    Raises:
        TypeError: an argument of the wrong type or dtype (arrays of mixed libraries, a
            dtype not in FLOAT_DTYPES,
            ``cache_seqlens``/``block_table`` not int32, ``dist_threshold`` not an integer,
            ``causal`` not a bool).
        ValueError: shapes that do not agree (head dim 0 included), arrays on different
            devices, only some of ``k1_new``/``k2_new``/``v_new``, a paged block size that
            is not a multiple of 16, lengths of ``2**30`` or more, a bad ``sm_scale``, a
            cache with a stride-0 (expanded) axis when new keys are written into it; on the
            GPU a dtype or head dim the kernels lack, or a cache whose strides the kernels
            cannot use in place.
    """
    library = validate.library_of(q1, "q1")
    named = {"q1": q1, "q2": q2, "k1_cache": k1_cache, "k2_cache": k2_cache, "v_cache": v_cache,
             "cache_seqlens": cache_seqlens}
    news = [k1_new, k2_new, v_new]
    if any(x is not None for x in news):
        if any(x is None for x in news):
            missing = ", ".join(n for n, x in zip(_NEW, news) if x is None)
            raise ValueError(f"k1_new, k2_new and v_new come together: {missing} missing")
        named.update(zip(_NEW, news))
    if block_table is not None:
        named["block_table"] = block_table
    for name, x in named.items():
        if validate.library_of(x, name) != library:
            raise TypeError(f"{name} is a {validate.library_of(x, name)} array but q1 is a "
                            f"{library} array: pass arrays of one library")
    devices = {name: validate._device_key(x, library) for name, x in named.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {validate._describe_device(d)}" for n, d in devices.items())
        raise ValueError(f"all arrays must be on one device: {listing}")
    kind, index = devices["q1"]
    on_gpu = kind == "cuda"

    shape = {name: validate._shape(x) for name, x in named.items()}
    if len(shape["q1"]) != 4 or shape["q2"] != shape["q1"]:
        raise ValueError(f"q1 and q2 must share one shape (B, H, M, D), got {shape['q1']} and "
                         f"{shape['q2']}")
    B, H, M, D = shape["q1"]
    dtype = validate.dtype_name(q1)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"q1 has dtype {dtype}; queries, caches and new keys must be one of "
                        f"{', '.join(FLOAT_DTYPES)}")
    for name in ("q2",) + _CACHES + (_NEW if "k1_new" in named else ()):
        if validate.dtype_name(named[name]) != dtype:
            raise TypeError(f"{name} has dtype {validate.dtype_name(named[name])}, q1 {dtype}: "
                            "queries, caches and new keys share one dtype")
    cshape = shape["k1_cache"]
    if len(cshape) != 4 or shape["k2_cache"] != cshape or shape["v_cache"] != cshape:
        raise ValueError("k1_cache, k2_cache and v_cache must share one 4-d shape, got "
                         + ", ".join(str(shape[n]) for n in _CACHES))
    pages, Hkv, rows, Dc = cshape
    if Dc != D:
        raise ValueError(f"k1_cache: head dim {Dc} differs from q1's {D}")
    if D < 1:
        raise ValueError("q1 has head_dim 0; head_dim (last dimension) must be at least 1")
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"q1's heads ({H}) must be a multiple of k1_cache's key/value heads "
                         f"({Hkv})")
    for name in ("cache_seqlens",) + (("block_table",) if block_table is not None else ()):
        if validate.dtype_name(named[name]) != "int32":
            raise TypeError(f"{name} must be int32, got {validate.dtype_name(named[name])}")
    if shape["cache_seqlens"] != (B,):
        raise ValueError(f"cache_seqlens must have shape (B,) = ({B},), got {shape['cache_seqlens']}")
    paged = block_table is not None
    if paged:
        if len(shape["block_table"]) != 2 or shape["block_table"][0] != B:
            raise ValueError(f"block_table must have shape (B, max_blocks) with B = {B}, got "
                             f"{shape['block_table']}")
        if rows % 16 or rows == 0:
            raise ValueError(f"k1_cache: paged caches need a block size (dim 2) that is a "
                             f"positive multiple of 16, got {rows}")
        capacity = shape["block_table"][1] * rows
    else:
        if pages != B:
            raise ValueError(f"k1_cache: a contiguous cache has shape (B, Hkv, N_max, D) with "
                             f"B = {B}, got {cshape} (pass block_table for a paged cache)")
        capacity = rows
    if capacity >= GPU_MAX_LENGTH or M >= GPU_MAX_LENGTH:
        raise ValueError(f"k1_cache's capacity ({capacity}) and q1's new rows ({M}) must stay "
                         "below 2**30")
    if "k1_new" in named:
        for name in _NEW:
            if shape[name] != (B, Hkv, M, D):
                raise ValueError(f"{name} must have shape (B, Hkv, M, D) = {(B, Hkv, M, D)}, got "
                                 f"{shape[name]}")
    w = validate._check_w(dist_threshold)
    causal = validate._check_causal(causal)
    scale = validate._check_sm_scale(sm_scale, D)
    if scale * 1.4426950408889634 > 3.0e38:  # the kernels take sm_scale * log2(e) in float32
        raise ValueError(f"sm_scale must stay below 2e38 (its product with log2(e) is a "
                         f"float32 in the kernels), got {sm_scale!r}")
    if on_gpu:
        if dtype not in KV_DTYPES:
            extra = (" (float32 KV caches are not supported on the GPU: keep the cache in "
                     "bfloat16 or float16)") if dtype == "float32" else ""
            raise ValueError(f"q1: the KV-cache kernels take {' and '.join(KV_DTYPES)}, got "
                             f"{dtype}{extra}")
        if D not in KV_HEAD_DIMS:
            raise ValueError(f"q1: the KV-cache kernels take head dims {KV_HEAD_DIMS}, got {D}")
        from .launch import kernel_ready

        for name in _CACHES:
            x = named[name]
            ptr = int(x.data_ptr()) if library == "torch" else int(x.data.ptr)
            strides = _strides(x, library)
            if not kernel_ready(cshape, strides, ptr, 2):
                raise ValueError(
                    f"{name}: the kernels read and write caches in place, which needs unit "
                    "stride along D, every other stride a non-negative multiple of 8 elements "
                    f"and a 16-byte aligned pointer; got strides {strides}")
    if "k1_new" in named:
        for name in _CACHES:
            strides = _strides(named[name], library)
            if any(st == 0 and n > 1 for n, st in zip(cshape, strides)):
                raise ValueError(f"{name}: new keys are written into the cache, whose rows must "
                                 f"not alias (a stride-0, expanded axis); got strides {strides}")
    return KVArgs(library, index if on_gpu else None, dtype, B, H, Hkv, M, D, paged, rows,
                  capacity, pages, "k1_new" in named, w, causal, scale)


def _rows(cache, b, n, block_table):
    """Rows 0..n-1 of sequence ``b`` of a cache: (Hkv, n, D)."""
    if block_table is None:
        return cache[b, :, :n]
    bs = cache.shape[2]
    pages = [cache[int(p)] for p in block_table[b, :math.ceil(n / bs)]]
    if not pages:  # (also when the cache has no pages at all)
        return np.empty((cache.shape[1], 0, cache.shape[3]), cache.dtype)
    return np.concatenate(pages, axis=1)[:, :n]


def _append(cache, b, pos, rows, block_table):
    """Write ``rows`` (Hkv, m, D) into sequence ``b`` of a cache at positions pos.. (in place)."""
    for t in range(rows.shape[1]):
        n = pos + t
        if block_table is None:
            cache[b, :, n] = rows[:, t]
        else:
            bs = cache.shape[2]
            cache[int(block_table[b, n // bs]), :, n % bs] = rows[:, t]


def host_lengths(a: KVArgs, cache_seqlens, block_table=None) -> np.ndarray:
    """``cache_seqlens`` (host values: NumPy, or a CPU tensor's ``.numpy()``) as int64, after
    checking that every sequence's length plus the appended rows fits the cache and, for a
    paged cache, that every ``block_table`` entry those rows use (host values) names a page
    of the cache. Entries past a sequence's last used block are not read: they may hold
    anything. The checks run before the append writes anything.

    Raises:
        ValueError: a negative length, one that the append would take past the capacity, or
            a used ``block_table`` entry outside ``[0, num_blocks)``.
    """
    seq = np.asarray(cache_seqlens, np.int64)
    extra = a.M if a.appended else 0
    if (seq < 0).any() or (seq + extra > a.capacity).any():
        raise ValueError(f"cache_seqlens {seq.tolist()} plus {extra} appended rows must lie in "
                         f"[0, {a.capacity}] (the cache's capacity)")
    if block_table is not None:
        table = np.asarray(block_table, np.int64)
        used = -(-(seq + extra) // a.block_size)  # blocks holding rows 0 .. length - 1
        for b in range(a.B):
            row = table[b, :used[b]]
            bad = row[(row < 0) | (row >= a.pages)]
            if bad.size:
                raise ValueError(f"block_table[{b}] uses page {int(bad[0])}, outside the "
                                 f"cache's {a.pages} pages (k1_cache's dim 0); the first "
                                 f"{int(used[b])} entries of the row must lie in "
                                 f"[0, {a.pages})")
    return seq


def by_library(library: str, args, q1, return_lse: bool, reference_fn, torch_fn, cupy_fn):
    """The entry points' dispatch: NumPy runs ``reference_fn(*args)`` (results cast to q1's
    dtype, lse to float32), torch ``torch_fn(*args)``, CuPy ``cupy_fn(*args)``; returns
    ``o`` or ``(o, lse)``."""
    if library == "numpy":
        o, lse = reference_fn(*args)
        o = o.astype(q1.dtype)
        lse = lse.astype(np.float32)
    elif library == "torch":
        o, lse = torch_fn(*args)
    else:
        o, lse = cupy_fn(*args)
    return (o, lse) if return_lse else o


def reference_with_kvcache(q1, q2, k1_cache, k2_cache, v_cache, dist_threshold, cache_seqlens,
                           k1_new=None, k2_new=None, v_new=None, block_table=None, causal=True,
                           sm_scale=None):
    """Float64 reference of :func:`attention_with_kvcache` on NumPy arrays (any float dtype).

    Appends ``k1_new``/``k2_new``/``v_new`` into the caches in place (cast to the caches'
    dtype), then attends sequence by sequence with :func:`cupy_piecewise.reference.forward`
    at the positions the function's docstring gives.

    Returns:
        ``(o, lse)``: float64 arrays of shapes (B, H, M, D) and (B, H, M).

    Raises:
        ValueError: what :func:`check_kvcache_args` raises, and a sequence whose cached
            length plus appended rows exceeds the cache's capacity, or a negative length.
    """
    a = check_kvcache_args(q1, q2, k1_cache, k2_cache, v_cache, dist_threshold, cache_seqlens,
                           k1_new, k2_new, v_new, block_table, causal, sm_scale)
    seq = host_lengths(a, cache_seqlens, block_table)
    extra = a.M if a.appended else 0
    o = np.zeros((a.B, a.H, a.M, a.D))
    lse = np.full((a.B, a.H, a.M), -np.inf)
    for b in range(a.B):
        if a.appended:
            for cache, new in zip((k1_cache, k2_cache, v_cache), (k1_new, k2_new, v_new)):
                _append(cache, b, int(seq[b]), new[b], block_table)
        L = int(seq[b]) + extra
        ks = [_rows(c, b, L, block_table)[None] for c in (k1_cache, k2_cache, v_cache)]
        ob, lb = reference.forward(q1[b:b + 1], ks[0], q2[b:b + 1], ks[1], ks[2], a.w, a.causal,
                                   a.sm_scale, q_offset=L - a.M, k_offset=0)
        o[b], lse[b] = ob[0], lb[0]
    return o, lse


def attention_with_kvcache(q1, q2, k1_cache, k2_cache, v_cache, dist_threshold, *,
                           cache_seqlens, k1_new=None, k2_new=None, v_new=None, block_table=None,
                           causal=True, sm_scale=None, return_lse=False):
    """Piecewise attention of new query rows against a key/value cache (no gradient).

    Sequence ``b`` attends keys ``0 .. L_b - 1`` of its cache, where
    ``L_b = cache_seqlens[b] + M`` when new keys are given (they are first written into
    the cache at positions ``cache_seqlens[b] .. cache_seqlens[b] + M - 1``, in place) and
    ``L_b = cache_seqlens[b]`` otherwise; query ``t`` sits at position ``L_b - M + t``
    (the queries end where the keys end). The score of query ``t`` and key ``n`` is
    ``sm_scale * q2·k2`` when ``d = (L_b - M + t) - n >= dist_threshold`` and
    ``sm_scale * q1·k1`` otherwise; ``causal`` excludes keys with ``d < 0``. A row with no
    admissible key gives ``o = 0`` and ``lse = -inf``.

    Args:
        q1, q2: new queries, (B, H, M, D): M = 1 to decode, more for chunked prefill or
            speculative verification.
        k1_cache, k2_cache, v_cache: the caches, all of one shape: contiguous
            ``(B, Hkv, N_max, D)`` with any strides (unit stride along D on the GPU), or
            paged ``(num_blocks, Hkv, block_size, D)`` with ``block_size`` a multiple of 16.
            Written in place when new keys are given.
        dist_threshold: the distance ``w`` (an integer, negative allowed).
        cache_seqlens: (B,) int32 on the arrays' device: keys already cached per sequence.
        k1_new, k2_new, v_new: (B, Hkv, M, D) keys and values to append, all or none.
        block_table: (B, max_blocks) int32: page of each block of ``block_size`` rows of
            each sequence (paged caches only; capacity ``max_blocks * block_size``).
        causal: exclude keys after the query (default True, as decoding needs).
        sm_scale: score scale, finite and positive; None means ``1 / sqrt(D)``.
        return_lse: also return the log-sum-exp of the scores (natural log).

    Arrays come from one library: NumPy (float64 reference, results in the input dtype),
    CuPy or torch CUDA (float16/bfloat16, head dims 16, 32, 64, 128; CuPy's current stream,
    torch's current stream), torch CPU (reference). On the GPU nothing synchronises with
    the host and lengths are read on the device, so the torch call captures in a CUDA
    graph; the caller must keep ``0 <= cache_seqlens[b]`` and ``cache_seqlens[b] + M``
    within the capacity (rows outside the cache are not written, and the attended length
    is clamped to it) and ``block_table`` entries valid for every block a sequence uses.

    Returns:
        ``o`` (B, H, M, D) in the input dtype, or ``(o, lse)`` with ``lse`` (B, H, M)
        float32.

    Raises:
        TypeError, ValueError: as :func:`check_kvcache_args`; on NumPy and torch CPU also a
            length beyond the capacity or a used ``block_table`` entry that names no page
            (values are on the host there; checked before anything is written).
    """
    library = validate.library_of(q1, "q1")
    args = (q1, q2, k1_cache, k2_cache, v_cache, dist_threshold, cache_seqlens, k1_new, k2_new,
            v_new, block_table, causal, sm_scale)

    def on_torch(*a):
        from . import kvcache_torch

        return kvcache_torch.attention_with_kvcache(*a)

    return by_library(library, args, q1, return_lse, reference_with_kvcache, on_torch, _cupy_call)


#: allocator of the CuPy path's outputs (``(shape, dtype) -> array``; None: cupy.empty).
#: The GPU tests swap in a NaN-filling one to show that the kernels write every element.
_empty = None


def _cupy_call(q1, q2, k1_cache, k2_cache, v_cache, w, cache_seqlens, k1_new, k2_new, v_new,
               block_table, causal, sm_scale):
    import cupy

    a = check_kvcache_args(q1, q2, k1_cache, k2_cache, v_cache, w, cache_seqlens, k1_new, k2_new,
                           v_new, block_table, causal, sm_scale)
    empty = _empty or cupy.empty
    with cupy.cuda.Device(a.device):
        o = empty((a.B, a.H, a.M, a.D), q1.dtype)
        lse = empty((a.B, a.H, a.M), cupy.float32)
        if a.M == 0 or a.B == 0 or (a.H == 0 and not a.appended):
            return o, lse
        from .adapters import cupy as ad

        run_on_gpu(ad.OPS, a, q1, q2, k1_cache, k2_cache, v_cache, cache_seqlens, k1_new,
                   k2_new, v_new, block_table, o, lse)
    return o, lse


def run_on_gpu(ops, a: KVArgs, q1, q2, k1_cache, k2_cache, v_cache, cache_seqlens, k1_new,
               k2_new, v_new, block_table, o, lse, rotary=None) -> None:
    """Launch a checked KV-cache call ``a`` (M, B > 0) into the outputs ``o``, ``lse`` on the
    library's current stream; ``ops``: the library's
    :class:`~cupy_piecewise.core.ArrayOps` (CuPy or torch). Inputs the kernels cannot read
    in place are copied to fresh buffers (caches never are: checked as kernel-ready);
    lengths and block table get unit stride. ``rotary``: None, or ``(layout, cos, sin,
    groups)`` for a rotary-inside call (:mod:`cupy_piecewise.kvcache_rotary`: k1 and k2 the
    same raw cache, ``layout`` a ``compile.ROTARY_LAYOUTS`` value, float32 tables made
    contiguous here, ``groups`` the two position divisors, 0 for not rotated)."""
    from .launch import kernel_ready

    arrays = {"q1": q1, "q2": q2, "o": o, "k1": k1_cache, "k2": k2_cache, "v": v_cache}
    if a.appended:
        arrays.update(k1n=k1_new, k2n=k2_new, vn=v_new)
    copies = {}  # id of an input -> its copy: one copy when k1n and k2n are one tensor
    for name in ("q1", "q2", "k1n", "k2n", "vn"):  # inputs only: copy what is not ready
        x = arrays.get(name)
        if x is not None and not kernel_ready(ops.shape(x), ops.strides(x), ops.ptr(x), 2):
            if id(x) not in copies:
                copies[id(x)] = ops.copy(x)  # a fresh (aligned) contiguous buffer, always
            arrays[name] = copies[id(x)]
    # the kernels index the lengths and the table's columns with unit stride
    if ops.strides(cache_seqlens)[0] != 1:
        cache_seqlens = ops.copy(cache_seqlens)
    if block_table is not None and ops.strides(block_table)[1] != 1 and block_table.shape[1] > 1:
        block_table = ops.copy(block_table)
    ptrs = {n: int(ops.ptr(x)) for n, x in arrays.items()}
    ptrs.update(seqlens=int(ops.ptr(cache_seqlens)), lse=int(ops.ptr(lse)),
                block_table=int(ops.ptr(block_table)) if block_table is not None else 0)
    bt_stride = int(ops.strides(block_table)[0]) if block_table is not None else 0
    layout, groups = 0, (0, 0)
    if rotary is not None:
        layout, cos, sin, groups = rotary
        for name, table in (("rot_cos", cos), ("rot_sin", sin)):
            half = ops.shape(table)[1]
            if tuple(ops.strides(table)) != (half, 1) or ops.ptr(table) % 16:
                table = ops.copy(table)  # the kernel reads 16-byte pieces of packed rows
            arrays[name] = table  # held until the launch: a freed copy could be reused
            ptrs[name] = int(ops.ptr(table))
    views = {n: tuple(ops.strides(x))[:3] for n, x in arrays.items() if not n.startswith("rot_")}
    plan = launch_plan(a, views, bt_stride, layout, groups)
    ws = ops.scratch(plan.workspace_bytes, a.device) if plan.workspace_bytes else None
    plan.run(ptrs, ops.stream(a.device), int(ops.ptr(ws)) if ws is not None else 0)


def launch_plan(a: KVArgs, strides: dict, bt_stride: int, rotary: int = 0,
                rot_groups: tuple = (0, 0)):
    """The :class:`cupy_piecewise.kvcache_launch.KVPlan` of a checked call ``a`` whose
    arrays have the element ``strides`` (first three axes) given by name; ``rotary`` and
    ``rot_groups`` as :class:`~cupy_piecewise.kvcache_launch.KVShape` takes them."""
    from . import kvcache_launch as kl

    limit = a.capacity + a.M + 1  # |d| <= capacity + M: the same comparisons in 32 bits
    shape = kl.KVShape(
        a.device, a.dtype, a.B, a.H, a.Hkv, a.M, a.D, a.capacity, a.pages,
        a.block_size if a.paged else 0, bt_stride, a.appended, a.causal,
        max(-limit, min(limit, a.w)), a.sm_scale,
        tuple((n, tuple(strides[n])) for n in kl.POINTERS if n in strides), rotary,
        tuple(rot_groups))
    return kl.plan(shape)
