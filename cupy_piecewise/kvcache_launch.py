"""Launching the KV-cache kernels (``kernels_cu/kvcache.cu``, ``kernels_cu/sm90/kvdecode.cu``)
on raw device pointers.

A call is up to three launches on one stream: ``pw_kvcache_append`` (when new keys are
given) writes them into the cache, ``pw_kvcache`` attends, and, when the keys are split
across blocks, ``pw_forward_combine`` (the forward's own merge kernel) merges the splits by
their log-sum-exp. On an H200 (compute capability 9.0) a decode step (M = 1, head dim 64 or
128) runs ``pw90_kvdecode`` instead, which streams the keys by TMA (tensor maps of the three
caches, built per cache pointer and cached) and, with 2 to ``capability.KV90_MAX_CLUSTER``
(4) splits, merges them inside one thread-block cluster: no combine launch. That decode and the
combine after it are programmatic dependent launches (``capability.KV90_PDL_DECODE``,
``KV90_PDL``; :func:`cuda_driver.launch_programmatic`): each may start before the kernel
ahead of it completes and waits for it before touching global memory. Nothing here
reads the cached lengths: the grid and the number of splits come from shapes only, so a
decode step captures in a CUDA graph and replays with new lengths.

Arguments travel as one packed struct per kernel family (``KVParams`` in kvparams.cuh,
mirrored by :data:`KV_FIELDS`; ``Params`` of params.cuh for the merge), after the tensor maps
for ``pw90_kvdecode``.
"""
from __future__ import annotations

import ctypes
import math
import struct
from typing import NamedTuple

from . import capability, launch
from .compile import Variant
from .core.memo import Memo

__all__ = ["KV_FIELDS", "KVPlan", "plan", "split_count", "staged_tables"]

#: ``KVParams`` field by field (all 8 bytes; the last holds two float32).
KV_FIELDS = tuple(f"{t}.{f}" for t in ("q1", "q2", "o") for f in ("ptr", "sb", "sh", "sr")) + \
    tuple(f"{t}.{f}" for t in ("k1", "k2", "v") for f in ("ptr", "sp", "sh", "sr")) + \
    tuple(f"{t}.{f}" for t in ("k1n", "k2n", "vn") for f in ("ptr", "sb", "sh", "sr")) + (
        "seqlens", "block_table", "bt_stride", "block_size", "lse", "o_part", "lse_part",
        "H", "group", "M", "capacity", "w", "nsplit", "scale_log2|sm_scale", "rot_cos",
        "rot_sin", "rot_group1", "rot_group2")
_KV_SLOT = {name: i for i, name in enumerate(KV_FIELDS)}
_KV_PACK = struct.Struct(f"<{len(KV_FIELDS)}q")
_LOG2E = 1.4426950408889634
#: the arrays a call passes, in the order :meth:`KVPlan.run` takes their pointers
POINTERS = ("q1", "q2", "o", "k1", "k2", "v", "k1n", "k2n", "vn", "seqlens", "block_table",
            "lse", "rot_cos", "rot_sin")
#: pointers that are a KVParams field of their own (the others are a view's ``.ptr``)
_BARE_POINTERS = ("seqlens", "block_table", "lse", "rot_cos", "rot_sin")
#: most key splits of one call (the merge kernel loops over them per row)
MAX_SPLITS = 64
#: resident blocks per SM the split count aims to fill (shared memory permitting)
_MAX_BLOCKS_PER_SM = 4


