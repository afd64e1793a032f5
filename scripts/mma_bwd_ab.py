#!/usr/bin/env python3
"""Same-process A/B of compile-time builds of the mma.sync backward (kernels_cu/backward.cu:
the deterministic dq and dk/dv kernels, or the one-kernel scheme) on one GPU: backward time
only, builds interleaved.

    PYTHONPATH=$PWD python3 scripts/mma_bwd_ab.py --variants "PW_BWD_DS_PRESCALE=0" \\
        --dtypes fp16,bf16 --out $OUT/bwd_ab.txt

Every build (the default, then each ';'-separated --variants entry, its ','-separated macros
passed to NVRTC as -D options) gets its own set of the package's kernel caches (compile._functions and
_modules, launch._kernels and _launches), swapped in before each timing, so one process
times every build on the same inputs and the same GPU state. Cross-process comparisons of
the mma.sync backward moved by up to 1.5% between rows that launch identical kernels
(bench/NOTES.md, twenty-third session); this probe exists to resolve smaller differences.

For each length L, head dim D, dtype, causal flag and --modes entry: B = 16384 / L,
H = 2048 / D, w = L / 4 (or each --w-fracs entry), random inputs, the forward once (o, lse), then
``attention_backward(..., deterministic=mode == "det")`` timed by CUDA events (median of
--reps calls after warm-up), builds in the order A B ... then reversed, --rounds times.
The table gives each build's median over rounds (ms; spread = max - min in % of the
median) and its time ratio to the default build in the same mode (> 1: faster). bfloat16
kernels do not change with the float16 scaling macros, so their rows measure the probe's own
noise. --out writes the text headed by the date, GPU and command, and a JSON file of every
timing beside it.

--w-fracs times each row at thresholds w = frac * L (default 0.25, the bench's); with w >= L
every key is near, one product per tile as in a standard attention, so the w = L rows tell
the piecewise work's cost from the kernel's own (as mma_fwd_probe.py --w-fracs does for the
forward). --flash times SDPA's FlashAttention-2 backward (torch, on q1, k1, v; backward alone,
its graph built outside the timing) on the same shapes once per round, and the table's
"x flash" column gives flash's time over each build's (> 1: ours faster), the bench's ratio.

    PYTHONPATH=$PWD python3 scripts/mma_bwd_ab.py --w-fracs 0.25,1 --flash --modes default
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}

from probe_common import cuda_time, w_fracs, w_of  # noqa: E402  (scripts/, on sys.path above)


class Build:
    """One build's NVRTC macros and its own kernel caches."""

    def __init__(self, macros: str):
        self.macros = macros
        self.caches = ({}, {}, {}, {})

    def activate(self, base_options):
        from cupy_piecewise import capability, compile as comp, launch

        comp.BASE_OPTIONS = base_options + tuple(f"-D{m}" for m in self.macros.split() if m)
        comp._functions, comp._modules, launch._kernels, launch._launches = self.caches
        # the host mirrors of a macro that moves a shared-memory layout (PW_GRID_TWO_DS),
        # for this build's launch plans (each build keeps its own plan cache)
        for name, value in capability._MIRROR_DEFAULTS.items():
            setattr(capability, name, value)
        capability.apply_kernel_macros(self.macros.split())


