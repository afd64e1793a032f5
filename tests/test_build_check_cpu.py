"""The NVRTC build check without a GPU: one forward and one backward variant compile for
sm_90 with registers reported and no spills, and ``build_check.variants_for`` covers every
variant the tile table can select.

Needs NVRTC (the ``nvidia-cuda-nvrtc`` wheel in the ``test`` extra, loaded through CuPy);
where it cannot be loaded the compile test is skipped with the reason.
"""
from __future__ import annotations

import itertools
import time

import pytest

from cupy_piecewise import build_check, capability
from cupy_piecewise.compile import (HOPPER_KERNELS, ROTARY_LAYOUTS, ROW_KERNELS, Variant,
                                    compile_offline)

SM90 = (9, 0)



def _pick(phase, head_dim=64, dtype="float16", causal=False) -> Variant:
    matches = [v for v in build_check.variants_for(SM90) if not v.varlen and not v.rotary
               and (v.phase, v.head_dim, v.dtype, v.causal) == (phase, head_dim, dtype, causal)]
    assert len(matches) == 1, matches
    return matches[0]


def test_one_forward_and_one_backward_variant_compile_for_sm90_without_spills(nvrtc):
    t0 = time.perf_counter()
    reports = (compile_offline(SM90, [_pick("fwd", causal=True)])
               + compile_offline(SM90, [_pick("bwd_dq", dtype="bfloat16"),
                                        _pick("bwd_dkv", dtype="bfloat16")]))
    elapsed = time.perf_counter() - t0
    assert [r.variant.phase for r in reports] == ["fwd", "bwd_dq", "bwd_dkv"]
    for r in reports:
        where = f"{r.variant.name_expression} on {r.arch}:\n{r.log}"
        assert r.ok and r.arch == "sm_90", where
        assert r.registers is not None and 0 < r.registers <= 255, where
        assert r.spill_stores == 0 and r.spill_loads == 0, where
    assert elapsed < 15, f"compiling three variants took {elapsed:.1f} s"


def test_variants_cover_every_selectable_config_and_the_delta_prepass(monkeypatch):
    monkeypatch.delenv(capability.ENV_VAR, raising=False)
    capability.refresh_env_override()
    variants = build_check.variants_for(SM90)
    assert len(set(variants)) == len(variants)
    got = {(v.phase, v.head_dim, v.dtype, v.causal): v.tiles for v in variants
           if v.phase not in ROW_KERNELS and not v.varlen and not v.rotary}
    head_dims = capability.head_dims(SM90)
    assert set(head_dims) >= {16, 32, 64, 80, 96, 128, 256}
    table = capability.TABLE[SM90]

    # float32 (TF32) runs the mma.sync phases; the KV-cache ones and the fused backward are 16-bit
    def dtypes(phase):
        return capability.HALF_DTYPES if phase in capability.HALF_ONLY_PHASES else capability.TABLE_DTYPES

    def offered(ph, d, dt, c=False, varlen=False):
        # TF32_TABLE's None: no float32 kernel at that head dim; bwd_fused refined to None
        if ph == "bwd_fused":
            return capability.fused_backward_tiles(SM90, d, dt, c, varlen=varlen) is not None
        return not (dt == "float32" and capability.TF32_TABLE[SM90].get(ph, {}).get(d, 0) is None)

    expected = {(ph, d, dt, c) for ph in capability.PHASES for d in table[ph]
                for dt in dtypes(ph) for c in (False, True) if offered(ph, d, dt, c)}
    assert set(got) == expected
    assert "float32" in capability.TABLE_DTYPES
    for (phase, head_dim, dtype, causal), tiles in got.items():
        assert tiles == capability.lookup(SM90, phase, head_dim, dtype, causal), (phase, head_dim, dtype, causal)
    # the packed-batch (VARLEN) kernels, with their own tiles where VARLEN_TABLE says so
    packed = {(v.phase, v.head_dim, v.dtype, v.causal): v.tiles for v in variants if v.varlen}
    packed_dims = {ph: set(table[ph]) | set(capability.VARLEN_TABLE[SM90].get(ph, {}))
                   for ph in capability.VARLEN_PHASES}
    assert set(packed) == {(ph, d, dt, c) for ph in capability.VARLEN_PHASES
                           for d in packed_dims[ph] for dt in dtypes(ph) for c in (False, True)
                           if offered(ph, d, dt, c, varlen=True)}
    for (phase, head_dim, dtype, causal), tiles in packed.items():
        assert tiles == capability.lookup(SM90, phase, head_dim, dtype, causal, varlen=True)
    kv_dims = set(table["kvcache"])
    # the delta pre-pass, the split-KV combine, the KV append, the fused backward's dQ conversion
    for row_kernel in ROW_KERNELS:
        have = {(v.head_dim, v.dtype) for v in variants if v.phase == row_kernel}
        dims = kv_dims if row_kernel == "kv_append" else set(head_dims)
        half = row_kernel in ("kv_append", "bwd_dq_convert")
        kinds = capability.HALF_DTYPES if half else capability.TABLE_DTYPES
        if row_kernel == "bwd_dq_convert":  # beside every one-kernel backward, dense or packed
            assert have == ({(d, dt) for ph, d, dt, c in expected if ph in ("bwd_fused", "bwd_grid")}
                            | {(d, dt) for ph, d, dt, c in packed if ph == "bwd_fused"})
            continue
        assert have == {(d, dt) for d, dt in itertools.product(dims, kinds)
                        if offered("fwd", d, dt)}, row_kernel
    hopper = build_check.variants_for(SM90, hopper=True)
    # every Hopper kernel but the decode has a packed-batch (VARLEN) build: forward, backward
    # and its helpers
    assert {(v.phase, v.head_dim, v.dtype, v.causal) for v in hopper if v.varlen} == {
        (v.phase, v.head_dim, v.dtype, v.causal) for v in hopper
        if not v.varlen and v.phase != "kvdecode_sm90"}
    assert {v.phase for v in hopper if v.varlen} == set(HOPPER_KERNELS) - {"kvdecode_sm90"}
    # the decode: one build per dtype, KV90 head dim, cluster size (no causal flag: M = 1
    # sees every key) and rotary form (none, halves, interleaved); the rotary forms' staged
    # tables (rot_stage) at cluster 1 besides, and the paged D = 64 entry (page_box) of the
    # plain form at every cluster size
    decode = [(v.head_dim, v.dtype, v.causal, v.cluster, v.rotary, v.rot_stage, v.page_box)
              for v in hopper if v.phase == "kvdecode_sm90"]
    assert len(decode) == len(set(decode)) and set(decode) == set(itertools.product(
        capability.KV90_HEAD_DIMS, capability.HALF_DTYPES, (False,), range(1, 9),
        (0,) + tuple(ROTARY_LAYOUTS.values()), (False,), (False,))) | set(itertools.product(
        capability.KV90_HEAD_DIMS, capability.HALF_DTYPES, (False,), (1,),
        tuple(ROTARY_LAYOUTS.values()), (True,), (False,))) | set(itertools.product(
        (64,), capability.HALF_DTYPES, (False,), range(1, 9), (0,), (False,), (True,)))
    # the cp.async KV-cache kernels: both rotary forms of every selectable variant
    kv = {(v.phase, v.head_dim, v.dtype, v.causal, v.tiles) for v in variants
          if v.phase in capability.KV_PHASES and not v.rotary}
    assert kv and not any(v.rotary for v in variants if v.phase not in capability.KV_PHASES)
    for rot in ROTARY_LAYOUTS.values():
        assert {(v.phase, v.head_dim, v.dtype, v.causal, v.tiles) for v in variants
                if v.phase in capability.KV_PHASES and v.rotary == rot} == kv, rot
    bwd_dims = (64, 80, 96, 128)
    for phase, dims in (("fwd_sm90", (64, 80, 96, 128, 256)), ("bwd_sm90", bwd_dims),
                        ("bwd_sm90_det", bwd_dims)):
        assert {(v.head_dim, v.dtype, v.causal) for v in hopper if v.phase == phase} == set(
            itertools.product(dims, capability.HALF_DTYPES, (False, True))), phase
    assert {v.head_dim for v in hopper if v.phase in ("bwd_sm90_prep", "bwd_sm90_dq")} == set(bwd_dims)
    assert all(v.tiles is None for v in variants if v.phase in ROW_KERNELS)


