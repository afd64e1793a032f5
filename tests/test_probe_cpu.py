"""The GPU-free parts of the tuning scripts: scripts/gpu_run.sh's step list,
scripts/profile_case.py's options, scripts/hopper_probe.py's --variants bookkeeping (the
comparison table from the workers' output lines: medians over interleaved rounds, the
spread, ratios to cuDNN; the tile figures it derives from the -D options of a variant),
scripts/mma_fwd_probe.py's tile argument and A/B table, scripts/mma_bwd_probe.py's table,
scripts/mma_bwd_ab.py's table and kernel-cache swap, scripts/fit_vote_model.py's replay of
the float16 dS fit, scripts/hopper_bwd_ab.py's parsing and summary,
scripts/kvdecode_probe.py's configs, table and knob settings, scripts/bitwise_ab.py's cases, and
scripts/causal_schedule_model.py's makespans, scripts/warp_skip_model.py's proof,
scripts/merge_margin.py's seed lists, scripts/col_range_model.py's check of the column groups."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "scripts"))
hopper_probe = pytest.importorskip("hopper_probe")  # (imports cupy_piecewise only)
ROOT = Path(__file__).resolve().parent.parent


def _vtime(tag, L, D, c, tflops):
    return f"VTIME {tag} | L={L} D={D} causal={c} | 1.0000 ms {tflops:.1f} TFLOP/s"


def test_variants_table_takes_medians_and_reports_the_spread():
    lines = []
    for r, (a, b, cudnn) in enumerate(((300.0, 330.0, 400.0), (320.0, 310.0, 420.0),
                                       (310.0, 350.0, 410.0))):
        lines += [_vtime("(default)", 2048, 64, 1, a), _vtime("PW90_X=1", 2048, 64, 1, b),
                  _vtime("sdpa_cudnn", 2048, 64, 1, cudnn)]
    lines.append("VAGREE PW90_X=1 | L=2048 D=64 causal=1 | 1.5e-05")
    out = hopper_probe.variants_table(lines, ["(default)", "PW90_X=1"],
                                      {"(default)": "128 pass", "PW90_X=1": "128 pass"},
                                      lengths=(2048,))
    cols = hopper_probe.vt_configs((2048,))
    i = cols.index((2048, 64, 1))  # the only cell with data
    rows = {ln[:34].strip(): ln[34:] for ln in out[2:]}
    cell = lambda text: text[12 * i:12 * (i + 1)].strip()  # noqa: E731
    assert cell(rows["(default)"]) == "310.0" and cell(rows["PW90_X=1"]) == "330.0"
    assert cell(rows["sdpa_cudnn"]) == "410.0"
    assert "vs package fwd at scale: max rel 1.5e-05" in rows["PW90_X=1"]
    ratio = [ln for ln in out if ln.startswith("  / cudnn")]
    assert [cell(ln[34:]) for ln in ratio] == [f"{310 / 410:.3f}", f"{330 / 410:.3f}"]
    spread = [ln for ln in out if ln.startswith("  spread")]
    # (default): (320 - 300) / 310; PW90_X=1: (350 - 310) / 330; cudnn; flash (no data)
    assert [cell(ln[34:]) for ln in spread] == ["6.5%", "12.1%", "4.9%", "-"]
    j = cols.index((2048, 128, 0))  # a cell no line timed
    assert rows["(default)"][12 * j:12 * (j + 1)].strip() == "-"


def test_variants_table_one_round_has_no_spread_line():
    lines = [_vtime("(default)", 8192, 128, 0, 550.0), _vtime("sdpa_cudnn", 8192, 128, 0, 600.0)]
    out = hopper_probe.variants_table(lines, ["(default)"], {}, lengths=(8192,))
    assert not any(ln.startswith("  spread") for ln in out)
    assert any("0.917" in ln for ln in out if ln.startswith("  / cudnn"))


def test_variant_tiles_follow_the_macros():
    """block_m / tiles / smem_bytes of a --variants build: the package's figures unless the
    macros change them (PW90_BM64 only at D = 64)."""
    from cupy_piecewise import capability

    opts = ["-DPW90_BM64=128", "-DPW90_BN64=96"]
    assert hopper_probe.block_m(64, opts) == 128 and hopper_probe.block_m(128, opts) == 128
    assert hopper_probe.block_m(64) == capability.HOPPER_BLOCK_M[64] == 192
    assert hopper_probe.block_m(128) == capability.HOPPER_BLOCK_M[128]
    assert hopper_probe.tiles(64, opts)[0] == 96
    # Q1, Q2 of 128 x 64; 4 K + 2 V slots of 96 x 64 (2-byte elements); 14 mbarriers; 1 KB
    # alignment slack
    assert capability.HOPPER_FWD_SLOTS[64] == (4, 2)
    assert hopper_probe.smem_bytes(64, opts) == 2 * 128 * 128 + 6 * 96 * 128 + 8 * 14 + 1024
    assert hopper_probe.smem_bytes(64) == capability.hopper_shared_bytes(64)
    assert hopper_probe.smem_bytes(128) == capability.hopper_shared_bytes(128)
    assert hopper_probe.vt_configs((2048, 16384)) == [
        (L, D, c) for L in (2048, 16384) for D in (64, 128) for c in (0, 1)]


def test_causal_schedule_model_reproduces_the_notes():
    """scripts/causal_schedule_model.py: the makespans by hand on a tiny case, and the bench
    rows the NOTES quote (pairs 1.19x, 1.06x, 0.99x at L = 2048, 8192, 16384)."""
    model = pytest.importorskip("causal_schedule_model")
    # L = 512: 4 query tiles of 1-4 key tiles; pairs (3, 0) and (2, 1) hold 5 each
    assert model.pairs(1, 4) == 5.0
    assert model.one_cta_per_tile(1, 4, c=0.0) == 4.0  # every tile on its own SM
    assert model.one_cta_per_tile(1, 4, sms=1, c=1.0) == 4 * 1.0 + (1 + 2 + 3 + 4)
    # 3 units of one head on 2 CTAs: CTA 0 takes units 0 and 2 (the middle tile alone)
    assert model.pairs(1, 5, sms=2) == 6.0 + 3.0
    got = [round(model.speedup(16384 * 16 // L, L), 2) for L in (2048, 8192, 16384)]
    assert got == [1.19, 1.06, 0.99]


def test_straddle_visit_model_counts_and_the_notes_bounds():
    """scripts/straddle_visit_model.py: visits counted by hand on a tiny case (L = 256,
    128x64 tiles, w = 64: query tile 0 meets key tiles of modes 3, 1, 1, 1 and query tile 1
    modes 2, 3, 3, 1, so 11 visits against 8), a straddling tile's cost with halves by hand
    (the slowest warp: two half visits and one second product), and the L = 2048 bounds
    bench/NOTES.md quotes (0.955 and 0.919; 0.988 and 0.978 with halves)."""
    model = pytest.importorskip("straddle_visit_model")
    assert [model.tile_mode(0, 128, k, 64, 64) for k in (0, 64, 128, 192)] == [3, 1, 1, 1]
    assert [model.tile_mode(128, 128, k, 64, 64) for k in (0, 64, 128, 192)] == [2, 3, 3, 1]
    standard, ours, halves = model.visits(256, False, w=64)
    assert (standard, ours) == (8, 11)
    # L = 64: the one tile (query tile 0, key tile 0) of the case above, its four warps of 32
    # rows: warps 2 and 3 cross d = 64 in one half each, so 0.5 + 0.5 + 0.25 = 1.25
    assert model.visits(64, False, bm=128, bn=64, w=64)[2] == 1.25
    assert standard < halves < ours
    rows = {c: model.visits(2048, c) for c in (False, True)}
    assert rows[False][:2] == (512, 536) and rows[True][:2] == (272, 296)
    assert [round(rows[c][0] / rows[c][1], 3) for c in (False, True)] == [0.955, 0.919]
    assert [round(rows[c][0] / rows[c][2], 3) for c in (False, True)] == [0.988, 0.978]


def test_causal_schedule_model_backward_order():
    """The --bwd model: launch orders and a makespan by hand on a tiny case."""
    model = pytest.importorskip("causal_schedule_model")
    # two heads of 3 key tiles: head by head, or (groups of 6 // 3 = 2 heads) tile by tile
    assert model.bwd_order(2, 3) == [0, 1, 2, 0, 1, 2]
    assert model.bwd_order(2, 3, lpt_ctas=6) == [0, 0, 1, 1, 2, 2]
    assert model.bwd_order(3, 2, lpt_ctas=4) == [0, 0, 1, 1, 0, 1]  # a last group of one head
    # L = 256: 2 key tiles of 4 and 2 query tiles; one head on 1 SM is its total work
    assert model.bwd_makespan(1, 256, sms=1, c=0.0) == 1.0
    # 2 heads on 2 SMs, no set-up: head by head puts (4, 4) and (2, 2) on the SMs, 6 each;
    # both orders balance here, the ideal is 12 / 2
    assert model.bwd_makespan(2, 256, sms=2, c=0.0) == 1.0
    # 3 SMs, set-up 1: costs 5, 3, 5, 3 in the default order -> SMs 5 | 3 + 3 | 5, makespan 6
    # of an ideal 16 / 3; longest first (5, 5, 3, 3) -> 5 | 5 | 3 + 3, the same 6
    assert model.bwd_makespan(2, 256, sms=3, c=1.0) == pytest.approx(6 / (16 / 3))
    assert model.bwd_makespan(2, 256, 4, sms=3, c=1.0) == pytest.approx(6 / (16 / 3))
    rows = [model.bwd_makespan(16384 * 2048 // (2048 * D), 2048, lpt) for D in (64, 128)
            for lpt in (0, 256)]
    assert rows[1] < rows[0] and rows[3] < rows[2]  # longest first shortens the modelled tail


def test_mma_fwd_probe_tiles_and_table():
    mma_fwd_probe = pytest.importorskip("mma_fwd_probe")
    assert mma_fwd_probe.parse_tiles("128:128x64x8, 128x64x4;64:128x64x4") == {
        128: ["128x64x8", "128x64x4"], 64: ["128x64x4"]}

    def rec(tiles, tflops, L=2048):
        return dict(kind="time", L=L, D=64, dtype="bf16", causal=True, tiles=tiles, ms=1.0,
                    tflops=tflops)

    results = {  # two rounds per build; the default lacks one row (an error record)
        "": [[rec("128x64x4", 200.0), rec("sdpa_flash", 300.0),
              dict(kind="time", L=8192, D=64, dtype="bf16", causal=True, tiles="128x64x4",
                   error="boom")],
             [rec("128x64x4", 220.0), rec("sdpa_flash", 310.0)]],
        "PW_FWD_VISITS=0": [[rec("128x64x4", 180.0), rec("128x64x4", 240.0, L=8192)],
                            [rec("128x64x4", 190.0), rec("128x64x4", 250.0, L=8192)]],
    }
    lines = mma_fwd_probe.summary_table(results, ["", "PW_FWD_VISITS=0"])
    assert lines[2] == "| L | D | dtype | causal | tiles | default | PW_FWD_VISITS=0 |"
    rows = {tuple(c.strip() for c in line.split("|")[1:6]): line for line in lines[4:]}
    # medians 210 and 185, spreads 20/210 and 10/185, ratio 185/210
    assert rows[("2048", "64", "bf16", "1", "128x64x4")].endswith(
        "| 210.0 (9.5%) | 185.0 (5.4%) x0.881 |")
    assert rows[("2048", "64", "bf16", "1", "sdpa_flash")].endswith("| 305.0 (3.3%) |  |")
    # no default timing on the row: the other build's cell carries no ratio
    assert rows[("8192", "64", "bf16", "1", "128x64x4")].endswith("|  | 245.0 (4.1%) |")
    # the header takes the GPU from a worker's env record, which the table ignores
    results[""][0].insert(0, dict(kind="env", gpu="NVIDIA H200", torch="2.11", cupy="14.2"))
    assert mma_fwd_probe.summary_table(results, ["", "PW_FWD_VISITS=0"]) == lines
    header = mma_fwd_probe.run_header(results)
    assert header["gpu"] == "NVIDIA H200" and header["date"].endswith("+00:00")
    assert header["command"].startswith("python3 scripts/mma_fwd_probe.py")


def test_mma_fwd_probe_thresholds():
    """--w-fracs: w = L / 4 keeps the candidate's name (earlier tables' rows), any other
    fraction is named in the tiles column; w = L puts every key near (d < w)."""
    mma_fwd_probe = pytest.importorskip("mma_fwd_probe")
    assert mma_fwd_probe.w_fracs("0.25, 1") == [0.25, 1.0]
    assert [mma_fwd_probe.w_of(2050, f) for f in (0.25, 1.0, 0.5, 0.1)] == [512, 2050, 1025, 205]
    assert mma_fwd_probe.tile_label("128x64x4", 0.25) == "128x64x4"
    assert mma_fwd_probe.tile_label("128x64x4", 1.0) == "128x64x4 w=1L"
    for bad in ("", "-0.5", "x"):
        with pytest.raises(ValueError):
            mma_fwd_probe.w_fracs(bad)


def test_mma_fwd_probe_control_build_is_the_default():
    """--control times the default kernels once more under a macro that no kernel source
    reads, so its column measures the cross-process probe's noise."""
    mma_fwd_probe = pytest.importorskip("mma_fwd_probe")
    assert mma_fwd_probe.build_list("A=1 B=0; C=1;", False) == ["", "A=1 B=0", "C=1"]
    assert mma_fwd_probe.build_list("A=1", True) == ["", "A=1", mma_fwd_probe.CONTROL_MACRO]
    name = mma_fwd_probe.CONTROL_MACRO.split("=")[0]
    sources = [f for f in (ROOT / "kernels_cu").rglob("*") if f.suffix in (".cu", ".cuh")]
    assert sources and not any(name in f.read_text() for f in sources)


