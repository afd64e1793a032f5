"""Launching the CUDA kernels on raw device pointers.

This layer knows nothing of CuPy arrays or torch tensors: callers (``cupy_backend``,
``torch_ops``) pass :class:`ArrayRef` (pointer + element strides) for inputs and for
outputs they allocated, and the stream to launch on. Working from pointers keeps the
per-call host cost to a few microseconds and makes the zero-copy promise literal: the
kernels read the callers' own memory.

Kernel arguments travel as one packed struct (``Params`` in ``kernels_cu/params.cuh``)
through ``cuLaunchKernel``; :data:`PARAM_FIELDS` mirrors its layout.
"""
from __future__ import annotations

import ctypes
import math
import os
import struct
import threading
from typing import NamedTuple

from . import capability
from .compile import ROW_KERNELS, Variant, get_function

__all__ = ["ArrayRef", "kernel_ready", "forward", "backward", "plan"]

#: Tensor views in the order of ``Params`` (each: pointer, batch/head/row strides).
TENSORS = ("q1", "k1", "q2", "k2", "v", "o", "dout", "dq1", "dk1", "dq2", "dk2", "dv")
#: The scalar tail of ``Params``; the last 8 bytes hold two float32 (scale_log2, sm_scale).
PARAM_FIELDS = tuple(f"{t}.{f}" for t in TENSORS for f in ("ptr", "sb", "sh", "sr")) + (
    "lse", "delta", "H", "group", "M", "N", "w", "scale_log2|sm_scale",
    "nsplit", "split_tiles", "o_part", "lse_part")
_NSLOTS = len(PARAM_FIELDS)
_Slots = ctypes.c_int64 * _NSLOTS
_LOG2E = 1.4426950408889634
_MAX_GRID_YZ = 65535


class ArrayRef(NamedTuple):
    """A device array as the kernels see it: data pointer and strides in elements."""

    ptr: int
    strides: tuple


def kernel_ready(shape, strides, ptr: int, itemsize: int) -> bool:
    """True when the kernels can read this array in place.

    They need unit stride along the last axis, 16-byte aligned rows (every other stride a
    non-negative multiple of 8 elements of a 2-byte type) and a 16-byte aligned pointer.
    Axes of length 1 may have any stride. Anything else is copied once by the caller.
    """
    if ptr % 16:
        return False
    for n, s in zip(shape[:-1], strides[:-1]):
        if n > 1 and (s < 0 or (s * itemsize) % 16):
            return False
    return shape[-1] <= 1 or strides[-1] == 1


_cc_cache: dict[int, tuple[int, int]] = {}
_sm_count: dict[int, int] = {}
#: Decoding (at most this many query rows) takes the one-warp fwd_decode tiles.
DECODE_ROWS = 16
#: Split the keys across blocks while the grid has fewer blocks than this many per SM.
SPLIT_BLOCKS_PER_SM = 4


def _multiprocessors(device: int) -> int:
    n = _sm_count.get(device)
    if n is None:
        import cupy

        n = _sm_count[device] = int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])
    return n


