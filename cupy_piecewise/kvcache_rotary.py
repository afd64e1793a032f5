"""Rotary embedding inside KV-cache attention: one cache of raw keys serves both projections.

ReRoPE and SelfExtend give a key two rotary positions: its own for nearby queries, and a
clipped or grouped one for distant queries. :func:`cupy_piecewise.attention_with_kvcache`
takes them as two caches, ``k1_cache`` and ``k2_cache``, and a serving engine must write
both. :func:`attention_with_rotary_kvcache` caches the raw (unrotated) keys once instead,
and rotates each key inside the kernel at the position the query's distance picks. Both
position maps are ``n // group_size``, or no rotation at all:

- ReRoPE: ``k1_group_size=1`` (key ``n`` at position ``n``), ``k2_group_size=None`` (``k2``
  is the raw key); queries ``q1`` rotated at their own positions, ``q2`` at ``w``.
- SelfExtend: ``k1_group_size=1``, ``k2_group_size=G`` (key ``n`` at ``n // G``); ``q1`` at
  the query's position ``i``, ``q2`` at ``i // G + w - w // G``.

The caller rotates the queries (a few rows per step) with :func:`apply_rotary` or their own
code; docs/kvcache.md has both recipes. The cache then holds ``k`` and ``v`` instead of
``k1``, ``k2`` and ``v``: a third less memory, and no cached key is ever rewritten (the
kernel rotates each key as it reads it, every step; the tables are read from L2).

Rotation (``cos``, ``sin`` of shape ``(positions, D // 2)``; row ``p`` for position ``p``):
with ``interleaved=False`` (GPT-NeoX, Llama: ``rotate_half``) the halves ``x[:D/2]`` and
``x[D/2:]`` rotate against each other, ``(x1 cos - x2 sin, x2 cos + x1 sin)``; with
``interleaved=True`` (GPT-J) the pairs ``(x[2i], x[2i+1])``. Hugging Face's ``cos`` of shape
``(positions, D)`` repeats its first half, so ``cos[:, :D // 2]`` is the table here; a
GPT-J style ``(positions, D)`` table repeats each entry twice, so pass ``cos[:, ::2]``.

On the GPU a rotary call runs the kernel a two-cache call of its shape runs (the cp.async
``pw_kvcache``, or on an H200 the TMA decode ``pw90_kvdecode`` for one new token), built
with ``ROT``: each warp rotates the key rows it is about to read in shared memory
(``kv_rotate_rows``, kernels_cu/kvparams.cuh), in float32 (products and sums rounded
separately, no FMA), and rounds the result once to the cache dtype, as a float32 rotation
before caching would. Both kernels pass their GPU tests and compute-sanitizer (H200,
2026-12-05). The rotation costs time: on an H200 (bf16, one token, w = N / 4) a ReRoPE
decode runs at 0.72-0.82x SDPA cuDNN's bandwidth and a SelfExtend one (every key rotated)
at 0.44-0.60x, where the two-cache call runs at 0.98-1.01x
(bench/results/2026-12-05-h200-rotary-decode-speed): the price of a third less KV memory.
"""
from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

from . import kvcache, reference, validate
from .compile import ROTARY_LAYOUTS

__all__ = ["attention_with_rotary_kvcache", "reference_with_rotary_kvcache", "apply_rotary",
           "check_rotary_args", "RotaryArgs"]

#: Table dtypes by path: the kernel reads float32 tables; the reference takes any float.
_GPU_TABLE_DTYPE = "float32"


class RotaryArgs(NamedTuple):
    """A checked call of :func:`attention_with_rotary_kvcache` (metadata only)."""

    kv: kvcache.KVArgs  # as for attention_with_kvcache with k1_cache = k2_cache = k_cache
    layout: str  # "half" or "interleaved"
    groups: tuple  # (k1, k2) position divisors; 0: that projection is not rotated
    positions: int  # rows of the cos and sin tables


# check_kvcache_args names k1/k2 arguments; this call has one key cache and one new key
# tensor, so its messages are rewritten to the names the caller used.
_RENAMES = ((re.compile(r"k1_cache, k2_cache and v_cache"), "k_cache and v_cache"),
            (re.compile(r"k1_new, k2_new and v_new"), "k_new and v_new"),
            (re.compile(r"\bk[12]_cache\b"), "k_cache"), (re.compile(r"\bk[12]_new\b"), "k_new"))


def _renamed(err: Exception) -> Exception:
    text = str(err)
    for pattern, name in _RENAMES:
        text = pattern.sub(name, text)
    return type(err)(text)


def _group(value, name: str) -> int:
    if value is None:
        return 0
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive integer or None (not rotated), got "
                        f"{value!r}")
    if not 1 <= int(value) < (1 << 30):
        raise ValueError(f"{name} must be a positive integer below 2**30 or None, got {value!r}")
    return int(value)


