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
- ``"ring"``: each rank's keys are cut into packets of ``ring_piece`` keys
  (:data:`FWD_PIECES` times that in the forward) that travel around the ring by
  point-to-point messages, each packet's transfer overlapping the kernels of the one before
  (:class:`_Ring`); partial outputs merge by their log-sum-exp. In the backward a float32
  dK/dV accumulator follows each packet and arrives back at its owner complete, and dQ of
  every packet is added into the Hopper backward's float32 accumulator (one rounding at the
  end) where that path runs. A rank holds only about two packets and their accumulators at
  a time, so the memory in flight does not grow with the sequence.

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
#: The ring's forward packets hold this many backward pieces (``ring_piece``): each packet
#: costs one merge of a query chunk's float32 o (a pass over it), and the forward's memory
#: is not its peak (the backward's float32 dK/dV sums and gradients are), so it sends fewer,
#: larger ones.
FWD_PIECES = 16
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
        O.mul_(a).addcmul_(o, b)  # in place: no chunk-sized float32 temporaries
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


def _pieces(cs, piece: Optional[int]) -> list:
    """``cs`` (a rank's chunks) cut into runs of at most ``piece`` keys: the ring's packets.
    Every rank's list has the same lengths in the same order (same local length and layout),
    which is what lets a packet's receive buffer be sized before it arrives."""
    out = []
    for c in cs:
        step = piece or c.length
        out += [Chunk(c.start + a, min(step, c.length - a), c.local + a)
                for a in range(0, c.length, max(step, 1))]
    return out


