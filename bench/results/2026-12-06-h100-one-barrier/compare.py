"""Forward+backward of the mma.sync path, the defaults before 2026-12-06 (def1, def2) against
the three macros PW_GRID_TID_RELOAD=2 PW_GRID_TWO_DS=1 PW_ONE_BARRIER=1 (mac0, mac1, mac2),
each run beside SDPA flash (bench.py, one H100, runs alternated def1 mac1 def2 mac2 within
two minutes; mac0 a few minutes earlier): ours/flash per run, then the median of ours' time
under the defaults over its median under the macros (> 1: the macros faster) and flash's own
drift between the runs (max/min of its times).

    python3 bench/results/2026-12-06-h100-one-barrier/compare.py
"""
import json
import statistics
from pathlib import Path

here = Path(__file__).resolve().parent / "bench"
runs = {"def1": "def1/results.json", "def2": "def2/results.json", "mac0": "mac0_results.json",
        "mac1": "mac1/results.json", "mac2": "mac2/results.json"}


def rows(path):
    return {(r["dtype"], r["D"], r["causal"], r["L"], r["provider"]): r["ms"]
            for r in json.load(open(here / path))["main"] if r["status"] == "ok"}


ms = {name: rows(path) for name, path in runs.items()}
print("| dtype | D | causal | L | " + " | ".join(f"{n} ours/flash" for n in runs)
      + " | defaults/macros time | flash max/min |")
print("|" + "---|" * (5 + len(runs) + 1))
for k in sorted({k[:4] for k in ms["def1"]}):
    ours = {n: ms[n][k + ("piecewise_mma",)] for n in runs}
    flash = {n: ms[n][k + ("sdpa_flash",)] for n in runs}
    gain = (statistics.median(ours[n] for n in runs if n.startswith("def"))
            / statistics.median(ours[n] for n in runs if n.startswith("mac")))
    print(f"| {' | '.join(map(str, k))} | "
          + " | ".join(f"{flash[n] / ours[n]:.3f}" for n in runs)
          + f" | {gain:.3f} | {max(flash.values()) / min(flash.values()):.3f} |")