def test_mma_bwd_probe_table_medians_and_ratios():
    """scripts/mma_bwd_probe.py's table: per row the median forward+backward TFLOP/s over
    rounds with the spread, the time ratios to the two-kernel run ("det") and to SDPA flash,
    and the backward alone (f+b minus the forward of its scheme; ours share det's forward)."""
    import statistics

    mma_bwd_probe = pytest.importorskip("mma_bwd_probe")
    base = {"sdpa_flash": 2.0, "det": 4.0, "fused 64x64x4": 3.2}  # f+b ms of round 0
    fwd = {"sdpa_flash": 0.5, "det": 1.0}
    recs = [dict(kind="env", gpu="x")]
    for rnd, scale in enumerate((1.0, 1.1)):
        for run, ms in base.items():
            rec = dict(kind="time", L=2048, D=64, dtype="bf16", causal=True, run=run, round=rnd,
                       fb_ms=ms * scale, fb_tflops=100.0 / (ms * scale))
            if run in fwd:
                rec["fwd_ms"] = fwd[run]
            recs.append(rec)
    recs.append(dict(kind="time", L=2048, D=64, dtype="bf16", causal=True, run="fused 32x64x4",
                     round=0, error="boom"))  # a failed run has no row
    rows = {line.split("|")[5].strip(): [c.strip() for c in line.split("|")[6:10]]
            for line in mma_bwd_probe.table(recs) if line.startswith("| 2048")}
    assert set(rows) == set(base)
    for run, (tf, xdet, xflash, bwd) in rows.items():
        med = 1.05 * base[run]  # the median of the two rounds' times
        tfs = [100.0 / (base[run] * s) for s in (1.0, 1.1)]
        spread = 100 * (max(tfs) - min(tfs)) / statistics.median(tfs)
        assert tf == f"{statistics.median(tfs):.1f} ({spread:.1f}%)"
        assert float(xdet) == pytest.approx(1.05 * base["det"] / med, abs=1e-3)
        assert float(xflash) == pytest.approx(1.05 * base["sdpa_flash"] / med, abs=1e-3)
        assert float(bwd) == pytest.approx(med - fwd.get(run, fwd["det"]), abs=1e-3)