def test_hopper_kernels_build_for_sm90a(capsys, nvrtc):
    """--arch sm_90a compiles every Hopper variant the launch layer can select (the names
    launch.HopperLaunches, varlen_launch.HopperVarlenLaunches and launch.HopperBackward ask
    for), with no spills: 20 forward (D 64, 80, 96, 128, 256), 32 backward (D 64, 80, 96,
    128; fused dQ or deterministic), 8 prep and 8 dQ-convert kernels, each dense and packed
    (VARLEN). 80 and 96 are the D = 128 kernels with DV columns stored. Plus the KV-cache
    decode: 120 builds (D 64 and 128, two dtypes, clusters of 1-8, without rotation and with
    each rotary layout; the rotary layouts' staged-table forms at cluster 1; the paged D = 64
    entry at every cluster size)."""
    assert build_check.main(["--arch", "sm_90a"]) == 0
    out = capsys.readouterr().out
    assert "256 variants compiled for sm_90a" in out
    assert "pw90_kvdecode_pages<bf16_t, 64, 6, 8, 4>" in out
    assert "pw90_kvdecode_rot<bf16_t, 128, 3, 4, 4, 2>" in out and "pw90_kvdecode<half_t, 64, 6, 1, 4>" in out
    assert "pw90_kvdecode_rot<bf16_t, 128, 3, 1, 4, 1, true>" in out
    for name in ("pw90_forward<pw90::f16, 256, true, true>", "pw90_forward<pw90::bf16, 128, false, false, 96>",
                 "pw90_bwd<pw90::f16, 128, true, true, true, 80>", "pw90_bwd_prep<pw90::bf16, 128, false, 96>",
                 "pw90_bwd_dq_convert<pw90::f16, 128, true, 80>"):
        assert name in out, name and "pw90_forward<pw90::bf16, 128, true>" in out
    assert "pw90_forward<pw90::f16, 64, false, true>" in out
    for name in ("pw90_bwd<pw90::f16, 128, true, true>", "pw90_bwd<pw90::bf16, 64, false, false>",
                 "pw90_bwd_prep<pw90::bf16, 64>", "pw90_bwd_dq_convert<pw90::f16, 128>",
                 "pw90_bwd<pw90::bf16, 128, true, true, true>",
                 "pw90_bwd<pw90::f16, 64, false, false, true>",
                 "pw90_bwd_prep<pw90::f16, 128, true>", "pw90_bwd_dq_convert<pw90::bf16, 64, true>"):
        assert name in out, name


def test_near_limit_flags_mma_variants_only():
    """Variants at 250+ registers are reported (not failed); Hopper kernels, which report
    their setmaxnreg entry cap, and failed builds are not flagged."""
    from cupy_piecewise.build_check import NEAR_LIMIT_REGISTERS, near_limit
    from cupy_piecewise.compile import BuildReport

    tiles = capability.lookup((9, 0), "bwd_dkv", 128, "bfloat16", False)
    mma = Variant("bwd_dkv", "bfloat16", 128, tiles, False)
    hopper = Variant("bwd_sm90", "bfloat16", 128, None, False)

    def report(v, regs, ok=True):
        return BuildReport(v, "sm_90", regs, 0, 0, 0, ok, "")

    assert near_limit(report(mma, NEAR_LIMIT_REGISTERS))
    assert not near_limit(report(mma, NEAR_LIMIT_REGISTERS - 1))
    assert not near_limit(report(hopper, 255))
    assert not near_limit(report(mma, 255, ok=False))


def _fused_sm90(varlen: bool = False) -> list:
    """The sm_90 row's one-kernel pw_backward_dkv (bwd_fused) variants: its packed-batch
    entries (VARLEN_TABLE), built dense (what a bwd_fused tile override runs: the dense
    row's entries until bwd_grid replaced them, 2026-12-05) or packed."""
    return [Variant("bwd_fused", dt, d, t, c, varlen=varlen)
            for phase, d, dt, c, t in capability.selectable_configs(SM90, varlen=True)
            if phase == "bwd_fused"]


def test_fused_backward_red2_form_builds_without_spills(nvrtc, monkeypatch):
    """-DPW_DQ_RED4=0 (kernels_cu/backward.cu: the fused backward's dQ added with 8-byte
    reductions, the form before the 16-byte lane swap became the default on sm_90;
    bench/NOTES.md) still compiles, without spills, for the sm_90 row's fused variants, so
    that an A/B run can build it: with the two-barrier tile loop of its day
    (-DPW_ONE_BARRIER=0; under one barrier, the default since 2026-12-06, the bfloat16
    D = 128 causal 32x64x4 entry spills 16 bytes in this form, not in the default's)."""
    from cupy_piecewise import compile as comp

    base = comp.arch_options
    monkeypatch.setattr(comp, "arch_options", lambda cc, hopper=False: base(cc, hopper) + (
        "-DPW_DQ_RED4=0", "-DPW_ONE_BARRIER=0"))
    vs = _fused_sm90()
    assert vs
    for r in compile_offline(SM90, vs):
        assert r.ok and not (r.spill_stores or r.spill_loads), (r.variant, r.log)


