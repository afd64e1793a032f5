"""The Hopper decode's two staged box forms, row by row, from this folder's two decode tables
(bench/kvcache_decode.py --paged 64 on one H100, four minutes apart: run1_probe3 built with
-DKV90_TILE_BOX=2, run2_rowbox1 with -DKV90_ROW_BOX=1, each with its own SDPA cuDNN rows):
each form's ratio to cuDNN, its paged over contiguous ratio, and the row-box run's bandwidth
over the tile-box run's (contiguous, paged, and cuDNN's own, which shows the drift between
the two runs); bench/decode_targets.py's side_by_side makes the table. The probe tables
(run*/tilebox_probe.txt) time the forms against the half-row default in one worker; this is
the second look, with paged caches.

    python3 bench/results/2026-12-06-h100-rowbox/compare.py
"""
import json
import sys
from pathlib import Path

here = Path(__file__).resolve().parent
sys.path.insert(0, str(here.parents[1]))
from decode_targets import side_by_side  # noqa: E402

print(side_by_side(json.load(open(here / "run1_probe3/decode_tilebox.json")),
                   json.load(open(here / "run2_rowbox1/decode_tilebox.json")),
                   ("tile box", "row box")))