def test_mma_bwd_ab_table_and_cache_swap(monkeypatch):
    """scripts/mma_bwd_ab.py: the table gives each build's median backward ms over rounds, its
    spread and the default's median over its own; Build.activate puts the build's macros
    after the base NVRTC options and its own kernel caches in place of the package's, so
    each build's kernels are compiled and looked up apart in one process."""
    mma_bwd_ab = pytest.importorskip("mma_bwd_ab")
    from cupy_piecewise import compile as comp, launch

    recs = [dict(L=8192, D=64, dtype="fp16", causal=False, mode="det", build="default",
                 ms=[10.0, 12.0, 11.0]),
            dict(L=8192, D=64, dtype="fp16", causal=False, mode="det", build="X=0",
                 ms=[11.0, 13.2, 12.1]),
            dict(L=8192, D=64, dtype="fp16", causal=False, mode="default", build="default",
                 ms=[5.0, 5.0, 5.0])]
    table = [line for line in mma_bwd_ab.summary_table(recs) if line.startswith("| 8192")]
    assert [line.split("|")[5].strip() for line in table] == ["det", "det", "default"]
    assert table[0].split("|")[6:11] == [" 0.25L ", " default ", " 11.000 (18.2%) ", " 1.000 ",
                                         "  "]  # no flash row: no x flash
    assert table[1].split("|")[8:10] == [" 12.100 (18.2%) ", f" {11.0 / 12.1:.3f} "]
    assert table[2].split("|")[8:10] == [" 5.000 (0.0%) ", " 1.000 "]  # its own mode's default

    # --w-fracs: each threshold against its own default; --flash: flash's time over each
    # build's on the same (L, D, dtype, causal), whatever the threshold
    recs = [dict(L=2048, D=128, dtype="bf16", causal=True, build="sdpa_flash", ms=[2.0, 2.2, 2.1]),
            dict(L=2048, D=128, dtype="bf16", causal=True, mode="default", w_frac=0.25,
                 build="default", ms=[3.0, 3.0, 3.0]),
            dict(L=2048, D=128, dtype="bf16", causal=True, mode="default", w_frac=1.0,
                 build="default", ms=[2.5, 2.5, 2.5]),
            dict(L=2048, D=128, dtype="bf16", causal=True, mode="default", w_frac=1.0,
                 build="X=1", ms=[2.0, 2.0, 2.0])]
    rows = [line.split("|") for line in mma_bwd_ab.summary_table(recs) if line.startswith("| 2048")]
    assert [(r[6].strip(), r[7].strip()) for r in rows] == [
        ("-", "sdpa_flash"), ("0.25L", "default"), ("1L", "default"), ("1L", "X=1")]
    assert [r[9].strip() for r in rows] == ["", "1.000", "1.000", "1.250"]
    assert [r[10].strip() for r in rows] == ["1.000", f"{2.1 / 3.0:.3f}", f"{2.1 / 2.5:.3f}",
                                              f"{2.1 / 2.0:.3f}"]

    for name in ("BASE_OPTIONS", "_functions", "_modules"):
        monkeypatch.setattr(comp, name, getattr(comp, name))
    for name in ("_kernels", "_launches"):
        monkeypatch.setattr(launch, name, getattr(launch, name))
    a, b = mma_bwd_ab.Build(""), mma_bwd_ab.Build("PW_X=0 PW_Y=1")
    base = ("-std=c++17",)
    b.activate(base)
    assert comp.BASE_OPTIONS == base + ("-DPW_X=0", "-DPW_Y=1")
    comp._functions["k"] = "fn of b"
    a.activate(base)
    assert comp.BASE_OPTIONS == base and "k" not in comp._functions
    b.activate(base)
    assert comp._functions["k"] == "fn of b" and launch._launches is b.caches[3]
    # a build's layout macro sets its host mirror while it is active, and only then
    from cupy_piecewise import capability
    monkeypatch.setattr(capability, "GRID_TWO_DS_D64", False)
    c = mma_bwd_ab.Build("PW_GRID_TWO_DS=1 PW_GRID_TID_RELOAD=2")
    c.activate(base)
    assert capability.GRID_TWO_DS_D64 is True
    a.activate(base)
    assert capability.GRID_TWO_DS_D64 is False


