"""CPU build check of the Hopper backward prototype (kernels_cu/sm90/backward.cu).

Compiles every instantiation (bf16/fp16 x D 64/128 x causal x fused dQ or not, plus the prep
and dQ-convert kernels) for sm_90a with NVRTC, no GPU needed, and checks ptxas's report (no
spills, no wgmma serialisation) and that the PTX holds the Hopper instructions the design
relies on. The host-side mirrors in scripts/hopper_bwd_probe.py (shared-memory size, packed
parameter sizes) are checked against the C++ definitions by static_asserts compiled here.

The register budget is tight at D = 128 (consumer peak about 236 of 240 with fused dQ):
a change that makes ptxas spill or serialise wgmma (C7512/C7515) fails here.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import sm90_build  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ELEM = {"bfloat16": "pw90::bf16", "float16": "pw90::f16"}


def _main(t, d, c, q, varlen=False, dv=None):
    flags = ", true" if varlen else ""  # the packed-batch build (VARLEN)
    if dv is not None:  # head dims 80/96: the D = 128 kernel storing DV columns
        flags = f", {'true' if varlen else 'false'}, {dv}"
    return f"pw90_bwd<{ELEM[t]}, {d}, {'true' if c else 'false'}, {'true' if q else 'false'}{flags}>"


MAIN = ([(t, d, c, q, vl, None) for t in ELEM for d in (64, 128) for c in (False, True)
         for q in (True, False) for vl in (False, True)]
        + [(t, 128, c, q, vl, dv) for t in ELEM for c in (False, True) for q in (True, False)
           for vl in (False, True) for dv in (80, 96)])
HELPERS = ([f"pw90_bwd_{k}<{ELEM[t]}, {d}{vl}>" for k in ("prep", "dq_convert") for t in ELEM
            for d in (64, 128) for vl in ("", ", true")]
           # head dims 80/96: the D = 128 helpers touching DV columns, as the package launches them
           + [f"pw90_bwd_{k}<{ELEM[t]}, 128, {vl}, {dv}>" for k in ("prep", "dq_convert")
              for t in ELEM for vl in ("false", "true") for dv in (80, 96)])
NAMES = [_main(*k) for k in MAIN] + HELPERS


def _known_gap(t, d, c, q, varlen, dv):
    """Instantiations allowed to spill or serialise wgmma (xfail): none at present."""
    return False


def _probe():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import hopper_bwd_probe
    finally:
        sys.path.pop(0)
    return hopper_bwd_probe


@pytest.fixture(scope="module")
def build():
    probe = _probe()
    src = ("\nstatic_assert(pw90::bwd::Smem<64>::BYTES == %d, \"probe smem_bytes(64)\");"
           "\nstatic_assert(pw90::bwd::Smem<128>::BYTES == %d, \"probe smem_bytes(128)\");"
           "\nstatic_assert(sizeof(pw90::bwd::BwdParams) == %d, \"probe _BWD_PARAMS\");"
           "\nstatic_assert(sizeof(pw90::bwd::PrepParams) == %d, \"probe _PREP_PARAMS\");"
           "\nstatic_assert(sizeof(pw90::bwd::ConvertParams) == %d, \"probe _CONV_PARAMS\");\n"
           % (probe.smem_bytes(64), probe.smem_bytes(128), probe._BWD_PARAMS.size,
              probe._PREP_PARAMS.size, probe._CONV_PARAMS.size))
    # the probe's host-side mirrors must match the C++ layout (static_asserts above)
    return sm90_build.build("sm90/backward.cu", NAMES, extra_source=src)


def _check_clean(build, name):
    log, _, lowered, blocks = build
    text = blocks.get(lowered[name])
    assert text is not None, f"no ptxas report for {name}"
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    assert m and re.search(r"Used \d+ registers", text), text
    assert m.groups() == ("0", "0", "0"), f"{name}: stack/spills {m.groups()}\n{text}"
    serial = [ln for ln in log.splitlines()
              if ("serialized" in ln or "C751" in ln) and lowered[name] in ln]
    assert not serial, "\n".join(serial)


@pytest.mark.parametrize("key", MAIN, ids=[_main(*k) for k in MAIN])
def test_main_kernel_no_spills_no_serialisation(build, key, request):
    if _known_gap(*key):
        request.applymarker(pytest.mark.xfail(
            reason="known register-pressure gap (spills / wgmma serialised)",
            strict=False))
    _check_clean(build, _main(*key))


@pytest.mark.parametrize("name", HELPERS)
def test_helper_kernels_no_spills(build, name):
    _check_clean(build, name)


def test_ptx_uses_hopper_instructions(build):
    ptx = build[1]
    assert ".target sm_90a" in ptx
    for needle in ("wgmma.mma_async.sync.aligned.m64n", "wgmma.fence.sync.aligned",
                   "cp.async.bulk.tensor.4d", "cp.async.bulk.shared::cluster.global.mbarrier",
                   "mbarrier.try_wait.parity", "setmaxnreg.inc", "setmaxnreg.dec",
                   "red.global.add.v4.f32", "fence.proxy.async", ".tensormap"):
        assert needle in ptx, needle
    # dV += Pᵀ·dO and dK += dSᵀ·Q: A from registers, B MN-major (imm-trans-b = 1)
    assert re.search(r"wgmma\.mma_async[^;]*\{%r\d+, ?%r\d+, ?%r\d+, ?%r\d+\}, %rd\d+, p, 1, 1, 1;", ptx)
    # dQ = dS·K: both operands from shared memory, both MN-major (imm-trans-a = imm-trans-b = 1)
    assert re.search(r"wgmma\.mma_async[^;]*\}, %rd\d+, %rd\d+, p, 1, 1, 1, 1;", ptx)


def test_every_instantiation_has_a_report(build):
    _, _, lowered, blocks = build
    missing = [n for n in NAMES if lowered[n] not in blocks]
    assert not missing, missing


# ---------------------------------------------------------------- tile walk (pure Python mirror)
# A line-by-line mirror of the kernel's bookkeeping (Walk, block_mode, the per-warpgroup
# live / wmode / split / edge / keep tests of consumer()), checked on many shapes: every
# admissible (query, key) pair must be processed exactly once, in pass 1 when d < w and in pass 2
# when d >= w, and every visited tile must lie inside the producer's ranges.
_BM, _BN = 64, 128


def _fdiv(a, b):
    return a // b  # Python's // is floor division, as floor_div in the kernel


def _cdiv(a, b):
    return -((-a) // b)


def _clamp(x, lo, hi):
    return max(lo, min(hi, x))


def _block_mode(causal, q0, qn, k0, kn, P, w):
    dmin = q0 + P - (k0 + kn - 1)
    dmax = q0 + qn - 1 + P - k0
    if causal and dmin < 0:
        dmin = 0
    return (1 if dmin < w else 0) | (2 if dmax >= w else 0)


def _walk(causal, M, N, w, n0):
    P = N - M
    thi = (M + _BM - 1) // _BM
    tlo = _clamp(_fdiv(n0 - P, _BM), 0, thi) if causal else 0
    end1 = _clamp(_cdiv(w - P + n0 + _BN - 1, _BM), tlo, thi)
    first2 = _clamp(_cdiv(w - P + n0 - _BM + 1, _BM), tlo, thi)
    return {1: (tlo, end1), 2: (first2, thi)}


def _visit(causal, M, N, w, n0, pair, t):
    P = N - M
    if causal and t * _BM + _BM - 1 + P - n0 < 0:
        return False
    return bool(_block_mode(causal, t * _BM, _BM, n0, _BN, P, w) & pair)


def _covered(causal, M, N, w):
    import numpy as np

    P = N - M
    nd = M + N + 1
    w = max(-nd, min(nd, w))
    count = {1: np.zeros((M, N), int), 2: np.zeros((M, N), int)}
    for n0 in range(0, N, _BN):
        rng = _walk(causal, M, N, w, n0)
        for pair in (1, 2):
            lo, hi = rng[pair]
            for t in range(lo, hi):
                if not _visit(causal, M, N, w, n0, pair, t):
                    continue
                m0 = t * _BM
                for wg in (0, 1):
                    kw0 = n0 + 64 * wg
                    dmin, dmax = m0 + P - (kw0 + 63), m0 + _BM - 1 + P - kw0
                    live = kw0 < N and (not causal or dmax >= 0)
                    wmode = _block_mode(causal, m0, _BM, kw0, 64, P, w)
                    if not live or not (wmode & pair):
                        continue
                    split = wmode == 3
                    edge = kw0 + 64 > N or (causal and dmin < 0)
                    for kr in range(kw0, kw0 + 64):
                        for q in range(m0, m0 + _BM):
                            if q >= M:  # the kernel zeroes these through lse2 = +inf
                                continue
                            d = q + P - kr
                            keep = (not edge) or (kr < N and (not causal or d >= 0))
                            keep = keep and (not split or (d < w if pair == 1 else d >= w))
                            if keep:
                                count[pair][q, kr] += 1
    return count, w


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("M,N", [(1, 77), (50, 50), (200, 200), (300, 130), (130, 300), (257, 385)])
@pytest.mark.parametrize("w", [-1000, -200, -3, 0, 5, 37, 64, 128, 129, 300, 5000])
def test_tile_walk_covers_every_pair_once(causal, M, N, w):
    import numpy as np

    count, wc = _covered(causal, M, N, w)
    q = np.arange(M)[:, None]
    k = np.arange(N)[None, :]
    d = q + (N - M) - k
    adm = np.ones((M, N), bool) if not causal else d >= 0
    want1 = (adm & (d < wc)).astype(int)
    want2 = (adm & (d >= wc)).astype(int)
    assert np.array_equal(count[1], want1), "pass 1 (d < w) coverage"
    assert np.array_equal(count[2], want2), "pass 2 (d >= w) coverage"


@pytest.mark.parametrize("seed", range(40))
def test_packed_statistics_layout_gives_each_sequence_its_own_tiles(seed):
    """The packed backward's padded statistics (kernels_cu/sm90/backward.cu, BwdSeq): sequence
    b's rows start at row0 = floor((cu_q[b] + 64 b) / 64) * 64, a multiple of 64; the
    ceil(M_b / 64) whole tiles the kernels touch there never reach the next sequence's row0,
    and all fit the Mpad rows launch.HopperBackward allocates (a multiple of 64, so that each
    head's rows start 16-byte aligned for the 1-D bulk copies)."""
    import math

    import numpy as np

    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 40))
    lens = rng.choice([0, 1, 63, 64, 65, 127, 128, 129, int(rng.integers(1, 3000))], size=B)
    cu = np.concatenate([[0], np.cumsum(lens)])
    bm = 64
    mpad = math.ceil((int(cu[-1]) + bm * B) / bm) * bm  # launch.HopperBackward, packed
    assert mpad % bm == 0
    row0 = [(int(cu[b]) + bm * b) // bm * bm for b in range(B)]
    ends = [r + math.ceil(int(m) / bm) * bm for r, m in zip(row0, lens)]
    assert all(r % bm == 0 for r in row0)
    assert all(e <= n for e, n in zip(ends, row0[1:] + [mpad])), (lens, row0, ends, mpad)


@pytest.mark.parametrize("D", [64, 128])
def test_dq_accumulator_order_is_a_permutation_fed_by_v4_reductions(D):
    """The dQ accumulator's order inside a 64-row query tile (dq_run in the kernel), mirrored:
    it must be a permutation of the tile's 64 x D floats; a column pair (c, c + 1) must be
    adjacent and 8-byte aligned; the four accumulator-fragment elements (hh, e) that a
    consumer thread holds for column block j of panel pn must be one 16-byte aligned run in
    fragment order dq[4 j + 2 hh + e] (one red.global.add.v4.f32), with a warp's 32 runs for
    one j contiguous (512 bytes per instruction); and the run that pw90_bwd_dq_convert's lane
    reads for row pair (i, i + 8) must hold rows i and i + 8 of columns 64 pn + 2 lane, + 1."""
    def dq_index(r, c):
        pn, cc = c // 64, c % 64
        wl, hh, lane, j = r // 16, (r % 16) // 8, (r % 8) * 4 + (cc % 8) // 2, cc // 8
        return pn * 4096 + ((j * 4 + wl) * 32 + lane) * 4 + 2 * hh + (cc % 2)

    seen = sorted(dq_index(r, c) for r in range(64) for c in range(D))
    assert seen == list(range(64 * D))
    for r in range(64):
        for c in range(0, D, 2):
            assert dq_index(r, c) % 2 == 0 and dq_index(r, c + 1) == dq_index(r, c) + 1
    for pn in range(D // 64):
        for wl in range(4):
            for j in range(8):
                starts = []
                for lane in range(32):
                    # element (hh, e) of the thread: row 16 wl + lane / 4 + 8 hh, column 8 j + 2 (lane % 4) + e
                    run = [dq_index(16 * wl + lane // 4 + 8 * hh, 64 * pn + 8 * j + 2 * (lane % 4) + e)
                           for hh in range(2) for e in range(2)]
                    assert run == list(range(run[0], run[0] + 4)) and run[0] % 4 == 0
                    starts.append(run[0])
                assert starts == list(range(starts[0], starts[0] + 128, 4))

    def dq_run(pn, wl, j, lane):  # the kernel's bwd::dq_run
        return pn * 4096 + ((j * 4 + wl) * 32 + lane) * 4

    for i in [r for r in range(64) if r % 16 < 8]:  # convert: warp i % 8 of the row pair's block
        for pn in range(D // 64):
            for lane in range(32):
                at = dq_run(pn, (i % 64) // 16, lane // 4, 4 * (i % 8) + lane % 4)
                c = 64 * pn + 2 * lane
                assert [at, at + 1, at + 2, at + 3] == [dq_index(i, c), dq_index(i, c + 1),
                                                         dq_index(i + 8, c), dq_index(i + 8, c + 1)]


@pytest.mark.parametrize("d", [64, 128])
def test_opt_in_dq_writer_build_compiles_with_its_shared_memory(d):
    """The opt-in dQ writer warp (-DPW90_BWD_DQ_WRITER=1, timed by scripts/hopper_bwd_probe.py;
    not a selectable variant) must keep compiling: Smem<D>::BYTES equal to
    capability.hopper_bwd_shared_bytes(D, dq_writer=True) (what the probe launches with),
    the kernel's setmaxnreg budget static_assert holding, the bulk reduce-add in the PTX, no
    wgmma serialisation and no spills (the build gives the producer warpgroup 32 registers
    and the consumers 232: at 24 the producer and writer threads spilled)."""
    from cupy_piecewise import capability

    name = _main("bfloat16", d, True, True)
    src = ("\nstatic_assert(pw90::bwd::Smem<%d>::BYTES == %d, \"hopper_bwd_shared_bytes(dq_writer)\");\n"
           % (d, capability.hopper_bwd_shared_bytes(d, dq_writer=True)))
    log, ptx, lowered, blocks = sm90_build.build("sm90/backward.cu", [name],
                                                 defines=("PW90_BWD_DQ_WRITER=1",), extra_source=src)
    assert "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" in ptx
    assert "st.shared.v4.f32" in ptx
    assert lowered[name] in blocks
    serial = [ln for ln in log.splitlines() if "serialized" in ln or "C751" in ln]
    assert not serial, "\n".join(serial)
    assert re.search(r"0 bytes spill stores, 0 bytes spill loads", blocks[lowered[name]]), blocks[lowered[name]]
