"""Launching the CUDA kernels on raw device pointers.

This layer knows nothing of CuPy arrays or torch tensors: callers (``cupy_piecewise.core``,
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
import struct
import threading
from dataclasses import replace
from typing import NamedTuple

from . import capability, cuda_driver
from .compile import HOPPER_KERNELS, ROW_KERNELS, Variant, get_function

__all__ = ["ArrayRef", "Launches", "kernel_ready", "forward", "backward", "forward_launches",
           "backward_launches", "plan"]

#: Tensor views in the order of ``Params`` (each: pointer, batch/head/row strides).
TENSORS = ("q1", "k1", "q2", "k2", "v", "o", "dout", "dq1", "dk1", "dq2", "dk2", "dv")
#: The scalar tail of ``Params``; the last 8 bytes hold two float32 (scale_log2, sm_scale).
PARAM_FIELDS = tuple(f"{t}.{f}" for t in TENSORS for f in ("ptr", "sb", "sh", "sr")) + (
    "lse", "delta", "H", "group", "M", "N", "w", "scale_log2|sm_scale",
    "nsplit", "split_tiles", "o_part", "lse_part", "shift", "dlse", "cu_q", "cu_k")
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
    non-negative multiple of 16 bytes: 8 elements of a 2-byte type, 4 of float32) and a
    16-byte aligned pointer.
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
#: Key tiles per split of an unsplit forward: more than any sequence has.
UNSPLIT_TILES = 1 << 40


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


_variants: dict[tuple, Variant] = {}


def plan(problem, phase: str, varlen: bool = False) -> Variant:
    """The kernel variant (tile sizes from the capability table) for ``problem``'s device;
    ``varlen``: the packed-batch kernel of ``phase``.

    Cached per (device, phase, head dim, dtype, causal, varlen) and the value of
    ``CUPY_PIECEWISE_TILES``, so a tuning override set between calls still takes effect.
    """
    key = (problem.device, phase, problem.D, problem.dtype, problem.causal, varlen,
           capability.plan_switches())
    hit = _variants.get(key)
    if hit is not None:
        return hit
    cc = _compute_capability(problem.device)
    tiles = None if phase in ROW_KERNELS else capability.lookup(
        cc, phase, problem.D, problem.dtype, problem.causal, varlen=varlen)
    variant = _variants[key] = Variant(phase, problem.dtype, problem.D, tiles, problem.causal,
                                       varlen)
    return variant


#: Dynamic shared memory of the Hopper kernels by phase (the row kernels use none).
_HOPPER_SMEM = {"fwd_sm90": capability.hopper_shared_bytes,
                "bwd_sm90": capability.hopper_bwd_shared_bytes,
                "bwd_sm90_det": capability.hopper_bwd_shared_bytes}


def _kernel(device: int, variant: Variant) -> tuple[int, int]:
    """(CUfunction handle, dynamic shared bytes) for ``variant``, loaded on ``device``.

    Everything happens with ``device`` current: CuPy's ``RawKernel.kernel`` loads the
    module into the current device's context, and a handle from another device's context
    fails to launch (CUDA_ERROR_INVALID_HANDLE)."""
    key = (device, variant)
    hit = _kernels.get(key)
    if hit is not None:
        return hit
    import cupy

    if variant.phase == "kvdecode_sm90":  # its ring depth rides in the tiles
        smem = capability.kv90_shared_bytes(variant.head_dim, variant.tiles.stages,
                                            bool(variant.rotary), variant.rot_stage)
    elif variant.phase in HOPPER_KERNELS:
        smem = _HOPPER_SMEM.get(variant.phase, lambda d: 0)(variant.head_dim)
    else:
        smem = 0 if variant.tiles is None else capability.shared_bytes(
            variant.phase, variant.head_dim, variant.tiles, capability.elem_bytes(variant.dtype))
    with cupy.cuda.Device(device):
        kernel = get_function(device, variant)  # a cupy.RawKernel
        if smem > 48 * 1024:  # above 48 KB a kernel must opt in
            kernel.max_dynamic_shared_size_bytes = smem
        ptr = kernel.kernel.ptr  # the loaded CUfunction of this device
    with _lock:
        _kernels[key] = (ptr, smem)
    return ptr, smem


# ---------------------------------------------------------------------------
# Launch plans: everything about a call except its pointers and stream, prepared once.

#: The pointer arguments of :meth:`Launches.run`, in order, for each kind of call.
FORWARD_ARRAYS = ("q1", "k1", "q2", "k2", "v", "o", "lse")
BACKWARD_ARRAYS = ("q1", "k1", "q2", "k2", "v", "o", "lse", "dout",
                   "dq1", "dk1", "dq2", "dk2", "dv", "delta", "dlse")
#: Arrays that travel as a bare pointer (contiguous float32), the rest as views.
_BARE = ("lse", "delta", "dlse", "cu_q", "cu_k")
_SLOT = {name: i for i, name in enumerate(PARAM_FIELDS)}
_SIZE = 8 * _NSLOTS
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


def _clamped(problem) -> tuple[int, int]:
    """``(P, w)`` for the kernels: ``d(i, j) = i + P - j`` compared with ``w``. With
    ``x = i - j`` in ``[1 - N, M - 1]``, ``d >= w`` is ``x >= w - P``, which ``w - P``
    clamped to ``[-N, M]`` decides the same way; so ``|w| <= |P| + max(M, N)``, and ``P``
    (from :func:`cupy_piecewise.core.clamp_w`: ``N - M`` or within ``[-M, N]``) keep the
    Hopper kernels' 32-bit arithmetic exact for lengths below 2^30."""
    P = problem.N - problem.M if problem.shift is None else problem.shift
    return P, max(P - problem.N, min(P + problem.M, int(problem.w)))


