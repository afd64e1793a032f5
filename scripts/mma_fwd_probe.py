#!/usr/bin/env python3
"""A/B probe of the mma.sync forward (kernels_cu/forward.cu) on one GPU: compile-time
variants x tile candidates, checked against the reference, then timed beside SDPA flash.

    PYTHONPATH=$PWD python3 scripts/mma_fwd_probe.py --variants "PW_FWD_VISITS=0" \\
        --tiles "128:128x64x8,128x64x4;64:128x64x4" --out $OUT/mma_fwd.txt

Every build (the default and each --variants entry, its macros passed to NVRTC as -D options)
runs in its own worker process (the in-process kernel cache is keyed by the variant, not the
options). A worker forces the mma.sync path (CUPY_PIECEWISE_PATH=mma), and for every head dim
and tile candidate (CUPY_PIECEWISE_TILES fwd=...):

1. check: tests/test_kernels_gpu.run_case (forward and gradients against the float64
   reference by the tolerance rule, outputs NaN-poisoned) at ragged sizes with a straddling
   threshold, causal and not, bf16 and fp16;
2. time: bf16 (and --dtypes), B = 16384 / L, H = 2048 / D, w = L / 4, causal and not,
   CUDA-event median of --reps calls after warm-up, TFLOP/s with 4 B H M N D (half causal).

The parent runs the builds --rounds times in interleaved order and tables the medians with
the spread (max - min over rounds, % of the median), beside SDPA flash (FlashAttention-2,
mma.sync: the issue's yardstick) timed in the default build's worker. Builds run in separate
processes, and rows whose kernels a variant does not change moved by up to 4.6% there
(bench/results/2026-12-04-h200-staged-defaults): --control adds a build of the default
kernels under a macro no kernel reads (CONTROL_MACRO, identical PTX), timed in its own
worker without SDPA flash beside it, so the table shows this probe's noise, and any bias of
the default's worker, in the same run as the variants. --out writes that
text headed by the date, GPU, versions, command and commit, and beside it a JSON file
{header, builds: {build: [round records]}}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from probe_common import w_fracs, w_of  # noqa: E402  (shared with mma_bwd_ab.py)

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
CONTROL_MACRO = "PW_PROBE_CONTROL=1"  # read by no kernel: --control's build is the default's


def worker(args) -> None:
    os.environ["CUPY_PIECEWISE_PATH"] = "mma"
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    import torch

    import cupy_piecewise
    from cupy_piecewise import capability, compile as comp
    from probe_common import cuda_time  # scripts/ (this file's folder) is on sys.path

    comp.BASE_OPTIONS = comp.BASE_OPTIONS + tuple(f"-D{m}" for m in args.macros.split() if m)
    capability.apply_kernel_macros(args.macros.split())  # e.g. PW_FWD_Q_ROTATE's smem size
    import cupy

    out = [dict(kind="env", gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                cupy=cupy.__version__)]
    tiles = parse_tiles(args.tiles)
    if args.check:
        from test_kernels_gpu import run_case

        for D, specs in tiles.items():
            for spec in specs:
                capability.set_tile_override(f"fwd={spec}")
                for dtype in ("bfloat16", "float16"):
                    for causal in (False, True):
                        for M, N, w in ((300, 300, 37), (129, 517, 200), (64, 700, -5)):
                            try:
                                run_case(D, dtype, causal, M, N, w, 2, False)
                                verdict = "ok"
                            except Exception as e:  # noqa: BLE001 - reported, not raised
                                verdict = f"FAIL {type(e).__name__}: {str(e)[:300]}"
                            out.append(dict(kind="check", D=D, tiles=spec, dtype=dtype,
                                            causal=causal, M=M, N=N, w=w, verdict=verdict))
                capability.set_tile_override(None)
    dev = torch.device("cuda")
    for L in [int(x) for x in args.lengths.split(",")]:
        for D, specs in tiles.items():
            B, H = max(1, 16384 // L), 2048 // D
            for dname in args.dtypes.split(","):
                dt = getattr(torch, DTYPES[dname])
                q1, k1, q2, k2, v = (torch.randn(B, H, L, D, device=dev, dtype=dt)
                                     for _ in range(5))
                for causal in (False, True):
                    flops = 4 * B * H * L * L * D * (0.5 if causal else 1.0)
                    # one row per (tile candidate, threshold): w = L / 4 keeps the tile name
                    runs = [(tile_label(s, frac),
                             lambda s=s, w=w_of(L, frac): cupy_piecewise.attention(
                                 q1, k1, q2, k2, v, w, causal=causal))
                            for s in specs for frac in w_fracs(args.w_fracs)]
                    if args.flash and dname != "fp32":
                        from torch.nn.attention import SDPBackend, sdpa_kernel

                        def flash():
                            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                                return torch.nn.functional.scaled_dot_product_attention(
                                    q1, k1, v, is_causal=causal)
                        runs.append(("sdpa_flash", flash))
                    for spec, fn in runs:
                        if spec != "sdpa_flash":
                            capability.set_tile_override(f"fwd={spec.split()[0]}")
                        try:
                            with torch.no_grad():
                                ms = cuda_time(torch, fn, reps=args.reps)
                            rec = dict(kind="time", L=L, D=D, dtype=dname, causal=causal,
                                       tiles=spec, ms=ms, tflops=flops / ms / 1e9)
                        except Exception as e:  # noqa: BLE001
                            rec = dict(kind="time", L=L, D=D, dtype=dname, causal=causal,
                                       tiles=spec, error=f"{type(e).__name__}: {str(e)[:200]}")
                        finally:
                            capability.set_tile_override(None)
                        out.append(rec)
    print(json.dumps(out), flush=True)


def tile_label(spec, frac):
    """A timing row's tiles column: the candidate alone at the bench's w = L / 4, else the
    candidate and the fraction ('128x64x4 w=1L'). With w >= L every key is near (d < w), so
    the kernel does one product per tile, as a standard attention does: the row that tells
    the piecewise cost (far and straddling tiles, two Q tiles) from the kernel's own."""
    return spec if frac == 0.25 else f"{spec} w={frac:g}L"