@pytest.mark.parametrize("split", [0, 1])
def test_score_mask_split_override_compiles(nvrtc, monkeypatch, split):
    """-DPW_SCORE_MASK_SPLIT=n (kernels_cu/common.cuh) overrides every score_tile call
    site's mask form for A/B runs: 0 the one-body mask of the tree before 2026-12-03, 1 the
    product copies (fastest in the forward, but spills in some entries:
    bench/results/2026-12-03-offline-score-mask-split). The defaults (2 in the backward and
    the forward at D >= 128) go through the build check; this checks that each override
    still builds the sm_90 row's dense mma.sync backward at D = 64 and 128."""
    from cupy_piecewise import compile as comp

    base = comp.arch_options
    monkeypatch.setattr(comp, "arch_options", lambda cc, hopper=False: base(cc, hopper) + (
        f"-DPW_SCORE_MASK_SPLIT={split}",))
    vs = sorted({Variant(phase, dt, d, t, c)
                 for phase, d, dt, c, t in capability.selectable_configs(SM90)
                 if phase in ("bwd_dq", "bwd_dkv", "bwd_grid") and d in (64, 128)
                 and dt == "bfloat16"}
                | {v for v in _fused_sm90() if v.dtype == "bfloat16"}, key=str)
    assert vs
    for r in compile_offline(SM90, vs):
        assert r.ok and r.registers, (r.variant, r.log)


@pytest.mark.parametrize("lazy", [0, 1])
def test_lazy_rescale_ab_builds_compile(nvrtc, monkeypatch, lazy):
    """kernels_cu/forward.cu rescales the output accumulator lazily (only when some row of the
    warp raised its max) at head dim 128 by default; the build check covers that default.
    The A/B builds -DPW_FWD_LAZY_RESCALE=0 (never) and =1 (at every head dim) build the sm_90
    row's dense 16-bit forward. =0 builds without spills at D = 64 (it was the default until
    2026-12-04) and at D = 128's previous entry, 128x32x4 (one key slot); at D = 128's entry
    since 2026-12-05, 128x64x4 in three rotating slots, the eager rescale spills 148 bytes
    (NVRTC 13.5), so there it is bounded at 192 bytes and stays an A/B build only: the lazy
    rescale is what lets the rotation fit. =1 at D = 64 only (at D = 128 it is the default's
    code, which the build check compiles). With =1 D = 64's non-causal 128x64x4 entry, at
    255 registers, spills 12/16 bytes (NVRTC 13.5, 2026-12-04): one reason the default
    leaves D = 64 eager."""
    from cupy_piecewise import compile as comp

    base = comp.arch_options
    monkeypatch.setattr(comp, "arch_options", lambda cc, hopper=False: base(cc, hopper) + (
        f"-DPW_FWD_LAZY_RESCALE={lazy}",))
    vs = {Variant(phase, dt, d, t, c)
          for phase, d, dt, c, t in capability.selectable_configs(SM90)
          if phase == "fwd" and d in ((64,) if lazy else (64, 128))
          and dt in capability.HALF_DTYPES}
    assert len(vs) == (4 if lazy else 8)
    rotating = {v for v in vs if capability.fwd_q_rotate(v.head_dim, v.tiles)}
    assert len(rotating) == (0 if lazy else 4)
    if lazy == 0:  # the entry before the rotation, which =0 must still build without spills
        vs |= {Variant("fwd", dt, 128, capability.TileConfig(128, 32, 4, 2), c)
               for dt in capability.HALF_DTYPES for c in (False, True)}
    for r in compile_offline(SM90, sorted(vs, key=str)):
        assert r.ok and r.registers, (r.variant, r.log)
        if lazy == 0:
            bound = 192 if r.variant in rotating else 0
            assert (r.spill_stores or 0) <= bound and (r.spill_loads or 0) <= bound, (r.variant, r.log)


@pytest.mark.parametrize("macros", [
    ("-DPW_BWD_P_FIXED_EXEMPT=1", "-DPW_BWD_TID_RELOAD=0", "-DPW_ONE_BARRIER=0"),
    ("-DPW_BWD_P_FIXED_EXEMPT=2", "-DPW_BWD_TID_RELOAD=2")])
def test_exempt_entry_forms_build_without_spills(nvrtc, monkeypatch, macros):
    """The causal D = 128 float16 one-kernel entry spills 16 bytes with the fixed P scale
    unless it re-reads threadIdx.x per tile (kernels_cu/backward.cu). The default
    (-DPW_BWD_P_FIXED_EXEMPT=2 -DPW_BWD_TID_RELOAD=2: the fixed scale with the reload in its
    dense form; the packed-batch form, which spills 8 bytes even so, keeps the per-row scale)
    and the earlier default's A/B form (EXEMPT=1 RELOAD=0: per-row scale in both forms, no
    reload, with the two-barrier tile loop of its day: under one barrier, the default since
    2026-12-06, its D = 128 fused entry spills 8 bytes) build every sm_90 float16 dk/dv and
    one-kernel variant at D = 64 and 128, dense and packed, without spills; the explicit
    default pins the pair against a change of the file's defaults."""
    from cupy_piecewise import compile as comp

    base = comp.arch_options
    monkeypatch.setattr(comp, "arch_options", lambda cc, hopper=False: base(cc, hopper) + macros)
    vs = sorted({Variant(phase, dt, d, t, c, varlen=varlen)
                 for varlen in (False, True)
                 for phase, d, dt, c, t in capability.selectable_configs(SM90, varlen=varlen)
                 if phase in ("bwd_dkv", "bwd_fused") and d in (64, 128) and dt == "float16"}
                | {v for v in _fused_sm90() if v.dtype == "float16"}, key=str)
    assert any(v.phase == "bwd_fused" and v.causal and v.head_dim == 128 and not v.varlen
               for v in vs)
    assert any(v.varlen for v in vs)
    for r in compile_offline(SM90, vs):
        assert r.ok and r.registers, (r.variant, r.log)
        assert not (r.spill_stores or r.spill_loads), (r.variant, r.log)


@pytest.mark.parametrize("skip", [0, 2])
def test_warp_skip_forward_ab_builds_compile(nvrtc, monkeypatch, skip):
    """The A/B forms of -DPW_FWD_WARP_SKIP (kernels_cu/forward.cu: in the rotating-slot
    forward a warp skips a masked visit none of whose elements is admissible; 1, the default
    since 2026-12-07 and the build check's, in both phases; 2 in the near phase only; 0 no
    skip, the default before) build every selectable sm_90 16-bit forward at D = 128, dense
    and packed, causal and not, without spills, so that an A/B run times spill-free builds.
    Only the rotating-slot entries change under it, and their spill-free form is fragile (a
    plain branch in the near loop spilled 68-144 bytes, a vote in the far loop 136: the
    macro's comment), which is what this pins."""
    from cupy_piecewise import compile as comp

    base = comp.arch_options
    monkeypatch.setattr(comp, "arch_options", lambda cc, hopper=False: base(cc, hopper) + (
        f"-DPW_FWD_WARP_SKIP={skip}",))
    vs = [v for v in build_check.variants_for(SM90) if v.phase == "fwd" and v.head_dim == 128
          and v.dtype in capability.HALF_DTYPES]
    assert sum(capability.fwd_q_rotate(v.head_dim, v.tiles) for v in vs) == 4  # not vacuous
    for r in compile_offline(SM90, vs):
        assert r.ok and r.registers, (r.variant, r.log)
        assert not (r.spill_stores or r.spill_loads), (r.variant, r.log)


