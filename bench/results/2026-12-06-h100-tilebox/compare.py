"""The Hopper decode with whole-tile TMA boxes (-DKV90_TILE_BOX=1) against the default, per
shape, from this folder's two decode tables (bench/kvcache_decode.py --paged 64 on one H100,
a minute apart, each with its own SDPA cuDNN rows): each form's ratio to cuDNN and its paged
over contiguous ratio, then the tile-box run's bandwidth over the default's (contiguous,
paged, and cuDNN's own, which shows the run-to-run drift); bench/decode_targets.py's
side_by_side makes the table.

    python3 bench/results/2026-12-06-h100-tilebox/compare.py
"""
import json
import sys
from pathlib import Path

here = Path(__file__).resolve().parent
sys.path.insert(0, str(here.parents[1]))
from decode_targets import side_by_side  # noqa: E402

print(side_by_side(json.load(open(here / "decode_default_h100.json")),
                   json.load(open(here / "decode_tilebox.json")), ("default", "tile box")))
