"""piecewise_mma's ratios to SDPA flash (time of flash / time of ours, > 1: ours faster) in this
folder's run (results.json: 2026-12-05, warp-grid backward and rotating-slot forward) beside
the last H200 run of the same table (../2026-12-04-h200-staged-defaults/mma_bench). Each ratio
is taken within its own run, so the columns compare like with like across sessions.

    python3 bench/results/2026-12-05-h200-mma-table/compare.py [NEW.json OLD.json]
"""
import json
import sys
from pathlib import Path

here = Path(__file__).resolve().parent
new_path, old_path = (sys.argv[1:3] if len(sys.argv) > 2 else
                      (here / "results.json",
                       here.parent / "2026-12-04-h200-staged-defaults" / "mma_bench" / "results.json"))


def rows(path):
    return {(r["dtype"], r["D"], r["causal"], r["L"], r["phase"]): r
            for r in json.load(open(path))["main"] if r["provider"] == "piecewise_mma"}


def fmt(r, key):
    return f"{r[key]:.3f}" if r.get(key) else "-"


new, old = rows(new_path), rows(old_path)
print("| dtype | D | causal | L | phase | ours/flash before | ours/flash now | ours/cudnn now "
      "| ours/flag now | TFLOP/s now |")
print("|" + "---|" * 10)
for k in sorted(new):
    o, n = old.get(k, {}), new[k]
    print(f"| {k[0]} | {k[1]} | {'yes' if k[2] else 'no'} | {k[3]} | {k[4]} | "
          f"{fmt(o, 'ratio_vs_sdpa_flash')} | {fmt(n, 'ratio_vs_sdpa_flash')} | "
          f"{fmt(n, 'ratio_vs_sdpa_cudnn')} | {fmt(n, 'ratio_vs_flag_attn')} | {n['tflops']:.1f} |")