def _piece_keys(ring_piece, B, Hkv, dev) -> Optional[int]:
    """Keys per ring packet: ``ring_piece`` when given; on CUDA, as many 128-key tiles as
    make one wave of backward blocks (one block per 128-key tile and kv head and batch
    entry: ``SMs // (B * Hkv)`` tiles, at least 8); on the CPU, whole chunks (None)."""
    if ring_piece is not None:
        return ring_piece
    if dev.type != "cuda":
        return None
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    return 128 * max(8, sms // max(1, B * Hkv))


class _Ring:
    """The ring's schedule and messages on one rank.

    The keys of every rank are cut into the same ``n`` packets (:func:`_pieces`), which
    travel from rank to rank; at every slot each rank computes on one packet while the next
    one arrives, so it holds about two packets, not whole blocks.

    Forward (:meth:`slots`): slot ``t = p * W + k`` processes packet ``p`` of the rank ``k``
    places behind; at ``k = 0`` the rank injects its own packet ``p``, and each packet moves
    one rank on before it is processed (its transfer overlaps the kernels).

    Backward (:func:`_ring_bwd`): the same slots; a float32 dK/dV accumulator follows each
    packet one slot behind the K/V, gathering every rank's contribution, and arrives home
    complete at ``k = W``, i.e. as the owner starts its next packet.
    """

    def __init__(self, group, L_local, layout, piece):
        self.group = group
        self.world, self.rank = _world(group)
        self.pieces = [_pieces(chunks(r, self.world, L_local, layout), piece)
                       for r in range(self.world)]
        self.n = len(self.pieces[self.rank])
        nxt, prv = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        self.next = dist.get_global_rank(group, nxt) if group is not None else nxt
        self.prev = dist.get_global_rank(group, prv) if group is not None else prv

    def slots(self):
        """``(t, p, k, owner, kc)`` per slot: packet ``p`` of ``owner`` (``k`` ranks
        behind), ``kc`` its key positions (``local`` 0: the packet's own rows)."""
        for t in range(self.n * self.world):
            p, k = divmod(t, self.world)
            owner = (self.rank - k) % self.world
            c = self.pieces[owner][p]
            yield t, p, k, owner, Chunk(c.start, c.length, 0)

    def own(self, tensors, p):
        """This rank's packet ``p`` of ``tensors`` (views)."""
        c = self.pieces[self.rank][p]
        return [x.narrow(2, c.local, c.length) for x in tensors]

    def start(self, sends, recvs):
        """Post ``sends`` to the next rank and ``recvs`` (buffers) from the previous one,
        as one batch; returns the requests. Every rank posts the same pattern in the same
        order, so the messages between each pair match."""
        ops = [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in recvs]
        ops += [dist.P2POp(dist.isend, t, self.next, self.group) for t in sends]
        return dist.batch_isend_irecv(ops) if ops else []


def _wait(reqs):
    for r in reqs:
        r.wait()


def _ring_fwd(q1, k1, q2, k2, v, w, causal, sm_scale, group, layout, piece):
    ring = _Ring(group, q1.shape[2], layout, piece)
    qcs = chunks(ring.rank, ring.world, q1.shape[2], layout)
    merge = _Merge(q1, _acc_dtype(q1.dtype))
    blk = None
    for t, p, k, owner, kc in ring.slots():
        if k == 0:
            blk = ring.own((k1, k2, v), p)
        reqs, nxt = [], None
        if k < ring.world - 1:  # the packet moves on while it is computed on here
            send = [x.contiguous() for x in blk]
            nxt = [torch.empty_like(x) for x in send]
            reqs = ring.start(send, nxt)
        for qc in qcs:
            if _sees(qc, kc, causal):
                o, lse = _block_fwd(q1, q2, *blk, qc, kc, w, causal, sm_scale)
                merge.add(qc, o, lse)
        _wait(reqs)
        blk = nxt
    lse_dtype = torch.float64 if q1.dtype == torch.float64 else torch.float32
    return merge.o.to(q1.dtype), merge.lse.to(lse_dtype)


class _DqSums:
    """dq1, dq2 of this rank's query chunks, summed over key blocks. When the CUDA backward
    has a float32 dQ accumulator (the Hopper kernels) every block adds into it and the sum
    is rounded once, and the blocks of a query chunk share its statistics
    (:class:`cupy_piecewise.core.SharedRows`); otherwise each block's dq (input dtype) is
    summed in float32."""

    def __init__(self, q1):
        self.q1 = q1
        self.shared = {}  # query chunk -> core.SharedRows
        self.sums = None  # float32 (float64) sums of the rounded per-block dq1, dq2

    def block(self, do, q1, q2, k1, k2, v, o, lse, qc, kc, w, causal, sm_scale):
        """Backward of one (query chunk, key block): adds dq here, returns (dk1, dk2, dv)."""
        args = (_rows(q1, qc), k1.narrow(2, kc.local, kc.length), _rows(q2, qc),
                k2.narrow(2, kc.local, kc.length), v.narrow(2, kc.local, kc.length))
        if q1.is_cuda and not torch.are_deterministic_algorithms_enabled():
            from . import core, torch_ops
            from .adapters import torch as adapter

            call = torch_ops._call(args[0], args[1], args[2], args[3], args[4], w, causal,
                                   sm_scale, qc.start, kc.start)
            d, oo, ll = _rows(do, qc), _rows(o, qc), lse.narrow(2, qc.local, qc.length)
            shared = self.shared.get(qc)
            if shared is None:
                shared = core.shared_rows(call, adapter.OPS, d, *args, oo)
                if shared is not None:
                    self.shared[qc] = shared
            if shared is not None:
                g = core.run_backward(call, adapter.OPS, d, *args, oo, ll, shared=shared)
                return g[1], g[3], g[4]
        g = _block_bwd(do, q1, q2, k1, k2, v, o, lse, qc, kc, w, causal, sm_scale)
        if self.sums is None:
            acc = _acc_dtype(q1.dtype)
            self.sums = [torch.zeros(self.q1.shape, dtype=acc, device=q1.device) for _ in range(2)]
        _rows(self.sums[0], qc).add_(g[0])
        _rows(self.sums[1], qc).add_(g[2])
        return g[1], g[3], g[4]

    def result(self):
        """(dq1, dq2) of the rank's queries, in the input dtype."""
        from . import core
        from .adapters import torch as adapter

        dq = [torch.empty_like(self.q1) for _ in range(2)] if self.shared else None
        for qc, shared in self.shared.items():
            core.finish_dq(shared, adapter.OPS, out=(_rows(dq[0], qc), _rows(dq[1], qc)))
        if self.sums is None:
            if dq is None:  # no block had work
                return torch.zeros_like(self.q1), torch.zeros_like(self.q1)
            return dq[0], dq[1]
        if dq is not None:  # both kinds of blocks (inputs of unusual strides): add
            for s, x in zip(self.sums, dq):
                s.add_(x)
        return self.sums[0].to(self.q1.dtype), self.sums[1].to(self.q1.dtype)


def _ring_bwd(do, q1, k1, q2, k2, v, o, lse, w, causal, sm_scale, group, layout, piece):
    ring = _Ring(group, q1.shape[2], layout, piece)
    W, n = ring.world, ring.n
    qcs = chunks(ring.rank, W, q1.shape[2], layout)
    acc = _acc_dtype(q1.dtype)
    dq = _DqSums(q1)
    grads = [torch.empty_like(x) for x in (k1, k2, v)]  # dk1, dk2, dv, filled packet by packet

    def sums_for(t):
        """An empty float32 dK/dV accumulator for what arrives for slot t: packet p of the
        rank k behind (k > 0), or (k = 0) this rank's own packet p - 1, complete."""
        p, k = divmod(t, W)
        c = ring.pieces[ring.rank][p - 1] if k == 0 else ring.pieces[(ring.rank - k) % W][p]
        return [torch.empty(x.shape[:2] + (c.length, x.shape[3]), dtype=acc, device=x.device)
                for x in (k1, k2, v)]

    def home(p, d):  # this rank's packet p: its dK/dV, complete
        for g, x in zip(ring.own(grads, p), d):
            g.copy_(x)

    # The accumulators move in batches of (send this slot's to the next rank, receive the
    # next slot's from the previous one) posted at the end of each slot. Pairing the send
    # with the receive in one batch matters: with two ranks both directions share one NCCL
    # stream, and a lone send queued before the matching receive would deadlock.
    blk, arrived, acc_reqs, sending = None, None, [], None
    for t, p, k, owner, kc in ring.slots():
        if k == 0:
            blk = ring.own((k1, k2, v), p)
        nxt, kv_reqs = None, []
        if k < W - 1:  # K/V move on while the kernels run
            send = [x.contiguous() for x in blk]
            nxt = [torch.empty_like(x) for x in send]
            kv_reqs = ring.start(send, nxt)
        out = None if k == 0 else arrived

        def landed():  # the last batch is done: what it brought is usable, what it took, free
            nonlocal acc_reqs, arrived, sending
            _wait(acc_reqs)
            acc_reqs, sending = [], None
            if k == 0 and arrived is not None:
                home(p - 1, arrived)
                arrived = None

        for qc in qcs:
            if _sees(qc, kc, causal):
                g = dq.block(do, q1, q2, *blk, o, lse, qc, kc, w, causal, sm_scale)
                landed()  # after the first kernel is queued: the transfer overlapped it
                if out is None:
                    out = [x.to(acc) for x in g]
                else:
                    for a, x in zip(out, g):
                        a.add_(x)
        landed()
        _wait(kv_reqs)
        if out is None:  # no query of this rank sees the packet
            out = [torch.zeros(x.shape, dtype=acc, device=x.device) for x in blk]
        if W == 1:
            home(p, out)
        else:  # on to the next rank (at k = W - 1: home to its owner)
            arrived = sums_for(t + 1)
            acc_reqs, sending = ring.start(out, arrived), out
        del out
        blk = nxt
    if W > 1 and n:
        _wait(acc_reqs)
        home(n - 1, arrived)
    dq1, dq2 = dq.result()
    return dq1, grads[0], dq2, grads[1], grads[2]


# --------------------------------------------------------------------------- autograd


class _ContextParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q1, k1, q2, k2, v, w, causal, sm_scale, group, layout, method, piece):
        if method == "allgather":
            o, lse, gathered = _allgather_fwd(q1, k1, q2, k2, v, w, causal, sm_scale, group, layout)
            ctx.gathered = gathered  # K/V of the whole sequence (this method's memory)
        else:
            # the forward merges each packet's partial o by lse (a pass over the chunk's
            # float32 o), so it moves packets of FWD_PIECES backward pieces: fewer merges
            fwd_piece = None if piece is None else FWD_PIECES * piece
            o, lse = _ring_fwd(q1, k1, q2, k2, v, w, causal, sm_scale, group, layout, fwd_piece)
        ctx.save_for_backward(q1, k1, q2, k2, v, o, lse)
        ctx.args = (w, causal, sm_scale, group, layout, method, piece)
        return o

    @staticmethod
    def backward(ctx, do):
        q1, k1, q2, k2, v, o, lse = ctx.saved_tensors
        w, causal, sm_scale, group, layout, method, piece = ctx.args
        do = do.contiguous()
        if method == "allgather":
            grads = _allgather_bwd(do, q1, k1, q2, k2, v, o, lse, w, causal, sm_scale, group,
                                   layout, ctx.gathered)
            del ctx.gathered
        else:
            grads = _ring_bwd(do, q1, k1, q2, k2, v, o, lse, w, causal, sm_scale, group, layout,
                              piece)
        grads = [g.to(x.dtype) for g, x in zip(grads, (q1, k1, q2, k2, v))]
        return (*grads, None, None, None, None, None, None, None)


