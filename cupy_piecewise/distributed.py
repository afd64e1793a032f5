"""Context parallelism over ``torch.distributed``: piecewise attention of a sequence whose
queries, keys and values are sharded along the length axis across the ranks of a group.

Each rank passes its shard ``(B, H, L_local, D)`` of q1, q2 and ``(B, Hkv, L_local, D)`` of
k1, k2, v; the result is the rank's shard of ``o``, differentiable (torch autograd). The
sequence is self-attention over ``L = W * L_local`` positions (``W`` ranks): query and key
``t`` both sit at position ``t``, so ``d = t_q - t_k`` and causal keeps ``t_k <= t_q``.
Every block of work calls the single-device :func:`cupy_piecewise.attention` with
position offsets (``q_offset``, ``k_offset``) that place it in the whole sequence, which
is what lets the ``d = w`` boundary cross shard boundaries; inside a block the kernels
skip empty tiles and use one product on tiles wholly on one side of ``d = w``.

Layouts (how positions map to ranks, :func:`shard` / :func:`unshard`):

- ``"contiguous"``: rank ``r`` holds positions ``[r * L_local, (r + 1) * L_local)``;
- ``"zigzag"``: the sequence is cut into ``2W`` equal chunks and rank ``r`` holds chunks
  ``r`` and ``2W - 1 - r`` (in that order), which balances causal work across ranks.

Methods:

- ``"allgather"``: every rank gathers K1, K2, V of the whole sequence, attends its queries
  to the keys they can see (causal: up to the end of each query chunk), and the key-side
  gradients are summed back to their owners (reduce-scatter on NCCL, all-reduce on gloo).
- ``"ring"``: K1, K2, V blocks travel around the ring by point-to-point messages, the next
  block's transfer overlapping the current block's kernels; partial results merge by their
  log-sum-exp. The backward passes the blocks around again with their dK/dV accumulators,
  which arrive back at their owners complete; peak memory holds two blocks, not the whole
  sequence.

Runs on NCCL with CUDA tensors (the CUDA kernels) and on gloo with CPU tensors (the torch
CPU implementation), so the CPU tests run it with several processes.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from . import validate

__all__ = ["attention", "shard", "unshard", "LAYOUTS", "METHODS"]

LAYOUTS = ("contiguous", "zigzag")
METHODS = ("allgather", "ring")


class Chunk(NamedTuple):
    """A run of positions held by one rank: ``length`` positions from ``start`` (global),
    stored from ``local`` in the rank's shard."""

    start: int
    length: int
    local: int


def chunks(rank: int, world: int, local_len: int, layout: str) -> list:
    """The chunks of global positions rank ``rank`` holds, in the order of its shard.

    Raises ValueError for an unknown layout or (zigzag) an odd ``local_len``."""
    if layout == "contiguous":
        return [Chunk(rank * local_len, local_len, 0)]
    if layout == "zigzag":
        if local_len % 2:
            raise ValueError(f"layout='zigzag' needs an even local length (two chunks per rank), "
                             f"got {local_len}")
        c = local_len // 2
        return [Chunk(rank * c, c, 0), Chunk((2 * world - 1 - rank) * c, c, c)]
    raise ValueError(f"layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")


def _world(group):
    return dist.get_world_size(group), dist.get_rank(group)