def split_plan(problem, tiles, sms: int) -> tuple[int, int]:
    """(nsplit, key tiles per split) for a forward with ``tiles`` on ``sms`` multiprocessors.

    Splitting pays when the (query tile, head, batch) grid cannot fill the GPU: keys are
    then cut into ranges of whole tiles, at least two tiles each, until the grid reaches
    SPLIT_BLOCKS_PER_SM blocks per SM.
    """
    blocks = math.ceil(problem.M / tiles.block_m) * problem.H * problem.B
    key_tiles = math.ceil(problem.N / tiles.block_n)
    want = math.ceil(SPLIT_BLOCKS_PER_SM * sms / max(blocks, 1))
    nsplit = max(1, min(want, key_tiles // 2, 1024))
    if nsplit == 1:
        return 1, key_tiles
    per = math.ceil(key_tiles / nsplit)
    return math.ceil(key_tiles / per), per
_kernels: dict[tuple[int, Variant], tuple[int, int]] = {}
_lock = threading.Lock()


def _compute_capability(device: int) -> tuple[int, int]:
    cc = _cc_cache.get(device)
    if cc is None:
        import cupy

        s = cupy.cuda.Device(device).compute_capability
        cc = _cc_cache[device] = (int(s[:-1]), int(s[-1]))
    return cc


_plans: dict[tuple, Variant] = {}


def plan(problem, phase: str) -> Variant:
    """The kernel variant (tile sizes from the capability table) for ``problem``'s device.

    Cached per (device, phase, head dim, dtype, causal) and the value of
    ``CUPY_PIECEWISE_TILES``, so a tuning override set between calls still takes effect.
    """
    key = (problem.device, phase, problem.D, problem.dtype, problem.causal,
           os.environ.get(capability.ENV_VAR))
    hit = _plans.get(key)
    if hit is not None:
        return hit
    cc = _compute_capability(problem.device)
    tiles = None if phase in ROW_KERNELS else capability.lookup(
        cc, phase, problem.D, problem.dtype, problem.causal)
    variant = _plans[key] = Variant(phase, problem.dtype, problem.D, tiles, problem.causal)
    return variant


def _kernel(device: int, variant: Variant) -> tuple[int, int]:
    """(CUfunction handle, dynamic shared bytes) for ``variant``, loaded on ``device``."""
    key = (device, variant)
    hit = _kernels.get(key)
    if hit is not None:
        return hit
    kernel = get_function(device, variant)  # a cupy.RawKernel
    smem = 0 if variant.tiles is None else capability.shared_bytes(
        variant.phase, variant.head_dim, variant.tiles)
    if smem > 48 * 1024:  # above 48 KB a kernel must opt in
        kernel.max_dynamic_shared_size_bytes = smem
    ptr = kernel.kernel.ptr  # the loaded CUfunction
    with _lock:
        _kernels[key] = (ptr, smem)
    return ptr, smem


_PACKER = struct.Struct(f"<{_NSLOTS}q")
_tls = threading.local()


def _buffers():
    """This thread's parameter block and its one-entry argument array (reused per launch:
    cuLaunchKernel copies the parameters before it returns)."""
    bufs = getattr(_tls, "bufs", None)
    if bufs is None:
        slots = _Slots()
        args = (ctypes.c_void_p * 1)(ctypes.addressof(slots))
        # keep `args` itself referenced: the launch reads it through its address
        bufs = _tls.bufs = (slots, ctypes.addressof(args), args)
    return bufs


def _pack(problem, refs: dict, split=(1, 0, 0, 0)) -> ctypes.Array:
    """Write the kernel parameters for ``problem`` into this thread's parameter block."""
    slots = []
    for name in TENSORS:
        r = refs.get(name)
        if r is None:
            slots += (0, 0, 0, 0)
        else:
            s = r.strides
            slots += (r.ptr, s[0], s[1], s[2])
    n_dist = problem.M + problem.N + 1  # every distance lies strictly inside +-n_dist
    w = max(-n_dist, min(n_dist, int(problem.w)))
    scales = struct.unpack("<q", struct.pack("<ff", problem.sm_scale * _LOG2E, problem.sm_scale))[0]
    slots += (refs.get("lse", 0), refs.get("delta", 0), problem.H, problem.H // problem.Hkv,
              problem.M, problem.N, w, scales) + tuple(split)
    buf = _buffers()[0]
    _PACKER.pack_into(buf, 0, *slots)
    return buf


def _launch(problem, variant: Variant, grid, stream: int) -> None:
    """Launch ``variant`` with the parameters the last :func:`_pack` on this thread wrote."""
    fn, smem = _kernel(problem.device, variant)
    args = _buffers()[1]
    _driver().launchKernel(fn, grid[0], grid[1], grid[2], variant.threads, 1, 1, smem, stream,
                           args, 0)


_driver_mod = None


def _driver():
    global _driver_mod
    if _driver_mod is None:
        from cupy_backends.cuda.api import driver

        _driver_mod = driver
    return _driver_mod


def _check_grid(problem) -> None:
    if problem.H > _MAX_GRID_YZ or problem.B > _MAX_GRID_YZ:
        raise ValueError(f"q1: batch ({problem.B}) and heads ({problem.H}) must each be at most "
                         f"{_MAX_GRID_YZ} for the CUDA kernels")


class _DeviceGuard:
    """Makes ``device`` current for the launch only when it is not already (cheap path)."""

    def __init__(self, device: int):
        self.device = device
        self.prev = None

    def __enter__(self):
        from cupy_backends.cuda.api import runtime

        cur = runtime.getDevice()
        if cur != self.device:
            self.prev = cur
            runtime.setDevice(self.device)

    def __exit__(self, *exc):
        if self.prev is not None:
            from cupy_backends.cuda.api import runtime

            runtime.setDevice(self.prev)


def forward(problem, q1, k1, q2, k2, v, o, lse, *, stream: int, workspace=None) -> None:
    """Launch the forward kernel: writes every element of ``o`` and ``lse``.

    Args:
        problem: a validated :class:`cupy_piecewise.validate.Problem` (float16/bfloat16,
            supported head dim, ``device`` set).
        q1, q2: :class:`ArrayRef` of (B, H, M, D); k1, k2, v: (B, Hkv, N, D); all
            :func:`kernel_ready`.
        o: :class:`ArrayRef` of the (B, H, M, D) output, input dtype, kernel_ready.
        lse: device pointer (int) of a contiguous float32 (B, H, M) output.
        stream: ``cudaStream_t`` as an int (0 for the legacy default stream).
        workspace: optional ``nbytes -> (keepalive, device pointer)`` allocator on the
            caller's stream. With it, grids too small to fill the GPU (decoding, few heads)
            split the keys across blocks and merge the partial results (split-KV); without
            it the forward runs unsplit.
    """
    if problem.M == 0:
        return
    _check_grid(problem)
    variant = plan(problem, "fwd_decode" if problem.M <= DECODE_ROWS else "fwd")
    tiles = variant.tiles
    nsplit, per = 1, 0
    if workspace is not None and problem.N > 0:
        nsplit, per = split_plan(problem, tiles, _multiprocessors(problem.device))
    refs = dict(q1=q1, k1=k1, q2=q2, k2=k2, v=v, o=o, lse=lse)
    keep = None
    if nsplit > 1:
        rows = nsplit * problem.B * problem.H * problem.M
        keep, ws = workspace(4 * rows * (problem.D + 1))
        _pack(problem, refs, (nsplit, per, ws, ws + 4 * rows * problem.D))
    else:
        _pack(problem, refs, (1, 1 << 40, 0, 0))
    grid = (math.ceil(problem.M / tiles.block_m) * nsplit, problem.H, problem.B)
    with _DeviceGuard(problem.device):
        _launch(problem, variant, grid, stream)
        if nsplit > 1:
            _launch(problem, plan(problem, "fwd_combine"),
                    (math.ceil(problem.H * problem.M / 8), problem.B, 1), stream)
    del keep  # stream-ordered allocators may reuse it for work queued after this point


def backward(problem, q1, k1, q2, k2, v, o, lse, do, dq1, dk1, dq2, dk2, dv, delta, *,
             stream: int) -> None:
    """Launch the backward kernels: writes every element of the five gradients.

    Args: as :func:`forward`, plus ``do`` (ArrayRef, (B, H, M, D)), the gradient outputs
    ``dq1``, ``dq2`` ((B, H, M, D)) and ``dk1``, ``dk2``, ``dv`` ((B, Hkv, N, D)) as
    ArrayRef in the input dtype, ``lse`` and ``delta`` as pointers of contiguous float32
    (B, H, M) arrays (``delta`` is scratch). dk/dv of a grouped-query problem are summed
    over the query heads of each group in the kernel.
    """
    _check_grid(problem)
    _pack(problem, dict(q1=q1, k1=k1, q2=q2, k2=k2, v=v, o=o, dout=do, dq1=dq1,
                                 dk1=dk1, dq2=dq2, dk2=dk2, dv=dv, lse=lse, delta=delta))
    with _DeviceGuard(problem.device):
        if problem.M > 0:
            _launch(problem, plan(problem, "bwd_delta"),
                    (math.ceil(problem.H * problem.M / 8), problem.B, 1), stream)
            dq = plan(problem, "bwd_dq")
            _launch(problem, dq, (math.ceil(problem.M / dq.tiles.block_m), problem.H, problem.B),
                    stream)
        if problem.N > 0:  # with M == 0 this still writes dk = dv = 0
            dkv = plan(problem, "bwd_dkv")
            _launch(problem, dkv,
                    (math.ceil(problem.N / dkv.tiles.block_n), problem.Hkv, problem.B),
                    stream)