def test_fit_vote_model_replays_the_kernel_exponents():
    """scripts/fit_vote_model.py: a row whose largest |dS| doubles every tile votes on every
    tile at headroom 0 (its largest lands in [2^14, 2^15) and the next tile reaches 2^15),
    and on every third at headroom 2; a constant row votes only on its first tile."""
    import numpy as np

    model = pytest.importorskip("fit_vote_model")
    growing = np.tile(np.exp2(np.arange(12.0)), (16, 1))
    assert model.vote_fraction(growing, 1, 0) == 1.0
    assert model.vote_fraction(growing, 1, 2) == pytest.approx(4 / 12)  # tiles 0, 3, 6, 9
    assert model.vote_fraction(np.full((32, 64), 0.25), 8, 0) == pytest.approx(1 / 8)
    mag = model.ds_magnitudes(256, 16, causal=True)
    assert mag.shape == (256, 256) and np.all(np.triu(mag, 1) == 0)


def test_hopper_bwd_ab_summary_takes_medians_and_speed_ratios():
    """scripts/hopper_bwd_ab.py: TIME lines of the probe parsed per (L, D, causal, provider,
    phase); per build the median over its rounds with the spread, the check counts, and the
    speed ratio default time / variant time; a cell missing in a build prints '-'."""
    import hopper_bwd_ab as ab

    def text(ms_a, ms_b):
        return (f"TIME L=2048 D=64 causal=0 | pw90 fused       | bwd     |    {ms_a:.3f} ms   300.0 TFLOP/s\n"
                f"TIME L=2048 D=64 causal=0 | pw90 fused       | fwd_bwd |    9.999 ms   300.0 TFLOP/s\n"
                f"TIME L=8192 D=128 causal=1 | pw90 fused       | bwd     |    {ms_b:.3f} ms   300.0 TFLOP/s\n"
                "TIME L=8192 D=128 causal=1 | pw90 fused       | bwd     | ERROR RuntimeError: x\n"
                "check done in this worker: 100 pass, 0 fail\ncheck done in this worker: 4 pass, 1 fail\n")
    t = ab.parse_times(text(2.0, 4.0))
    assert t[(2048, 64, False, "pw90 fused", "bwd")] == 2.0 and t[(8192, 128, True, "pw90 fused", "bwd")] == 4.0
    assert ab.parse_checks(text(2.0, 4.0)) == (104, 1) and ab.parse_checks("nothing") is None
    runs = {"default": [ab.parse_times(text(2.0, 4.0)), ab.parse_times(text(2.2, 4.4)),
                        ab.parse_times(text(2.1, 4.2))],
            "X=1": [ab.parse_times(text(1.0, 8.0)), ab.parse_times(text(3.0, 8.0))]}
    del runs["X=1"][1][(8192, 128, True, "pw90 fused", "bwd")]
    out = ab.summary(["default", "X=1"], runs, {"default": (104, 0)})
    assert "L2k D64" in out and "L8k D128c" in out
    # medians: default 2.1 (spread 0.2 / 2.1), 4.2; X=1 2.0 (spread 100%), 8.0 (one round)
    assert out.count("| default |") == 1
    table = [ln for ln in out.splitlines() if ln.startswith("| default |")][0]
    assert "2.100 (9.5%, n=3)" in table and "4.200 (9.5%, n=3)" in table and "104 pass, 0 fail" in table
    x = [ln for ln in out.splitlines() if ln.startswith("| X=1 | not run")][0]
    assert "2.000 (100.0%, n=2)" in x and "8.000 (0.0%, n=1)" in x
    ratio = [ln for ln in out.splitlines() if ln.startswith("| X=1 |") and "not run" not in ln][0]
    assert ratio.split("|")[2:4] == [" 1.050 ", " 0.525 "]
    # no timings at all (a probe that could not run): one line, not an empty table
    empty = ab.summary(["default", "X=1"], {"default": [{}], "X=1": []}, {"default": (104, 0)})
    assert empty.startswith("pw90 fused, bwd: no timings parsed") and "default: 104 pass, 0 fail" in empty


