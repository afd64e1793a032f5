"""Prints piecewise_mma's ratios to SDPA flash (time of flash / time of ours, > 1: ours faster)
in this session's bench (mma_bench/, staged defaults on) beside the twenty-fifth session's run
of the same rows (../2026-12-04-h200-mma-vs-flag-attn/triton_default/, earlier defaults). Each
ratio is taken within its own run, so the two columns compare like with like although the runs
were on different machines' sessions."""
import json
from pathlib import Path

here = Path(__file__).resolve().parent


def rows(path):
    return {(r["dtype"], r["D"], r["causal"], r["L"], r["phase"]): r
            for r in json.load(open(path))["main"] if r["provider"] == "piecewise_mma"}


new = rows(here / "mma_bench" / "results.json")
old = rows(here.parent / "2026-12-04-h200-mma-vs-flag-attn" / "triton_default" / "results.json")
print("| dtype | D | causal | L | phase | ours/flash before | ours/flash now | ours/cudnn now | TFLOP/s now |")
print("|" + "---|" * 9)
for k in sorted(new):
    o, n = old.get(k, {}), new[k]
    f = lambda r, p: f"{r[p]:.3f}" if r.get(p) else "-"
    print(f"| {k[0]} | {k[1]} | {'yes' if k[2] else 'no'} | {k[3]} | {k[4]} | "
          f"{f(o, 'ratio_vs_sdpa_flash')} | {f(n, 'ratio_vs_sdpa_flash')} | "
          f"{f(n, 'ratio_vs_sdpa_cudnn')} | {n['tflops']:.1f} |")
