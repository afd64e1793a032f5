"""The Hopper decode's boxes on an H200, row by row: the default since this folder (whole
rows at D = 128 where the splits are not merged in a cluster, -DKV90_ROW_BOX=2) against the
half-row form before it (-DKV90_ROW_BOX=0), from this folder's decode tables
(bench/kvcache_decode.py --paged 64, the two builds about a minute apart, twice: run1 and
run2, each table with its own SDPA cuDNN rows); bench/decode_targets.py's side_by_side makes
each table.

    python3 bench/results/2026-12-06-h200-rowbox-default/compare.py
"""
import json
import sys
from pathlib import Path

here = Path(__file__).resolve().parent
sys.path.insert(0, str(here.parents[1]))
from decode_targets import side_by_side  # noqa: E402

for run, prefix in (("run1", "decode_"), ("run2", "decode2_")):
    print(f"\n{run}: half rows (KV90_ROW_BOX=0) then the default (KV90_ROW_BOX=2)\n")
    print(side_by_side(json.load(open(here / run / f"{prefix}halfrow.json")),
                       json.load(open(here / run / f"{prefix}default.json")),
                       ("half rows", "default")))