@pytest.mark.parametrize("chunk", [0, 4])
def test_column_range_forward_ab_build_compiles(nvrtc, monkeypatch, chunk):
    """The A/B forms of the column-range masked visit (kernels_cu/forward.cu,
    PW_FWD_COL_RANGE; 2 by default since 2026-12-07, the build check's): 0, the full
    masked visit of every kernel before, and 4, chunks of four 16-key groups, build every
    selectable 16-bit forward of sm_80 to sm_90 without spills. Only the dense non-causal
    D = 64 kernels with 128-key tiles take the ranged visit (sm_90's 128x128x4 entry, bf16
    and fp16); the rest build the same code under every value, and the test asserts those
    two are among the variants built. Its spill-free form is fragile: plain branches on the
    range spilled 76-148 bytes at that entry, chunks of four 4 bytes there when causal
    kernels took it."""
    from cupy_piecewise import compile as comp

    base = comp.arch_options
    monkeypatch.setattr(comp, "arch_options", lambda cc, hopper=False: base(cc, hopper) + (
        f"-DPW_FWD_COL_RANGE={chunk}",))
    for cc in ((8, 0), (8, 6), (8, 9), SM90):
        vs = [v for v in build_check.variants_for(cc)
              if v.phase == "fwd" and v.dtype in capability.HALF_DTYPES]
        if cc == SM90:  # not vacuous: the ranged visit's two variants are built
            ranged = {v.dtype for v in vs if v.head_dim == 64 and not v.causal and not v.varlen
                      and v.tiles.block_n == 128}
            assert ranged == set(capability.HALF_DTYPES)
        for r in compile_offline(cc, vs):
            assert r.ok and r.registers, (r.variant, r.log)
            assert not (r.spill_stores or r.spill_loads), (r.variant, r.log)


_GRID_EARLIER = ("-DPW_GRID_STASH_PLAIN=0", "-DPW_GRID_FMA_EXP=0", "-DPW_DQ_PERM=0",
                 "-DPW_GRID_GEOM32=0")


@pytest.mark.parametrize("macros", [(m,) for m in _GRID_EARLIER] + [_GRID_EARLIER])
def test_one_kernel_backward_staged_ab_builds_compile(nvrtc, monkeypatch, macros):
    """The A/B forms of the one-kernel backwards' four cuts (kernels_cu/backward.cu; each 1
    by default since 2026-12-07, the build check's): -DPW_GRID_STASH_PLAIN=0 (the warp-grid
    backward stashes Pᵀ with the key check), -DPW_GRID_FMA_EXP=0 (its scores scaled in the
    score tile), -DPW_DQ_PERM=0 (the float32 dQ accumulator in natural column order, a lane
    swap before each 16-byte reduction) and -DPW_GRID_GEOM32=0 (the per-tile geometry in
    64-bit integers), each alone and all four (the default before), build every selectable
    warp-grid and fused backward, their delta pre-pass and dQ conversion, sm_80 to sm_90,
    dense and packed, without spills, so that an A/B run times spill-free builds."""
    from cupy_piecewise import compile as comp

    base = comp.arch_options
    monkeypatch.setattr(comp, "arch_options", lambda cc, hopper=False: base(cc, hopper) + macros)
    phases = ("bwd_grid", "bwd_fused", "bwd_dq_convert", "bwd_delta")
    for cc in ((8, 0), (8, 6), (8, 9), SM90):
        vs = [v for v in build_check.variants_for(cc) if v.phase in phases]
        assert {v.phase for v in vs} == set(phases) and any(v.varlen for v in vs)  # not vacuous
        for r in compile_offline(cc, vs):
            assert r.ok and r.registers, (r.variant, r.log)
            assert not (r.spill_stores or r.spill_loads), (r.variant, r.log)


def test_per_row_p_scale_ab_build_compiles(nvrtc, monkeypatch):
    """kernels_cu/backward.cu gives float16's P in the dk/dv kernel a fixed 2^14 by default
    (FixedP), except in the one entry where that spills; the build check covers the default.
    The A/B build -DPW_BWD_P_FIXED=0 (fit_rows' per-row scale everywhere, the default until
    2026-12-04) builds the sm_90 row's float16 dk/dv and one-kernel backward variants at
    D = 64 and 128 without spills, with the two-barrier tile loop of its day
    (-DPW_ONE_BARRIER=0: under one barrier its D = 128 fused entry spills 8 bytes)."""
    from cupy_piecewise import compile as comp

    base = comp.arch_options
    monkeypatch.setattr(comp, "arch_options", lambda cc, hopper=False: base(cc, hopper) + (
        "-DPW_BWD_P_FIXED=0", "-DPW_ONE_BARRIER=0"))
    vs = sorted({Variant(phase, dt, d, t, c)
                 for phase, d, dt, c, t in capability.selectable_configs(SM90)
                 if phase in ("bwd_dkv", "bwd_fused") and d in (64, 128) and dt == "float16"}
                | {v for v in _fused_sm90() if v.dtype == "float16"}, key=str)
    assert any(v.phase == "bwd_dkv" for v in vs) and any(v.phase == "bwd_fused" for v in vs)
    for r in compile_offline(SM90, vs):
        assert r.ok and r.registers, (r.variant, r.log)
        assert not (r.spill_stores or r.spill_loads), (r.variant, r.log)


@pytest.mark.parametrize("macro", ["PW_BWD_DS_PRESCALE=0", "PW_FIT_HEADROOM=0"])
def test_float16_ds_fit_ab_builds_compile(nvrtc, monkeypatch, macro):
    """The A/B builds of the float16 dS range fit (the build check covers the defaults)
    build the sm_90 row's float16 dq, dk/dv and one-kernel entries at every head dim without
    spills: -DPW_BWD_DS_PRESCALE=0 (kernels_cu/backward.cu: fit_rows' per-row fit, the
    default until 2026-12-04) and -DPW_FIT_HEADROOM=0 (kernels_cu/common.cuh: fit_scaled_rows
    rescales a row's largest |dS| to 2^14 rather than the default's 2^10, the default until
    2026-12-04)."""
    from cupy_piecewise import compile as comp

    base = comp.arch_options
    monkeypatch.setattr(comp, "arch_options", lambda cc, hopper=False: base(cc, hopper) + (
        f"-D{macro}",))
    vs = sorted({Variant(phase, dt, d, t, c)
                 for phase, d, dt, c, t in capability.selectable_configs(SM90)
                 if phase in ("bwd_dq", "bwd_dkv", "bwd_fused") and dt == "float16"}
                | {v for v in _fused_sm90() if v.dtype == "float16"}, key=str)
    assert {v.head_dim for v in vs} >= {64, 128}
    assert {v.phase for v in vs} == {"bwd_dq", "bwd_dkv", "bwd_fused"}
    for r in compile_offline(SM90, vs):
        assert r.ok and r.registers, (r.variant, r.log)
        assert not (r.spill_stores or r.spill_loads), (r.variant, r.log)


