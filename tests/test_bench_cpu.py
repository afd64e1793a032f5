"""CPU checks of bench/bench.py (the entry point; the work is in the modules beside it): the
--dry-run end to end (tiny sizes, CPU tensors, perf_counter timing) and the FLOP/byte
conventions of docs/semantics.md (FLOP convention). The flex_composite and piecewise_mma
providers have their own checks in tests/test_bench_flex_cpu.py.

Needs torch (CPU build). tqdm and matplotlib are optional: without tqdm the bench prints a
plain progress line; without matplotlib the PNG check is skipped with a printed reason.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "bench.py")


def _load_bench():
    spec = importlib.util.spec_from_file_location("cupy_piecewise_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    return _load_bench()


# ----------------------------------------------------------------------------- FLOPs
def test_forward_flops_match_spec(bench):
    B, H, M, N, D = 3, 5, 7, 11, 16
    assert bench.attn_flops(B, H, M, N, D, False, "fwd") == 4 * B * H * M * N * D


def test_causal_halves_only_when_square(bench):
    assert bench.attn_flops(2, 4, 128, 128, 64, True, "fwd") == 4 * 2 * 4 * 128 * 128 * 64 / 2
    # M != N: no halving (docs/semantics.md, FLOP convention)
    assert bench.attn_flops(2, 4, 16, 128, 64, True, "fwd") == 4 * 2 * 4 * 16 * 128 * 64


@pytest.mark.parametrize("causal", [False, True])
def test_backward_and_total_factors(bench, causal):
    f = bench.attn_flops(1, 2, 256, 256, 128, causal, "fwd")
    assert bench.attn_flops(1, 2, 256, 256, 128, causal, "bwd") == pytest.approx(2.5 * f)
    assert bench.attn_flops(1, 2, 256, 256, 128, causal, "fwd_bwd") == pytest.approx(3.5 * f)


def test_default_sweep_flops_and_tflops(bench):
    # default sizes: B = 16384 / L, H = 2048 / D -> forward FLOPs = 4 * 16384 * 2048 * L
    L, D = 8192, 128
    f = bench.attn_flops(16384 // L, 2048 // D, L, L, D, False, "fwd")
    assert f == 4 * 16384 * 2048 * L
    assert bench.tflops_from_ms(f, 1.0) == pytest.approx(f / 1e-3 / 1e12)
    assert bench.tflops_from_ms(f, None) is None


def test_decode_bytes(bench):
    # one of k1/k2 plus v per key, two queries and o per query row, 2 bytes each
    b = bench.decode_bytes(1, 32, 32, 16, 4096, 128, 2)
    assert b == 2 * (32 * 4096 * 128 * 2 + 32 * 16 * 128 * 3)
    assert bench.decode_bytes(1, 32, 32, 16, 4096, 128, 2, n_queries=1) == 2 * (32 * 4096 * 128 * 2 + 32 * 16 * 128 * 2)


def test_input_rotation_count(bench):
    l2 = 60 * 2**20
    assert bench.n_sets_for(4 * l2, l2) == 1
    assert bench.n_sets_for(4 * l2 - 1, l2) >= 2
    assert bench.n_sets_for(1, l2) == 8


def test_ratios(bench):
    base = dict(dtype="bfloat16", B=1, H=2, M=64, N=64, D=16, causal=False, phase="fwd", status="ok")
    rows = [dict(base, provider="sdpa_flash", ms=2.0), dict(base, provider="sdpa_cudnn", ms=1.0),
            dict(base, provider="piecewise", ms=4.0), dict(base, provider="torch_plain", ms=None, status="skipped")]
    bench.annotate_ratios(rows)
    assert rows[2]["ratio_vs_sdpa_flash"] == pytest.approx(0.5)
    assert rows[2]["ratio_vs_sdpa_cudnn"] == pytest.approx(0.25)
    assert rows[0]["ratio_vs_sdpa_flash"] == pytest.approx(1.0)
    assert rows[3]["ratio_vs_sdpa_flash"] is None


def test_mma_only_run_reports_piecewise_mma_as_ours(bench):
    # issue 15's table runs piecewise_mma beside sdpa_flash and flag_attn without the default
    # path: the summary must put the mma rows in "ours" and give ours/flag, not blank cells
    base = dict(dtype="bfloat16", B=1, H=2, M=64, N=64, L=64, Hkv=2, D=16, causal=False, status="ok")
    rows = [dict(base, provider=p, phase=ph, ms=ms, tflops=10.0 / ms)
            for p, ms in (("piecewise_mma", 2.0), ("sdpa_flash", 1.0), ("flag_attn", 4.0))
            for ph in ("fwd", "fwd_bwd")]
    bench.annotate_ratios(rows)
    out = bench.render_summary({"main": rows})
    assert out.startswith("(ours = piecewise_mma")
    hdr, _, line = [x for x in out.splitlines() if x.startswith("|")][:3]
    cells = dict(zip([h.strip() for h in hdr.strip("|").split("|")],
                     [c.strip() for c in line.strip("|").split("|")]))
    assert cells["ours fwd"] == "5.0" and cells["ours f+b"] == "5.0"
    assert cells["ours/flash fwd"] == "0.50" and cells["ours/flag f+b"] == "2.00"
    assert "mma fwd" not in cells and cells["flag fwd"] == "2.5"
    # with the default path present, piecewise stays "ours" and piecewise_mma is a peer column
    rows += [dict(base, provider="piecewise", phase=ph, ms=1.0, tflops=10.0) for ph in ("fwd", "fwd_bwd")]
    bench.annotate_ratios(rows)
    out = bench.render_summary({"main": rows})
    assert not out.startswith("(ours") and "| ours/mma fwd |" in out


def test_plain_piecewise_matches_sdpa_when_w_beyond_distances(bench):
    g = torch.Generator().manual_seed(0)
    q1, k1, q2, k2, v = (torch.randn(1, 2, 24, 16, generator=g, dtype=torch.float64) for _ in range(5))
    for causal in (False, True):
        o = bench.plain_piecewise(q1, k1, q2, k2, v, 24, causal)
        ref = torch.nn.functional.scaled_dot_product_attention(q1, k1, v, is_causal=causal)
        assert torch.allclose(o, ref, atol=1e-10)
        # w <= -N: every pair takes q2, k2 (non-causal)
    o = bench.plain_piecewise(q1, k1, q2, k2, v, -24, False)
    ref = torch.nn.functional.scaled_dot_product_attention(q2, k2, v)
    assert torch.allclose(o, ref, atol=1e-10)


def test_cli_parsing(bench):
    a = bench.parse_args(["--quick"])
    assert a.lengths == [2048, 8192] and a.dtypes == ["bfloat16"] and a.dims == [64, 128]
    assert a.causal == [False, True] and a.budget_s == 520.0
    a = bench.parse_args([])
    assert a.lengths == [1024, 2048, 4096, 8192, 16384] and a.dtypes == ["bfloat16", "float16"]
    a = bench.parse_args(["--dtypes", "bf16,fp16", "--causal", "true", "--phases", "fwd,fwd+bwd",
                          "--providers", "piecewise,sdpa_flash", "--skip", "memory"])
    assert a.dtypes == ["bfloat16", "float16"] and a.causal == [True] and a.phases == ["fwd", "fwd_bwd"]
    assert "memory" not in a.sections
    with pytest.raises(SystemExit):
        bench.parse_args(["--providers", "nope"])


# ----------------------------------------------------------------------------- end to end
MAIN_KEYS = {"provider", "phase", "dtype", "B", "H", "M", "N", "D", "causal", "w", "ms", "tflops", "status",
             "ratio_vs_sdpa_flash", "ratio_vs_sdpa_cudnn", "flops"}


def test_dry_run_end_to_end(tmp_path):
    out = tmp_path / "res"
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["PW_TEST_MACROS"] = "PW_GRID_TID_RELOAD=2"  # an A/B build is named in the header
    proc = subprocess.run([sys.executable, BENCH, "--dry-run", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Summary" in proc.stdout

    res = json.loads((out / "results.json").read_text())
    h = res["header"]
    for k in ("date_utc", "gpu", "torch", "cupy", "triton", "command", "timer", "flop_convention"):
        assert k in h, k
    assert h["dry_run"] is True
    assert h["command"].startswith("PW_TEST_MACROS=PW_GRID_TID_RELOAD=2 python3 "), h["command"]
    assert h["env"]["PW_TEST_MACROS"] == "PW_GRID_TID_RELOAD=2"

    assert res["main"], "no main-sweep measurements"
    for r in res["main"]:
        assert MAIN_KEYS <= set(r), MAIN_KEYS - set(r)
        assert r["status"] in ("ok", "error", "skipped", "not installed")
        if r["status"] == "ok":
            assert r["ms"] > 0 and r["tflops"] > 0
            assert math.isclose(r["tflops"], r["flops"] / (r["ms"] * 1e-3) / 1e12, rel_tol=1e-9)
        else:
            assert r["error"]
    providers = {r["provider"] for r in res["main"]}
    assert {"piecewise", "piecewise_mma", "piecewise_mma_det", "flex_composite", "sdpa_flash",
            "sdpa_cudnn", "torch_plain", "flag_attn"} <= providers
    assert {r["phase"] for r in res["main"]} == {"fwd", "bwd", "fwd_bwd"}
    # the references work on CPU tensors, so they must have produced numbers
    for p in ("sdpa_flash", "torch_plain"):
        assert any(r["status"] == "ok" for r in res["main"] if r["provider"] == p), p
    flash_ok = [r for r in res["main"] if r["provider"] == "sdpa_flash" and r["status"] == "ok"]
    assert all(r["ratio_vs_sdpa_flash"] == pytest.approx(1.0) for r in flash_ok)

    pw = [r for r in res["main"] if r["provider"] == "piecewise"]
    if importlib.util.find_spec("cupy_piecewise") is not None or os.path.isdir(os.path.join(ROOT, "cupy_piecewise")):
        # the library's torch CPU path runs in the dry run
        assert any(r["status"] == "ok" for r in pw), [r.get("error") for r in pw][:3]
        checks = [c for c in res["spot_checks"] if c["status"] == "ok"]
        assert checks
        for c in checks:
            assert c["max_abs_diff_vs_sdpa"] < 0.1 and c["max_abs_diff_vs_plain_fp32"] < 0.1, c
        # piecewise_mma is the same CPU path in a dry run; on the CPU flex_composite runs its forward
        # uncompiled (torch's CPU flex has no backward: those rows carry torch's error)
        mma = [r for r in res["main"] if r["provider"] in ("piecewise_mma", "piecewise_mma_det")]
        assert all(r["status"] == "ok" for r in mma), [r.get("error") for r in mma][:3]
        for c in checks:
            assert c["vs_ours"]["piecewise_mma"] == 0.0, c
        flex = [r for r in res["main"] if r["provider"] == "flex_composite"]
        if all(r["status"] != "not installed" for r in flex):
            assert all(r["status"] == "ok" for r in flex if r["phase"] == "fwd"), [r.get("error") for r in flex][:3]
            for c in checks:
                assert c["vs_ours"]["flex_composite"] < 0.1, c
            ours = {(r["dtype"], r["D"], r["causal"], r["L"], r["phase"]): r for r in pw if r["status"] == "ok"}
            for r in flex:
                if r["status"] == "ok":
                    o = ours.get((r["dtype"], r["D"], r["causal"], r["L"], r["phase"]))
                    if o:
                        assert o["ratio_vs_flex_composite"] == pytest.approx(r["ms"] / o["ms"])

    assert res["w_sweep"] and res["w_sweep_summary"]
    for s in res["w_sweep_summary"]:
        assert {"causal", "phase", "mean_ms", "max_dev_pct"} <= set(s)
    assert res["decode"] and res["copy_bandwidth"]["status"] == "ok"
    for r in res["decode"]:
        assert {"M", "N", "H", "bytes", "gbps", "pct_of_copy_bw", "ms", "status"} <= set(r)
    assert res["memory"]
    assert {r["provider"] for r in res["memory"]} >= {"piecewise", "torch_plain"}

    md = (out / "results.md").read_text()
    for title in ("## Summary", "## Main sweep", "## Spot checks", "## w sweep", "## Decode", "## Peak memory"):
        assert title in md, title
    assert "| L | B x H | phase |" in md

    try:
        importlib.import_module("matplotlib")
    except Exception as e:
        print(f"PNG check skipped: matplotlib not importable ({type(e).__name__}: {e})")
        return
    pngs = sorted(p.name for p in out.glob("*.png"))
    configs = {(r["dtype"], r["D"], r["causal"]) for r in res["main"]}
    assert len(pngs) == len(configs), pngs
    for p in pngs:
        assert (out / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- decode targets
def test_decode_targets_judges_each_shape(tmp_path):
    """bench/decode_targets.py reads a kvcache_decode.py JSON and judges issue 13's three
    targets per shape: 90% of copy only where B·H >= 32 and N >= 32768, >= 1.0x cuDNN,
    paged >= 0.95x contiguous; with counts and the worst shortfall."""
    spec = importlib.util.spec_from_file_location(
        "decode_targets", os.path.join(ROOT, "bench", "decode_targets.py"))
    dt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dt)

    def row(provider, N, B, gbps, pct, vs_cudnn, vs_contig):
        return dict(provider=provider, dtype="bfloat16", D=64, B=B, H=32, Hkv=32, N=N,
                    gbps=gbps, pct_of_copy_bw=pct, vs_cudnn=vs_cudnn, vs_contiguous=vs_contig)

    results = {"header": {"gpu": "G", "date": "D", "command": "c"},
               "copy_bandwidth": {"gbps": 4000.0},
               "decode": [row("piecewise_kvcache", 4096, 1, 3000, 75.0, 1.02, 1.0),
                          row("piecewise_kvcache_paged64", 4096, 1, 2800, 70.0, 0.95, 0.933),
                          row("piecewise_kvcache", 32768, 8, 3800, 95.0, 0.97, 1.0),
                          row("piecewise_kvcache_paged64", 32768, 8, 3700, 92.5, 0.94, 0.974),
                          row("sdpa_cudnn", 32768, 8, 3918, 97.9, 1.0, 1.031)]}
    rows = dt.rows_of(results, 64)
    assert [(r["N"], r["copy_applies"]) for r in rows] == [(4096, False), (32768, True)]
    text = dt.table(rows, 64)
    assert "| 75.0 - | 1.020 met | 0.933 missed |" in text
    assert "| 95.0 met | 0.970 missed | 0.974 met |" in text
    assert "% of copy >= 90: met on 1 of 1 rows" in text
    assert "x cuDNN >= 1.0: met on 1 of 2 rows; range 0.970-1.020, worst 3.0% short" in text
    assert "paged64 >= 0.95: met on 1 of 2 rows; range 0.933-0.974, worst 1.8% short" in text
    path = tmp_path / "r.json"
    path.write_text(json.dumps(results))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "decode_targets.py"),
                          str(path)], capture_output=True, text=True, check=True).stdout
    assert out.startswith("G, D: `c`; device copy 4000 GB/s") and text in out


def test_decode_side_by_side_divides_each_run_by_its_own_cudnn():
    """bench/decode_targets.side_by_side: two decode tables of one machine, row by row; each
    build's ratio to the cuDNN rows of its own run, paged over contiguous per build, the
    second over the first, and cuDNN's drift; shapes missing a provider raise KeyError."""
    spec = importlib.util.spec_from_file_location(
        "decode_targets", os.path.join(ROOT, "bench", "decode_targets.py"))
    dt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dt)

    def run(ours, paged, cudnn):
        mk = lambda p, g: dict(provider=p, dtype="bfloat16", D=128, B=1, H=32, Hkv=32,  # noqa
                               N=4096, gbps=g, status="ok")
        return {"decode": [mk("piecewise_kvcache", ours), mk("piecewise_kvcache_paged64", paged),
                           mk("sdpa_cudnn", cudnn), dict(mk("sdpa_flash", 0), status="error")]}

    text = dt.side_by_side(run(2000, 1900, 2500), run(2200, 2200, 2000), ("a", "b"))
    lines = text.splitlines()
    assert lines[0].startswith("| dtype | D | B | Hkv | N | a x cuDNN | b x cuDNN |")
    assert lines[2] == ("| bfloat16 | 128 | 1 | 32 | 4096 | 0.800 | 1.100 | 0.950 | 1.000 "
                        "| 1.100 | 1.158 | 0.800 |")
    with pytest.raises(KeyError):
        dt.side_by_side(run(1, 1, 1), {"decode": run(1, 1, 1)["decode"][:1]}, ("a", "b"))
