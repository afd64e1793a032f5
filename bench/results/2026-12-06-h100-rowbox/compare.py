"""The Hopper decode's two staged box forms, row by row, from this folder's two decode tables
(bench/kvcache_decode.py --paged 64 on one H100, four minutes apart: run1_probe3 built with
-DKV90_TILE_BOX=2, run2_rowbox1 with -DKV90_ROW_BOX=1, each with its own SDPA cuDNN rows):
each form's ratio to cuDNN, its paged over contiguous ratio, and the row-box run's bandwidth
over the tile-box run's (contiguous, paged, and cuDNN's own, which shows the drift between
the two runs). The probe tables (run*/tilebox_probe.txt) time the forms against the
half-row default in one worker; this is the second look, with paged caches.

    python3 bench/results/2026-12-06-h100-rowbox/compare.py
"""
import json
from pathlib import Path

here = Path(__file__).resolve().parent


def gbps(path):
    return {(r["dtype"], r["D"], r["B"], r["Hkv"], r["N"], r["provider"]): r["gbps"]
            for r in json.load(open(here / path))["decode"] if r["status"] == "ok"}


tile, row = gbps("run1_probe3/decode_tilebox.json"), gbps("run2_rowbox1/decode_tilebox.json")
print("| dtype | D | B | Hkv | N | tile box x cuDNN | row box x cuDNN | tile box paged64/contig "
      "| row box paged64/contig | contig row/tile | paged row/tile | cuDNN run2/run1 |")
print("|" + "---|" * 12)
for k in sorted({k[:5] for k in tile}):
    c, p, cu = (k + ("piecewise_kvcache",), k + ("piecewise_kvcache_paged64",),
                k + ("sdpa_cudnn",))
    print(f"| {' | '.join(map(str, k))} | {tile[c] / tile[cu]:.3f} | {row[c] / row[cu]:.3f} "
          f"| {tile[p] / tile[c]:.3f} | {row[p] / row[c]:.3f} | {row[c] / tile[c]:.3f} "
          f"| {row[p] / tile[p]:.3f} | {row[cu] / tile[cu]:.3f} |")
