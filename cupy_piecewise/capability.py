"""Tile sizes per GPU, as data.

The table maps (compute capability, phase, head dim) to a :class:`TileConfig`;
an entry may be refined by dtype and/or causal. Phases:

- ``fwd``: forward, one block per query tile; ``block_m`` query rows
  (16 per warp), ``block_n`` keys per step.
- ``fwd_decode``: the same forward kernel for M <= 16 query rows (decoding), one
  warp per block, with the keys split across blocks (split-KV) and the partial
  results merged by their log-sum-exp.
- ``bwd_dq``: backward for dq1/dq2, one block per query tile (16 query rows
  per warp).
- ``bwd_dkv``: backward for dk1/dk2/dv, one block per key tile; ``block_n``
  keys (16 per warp), ``block_m`` queries per step.
- ``bwd_fused``: the one-kernel backward (float16 and bfloat16 where it has an entry and
  ``bwd_grid`` has none; ``bwd_dq`` + ``bwd_dkv`` are the deterministic mode): the ``bwd_dkv`` kernel built to
  also add each tile's dQ to a float32 accumulator with atomics; same tile fields.
- ``bwd_grid``: the one-kernel backward on FlashAttention-2's 2-D warp grid
  (``pw_backward_grid``, float16/bfloat16, dense batches): ``block_n`` keys (32 per warp
  row, ``block_n == 16 * num_warps``, 4 or 8 warps), ``block_m`` = 64 queries per step;
  Pᵀ and dSᵀ pass through shared memory. Where the table has an entry it replaces
  ``bwd_fused`` (:func:`grid_backward_tiles`); the same delta and convert kernels run
  around it.
- ``kvcache``: attention against a key/value cache (:mod:`cupy_piecewise.kvcache`):
  ``block_m`` = 16 packed query rows (the heads of a group times the new tokens),
  ``block_n`` keys per tile (16 per warp), ``stages`` deep cp.async ring (2 to 4).
- ``kvdecode``: the same kernel for one new token per sequence (M = 1): one key slot per
  stage (each key's one projection), so a smaller ring.

Every entry satisfies, for its architecture (checked by the tests):

- ``block_m``, ``block_n`` in {16, 32, 64, 128};
- ``block_m`` (fwd, bwd_dq) or ``block_n`` (bwd_dkv, bwd_fused) is 16 or 32 times
  ``num_warps``: each warp owns one or two m16 row blocks of the tile (two blocks
  let each shared-memory fragment of the other operand feed twice the mma);
- :func:`shared_bytes` ``<=`` :data:`SHARED_LIMIT` of the architecture.

Fallback for a GPU whose compute capability is not listed: take the entry of
the nearest lower listed architecture whose tiles fit the GPU's shared-memory
limit per block (:data:`SHARED_LIMIT` if known there, else the ``max_shared``
argument, else the smallest listed limit, 99 KiB, to be safe), walking down the
listed architectures until one fits. A GPU below compute capability 8.0 is not
supported (the kernels use ``cp.async`` and bf16 ``mma.sync``): ValueError.

Override, for tuning: the ``override=`` argument of :func:`lookup`
(``{phase: TileConfig}``) or the environment variable ``CUPY_PIECEWISE_TILES``,
e.g. ``"fwd=128x64x8,bwd_dq=64x64x4"`` (``block_m x block_n x num_warps``, an
optional fourth field for stages, ``128x64x8x2``; see :data:`STAGES`). The argument wins over the
variable, the variable over the table. Overrides obey the same constraints;
a bad one raises ValueError naming ``CUPY_PIECEWISE_TILES``. The variable is read
once, at import: after changing it in a running process call
:func:`refresh_env_override`, or use :func:`set_tile_override`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

__all__ = [
    "TileConfig",
    "PHASES",
    "LISTED_ARCHS",
    "SHARED_LIMIT",
    "TABLE",
    "MACRO_TABLE",
    "ENV_VAR",
    "env_override",
    "refresh_env_override",
    "set_tile_override",
    "plan_switches",
    "PATH_VAR",
    "PERSIST_VAR",
    "persist_ctas",
    "KV_PHASES",
    "HALF_ONLY_PHASES",
    "fused_ds_bytes",
    "path_override",
    "HOPPER_HEAD_DIMS",
    "HOPPER_BWD_HEAD_DIMS",
    "hopper_head_dims",
    "hopper_compute_dim",
    "hopper_block_m",
    "hopper_fwd_threads",
    "hopper_shared_bytes",
    "hopper_bwd_shared_bytes",
    "hopper_bwd_helper_grid",
    "fwd_one_key_slot",
    "FWD_Q_ROTATE",
    "fwd_q_rotate",
    "apply_kernel_macros",
    "shared_bytes",
    "elem_bytes",
    "has_float32_kernels",
    "HALF_DTYPES",
    "TABLE_DTYPES",
    "TF32_TABLE",
    "check_config",
    "lookup",
    "selectable_configs",
    "fused_backward_tiles",
    "grid_backward_tiles",
    "grid_two_ds_buffers",
    "VARLEN_TABLE",
    "VARLEN_PHASES",
    "parse_override",
    "resolve_arch",
    "head_dims",
]


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes of one kernel variant: rows of the query tile, rows of the
    key tile, warps per block, and cp.async pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    stages: int = 2

    def __str__(self) -> str:  # the CUPY_PIECEWISE_TILES spelling
        return f"{self.block_m}x{self.block_n}x{self.num_warps}x{self.stages}"


PHASES = ("fwd", "fwd_decode", "bwd_dq", "bwd_dkv", "bwd_fused", "bwd_grid", "kvcache",
          "kvdecode")
#: the KV-cache kernel's phases (kernels_cu/kvcache.cu)
KV_PHASES = ("kvcache", "kvdecode")
#: phases built for float16 and bfloat16 only: the KV-cache kernels, and the one-kernel
#: backwards (float32 inputs take the deterministic two-kernel backward)
HALF_ONLY_PHASES = KV_PHASES + ("bwd_fused", "bwd_grid")
LISTED_ARCHS = ((8, 0), (8, 6), (8, 9), (9, 0))
ENV_VAR = "CUPY_PIECEWISE_TILES"

# The launch caches put the override's text in their keys, so it is read on every call and
# must cost nothing: the value is read from the environment once, at import, and again
# only when refresh_env_override() or set_tile_override() says so (a public os.environ
# read costs 0.3-0.7 us, 5% of a small call; the faster private routes were dropped).
_override = os.environ.get(ENV_VAR)


def env_override():
    """The value of ``CUPY_PIECEWISE_TILES`` in effect (``None`` when unset): the
    environment at import, or at the last :func:`refresh_env_override` /
    :func:`set_tile_override`. Costs one global read."""
    return _override


def refresh_env_override():
    """Re-read ``CUPY_PIECEWISE_TILES`` (and ``CUPY_PIECEWISE_PATH``,
    ``CUPY_PIECEWISE_PERSIST_CTAS``) from ``os.environ`` after changing them in this process,
    and return the tile override. Later calls plan with it (plans are cached per value)."""
    global _override, _path, _persist, _switches
    _override = os.environ.get(ENV_VAR)
    _path = os.environ.get(PATH_VAR)
    _persist = os.environ.get(PERSIST_VAR)
    _switches = (_override, _path, _persist)
    return _override


#: Kernel path switch (README, "Kernel paths"): unset or ``auto`` picks per GPU and problem;
#: ``mma`` forces the mma.sync kernels on Hopper (for comparison and as a fallback);
#: ``hopper`` takes the Hopper forward for every problem it supports, small grids included
#: (tests use it to cover that kernel at every shape). Read at import and by
#: :func:`refresh_env_override`.
PATH_VAR = "CUPY_PIECEWISE_PATH"
PATHS = ("auto", "mma", "hopper")
_path = os.environ.get(PATH_VAR)

#: Most CTAs of the persistent Hopper forward's grid (README, "Kernel paths"); unset: one
#: per SM. A testing knob: with a handful of CTAs even a small problem makes each CTA walk
#: several work tiles, which the production grid does only on large ones. Read at import
#: and by :func:`refresh_env_override`.
PERSIST_VAR = "CUPY_PIECEWISE_PERSIST_CTAS"
_persist = os.environ.get(PERSIST_VAR)


def persist_ctas():
    """The value of ``CUPY_PIECEWISE_PERSIST_CTAS`` as an int, or ``None`` when unset.
    Raises ValueError (naming the variable) for anything but a positive integer."""
    if _persist is None or not _persist.strip():
        return None
    try:
        n = int(_persist)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{PERSIST_VAR}={_persist!r}: expected a positive integer")
    return n


#: Head dims of the Hopper (sm_90a: wgmma + TMA) forward; others take the mma.sync path.
#: 80 and 96 run the D = 128 kernels on zero-padded columns (hopper_compute_dim).
HOPPER_HEAD_DIMS = (64, 80, 96, 128, 256)
#: Head dims of the Hopper backward (and its prep / dQ-convert kernels). D = 256 is not one:
#: resident K1, K2, V of a 128-key tile alone would take 192 KB, and dK + dV 256 registers
#: per consumer thread; its backward runs the mma.sync kernels.
HOPPER_BWD_HEAD_DIMS = (64, 80, 96, 128)
#: Query rows per Hopper forward block (a consumer warpgroup per 64) and key rows per tile,
#: per compute head dim (kernels_cu/sm90/forward.cu, FwdCfg). Three consumer warpgroups at
#: D = 64 (FlashAttention-3's layout there), with each tile's P·V waited for in its tile
#: (the serial loop: no P of the previous tile held, so 160 registers suffice); two at 128
#: and 256. A block runs a producer warpgroup besides (:func:`hopper_fwd_threads`).
HOPPER_BLOCK_M = {64: 192, 128: 128, 256: 128}
HOPPER_BLOCK_N = {64: 128, 128: 128, 256: 32}
#: Buffers of BLOCK_N keys in the Hopper forward's K ring and V ring, per compute head dim
#: (FwdCfg's KSLOTS, VSLOTS): a tile takes one K slot (K1 or K2), a tile that straddles
#: d = w two.
HOPPER_FWD_SLOTS = {64: (4, 2), 128: (3, 2), 256: (4, 2)}
#: Whether a dense causal batch runs the Hopper forward's persistent grid, per compute head
#: dim (FwdCfg's PAIRS): CTAs walk units of two query tiles of one head, the longest and the
#: shortest not yet taken, which hold equally many key tiles, with a static stride. Else one
#: CTA per query tile, balanced by the hardware's block scheduler. On an H200 pairs were
#: faster at D = 128 in every causal cell timed, and slower at D = 64, L = 8192
#: (bench/NOTES.md).
HOPPER_CAUSAL_PAIRS = {64: False, 128: True, 256: False}


#: Head dims of the Hopper KV-cache decode (kernels_cu/sm90/kvdecode.cu: whole 64-column
#: TMA boxes); the others decode on the cp.async kernel.
KV90_HEAD_DIMS = (64, 128)
#: Tiles of the Hopper decode per head dim: ``TileConfig(16 packed query rows, 64 keys,
#: 4 consumer warps (one per 16-key chunk), ring stages)``. With 32 KB stages at D = 128
#: three give two blocks per SM; 16 KB at D = 64, six give two (bench/NOTES.md: fewer blocks
#: per SM lose half the bandwidth).
KV90_TILES = {64: TileConfig(16, 64, 4, 6), 128: TileConfig(16, 64, 4, 3)}
#: Fewest 64-key tiles a split of the Hopper decode gets (kvcache_launch.split_count), per
#: head dim: at D = 128 four clustered splits of 1024 keys beat eight split-and-combined
#: ones of 512 at 4096 keys; at D = 64 eight splits stay faster.
KV90_MIN_TILES = {64: 8, 128: 16}
#: Cluster sizes the Hopper decode is built for: 2..8 key splits of a (head, sequence) merge
#: inside one thread-block cluster (8: the portable cluster limit); 1 is unsplit, or more
#: splits than a cluster holds, merged by pw_forward_combine.
KV90_CLUSTERS = tuple(range(1, 9))
#: Most splits the Hopper decode merges in a cluster; more go through pw_forward_combine.
#: Clusters of 8 measured 0.64-0.79x cuDNN where 8 split-and-combined blocks reach 0.89-0.98x
#: (bench/NOTES.md); clusters of up to 4 gain 5-7% over the combine launch.
KV90_MAX_CLUSTER = 4
#: Programmatic dependent launches (cuLaunchKernelEx; kernels_cu/common.cuh) around the
#: Hopper decode: the split merge after it (its blocks start while the decode runs and wait
#: in griddepcontrol.wait), and the decode itself (its set-up overlaps the end of the kernel
#: before it on the stream; it reads and writes global memory only after its wait).
KV90_PDL = True
KV90_PDL_DECODE = True


def kv90_tiles(head_dim: int) -> TileConfig:
    """Tiles of the Hopper decode kernel built for ``head_dim`` (:data:`KV90_TILES`)."""
    return KV90_TILES[head_dim]


def kv90_shared_bytes(head_dim: int, stages: int, rotary: bool = False,
                      staged: bool = False) -> int:
    """Dynamic shared memory of the Hopper decode (mirrors ``pw90kv::Smem<D, STAGES,
    TAB>::BYTES``; checked by tests/test_traits_cpu.py): per stage the K and V of 64 keys, as
    2 KB boxes of 16 rows x 64 columns; one more 16-key K chunk (the one that straddles
    d = w); a full and an empty mbarrier per stage (``stages`` of them: :data:`KV90_TILES`'
    ring depth, or a tuning run's); Q1 and Q2 (16 rows of ``head_dim + 8`` elements); 1 KB to
    align the base to 1024 bytes. A ``rotary`` form with staged table rows (``TAB``: asked
    for by ``staged``, or every rotary form under :data:`KV90_ROT_STAGE`) adds per stage and
    for the straddling chunk 16 rows of the cos and of the sin table (float32,
    ``head_dim / 2`` each) per 16-key chunk."""
    chunk = (head_dim // 64) * 16 * 128
    tab = 2 * 16 * (head_dim // 2) * 4 if rotary and (staged or KV90_ROT_STAGE) else 0
    return (stages * (8 * chunk + 4 * tab) + chunk + tab + 2 * stages * 8
            + 2 * 16 * (head_dim + 8) * 2 + 1024)


def hopper_head_dims(phase: str) -> tuple:
    """Head dims the Hopper kernel of ``phase`` (compile.HOPPER_KERNELS) is built for."""
    if phase == "kvdecode_sm90":
        return KV90_HEAD_DIMS
    return HOPPER_HEAD_DIMS if phase == "fwd_sm90" else HOPPER_BWD_HEAD_DIMS


def hopper_compute_dim(head_dim: int) -> int:
    """The head dim a Hopper kernel computes with for tensors of ``head_dim`` columns: its
    shared-memory tiles are whole 64-column panels (128-byte swizzle), so 80 and 96 run the
    D = 128 kernel, whose TMA boxes fill the columns past the tensor's with zeros (products
    unchanged; 1.33-1.6x the FLOPs of the real columns). Its template's DV is ``head_dim``."""
    for d in (64, 128, 256):
        if head_dim <= d:
            return d
    raise ValueError(f"no Hopper kernel for head dim {head_dim}")