def shard(x: torch.Tensor, group=None, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """This rank's shard of the full tensor ``x`` (the same on every rank) along ``dim``.

    ``x.shape[dim]`` must be a multiple of the group size (of twice it for zigzag). Returns
    a new contiguous tensor. Raises ValueError otherwise or for an unknown layout."""
    world, rank = _world(group)
    L = x.shape[dim]
    if L % world:
        raise ValueError(f"x: length {L} along dim {dim} is not a multiple of the group size {world}")
    parts = [x.narrow(dim, c.start, c.length) for c in chunks(rank, world, L // world, layout)]
    return torch.cat(parts, dim=dim).contiguous()


def unshard(x: torch.Tensor, group=None, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """The full tensor from every rank's shard ``x`` along ``dim`` (a collective: every rank
    calls it and gets the whole tensor). Not differentiable."""
    world, _ = _world(group)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    L = x.shape[dim] * world
    shape = list(x.shape)
    shape[dim] = L
    out = x.new_empty(shape)
    for r, part in enumerate(parts):
        for c in chunks(r, world, x.shape[dim], layout):
            out.narrow(dim, c.start, c.length).copy_(part.narrow(dim, c.local, c.length))
    return out


# --------------------------------------------------------------------------- blocks


def _sees(qc: Chunk, kc: Chunk, causal: bool) -> bool:
    """False when causal masking empties the block (every key after every query)."""
    return not causal or kc.start <= qc.start + qc.length - 1


def _rows(x, c: Chunk):
    return x.narrow(2, c.local, c.length)


def _block_fwd(q1, q2, k1, k2, v, qc, kc, w, causal, sm_scale):
    from . import api

    return api.attention(_rows(q1, qc), _rows(k1, kc), _rows(q2, qc), _rows(k2, kc),
                         _rows(v, kc), w, causal=causal, sm_scale=sm_scale, return_lse=True,
                         q_offset=qc.start, k_offset=kc.start)


def _block_bwd(do, q1, q2, k1, k2, v, o, lse, qc, kc, w, causal, sm_scale):
    from . import api

    return api.attention_backward(_rows(do, qc), _rows(q1, qc), _rows(k1, kc), _rows(q2, qc),
                                  _rows(k2, kc), _rows(v, kc), _rows(o, qc),
                                  lse.narrow(2, qc.local, qc.length), w, causal=causal,
                                  sm_scale=sm_scale, q_offset=qc.start, k_offset=kc.start)


class _Merge:
    """Running merge of partial attentions of the same query rows by their lse (float32,
    float64 for float64 inputs)."""

    def __init__(self, q, dtype):
        B, H, L, D = q.shape
        self.o = torch.zeros(B, H, L, D, dtype=dtype, device=q.device)
        self.lse = torch.full((B, H, L), -math.inf, dtype=dtype, device=q.device)

    def add(self, qc: Chunk, o, lse):
        O = self.o.narrow(2, qc.local, qc.length)
        LSE = self.lse.narrow(2, qc.local, qc.length)
        lse = lse.to(LSE.dtype)
        new = torch.logaddexp(LSE, lse)
        safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # rows still empty
        a = torch.exp(LSE - safe).unsqueeze(-1)
        b = torch.exp(lse - safe).unsqueeze(-1)
        O.copy_(a * O + b * o.to(O.dtype))
        LSE.copy_(new)


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------- allgather


def _scatter_sum(full, group, world, rank, layout, nccl):
    """Sum ``full`` (B, heads, L, D) over the ranks and return this rank's shard of the sum
    (reduce-scatter on NCCL; all-reduce and a slice on gloo, which has no reduce-scatter)."""
    local_len = full.shape[2] // world

    def part(x, r):
        return torch.cat([x.narrow(2, c.start, c.length) for c in chunks(r, world, local_len, layout)],
                         dim=2).contiguous()

    if nccl:
        out = torch.empty_like(part(full, rank))
        dist.reduce_scatter(out, [part(full, r) for r in range(world)], group=group)
        return out
    dist.all_reduce(full, group=group)
    return part(full, rank)


def _allgather_fwd(q1, k1, q2, k2, v, w, causal, sm_scale, group, layout):
    world, rank = _world(group)
    K1, K2, V = (unshard(t, group, layout, dim=2) for t in (k1, k2, v))
    merge = _Merge(q1, _acc_dtype(q1.dtype))
    for qc in chunks(rank, world, q1.shape[2], layout):
        end = qc.start + qc.length if causal else K1.shape[2]  # keys this chunk can see
        full = Chunk(0, end, 0)
        o, lse = _block_fwd(q1, q2, K1, K2, V, qc, full, w, causal, sm_scale)
        merge.add(qc, o, lse)
    lse_dtype = torch.float64 if q1.dtype == torch.float64 else torch.float32
    return merge.o.to(q1.dtype), merge.lse.to(lse_dtype), (K1, K2, V)


def _allgather_bwd(do, q1, k1, q2, k2, v, o, lse, w, causal, sm_scale, group, layout, gathered):
    world, rank = _world(group)
    K1, K2, V = gathered
    acc = _acc_dtype(q1.dtype)
    dq1 = torch.zeros(q1.shape, dtype=acc, device=q1.device)
    dq2 = torch.zeros_like(dq1)
    dK1 = torch.zeros(K1.shape, dtype=acc, device=q1.device)
    dK2, dV = torch.zeros_like(dK1), torch.zeros_like(dK1)
    for qc in chunks(rank, world, q1.shape[2], layout):
        end = qc.start + qc.length if causal else K1.shape[2]
        g = _block_bwd(do, q1, q2, K1, K2, V, o, lse, qc, Chunk(0, end, 0), w, causal, sm_scale)
        _rows(dq1, qc).add_(g[0].to(acc))
        _rows(dq2, qc).add_(g[2].to(acc))
        for d, x in zip((dK1, dK2, dV), (g[1], g[3], g[4])):
            d.narrow(2, 0, end).add_(x.to(acc))
    nccl = dist.get_backend(group) == "nccl"
    dk1, dk2, dv = (_scatter_sum(d, group, world, rank, layout, nccl) for d in (dK1, dK2, dV))
    return dq1, dk1, dq2, dk2, dv


# --------------------------------------------------------------------------- ring


def _exchange(tensors, group, world, rank, reverse=False):
    """Start sending ``tensors`` to the next rank (previous with ``reverse``) and receiving
    the same shapes from the other side; returns (requests, received buffers)."""
    dst = (rank - 1) % world if reverse else (rank + 1) % world
    src = (rank + 1) % world if reverse else (rank - 1) % world
    recv = [torch.empty_like(t) for t in tensors]
    g_dst = dist.get_global_rank(group, dst) if group is not None else dst
    g_src = dist.get_global_rank(group, src) if group is not None else src
    ops = [dist.P2POp(dist.isend, t, g_dst, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, g_src, group) for t in recv]
    return dist.batch_isend_irecv(ops), recv


def _ring_fwd(q1, k1, q2, k2, v, w, causal, sm_scale, group, layout):
    world, rank = _world(group)
    L_local = q1.shape[2]
    qcs = chunks(rank, world, L_local, layout)
    merge = _Merge(q1, _acc_dtype(q1.dtype))
    blk = [k1.contiguous(), k2.contiguous(), v.contiguous()]
    for step in range(world):
        owner = (rank - step) % world
        reqs = None
        if step < world - 1:  # the next block travels while this one computes
            reqs, nxt = _exchange(blk, group, world, rank)
        for kc in chunks(owner, world, L_local, layout):
            for qc in qcs:
                if _sees(qc, kc, causal):
                    o, lse = _block_fwd(q1, q2, *blk, qc, kc, w, causal, sm_scale)
                    merge.add(qc, o, lse)
        if reqs is not None:
            for r in reqs:
                r.wait()
            blk = nxt
    lse_dtype = torch.float64 if q1.dtype == torch.float64 else torch.float32
    return merge.o.to(q1.dtype), merge.lse.to(lse_dtype)


def _ring_bwd(do, q1, k1, q2, k2, v, o, lse, w, causal, sm_scale, group, layout):
    world, rank = _world(group)
    L_local = q1.shape[2]
    qcs = chunks(rank, world, L_local, layout)
    acc = _acc_dtype(q1.dtype)
    dq1 = torch.zeros(q1.shape, dtype=acc, device=q1.device)
    dq2 = torch.zeros_like(dq1)
    blk = [k1.contiguous(), k2.contiguous(), v.contiguous()]
    dblk = [torch.zeros(k1.shape, dtype=acc, device=k1.device) for _ in range(3)]
    for step in range(world):
        owner = (rank - step) % world
        reqs = None
        if step < world - 1:  # K/V for the next step; their accumulators follow below
            reqs, nxt = _exchange(blk, group, world, rank)
        for kc in chunks(owner, world, L_local, layout):
            for qc in qcs:
                if _sees(qc, kc, causal):
                    g = _block_bwd(do, q1, q2, *blk, o, lse, qc, kc, w, causal, sm_scale)
                    _rows(dq1, qc).add_(g[0].to(acc))
                    _rows(dq2, qc).add_(g[2].to(acc))
                    for d, x in zip(dblk, (g[1], g[3], g[4])):
                        _rows(d, kc).add_(x.to(acc))
        # the accumulators of this block move on with it (after W moves they are home)
        dreqs, dnxt = _exchange(dblk, group, world, rank)
        for r in dreqs:
            r.wait()
        dblk = dnxt
        if reqs is not None:
            for r in reqs:
                r.wait()
            blk = nxt
    return dq1, dblk[0], dq2, dblk[1], dblk[2]


# --------------------------------------------------------------------------- autograd


class _ContextParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q1, k1, q2, k2, v, w, causal, sm_scale, group, layout, method):
        if method == "allgather":
            o, lse, gathered = _allgather_fwd(q1, k1, q2, k2, v, w, causal, sm_scale, group, layout)
            ctx.gathered = gathered  # K/V of the whole sequence (this method's memory)
        else:
            o, lse = _ring_fwd(q1, k1, q2, k2, v, w, causal, sm_scale, group, layout)
        ctx.save_for_backward(q1, k1, q2, k2, v, o, lse)
        ctx.args = (w, causal, sm_scale, group, layout, method)
        return o

    @staticmethod
    def backward(ctx, do):
        q1, k1, q2, k2, v, o, lse = ctx.saved_tensors
        w, causal, sm_scale, group, layout, method = ctx.args
        do = do.contiguous()
        if method == "allgather":
            grads = _allgather_bwd(do, q1, k1, q2, k2, v, o, lse, w, causal, sm_scale, group,
                                   layout, ctx.gathered)
            del ctx.gathered
        else:
            grads = _ring_bwd(do, q1, k1, q2, k2, v, o, lse, w, causal, sm_scale, group, layout)
        grads = [g.to(x.dtype) for g, x in zip(grads, (q1, k1, q2, k2, v))]
        return (*grads, None, None, None, None, None, None)


def attention(q1, k1, q2, k2, v, dist_threshold, *, group=None, causal=False,
              sm_scale: Optional[float] = None, layout: str = "zigzag",
              method: str = "ring"):
    """Piecewise attention of a sequence sharded across the ranks of ``group``.

    Args:
        q1, q2: this rank's shard ``(B, H, L_local, D)`` of the queries (torch tensors, on
            this rank's CUDA device with NCCL, on the CPU with gloo).
        k1, k2, v: this rank's shard ``(B, Hkv, L_local, D)`` of keys and values; every
            rank holds the same ``L_local``; the sequence has ``L = W * L_local`` positions.
        dist_threshold: ``w`` as in :func:`cupy_piecewise.attention`, on global positions.
        group: the process group (default: the world).
        causal, sm_scale: as in :func:`cupy_piecewise.attention`.
        layout: ``"zigzag"`` (default) or ``"contiguous"`` (see the module doc and
            :func:`shard`).
        method: ``"ring"`` (default) or ``"allgather"``. On two H200s (B = 1, H = 16,
            D = 128, bf16, causal) both ran forward+backward 1.3x faster than one GPU at
            L = 32k and 1.8x at 128k, and ring used half of allgather's memory
            (bench/results/2026-11-30-h200-context-parallel).

    Returns the rank's shard of ``o`` ``(B, H, L_local, D)`` in the input dtype, with
    autograd. Every rank of the group must call it with the same arguments (collective).

    Raises:
        TypeError, ValueError: as :func:`cupy_piecewise.attention` for the shards, and for an
            unknown layout or method, an uninitialised process group, or an odd ``L_local``
            with zigzag.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("torch.distributed is not initialised (dist.init_process_group first)")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")
    if method not in METHODS:
        raise ValueError(f"method: expected one of {', '.join(METHODS)}, got {method!r}")
    p = validate.check_inputs(q1, k1, q2, k2, v, dist_threshold, causal, sm_scale)
    if p.library != "torch":
        raise TypeError(f"q1: cupy_piecewise.distributed takes torch tensors, got {p.library} arrays")
    if p.M != p.N:
        raise ValueError(f"q1 and k1 must hold the same local length (self-attention shards), got "
                         f"{p.M} and {p.N}")
    world, rank = _world(group)
    chunks(rank, world, p.M, layout)  # zigzag: even local length
    return _ContextParallel.apply(q1, k1, q2, k2, v, p.w, p.causal, p.sm_scale, group, layout,
                                  method)