def parse_tiles(text):
    """'128:128x64x8,128x64x4;64:128x64x4' -> {128: [...], 64: [...]}"""
    out = {}
    for part in text.split(";"):
        if part.strip():
            d, specs = part.split(":")
            out[int(d)] = [s.strip() for s in specs.split(",") if s.strip()]
    return out


def summary_table(results, builds):
    """Markdown lines: per (L, D, dtype, causal, tiles) row, each build's median TFLOP/s over
    its rounds with the spread ((max - min) / median), and for the other builds the ratio to
    the default build (builds[0]) on the same row; a cell is empty where a build has no
    timing, and no ratio is given where the default has none.

    results: {build: [round records, ...]}, each round the worker's list of records
    (``kind`` "time" with L, D, dtype, causal, tiles and tflops, or an error instead)."""
    def key(rec):
        return rec["L"], rec["D"], rec["dtype"], rec["causal"], rec["tiles"]

    keys = []
    for rounds in results.values():
        for recs in rounds:
            for rec in recs:
                if rec["kind"] == "time" and key(rec) not in keys:
                    keys.append(key(rec))
    out = ["", "TFLOP/s, median over rounds (spread %); xR = build / default on the same row",
           "| L | D | dtype | causal | tiles | " + " | ".join(b or "default" for b in builds) + " |",
           "|---|---|---|---|---|" + "---|" * len(builds)]
    for k in keys:
        cells, base = [], None
        for i, b in enumerate(builds):
            vals = [rec["tflops"] for recs in results[b] for rec in recs
                    if rec["kind"] == "time" and "tflops" in rec and key(rec) == k]
            if not vals:
                cells.append("")
                continue
            med = statistics.median(vals)
            cell = f"{med:.1f} ({100 * (max(vals) - min(vals)) / med:.1f}%)"
            if i == 0:
                base = med
            elif base is not None:
                cell += f" x{med / base:.3f}"
            cells.append(cell)
        out.append(f"| {k[0]} | {k[1]} | {k[2]} | {int(k[3])} | {k[4]} | " + " | ".join(cells) + " |")
    return out


def run_header(results):
    """Where and when the figures were taken: date (UTC), GPU and library versions (from the
    workers' env records), the command line and the sources (bench/provenance.py)."""
    import datetime

    env = next((rec for rounds in results.values() for recs in rounds for rec in recs
                if rec.get("kind") == "env"), {})
    from probe_common import source_stamp  # scripts/ (this file's folder) is on sys.path
    commit = source_stamp()
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                gpu=env.get("gpu"), torch=env.get("torch"), cupy=env.get("cupy"),
                command="python3 scripts/mma_fwd_probe.py " + " ".join(sys.argv[1:]),
                git_commit=commit)


def _precompile(macros, variants):
    """Compile and load ``variants`` with ``macros`` (a spawned pool worker): fills CuPy's
    disk cache, keyed by source and options, so the timing workers only load."""
    sys.path.insert(0, str(ROOT))
    from cupy_piecewise import compile as comp

    comp.BASE_OPTIONS = comp.BASE_OPTIONS + tuple(f"-D{m}" for m in macros.split() if m)
    failed = []
    for v in variants:
        try:
            comp.get_function(0, v)
        except Exception as e:  # noqa: BLE001 - reported by the parent
            failed.append(f"{v.name_expression}: {type(e).__name__}: {str(e)[:500]}")
    return failed