def hopper_block_m(head_dim: int) -> int:
    """Query rows per block of the Hopper forward for tensors of ``head_dim`` columns
    (:data:`HOPPER_BLOCK_M` of its compute head dim)."""
    return HOPPER_BLOCK_M[hopper_compute_dim(head_dim)]


def hopper_fwd_threads(head_dim: int) -> int:
    """Threads per block of the Hopper forward for ``head_dim`` (mirrors
    ``pw90::FwdWarps<D>::THREADS``): a producer warpgroup and a consumer warpgroup per 64
    query rows (512 at D = 64, 384 at 128 and 256)."""
    return 128 * (1 + hopper_block_m(head_dim) // 64)


def hopper_shared_bytes(head_dim: int, *, block_n: int | None = None,
                        slots: tuple | None = None, block_m: int | None = None) -> int:
    """Dynamic shared memory of the Hopper forward (mirrors ``pw90::FwdSmem<D>::BYTES``;
    checked by tests/test_traits_cpu.py): Q1 and Q2 tiles, the K and V rings
    (:data:`HOPPER_FWD_SLOTS` buffers of :data:`HOPPER_BLOCK_N` keys) as 64-column,
    128-byte-swizzled panels, a full and an empty mbarrier per buffer plus two (Q loaded;
    Q released, for the persistent grid), and 1 KB to align the base. ``block_n``,
    ``slots`` (K, V) and ``block_m`` replace the table's for a build with other tile macros
    (scripts/hopper_probe.py --variants); the package never passes them."""
    head_dim = hopper_compute_dim(head_dim)
    panels = head_dim // 64
    q_tile = panels * (block_m or HOPPER_BLOCK_M[head_dim]) * 128
    k_tile = panels * (block_n or HOPPER_BLOCK_N[head_dim]) * 128
    nslots = sum(slots or HOPPER_FWD_SLOTS[head_dim])
    return 2 * q_tile + nslots * k_tile + 8 * (2 + 2 * nslots) + 1024


#: Query rows per streamed tile and key rows per block of the Hopper backward
#: (kernels_cu/sm90/backward.cu, pw90::bwd::BM / BN).
HOPPER_BWD_BLOCK_M = 64
HOPPER_BWD_BLOCK_N = 128
#: Rows per block of the Hopper backward's helper kernels (``pw90_bwd_prep``,
#: ``pw90_bwd_dq_convert``): 8 warps of 256 threads, each warp a row pair (i, i + 8).
HOPPER_BWD_HELPER_ROWS = 16


def hopper_bwd_helper_grid(heads: int, rows: int, batch: int) -> tuple:
    """Grid of the Hopper backward's helper kernels over ``rows`` rows of each of ``heads``
    heads and ``batch`` batch entries (mirrors ``pw90::bwd::row_pair``): each head's rows in
    whole blocks of :data:`HOPPER_BWD_HELPER_ROWS`."""
    return (heads * -(-rows // HOPPER_BWD_HELPER_ROWS), batch, 1)


def hopper_bwd_shared_bytes(head_dim: int, stages: int = 2, dq_writer: bool = False) -> int:
    """Dynamic shared memory of the Hopper backward (mirrors ``pw90::bwd::Smem<D>::BYTES``;
    checked by tests/test_traits_cpu.py): resident K1, K2, V of the key tile; ``stages`` ring
    stages of (Q, dO) and of lse2/delta (64 float32 each); two dSᵀ buffers (128 keys x 64
    queries, 16-bit); 1 + 2 ``stages`` mbarriers; 1 KB to align the base. The package builds
    2 stages; the probe's builds may set ``-DPW90_BWD_STAGES``. ``dq_writer`` (a build with
    ``-DPW90_BWD_DQ_WRITER=1``): two 16 KB dQ staging buffers, four more mbarriers and two
    8-byte panel addresses."""
    panels = hopper_compute_dim(head_dim) // 64
    k_tile = panels * HOPPER_BWD_BLOCK_N * 128
    q_tile = panels * HOPPER_BWD_BLOCK_M * 128
    ds = HOPPER_BWD_BLOCK_N * HOPPER_BWD_BLOCK_M * 2
    staging = 2 * 64 * 64 * 4 if dq_writer else 0
    return (3 * k_tile + stages * 2 * q_tile + 2 * ds + stages * 2 * HOPPER_BWD_BLOCK_M * 4
            + staging + 8 * (1 + 2 * stages + (4 if dq_writer else 0)) + (16 if dq_writer else 0) + 1024)


_switches = (_override, _path, _persist)


def plan_switches():
    """``(CUPY_PIECEWISE_TILES, CUPY_PIECEWISE_PATH, CUPY_PIECEWISE_PERSIST_CTAS)`` as in
    effect (see :func:`env_override`): what plan caches put in their keys. One global read."""
    return _switches


def path_override() -> str:
    """The value of ``CUPY_PIECEWISE_PATH``: ``'auto'`` (unset), ``'mma'`` or ``'hopper'``.
    Raises ValueError for any other value (naming the variable)."""
    value = (_path or "auto").strip().lower() or "auto"
    if value not in PATHS:
        raise ValueError(f"{PATH_VAR}={_path!r}: expected one of {', '.join(PATHS)}")
    return value


def set_tile_override(text):
    """Set (``text``, e.g. ``"fwd=128x64x8"``) or clear (``None``) the tile override for
    later calls of this process and of child processes (``os.environ`` is updated too).
    Raises ValueError for text :func:`parse_override` cannot read. Returns the old value."""
    global _override, _switches
    if text is not None:
        parse_override(text)
        os.environ[ENV_VAR] = text
    else:
        os.environ.pop(ENV_VAR, None)
    old, _override = _override, text
    _switches = (_override, _path, _persist)
    return old


BLOCK_SIZES = (16, 32, 64, 128)
STAGES = (2,)  # the kernels are double-buffered; deeper pipelines are future work
#: the KV-cache kernel's ring (memory-bound: more bytes in flight per block)
KV_STAGES = (2, 3, 4)
#: dtypes the mma.sync kernels of the table take: float16 and bfloat16 (m16n8k16), and
#: float32 (TF32 products, m16n8k8; 4-byte elements in shared memory, tiles from
#: :data:`TF32_TABLE` where the 16-bit entry does not fit).
TABLE_DTYPES = ("float16", "bfloat16", "float32")
#: dtypes of the Hopper kernels (kernels_cu/sm90/) and of the phases
#: :data:`HALF_ONLY_PHASES`: 16-bit only.
HALF_DTYPES = ("float16", "bfloat16")

#: Largest dynamic shared memory per block (bytes, opt-in), per compute capability.
SHARED_LIMIT = {
    (8, 0): 166912,  # A100: 163 KiB
    (8, 6): 101376,  # GA10x: 99 KiB
    (8, 7): 166912,  # Orin: 163 KiB
    (8, 9): 101376,  # Ada: 99 KiB
    (9, 0): 232448,  # H100/H200: 227 KiB
    (10, 0): 232448,  # B200: 227 KiB
    (12, 0): 101376,  # consumer Blackwell: 99 KiB
}


def fused_ds_bytes(cfg: TileConfig) -> int:
    """Bytes the fused backward adds to the dk/dv kernel's layout: one tile of dS, key-major,
    ``block_n`` rows of ``block_m`` 16-bit entries at a pitch of ``block_m + 8``."""
    return 2 * cfg.block_n * (cfg.block_m + 8)


#: Host mirror of the kernels' -DPW_FWD_Q_ROTATE (kernels_cu/traits.cuh; on by default since
#: 2026-12-05): one-key-slot forward tiles with BM == 2 * BN keep three rotating slots of one
#: Q tile each (:func:`fwd_q_rotate`), as TABLE's sm_90 D = 128 forward entry, 128x64x4, does.
#: Only :func:`apply_kernel_macros` changes it, beside the -D option that builds the matching
#: kernels: ``PW_FWD_Q_ROTATE=0`` (an A/B build of the earlier four-slot layout) turns it
#: off, and 128x64x4 at D = 128 then needs 139264 bytes (one block per SM) instead of 104448.
FWD_Q_ROTATE = True

#: Host mirror of the kernels' -DPW_FWD_ONE_K_D64 (kernels_cu/traits.cuh; on by default since
#: 2026-12-05): :func:`fwd_one_key_slot` holds at head dim 64 with 128-key tiles too, as
#: TABLE's sm_90 D = 64 forward entry, 128x128x4, uses it (110592 bytes, two blocks per SM).
#: Only :func:`apply_kernel_macros` changes it: ``PW_FWD_ONE_K_D64=0`` (an A/B build of the
#: earlier two-slot layout) turns it off, and 128x128x4 then needs 147456 bytes.
FWD_ONE_K_D64 = True

#: Host mirror of the Hopper decode's -DKV90_ROT_STAGE (kernels_cu/sm90/kvdecode.cu; staged,
#: off by default): the rotary forms' producer warp stages each chunk's cos and sin rows in
#: shared memory (:func:`kv90_shared_bytes`). Only :func:`apply_kernel_macros` changes it.
KV90_ROT_STAGE = False

#: The Hopper rotary decode takes the staged-table form (the kernel's TAB = true, as
#: :data:`KV90_ROT_STAGE` makes every rotary form) only for shapes where the default form
#: would run one key split (B·Hkv alone fills the GPU); staged, off by default. Why only
#: there: its ring (218672 bytes at D = 128) leaves one block per SM, so where the decode
#: splits, :func:`kvcache_launch.split_count` halves the splits and the step runs 15-44%
#: slower; where it does not split, the staged form ran +2-19% (H100,
#: bench/results/2026-12-06-h100-mma-d64-decode-ncu), but on an H200 it was slower there
#: too at D = 64 (0.83 -> 0.60x cuDNN) and even at D = 128
#: (bench/results/2026-12-06-h200-decode-mma-tables), hence off. Read when a call signature
#: is first planned, like the other KV90_* settings.
KV90_ROT_STAGE_UNSPLIT = False

#: Host mirror of the Hopper decode's -DKV90_TILE_BOX (kernels_cu/sm90/kvdecode.cu; an A/B
#: build, off by default): the plain decode kernel takes six tensor maps, the last three of
#: 64-row boxes where a 64-key tile lies in one page (:func:`kvcache_launch.kv90_tile_box`),
#: which its producer loads whole. On an H100 +0.4-1.7% at D = 128 and -0.1-6% at D = 64
#: (bench/results/2026-12-06-h100-tilebox), hence off; 2 (the next A/B) keeps the boxes to
#: head dim 128 and paged caches. An int: 0, 1 or 2. Only :func:`apply_kernel_macros`
#: changes it.
KV90_TILE_BOX = 0

#: The Hopper decode's paged D = 64 entry (:func:`kvcache_launch.page_box`, kernels_cu/sm90/
#: kvdecode.cu ``pw90_kvdecode_pages``): a cache paged in multiples of 64 rows loads each
#: 64-key tile as one TMA box per operand (one 8 KB page) instead of four 16-row boxes. Its
#: body is the D = 64 kernel of the -DKV90_TILE_BOX=2 build, which ran the paged D = 64 rows
#: +1.0-6.5% and kept the paged-within-5% target on 23-24 of 24 rows against 22-23 (H100,
#: 2026-12-07, bench/results/2026-12-07-h100-paged-d64-entry). False sends those caches to the
#: plain decode: the host mirror of -DKV90_PAGE_BOX (1 by default; 0 builds no such entry),
#: set by :func:`apply_kernel_macros` for A/B runs; read when a call signature is first
#: planned.
KV90_PAGE_BOX = True

#: Host mirror of the Hopper decode's -DKV90_ROW_BOX (kernels_cu/sm90/kvdecode.cu; 2 by
#: default since 2026-12-06): at head dim 128 the plain decode's k1, k2 and v maps are 5-d, one
#: box of 16 whole rows per chunk (:func:`kvcache_launch.kv90_row_box`): 1 in every such
#: decode, 2 only where the key splits do not merge in a cluster, 0 nowhere. On an H100 the
#: row boxes ran +3.2-5.1% on every unclustered D = 128 row and -2% on the clustered one
#: (bench/results/2026-12-06-h100-rowbox); mode 2 became the default after its own GPU run
#: on an H200, +1.2-3.9% on the unclustered D = 128 rows there (``gpu_run.sh rowbox``,
#: bench/results/2026-12-06-h200-rowbox-default). A tile-box build takes no row boxes. An
#: int, 0, 1 or 2. Only :func:`apply_kernel_macros` changes it.
KV90_ROW_BOX = 2

#: Host mirror of -DPW_GRID_TWO_DS (kernels_cu/traits.cuh; an A/B build, off by default):
#: the warp-grid backward keeps Pᵀ and dSᵀ in two buffers at head dim 64 with 4 warps too
#: (:func:`grid_two_ds_buffers`), 102400 bytes a block, over sm_86/89's limit. Only
#: :func:`apply_kernel_macros` changes it.
GRID_TWO_DS_D64 = False

#: kernel macro -> this module's mirror of it (the launch's shared-memory size or its
#: arguments depend on it)
_MACRO_MIRRORS = {"PW_FWD_Q_ROTATE": "FWD_Q_ROTATE", "PW_FWD_ONE_K_D64": "FWD_ONE_K_D64",
                  "KV90_ROT_STAGE": "KV90_ROT_STAGE", "KV90_TILE_BOX": "KV90_TILE_BOX",
                  "PW_GRID_TWO_DS": "GRID_TWO_DS_D64", "KV90_ROW_BOX": "KV90_ROW_BOX",
                  "KV90_PAGE_BOX": "KV90_PAGE_BOX"}
#: the mirrors' values without any macro (tests restore them: tests/test_capability.py)
_MIRROR_DEFAULTS = {name: globals()[name] for name in _MACRO_MIRRORS.values()}


def apply_kernel_macros(macros) -> None:
    """Sets the host mirrors of the kernel macros in ``macros`` (``NAME=VALUE`` strings, as
    given to NVRTC without ``-D``; names without a mirror are ignored): an A/B build that
    changes a kernel's shared-memory layout needs the launch to size it the same way. The
    probes and tests/conftest.py (PW_TEST_MACROS) call it; the package never does.

    Raises ValueError for a mirrored macro whose value is not an integer."""
    for m in macros:
        name, _, value = m.partition("=")
        if name in _MACRO_MIRRORS:
            mirror = _MACRO_MIRRORS[name]
            try:  # each mirror keeps its type: a switch (bool) or a mode (int)
                globals()[mirror] = type(_MIRROR_DEFAULTS[mirror])(int(value or "1"))
            except ValueError:
                raise ValueError(f"kernel macro {m!r}: expected an integer value") from None


def grid_two_ds_buffers(head_dim: int, cfg: TileConfig) -> bool:
    """Whether the warp-grid backward (phase ``bwd_grid``) keeps Pᵀ and dSᵀ in two buffers
    (else dSᵀ overwrites Pᵀ after dV's product): head dims up to 64 with 8 warps, where the
    second buffer fits every listed architecture that can run the entry. The kernel's rule is
    ``grid_two_ds_buffers`` of kernels_cu/traits.cuh (tests/test_traits_cpu.py compares the
    layouts). With :data:`GRID_TWO_DS_D64` (the mirror of -DPW_GRID_TWO_DS, an A/B build)
    also at 4 warps."""
    return head_dim <= 64 and (cfg.num_warps == 8 or (GRID_TWO_DS_D64 and cfg.num_warps == 4))


def _grid_dq_tiles_fit(head_dim: int, warps: int) -> bool:
    """BwdGridTraits' static_assert "dQ tiles cover D" (kernels_cu/traits.cuh): the 64 x D
    dQ block splits into warp tiles of 32 queries x min(2 D / warps, 32) columns, a multiple
    of 16, the same whole number per warp (head dims 64 and 128; not 16, 80, 96, nor 32 at
    8 warps)."""
    cols = min(2 * head_dim // warps, 32)
    return cols % 16 == 0 and cols > 0 and (2 * head_dim) % (cols * warps) == 0


def fwd_one_key_slot(head_dim: int, cfg: TileConfig, elem_bytes: int = 2) -> bool:
    """Whether the mma.sync forward (phases fwd and fwd_decode) keeps one key slot per
    pipeline stage instead of two: 16-bit inputs (``elem_bytes`` 2), ``head_dim`` >= 128 (or
    64 with 128-key tiles, :data:`FWD_ONE_K_D64`) and 32 query rows per warp (``block_m ==
    32 * num_warps``). The kernel's rule is
    ``fwd_one_key_slot`` of kernels_cu/traits.cuh; tests/test_traits_cpu.py checks that the
    two agree on every selectable variant. A straddling tile's second key projection then
    replaces its first between the tile's two visits, and 128x32x4 at D = 128 fits two
    blocks per SM on sm_90 (104 KB each)."""
    return (elem_bytes == 2
            and (head_dim >= 128 or (FWD_ONE_K_D64 and head_dim == 64 and cfg.block_n == 128))
            and cfg.block_m == 32 * cfg.num_warps)


def fwd_q_rotate(head_dim: int, cfg: TileConfig, elem_bytes: int = 2) -> bool:
    """Whether the mma.sync forward keeps three rotating Q-sized slots (q2 and two key
    stages over far tiles and the straddling tiles' q2·k2 visits; two stages and q1 over the
    straddling tiles' q1·k1 visits and near tiles) instead of q1, q2 and two stages: with :data:`FWD_Q_ROTATE` (the kernels'
    -DPW_FWD_Q_ROTATE) where :func:`fwd_one_key_slot` holds and ``block_m == 2 * block_n``,
    so that one stage (k and v) is one Q tile. The kernel's rule is ``fwd_q_rotate`` of
    kernels_cu/traits.cuh."""
    # stages == 2: the kernel's layout assumes double buffering (STAGES allows only 2 today)
    return (FWD_Q_ROTATE and fwd_one_key_slot(head_dim, cfg, elem_bytes)
            and cfg.block_m == 2 * cfg.block_n and cfg.stages == 2)


def shared_bytes(phase: str, head_dim: int, cfg: TileConfig, elem_bytes: int = 2) -> int:
    """Shared memory (bytes) one block of ``phase`` needs with tiles ``cfg``.

    Rows are padded by 16 bytes (bank-conflict-free ``ldmatrix``); ``elem_bytes`` is 4
    for float32 inputs (:func:`elem_bytes`), 2 otherwise. fwd keeps
    q1, q2 and ``stages`` copies of k1, k2, v (of one key slot and v where
    :func:`fwd_one_key_slot` says so); bwd_dq adds do (and 8 bytes per
    row for lse and delta); bwd_dkv keeps the key tile (k1, k2, v) and
    ``stages`` copies of the query-side tiles (q1, q2, do) plus lse/delta; bwd_fused adds
    one dS tile (:func:`fused_ds_bytes`).

    This is the Python figure of the layout: the launch passes it as the dynamic
    shared-memory size. The kernels carve their shared memory with the traits
    structs of ``kernels_cu/traits.cuh`` (``FwdTraits``, ``BwdDqTraits``,
    ``BwdDkvTraits``), whose ``smem_bytes`` must agree with this function for
    every variant the table can select; ``tests/test_traits_cpu.py`` checks that
    with NVRTC (a ``static_assert`` per variant, no GPU needed). Change both
    together. (bwd_dq's 8 bytes per row are reserved there, not read.)
    """
    row = elem_bytes * head_dim + 16  # padded rows (Pitch<D * width> of common.cuh), bytes
    if phase in ("fwd", "fwd_decode", "kvcache", "kvdecode"):
        # q1, q2, and per stage the key slots and v: kvcache two slots (16 query rows),
        # kvdecode one (one new token: every key has one distance), fwd by fwd_one_key_slot
        slots = {"kvcache": 2, "kvdecode": 1}.get(phase)
        if slots is None and fwd_q_rotate(head_dim, cfg, elem_bytes):
            return 3 * cfg.block_m * row  # three Q-sized slots (fwd_q_rotate)
        if slots is None:
            slots = 1 if fwd_one_key_slot(head_dim, cfg, elem_bytes) else 2
        return (2 * cfg.block_m + (slots + 1) * cfg.stages * cfg.block_n) * row
    if phase == "bwd_dq":
        return (3 * cfg.block_m + 3 * cfg.stages * cfg.block_n) * row + 8 * cfg.block_m
    if phase == "bwd_grid":
        # k1, k2, v of block_n keys; per stage q1, q2, do of block_m queries and their lse
        # and delta; one or two key-major Pᵀ/dSᵀ buffers (block_n rows, pitch block_m + 8)
        ds = 2 * cfg.block_n * (cfg.block_m + 8)
        return ((3 * cfg.block_n + 3 * cfg.stages * cfg.block_m) * row
                + 8 * cfg.stages * cfg.block_m
                + ds * (2 if grid_two_ds_buffers(head_dim, cfg) else 1))
    if phase in ("bwd_dkv", "bwd_fused"):
        dkv = (3 * cfg.block_n + 3 * cfg.stages * cfg.block_m) * row + 8 * cfg.stages * cfg.block_m
        return dkv + (fused_ds_bytes(cfg) if phase == "bwd_fused" else 0)
    raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")


# ----------------------------------------------------------------------------
# The table. TABLE[cc][phase][head_dim] is a TileConfig, or a dict refining it by
# (dtype, causal) where either may be None meaning "any"; the (None, None) key
# is the default of that refinement. Starting values, to be tuned on hardware.

_T = TileConfig

#: The row of compute capability 8.6 and 8.9 (99 KiB shared per block). Head dims 64 and 128
#: take the best shape the H200 measurements found among those that fit 99 KiB (see the note
#: on deriving these rows above TABLE); the others are budget estimates.
_SM86_89 = {
    # 64: 128x64x4 (92 KB), the H200's best D = 64 shape; 128: 64x32x4 (87 KB), as none of
    # the shapes the H200 timed faster (128x64x8, 64x64x4, 128x32x8) fits
    "fwd": {256: _T(32, 16, 2), 128: _T(64, 32, 4), 96: _T(64, 32, 4), 80: _T(64, 32, 4),
            64: _T(128, 64, 4), 32: _T(64, 64, 4), 16: _T(64, 64, 4)},
    "fwd_decode": {256: _T(16, 16, 1), 128: _T(16, 32, 1), 96: _T(16, 32, 1), 80: _T(16, 32, 1),
                   64: _T(16, 64, 1), 32: _T(16, 64, 1), 16: _T(16, 64, 1)},
    # 64: 128x32x4 (84 KB); 128: 64x16x4 (79 KB; 64x32x4 needs 105 KB)
    "bwd_dq": {256: _T(16, 16, 1), 128: _T(64, 16, 4), 96: _T(64, 16, 4), 80: _T(64, 16, 4),
               64: _T(128, 32, 4), 32: _T(64, 32, 4), 16: _T(64, 64, 4)},
    # 64: 64x64x4 (84 KB; the H200's causal 32x128x4 spills 16-52 bytes here); 128: 16x64x4
    # (79 KB; 32x64x4 needs 105 KB)
    "bwd_dkv": {256: _T(16, 16, 1), 128: _T(16, 64, 4), 96: _T(16, 64, 4), 80: _T(16, 64, 4),
                64: _T(64, 64, 4), 32: _T(64, 64, 4), 16: _T(64, 64, 4)},
    # where the H200 measured the one-kernel backward faster (note above TABLE), in shapes
    # that fit 99 KiB: 128 causal 16x64x4 (82 KB); 64 float16 64x64x4 (93 KB) until bwd_grid
    # replaced it for dense batches (VARLEN_TABLE keeps it for packed ones)
    "bwd_fused": {128: {(None, True): _T(16, 64, 4), (None, None): None}},
    # D = 64 as sm_90 (93 KB, one Pᵀ/dSᵀ buffer; it replaced bwd_fused's float16 entry
    # there); D = 128 has none: 64x64x4 needs 163 KiB
    "bwd_grid": {64: _T(64, 64, 4)},
    "kvcache": {128: _T(16, 32, 2, 2), 64: _T(16, 64, 4, 2), 32: _T(16, 64, 4, 2),
                16: _T(16, 64, 4, 2)},
    "kvdecode": {128: _T(16, 64, 4, 2), 64: _T(16, 64, 4, 3), 32: _T(16, 64, 4, 3),
                 16: _T(16, 64, 4, 3)},
}

# How the sm_80, sm_86 and sm_89 rows are derived (issue 15; none of these GPUs has been
# timed). The mma.sync kernels are the same code on all four architectures, and the register
# file is the same (64K 32-bit registers per SM, at most 255 per thread), so what the H200
# measured about tile shapes carries over, within each GPU's shared memory per block: for
# head dims 64 and 128 each row takes the fastest shape of bench/results/tiles_h200.json
# (and of the sm_90 row, which later runs refined) that fits, and the build check proves it
# compiles without spills for that architecture. The H200 ran one block per SM at D = 128
# and two at 64 in the shapes those rows were taken from, so those figures did not depend on
# occupancy the smaller GPUs cannot reach. (From 2026-12-04 the sm_90 D = 128 forward ran
# two blocks of 128x32x4 per SM with one key slot, 104 KB each, and since 2026-12-05 two of
# 128x64x4 in three rotating slots, 104 KB each too; an A100 fits one, and one block of
# 128x32x4 ran no faster than 128x64x8 on the H200, so sm_80 keeps 64x64x4.)
# The bwd_fused entries take the one-kernel backward for the variants where it won on the
# H200 (the sm_90 row, before bwd_grid replaced it there), in shapes that fit; bwd_grid's
# D = 64 entry is the H100's best shape (2026-12-05), which fits all three.
# sm_86 and sm_89 share one row on purpose: every quantity the choice depends on is the same
# (99 KiB per block and 100 KiB per SM of shared memory, 64K registers and 1536 threads per
# SM). What differs, Ada's much larger L2 cache (up to 96 MB against 6 MB), changes how often
# K and V come from DRAM, not which tile shape fits.

TABLE: dict[tuple[int, int], dict[str, dict[int, object]]] = {
    # A100: 163 KiB shared per block. D = 64 and 128 from the H200's measurements (the note
    # above): fwd 64 128x64x4 (+18% over 128x64x8 on the H200); fwd 128 keeps 64x64x4 (the
    # H200's best, 128x64x8, needs 174 KB); bwd_dq 64 128x32x4, 128 64x32x4 (+5%, +6% over
    # 64x64x4 and 128x32x8 there); bwd_dkv 128 as the sm_90 row (+31% non-causal over
    # 16x128x8 there); bwd_dkv 64 keeps 64x64x4 (the H200's causal 32x128x4 spills on sm_80).
    (8, 0): {
        "fwd": {256: _T(32, 32, 2), 128: _T(64, 64, 4), 96: _T(64, 64, 4), 80: _T(64, 64, 4),
                64: _T(128, 64, 4), 32: _T(128, 64, 8), 16: _T(128, 64, 8)},
        "fwd_decode": {256: _T(16, 32, 1), 128: _T(16, 32, 1), 96: _T(16, 32, 1), 80: _T(16, 32, 1),
                       64: _T(16, 64, 1), 32: _T(16, 64, 1), 16: _T(16, 64, 1)},
        "bwd_dq": {256: _T(64, 16, 4), 128: _T(64, 32, 4), 96: _T(64, 32, 4), 80: _T(64, 32, 4),
                   64: _T(128, 32, 4), 32: _T(64, 128, 4), 16: _T(64, 128, 4)},
        # causal D = 128 keeps one 16-row block per warp (32x64 spills there, as on sm_90)
        "bwd_dkv": {256: _T(16, 64, 4),
                    128: {(None, True): _T(16, 64, 4), (None, None): _T(32, 64, 4)},
                    96: {(None, True): _T(16, 64, 4), (None, None): _T(32, 64, 4)},
                    80: {(None, True): _T(16, 64, 4), (None, None): _T(32, 64, 4)},
                    64: _T(64, 64, 4), 32: _T(128, 64, 4), 16: _T(128, 64, 4)},
        # as sm_86/89 (the note above TABLE): 128 causal keeps bwd_dkv's 16x64x4
        "bwd_fused": {128: {(None, True): _T(16, 64, 4), (None, None): None}},
        # D = 64 as sm_90; D = 128's 64x64x4 fits (166912 bytes, all of it) but spills 12-16
        # bytes here (NVRTC 13.5) and only tied bwd_fused on the H100
        "bwd_grid": {64: _T(64, 64, 4)},
        "kvcache": {d: _T(16, 64, 4, 2) for d in (16, 32, 64, 128)},
        "kvdecode": {d: _T(16, 64, 4, 3) for d in (16, 32, 64, 128)},
    },
    # RTX 30xx / A10 / A40 (8.6) and RTX 40xx / L4 / L40 (8.9): one row for both. Their
    # limits are the same (99 KiB shared memory per block, 64K registers and 1536 threads
    # per SM) and neither has been timed, so nothing yet tells them apart.
    (8, 6): _SM86_89,
    (8, 9): _SM86_89,
    # H100 / H200: 227 KiB shared per block. Measured with bench/tiles.py on an H200
    # (2026-11-30, bf16, L=8192; bench/results/tiles_h200.json) among variants ptxas
    # compiles without spills. Warps own 32 rows (MW=2) where the registers allow.
    (9, 0): {
        # Head dims 80, 96 and 256 (issue 12) take the D = 128 shapes where they fit (80 and
        # 96 need fewer registers and less shared memory); 256 takes 16-key steps and one
        # 16-row block per warp (a D-wide accumulator is 128 registers; the build check
        # finds these at 247-255 without spills). Not yet timed.
        # 128: 128x64x4 in three rotating Q-sized slots (fwd_q_rotate, kernels_cu/traits.cuh
        # PW_FWD_Q_ROTATE; 104 KB), two blocks per SM: 1.08-1.16x the 128x32x4 entry before
        # it on an H200 (2026-12-05, scripts/mma_fwd_probe.py, bf16 and fp16, L 2048-16384,
        # causal and not; 0.85-0.93x SDPA flash at L 2048, 0.95-0.99x at 8192-16384). That
        # 128x32x4 kept one key slot per stage (fwd_one_key_slot), two blocks per SM at
        # 104 KB: 1.12-1.21x the 128x64x8 entry before it (2026-12-04,
        # bench/results/2026-12-04-h200-fwd-one-key-slot). Built with -DPW_FWD_Q_ROTATE=0,
        # 128x64x4 keeps four slots (139264 bytes: one block per SM, which still fits).
        # 96 and 80: 128x32x4 fits two blocks per SM with both key slots (93 and 79 KB):
        # 1.16x (96) and 1.04-1.12x (80) the 128x64x8 entry there (one bf16 round, L 8192).
        # 64: 128x128x4, FlashAttention-2's D = 64 tile, with one key slot per stage
        # (fwd_one_key_slot, PW_FWD_ONE_K_D64; 110592 bytes, two blocks per SM): 1.07-1.12x the
        # 128x64x4 entry before it on an H100 (2026-12-05, scripts/mma_fwd_probe.py, bf16 and
        # fp16, causal and not, L 2048 and 8192; bench/NOTES.md, thirty-fourth section).
        "fwd": {256: _T(64, 16, 4), 128: _T(128, 64, 4), 96: _T(128, 32, 4), 80: _T(128, 32, 4),
                64: _T(128, 128, 4), 32: _T(128, 128, 8), 16: _T(128, 64, 4)},
        "fwd_decode": {256: _T(16, 16, 1), 128: _T(16, 32, 1), 96: _T(16, 32, 1), 80: _T(16, 32, 1),
                       64: _T(16, 64, 1), 32: _T(16, 64, 1), 16: _T(16, 64, 1)},
        "bwd_dq": {256: _T(64, 16, 4), 128: _T(128, 64, 8), 96: _T(128, 64, 8), 80: _T(128, 64, 8),
                   64: _T(128, 32, 4), 32: _T(64, 64, 4), 16: _T(128, 64, 4)},
        "bwd_dkv": {
            256: _T(16, 64, 4),
            # causal spills at 32x64 (mask and row-scale registers): one 16-row block per warp
            128: {(None, True): _T(16, 64, 4), (None, None): _T(32, 64, 4)},
            96: {(None, True): _T(16, 64, 4), (None, None): _T(32, 64, 4)},
            80: {(None, True): _T(16, 64, 4), (None, None): _T(32, 64, 4)},
            64: {(None, True): _T(32, 128, 4), (None, None): _T(64, 64, 4)},
            32: _T(64, 64, 4),
            16: _T(64, 128, 4),
        },
        # The one-kernel backward pw_backward_dkv (FUSED) keeps its entries for packed
        # batches only (VARLEN_TABLE; bwd_grid has no packed build): for dense ones bwd_grid
        # below replaced its two, D = 128 causal 32x64x4 and D = 64 float16 64x64x4 (which
        # had beaten the two-kernel scheme by 1.18-1.25x and 1.07-1.18x, 2026-12-02), at
        # 1.12-1.23x and 1.05-1.10x their speed (2026-12-05). A bwd_fused tile override
        # still runs it on dense batches.
        "bwd_fused": {},
        # The warp-grid one-kernel backward (FlashAttention-2's decomposition; replaces
        # bwd_fused where it has an entry, every dtype and causal flag), measured on an H100
        # (2026-12-05, scripts/mma_bwd_probe.py, L 2048/8192, bf16/fp16, causal and not,
        # forward+backward; bench/results/2026-12-05-h100-grid-backward): D = 128 64x128x8
        # (228352 bytes, one block per SM): 1.23-1.48x the two-kernel scheme, 1.12-1.27x
        # bwd_fused 32x64x4, 0.82-0.90x SDPA flash (the default before: 0.69-0.75x); D = 64
        # 64x64x4 (93 KB, two blocks per SM): 1.04-1.17x the two kernels, 0.77-0.84x flash
        # (64x128x8 there: 0.76-0.80x).
        "bwd_grid": {128: _T(64, 128, 8), 64: _T(64, 64, 4)},
        # memory-bound: a 3-deep ring of 64-key tiles keeps ~100 KB in flight per block
        "kvcache": {d: _T(16, 64, 4, 3) for d in (16, 32, 64, 128)},
        # two stages measured best on an H200 (2026-12-01, bf16, B*H 32-256, N 4k-128k:
        # bench/results/2026-12-01-h200-kvcache/results_tune_*.json): 1-3% over three or four
        "kvdecode": {d: _T(16, 64, 4, 2) for d in (16, 32, 64, 128)},
    },
}

#: the packed-batch one-kernel entries of sm_80, sm_86 and sm_89: D = 64 float16, which their
#: dense rows gave to bwd_grid (no packed build), and D = 128 causal, as the dense rows
_PACKED_FUSED_SM8X = {128: {(None, True): _T(16, 64, 4), (None, None): None},
                      64: {("float16", None): _T(64, 64, 4), (None, None): None}}

#: Packed variable-length batches (``attention_varlen``) run the same kernels built with a
#: VARLEN flag: per-sequence lengths and offsets held in registers. Where a dense entry sits
#: at the register limit that tips it into spills, the packed kernel takes the entry here
#: instead (same layout as TABLE; phases fwd, bwd_dq, bwd_dkv, bwd_fused; absent entries:
#: TABLE's). bwd_fused also keeps here the entries its dense rows gave to bwd_grid.
VARLEN_TABLE: dict[tuple[int, int], dict[str, dict[int, object]]] = {
    # the packed D = 128 dk/dv kernel spills at 32x64x4 on sm_80 too (16 bytes, bf16)
    (8, 0): {
        "bwd_dkv": {128: _T(16, 64, 4), 96: _T(16, 64, 4), 80: _T(16, 64, 4)},
        "bwd_fused": _PACKED_FUSED_SM8X,
    },
    (8, 6): {"bwd_fused": _PACKED_FUSED_SM8X},
    (8, 9): {"bwd_fused": _PACKED_FUSED_SM8X},
    (9, 0): {
        # 128, 96, 80: the dense entries before 128x32x4 (which spills 20-28 bytes at 128
        # and 8 at 96 with the packed batch's registers; 80 not timed packed); 128 also not
        # the dense 128x64x4 (its packed rotating-slot form spills 88-100 bytes, NVRTC 13.5)
        "fwd": {128: _T(128, 64, 8), 96: _T(128, 64, 8), 80: _T(128, 64, 8), 64: _T(64, 64, 4)},
        "bwd_dkv": {
            128: {(None, True): _T(16, 64, 4), (None, None): _T(16, 64, 4)},
            64: {(None, True): _T(32, 64, 4), (None, None): _T(64, 64, 4)},
        },
        # the one-kernel entries the dense row had before bwd_grid replaced them (TABLE)
        "bwd_fused": {
            128: {(None, True): _T(32, 64, 4), (None, None): None},
            64: {("float16", None): _T(64, 64, 4), (None, None): None},
        },
    },
}
#: Phases with a packed-batch kernel.
VARLEN_PHASES = ("fwd", "bwd_dq", "bwd_dkv", "bwd_fused")

#: float32 tiles of compute capability 8.6 and 8.9 (99 KiB shared per block).
_SM86_89_TF32 = {
    "fwd": {256: None, 128: _T(32, 16, 2), 96: _T(64, 16, 4), 80: _T(64, 16, 4),
            64: _T(64, 32, 4)},
    "fwd_decode": {256: None, 128: _T(16, 16, 1), 96: _T(16, 16, 1), 80: _T(16, 16, 1),
                   64: _T(16, 32, 1)},
    "bwd_dq": {256: None, 128: _T(16, 16, 1), 96: _T(32, 16, 2), 80: _T(64, 16, 4),
               64: _T(64, 16, 4)},
    "bwd_dkv": {256: None, 128: _T(16, 16, 1), 96: _T(16, 32, 2), 80: _T(16, 64, 4),
                64: _T(16, 64, 4)},
}
#: float32 inputs (TF32 products) keep 4-byte elements in shared memory: twice the 16-bit
#: tiles' bytes. Where a TABLE entry does not fit the architecture's limit that way, or
#: spills with the TF32 rounding's extra registers, float32 takes the entry here (dense and
#: packed batches alike); ``None``: no float32 kernel at that head dim, and a call raises
#: ValueError before any kernel runs. That is head dim 256 everywhere: on sm_86/89 no tile
#: fits (16 x 16 tiles of 4-byte rows need 130 KB), and elsewhere the tiles that fit leave
#: the backward kernels (and the sm_80 forward) spilling 8-124 bytes (ptxas, NVRTC 13; the
#: TF32 operand rounding costs the last registers a D = 256 accumulator leaves). Chosen to
#: fit without spills, keeping the warps and the rows per warp of the 16-bit entry where
#: possible; not timed except on sm_90 (bench/NOTES.md).
TF32_TABLE: dict[tuple[int, int], dict[str, dict[int, object]]] = {
    (8, 0): {
        "fwd": {256: None, 128: _T(64, 16, 4), 96: _T(64, 32, 4), 80: _T(64, 32, 4),
                64: _T(64, 64, 4)},
        "fwd_decode": {256: None, 96: _T(16, 16, 1), 80: _T(16, 16, 1)},
        "bwd_dq": {256: None, 128: _T(64, 16, 4), 96: _T(64, 32, 4), 80: _T(64, 32, 4),
                   32: _T(64, 64, 4)},
        "bwd_dkv": {256: None, 128: _T(16, 64, 4), 96: _T(16, 64, 4)},
    },
    (8, 6): _SM86_89_TF32,
    (8, 9): _SM86_89_TF32,
    (9, 0): {
        # 80: the 16-bit entry before 128x32x4 (which spills 84 bytes in float32)
        "fwd": {256: None, 128: _T(64, 32, 4), 96: _T(64, 32, 4), 80: _T(128, 64, 8),
                64: _T(64, 64, 4)},
        "fwd_decode": {256: None, 96: _T(16, 16, 1), 80: _T(16, 16, 1)},
        "bwd_dq": {256: None, 128: _T(64, 32, 4), 96: _T(64, 16, 4), 80: _T(64, 32, 4),
                   64: _T(64, 32, 4), 16: _T(64, 64, 4)},
        "bwd_dkv": {256: None, 128: _T(16, 64, 4),
                    64: {(None, True): _T(32, 64, 4), (None, None): _T(64, 64, 4)},
                    16: _T(64, 64, 4)},
    },
}

#: Table entries that belong to a mirrored A/B macro (the mirrors above, by name): while the
#: mirror is on (:func:`apply_kernel_macros`, which tests/conftest.py's ``PW_TEST_MACROS`` and
#: the probes call), these replace TABLE's for dense 16-bit variants, so that the GPU suite
#: runs the macro's kernels at the shapes they are staged for before the macro becomes the
#: default (then the entry moves into TABLE). Same layout as TABLE. It holds nothing now:
#: PW_FWD_Q_ROTATE's entry (sm_90 fwd D = 128, 128x64x4) and PW_FWD_ONE_K_D64's (sm_90 fwd
#: D = 64, 128x128x4) moved into TABLE when those macros became the default (2026-12-05).
MACRO_TABLE: dict[str, dict[tuple[int, int], dict[str, dict[int, object]]]] = {}

del _T, _SM86_89_TF32, _PACKED_FUSED_SM8X

_NO_ENTRY = object()


def _table_entry(arch, phase: str, head_dim: int, varlen: bool, dtype: str = "bfloat16"):
    """The table's entry (TileConfig, refinement dict, or None: nothing fits) for a variant."""
    if dtype == "float32":
        entry = TF32_TABLE.get(arch, {}).get(phase, {}).get(head_dim, _NO_ENTRY)
        if entry is not _NO_ENTRY:
            return entry
    if varlen:
        entry = VARLEN_TABLE.get(arch, {}).get(phase, {}).get(head_dim)
        if entry is not None:
            return entry
    elif dtype != "float32":
        for mirror, rows in MACRO_TABLE.items():
            entry = rows.get(arch, {}).get(phase, {}).get(head_dim) if globals()[mirror] else None
            if entry is not None:
                return entry
    return TABLE[arch][phase].get(head_dim)


def head_dims(cc: tuple[int, int]) -> tuple[int, ...]:
    """Head dims the table has entries for on ``cc`` (after fallback)."""
    arch = resolve_arch(cc)
    return tuple(sorted(TABLE[arch]["fwd"]))


def elem_bytes(dtype: str) -> int:
    """Bytes of one element of ``dtype`` in the kernels' shared-memory tiles (4 for
    float32, 2 for float16 and bfloat16)."""
    return 4 if dtype == "float32" else 2


def has_float32_kernels(cc: tuple[int, int], head_dim: int) -> bool:
    """Whether float32 inputs of ``head_dim`` run on a GPU of compute capability ``cc``:
    every mma.sync phase (forward, decode forward, dq, dk/dv) has a float32 (TF32) tile
    there. False where :data:`TF32_TABLE` says no kernel (head dim 256 everywhere) or no
    tile fits; those calls raise ValueError before any kernel runs."""
    try:
        for phase in ("fwd", "fwd_decode", "bwd_dq", "bwd_dkv"):
            lookup(cc, phase, head_dim, "float32", False)
    except ValueError:
        return False
    return True


def _limit_for(cc: tuple[int, int], max_shared: int | None) -> int:
    if cc in SHARED_LIMIT:
        return SHARED_LIMIT[cc]
    if max_shared is not None:
        return int(max_shared)
    return min(SHARED_LIMIT[a] for a in LISTED_ARCHS)


def check_config(
    phase: str, head_dim: int, cfg: TileConfig, cc: tuple[int, int], *, max_shared: int | None = None, elem_bytes: int = 2
) -> list[str]:
    """Return the list of constraints ``cfg`` breaks (empty when it is valid)."""
    problems = []
    if phase not in PHASES:
        return [f"unknown phase {phase!r}; phases are {', '.join(PHASES)}"]
    for field in ("block_m", "block_n"):
        value = getattr(cfg, field)
        if value not in BLOCK_SIZES:
            problems.append(f"{field}={value} is not one of {BLOCK_SIZES}")
    if cfg.num_warps < 1:
        problems.append(f"num_warps={cfg.num_warps} must be at least 1")
    stages = KV_STAGES if phase in KV_PHASES else STAGES
    if cfg.stages not in stages:
        problems.append(f"stages={cfg.stages} is not one of {stages}")
    if phase in KV_PHASES:
        if cfg.block_m != 16:
            problems.append(f"{phase} packs 16 query rows: block_m must be 16, got {cfg.block_m}")
        if cfg.block_n != 16 * cfg.num_warps:
            problems.append(f"{phase} needs block_n == 16 * num_warps (16 keys per warp), got "
                            f"block_n={cfg.block_n}, num_warps={cfg.num_warps}")
    rows_field = "block_n" if phase in ("bwd_dkv", "bwd_fused") + KV_PHASES else "block_m"
    rows = getattr(cfg, rows_field)
    if phase == "bwd_grid":
        # pw_backward_grid's warp grid (BwdGridTraits): (block_n / 32) x 2 warps
        if cfg.block_m != 64 or cfg.num_warps not in (4, 8) or cfg.block_n != 16 * cfg.num_warps:
            problems.append(f"bwd_grid needs block_m == 64, num_warps 4 or 8 and block_n == "
                            f"16 * num_warps, got {cfg}")
        elif not _grid_dq_tiles_fit(head_dim, cfg.num_warps):
            problems.append(f"bwd_grid's dQ warp tiles (32 queries x 16-32 columns, whole tiles "
                            f"per warp) do not cover head_dim {head_dim} with {cfg.num_warps} warps")
        if cfg.stages != 2:
            problems.append(f"bwd_grid double-buffers its query tiles: stages must be 2, "
                            f"got {cfg.stages}")
    elif rows not in (16 * cfg.num_warps, 32 * cfg.num_warps):
        problems.append(
            f"{phase} needs {rows_field} == 16 * num_warps or 32 * num_warps (each warp owns 16 or "
            f"32 rows), got {rows_field}={rows}, num_warps={cfg.num_warps}")
    if not problems:
        need = shared_bytes(phase, head_dim, cfg, elem_bytes)
        limit = _limit_for(cc, max_shared)
        if need > limit:
            problems.append(
                f"needs {need} bytes of shared memory for head_dim {head_dim}, more than the "
                f"{limit} bytes per block of sm_{cc[0]}{cc[1]}"
            )
    return problems


def resolve_arch(cc: tuple[int, int], max_shared: int | None = None) -> tuple[int, int]:
    """The listed architecture whose entries serve ``cc`` (see the module doc)."""
    cc = (int(cc[0]), int(cc[1]))
    if cc < (8, 0):
        raise ValueError(
            f"GPU of compute capability {cc[0]}.{cc[1]} (sm_{cc[0]}{cc[1]}) is not supported: "
            "cupy-piecewise needs sm_80 (Ampere) or newer"
        )
    if cc in TABLE:
        return cc
    limit = _limit_for(cc, max_shared)
    for arch in sorted((a for a in LISTED_ARCHS if a <= cc), reverse=True):
        fits = all(
            shared_bytes(phase, d, cfg) <= limit
            for phase in PHASES
            for d, entry in TABLE[arch][phase].items()
            for cfg in _entry_configs(entry)
        )
        if fits:
            return arch
    return min(LISTED_ARCHS, key=lambda a: SHARED_LIMIT[a])


def _entry_configs(entry) -> list[TileConfig]:
    if entry is None:
        return []
    return [entry] if isinstance(entry, TileConfig) else [c for c in entry.values() if c is not None]


def _refine(entry, dtype: str, causal: bool) -> TileConfig:
    if isinstance(entry, TileConfig):
        return entry
    for key in ((dtype, causal), (dtype, None), (None, causal), (None, None)):
        if key in entry:
            return entry[key]
    raise KeyError(f"table refinement has no default (None, None) entry: {entry!r}")


def parse_tiles(spec: str, what: str) -> TileConfig:
    """``"BMxBNxWARPS[xSTAGES]"`` (e.g. ``"128x64x8"``) as a TileConfig; ValueError naming
    ``what`` (the variable or option it came from) otherwise."""
    try:
        numbers = [int(n) for n in spec.strip().lower().split("x")]
    except ValueError:
        numbers = []
    if len(numbers) not in (3, 4):
        raise ValueError(f"{what}: cannot read tile sizes {spec!r}; expected BMxBNxWARPS[xSTAGES] "
                         "(CUPY_PIECEWISE_TILES format), e.g. 128x64x8")
    return TileConfig(*numbers)


def parse_override(text: str, source: str = ENV_VAR) -> dict[str, TileConfig]:
    """Parse ``"fwd=128x64x8,bwd_dq=64x64x4"`` into ``{phase: TileConfig}``."""
    result: dict[str, TileConfig] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        phase, sep, spec = item.partition("=")
        phase = phase.strip()
        if not sep or phase not in PHASES:
            raise ValueError(
                f"{source}: cannot read {item!r}; expected PHASE=BMxBNxWARPS[xSTAGES] with PHASE one of "
                f"{', '.join(PHASES)}, e.g. CUPY_PIECEWISE_TILES='fwd=128x64x8,bwd_dq=64x64x4'"
            )
        result[phase] = parse_tiles(spec, f"{source} ({phase})")
    return result


def lookup(
    cc: tuple[int, int],
    phase: str,
    head_dim: int,
    dtype: str,
    causal: bool,
    override: Mapping[str, TileConfig] | None = None,
    *,
    max_shared: int | None = None,
    varlen: bool = False,
) -> TileConfig:
    """Tile sizes for one kernel variant on a GPU of compute capability ``cc``.

    ``override`` (``{phase: TileConfig}``) wins over the ``CUPY_PIECEWISE_TILES``
    environment variable, which wins over the table. ``max_shared`` is the GPU's
    opt-in shared memory per block, used only when ``cc`` is not in
    :data:`SHARED_LIMIT`. ``varlen``: the tiles of the packed-batch kernel of ``phase``
    (:data:`VARLEN_TABLE` where it has an entry, else the table's).

    Raises:
        ValueError: unknown phase, head_dim without an entry, dtype the table
            does not cover, GPU older than sm_80, or an override breaking a
            constraint (message names CUPY_PIECEWISE_TILES).
    """
    cc = (int(cc[0]), int(cc[1]))
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {', '.join(PHASES)}, got {phase!r}")
    dtypes = HALF_DTYPES if phase in HALF_ONLY_PHASES else TABLE_DTYPES
    if dtype not in dtypes:
        raise ValueError(f"dtype {dtype!r} has no tile table for {phase}; expected one of "
                         f"{', '.join(dtypes)}")
    arch = resolve_arch(cc, max_shared)
    if (dtype == "float32" and head_dim in TABLE[arch][phase]
            and _table_entry(arch, phase, head_dim, varlen, dtype) is None):
        # no float32 kernel at this head dim, whatever tiles an override names
        raise ValueError(
            f"head_dim {head_dim} with float32 inputs has no kernel on sm_{arch[0]}{arch[1]} "
            "(capability.TF32_TABLE: its tiles of 4-byte elements do not fit the shared memory "
            "or the registers); use bfloat16 or float16 inputs at this head dim")

    chosen = None
    source = None
    if override is not None and phase in override:
        chosen, source = override[phase], f"override[{phase!r}] (same rules as {ENV_VAR})"
        if not isinstance(chosen, TileConfig):
            raise ValueError(f"{source} must be a TileConfig, got {type(chosen).__qualname__}")
    else:
        env = (env_override() or "").strip()
        if env:
            parsed = parse_override(env)
            if phase in parsed:
                chosen, source = parsed[phase], f"{ENV_VAR}={env!r}"
    if chosen is not None:
        problems = check_config(phase, head_dim, chosen, cc, max_shared=max_shared, elem_bytes=elem_bytes(dtype))
        if problems:
            raise ValueError(f"{source}: tiles {chosen} for {phase} are invalid: " + "; ".join(problems))
        return chosen

    if varlen and phase not in VARLEN_PHASES:
        raise ValueError(f"phase {phase!r} has no packed-batch kernel; those are {VARLEN_PHASES}")
    entry = _table_entry(arch, phase, head_dim, varlen, dtype)
    if entry is None:
        raise ValueError(
            f"head_dim {head_dim} has no tile entry; expected one of "
            f"{', '.join(str(d) for d in sorted(TABLE[arch][phase]))}"
        )
    chosen = _refine(entry, dtype, bool(causal))
    if chosen is None:  # a refinement to None: bwd_fused where the two-kernel scheme runs
        raise ValueError(f"{phase} has no tiles for head_dim {head_dim}, {dtype}, causal={causal} "
                         f"on sm_{arch[0]}{arch[1]} (fused_backward_tiles says None there)")
    if dtype == "float32" and cc not in SHARED_LIMIT:
        # resolve_arch picked the table by its 16-bit tiles; 4-byte rows may not fit a GPU
        # whose limit is between the two (TF32_TABLE fits every listed architecture)
        problems = check_config(phase, head_dim, chosen, cc, max_shared=max_shared,
                                elem_bytes=elem_bytes(dtype))
        if problems:
            raise ValueError(f"float32 tiles {chosen} for {phase} at head_dim {head_dim} on "
                             f"sm_{cc[0]}{cc[1]}: " + "; ".join(problems))
    return chosen


def selectable_configs(cc: tuple[int, int], *, max_shared: int | None = None,
                       varlen: bool = False) -> set[tuple[str, int, str, bool, TileConfig]]:
    """Every (phase, head_dim, dtype, causal, TileConfig) the table can select on ``cc``;
    with ``varlen``, those of the packed-batch kernels (phases :data:`VARLEN_PHASES`).

    Ignores ``CUPY_PIECEWISE_TILES``: this is what the build check compiles.
    """
    cc = (int(cc[0]), int(cc[1]))
    arch = resolve_arch(cc, max_shared)
    out = set()
    for phase in (VARLEN_PHASES if varlen else PHASES):
        dims = set(TABLE[arch][phase])
        if varlen:  # packed-only entries (bwd_fused where the dense row has bwd_grid)
            dims |= set(VARLEN_TABLE.get(arch, {}).get(phase, {}))
        for head_dim in sorted(dims):
            for dtype in (HALF_DTYPES if phase in HALF_ONLY_PHASES else TABLE_DTYPES):
                entry = _table_entry(arch, phase, head_dim, varlen, dtype)
                if entry is None:  # float32 where no tile fits (TF32_TABLE)
                    continue
                for causal in (False, True):
                    tiles = _refine(entry, dtype, causal)
                    if tiles is not None:  # bwd_fused refined to None: no fused kernel there
                        out.add((phase, head_dim, dtype, causal, tiles))
    return out


def fused_backward_tiles(cc: tuple[int, int], head_dim: int, dtype: str, causal: bool, *,
                         varlen: bool = False, max_shared: int | None = None):
    """Tiles of the one-kernel mma.sync backward (phase ``bwd_fused``) for this variant, or
    None where it has none and the deterministic two-kernel scheme runs instead: float32
    inputs, head dims without a ``bwd_fused`` entry, and entries refined to None (where the
    H200 measured the two-kernel scheme as fast or faster; see the sm_90 row). A
    ``bwd_fused`` tile override (``CUPY_PIECEWISE_TILES``) forces the fused kernel.

    Raises:
        ValueError: as :func:`lookup` (a bad override, an unsupported GPU).
    """
    if dtype not in HALF_DTYPES:
        return None
    env = (env_override() or "").strip()
    if env and "bwd_fused" in parse_override(env):
        return lookup(cc, "bwd_fused", head_dim, dtype, causal, max_shared=max_shared,
                      varlen=varlen)
    arch = resolve_arch(cc, max_shared)
    entry = _table_entry(arch, "bwd_fused", head_dim, varlen, dtype)
    if entry is None or _refine(entry, dtype, bool(causal)) is None:
        return None
    return lookup(cc, "bwd_fused", head_dim, dtype, causal, max_shared=max_shared, varlen=varlen)


def grid_backward_tiles(cc: tuple[int, int], head_dim: int, dtype: str, causal: bool, *,
                        varlen: bool = False, max_shared: int | None = None):
    """Tiles of the warp-grid one-kernel backward (phase ``bwd_grid``) for this variant, or
    None where it does not run: float32 inputs, packed batches (no packed build), head dims
    without a ``bwd_grid`` entry, and a ``bwd_fused`` tile override (``CUPY_PIECEWISE_TILES``)
    without a ``bwd_grid`` one, which forces the earlier one-kernel backward. A ``bwd_grid``
    override forces this one. Where it returns tiles, the mma.sync backward's one-kernel
    scheme runs ``bwd_grid`` instead of ``bwd_fused``.

    Raises:
        ValueError: as :func:`lookup` (a bad override, an unsupported GPU).
    """
    if dtype not in HALF_DTYPES or varlen:
        return None
    env = (env_override() or "").strip()
    parsed = parse_override(env) if env else {}
    if "bwd_grid" in parsed:
        return lookup(cc, "bwd_grid", head_dim, dtype, causal, max_shared=max_shared)
    if "bwd_fused" in parsed:
        return None
    arch = resolve_arch(cc, max_shared)
    entry = _table_entry(arch, "bwd_grid", head_dim, False, dtype)
    if entry is None or _refine(entry, dtype, bool(causal)) is None:
        return None
    return lookup(cc, "bwd_grid", head_dim, dtype, causal, max_shared=max_shared)