def test_q_rotate_forward_builds(nvrtc, monkeypatch):
    """The default build (kernels_cu/traits.cuh PW_FWD_Q_ROTATE 1 since 2026-12-05:
    forward.cu's three rotating Q-sized slots) builds the D = 128 forward at 128x64x4 in both
    dtypes, causal and not, dense and packed. The dense forms, TABLE's sm_90 entry, build
    without spills at 255 registers; packed batches spill 88-100/116 bytes (stores/loads;
    NVRTC 13.5, 2026-12-04) and keep another entry (VARLEN_TABLE); the bound catches a
    change that makes them worse. Some report must differ from the same variants built with
    -DPW_FWD_Q_ROTATE=0 (the earlier four-slot layout, whose dense non-causal forms spill 56
    bytes), so the macro is known to reach NVRTC and the default is known to be the
    rotation."""
    from cupy_piecewise import compile as comp

    t = capability.TileConfig(128, 64, 4, 2)
    vs = [Variant("fwd", dt, 128, t, c, varlen=vl) for vl in (False, True)
          for dt in capability.HALF_DTYPES for c in (False, True)]
    base = comp.arch_options

    def options(*extra):  # the macro as given here (none: the default), whatever PW_TEST_MACROS set
        return lambda cc, hopper=False: tuple(
            o for o in base(cc, hopper) if not o.startswith("-DPW_FWD_Q_ROTATE")) + extra

    monkeypatch.setattr(comp, "arch_options", options("-DPW_FWD_Q_ROTATE=0"))
    four_slots = {r.variant: (r.registers, r.stack_bytes, r.spill_stores, r.spill_loads)
                  for r in compile_offline(SM90, vs)}
    monkeypatch.setattr(comp, "arch_options", options())
    changed = []
    for r in compile_offline(SM90, vs):
        assert r.ok and r.registers, (r.variant, r.log)
        bound = 192 if r.variant.varlen else 0
        assert (r.spill_stores or 0) <= bound and (r.spill_loads or 0) <= bound, (r.variant, r.log)
        changed.append((r.registers, r.stack_bytes, r.spill_stores, r.spill_loads)
                       != four_slots[r.variant])
    # one NVRTC program with one option list: a report that moved shows the macro reached it
    assert any(changed), "no report differs from the build with -DPW_FWD_Q_ROTATE=0"


def _grid_variants(cc) -> list:
    """Every bwd_grid variant the table can select on ``cc`` (the test skips where none)."""
    vs = sorted({Variant(phase, dt, d, t, c)
                 for phase, d, dt, c, t in capability.selectable_configs(cc)
                 if phase == "bwd_grid"}, key=str)
    if not vs:
        pytest.skip(f"no bwd_grid entry for {cc}")
    return vs


@pytest.mark.parametrize("group1", [0, 1])
def test_grid_backward_division_forms_build_without_spills(nvrtc, monkeypatch, group1):
    """-DPW_GRID_GROUP1 (kernels_cu/backward.cu, pw_backward_grid's tile_of): 1, the default
    since 2026-12-05, skips the integer division from tile index to (query head, tile) when
    there is no GQA; 0 divides always (the A/B form, the kernel before). Both build every
    sm_90 bwd_grid variant without spills (the D = 128 causal entries take 255 registers with
    1, 253 with 0: NVRTC 13.5), so an A/B run can build either."""
    from cupy_piecewise import compile as comp

    base = comp.arch_options
    monkeypatch.setattr(comp, "arch_options",
                        lambda cc, hopper=False: base(cc, hopper) + (f"-DPW_GRID_GROUP1={group1}",))
    vs = _grid_variants(SM90)
    assert {v.head_dim for v in vs} >= {64, 128} and {v.causal for v in vs} == {False, True}
    for r in compile_offline(SM90, vs):
        assert r.ok and r.registers, (r.variant, r.log)
        assert not (r.spill_stores or r.spill_loads), (r.variant, r.log)


@pytest.mark.parametrize("cc", sorted(capability.TABLE))
def test_grid_backward_reload_modes_build_without_spills(nvrtc, monkeypatch, cc):
    """PW_GRID_TID_RELOAD (kernels_cu/backward.cu): the default, 2 since 2026-12-06, holds the
    warp-grid backward's lane- and warp-derived offsets across the tile loop at D = 64 and
    re-reads threadIdx.x per tile above it; 1, the earlier default kept for A/B runs,
    re-reads at every D. Every bwd_grid entry of every listed architecture builds without
    spills in both forms; the D = 128 entries' reports do not differ between them, and some
    D = 64 entry's does (the mode reached them; since the four tile-loop cuts of 2026-12-07
    the sm_90 bfloat16 causal one reports 240 registers in both)."""
    from cupy_piecewise import compile as comp

    vs = _grid_variants(cc)
    base = comp.arch_options
    default = {}
    for r in compile_offline(cc, vs):
        assert r.ok and r.registers and not (r.spill_stores or r.spill_loads), (r.variant, r.log)
        default[r.variant] = (r.registers, r.spill_stores)
    monkeypatch.setattr(comp, "arch_options",
                        lambda c, hopper=False: base(c, hopper) + ("-DPW_GRID_TID_RELOAD=1",))
    moved_64 = []
    for r in compile_offline(cc, vs):
        assert r.ok and r.registers, (r.variant, r.log)
        assert not (r.spill_stores or r.spill_loads), (r.variant, r.log)
        moved = (r.registers, r.spill_stores) != default[r.variant]
        if r.variant.head_dim == 64:
            moved_64.append(moved)
        else:
            assert not moved, (r.variant, default[r.variant], r.registers)
    assert not moved_64 or any(moved_64), "the mode reached no D = 64 entry"


@pytest.mark.parametrize("cc", [(8, 0), (9, 0)])
@pytest.mark.parametrize("macros", [("PW_GRID_TWO_DS=1",),
                                    ("PW_GRID_TWO_DS=1", "PW_GRID_TID_RELOAD=2")])