def precompile(builds, tiles, dtypes, jobs):
    """Every forward candidate and the table's backward kernels of the checked head dims, for
    every build, compiled in parallel (NVRTC holds the interpreter: processes)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    sys.path.insert(0, str(ROOT))
    from cupy_piecewise import build_check, capability
    from cupy_piecewise.compile import Variant

    names = sorted({DTYPES[d] for d in dtypes.split(",")} | {"bfloat16", "float16"})
    vs = [Variant("fwd", dt, D, capability.parse_override(f"fwd={spec}")["fwd"], c)
          for D, specs in tiles.items() for spec in specs for dt in names for c in (False, True)]
    vs += [v for v in build_check.variants_for((9, 0)) if v.head_dim in tiles and not v.varlen
           and v.dtype in ("bfloat16", "float16")
           and v.phase in ("bwd_dq", "bwd_dkv", "bwd_delta", "fwd_combine")]
    tasks = [(b, vs[i:i + 3]) for b in builds for i in range(0, len(vs), 3)]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        failed = [f for r in pool.map(_precompile, *zip(*tasks)) for f in r]
    return len(vs) * len(builds), failed


def build_list(variants: str, control: bool) -> list[str]:
    """The builds a run times, each a space-separated macro string: the default (""), each
    ';'-separated --variants entry, then with --control the default's kernels again under
    CONTROL_MACRO."""
    builds = [""] + [v.strip() for v in variants.split(";") if v.strip()]
    return builds + [CONTROL_MACRO] if control else builds


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="", help="';'-separated macro sets, e.g. 'A=1 B=0;C=1'")
    ap.add_argument("--tiles", default="128:128x64x8,128x64x4;64:128x64x4")
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--w-fracs", default="0.25",
                    help="thresholds to time, as fractions of L (e.g. '0.25,1': w = L / 4, the "
                         "bench's, and w = L, where every key is near and one product per tile "
                         "remains)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--control", action="store_true",
                    help=f"add a build of the default kernels ({CONTROL_MACRO}, read by no "
                         "kernel) to measure the probe's noise")
    ap.add_argument("--out", default=None)
    ap.add_argument("--jobs", type=int, default=min(14, os.cpu_count() or 1))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--macros", default="", help=argparse.SUPPRESS)
    ap.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--flash", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    try:
        w_fracs(args.w_fracs)
    except ValueError as e:
        ap.error(str(e))
    builds = build_list(args.variants, args.control)
    results = {b: [] for b in builds}
    lines = []

    def say(*a):
        text = " ".join(str(x) for x in a)
        print(text, flush=True)
        lines.append(text)

    import time

    t0 = time.time()
    count, failed = precompile(builds, parse_tiles(args.tiles), args.dtypes, args.jobs)
    say(f"precompiled {count} kernels in {time.time() - t0:.0f} s; {len(failed)} failed")
    for f in failed:
        say("  " + f)
    for rnd in range(args.rounds):
        for b in (builds if rnd % 2 == 0 else builds[::-1]):
            cmd = [sys.executable, __file__, "--worker", "--macros", b, "--tiles", args.tiles,
                   "--lengths", args.lengths, "--dtypes", args.dtypes, "--reps", str(args.reps),
                   "--w-fracs", args.w_fracs]
            if rnd == 0 and not args.no_check:
                cmd.append("--check")
            if b == "":
                cmd.append("--flash")
            r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if r.returncode != 0:
                say(f"build '{b or 'default'}' round {rnd}: worker failed\n{r.stderr[-3000:]}")
                continue
            recs = json.loads(r.stdout.strip().splitlines()[-1])
            results[b].append(recs)
            for rec in recs:
                if rec["kind"] == "check" and rec["verdict"] != "ok":
                    say(f"CHECK build '{b or 'default'}' D{rec['D']} {rec['tiles']} {rec['dtype']} "
                        f"causal={rec['causal']} M{rec['M']} N{rec['N']} w{rec['w']}: {rec['verdict']}")
            nchk = sum(1 for rec in recs if rec["kind"] == "check")
            bad = sum(1 for rec in recs if rec["kind"] == "check" and rec["verdict"] != "ok")
            if nchk:
                say(f"build '{b or 'default'}': {nchk - bad}/{nchk} checks passed")
    for line in summary_table(results, builds):
        say(line)
    header = run_header(results)
    if args.out:
        top = [f"- {k}: {v}" for k, v in header.items()]
        Path(args.out).write_text("\n".join(top + [""] + lines) + "\n")
        Path(args.out).with_suffix(".json").write_text(
            json.dumps(dict(header=header, builds=results), indent=1))


if __name__ == "__main__":
    main()
