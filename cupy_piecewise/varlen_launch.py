"""Launching the packed variable-length kernels on raw device pointers.

A packed batch (``attention_varlen``) runs the mma.sync forward and backward kernels built
with their ``VARLEN`` flag (kernels_cu/params.cuh, ``seq_of``): one grid over (query tile
of the longest sequence, head, sequence) whose blocks read their sequence's rows from the
``B + 1`` running totals on the device, and leave when their tile starts past its end. The
host never reads the totals, so a call captures in a CUDA graph and replays with other
lengths (within the ``max_seqlen`` the grid was sized for).

The parameter block is :mod:`cupy_piecewise.launch`'s ``Params``: each packed
``(total, heads, D)`` array travels as a view with batch stride 0, head stride
``stride[1]`` and row stride ``stride[0]``; ``M`` and ``N`` hold ``total_q`` and
``total_k`` (the row count of lse and delta, ``(H, total_q)``); ``cu_q`` and ``cu_k`` are
pointers written per call. On compute capability 9.0 the packed forward runs the Hopper
kernel built with VARLEN where the dense rule would (:func:`use_hopper`): its tensor maps
describe the packed arrays as one batch and each CTA offsets its TMA coordinates by its
sequence's first rows (rows of the neighbouring sequence that a tile reaches are masked as
keys past the sequence's end, and not stored as queries). The packed backward runs the
Hopper backward built with VARLEN there too (:func:`use_hopper_backward`; statistics and the
dQ accumulator in FlashAttention-3's padded layout, so that a tile's rows past its sequence's
end meet +inf lse and add nothing), and the mma.sync kernels elsewhere.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

from . import launch

__all__ = ["VarlenShape", "FORWARD_ARRAYS", "BACKWARD_ARRAYS", "forward_launches",
           "backward_launches", "use_hopper", "use_hopper_backward"]

#: Pointer arguments of :meth:`launch.Launches.run` for a packed forward / backward.
FORWARD_ARRAYS = launch.FORWARD_ARRAYS + ("cu_q", "cu_k")
BACKWARD_ARRAYS = launch.BACKWARD_ARRAYS + ("cu_q", "cu_k")


class VarlenShape(NamedTuple):
    """A packed call's sizes beyond its :class:`~cupy_piecewise.validate.Problem`, whose
    ``B`` is the number of sequences and ``M`` / ``N`` the longest query and key sequence
    (``max_seqlen_q`` / ``max_seqlen_k``): the packed row counts."""

    total_q: int
    total_k: int


def _view(strides) -> tuple:
    """(batch, head, row) element strides of a packed (total, heads, D) array."""
    return (0, int(strides[1]), int(strides[0]))


def _view4(strides) -> tuple:
    """(batch, head, row, D) element strides of a packed array seen as one batch."""
    return (0, int(strides[1]), int(strides[0]), 1)


def _template(problem, shape: VarlenShape, views: dict) -> bytes:
    # Params.M and N carry the packed totals; the kernels take each sequence's lengths and
    # shift from cu_q / cu_k. w arrives clamped for the longest sequences (core.clamp_w);
    # launch._pack clamps it again to [-total_q, total_k], which contains that range.
    # Unsplit: one split whose key-tile range covers every sequence.
    return launch._pack(replace(problem, M=shape.total_q, N=shape.total_k, shift=None), views,
                        (1, launch.UNSPLIT_TILES, 0, 0))


def use_hopper(problem) -> bool:
    """True when a packed forward runs the Hopper kernel (``pw90_forward`` built with VARLEN):
    the dense rule of :func:`cupy_piecewise.launch.use_hopper` with ``M`` the longest
    sequence (compute capability 9.0, a head dim in :data:`capability.HOPPER_HEAD_DIMS`,
    more than 16 query rows, a grid of
    at least one CTA per SM unless ``CUPY_PIECEWISE_PATH=hopper``)."""
    return launch.use_hopper(problem, split=True)


class HopperVarlenLaunches(launch.HopperLaunches):
    """The Hopper forward of a packed batch: tensor maps over the packed arrays as batch 1
    ((1, heads, total, D) views), o with batch stride 0, ``M`` / ``N`` the packed totals,
    grid (ceil(longest sequence / 128), H, B); :meth:`run` takes :data:`FORWARD_ARRAYS`."""

    __slots__ = ()

    def __init__(self, problem, shape: VarlenShape, strides):
        p = problem
        packed = replace(p, B=1, M=shape.total_q, N=shape.total_k, shift=None)
        # (1, heads, total, D) views: batch stride 0 (one batch), head and row strides
        super().__init__(packed, [_view4(st) for st in strides],
                         variant=launch.Variant("fwd_sm90", p.dtype, p.D, None, p.causal, True),
                         grid=(math.ceil(p.M / launch.capability.hopper_block_m(p.D)), p.H, p.B))
        self.arrays = FORWARD_ARRAYS  # run() packs cu_q and cu_k after the dense pointers


def forward_launches(problem, shape: VarlenShape, strides):
    """Prepare the packed forward (``problem.M > 0``, ``problem.B`` and ``problem.H`` > 0).

    ``strides``: element strides of the packed q1, k1, q2, k2, v, o (each (total, heads, D)
    with unit stride along D). :meth:`~launch.Launches.run` then takes the pointers of
    :data:`FORWARD_ARRAYS`: the six arrays, lse (float32 (H, total_q), or 0), cu_q and cu_k
    (int32 (B + 1,)). Unsplit: a decode-like batch (few queries per sequence) does not get
    the dense path's split-KV. Returns :class:`HopperVarlenLaunches` where
    :func:`use_hopper` says so and tensor maps can describe the strides.
    """
    launch._check_grid(problem)
    launch._driver()
    if shape.total_k and use_hopper(problem) and launch._tma_describable(
            replace(problem, B=1, M=shape.total_q, N=shape.total_k),
            [_view4(st) for st in strides[:5]]):
        return HopperVarlenLaunches(problem, shape, strides)
    variant = launch.plan(problem, "fwd", varlen=True)
    views = dict(zip(("q1", "k1", "q2", "k2", "v", "o"), map(_view, strides)))
    grid = (math.ceil(problem.M / variant.tiles.block_m), problem.H, problem.B)
    steps = [launch._step(problem, variant, grid)]
    return launch.Launches(problem.device, FORWARD_ARRAYS, views, steps,
                           _template(problem, shape, views))


def _dq_steps(problem, shape: VarlenShape) -> list:
    """The mma.sync delta pre-pass and packed dq kernel (``problem.M``, ``total_q`` > 0)."""
    dq = launch.plan(problem, "bwd_dq", varlen=True)
    # the pre-pass is the dense one: batch 1, rows H * total_q of the (H, total_q) arrays
    return [launch._step(problem, launch.plan(problem, "bwd_delta"),
                         (math.ceil(problem.H * shape.total_q / 8), 1, 1)),
            launch._step(problem, dq, (math.ceil(problem.M / dq.tiles.block_m),
                                       problem.H, problem.B))]


def use_hopper_backward(problem, shape: VarlenShape) -> bool:
    """True when a packed backward runs the Hopper kernels (``pw90_bwd`` built with VARLEN):
    the dense rule of :func:`cupy_piecewise.launch.use_hopper_backward` with ``M`` / ``N``
    the longest sequences, queries and keys in the batch, and padded statistics
    (``total_q + 64 B`` rows) indexable by the kernels' 32-bit row numbers."""
    return (shape.total_q > 0 and shape.total_k > 0
            and shape.total_q + launch.capability.HOPPER_BWD_BLOCK_M * problem.B < 2**31
            and launch.use_hopper_backward(problem))