class KVShape(NamedTuple):
    """Everything about a KV-cache call except its pointers: the plan cache's key.

    ``strides`` maps q1, q2, o, k1n, k2n, vn to (batch, head, row) element strides and k1,
    k2, v to (page, head, row) strides (page = batch for a contiguous cache)."""

    device: int
    dtype: str
    B: int
    H: int
    Hkv: int
    M: int
    D: int
    capacity: int  # keys a sequence can hold
    pages: int  # the caches' dim 0: pages of a paged cache, B for a contiguous one
    block_size: int  # rows per page; 0 for a contiguous cache
    bt_stride: int  # block_table row stride (elements); 0 for a contiguous cache
    appended: bool
    causal: bool
    w: int  # clamped to +-(capacity + M + 1): 32-bit in the kernel, same comparisons
    sm_scale: float
    strides: tuple  # ((name, (s0, s1, s2)), ...) in POINTERS order, absent arrays left out
    #: rotary inside the kernel (attention_with_rotary_kvcache): 0 for none, else a
    #: compile.ROTARY_LAYOUTS value (k1 and k2 then name one cache of raw keys), and each
    #: projection's position divisor (0: not rotated)
    rotary: int = 0
    rot_groups: tuple = (0, 0)


def use_hopper_decode(shape: KVShape, cc) -> bool:
    """True when ``shape`` runs the Hopper decode kernel (``kernels_cu/sm90/kvdecode.cu``: TMA
    loads from a producer warp): compute capability 9.0, one new token (M = 1), a head dim
    in :data:`capability.KV90_HEAD_DIMS`, no ``CUPY_PIECEWISE_PATH=mma``, and caches whose
    strides a tensor map describes (positive multiples of 16 bytes on every axis longer than
    1; a broadcast axis is not one). Everything else runs the cp.async kernel. Both kernels
    have rotary-inside forms."""
    if (tuple(cc) != (9, 0) or shape.M != 1 or shape.D not in capability.KV90_HEAD_DIMS
            or capability.path_override() == "mma"):
        return False
    dims = (shape.pages, shape.Hkv, shape.block_size or shape.capacity)
    strides = dict(shape.strides)
    return all(n == 1 or (0 < st < (1 << 39) and st % 8 == 0) for name in ("k1", "k2", "v")
               for n, st in zip(dims, strides[name]))


