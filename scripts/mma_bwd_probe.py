#!/usr/bin/env python3
"""A/B probe of the mma.sync backward on one GPU: the one-kernel scheme (phase bwd_fused, dQ
by float32 atomics) at tile candidates against the deterministic two-kernel scheme (bwd_dq +
bwd_dkv at their table entries), checked against the reference, timed beside SDPA flash.

    PYTHONPATH=$PWD python3 scripts/mma_bwd_probe.py --tiles "128:16x64x4,32x64x4;64:64x64x4" \\
        --lengths 2048,8192 --dtypes bf16,fp16 --out $OUT/mma_bwd.txt

The mma.sync path is forced (CUPY_PIECEWISE_PATH=mma). For every head dim and candidate
(CUPY_PIECEWISE_TILES bwd_fused=...; a candidate written PHASE=BMxBNxW, e.g.
``bwd_grid=64x128x8``, overrides that one-kernel phase instead: the warp-grid backward):

1. check: tests/test_kernels_gpu.run_case (forward and the five gradients against the float64
   reference by the tolerance rule, outputs NaN-poisoned), default backward (the fused one),
   at ragged sizes with a straddling threshold, causal and not, grouped queries, bf16 and fp16;
2. time: B = 16384 / L, H = 2048 / D, w = L / 4, causal and not, the forward and the forward +
   backward (torch autograd through the package's torch function, gradients by
   torch.autograd.grad so nothing accumulates), CUDA-event medians of --reps calls after
   warm-up, TFLOP/s with 4 B H M N D (half causal) for the forward and 3.5x that for forward +
   backward (docs/semantics.md); rows "det" (deterministic=True) and "sdpa_flash" (SDPA's
   FlashAttention-2 backend, the issue's yardstick) in the same run.

--rounds repeats the timing (candidates interleaved); the table gives medians with the spread
and the ratio to "det" and to sdpa_flash. --out writes the text, headed by the date, GPU,
versions, command and commit, and a JSON file beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))
from mma_fwd_probe import _precompile, parse_tiles  # noqa: E402 - scripts/ is on sys.path

DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
CHECK_CASES = ((300, 300, 37, 2), (129, 517, 200, 1), (64, 700, -5, 2), (777, 64, 12, 1))


def override(spec: str) -> str:
    """The CUPY_PIECEWISE_TILES text of a candidate: ``bwd_fused=<spec>``, or the spec itself
    when it names its phase (``bwd_grid=64x128x8``)."""
    return spec if "=" in spec else f"bwd_fused={spec}"


def precompile(tiles, jobs, macros=""):
    """The candidates' fused kernels and the table's mma.sync kernels (dense, 16-bit) of the
    probed head dims, compiled in parallel (NVRTC holds the interpreter: processes)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from cupy_piecewise import build_check, capability
    from cupy_piecewise.compile import Variant

    vs = {Variant(phase, dt, D, t, c)
          for D, specs in tiles.items() for spec in specs
          for phase, t in capability.parse_override(override(spec)).items()
          for dt in DTYPES.values() for c in (False, True)}
    vs |= {v for v in build_check.variants_for((9, 0)) if v.head_dim in tiles and not v.varlen
           and v.dtype in DTYPES.values()}
    vs = sorted(vs, key=lambda v: v.name_expression)
    chunks = [vs[i::jobs] for i in range(jobs)]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        failed = [f for r in pool.map(_precompile, [macros] * jobs, chunks) for f in r]
    return len(vs), failed


def check(tiles, say):
    from cupy_piecewise import capability
    from test_kernels_gpu import run_case

    recs = []
    for D, specs in tiles.items():
        for spec in specs:
            capability.set_tile_override(override(spec))
            ok = bad = 0
            for dtype in ("bfloat16", "float16"):
                for causal in (False, True):
                    for M, N, w, group in CHECK_CASES:
                        try:
                            run_case(D, dtype, causal, M, N, w, group, False)
                            ok += 1
                        except Exception as e:  # noqa: BLE001 - reported, not raised
                            bad += 1
                            say(f"CHECK FAIL D{D} {spec} {dtype} causal={causal} M{M} N{N} w{w} "
                                f"group{group}: {type(e).__name__}: {str(e)[:400]}")
            capability.set_tile_override(None)
            recs.append(dict(kind="check", D=D, tiles=spec, passed=ok, failed=bad))
            say(f"check D{D} {override(spec)}: {ok} passed, {bad} failed")
    return recs