def backward_launches(problem, shape: VarlenShape, strides, *, deterministic: bool = False):
    """Prepare the packed backward.

    On an H100/H200 where :func:`use_hopper_backward` holds and tensor maps can describe
    the strides: :class:`cupy_piecewise.launch.HopperBackward` with ``packed=shape`` (dQ by
    float32 atomics; ``deterministic``: dQ by the packed mma.sync dq kernel instead).
    Otherwise the mma.sync kernels: where :func:`cupy_piecewise.launch.use_fused_backward`
    says so (not ``deterministic``; float16/bfloat16 variants with a packed ``bwd_fused``
    tile) the one-kernel backward (:func:`cupy_piecewise.launch.fused_backward_steps` over
    the ``H * total_q`` rows; dQ by float32 atomics into a workspace of ``workspace_bytes``);
    else the deterministic scheme: the delta pre-pass over all ``H * total_q`` rows, the dq
    kernel over (query tile, head, sequence) and the dk/dv kernel over (key tile, kv head,
    sequence). Either writes zeros for keys of sequences without queries.

    ``strides``: element strides of the packed q1, k1, q2, k2, v, o, dout, dq1, dk1, dq2,
    dk2, dv. ``run`` takes the pointers of :data:`BACKWARD_ARRAYS` (lse, delta and dlse:
    float32 (H, total_q); delta is scratch; dlse 0 for none) and, on the Hopper path, a
    workspace of ``workspace_bytes``.
    """
    launch._check_grid(problem)
    launch._driver()
    names = ("q1", "k1", "q2", "k2", "v", "o", "dout", "dq1", "dk1", "dq2", "dk2", "dv")
    views = dict(zip(names, map(_view, strides)))
    if problem.M > 0 and use_hopper_backward(problem, shape) and launch._tma_describable(
            replace(problem, B=1, M=shape.total_q, N=shape.total_k),
            [_view4(st) for st in strides[:5]], _view4(strides[6])):
        mma = None
        if deterministic:
            mma = launch.Launches(problem.device, BACKWARD_ARRAYS, views,
                                  _dq_steps(problem, shape), _template(problem, shape, views))
        return launch.HopperBackward(problem, {n: _view4(st) for n, st in zip(names, strides)},
                                     deterministic, packed=shape, mma=mma)
    if shape.total_q > 0 and launch.use_fused_backward(problem, deterministic, varlen=True):
        rows = problem.H * shape.total_q
        steps, acc_bytes = launch.fused_backward_steps(problem, rows, varlen=True), 4 * rows * problem.D
        return launch.Launches(problem.device, BACKWARD_ARRAYS, views, steps,
                               _template(problem, shape, views), workspace_bytes=2 * acc_bytes,
                               ws_offset=acc_bytes)
    steps = []
    if problem.M > 0 and shape.total_q > 0:
        steps += _dq_steps(problem, shape)
    if problem.N > 0:
        dkv = launch.plan(problem, "bwd_dkv", varlen=True)
        steps.append(launch._step(problem, dkv, (math.ceil(problem.N / dkv.tiles.block_n),
                                                 problem.Hkv, problem.B)))
    return launch.Launches(problem.device, BACKWARD_ARRAYS, views, steps,
                           _template(problem, shape, views))
