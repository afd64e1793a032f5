"""torch entry of :func:`cupy_piecewise.attention_with_kvcache`: the operator
``cupy_piecewise::kvcache`` (CUDA kernels; a fake implementation for ``torch.compile``;
declared as mutating the three caches, which it writes when new keys are given) and the
reference for CPU tensors.

CUDA tensors are read in place from ``data_ptr()`` and element strides; outputs and the
split-KV workspace come from torch's caching allocator on torch's current stream, and
nothing synchronises with the host, so the call captures in a CUDA graph (warm it up once
outside the capture: the first call compiles or loads the kernels).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from . import kvcache, validate

Tensor = torch.Tensor

__all__ = ["attention_with_kvcache", "kvcache_op", "attention_with_rotary_kvcache",
           "rotary_kvcache_op"]


def _cuda(q1, q2, k1_cache, k2_cache, v_cache, w, cache_seqlens, k1_new, k2_new, v_new,
          block_table, causal, sm_scale):
    a = kvcache.check_kvcache_args(q1, q2, k1_cache, k2_cache, v_cache, w, cache_seqlens,
                                   k1_new, k2_new, v_new, block_table, causal, sm_scale)
    o = torch.empty((a.B, a.H, a.M, a.D), dtype=q1.dtype, device=q1.device)
    lse = torch.empty((a.B, a.H, a.M), dtype=torch.float32, device=q1.device)
    if a.M == 0 or a.B == 0 or (a.H == 0 and not a.appended):
        return o, lse
    from .adapters import torch as ad

    kvcache.run_on_gpu(ad.OPS, a, q1, q2, k1_cache, k2_cache, v_cache, cache_seqlens, k1_new,
                       k2_new, v_new, block_table, o, lse)
    return o, lse


def _append_on_host(a, cache_seqlens, block_table, caches, news):
    """The CPU paths' append: checks the lengths (kvcache.host_lengths), writes ``news`` into
    ``caches`` (CPU tensors, in place) when the call appends, and returns the attended
    lengths (int32 NumPy) and the block table as NumPy (or None)."""
    table = block_table.numpy() if block_table is not None else None
    seq = kvcache.host_lengths(a, cache_seqlens.numpy(), table)
    if a.appended:
        with torch.no_grad():
            for cache, new in zip(caches, news):
                for b in range(a.B):
                    kvcache._append(cache, b, int(seq[b]), new[b], table)
    return (seq + (a.M if a.appended else 0)).astype(np.int32), table


def _f64(x):
    return None if x is None else x.detach().to("cpu", torch.float64).numpy()


def _cpu(q1, q2, k1_cache, k2_cache, v_cache, w, cache_seqlens, k1_new, k2_new, v_new,
         block_table, causal, sm_scale):
    """The reference on CPU tensors: the append is done on the caches themselves (so it
    is in place for the caller), then the attention in float64."""
    a = kvcache.check_kvcache_args(q1, q2, k1_cache, k2_cache, v_cache, w, cache_seqlens,
                                   k1_new, k2_new, v_new, block_table, causal, sm_scale)
    lengths, table = _append_on_host(a, cache_seqlens, block_table, (k1_cache, k2_cache, v_cache),
                                     (k1_new, k2_new, v_new))
    o, lse = kvcache.reference_with_kvcache(
        _f64(q1), _f64(q2), _f64(k1_cache), _f64(k2_cache), _f64(v_cache), a.w, lengths,
        block_table=table, causal=a.causal, sm_scale=a.sm_scale)
    return (torch.from_numpy(o).to(q1.dtype),
            torch.from_numpy(lse.astype(np.float32)))


@torch.library.custom_op("cupy_piecewise::kvcache", mutates_args=("k1_cache", "k2_cache", "v_cache"))
def kvcache_op(
    q1: Tensor, q2: Tensor, k1_cache: Tensor, k2_cache: Tensor, v_cache: Tensor, w: int,
    cache_seqlens: Tensor, k1_new: Optional[Tensor], k2_new: Optional[Tensor],
    v_new: Optional[Tensor], block_table: Optional[Tensor], causal: bool, sm_scale: float,
) -> tuple[Tensor, Tensor]:
    """KV-cache attention -> (o (B, H, M, D), lse (B, H, M) float32); see
    :func:`cupy_piecewise.attention_with_kvcache`. Writes the new keys into the caches."""
    run = _cuda if q1.is_cuda else _cpu
    return run(q1, q2, k1_cache, k2_cache, v_cache, w, cache_seqlens, k1_new, k2_new, v_new,
               block_table, causal, sm_scale)


@kvcache_op.register_fake
def _fake(q1, q2, k1_cache, k2_cache, v_cache, w, cache_seqlens, k1_new, k2_new, v_new,
          block_table, causal, sm_scale):
    B, H, M, D = q1.shape
    return q1.new_empty((B, H, M, D)), q1.new_empty((B, H, M), dtype=torch.float32)


def attention_with_kvcache(q1, q2, k1_cache, k2_cache, v_cache, w, cache_seqlens, k1_new,
                           k2_new, v_new, block_table, causal, sm_scale):
    """(o, lse) for torch tensors through ``cupy_piecewise::kvcache``. The operator's body
    checks every argument, once per call (also when torch.compile traced this call); here
    only what the schema takes is resolved first, each scalar checked so that errors name
    it: ``dist_threshold`` clamped to the cache (|d| <= capacity + M: the same comparisons,
    and an int64 for any integer) and ``sm_scale`` from None."""
    tensors = (q1, q2, k1_cache, k2_cache, v_cache, cache_seqlens) + tuple(
        x for x in (k1_new, k2_new, v_new, block_table) if x is not None)
    if not all(isinstance(x, Tensor) for x in tensors) or k1_cache.dim() != 4 or (
            block_table is not None and block_table.dim() != 2) or q1.dim() != 4:
        kvcache.check_kvcache_args(q1, q2, k1_cache, k2_cache, v_cache, w, cache_seqlens,
                                   k1_new, k2_new, v_new, block_table, causal, sm_scale)
    w = validate._check_w(w)
    causal = validate._check_causal(causal)
    scale = validate._check_sm_scale(sm_scale, q1.shape[-1])
    capacity = k1_cache.shape[2] * (1 if block_table is None else block_table.shape[1])
    limit = capacity + q1.shape[2] + 1
    return kvcache_op(q1, q2, k1_cache, k2_cache, v_cache, max(-limit, min(limit, w)),
                      cache_seqlens, k1_new, k2_new, v_new, block_table, causal, scale)


# ---------------------------------------------------------------------------------------
# Rotary inside (cupy_piecewise.kvcache_rotary): one cache of raw keys, rotated per key.

def _rotary_args(q1, q2, k_cache, v_cache, w, cos, sin, cache_seqlens, k_new, v_new,
                 block_table, g1, g2, interleaved, causal, sm_scale):
    """kvcache_rotary.check_rotary_args of an operator call (group sizes 0: not rotated)."""
    from . import kvcache_rotary

    return kvcache_rotary.check_rotary_args(q1, q2, k_cache, v_cache, w, cos, sin,
                                            cache_seqlens, k_new, v_new, block_table,
                                            g1 or None, g2 or None, interleaved, causal,
                                            sm_scale)


def _rotary_cuda(*args):
    from . import kvcache_rotary

    r = _rotary_args(*args)
    a = r.kv
    q1 = args[0]
    o = torch.empty((a.B, a.H, a.M, a.D), dtype=q1.dtype, device=q1.device)
    lse = torch.empty((a.B, a.H, a.M), dtype=torch.float32, device=q1.device)
    if a.M == 0 or a.B == 0 or (a.H == 0 and not a.appended):
        return o, lse
    from .adapters import torch as ad

    kvcache_rotary.run_rotary_on_gpu(ad.OPS, r, args, o, lse, args[5], args[6])
    return o, lse


def _rotary_cpu(q1, q2, k_cache, v_cache, w, cos, sin, cache_seqlens, k_new, v_new,
                block_table, g1, g2, interleaved, causal, sm_scale):
    """The reference on CPU tensors: the append on the caches themselves, then float64."""
    from . import kvcache_rotary

    r = _rotary_args(q1, q2, k_cache, v_cache, w, cos, sin, cache_seqlens, k_new, v_new,
                     block_table, g1, g2, interleaved, causal, sm_scale)
    a = r.kv
    lengths, table = _append_on_host(a, cache_seqlens, block_table, (k_cache, v_cache),
                                     (k_new, v_new))
    o, lse = kvcache_rotary.reference_with_rotary_kvcache(
        _f64(q1), _f64(q2), _f64(k_cache), _f64(v_cache), a.w, _f64(cos), _f64(sin), lengths,
        block_table=table, k1_group_size=g1 or None, k2_group_size=g2 or None,
        interleaved=interleaved, causal=a.causal, sm_scale=a.sm_scale)
    return (torch.from_numpy(o).to(q1.dtype),
            torch.from_numpy(lse.astype(np.float32)))


@torch.library.custom_op("cupy_piecewise::rotary_kvcache", mutates_args=("k_cache", "v_cache"))
def rotary_kvcache_op(
    q1: Tensor, q2: Tensor, k_cache: Tensor, v_cache: Tensor, w: int, cos: Tensor, sin: Tensor,
    cache_seqlens: Tensor, k_new: Optional[Tensor], v_new: Optional[Tensor],
    block_table: Optional[Tensor], g1: int, g2: int, interleaved: bool, causal: bool,
    sm_scale: float,
) -> tuple[Tensor, Tensor]:
    """Rotary-inside KV-cache attention -> (o (B, H, M, D), lse (B, H, M) float32); see
    :func:`cupy_piecewise.attention_with_rotary_kvcache` (``g1``, ``g2``: the group sizes,
    0 for not rotated). Writes the new keys and values into the caches."""
    run = _rotary_cuda if q1.is_cuda else _rotary_cpu
    return run(q1, q2, k_cache, v_cache, w, cos, sin, cache_seqlens, k_new, v_new, block_table,
               g1, g2, interleaved, causal, sm_scale)


@rotary_kvcache_op.register_fake
def _rotary_fake(q1, q2, k_cache, v_cache, w, cos, sin, cache_seqlens, k_new, v_new,
                 block_table, g1, g2, interleaved, causal, sm_scale):
    B, H, M, D = q1.shape
    return q1.new_empty((B, H, M, D)), q1.new_empty((B, H, M), dtype=torch.float32)


def attention_with_rotary_kvcache(q1, q2, k_cache, v_cache, w, cos, sin, cache_seqlens, k_new,
                                  v_new, block_table, k1_group_size, k2_group_size, interleaved,
                                  causal, sm_scale):
    """(o, lse) for torch tensors through ``cupy_piecewise::rotary_kvcache``. The operator's
    body checks every argument; here the schema's scalars are resolved first, each checked
    so that errors name it (as :func:`attention_with_kvcache` does)."""
    from . import kvcache_rotary

    tensors = (q1, q2, k_cache, v_cache, cos, sin, cache_seqlens) + tuple(
        x for x in (k_new, v_new, block_table) if x is not None)
    if not all(isinstance(x, Tensor) for x in tensors) or k_cache.dim() != 4 or (
            block_table is not None and block_table.dim() != 2) or q1.dim() != 4:
        kvcache_rotary.check_rotary_args(q1, q2, k_cache, v_cache, w, cos, sin, cache_seqlens,
                                         k_new, v_new, block_table, k1_group_size,
                                         k2_group_size, interleaved, causal, sm_scale)
    w = validate._check_w(w)
    causal = validate._check_causal(causal)
    scale = validate._check_sm_scale(sm_scale, q1.shape[-1])
    g1 = kvcache_rotary._group(k1_group_size, "k1_group_size")
    g2 = kvcache_rotary._group(k2_group_size, "k2_group_size")
    if not isinstance(interleaved, (bool, np.bool_)):
        raise TypeError(f"interleaved must be a bool, got {interleaved!r}")
    interleaved = bool(interleaved)
    capacity = k_cache.shape[2] * (1 if block_table is None else block_table.shape[1])
    limit = capacity + q1.shape[2] + 1
    return rotary_kvcache_op(q1, q2, k_cache, v_cache, max(-limit, min(limit, w)), cos, sin,
                             cache_seqlens, k_new, v_new, block_table, g1, g2, interleaved,
                             causal, scale)