def attention(q1, k1, q2, k2, v, dist_threshold, *, group=None, causal=False,
              sm_scale: Optional[float] = None, layout: str = "zigzag",
              method: str = "ring", ring_piece: Optional[int] = None):
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
        method: ``"ring"`` (default) or ``"allgather"``. On two H200s (2026-12-01; B = 1,
            H = Hkv = 16, D = 128, bf16, causal, L = 128k) forward+backward ran 1.41x
            faster than one GPU with the ring's default packets and 1.78x with allgather,
            and their peak memory per GPU was 0.52x and 2.19x that of one GPU
            (bench/results/2026-12-01-h200x2-cp-packets): the ring for memory, allgather for
            speed where the whole sequence's K/V and float32 dK/dV fit on every rank.
        ring_piece: keys per message of ``method="ring"``'s backward (the forward sends
            :data:`FWD_PIECES` = 16 times as many): each rank's keys are cut into pieces of
            at most this many and only the piece being computed on, the one arriving and
            their float32 dK/dV sums are held, so memory in flight does not grow with ``L``. Default: on CUDA,
            ``128 * max(8, SMs // (B * Hkv))`` (one wave of backward blocks per piece:
            1024 keys for B = 1, Hkv = 16 on an H200, 4224 for Hkv = 4); on the CPU, whole
            chunks.

    Returns the rank's shard of ``o`` ``(B, H, L_local, D)`` in the input dtype, with
    autograd. Every rank of the group must call it with the same arguments (collective).

    Raises:
        TypeError, ValueError: as :func:`cupy_piecewise.attention` for the shards, and for an
            unknown layout or method, an uninitialised process group, an odd ``L_local``
            with zigzag, or a ``ring_piece`` that is not a positive int.
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
    if ring_piece is not None and (isinstance(ring_piece, bool) or not isinstance(ring_piece, int)
                                   or ring_piece < 1):
        raise ValueError(f"ring_piece: expected a positive int or None, got {ring_piece!r}")
    world, rank = _world(group)
    chunks(rank, world, p.M, layout)  # zigzag: even local length
    piece = _piece_keys(ring_piece, p.B, p.Hkv, q1.device)
    return _ContextParallel.apply(q1, k1, q2, k2, v, p.w, p.causal, p.sm_scale, group, layout,
                                  method, piece)