def test_kvdecode_probe_configs_table_and_settings():
    """scripts/kvdecode_probe.py: configs split into -D macros and host knobs; its table,
    recomputed from a recorded run's rows, is that run's text; ``settings`` sets the
    package's decode knobs for the body and restores them."""
    import json

    kvdecode_probe = pytest.importorskip("kvdecode_probe")
    from cupy_piecewise import capability, tma

    assert kvdecode_probe.parse_config("base") == ((), dict.fromkeys(kvdecode_probe.TOGGLES))
    macros, tog = kvdecode_probe.parse_config("KV90_X=1 pdl=0 s=4 A=2 m=8")
    assert macros == ("A=2", "KV90_X=1") and (tog["pdl"], tog["s"], tog["m"], tog["c"]) == (
        0, 4, 8, None)

    res = os.path.join(os.path.dirname(__file__), os.pardir, "bench", "results",
                       "2026-12-03-h200-kvdecode-pdl")
    with open(os.path.join(res, "probe_final.json")) as f:
        rows = json.load(f)
    with open(os.path.join(res, "probe_final.txt")) as f:
        want = [ln for ln in f.read().splitlines() if not ln.startswith("round ")]
    assert kvdecode_probe.table(rows, ["base", "pdld=0", "pdl=0 pdld=0"], 3) == want
    rows[0]["ok"] = False
    assert "FAILED base" in kvdecode_probe.table(rows, ["base"], 3)[0]

    before = (capability.KV90_PDL, capability.KV90_PDL_DECODE, tma._L2_PROMOTION_128B,
              dict(capability.KV90_TILES), capability.KV90_MAX_CLUSTER,
              dict(capability.KV90_MIN_TILES))
    _, tog = kvdecode_probe.parse_config("pdl=0 pdld=0 l2=256 s=5 c=2 m=3")
    with kvdecode_probe.settings(tog, 64):
        assert not capability.KV90_PDL and not capability.KV90_PDL_DECODE
        assert tma._L2_PROMOTION_128B == 3 and capability.KV90_TILES[64].stages == 5
        assert capability.KV90_MAX_CLUSTER == 2 and capability.KV90_MIN_TILES[64] == 3
        assert capability.KV90_TILES[128] == before[3][128]
    assert (capability.KV90_PDL, capability.KV90_PDL_DECODE, tma._L2_PROMOTION_128B,
            dict(capability.KV90_TILES), capability.KV90_MAX_CLUSTER,
            dict(capability.KV90_MIN_TILES)) == before


