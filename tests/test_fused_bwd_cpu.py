"""The fused mma.sync backward's bookkeeping, mirrored in Python (kernels_cu/backward.cu):

- ``add_dq`` splits dS·K of a (BM x D) query tile into (16-row block, 16-column pair) units
  among the block's warps; every unit must be computed by exactly one warp, for every tile
  shape the table selects and the shapes the GPU tests force;
- the key-major dS buffer (pitch BM + 8 16-bit entries, traits.cuh ``ds_pitch``) must keep
  the 32-bit stores of a fragment row and the eight 16-byte rows of an ldmatrix phase in
  distinct banks.
No GPU needed."""
from __future__ import annotations

import itertools

import pytest

from cupy_piecewise import capability

FORCED = [(16, "64x64x4"), (32, "64x64x4"), (64, "32x128x4"), (80, "16x64x4"), (96, "32x64x4"),
          (128, "16x128x8"), (256, "16x64x4")]  # tests/test_kernels_gpu.py's forced shapes


def _units(bm: int, d: int, warps: int) -> list[tuple[int, int]]:
    """The (row block, column pair) units each warp of add_dq computes, in order."""
    r, cp_count = bm // 16, d // 16
    assert r % warps == 0 or warps % r == 0, "add_dq's static_assert"
    rpw = r // warps if r >= warps else 1
    wpr = 1 if r >= warps else warps // r
    out = []
    for warp in range(warps):
        for i in range(rpw):
            rb = warp * rpw + i if r >= warps else warp // wpr
            out += [(rb, cp) for cp in range(warp % wpr if wpr > 1 else 0, cp_count, wpr)]
    return out


def _shapes():
    seen = set()
    for cc in capability.LISTED_ARCHS:
        for vl in (False, True):
            for phase, d, _, _, t in capability.selectable_configs(cc, varlen=vl):
                if phase == "bwd_fused":
                    seen.add((d, t.block_m, t.block_n, t.num_warps))
    for d, spec in FORCED:
        t = capability.parse_override(f"bwd_fused={spec}")["bwd_fused"]
        seen.add((d, t.block_m, t.block_n, t.num_warps))
    return sorted(seen)


@pytest.mark.parametrize("d,bm,bn,warps", _shapes())
def test_add_dq_computes_every_unit_exactly_once(d, bm, bn, warps):
    units = _units(bm, d, warps)
    assert sorted(units) == sorted(itertools.product(range(bm // 16), range(d // 16)))


@pytest.mark.parametrize("bm", capability.BLOCK_SIZES)
def test_ds_buffer_pitch_is_bank_conflict_free(bm):
    pitch_bytes = 2 * (bm + 8)
    assert pitch_bytes % 16 == 0  # ldmatrix rows and the buffer stay 16-byte aligned
    for base_col in range(0, bm, 8):  # the 8 x 8 matrix at query columns base_col..
        # ldmatrix phase: eight 16-byte rows (keys 0..7), each four 4-byte banks
        banks = [((k * pitch_bytes + 2 * base_col) // 4 + j) % 32 for k in range(8) for j in range(4)]
        assert len(set(banks)) == 32, (bm, base_col)
    # stash_ds: lane (g, t) stores 32 bits at key row g, query column 2t of an 8-column block
    for nb in range(bm // 8):
        banks = [((g * pitch_bytes + 2 * (nb * 8 + 2 * t)) // 4) % 32 for g in range(8) for t in range(4)]
        assert len(set(banks)) == 32, (bm, nb)