def _pack(problem, strides: dict, split=(1, 0, 0, 0)) -> bytes:
    """The parameter block for ``problem`` with every pointer 0: ``strides`` maps the
    names in :data:`TENSORS` to element strides (absent views get zeros). The kernels
    count strides in 16-bit units (params.cuh): a float32 stride is doubled here."""
    slots = []
    unit = 2 if problem.dtype == "float32" else 1
    for name in TENSORS:
        s = strides.get(name)
        slots += (0, 0, 0, 0) if s is None else (0, unit * s[0], unit * s[1], unit * s[2])
    P, w = _clamped(problem)
    scales = struct.unpack("<q", struct.pack("<ff", problem.sm_scale * _LOG2E, problem.sm_scale))[0]
    slots += (0, 0, problem.H, problem.H // problem.Hkv, problem.M, problem.N, w, scales) + tuple(split)
    slots += (P, 0, 0, 0)  # shift; dlse, cu_q, cu_k (pointers set per call)
    return _PACKER.pack(*slots)


class Launches:
    """The kernel launches of one forward or backward call, prepared for fixed metadata.

    Built by :func:`forward_launches` / :func:`backward_launches` from a problem and the
    element strides of its arrays; :meth:`run` only writes the data pointers into a copy
    of the prepared parameter block and calls ``cuLaunchKernel`` for each kernel. Callers
    that see the same metadata again (the torch fast path) keep the object and skip all
    planning. Immutable, so one object may be run from several threads.

    Attributes:
        device: the CUDA device index the kernels run on.
        arrays: names of the pointers :meth:`run` takes, in order.
        strides: element strides of each (B, heads, rows, D) view, by name (the bare
            float32 arrays lse and delta are contiguous and not listed).
        workspace_bytes: scratch the call needs (split-KV partial results); 0 for none.
    """

    __slots__ = ("device", "arrays", "strides", "workspace_bytes", "_steps", "_template",
                 "_ptr_slots", "_ws_offset")

    def __init__(self, device, arrays, strides, steps, template, workspace_bytes=0,
                 ws_offset=0):
        self.device = device
        self.arrays = arrays
        self.strides = strides
        self.workspace_bytes = workspace_bytes
        self._steps = tuple(steps)  # (CUfunction, grid x, y, z, threads, shared bytes)
        self._template = template
        self._ptr_slots = tuple(_SLOT[n if n in _BARE else f"{n}.ptr"] for n in arrays)
        self._ws_offset = ws_offset

    def run(self, ptrs, stream: int, workspace: int = 0) -> None:
        """Launch every kernel on ``stream`` with the device pointers ``ptrs`` (ints, in
        the order of :attr:`arrays`) and, when :attr:`workspace_bytes` is non-zero, a
        ``workspace`` pointer to that many bytes valid on ``stream`` until the work ends.

        The device's primary context is made current on the calling thread for the
        launches (a thread that never touched CUDA has none; one working on another
        device has that one's) and the caller's context is restored afterwards."""
        slots, args, _ = _buffers()
        ctypes.memmove(slots, self._template, _SIZE)
        for i, p in zip(self._ptr_slots, ptrs):
            slots[i] = p
        if self.workspace_bytes:
            slots[_SLOT["o_part"]] = workspace
            slots[_SLOT["lse_part"]] = workspace + self._ws_offset
        _launch_all(self.device, self._steps, stream, args)


def _launch_all(device: int, steps, stream: int, args: int, programmatic: bool = False) -> None:
    """cuLaunchKernel for each (CUfunction, grid x, y, z, threads, shared bytes) of
    ``steps`` with the argument array at address ``args``, with ``device``'s primary
    context current on the calling thread (a thread that never touched CUDA has none; one
    working on another device has that one's); the caller's context is restored after.
    ``programmatic``: cuLaunchKernelEx with programmatic stream serialization instead
    (:func:`cuda_driver.launch_programmatic`; the kernels must wait for their producer)."""
    drv = _driver_mod or _driver()
    prev = drv.ctxGetCurrent()
    if prev and prev == _primary.get(device):
        _launch_steps(drv, steps, stream, args, programmatic)
        return
    _make_current(device)
    try:
        _launch_steps(drv, steps, stream, args, programmatic)
    finally:
        if prev:  # restore the caller's context; a thread that had none keeps ours
            drv.ctxSetCurrent(prev)


def _launch_steps(drv, steps, stream: int, args: int, programmatic: bool) -> None:
    for fn, gx, gy, gz, threads, smem in steps:
        if programmatic:
            cuda_driver.launch_programmatic(fn, (gx, gy, gz), threads, smem, stream, args)
        else:
            drv.launchKernel(fn, gx, gy, gz, threads, 1, 1, smem, stream, args, 0)


#: Primary context handle per device, as seen by :func:`_make_current`.
_primary: dict[int, int] = {}


def _make_current(device: int) -> None:
    """Make ``device``'s primary context current on this thread (cudaSetDevice does since
    CUDA 12, creating it if needed) and remember its handle for the cheap check in run."""
    _runtime_mod.setDevice(device)
    _primary[device] = _driver_mod.ctxGetCurrent()


_driver_mod = None
_runtime_mod = None


def _driver():
    global _driver_mod, _runtime_mod
    if _driver_mod is None:
        from cupy_backends.cuda.api import driver, runtime

        _runtime_mod = runtime
        _driver_mod = driver
    return _driver_mod


def _step(problem, variant: Variant, grid) -> tuple:
    fn, smem = _kernel(problem.device, variant)
    return (fn, grid[0], grid[1], grid[2], variant.threads, smem)


def _check_grid(problem) -> None:
    if not (problem.B and problem.H):
        raise ValueError("q1: no batch or no heads: nothing to launch (the core returns "
                         "empty outputs before planning launches)")
    if problem.H > _MAX_GRID_YZ or problem.B > _MAX_GRID_YZ:
        raise ValueError(f"q1: batch ({problem.B}) and heads ({problem.H}) must each be at most "
                         f"{_MAX_GRID_YZ} for the CUDA kernels")


def forward_launches(problem, strides, *, split: bool = True) -> Launches:
    """Prepare the forward of ``problem`` (``M > 0``).

    Args:
        problem: a validated :class:`cupy_piecewise.validate.Problem` (float16/bfloat16,
            supported head dim, ``device`` set).
        strides: element strides of q1, k1, q2, k2, v, o (each (B, heads, rows, D) with
            unit stride along D); lse is a contiguous float32 (B, H, M) array.
        split: allow split-KV (needs a workspace at run time) when the grid cannot fill
            the GPU (decoding, few heads).

    Loads (compiling on first use) the kernels it needs; raises ValueError for grids the
    hardware cannot launch.
    """
    _check_grid(problem)
    _driver()
    if use_hopper(problem, split) and _tma_describable(problem, strides):
        return HopperLaunches(problem, strides)
    variant = plan(problem, "fwd_decode" if problem.M <= DECODE_ROWS else "fwd")
    tiles = variant.tiles
    nsplit, per = 1, UNSPLIT_TILES
    if split and problem.N > 0:
        nsplit, per = split_plan(problem, tiles, _multiprocessors(problem.device))
        if nsplit == 1:
            per = UNSPLIT_TILES
    steps = [_step(problem, variant, (math.ceil(problem.M / tiles.block_m) * nsplit,
                                      problem.H, problem.B))]
    ws_bytes = ws_offset = 0
    if nsplit > 1:
        rows = nsplit * problem.B * problem.H * problem.M
        ws_offset = 4 * rows * problem.D
        ws_bytes = ws_offset + 4 * rows
        steps.append(_step(problem, plan(problem, "fwd_combine"),
                           (math.ceil(problem.H * problem.M / 8), problem.B, 1)))
    views = dict(zip(("q1", "k1", "q2", "k2", "v", "o"), map(tuple, strides)))
    template = _pack(problem, views, (nsplit, per, 0, 0))
    return Launches(problem.device, FORWARD_ARRAYS, views, steps, template, ws_bytes, ws_offset)


def use_hopper(problem, split: bool = True) -> bool:
    """True when ``problem``'s forward runs the Hopper kernel (wgmma + TMA, sm_90a).

    That is: a compute capability 9.0 GPU, float16/bfloat16, a head dim in
    :data:`capability.HOPPER_HEAD_DIMS`, no ``CUPY_PIECEWISE_PATH=mma``, more than
    :data:`DECODE_ROWS` query rows, and (when split-KV is allowed) enough query tiles to
    give every SM a block: smaller grids go to the mma.sync path, whose split-KV fills the
    GPU (the Hopper kernel has no split-KV yet), unless ``CUPY_PIECEWISE_PATH=hopper``.
    """
    if (problem.D not in capability.HOPPER_HEAD_DIMS or problem.M <= DECODE_ROWS
            or problem.dtype not in ("float16", "bfloat16")):
        return False
    path = capability.path_override()
    if _compute_capability(problem.device) != (9, 0) or path == "mma":
        return False
    if path == "hopper" or not split:
        return True
    blocks = math.ceil(problem.M / capability.hopper_block_m(problem.D)) * problem.H * problem.B
    return blocks >= _multiprocessors(problem.device)


def _tma_describable(problem, strides, dout=None) -> bool:
    """True when TMA tensor maps can describe q1, k1, q2, k2, v (and ``dout``, when given)
    with these element strides: every axis longer than 1 needs a positive stride below 2^40
    bytes (a broadcast axis, stride 0, cannot be described; the mma.sync kernels read it in
    place instead)."""
    q_shape = (problem.B, problem.H, problem.M)
    k_shape = (problem.B, problem.Hkv, problem.N)
    pairs = list(zip((q_shape, k_shape, q_shape, k_shape, k_shape), strides[:5]))
    if dout is not None:
        pairs.append((q_shape, dout))
    for shape, st in pairs:
        for n, s in zip(shape, st[:3]):
            if n > 1 and not 0 < s * 2 < (1 << 40):
                return False
    return True


#: FwdParams of kernels_cu/sm90/forward.cu: o, its batch/head/row strides, lse, H, group,
#: M, N, w, shift (8 bytes each), scale_log2 and sm_scale as float32, the batch size (the
#: persistent grid walks the work tiles itself), then the running totals cu_q and cu_k of a
#: packed batch (0 for a dense call).
_HOPPER_PARAMS = struct.Struct("<Qqqq Q qqqqqq ff q QQ")
_HOPPER_MAPS_MAX = 64


class _TensorMaps:
    """Tensor maps of one signature's arrays (fixed shapes, strides, boxes), encoded from
    the data pointers and cached per pointer tuple, so that repeated calls on the same
    buffers encode nothing. Thread-safe; the cache is dropped whole when full."""

    __slots__ = ("_shapes", "_strides", "_boxes", "_dtype", "_order", "_maps", "_lock")

    def __init__(self, shapes, strides, boxes, dtype, order=None):
        self._shapes, self._strides, self._boxes = tuple(shapes), tuple(strides), tuple(boxes)
        self._dtype = dtype
        self._order = tuple(order) if order is not None else tuple(range(len(self._shapes)))
        self._maps: dict = {}
        self._lock = threading.Lock()

    def addresses(self, ptrs) -> tuple:
        """``(addresses, keepalive)``: host addresses of the 128-byte maps of ``ptrs`` (one
        per shape), in ``order``, and the objects that own them. Hold ``keepalive`` until the
        launches that read the addresses are issued: another thread's call may drop the
        cache entry meanwhile."""
        key = tuple(ptrs)
        hit = self._maps.get(key)
        if hit is None:
            from . import tma

            maps = []
            for ptr, shape, st, box in zip(key, self._shapes, self._strides, self._boxes):
                # a box is its rows, or (rows, panels) for a map of whole rows (tma.py)
                rows, panels = box if isinstance(box, tuple) else (box, 1)
                maps.append(tma.tensor_map_bhld(ptr, shape, st, self._dtype, rows,
                                                panels=panels))
            hit = (tuple(maps[i].address() for i in self._order), maps)  # maps: keep alive
            with self._lock:
                if len(self._maps) >= _HOPPER_MAPS_MAX:
                    self._maps.clear()
                self._maps[key] = hit
        return hit


class HopperLaunches:
    """The Hopper forward of one signature, with :class:`Launches`' interface.

    The kernel takes five TMA tensor maps by value (q1, q2, k1, k2, v) and a parameter
    struct; maps are built from the data pointers at :meth:`run` and cached per pointer
    tuple (the shapes and strides are fixed for this object), so repeated calls on the same
    buffers encode nothing. A dense non-causal batch runs the persistent grid: one CTA per
    SM (at most one per work tile) walking the (query tile, head, batch) work tiles
    (``capability.hopper_block_m`` rows per query tile: 192 at D = 64, else 128).
    A dense causal one does too where ``capability.HOPPER_CAUSAL_PAIRS`` says so, walking
    units of two query tiles of one head (equal key-tile counts); else one CTA per work tile
    (tiles of unequal length, balanced by the hardware's block scheduling). A packed batch
    (``grid`` given) takes one CTA per work tile.
    """

    __slots__ = ("device", "arrays", "strides", "workspace_bytes", "_steps", "_template",
                 "_maps")

    def __init__(self, problem, strides, *, variant=None, grid=None):
        p = problem
        self.device = p.device
        self.arrays = FORWARD_ARRAYS
        self.strides = dict(zip(("q1", "k1", "q2", "k2", "v", "o"), map(tuple, strides)))
        self.workspace_bytes = 0
        variant = variant or Variant("fwd_sm90", p.dtype, p.D, None, p.causal)
        bm = capability.hopper_block_m(p.D)
        mtiles = math.ceil(p.M / bm)
        pairs = capability.HOPPER_CAUSAL_PAIRS[capability.hopper_compute_dim(p.D)]
        if grid is None and p.causal and not pairs:
            grid = (mtiles, p.H, p.B)
        elif grid is None:  # the persistent kernel (kernels_cu/sm90/forward.cu, PW90_PERSIST)
            # work units: query tiles, or (causal) pairs of query tiles of one head
            units = (mtiles + 1) // 2 if p.causal else mtiles
            grid = (min(units * p.H * p.B,
                        capability.persist_ctas() or _multiprocessors(p.device)), 1, 1)
        self._steps = (_step(p, variant, grid),)
        so = self.strides["o"]
        P, w = _clamped(p)
        self._template = _HOPPER_PARAMS.pack(0, so[0], so[1], so[2], 0, p.H, p.H // p.Hkv, p.M,
                                             p.N, w, P, p.sm_scale * _LOG2E, p.sm_scale, p.B,
                                             0, 0)
        bn = capability.HOPPER_BLOCK_N[capability.hopper_compute_dim(p.D)]
        q_shape, k_shape = (p.B, p.H, p.M, p.D), (p.B, p.Hkv, p.N, p.D)
        names = ("q1", "k1", "q2", "k2", "v")
        # the kernel takes the maps in the order q1, q2, k1, k2, v
        self._maps = _TensorMaps((q_shape, k_shape, q_shape, k_shape, k_shape),
                                 [self.strides[n] for n in names],
                                 (bm, bn, bm, bn, bn),
                                 p.dtype, order=(0, 2, 1, 3, 4))

    def run(self, ptrs, stream: int, workspace: int = 0) -> None:
        """Launch on ``stream`` with the pointers of q1, k1, q2, k2, v, o, lse (lse 0: not
        stored) and, for a packed batch (:attr:`arrays` ends with them), cu_q and cu_k;
        ``workspace`` is unused."""
        params = ctypes.create_string_buffer(self._template, _HOPPER_PARAMS.size)
        struct.pack_into("<Q", params, 0, ptrs[5])
        struct.pack_into("<Q", params, 32, ptrs[6])
        if len(ptrs) > 7:
            struct.pack_into("<QQ", params, _HOPPER_PARAMS.size - 16, ptrs[7], ptrs[8])
        maps, keep = self._maps.addresses(ptrs[:5])
        args = (ctypes.c_void_p * 6)(*maps, ctypes.addressof(params))
        _launch_all(self.device, self._steps, stream, ctypes.addressof(args))
        del keep  # the launch has copied the maps


def backward_launches(problem, strides, *, deterministic: bool = False):
    """Prepare the backward of ``problem``.

    ``strides``: element strides of q1, k1, q2, k2, v, o, dout, dq1, dk1, dq2, dk2, dv;
    lse and delta are contiguous float32 (B, H, M) arrays (delta is scratch). dk/dv of a
    grouped-query problem are summed over the query heads of each group in the kernel.
    With ``M == 0`` the dk/dv kernel still runs and writes zeros.

    On a compute capability 9.0 GPU the Hopper backward (:class:`HopperBackward`) runs when
    :func:`use_hopper_backward` says so; otherwise the mma.sync kernels: the one-kernel
    backward (:func:`fused_backward_steps`: dQ by float32 atomics) where
    :func:`use_fused_backward` says so (float16/bfloat16 variants with a ``bwd_grid`` or
    ``bwd_fused`` table entry: :func:`_one_kernel_phase`), else the delta pre-pass, dq and
    dk/dv kernels, which are bitwise reproducible. ``deterministic`` makes the Hopper path
    reproducible too (dQ by the mma.sync dq kernel instead of float32 atomics).
    """
    _check_grid(problem)
    _driver()
    names = ("q1", "k1", "q2", "k2", "v", "o", "dout", "dq1", "dk1", "dq2", "dk2", "dv")
    views = dict(zip(names, map(tuple, strides)))
    if use_hopper_backward(problem) and _tma_describable(problem, strides[:5], strides[6]):
        return HopperBackward(problem, views, deterministic)
    if use_fused_backward(problem, deterministic):
        rows = problem.B * problem.H * problem.M
        steps, acc_bytes = fused_backward_steps(problem, rows), 4 * rows * problem.D
        return Launches(problem.device, BACKWARD_ARRAYS, views, steps, _pack(problem, views),
                        workspace_bytes=2 * acc_bytes, ws_offset=acc_bytes)
    steps = []
    if problem.M > 0:
        steps += _mma_dq_steps(problem)
    if problem.N > 0:
        dkv = plan(problem, "bwd_dkv")
        steps.append(_step(problem, dkv, (math.ceil(problem.N / dkv.tiles.block_n), problem.Hkv,
                                          problem.B)))
    return Launches(problem.device, BACKWARD_ARRAYS, views, steps, _pack(problem, views))


def use_fused_backward(problem, deterministic: bool, varlen: bool = False) -> bool:
    """True when ``problem``'s mma.sync backward is the one-kernel scheme (phase
    ``bwd_grid`` or ``bwd_fused``): not ``deterministic``, query rows (with none there is no
    dQ, and the dk/dv kernel alone writes the zeros), and a ``bwd_grid`` or ``bwd_fused`` tile
    for the variant (:func:`capability.grid_backward_tiles`,
    :func:`capability.fused_backward_tiles`: float16/bfloat16, where the table has one)."""
    if deterministic or problem.M == 0 or problem.dtype not in capability.HALF_DTYPES:
        return False
    return _one_kernel_phase(problem, varlen) is not None


def _one_kernel_phase(problem, varlen: bool = False) -> str | None:
    """The one-kernel backward's main phase for ``problem``: ``bwd_grid`` where
    :func:`capability.grid_backward_tiles` has tiles, else ``bwd_fused`` where
    :func:`capability.fused_backward_tiles` has, else None."""
    args = (_compute_capability(problem.device), problem.D, problem.dtype, problem.causal)
    if capability.grid_backward_tiles(*args, varlen=varlen) is not None:
        return "bwd_grid"
    if capability.fused_backward_tiles(*args, varlen=varlen) is not None:
        return "bwd_fused"
    return None


def fused_backward_steps(problem, rows: int, varlen: bool = False) -> list:
    """The launches of the one-kernel mma.sync backward over ``rows`` query rows (``B * H *
    M``, or ``H * total_q`` for a packed batch, which the row kernels see as batch 1):

    1. ``bwd_delta``: delta, and zeroes both float32 dQ accumulators (``Params.dq_acc1``,
       ``dq_acc2``: the workspace, two (rows, D) float32 arrays, set by :meth:`Launches.run`);
    2. ``bwd_grid`` or ``bwd_fused`` (:func:`_one_kernel_phase`; when there are keys): one
       block per (key tile, kv head, batch entry or sequence) writes dk1, dk2, dv and adds
       dQ1, dQ2 to the accumulators;
    3. ``bwd_dq_convert``: dq1, dq2 = sm_scale x the accumulators, in the input dtype.
    """
    batch = 1 if varlen else problem.B
    per_batch = rows // batch
    helper = (math.ceil(per_batch / 8), batch, 1)
    steps = [_step(problem, plan(problem, "bwd_delta"), helper)]
    if problem.N > 0:
        main = plan(problem, _one_kernel_phase(problem, varlen) or "bwd_fused", varlen=varlen)
        steps.append(_step(problem, main, (math.ceil(problem.N / main.tiles.block_n),
                                           problem.Hkv, problem.B)))
    steps.append(_step(problem, plan(problem, "bwd_dq_convert"), helper))
    return steps


def _mma_dq_steps(problem) -> list:
    """The mma.sync delta pre-pass and dq kernel of ``problem`` (``M > 0``)."""
    dq = plan(problem, "bwd_dq")
    return [_step(problem, plan(problem, "bwd_delta"),
                  (math.ceil(problem.H * problem.M / 8), problem.B, 1)),
            _step(problem, dq, (math.ceil(problem.M / dq.tiles.block_m), problem.H, problem.B))]


def use_hopper_backward(problem) -> bool:
    """True when ``problem``'s backward runs the Hopper kernels (wgmma + TMA, sm_90a): a
    compute capability 9.0 GPU, float16/bfloat16, a head dim in
    :data:`capability.HOPPER_BWD_HEAD_DIMS`, queries and keys, and no ``CUPY_PIECEWISE_PATH=mma``.
    (The caller also needs strides a tensor map can describe: :func:`_tma_describable`.)"""
    if (problem.D not in capability.HOPPER_BWD_HEAD_DIMS or not (problem.M and problem.N)
            or problem.dtype not in ("float16", "bfloat16")):
        return False
    return (_compute_capability(problem.device) == (9, 0)
            and capability.path_override() != "mma")


#: Parameter structs of kernels_cu/sm90/backward.cu (pw90::bwd): PrepParams (o and dout
#: views, lse, lse2, delta, dq accumulator, B, H, M, Mpad, dlse, rows, cu_q), BwdParams (dk1,
#: dk2, dv views, dq accumulator, lse2, delta, B, H, group, M, N, Mpad, w, shift, scale_log2,
#: sm_scale, cu_q, cu_k) and ConvertParams (dq1, dq2 views, accumulator, B, H, M, Mpad,
#: sm_scale, rows, cu_q).
_BWD_PREP = struct.Struct("<Qqqq Qqqq QQQQ qqqq Q qQ")
_BWD_MAIN = struct.Struct("<Qqqq Qqqq Qqqq QQQ qqqqqqqq ff QQ")
_BWD_CONV = struct.Struct("<Qqqq Qqqq Q qqqq f4x qQ")


class HopperBackward:
    """The Hopper backward of one signature, with :class:`Launches`' interface.

    Launches, on one stream: ``pw90_bwd_prep`` (delta = rowsum(dO * O), lse in base 2,
    padded to whole 64-row tiles, and a zeroed float32 dQ accumulator), ``pw90_bwd`` (one
    block per 128-key tile: dK1, dK2, dV in registers, dQ added to the accumulator with
    float32 atomics) and ``pw90_bwd_dq_convert`` (accumulator -> dq1, dq2). Deterministic:
    the mma.sync delta and dq kernels compute dq1, dq2 without atomics and ``pw90_bwd``
    computes only dK1, dK2, dV.

    Its workspace (``workspace_bytes``, passed to :meth:`run`): lse2 and delta of
    (B, H, Mpad) float32, then (fused dQ only) the (2, B, H, Mpad, Dc) float32 accumulator,
    Dc the kernel's compute head dim (:func:`capability.hopper_compute_dim`: 128 for 80 and
    96); a packed batch has B = 1 and Mpad its padded total (below).
    Tensor maps of q1, q2, dout (64-row boxes) and k1, k2, v (128-row boxes) are cached per
    pointer tuple like :class:`HopperLaunches`'.

    ``packed`` (a :class:`cupy_piecewise.varlen_launch.VarlenShape`): a packed batch of
    ``problem.B`` sequences, the longest ``problem.M`` / ``problem.N`` rows, ``views`` those
    of the (total, heads, D) arrays with batch stride 0. The kernels are the VARLEN builds:
    tensor maps over the packed arrays as one batch, grids over (tile of the longest
    sequence, head, sequence), statistics in FlashAttention-3's padded layout ((H, Mpad)
    with Mpad = total_q + 64 B rounded up to 64: each sequence's rows start at a multiple
    of 64), and
    :meth:`run` takes cu_q and cu_k after the dense pointers. ``mma`` then gives the packed
    mma.sync delta + dq launches of the deterministic mode.
    """

    __slots__ = ("device", "arrays", "strides", "workspace_bytes", "dq_accumulator_bytes",
                 "deterministic", "_steps", "_mma", "_prep", "_main", "_conv", "_offsets", "_maps")

    def __init__(self, problem, views, deterministic: bool = False, *, packed=None, mma=None):
        p = problem
        bm, bn = capability.HOPPER_BWD_BLOCK_M, capability.HOPPER_BWD_BLOCK_N
        self.device = p.device
        self.strides = views
        self.deterministic = bool(deterministic)
        varlen = packed is not None
        rows_q = math.ceil(p.M / bm) * bm  # padded query rows of one (batch entry, head)
        if varlen:
            self.arrays = BACKWARD_ARRAYS + ("cu_q", "cu_k")
            # the kernels see one batch entry of the packed rows; w clamped for those
            dims = replace(p, B=1, M=packed.total_q, N=packed.total_k, shift=None)
            # a multiple of 64 rows: each head's statistics start 256-byte aligned (the
            # kernel's 1-D bulk copies need 16 bytes)
            mpad = math.ceil((packed.total_q + bm * p.B) / bm) * bm
        else:
            self.arrays = BACKWARD_ARRAYS
            dims, mpad = p, rows_q
        rows = dims.B * p.H * mpad
        self._offsets = (0, 4 * rows, 8 * rows)  # lse2, delta, dq accumulator
        # the dQ accumulator has the kernel's compute head dim of columns (80, 96: 128)
        dq_cols = capability.hopper_compute_dim(p.D)
        #: bytes of the float32 dQ accumulator (0: deterministic, dQ computed without one);
        #: a caller may hold it across calls (:meth:`run`'s ``dq_accumulator``)
        self.dq_accumulator_bytes = 0 if deterministic else 2 * 4 * rows * dq_cols
        self.workspace_bytes = 8 * rows + self.dq_accumulator_bytes
        prep = Variant("bwd_sm90_prep", p.dtype, p.D, None, False, varlen)
        main = Variant("bwd_sm90_det" if deterministic else "bwd_sm90", p.dtype, p.D, None,
                       p.causal, varlen)
        steps = [_step(p, prep, capability.hopper_bwd_helper_grid(p.H, rows_q, p.B)),
                 _step(p, main, (math.ceil(p.N / bn), p.Hkv, p.B))]
        if not deterministic:
            conv = Variant("bwd_sm90_dq", p.dtype, p.D, None, False, varlen)
            steps.append(_step(p, conv, capability.hopper_bwd_helper_grid(p.H, p.M, p.B)))
        self._steps = tuple(steps)
        # the mma.sync delta + dq kernels (deterministic dQ), sharing the call's Params block
        if deterministic and mma is None:
            mma = Launches(p.device, BACKWARD_ARRAYS, views, _mma_dq_steps(p), _pack(p, views))
        self._mma = mma if deterministic else None
        so, sd = views["o"], views["dout"]
        self._prep = _BWD_PREP.pack(0, *so[:3], 0, *sd[:3], 0, 0, 0, 0, dims.B, p.H, dims.M, mpad,
                                    0, rows_q, 0)
        dk1, dk2, dv = views["dk1"], views["dk2"], views["dv"]
        P, w = _clamped(dims)
        self._main = _BWD_MAIN.pack(0, *dk1[:3], 0, *dk2[:3], 0, *dv[:3], 0, 0, 0, dims.B, p.H,
                                    p.H // p.Hkv, dims.M, dims.N, mpad, w, P, p.sm_scale * _LOG2E,
                                    p.sm_scale, 0, 0)
        dq1, dq2 = views["dq1"], views["dq2"]
        self._conv = _BWD_CONV.pack(0, *dq1[:3], 0, *dq2[:3], 0, dims.B, p.H, dims.M, mpad,
                                    p.sm_scale, p.M, 0)
        q_shape = (dims.B, p.H, dims.M, p.D)
        k_shape = (dims.B, p.Hkv, dims.N, p.D)
        names = ("q1", "q2", "dout", "k1", "k2", "v")
        self._maps = _TensorMaps((q_shape,) * 3 + (k_shape,) * 3, [views[n] for n in names],
                                 (bm,) * 3 + (bn,) * 3, p.dtype)

    def run(self, ptrs, stream: int, workspace: int = 0, dq_accumulator: int = 0,
            statistics_ready: bool = False) -> None:
        """Launch on ``stream`` with the pointers of :attr:`arrays` (q1, k1, q2, k2, v, o,
        lse, dout, dq1, dk1, dq2, dk2, dv, delta, dlse, and cu_q, cu_k for a packed batch;
        dlse 0: none) and ``workspace`` (device pointer to :attr:`workspace_bytes` bytes,
        valid on ``stream`` until the work ends).

        ``dq_accumulator`` (not deterministic only): device pointer of a caller's float32
        dQ accumulator of :attr:`dq_accumulator_bytes` bytes, zeroed by the caller before
        its first call. This call then adds its dQ into it unscaled, in the kernel's order,
        leaves dq1 and dq2 unwritten, and uses only the first ``workspace_bytes -
        dq_accumulator_bytes`` bytes of workspace (lse2, delta); :meth:`convert` turns the sum into dq1
        and dq2. Calls that share one accumulator must have the same query rows and
        ``sm_scale`` (the keys may differ: context parallelism sums over key blocks).
        ``statistics_ready``: ``workspace`` already holds these rows' lse2 and delta (an
        earlier call with the same rows, o, dO, lse and dlse wrote them): the pre-pass is
        skipped."""
        q1, k1, q2, k2, v, o, lse, do, dq1, dk1, dq2, dk2, dv, delta, dlse = ptrs[:15]
        cu_q, cu_k = ptrs[15:17] if len(ptrs) > 15 else (0, 0)
        if dq_accumulator and self.deterministic:
            raise ValueError("the deterministic Hopper backward has no dQ accumulator")
        if self._mma is not None:
            self._mma.run(ptrs, stream)
        maps, keep = self._maps.addresses((q1, q2, do, k1, k2, v))  # keep: until launched
        lse2, dlt = workspace + self._offsets[0], workspace + self._offsets[1]
        acc = dq_accumulator or (0 if self.deterministic else workspace + self._offsets[2])
        prep = ctypes.create_string_buffer(self._prep, _BWD_PREP.size)
        struct.pack_into("<Q", prep, 0, o)
        struct.pack_into("<Q", prep, 32, do)
        # a caller's accumulator keeps its sum: the pre-pass zeroes only the call's own
        struct.pack_into("<QQQQ", prep, 64, lse, lse2, dlt, 0 if dq_accumulator else acc)
        struct.pack_into("<Q", prep, 128, dlse)
        struct.pack_into("<Q", prep, 144, cu_q)
        main = ctypes.create_string_buffer(self._main, _BWD_MAIN.size)
        for off, ptr in ((0, dk1), (32, dk2), (64, dv)):
            struct.pack_into("<Q", main, off, ptr)
        struct.pack_into("<QQQ", main, 96, acc, lse2, dlt)
        struct.pack_into("<QQ", main, 192, cu_q, cu_k)
        a_prep = (ctypes.c_void_p * 1)(ctypes.addressof(prep))
        a_main = (ctypes.c_void_p * 7)(*maps, ctypes.addressof(main))
        if not statistics_ready:
            _launch_all(self.device, self._steps[:1], stream, ctypes.addressof(a_prep))
        _launch_all(self.device, self._steps[1:2], stream, ctypes.addressof(a_main))
        if not (self.deterministic or dq_accumulator):
            self.convert(dq1, dq2, acc, stream, cu_q)
        del keep

    def convert(self, dq1: int, dq2: int, dq_accumulator: int, stream: int, cu_q: int = 0) -> None:
        """Launch ``pw90_bwd_dq_convert`` on ``stream``: dq1, dq2 (this signature's views) =
        ``sm_scale`` x the float32 accumulator at ``dq_accumulator``, in the input dtype."""
        conv = ctypes.create_string_buffer(self._conv, _BWD_CONV.size)
        struct.pack_into("<Q", conv, 0, dq1)
        struct.pack_into("<Q", conv, 32, dq2)
        struct.pack_into("<Q", conv, 64, dq_accumulator)
        struct.pack_into("<Q", conv, 120, cu_q)
        a_conv = (ctypes.c_void_p * 1)(ctypes.addressof(conv))
        _launch_all(self.device, self._steps[2:], stream, ctypes.addressof(a_conv))


_launches: dict[tuple, Launches] = {}
_LAUNCHES_MAX = 4096


def _cached(kind, problem, refs, extra):
    """Launches for (kind, problem, strides), memoised; the tile override is part of the key."""
    strides = tuple(tuple(r.strides) for r in refs)
    key = (kind, problem, strides, extra, capability.plan_switches())
    hit = _launches.get(key)
    if hit is None:
        hit = (forward_launches(problem, strides, split=extra) if kind == "fwd"
               else backward_launches(problem, strides, deterministic=extra))
        if len(_launches) >= _LAUNCHES_MAX:
            _launches.clear()
        _launches[key] = hit
    return hit


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
    launches = _cached("fwd", problem, (q1, k1, q2, k2, v, o), workspace is not None)
    keep, ws = (None, 0) if not launches.workspace_bytes else workspace(launches.workspace_bytes)
    launches.run((q1.ptr, k1.ptr, q2.ptr, k2.ptr, v.ptr, o.ptr, lse), stream, ws)
    del keep  # stream-ordered allocators may reuse it for work queued after this point


def backward(problem, q1, k1, q2, k2, v, o, lse, do, dq1, dk1, dq2, dk2, dv, delta, *,
             stream: int, workspace=None, deterministic: bool = False, dlse: int = 0,
             dq_accumulator: int = 0, statistics: int = 0, statistics_ready: bool = False) -> None:
    """Launch the backward kernels: writes every element of the five gradients.

    Args: as :func:`forward`, plus ``do`` (ArrayRef, (B, H, M, D)), the gradient outputs
    ``dq1``, ``dq2`` ((B, H, M, D)) and ``dk1``, ``dk2``, ``dv`` ((B, Hkv, N, D)) as
    ArrayRef in the input dtype, ``lse`` and ``delta`` as pointers of contiguous float32
    (B, H, M) arrays (``delta`` is scratch). dk/dv of a grouped-query problem are summed
    over the query heads of each group in the kernel. ``workspace``: ``nbytes ->
    (keepalive, device pointer)`` on the caller's stream, required by the Hopper backward
    and the one-kernel mma.sync backward (:func:`use_fused_backward`). ``deterministic``:
    bitwise-reproducible gradients (see :func:`backward_launches`). ``dlse``: pointer of a
    contiguous float32 (B, H, M) gradient of ``lse`` (0: none), subtracted from delta by the
    pre-pass.
    ``dq_accumulator``, ``statistics``: pointers of a caller's float32 dQ accumulator and
    statistics buffer (:func:`backward_shared_bytes`; 0: none); the call then adds its dQ
    into the accumulator and leaves dq1, dq2 unwritten, and keeps lse2 and delta in
    ``statistics``, computing them unless ``statistics_ready`` (:meth:`HopperBackward.run`,
    :func:`backward_dq_convert`). Raises ValueError when the call's path has none.
    """
    views = (q1, k1, q2, k2, v, o, do, dq1, dk1, dq2, dk2, dv)
    launches = _cached("bwd", problem, views, bool(deterministic))
    keep, ws = None, 0
    ptrs = (q1.ptr, k1.ptr, q2.ptr, k2.ptr, v.ptr, o.ptr, lse, do.ptr,
            dq1.ptr, dk1.ptr, dq2.ptr, dk2.ptr, dv.ptr, delta, dlse)
    if dq_accumulator:
        if not (getattr(launches, "dq_accumulator_bytes", 0) and statistics):
            raise ValueError("dq_accumulator: this backward path has no float32 dQ accumulator "
                             "(backward_shared_bytes is 0), or no statistics buffer was given")
        launches.run(ptrs, stream, statistics, dq_accumulator=dq_accumulator,
                     statistics_ready=statistics_ready)
        return
    if launches.workspace_bytes:
        if workspace is None:
            raise ValueError("this backward (Hopper, or the fused mma.sync one) needs a "
                             "workspace allocator")
        keep, ws = workspace(launches.workspace_bytes)
    launches.run(ptrs, stream, ws)
    del keep


def backward_shared_bytes(problem, strides) -> tuple:
    """``(accumulator bytes, statistics bytes)``: the float32 dQ accumulator and lse2/delta
    buffer that :func:`backward` calls of ``problem`` (element ``strides`` of q1, k1, q2,
    k2, v, o, dout, dq1, dk1, dq2, dk2, dv; not deterministic) over the same query rows can
    share, or ``(0, 0)`` when its path has none (the mma.sync kernels). Context parallelism
    sums dQ over key blocks there instead of in rounded per-block outputs."""
    launches = _cached("bwd", problem, [ArrayRef(0, s) for s in strides], False)
    acc = getattr(launches, "dq_accumulator_bytes", 0)
    return (acc, launches.workspace_bytes - acc) if acc else (0, 0)


def backward_dq_convert(problem, strides, dq_accumulator: int, dq1, dq2, *, stream: int) -> None:
    """dq1, dq2 (ArrayRef, (B, H, M, D), input dtype) = ``sm_scale`` x the float32 dQ
    accumulator at ``dq_accumulator`` that :func:`backward` calls of ``problem`` (same
    ``strides``; dq1/dq2 strides as given here) added into. Raises ValueError when the
    path has no accumulator."""
    launches = _cached("bwd", problem, [ArrayRef(0, s) for s in strides], False)
    if not getattr(launches, "dq_accumulator_bytes", 0):
        raise ValueError("backward_dq_convert: this backward path has no float32 dQ accumulator")
    launches.convert(dq1.ptr, dq2.ptr, dq_accumulator, stream)