def test_gpu_run_steps_match_their_usage_line():
    """scripts/gpu_run.sh parses (bash -n), and the steps its usage line lists are exactly
    those it has a block for (`if has STEP` / `if asked STEP`): a step added without its
    block, or a block whose name the usage line misspells, fails here and not on a device."""
    import re
    import shutil
    import subprocess

    script = ROOT / "scripts" / "gpu_run.sh"
    if shutil.which("bash"):
        subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    usage = re.search(r"gpu_run\.sh OUTDIR \[([^\]|]+)\|", text)
    assert usage, "usage line not found"
    listed = set(usage.group(1).split())
    blocks = set(re.findall(r"^if (?:has|asked) (\w+); then", text, re.M))
    assert listed == blocks, (sorted(listed - blocks), sorted(blocks - listed))


def test_profile_case_arguments():
    """scripts/profile_case.py (the process Nsight Compute profiles) parses its options,
    --peer and the decode's --kv-heads among them, before it touches a GPU."""
    import subprocess

    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_case.py"), "--help"],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert "--peer" in out and "--decode" in out and "--kv-heads" in out and "--heads" in out
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_case.py"), "--decode",
                          "--heads", "12", "--kv-heads", "8"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert bad.returncode == 2 and "multiple of --kv-heads" in bad.stderr