def check_rotary_args(q1, q2, k_cache, v_cache, dist_threshold, cos, sin, cache_seqlens,
                      k_new=None, v_new=None, block_table=None, k1_group_size=1,
                      k2_group_size=None, interleaved=False, causal=True,
                      sm_scale=None) -> RotaryArgs:
    """Check a call of :func:`attention_with_rotary_kvcache` from metadata alone.

    Raises:
        TypeError: what :func:`cupy_piecewise.kvcache.check_kvcache_args` raises (named
            for ``k_cache`` and ``k_new``); ``cos``/``sin`` from another library or not
            floating point (not float32 on the GPU); a group size that is not an integer or
            None; ``interleaved`` not a bool.
        ValueError: what ``check_kvcache_args`` raises; only one of ``k_new``/``v_new``;
            ``cos`` and ``sin`` of different shapes, not ``(positions, D // 2)``, on another
            device, or with fewer rows than the largest position the cache can ask for
            (``(capacity - 1) // group_size``); a group size below 1; an odd head dim.
    """
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        validate.library_of(x, name)  # a TypeError naming it when it is no array
    kshape, vshape = validate._shape(k_cache), validate._shape(v_cache)
    if len(kshape) != 4 or kshape != vshape:
        raise ValueError("k_cache and v_cache must share one 4-d shape, (B, Hkv, N_max, D) or "
                         f"(num_blocks, Hkv, block_size, D), got {kshape} and {vshape}")
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new come together: "
                         f"{'v_new' if v_new is None else 'k_new'} missing")
    try:
        kv = kvcache.check_kvcache_args(q1, q2, k_cache, k_cache, v_cache, dist_threshold,
                                        cache_seqlens, k_new, k_new, v_new, block_table, causal,
                                        sm_scale)
    except (TypeError, ValueError) as err:
        raise _renamed(err) from None
    if not isinstance(interleaved, (bool, np.bool_)):
        raise TypeError(f"interleaved must be a bool, got {interleaved!r}")
    groups = (_group(k1_group_size, "k1_group_size"), _group(k2_group_size, "k2_group_size"))
    for name, table in (("cos", cos), ("sin", sin)):
        lib = validate.library_of(table, name)
        if lib != kv.library:
            raise TypeError(f"{name} is a {lib} array but q1 is a {kv.library} array: pass "
                            "arrays of one library")
        where = validate._device_key(table, lib)
        if where != validate._device_key(q1, lib):
            raise ValueError(f"{name} is on {validate._describe_device(where)}, q1 on "
                             f"{validate._describe_device(validate._device_key(q1, lib))}: "
                             "all arrays must be on one device")
        dtype = validate.dtype_name(table)
        if kv.device is not None and dtype != _GPU_TABLE_DTYPE:
            raise TypeError(f"{name}: the GPU kernel reads float32 tables, got {dtype} (convert "
                            "it once, e.g. cos.float() or cos.astype('float32'))")
        if dtype not in ("float16", "bfloat16", "float32", "float64"):
            raise TypeError(f"{name} must be floating point, got {dtype}")
    if kv.D % 2:
        raise ValueError(f"q1: rotary pairs need an even head dim, got {kv.D}")
    shape, other = validate._shape(cos), validate._shape(sin)
    if shape != other:
        raise ValueError(f"cos and sin must share one shape, got {shape} and {other}")
    if len(shape) != 2 or shape[1] != kv.D // 2:
        raise ValueError(f"cos must have shape (positions, D // 2) = (positions, {kv.D // 2}), got "
                         f"{shape} (Hugging Face's (positions, D) tables: pass cos[:, :D // 2])")
    for name, g in zip(("k1_group_size", "k2_group_size"), groups):
        need = (kv.capacity - 1) // g + 1 if g and kv.capacity else 0
        if shape[0] < need:
            raise ValueError(f"cos has {shape[0]} positions, but a cache of capacity "
                             f"{kv.capacity} with {name}={g} reaches position {need - 1}")
    return RotaryArgs(kv, "interleaved" if interleaved else "half", groups, shape[0])