def precompile(macro_sets, dims, jobs):
    """The sm_90 row's 16-bit dense forward and backward kernels (both schemes) of ``dims``,
    for every build, compiled in parallel into CuPy's disk cache (NVRTC holds the
    interpreter: processes), so the timing process only loads them."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from cupy_piecewise import build_check
    from mma_fwd_probe import _precompile

    vs = [v for v in build_check.variants_for((9, 0)) if v.head_dim in dims and not v.varlen
          and v.dtype in DTYPES.values()
          and v.phase in ("fwd", "bwd_dq", "bwd_dkv", "bwd_fused", "bwd_grid", "bwd_delta",
                          "bwd_dq_convert", "fwd_combine")]
    tasks = [(m, vs[i:i + 2]) for m in macro_sets for i in range(0, len(vs), 2)]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        failed = [f for r in pool.map(_precompile, *zip(*tasks)) for f in r]
    return len(vs) * len(macro_sets), failed


def time_backward(cupy, fn, warmup, reps):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cupy.cuda.get_elapsed_time(a, b))
    return statistics.median(times)


def summary_table(recs):
    """Markdown rows from the timing records ({L, D, dtype, causal, mode, w_frac, build, ms:
    [per round]}; SDPA flash's rows have build "sdpa_flash" and no w_frac): each build's
    median over rounds, its spread (max - min, % of the median), the default's median over
    its own (> 1: faster than the default) and SDPA flash's over its own where flash ran."""
    table = ["", "backward ms, median over rounds (spread %); x default, x flash: time ratios "
             "(> 1: this build faster)",
             "| L | D | dtype | causal | mode | w | build | bwd ms | x default | x flash |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def key(r):
        return r["L"], r["D"], r["dtype"], r["causal"], r.get("mode", "det"), r.get("w_frac", 0.25)

    flash = {(r["L"], r["D"], r["dtype"], r["causal"]): statistics.median(r["ms"])
             for r in recs if r["build"] == "sdpa_flash"}
    ref = {key(r): statistics.median(r["ms"]) for r in recs if r["build"] == "default"}
    for r in recs:
        med = statistics.median(r["ms"])
        k = key(r)
        spread = 100 * (max(r["ms"]) - min(r["ms"])) / med
        if r["build"] == "sdpa_flash":
            table.append(f"| {k[0]} | {k[1]} | {k[2]} | {int(k[3])} | - | - | sdpa_flash | "
                         f"{med:.3f} ({spread:.1f}%) |  | 1.000 |")
            continue
        fl = flash.get(k[:4])
        table.append(f"| {k[0]} | {k[1]} | {k[2]} | {int(k[3])} | {k[4]} | {k[5]:g}L | "
                     f"{r['build']} | {med:.3f} ({spread:.1f}%) | {ref[k] / med:.3f} | "
                     f"{'' if fl is None else f'{fl / med:.3f}'} |")
    return table


def flash_backward(torch, q, k, v, do, causal):
    """SDPA flash's backward alone on cupy arrays (B, H, L, D), read in place through DLPack:
    the forward graph built once, then autograd.grad with the graph retained."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.from_dlpack(x).detach().requires_grad_(True) for x in (q, k, v))
    g = torch.from_dlpack(do)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="",
                    help="';'-separated builds, each macros separated by ',' or spaces, "
                         "e.g. 'A=0;B=1,C=2' (default none: the default build alone)")
    ap.add_argument("--w-fracs", default="0.25",
                    help="thresholds as fractions of L, e.g. '0.25,1' (w = L: no piecewise work)")
    ap.add_argument("--flash", action="store_true",
                    help="also time SDPA flash's backward on the same shapes")
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--modes", default="det",
                    help="det (deterministic=True), default (the one-kernel scheme where the "
                         "table picks it), or both: 'det,default'")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=None)
    ap.add_argument("--jobs", type=int, default=min(14, os.cpu_count() or 1))
    args = ap.parse_args()

    os.environ["CUPY_PIECEWISE_PATH"] = "mma"
    fracs = w_fracs(args.w_fracs)  # a bad list fails before any compile
    dims = [int(x) for x in args.dims.split(",")]
    macro_sets = [""] + [" ".join(v.replace(",", " ").split())
                         for v in args.variants.split(";") if v.strip()]
    t0 = time.time()
    count, failed = precompile(macro_sets, dims, args.jobs)
    print(f"precompiled {count} kernels in {time.time() - t0:.0f} s; {len(failed)} failed",
          flush=True)
    for f in failed:
        print("  " + f, flush=True)
    import cupy

    import cupy_piecewise
    from cupy_piecewise import capability, compile as comp

    capability.refresh_env_override()
    base = comp.BASE_OPTIONS
    builds = [Build(m) for m in macro_sets]
    names = [b.macros or "default" for b in builds]
    lines, recs = [], []

    def say(text):
        print(text, flush=True)
        lines.append(text)

    import numpy as np

    from cupy_piecewise.gpu_arrays import to_device
    if args.flash:
        import torch

    rng = np.random.default_rng(20261204)
    for L in (int(x) for x in args.lengths.split(",")):
        for D in dims:
            B, H = max(1, 16384 // L), 2048 // D
            host = [rng.standard_normal((B, H, L, D), dtype=np.float32) for _ in range(6)]
            for dname in args.dtypes.split(","):
                dt = DTYPES[dname]
                q1, k1, q2, k2, v, do = (to_device(x, dt) for x in host)
                for causal in (False, True):
                    if args.flash:
                        fb = flash_backward(torch, q1, k1, v, do, causal)
                        fms = [cuda_time(torch, fb, 3, args.reps) for _ in range(args.rounds)]
                        recs.append(dict(L=L, D=D, dtype=dname, causal=causal, build="sdpa_flash",
                                         ms=fms))
                        say(f"L {L} D {D} {dname} causal {int(causal)} sdpa_flash: "
                            f"{statistics.median(fms):.3f} ms")
                        del fb
                    for mode, frac in itertools.product(args.modes.split(","), fracs):
                        w = w_of(L, frac)
                        builds[0].activate(base)
                        o, lse = cupy_piecewise.attention(q1, k1, q2, k2, v, w, causal=causal,
                                                          return_lse=True)

                        def bwd():
                            return cupy_piecewise.attention_backward(
                                do, q1, k1, q2, k2, v, o, lse, w, causal=causal,
                                deterministic=mode == "det")

                        ms = {n: [] for n in names}
                        for rnd in range(args.rounds):
                            order = list(zip(builds, names))
                            for b, n in (order if rnd % 2 == 0 else order[::-1]):
                                b.activate(base)
                                ms[n].append(time_backward(cupy, bwd, 3, args.reps))
                        for n in names:
                            recs.append(dict(L=L, D=D, dtype=dname, causal=causal, mode=mode,
                                             w_frac=frac, build=n, ms=ms[n]))
                        say(" | ".join([f"L {L} D {D} {dname} causal {int(causal)} {mode} "
                                        f"w {frac:g}L"] +
                                       [f"{n}: {statistics.median(ms[n]):.3f} ms" for n in names]))
    builds[0].activate(base)
    table = summary_table(recs)
    for line in table:
        say(line)
    if args.out:
        now = datetime.datetime.now(datetime.timezone.utc)
        head = [f"- date: {now.isoformat(timespec='seconds')}",
                f"- gpu: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}",
                f"- cupy: {cupy.__version__}",
                "- command: python3 " + " ".join(sys.argv)]
        Path(args.out).write_text("\n".join(head + [""] + lines) + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(recs, indent=1))


if __name__ == "__main__":
    main()