def test_kvdecode_probe_shapes():
    """scripts/kvdecode_probe.py --shapes: "B,H,Hkv,N;..." entries, the decode table's shapes
    when empty, and a clear refusal of an entry that is not four positive integers with H a
    multiple of Hkv."""
    kvdecode_probe = pytest.importorskip("kvdecode_probe")
    assert kvdecode_probe.parse_shapes("") == kvdecode_probe.SHAPES
    assert kvdecode_probe.parse_shapes("1,32,32,32768; 4,32,8,32768;") == [
        (1, 32, 32, 32768), (4, 32, 8, 32768)]
    for bad in ("1,32,32", "1,32,x,8", "1,12,8,64", "0,32,32,64"):
        with pytest.raises(ValueError, match="--shapes entry"):
            kvdecode_probe.parse_shapes(bad)


def test_kvdecode_probe_table_of_the_merge_prefetch_run():
    """The split merge's A/B run (bench/results/2026-12-05-h100-combine-prefetch): the
    table recomputed from its rows is the recorded text, and its figures are the ones the
    results README and docs/performance.md quote (D = 64, B·H = 32, N = 4096: 0.948x ->
    1.035x cuDNN)."""
    import json

    kvdecode_probe = pytest.importorskip("kvdecode_probe")
    res = ROOT / "bench" / "results" / "2026-12-05-h100-combine-prefetch"
    rows = json.loads((res / "kvdecode_probe.json").read_text())
    want = [ln for ln in (res / "kvdecode_probe.txt").read_text().splitlines()
            if not ln.startswith("round ")]
    configs = ["base", "PW_COMBINE_PREFETCH=1", "c=8"]
    assert kvdecode_probe.table(rows, configs, 3) == want
    row = next(ln for ln in want if ln.startswith("| bfloat16 | 64 | 1 | 32/32 | 4096 |"))
    assert "x0.948 s8c1" in row and "x1.035 s8c1" in row


def test_bitwise_ab_decode_cases():
    """scripts/bitwise_ab.py: --decode's cases are (D, dtype, M, N) with M in {1, 4}; the
    dense cases keep (D, dtype, causal, L)."""
    import argparse

    bitwise_ab = pytest.importorskip("bitwise_ab")
    a = argparse.Namespace(dims="64,128", dtypes="float16", lengths="4096", decode=True)
    assert bitwise_ab.cases_of(a) == [(64, "float16", 1, 4096), (64, "float16", 4, 4096),
                                      (128, "float16", 1, 4096), (128, "float16", 4, 4096)]
    a.decode = False
    assert bitwise_ab.cases_of(a)[:2] == [(64, "float16", False, 4096), (64, "float16", True, 4096)]


def test_offline_sass_parses_tiles_opcodes_and_loops(capsys):
    offline_sass = pytest.importorskip("offline_sass")
    with pytest.raises(SystemExit):  # argparse's error, naming the option (below)
        offline_sass.main(["--phase", "bwd_grid", "--head-dim", "64", "--tiles", "64x128"])
    assert "--tiles: cannot read tile sizes '64x128'" in capsys.readouterr().err
    assert offline_sass.opcode("@!P0 LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]") == \
        "LDGSTS.E.BYPASS.128"
    assert offline_sass.opcode("@UPT HMMA.16816.F32.BF16 R0, R4, R8, R0") == \
        "HMMA.16816.F32.BF16"
    text = ["        /*0000*/                   MOV R1, c[0x0][0x28] ;",
            "        /*0010*/                   HMMA.16816.F32.BF16 R0, R4, R8, R0 ;",
            "        /*0020*/                   HMMA.16816.F32.BF16 R0, R4, R8, R0 ;",
            "        /*0030*/               @P0 BRA 0x10 ;",
            "        /*0040*/                   FADD R0, R0, R1 ;",
            "        /*0050*/              @!P1 BRA `(.L_x_3) 0x0 ;",
            "        /*0060*/                   BRA 0x70 ;"]
    instrs = [(int(m.group(1), 16), m.group(2))
              for m in map(offline_sass._ADDR.match, text) if m]
    assert len(instrs) == 7
    found = offline_sass.loops(instrs, 5)
    # two backward branches (to 0x10 and to 0x0), the larger first; the forward one is none
    assert [(lo, hi) for lo, hi, _ in found] == [(0x0, 0x50), (0x10, 0x30)]
    assert found[1][2] == {"HMMA.16816.F32.BF16": 2, "BRA": 1}