def split_count(shape: KVShape, tiles, smem: int, sms: int, smem_per_sm: int,
                min_tiles: int = 1) -> int:
    """Key splits per (sequence, key head, query tile) from shapes only: as many as fill the
    GPU's resident blocks once (``sms`` times the blocks one SM holds: ``smem_per_sm``
    bytes of shared memory over the block's ``smem`` plus 1 KB the driver reserves, at most
    4), never so many that a split of a full cache gets fewer than ``min_tiles`` key tiles
    (a block's pipeline start and its partial output are paid per split), at most
    :data:`MAX_SPLITS`."""
    rows = shape.M * (shape.H // shape.Hkv)
    blocks = shape.B * shape.Hkv * math.ceil(rows / tiles.block_m)
    per_sm = max(1, min(_MAX_BLOCKS_PER_SM, smem_per_sm // (smem + 1024)))
    want = (sms * per_sm) // max(blocks, 1)
    most = math.ceil(shape.capacity / tiles.block_n) // max(1, min_tiles)
    return max(1, min(want, most, MAX_SPLITS))


def kv90_row_box(shape: KVShape, cluster: int = 1):
    """The Hopper decode's box for ``shape``'s k1, k2 and v maps when its key splits merge
    in clusters of ``cluster`` blocks: 16 rows (an int), or ``(16, D // 64)``, 16 whole rows
    of ``D // 64`` panels in one 5-d box, for the plain decode (no rotary) at head dims above
    64 under ``capability.KV90_ROW_BOX`` 1, and under 2 only where ``cluster`` is 1; never
    in a tile-box build (``capability.KV90_TILE_BOX``). The kernel's rule is ROW_BOX in
    kernels_cu/sm90/kvdecode.cu."""
    mode = 0 if capability.KV90_TILE_BOX else capability.KV90_ROW_BOX
    if (mode == 1 or (mode == 2 and cluster == 1)) and not shape.rotary and shape.D > 64:
        return (16, shape.D // 64)
    return 16


def staged_tables(shape: KVShape, nsplit: int) -> bool:
    """Whether the Hopper rotary decode of ``shape`` takes the staged-table form (the
    kernel's TAB, asked for by name): with :data:`capability.KV90_ROT_STAGE_UNSPLIT`, for
    the rotary forms whose default-form plan runs ``nsplit`` = 1 key split. The staged form's
    larger ring would fit fewer blocks per SM, which lowers :func:`split_count` for that
    shape no further than 1, so the split plan stays the one computed for the default form.
    Under :data:`capability.KV90_ROT_STAGE` every rotary form is staged anyway (the
    kernel's default)."""
    return bool(shape.rotary) and capability.KV90_ROT_STAGE_UNSPLIT and nsplit == 1 and (
        not capability.KV90_ROT_STAGE)


def kv90_tile_box(shape: KVShape, mode: int = 1) -> bool:
    """Whether the Hopper decode built with ``-DKV90_TILE_BOX=<mode>`` loads ``shape``'s key
    tiles that do not straddle d = w as whole 64-row boxes: where every 64-key tile lies in
    one page (a contiguous cache of at least 64 rows, or pages of a multiple of 64 rows), and
    with ``mode`` 2 only at head dim 128 or from a paged cache. The kernel decides by the
    same rule (``wide_ok``, kernels_cu/sm90/kvdecode.cu)."""
    if mode == 2 and not (shape.D == 128 or shape.block_size):
        return False
    return (shape.block_size % 64 == 0) if shape.block_size else shape.capacity >= 64


def page_box(shape: KVShape) -> bool:
    """Whether the Hopper decode of ``shape`` runs its paged D = 64 entry,
    ``pw90_kvdecode_pages`` (``Variant.page_box``): the plain decode (no rotary) at head dim
    64 of a cache paged in multiples of 64 rows, under :data:`capability.KV90_PAGE_BOX` and
    outside a tile-box A/B build (whose own kernel loads pages whole already). That entry
    takes six maps, the last three of 64-row boxes, and loads each tile that lies on one side
    of d = w as one box per operand (kernels_cu/sm90/kvdecode.cu)."""
    return (capability.KV90_PAGE_BOX and not capability.KV90_TILE_BOX and not shape.rotary
            and shape.D == 64 and bool(shape.block_size) and shape.block_size % 64 == 0)


class KVPlan:
    """The launches of one KV-cache call signature (:class:`KVShape`), prepared once;
    :meth:`run` writes the pointers and launches. Immutable: safe from several threads."""

    __slots__ = ("shape", "nsplit", "cluster", "workspace_bytes", "_append", "_steps",
                 "_combine", "_template", "_combine_template", "_ws_offset", "_maps",
                 "_map_sets", "programmatic")

    def __init__(self, shape: KVShape):
        self.shape = s = shape
        cc = launch._compute_capability(s.device)
        self._maps = None
        self._map_sets = 1  # k1, k2, v's maps once; twice under KV90_TILE_BOX or page_box
        self.cluster = 1
        #: (decode, merge): programmatic dependent launches (capability.KV90_PDL*)
        self.programmatic = (False, False)
        arch = capability.resolve_arch(cc)
        # an SM holds its per-block limit plus the 1 KB reserved per block
        per_sm = capability.SHARED_LIMIT.get(cc, capability.SHARED_LIMIT[arch]) + 1024
        sms = launch._multiprocessors(s.device)
        if use_hopper_decode(s, cc):  # TMA boxes of 16 keys x 64 columns, 64-key tiles
            tiles = capability.kv90_tiles(s.D)
            smem90 = capability.kv90_shared_bytes(s.D, tiles.stages, bool(s.rotary))
            self.nsplit = split_count(s, tiles, smem90, sms, per_sm, capability.KV90_MIN_TILES[s.D])
            staged = staged_tables(s, self.nsplit)
            # up to a cluster's worth of splits merge on chip, without pw_forward_combine
            if self.nsplit <= capability.KV90_MAX_CLUSTER:  # built for KV90_CLUSTERS
                self.cluster = self.nsplit
            pages = page_box(s)
            main = Variant("kvdecode_sm90", s.dtype, s.D, tiles, False, cluster=self.cluster,
                           rotary=s.rotary, rot_stage=staged, page_box=pages)
            fn, smem = launch._kernel(s.device, main)
            dims = (s.pages, s.Hkv, s.block_size or s.capacity, s.D)
            st = dict(s.strides)
            strides = [st[n] + (1,) for n in ("k1", "k2", "v")]
            boxes = (kv90_row_box(s, self.cluster),) * 3
            # three more maps (kvdecode.cu): the tile-box A/B build's, or the paged entry's
            # 64-row maps (a page's tile per box)
            wide = None
            if capability.KV90_TILE_BOX and not s.rotary:
                wide = 64 if kv90_tile_box(s, capability.KV90_TILE_BOX) else 16
            elif pages:
                wide = 64
            if wide is not None:
                self._map_sets = 2
                strides = strides * 2
                boxes += (wide,) * 3
            self._maps = launch._TensorMaps([dims] * len(boxes), strides, boxes, s.dtype)
        else:
            # one new token: every key has one distance, so one key slot per stage (kvdecode)
            phase = "kvdecode" if s.M == 1 else "kvcache"
            tiles = capability.lookup(cc, phase, s.D, s.dtype, s.causal)
            main = Variant(phase, s.dtype, s.D, tiles, s.causal, rotary=s.rotary)
            fn, smem = launch._kernel(s.device, main)
            self.nsplit = split_count(s, tiles, smem, sms, per_sm)
        G = s.H // s.Hkv
        rtiles = math.ceil(s.M * G / tiles.block_m)
        if s.B > launch._MAX_GRID_YZ:
            raise ValueError(f"q1: batch ({s.B}) must be at most {launch._MAX_GRID_YZ} for the "
                             "CUDA kernels")
        self._append = ()
        if s.appended:
            afn, _ = launch._kernel(s.device, Variant("kv_append", s.dtype, s.D, None, False))
            self._append = ((afn, math.ceil(s.M * 3 * (s.D // 8) / 256), s.Hkv, s.B, 256, 0),)
        self._steps = ()
        if rtiles:  # no query heads (H = 0): the append alone
            # grid x: (key/value head, query tile); y: key split; z: sequence
            self._steps = ((fn, s.Hkv * rtiles, self.nsplit, s.B, main.threads, smem),)
        rows = s.B * s.H * s.M
        self._ws_offset = 4 * self.nsplit * rows * s.D
        merged_apart = self.nsplit > 1 and self.cluster == 1  # by pw_forward_combine
        self.workspace_bytes = (self._ws_offset + 4 * self.nsplit * rows
                                if merged_apart and rows else 0)
        self._combine = ()
        if merged_apart and rtiles:
            cfn, _ = launch._kernel(s.device, Variant("fwd_combine", s.dtype, s.D, None, False))
            self._combine = ((cfn, math.ceil(s.H * s.M / 8), s.B, 1, 256, 0),)

        if self._maps is not None:  # the Hopper decode: kernels_cu/sm90/kvdecode.cu waits
            from . import cuda_driver

            ok = cuda_driver.programmatic_available()  # else plain launches, same results
            self.programmatic = (ok and capability.KV90_PDL_DECODE,
                                 ok and bool(self._combine) and capability.KV90_PDL)
        slots = [0] * len(KV_FIELDS)
        for name, st in s.strides:
            base = _KV_SLOT[f"{name}.ptr"]
            slots[base + 1:base + 4] = st
        slots[_KV_SLOT["bt_stride"]] = s.bt_stride
        slots[_KV_SLOT["block_size"]] = s.block_size
        for name, value in (("H", s.H), ("group", G), ("M", s.M), ("capacity", s.capacity),
                            ("w", s.w), ("nsplit", self.nsplit),
                            ("rot_group1", s.rot_groups[0]), ("rot_group2", s.rot_groups[1])):
            slots[_KV_SLOT[name]] = value
        slots[_KV_SLOT["scale_log2|sm_scale"]] = struct.unpack(
            "<q", struct.pack("<ff", s.sm_scale * _LOG2E, s.sm_scale))[0]
        self._template = slots
        # the merge's Params: o's view, lse, H, M and the split partials (set per call)
        cslots = [0] * launch._NSLOTS
        ostr = dict(s.strides)["o"]
        cslots[launch._SLOT["o.sb"]:launch._SLOT["o.sb"] + 3] = ostr
        cslots[launch._SLOT["H"]] = s.H
        cslots[launch._SLOT["M"]] = s.M
        cslots[launch._SLOT["nsplit"]] = self.nsplit
        self._combine_template = cslots

    def run(self, ptrs: dict, stream: int, workspace: int = 0) -> None:
        """Launch on ``stream`` with the device pointers in ``ptrs`` (by name, see
        :data:`POINTERS`; absent or 0 = none) and a ``workspace`` of
        :attr:`workspace_bytes` bytes when that is non-zero."""
        slots = list(self._template)
        for name in POINTERS:
            p = ptrs.get(name, 0) or 0
            if name in _BARE_POINTERS:
                slots[_KV_SLOT[name]] = p
            else:
                slots[_KV_SLOT[f"{name}.ptr"]] = p
        if self.workspace_bytes:
            slots[_KV_SLOT["o_part"]] = workspace
            slots[_KV_SLOT["lse_part"]] = workspace + self._ws_offset
        block = _KV_PACK.pack(*slots)
        if self._append:
            _launch(self.shape.device, self._append, stream, block)
        if self._steps and self._maps is not None:  # tensor maps of k1, k2, v, then KVParams
            kv = (ptrs["k1"], ptrs["k2"], ptrs["v"])
            maps, keep = self._maps.addresses(kv * self._map_sets)
            _launch(self.shape.device, self._steps, stream, block, maps,
                    programmatic=self.programmatic[0])
            del keep  # the launch has copied the maps
        elif self._steps:
            _launch(self.shape.device, self._steps, stream, block)
        if self._combine:
            c = list(self._combine_template)
            c[launch._SLOT["o.ptr"]] = ptrs["o"]
            c[launch._SLOT["lse"]] = ptrs.get("lse", 0) or 0
            c[launch._SLOT["o_part"]] = workspace
            c[launch._SLOT["lse_part"]] = workspace + self._ws_offset
            _launch(self.shape.device, self._combine, stream, launch._PACKER.pack(*c),
                    programmatic=self.programmatic[1])


def _launch(device: int, steps, stream: int, block: bytes, maps=(), programmatic=False) -> None:
    """cuLaunchKernel of each step with the parameter struct ``block`` after the tensor maps
    at the host addresses ``maps`` (all copied by the driver before the call returns, so
    local buffers will do); ``programmatic``: as programmatic dependent launches
    (cuda_driver.launch_programmatic)."""
    buf = ctypes.create_string_buffer(block, len(block))
    args = (ctypes.c_void_p * (len(maps) + 1))(*maps, ctypes.addressof(buf))
    launch._launch_all(device, steps, stream, ctypes.addressof(args), programmatic)


#: Plans per (shape, tile override).
_plans = Memo(4096)


def plan(shape: KVShape) -> KVPlan:
    """The :class:`KVPlan` of ``shape`` (built once per signature and tile override; it
    reads ``capability.KV90_*``, programmatic launches included, when it is built)."""
    key = (shape, capability.plan_switches())
    hit = _plans.get(key)
    if hit is None:
        hit = _plans.put(key, KVPlan(shape))
    return hit