def apply_rotary(x, cos, sin, positions, interleaved=False):
    """Rotary embedding of NumPy rows, in float64: the rotation the kernel applies to keys,
    for rotating queries (or checking) on the host.

    Args:
        x: (..., n, D) array, D even.
        cos, sin: (positions, D // 2) tables.
        positions: (n,) integer positions, one per row of ``x``.
        interleaved: pairs ``(x[2i], x[2i+1])`` (GPT-J) instead of the halves (GPT-NeoX).

    Returns:
        float64 array of ``x``'s shape.

    Raises:
        ValueError: an odd head dim, tables not of shape (positions, D // 2), or
            ``positions`` not of shape (n,) with every entry in [0, len(cos)).
    """
    x = np.asarray(x, np.float64)
    D = x.shape[-1]
    c = np.asarray(cos, np.float64)
    s = np.asarray(sin, np.float64)
    if D % 2:
        raise ValueError(f"apply_rotary: x's head dim must be even, got {D}")
    if c.ndim != 2 or c.shape[1] != D // 2 or s.shape != c.shape:
        raise ValueError(f"apply_rotary: x of head dim {D} takes (positions, {D // 2}) tables, "
                         f"got cos {c.shape} and sin {s.shape}")
    pos = np.asarray(positions)
    n = x.shape[-2] if x.ndim >= 2 else None
    if pos.shape != (n,) or (pos.size and not np.issubdtype(pos.dtype, np.integer)):
        raise ValueError(f"apply_rotary: positions must be ({n},) integers, one per row of x, "
                         f"got shape {pos.shape} of {pos.dtype}")
    if pos.size and (pos.min() < 0 or pos.max() >= c.shape[0]):
        raise ValueError(f"apply_rotary: positions must lie in [0, {c.shape[0]}) (the tables' "
                         f"rows), got {int(pos.min())} .. {int(pos.max())}")
    pos = pos.astype(np.int64)
    c, s = c[pos], s[pos]
    out = np.empty_like(x)
    if interleaved:
        e, o = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = e * c - o * s
        out[..., 1::2] = o * c + e * s
    else:
        h = D // 2
        x1, x2 = x[..., :h], x[..., h:]
        out[..., :h] = x1 * c - x2 * s
        out[..., h:] = x2 * c + x1 * s
    return out


def _rotated(keys, r: RotaryArgs, cos, sin, which: int):
    """Keys (Hkv, L, D) float64 of projection ``which`` (0: k1, 1: k2)."""
    g = r.groups[which]
    if not g:
        return keys
    return apply_rotary(keys, cos, sin, np.arange(keys.shape[1]) // g,
                        r.layout == "interleaved")


def reference_with_rotary_kvcache(q1, q2, k_cache, v_cache, dist_threshold, cos, sin,
                                  cache_seqlens, k_new=None, v_new=None, block_table=None,
                                  k1_group_size=1, k2_group_size=None, interleaved=False,
                                  causal=True, sm_scale=None):
    """Float64 reference of :func:`attention_with_rotary_kvcache` on NumPy arrays.

    Appends ``k_new``/``v_new`` into the caches in place (cast to their dtype), rotates each
    sequence's raw keys in float64 with :func:`apply_rotary` (k1 at ``n // k1_group_size``,
    k2 at ``n // k2_group_size``, None: not rotated) and attends with
    :func:`cupy_piecewise.reference.forward` at the positions of
    :func:`cupy_piecewise.attention_with_kvcache`.

    Returns:
        ``(o, lse)``: float64 arrays of shapes (B, H, M, D) and (B, H, M).

    Raises:
        TypeError, ValueError: as :func:`check_rotary_args`, and a sequence whose cached length
            plus appended rows exceeds the cache's capacity, a negative length, or a used
            ``block_table`` entry that names no page.
    """
    r = check_rotary_args(q1, q2, k_cache, v_cache, dist_threshold, cos, sin, cache_seqlens,
                          k_new, v_new, block_table, k1_group_size, k2_group_size, interleaved,
                          causal, sm_scale)
    a = r.kv
    seq = kvcache.host_lengths(a, cache_seqlens, block_table)
    extra = a.M if a.appended else 0
    o = np.zeros((a.B, a.H, a.M, a.D))
    lse = np.full((a.B, a.H, a.M), -np.inf)
    for b in range(a.B):
        if a.appended:
            for cache, new in ((k_cache, k_new), (v_cache, v_new)):
                kvcache._append(cache, b, int(seq[b]), new[b], block_table)
        L = int(seq[b]) + extra
        raw = np.asarray(kvcache._rows(k_cache, b, L, block_table), np.float64)
        vals = kvcache._rows(v_cache, b, L, block_table)
        k1, k2 = (_rotated(raw, r, cos, sin, i) for i in (0, 1))
        ob, lb = reference.forward(q1[b:b + 1], k1[None], q2[b:b + 1], k2[None], vals[None], a.w,
                                   a.causal, a.sm_scale, q_offset=L - a.M, k_offset=0)
        o[b], lse[b] = ob[0], lb[0]
    return o, lse


