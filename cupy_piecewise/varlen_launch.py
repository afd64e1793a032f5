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
pointers written per call. The Hopper (wgmma + TMA) kernels have no packed variant yet:
packed batches take the mma.sync kernels on every GPU.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

from . import launch

__all__ = ["VarlenShape", "FORWARD_ARRAYS", "BACKWARD_ARRAYS", "forward_launches",
           "backward_launches"]

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


def _template(problem, shape: VarlenShape, views: dict) -> bytes:
    # Params.M and N carry the packed totals; the kernels take each sequence's lengths and
    # shift from cu_q / cu_k. w arrives clamped for the longest sequences (core.clamp_w);
    # launch._pack clamps it again to [-total_q, total_k], which contains that range.
    # Unsplit: one split whose key-tile range covers every sequence.
    return launch._pack(replace(problem, M=shape.total_q, N=shape.total_k, shift=None), views,
                        (1, launch.UNSPLIT_TILES, 0, 0))


def forward_launches(problem, shape: VarlenShape, strides) -> launch.Launches:
    """Prepare the packed forward (``problem.M > 0``, ``problem.B`` and ``problem.H`` > 0).

    ``strides``: element strides of the packed q1, k1, q2, k2, v, o (each (total, heads, D)
    with unit stride along D). :meth:`~launch.Launches.run` then takes the pointers of
    :data:`FORWARD_ARRAYS`: the six arrays, lse (float32 (H, total_q), or 0), cu_q and cu_k
    (int32 (B + 1,)). Unsplit: a decode-like batch (few queries per sequence) does not get
    the dense path's split-KV.
    """
    launch._check_grid(problem)
    launch._driver()
    variant = launch.plan(problem, "fwd", varlen=True)
    views = dict(zip(("q1", "k1", "q2", "k2", "v", "o"), map(_view, strides)))
    grid = (math.ceil(problem.M / variant.tiles.block_m), problem.H, problem.B)
    steps = [launch._step(problem, variant, grid)]
    return launch.Launches(problem.device, FORWARD_ARRAYS, views, steps,
                           _template(problem, shape, views))


def backward_launches(problem, shape: VarlenShape, strides) -> launch.Launches:
    """Prepare the packed backward: the delta pre-pass over all ``H * total_q`` rows, the dq
    kernel over (query tile, head, sequence) and the dk/dv kernel over (key tile, kv head,
    sequence), which writes zeros for keys of sequences without queries.

    ``strides``: element strides of the packed q1, k1, q2, k2, v, o, dout, dq1, dk1, dq2,
    dk2, dv. :meth:`~launch.Launches.run` takes the pointers of :data:`BACKWARD_ARRAYS`
    (lse, delta and dlse: float32 (H, total_q); delta is scratch; dlse 0 for none).
    Deterministic (no atomics).
    """
    launch._check_grid(problem)
    launch._driver()
    names = ("q1", "k1", "q2", "k2", "v", "o", "dout", "dq1", "dk1", "dq2", "dk2", "dv")
    views = dict(zip(names, map(_view, strides)))
    steps = []
    if problem.M > 0 and shape.total_q > 0:
        dq = launch.plan(problem, "bwd_dq", varlen=True)
        # the pre-pass is the dense one: batch 1, rows H * total_q of the (H, total_q) arrays
        steps.append(launch._step(problem, launch.plan(problem, "bwd_delta"),
                                  (math.ceil(problem.H * shape.total_q / 8), 1, 1)))
        steps.append(launch._step(problem, dq, (math.ceil(problem.M / dq.tiles.block_m),
                                                problem.H, problem.B)))
    if problem.N > 0:
        dkv = launch.plan(problem, "bwd_dkv", varlen=True)
        steps.append(launch._step(problem, dkv, (math.ceil(problem.N / dkv.tiles.block_n),
                                                 problem.Hkv, problem.B)))
    return launch.Launches(problem.device, BACKWARD_ARRAYS, views, steps,
                           _template(problem, shape, views))