def test_grid_backward_two_ds_buffers_at_d64_build_without_spills(nvrtc, monkeypatch, cc,
                                                                  macros):
    """-DPW_GRID_TWO_DS=1 (kernels_cu/traits.cuh, staged for an A/B): the 4-warp D = 64 grid
    backward with Pᵀ and dSᵀ in two buffers, alone and with PW_GRID_TID_RELOAD=2 (the
    default since 2026-12-06, named here so the pair stays built if the default moves), builds
    without spills on the architectures whose shared memory holds it (sm_80, sm_90)."""
    from cupy_piecewise import compile as comp

    base = comp.arch_options
    monkeypatch.setattr(comp, "arch_options",
                        lambda c, hopper=False: base(c, hopper) + tuple(f"-D{m}" for m in macros))
    vs = [Variant("bwd_grid", dt, 64, capability.TileConfig(64, 64, 4), c)
          for dt in ("bfloat16", "float16") for c in (False, True)]
    for r in compile_offline(cc, vs):
        assert r.ok and r.registers, (r.variant, r.log)
        assert not (r.spill_stores or r.spill_loads), (r.variant, r.log)


@pytest.mark.parametrize("cc", sorted(capability.TABLE))
@pytest.mark.parametrize("macros", [("PW_GRID_STAGGER=1",), ("PW_GRID_DQ_FIRST=1",),
                                    ("PW_GRID_STAGGER=1", "PW_GRID_DQ_FIRST=1")])
def test_grid_backward_order_forms_build_without_spills(nvrtc, monkeypatch, cc, macros):
    """The D = 64 warp-grid backward's staged order forms (kernels_cu/backward.cu, A/B builds
    for 2026-12-08): -DPW_GRID_STAGGER=1 (each block starts its passes at its own query tile)
    and -DPW_GRID_DQ_FIRST=1 (dQ's product and reductions before dK's product), alone and
    together, build every bwd_grid entry of every listed architecture without spills, at
    D = 64 (whose code they change) and above (whose code they leave alone)."""
    from cupy_piecewise import compile as comp

    vs = _grid_variants(cc)
    base = comp.arch_options
    monkeypatch.setattr(comp, "arch_options",
                        lambda c, hopper=False: base(c, hopper) + tuple(f"-D{m}" for m in macros))
    for r in compile_offline(cc, vs):
        assert r.ok and r.registers, (r.variant, r.log)
        assert not (r.spill_stores or r.spill_loads), (r.variant, r.log)


def test_two_barrier_tile_loop_builds_without_spills(nvrtc, monkeypatch):
    """-DPW_ONE_BARRIER=0 (kernels_cu/common.cuh pipelined_tiles): the earlier tile loop with
    two barriers per tile, kept for A/B runs against the default (one barrier since
    2026-12-06; the build check covers it). The sm_90 row's dense bfloat16 forward,
    one-kernel backward and deterministic backward entries at head dims 64 and 128 build
    without spills in that form, with the forward of its day (-DPW_FWD_WARP_SKIP=0: with
    the warp skip, the default since 2026-12-07, two barriers spill 144 bytes at the
    non-causal D = 128 rotating-slot entry, 8 causal; ptxas 13.0)."""
    from cupy_piecewise import compile as comp

    base = comp.arch_options
    monkeypatch.setattr(comp, "arch_options", lambda c, hopper=False: base(c, hopper) + (
        "-DPW_ONE_BARRIER=0", "-DPW_FWD_WARP_SKIP=0"))
    vs = sorted({Variant(phase, dt, d, t, c)
                 for phase, d, dt, c, t in capability.selectable_configs(SM90)
                 if phase in ("fwd", "bwd_grid", "bwd_dq", "bwd_dkv") and d in (64, 128)
                 and dt == "bfloat16"}, key=str)
    assert {v.phase for v in vs} == {"fwd", "bwd_grid", "bwd_dq", "bwd_dkv"}
    for filename in sorted({v.filename for v in vs}):
        for r in compile_offline(SM90, [v for v in vs if v.filename == filename]):
            assert r.ok and r.registers, (r.variant, r.log)
            assert not (r.spill_stores or r.spill_loads), (r.variant, r.log)


@pytest.mark.parametrize("reload", [0, 1])
def test_one_key_d64_forward_builds_without_spills(nvrtc, monkeypatch, reload):
    """The D = 64 one-key-slot forward (PW_FWD_ONE_K_D64, the default: 128-key tiles),
    plain and with the staged -DPW_LOAD_TID_RELOAD=1 (common.cuh load_rows), builds
    FlashAttention-2's D = 64 tile 128x128x4 (TABLE's sm_90 entry, 255 registers) and the
    two-slot 128x64x4 (the sm_80/86/89 entry) without spills on sm_90, bf16 and fp16, causal
    and not. (With two key slots 128x128x4 spills 164 bytes non-causal: the merged body holds
    both products' scores; NVRTC 13.5, 2026-12-05.)"""
    from cupy_piecewise import compile as comp

    base = comp.arch_options
    extra = ("-DPW_LOAD_TID_RELOAD=1",) if reload else ()
    monkeypatch.setattr(comp, "arch_options", lambda cc, hopper=False: base(cc, hopper) + extra)
    vs = [Variant("fwd", dt, 64, capability.TileConfig(128, bn, 4), c)
          for dt in ("bfloat16", "float16") for bn in (64, 128) for c in (False, True)]
    for r in compile_offline(SM90, vs):
        assert r.ok and r.registers, (r.variant, r.log)
        assert not (r.spill_stores or r.spill_loads), (r.variant, r.log)


@pytest.mark.parametrize("prefetch", (0, 1))
def test_combine_prefetch_builds_without_spills(nvrtc, monkeypatch, prefetch):
    """The split merge with its loads issued together (kernels_cu/forward.cu merge_split_row,
    PW_COMBINE_PREFETCH=1, the default since 2026-12-05: up to 8 splits' lse and partial
    rows in registers before the max) and its earlier form (=0, the A/B build of
    scripts/bitwise_ab.py --decode and scripts/kvdecode_probe.py) build on every listed
    architecture, every head dim and dtype, without spills (at most 128 registers at
    D = 256 on sm_90, NVRTC 13.5)."""
    from cupy_piecewise import compile as comp

    base = comp.arch_options
    monkeypatch.setattr(comp, "arch_options", lambda cc, hopper=False: base(cc, hopper) + (
        f"-DPW_COMBINE_PREFETCH={prefetch}",))
    vs = [Variant("fwd_combine", dt, d, None, False)
          for dt in ("bfloat16", "float16", "float32") for d in (16, 32, 64, 80, 96, 128, 256)]
    for cc in capability.LISTED_ARCHS:
        for r in compile_offline(cc, vs):
            assert r.ok and r.registers, (cc, r.variant, r.log)
            assert not (r.spill_stores or r.spill_loads), (cc, r.variant, r.log)


