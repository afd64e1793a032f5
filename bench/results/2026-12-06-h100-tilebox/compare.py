"""The Hopper decode with whole-tile TMA boxes (-DKV90_TILE_BOX=1) against the default, per
shape, from this folder's two decode tables (bench/kvcache_decode.py --paged 64 on one H100,
a minute apart, each with its own SDPA cuDNN rows): each form's ratio to cuDNN and its paged
over contiguous ratio, then the tile-box run's bandwidth over the default's (contiguous,
paged, and cuDNN's own, which shows the run-to-run drift).

    python3 bench/results/2026-12-06-h100-tilebox/compare.py
"""
import json
from pathlib import Path

here = Path(__file__).resolve().parent


def gbps(path):
    return {(r["dtype"], r["D"], r["B"], r["Hkv"], r["N"], r["provider"]): r["gbps"]
            for r in json.load(open(here / path))["decode"]}


base, box = gbps("decode_default_h100.json"), gbps("decode_tilebox.json")
print("| dtype | D | B | Hkv | N | default x cuDNN | tile box x cuDNN | default paged64/contig "
      "| tile box paged64/contig | contig box/default | paged box/default | cuDNN run2/run1 |")
print("|" + "---|" * 12)
for k in sorted({k[:5] for k in base}):
    c, p, cu = (k + ("piecewise_kvcache",), k + ("piecewise_kvcache_paged64",),
                k + ("sdpa_cudnn",))
    print(f"| {' | '.join(map(str, k))} | {base[c] / base[cu]:.3f} | {box[c] / box[cu]:.3f} "
          f"| {base[p] / base[c]:.3f} | {box[p] / box[c]:.3f} | {box[c] / base[c]:.3f} "
          f"| {box[p] / base[p]:.3f} | {box[cu] / base[cu]:.3f} |")