def attention_with_rotary_kvcache(q1, q2, k_cache, v_cache, dist_threshold, *, cos, sin,
                                  cache_seqlens, k_new=None, v_new=None, block_table=None,
                                  k1_group_size=1, k2_group_size=None, interleaved=False,
                                  causal=True, sm_scale=None, return_lse=False):
    """KV-cache attention whose two key projections are rotations of one cache of raw keys.

    The call of :func:`cupy_piecewise.attention_with_kvcache` with
    ``k1_cache[n] = rotate(k_cache[n], n // k1_group_size)`` and
    ``k2_cache[n] = rotate(k_cache[n], n // k2_group_size)`` (None: the raw key), the
    rotation done inside the kernel: sequence ``b`` attends keys ``0 .. L_b - 1``
    (``L_b = cache_seqlens[b] + M`` with new keys, written first in place, else
    ``cache_seqlens[b]``), query ``t`` sits at ``L_b - M + t``, and the score is
    ``sm_scale * q2·k2`` at distance ``d >= dist_threshold``, ``sm_scale * q1·k1`` below it.
    The module docstring gives the ReRoPE and SelfExtend settings; the queries arrive
    rotated.

    Args:
        q1, q2: rotated queries, (B, H, M, D).
        k_cache, v_cache: raw keys and values, one shape: contiguous ``(B, Hkv, N_max, D)``
            (any strides, unit stride along D on the GPU) or paged
            ``(num_blocks, Hkv, block_size, D)``, block size a multiple of 16. Written in
            place when new keys are given.
        dist_threshold: the distance ``w`` (an integer, negative allowed).
        cos, sin: (positions, D // 2) rotation tables, row ``p`` for position ``p``; float32
            on the GPU, any float dtype on the host; at least ``(capacity - 1) // g + 1``
            rows for each group size ``g`` given.
        cache_seqlens: (B,) int32 on the arrays' device: keys already cached per sequence.
        k_new, v_new: (B, Hkv, M, D) raw keys and values to append, both or neither.
        block_table: (B, max_blocks) int32 page of each block (paged caches only).
        k1_group_size, k2_group_size: key ``n`` of that projection is rotated at position
            ``n // group_size``; None leaves it unrotated. Defaults: 1 and None (ReRoPE).
        interleaved: rotate pairs ``(x[2i], x[2i+1])`` (GPT-J) instead of the halves
            (GPT-NeoX, Llama).
        causal, sm_scale, return_lse: as for :func:`cupy_piecewise.attention_with_kvcache`.

    Arrays come from one library: NumPy (float64 reference, results in the input dtype),
    torch CPU (reference, the append done on the tensors), CuPy or torch CUDA
    (bfloat16/float16, head dims 16, 32, 64, 128; the KV-cache kernels of
    :func:`~cupy_piecewise.attention_with_kvcache` built with the rotation). On the GPU
    nothing synchronises with the host, so the torch call captures in a CUDA graph.

    Returns:
        ``o`` (B, H, M, D) in the input dtype, or ``(o, lse)`` with ``lse`` (B, H, M)
        float32.

    Raises:
        TypeError, ValueError: as :func:`check_rotary_args`; on NumPy and torch CPU also a
            length beyond the capacity or a used ``block_table`` entry that names no page
            (checked before anything is written).
    """
    library = validate.library_of(q1, "q1")
    args = (q1, q2, k_cache, v_cache, dist_threshold, cos, sin, cache_seqlens, k_new, v_new,
            block_table, k1_group_size, k2_group_size, interleaved, causal, sm_scale)

    def on_torch(*a):
        from . import kvcache_torch

        return kvcache_torch.attention_with_rotary_kvcache(*a)

    return kvcache.by_library(library, args, q1, return_lse, reference_with_rotary_kvcache,
                              on_torch, _cupy_call)


def _cupy_call(*args):
    import cupy

    r = check_rotary_args(*args)
    a = r.kv
    cos, sin = args[5], args[6]
    empty = kvcache._empty or cupy.empty
    with cupy.cuda.Device(a.device):
        o = empty((a.B, a.H, a.M, a.D), args[0].dtype)
        lse = empty((a.B, a.H, a.M), cupy.float32)
        if a.M == 0 or a.B == 0 or (a.H == 0 and not a.appended):
            return o, lse
        from .adapters import cupy as ad

        run_rotary_on_gpu(ad.OPS, r, args, o, lse, cos, sin)
    return o, lse


def run_rotary_on_gpu(ops, r: RotaryArgs, args, o, lse, cos, sin) -> None:
    """Launch a checked rotary call ``r`` (its arguments ``args`` in
    :func:`check_rotary_args` order) through :func:`cupy_piecewise.kvcache.run_on_gpu`:
    ``k_cache`` as both key caches, ``k_new`` as both new key tensors."""
    q1, q2, k_cache, v_cache, _w, _cos, _sin, seqlens, k_new, v_new, block_table = args[:11]
    kvcache.run_on_gpu(ops, r.kv, q1, q2, k_cache, k_cache, v_cache, seqlens, k_new, k_new,
                       v_new, block_table, o, lse,
                       rotary=(ROTARY_LAYOUTS[r.layout], cos, sin, r.groups))