@pytest.mark.parametrize("tile_box", (0, 1, 2))
def test_tile_box_decode_builds_without_spills(nvrtc, monkeypatch, tile_box):
    """The Hopper decode with whole-tile TMA boxes (-DKV90_TILE_BOX=1, an A/B build:
    kernels_cu/sm90/kvdecode.cu; six tensor maps, a stage's K and V panel-major; 2: the
    boxes at D = 128 and from pages only) builds every plain sm_90a decode variant (every
    head dim, dtype and cluster size) and leaves the rotary forms as they are, without
    spills; its default, 0, builds the same variants."""
    from cupy_piecewise import compile as comp

    base = comp.arch_options
    monkeypatch.setattr(comp, "arch_options", lambda cc, hopper=False: base(cc, hopper) + (
        f"-DKV90_TILE_BOX={tile_box}",))
    vs = sorted({v for v in build_check.variants_for(SM90, hopper=True)
                 if v.phase == "kvdecode_sm90"}, key=str)
    assert {v.cluster for v in vs if not v.rotary} == set(capability.KV90_CLUSTERS)
    for r in compile_offline(SM90, vs):
        assert r.ok and r.registers, (r.variant, r.log)
        assert not (r.spill_stores or r.spill_loads), (r.variant, r.log)


def test_row_box_decode_builds_without_spills(nvrtc, monkeypatch):
    """The Hopper decode with boxes of whole rows in every plain D = 128 form (-DKV90_ROW_BOX=1,
    an A/B build: kernels_cu/sm90/kvdecode.cu, 5-d maps) builds every sm_90a decode variant
    (every head dim, dtype and cluster size; the rotary forms and D = 64 unchanged by it)
    without spills. The default, mode 2 (whole rows only without a cluster), is the build
    check's own (.ci/run fails on any spill there)."""
    from cupy_piecewise import compile as comp

    base = comp.arch_options
    monkeypatch.setattr(comp, "arch_options",
                        lambda cc, hopper=False: base(cc, hopper) + ("-DKV90_ROW_BOX=1",))
    vs = sorted({v for v in build_check.variants_for(SM90, hopper=True)
                 if v.phase == "kvdecode_sm90"}, key=str)
    for r in compile_offline(SM90, vs):
        assert r.ok and r.registers, (r.variant, r.log)
        assert not (r.spill_stores or r.spill_loads), (r.variant, r.log)