def time_all(args, tiles, say):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cupy_piecewise
    from cupy_piecewise import capability
    from probe_common import cuda_time

    recs = []
    dev = torch.device("cuda")
    for L in [int(x) for x in args.lengths.split(",")]:
        for D, specs in tiles.items():
            B, H = max(1, 16384 // L), 2048 // D
            for dname in args.dtypes.split(","):
                dt = getattr(torch, DTYPES[dname])
                ins = [torch.randn(B, H, L, D, device=dev, dtype=dt, requires_grad=True)
                       for _ in range(5)]
                do = torch.randn(B, H, L, D, device=dev, dtype=dt)
                for causal in (False, True):
                    f = 4 * B * H * L * L * D * (0.5 if causal else 1.0)

                    def ours(det):
                        o = cupy_piecewise.attention(*ins, L // 4, causal=causal,
                                                     deterministic=det)
                        return torch.autograd.grad(o, ins, do)

                    def flash():
                        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                            o = torch.nn.functional.scaled_dot_product_attention(
                                ins[0], ins[1], ins[4], is_causal=causal)
                            return torch.autograd.grad(o, (ins[0], ins[1], ins[4]), do)

                    def flash_fwd():
                        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.no_grad():
                            return torch.nn.functional.scaled_dot_product_attention(
                                ins[0], ins[1], ins[4], is_causal=causal)

                    def ours_fwd():
                        with torch.no_grad():
                            return cupy_piecewise.attention(*ins, L // 4, causal=causal)

                    runs = [("sdpa_flash", None, flash, flash_fwd),
                            ("det", None, lambda: ours(True), ours_fwd)]
                    runs += [(f"fused {s}", s, lambda: ours(False), None) for s in specs]
                    for rnd in range(args.rounds):
                        for name, spec, fb, fw in (runs if rnd % 2 == 0 else runs[::-1]):
                            if spec:
                                capability.set_tile_override(override(spec))
                            rec = dict(kind="time", L=L, D=D, dtype=dname, causal=causal,
                                       run=name, round=rnd)
                            try:
                                rec["fb_ms"] = cuda_time(torch, fb, reps=args.reps)
                                rec["fb_tflops"] = 3.5 * f / rec["fb_ms"] / 1e9
                                if fw is not None:
                                    rec["fwd_ms"] = cuda_time(torch, fw, reps=args.reps)
                            except Exception as e:  # noqa: BLE001 - reported
                                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                                say(f"TIME FAIL {rec}")
                            finally:
                                capability.set_tile_override(None)
                            recs.append(rec)
    return recs


def table(recs):
    """Markdown: per (L, D, dtype, causal, run) the median forward+backward TFLOP/s over
    rounds (spread %), its ratio to det and to sdpa_flash, and the backward alone (f+b minus
    the forward of the same scheme; ours share one forward) in ms."""
    def key(r):
        return r["L"], r["D"], r["dtype"], r["causal"]

    groups = {}
    for r in recs:
        if r["kind"] == "time" and "fb_ms" in r:
            groups.setdefault(key(r), {}).setdefault(r["run"], []).append(r)
    out = ["", "forward+backward TFLOP/s (3.5 x 4BHMND, half causal), median over rounds "
               "(spread %); x det, x flash: time ratios; bwd ms = f+b - fwd",
           "| L | D | dtype | causal | run | f+b TFLOP/s | x det | x flash | bwd ms |",
           "|---|---|---|---|---|---|---|---|---|"]
    for k, runs in groups.items():
        med = {n: statistics.median(x["fb_ms"] for x in rs) for n, rs in runs.items()}
        fwd = {n: statistics.median(x["fwd_ms"] for x in rs if "fwd_ms" in x)
               for n, rs in runs.items() if any("fwd_ms" in x for x in rs)}
        for n, rs in runs.items():
            tf = [x["fb_tflops"] for x in rs]
            m = statistics.median(tf)
            spread = 100 * (max(tf) - min(tf)) / m
            xdet = f"{med['det'] / med[n]:.3f}" if "det" in med else ""
            xfl = f"{med['sdpa_flash'] / med[n]:.3f}" if "sdpa_flash" in med else ""
            f0 = fwd.get("sdpa_flash") if n == "sdpa_flash" else fwd.get("det")
            bwd = f"{med[n] - f0:.3f}" if f0 is not None else ""
            out.append(f"| {k[0]} | {k[1]} | {k[2]} | {int(k[3])} | {n} | {m:.1f} ({spread:.1f}%) "
                       f"| {xdet} | {xfl} | {bwd} |")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiles", default="128:16x64x4,32x64x4;64:64x64x4,32x128x4")
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--jobs", type=int, default=min(14, os.cpu_count() or 1))
    ap.add_argument("--macros", default="",
                    help="space-separated NVRTC macros for every kernel of this run, e.g. "
                         "'PW_DQ_RED4=0' (compare with a run without: det and flash anchor both)")
    args = ap.parse_args()
    os.environ["CUPY_PIECEWISE_PATH"] = "mma"
    from cupy_piecewise import capability, compile as comp

    capability.refresh_env_override()
    comp.BASE_OPTIONS = comp.BASE_OPTIONS + tuple(f"-D{m}" for m in args.macros.split() if m)
    from mma_fwd_probe import run_header

    lines = []

    def say(*a):
        text = " ".join(str(x) for x in a)
        print(text, flush=True)
        lines.append(text)

    tiles = parse_tiles(args.tiles)
    import time

    t0 = time.time()
    count, failed = precompile(tiles, args.jobs, args.macros)
    say(f"precompiled {count} kernels in {time.time() - t0:.0f} s; {len(failed)} failed")
    for f in failed:
        say("  " + f)
    recs = []
    import torch
    import cupy

    recs.append(dict(kind="env", gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                     cupy=cupy.__version__))
    if not args.no_check:
        recs += check(tiles, say)
    recs += time_all(args, tiles, say)
    for line in table(recs):
        say(line)
    header = run_header({"": [recs]})
    header["command"] = "python3 scripts/mma_bwd_probe.py " + " ".join(sys.argv[1:])
    if args.out:
        top = [f"- {k}: {v}" for k, v in header.items()]
        Path(args.out).write_text("\n".join(top + [""] + lines) + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(dict(header=header, records=recs),
                                                                   indent=1))


if __name__ == "__main__":
    main()