def test_offline_sass_builds_the_d64_grid_backward():
    """The whole path (NVRTC PTX -> ptxas -> cuobjdump) where the tools are installed."""
    offline_sass = pytest.importorskip("offline_sass")
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    if not all(offline_sass.find_tool(t) for t in ("ptxas", "cuobjdump", "nvdisasm")):
        pytest.skip("ptxas, cuobjdump or nvdisasm not installed (CUDA toolkit or the "
                    "nvidia-cuda-* wheels)")
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = offline_sass.main(["--phase", "bwd_grid", "--head-dim", "64", "--tiles",
                                "64x64x4", "--loops", "1"])
    out = buf.getvalue()
    assert rc == 0, out
    assert "pw_backward_grid<bf16_t, 64, 64, 64, 4, false> sm_90 default" in out
    assert "spills 0/0" in out and "HMMA.16816.F32.BF16" in out


def test_warp_skip_model_never_skips_work():
    """scripts/warp_skip_model.py, the model of -DPW_FWD_WARP_SKIP's test (warp_visit_empty,
    kernels_cu/forward.cu) against the kernel's mask window: on random and boundary
    geometries (lengths up to 2^30) no skipped warp-visit holds an admissible element and the
    window equals the direct definition; at L = 2048, w = 512 the skip takes a quarter of
    the masked warp-visits (48 non-causal, 80 causal: 2.2% and 6.8% of all)."""
    model = pytest.importorskip("warp_skip_model")
    n_vis, n_skip, n_empty = model.proof(trials=1500, seed=7)
    assert n_vis == 3000 and 0 < n_skip <= n_empty
    assert model.share(2048, 512, False) == (2144, 192, 48)
    assert model.share(2048, 512, True) == (1184, 320, 80)


def test_merge_margin_seed_lists_and_gpu_test_hook():
    """scripts/merge_margin.py: its seed list syntax, and the GPU test it replays still has
    the signature it calls (kernel_path, causal, D) and reads tolerance.compare through the
    module (the spy it installs)."""
    import inspect

    import merge_margin

    assert merge_margin.parse_seeds("1-3,9,12-12") == [1, 2, 3, 9, 12]
    assert merge_margin.parse_seeds("") == []
    with pytest.raises(ValueError, match="--seeds"):
        merge_margin.parse_seeds("1,x-3")
    # a failing case stops at its first failed compare: its later outputs count nowhere
    rows = [dict(ratios={"o": 0.5, "dk1": 1.1}), dict(ratios={"o": 0.3, "dk1": 0.5, "dv": 0.4})]
    assert merge_margin.summarise(rows) == ({"dk1": 1.1, "dv": 0.4, "o": 0.5},
                                            {"dk1": 0.8, "dv": 0.4, "o": 0.4})
    sys.path.insert(0, str(ROOT / "tests"))
    pytest.importorskip("cupy")
    import test_kernels_gpu as t

    fn = t.test_merge_of_complementary_key_ranges
    assert list(inspect.signature(fn).parameters) == ["kernel_path", "causal", "D"]
    assert "tolerance.compare(" in inspect.getsource(fn)


def test_col_range_model_groups_cover_the_mask(capsys):
    """scripts/col_range_model.py: pair_groups (kernels_cu/common.cuh, -DPW_FWD_COL_RANGE)
    computed as the kernel does (int32, saturating) covers every column that holds an
    admissible element of a warp's 32 rows, over random and extreme geometries, the kernel's
    per-lane window equals the exact mask, and the aligned 128x128 cases compute 40 of 64
    groups (straddling tile) and 20 of 32 (causal diagonal) at chunks of 1 or 2."""
    model = pytest.importorskip("col_range_model")
    assert model.main(["--trials", "4000", "--window-trials", "150", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "4000 geometries: 0 failures" in out
    for ch in (1, 2):
        assert f"CH={ch}: straddle" in out
    lines = {ln.split(":")[0]: ln for ln in out.splitlines() if ln.startswith("CH=")}
    assert "total 40 of 64" in lines["CH=2"] and "total 20 of 32" in lines["CH=2"]
    assert "total 48 of 64" in lines["CH=4"] and "total 24 of 32" in lines["CH=4"]