def _build_ptx(variant, macros):
    """scripts/offline_sass.build_ptx: NVRTC's PTX of ``variant`` for sm_90a with ``-D<m>``
    for each of ``macros``, and its lowered name."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from offline_sass import build_ptx

    return build_ptx(variant, "sm_90a", list(macros))


def _decode_ptx(variant, *macros):
    """NVRTC's PTX of one Hopper decode variant built with ``-D<macro>`` for each of
    ``macros`` (:func:`_build_ptx`), the compile's internal-linkage prefix (a hash of the
    options: it differs between any two option sets) replaced by a fixed name."""
    import re

    ptx = _build_ptx(variant, macros)[0].decode()
    return re.sub(r"_INTERNAL_[0-9a-f]+_\d+_kvdecode_cu_[0-9a-f]+_", "_INTERNAL_", ptx)


def test_row_box_mode_2_kernels_are_the_timed_forms(nvrtc):
    """-DKV90_ROW_BOX=2 (whole-row boxes only without a cluster) makes no kernel of its own:
    PTX for PTX, each plain D = 128 decode without a cluster is mode 1's (the row boxes timed,
    GPU-tested and sanitized on an H100, bench/results/2026-12-06-h100-rowbox) and each one
    with a cluster is mode 0's (the half-row default); D = 64 and the rotary forms are mode
    0's. bfloat16 at every cluster size, float16 at 1 and 4, one D = 64 and one rotary form;
    mode 1 and mode 0 differ in each D = 128 case, so the check is not vacuous."""
    vs = build_check.variants_for(SM90, hopper=True)
    dec = [v for v in vs if v.phase == "kvdecode_sm90" and not v.rot_stage]
    pick = sorted({v for v in dec if v.head_dim == 128 and not v.rotary and (
        v.dtype == "bfloat16" or v.cluster in (1, 4))}, key=str)
    pick += [min((v for v in dec if v.head_dim == 64 and not v.rotary), key=str),
             min((v for v in dec if v.head_dim == 128 and v.rotary), key=str)]
    assert {v.cluster for v in pick if v.dtype == "bfloat16"} == set(capability.KV90_CLUSTERS)
    for v in pick:
        ptx = {m: _decode_ptx(v, f"KV90_ROW_BOX={m}") for m in (0, 1, 2)}
        whole = v.head_dim == 128 and not v.rotary
        assert (ptx[1] != ptx[0]) == whole, v
        assert ptx[2] == ptx[1 if whole and v.cluster == 1 else 0], v


def test_tile_box_builds_take_no_row_boxes(nvrtc):
    """A tile-box A/B build (-DKV90_TILE_BOX=1 or 2) beside the row-box default
    (KV90_ROW_BOX 2): mode 2 yields, so each decode is, PTX for PTX, the tile-box build with
    half rows (-DKV90_ROW_BOX=0), as kvcache_launch.kv90_row_box assumes when it gives such a
    build 16-row maps; mode 1 with tile boxes is refused at compile time. D = 128 bf16
    without a cluster (where mode 2 would take whole rows) and with one, and D = 64."""
    vs = build_check.variants_for(SM90, hopper=True)
    dec = [v for v in vs if v.phase == "kvdecode_sm90" and not v.rot_stage and not v.rotary
           and v.dtype == "bfloat16"]
    pick = [min((v for v in dec if v.head_dim == 128 and v.cluster == c), key=str)
            for c in (1, 4)] + [min((v for v in dec if v.head_dim == 64), key=str)]
    for v in pick:
        for tile_box in (1, 2):
            tb = f"KV90_TILE_BOX={tile_box}"
            assert _decode_ptx(v, tb) == _decode_ptx(v, tb, "KV90_ROW_BOX=0"), (v, tile_box)
    # the default's own D = 128 unclustered kernel does take the row boxes (not vacuous)
    assert _decode_ptx(pick[0]) != _decode_ptx(pick[0], "KV90_ROW_BOX=0")
    with pytest.raises(RuntimeError, match="exclude each other"):
        _build_ptx(pick[0], ["KV90_TILE_BOX=2", "KV90_ROW_BOX=1"])


# The shared layout the decode's consumers address (kvdecode.cu swz) against a model of what
# the producer's TMA boxes write: a box is written innermost dimension first, and the
# 128-byte swizzle XORs a 1024-byte aligned region's 16-byte chunk index (address bits 4-6)
# with its 128-byte row index (bits 7-9).
_LAYOUT_CHECK = r'''
namespace pw90kv_layout_check {
__device__ constexpr unsigned tma_swz(unsigned o) { return o ^ (((o >> 7) & 7u) << 4); }
// byte offset of element (row r, column c) of a chunk as the producer writes it. MODE 0:
// one 16-row box per 64-column panel at panel * BOX_BYTES (the default); 1: one box of whole
// rows {64, D / 64, 16} (KV90_ROW_BOX); 2: one 64-row box per panel at panel * 64 * 128 (a
// KV90_TILE_BOX stage)
template <int D, int MODE> __device__ constexpr unsigned tma_pos(int r, int c) {
  return MODE == 1 ? tma_swz(unsigned(((r * (D / 64) + c / 64) * 64 + c % 64) * 2))
       : MODE == 0 ? unsigned((c / 64) * pw90kv::BOX_BYTES) + tma_swz(unsigned((r * 64 + c % 64) * 2))
                   : unsigned((c / 64) * 64 * 128) + tma_swz(unsigned((r * 64 + c % 64) * 2));
}
template <int D, int MODE> __device__ constexpr bool layout_ok() {
  for (int r = 0; r < (MODE == 2 ? 64 : 16); ++r)
    for (int g = 0; g < D / 8; ++g) {
      const unsigned got = MODE == 1 ? pw90kv::swz<pw90kv::BOX_BYTES, D / 64>(0u, r, g)
                         : MODE == 0 ? pw90kv::swz<pw90kv::BOX_BYTES>(0u, r, g)
                                     : pw90kv::swz<64 * 128>(0u, r, g);
      if (got != tma_pos<D, MODE>(r, 8 * g)) return false;
    }
  return true;
}
__global__ void layout_check_kernel() {
  static_assert(layout_ok<64, 0>() && layout_ok<128, 0>(), "default chunk layout");
  static_assert(layout_ok<64, 2>() && layout_ok<128, 2>(), "tile-box stage layout");
  static_assert(layout_ok<64, 1>() && layout_ok<128, 1>(), "row-box chunk layout");
  EXTRA
}
}
'''


@pytest.mark.parametrize("extra,ok", [("", True), (
    "static_assert(pw90kv::swz<pw90kv::BOX_BYTES, 2>(0u, 3, 9) == tma_pos<128, 0>(3, 72), \"\");",
    False)])
def test_decode_swizzle_addresses_what_the_boxes_write(nvrtc, extra, ok):
    """kvdecode.cu's swz (constexpr) against the model above, evaluated by NVRTC: the
    default chunks and the tile-box stages (both run on GPUs) and the row boxes
    (KV90_ROW_BOX, on GPUs since 2026-12-06) all hold element (r, 8 g) where the consumers read group g of
    row r; a control (the row-box address against the default layout) must fail to compile,
    so the check is not vacuous."""
    from cupy_piecewise.compile import source

    prog = nvrtc.createProgram(source("sm90/kvdecode.cu") + _LAYOUT_CHECK.replace("EXTRA", extra),
                               "kvdecode.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, ["-std=c++17", "-arch=compute_90a"])
            compiled, log = True, ""
        except nvrtc.NVRTCError:
            compiled, log = False, nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)
    assert compiled == ok, log[-2000:]
    if not ok:  # the control's own assertion, not one of the layouts'
        assert log.count("static assertion failed") == 1 and "layout\"" not in log, log[-2000:]


def test_named_staged_rotary_forms_build_without_spills(nvrtc):
    """The staged-table rotary decode asked for by name (Variant.rot_stage: the kernel's
    TAB = true without -DKV90_ROT_STAGE, what kvcache_launch.staged_tables picks under
    capability.KV90_ROT_STAGE_UNSPLIT) builds at cluster 1 for every head dim, dtype and
    rotary layout without spills, and the build check lists those forms."""
    vs = sorted({v for v in build_check.variants_for(SM90, hopper=True) if v.rot_stage}, key=str)
    assert {(v.head_dim, v.rotary, v.dtype) for v in vs} == {
        (d, r, dt) for d in capability.KV90_HEAD_DIMS for r in (1, 2)
        for dt in capability.HALF_DTYPES}
    assert all(v.cluster == 1 and v.name_expression.endswith(", true>") for v in vs)
    for r in compile_offline(SM90, vs):
        assert r.ok and r.registers, (r.variant, r.log)
        assert not (r.spill_stores or r.spill_loads), (r.variant, r.log)


def test_staged_rotary_tables_build_without_spills(nvrtc, monkeypatch):
    """The Hopper decode's rotary forms with their table rows staged by the producer warp
    (-DKV90_ROT_STAGE=1, kernels_cu/sm90/kvdecode.cu: plain bulk copies into the stage,
    rotation from shared memory) build every variant the build check selects without spills
    (148-156 registers, NVRTC 13.5; the default forms are unchanged: the macro is off)."""
    from cupy_piecewise import compile as comp

    base = comp.arch_options
    monkeypatch.setattr(comp, "arch_options",
                        lambda cc, hopper=False: base(cc, hopper) + ("-DKV90_ROT_STAGE=1",))
    vs = sorted({v for v in build_check.variants_for(SM90, hopper=True)
                 if v.phase == "kvdecode_sm90" and v.rotary}, key=str)
    assert {v.head_dim for v in vs} == set(capability.KV90_HEAD_DIMS) and {v.rotary for v in vs} == {1, 2}
    for r in compile_offline(SM90, vs):
        assert r.ok and r.registers, (r.variant, r.log)
        assert not (r.spill_stores or r.spill_loads), (r.variant, r.log)


def test_paged_d64_entry_is_the_timed_tile_box_form(nvrtc):
    """pw90_kvdecode_pages (Variant.page_box; kvcache_launch.page_box sends the plain D = 64
    decode of caches paged in multiples of 64 rows to it) is, PTX for PTX but its name, the
    D = 64 decode of the -DKV90_TILE_BOX=2 build: the form timed (+1.0-6.5% on the paged
    D = 64 rows), GPU-tested and sanitized on an H100 on 2026-12-07 (under mode 2 and the
    equal mode 3 of that day). bfloat16 at clusters 1 and 4, float16 at 1; the plain default
    D = 64 kernel differs from it, so the check is not vacuous."""
    import dataclasses
    import re

    def body(ptx):
        return re.sub(r"\d+pw90_kvdecode(_pages)?", "ENTRY", ptx)

    vs = build_check.variants_for(SM90, hopper=True)
    pages = sorted((v for v in vs if v.phase == "kvdecode_sm90" and v.page_box
                    and (v.cluster == 1 or (v.dtype == "bfloat16" and v.cluster == 4))), key=str)
    assert len(pages) == 3 and all(v.head_dim == 64 and not v.rotary for v in pages)
    for v in pages:
        plain = dataclasses.replace(v, page_box=False)
        assert "pw90_kvdecode_pages<" in v.name_expression
        assert body(_decode_ptx(v)) == body(_decode_ptx(plain, "KV90_TILE_BOX=2")), v
        assert body(_decode_ptx(v)) != body(_decode_ptx(plain)), v
    with pytest.raises(ValueError, match="page_box"):
        dataclasses.replace(pages[0], head_dim=128).name_expression
