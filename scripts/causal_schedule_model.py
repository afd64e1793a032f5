#!/usr/bin/env python3
"""A list-scheduling model of the causal Hopper forward's two grids (bench/NOTES.md, "The
causal forward in pairs of query tiles"), no GPU needed:

- one CTA per query tile: tiles in the hardware's launch order (head by head, the longest
  query tile first, as the kernel maps blockIdx.x), each SM taking the next tile when it is
  free; a tile costs its key tiles plus ``c`` key tiles of per-CTA set-up (barriers, Q load,
  ring fill, epilogue), which the persistent grid hides;
- pairs: units (query tiles nmt-1-u and u of one head) dealt to min(units, SMs) CTAs with a
  static stride, no set-up cost.

Square causal problems (M = N = L), 128 x 128 tiles. ``c`` = 1.3 reproduces the H200 bench
(pairs 1.19x at L = 2048, 1.06x at 8192, 0.99x at 16384 for B x H = 16384 x 16 / L at
D = 128; measured +9-12%, +3-5%, -1%). The model has not been checked on other shapes.

    python3 scripts/causal_schedule_model.py                 # the bench rows and a sweep
    python3 scripts/causal_schedule_model.py --bh 6 --L 6144  # one shape
    python3 scripts/causal_schedule_model.py --bwd            # the causal backward's order

``--bwd`` models the causal Hopper backward (one CTA per 128-key tile, each visiting the
64-row query tiles at or after it) in the default launch order and longest first (the order
of the removed PW90_BWD_LPT), with the forward's set-up cost. It has not been fitted to
backward measurements, and the longest-first order it favours timed 0.92-1.00x the default
on an H200 (bench/NOTES.md, sixteenth session): the modelled tail did not appear.
"""
from __future__ import annotations

import argparse
import heapq

SMS = 132  # H200
SETUP = 1.3  # key tiles of per-CTA set-up, fitted to the bench (see the docstring)


def one_cta_per_tile(bh: int, nmt: int, sms: int = SMS, c: float = SETUP) -> float:
    """Makespan (in key-tile times) of one CTA per query tile, dispatched in launch order."""
    free = [0.0] * sms
    for _ in range(bh):
        for m in reversed(range(nmt)):  # query tile m sees m + 1 key tiles
            t = heapq.heappop(free)
            heapq.heappush(free, t + m + 1 + c)
    return max(free)


def pairs(bh: int, nmt: int, sms: int = SMS) -> float:
    """Makespan of the persistent walk over pairs: CTA g takes units g, g + G, ..."""
    units = (nmt + 1) // 2
    cost = [(nmt - u) + ((u + 1) if nmt - 1 - u != u else 0) for u in range(units)]
    total = units * bh
    ctas = min(total, sms)
    load = [0.0] * ctas
    for k in range(total):
        load[k % ctas] += cost[k % units]
    return max(load)


def speedup(bh: int, L: int, sms: int = SMS, c: float = SETUP) -> float:
    """Modelled time of one CTA per tile over time of pairs (> 1: pairs faster)."""
    nmt = L // 128
    return one_cta_per_tile(bh, nmt, sms, c) / pairs(bh, nmt, sms)


def bwd_key_tile_work(n: int, nqt: int) -> int:
    """Query tiles (64 rows) the causal backward's key tile n (128 keys) visits at M = N:
    those at or after its first row, nqt - 2n (the d = w straddle's second visit ignored)."""
    return nqt - 2 * n


def bwd_order(bh: int, nkt: int, lpt_ctas: int = 0) -> list:
    """Key-tile indices in launch order: the default grid (key tile fastest, head by head),
    or with ``lpt_ctas`` the order of the removed PW90_BWD_LPT (groups of
    max(1, lpt_ctas // nkt) heads, each group's key tiles in increasing order, the longest
    first, across its heads)."""
    if not lpt_ctas:
        return [n for _ in range(bh) for n in range(nkt)]
    g = max(1, min(bh, lpt_ctas // nkt))
    return [n for g0 in range(0, bh, g) for n in range(nkt) for _ in range(g0, min(bh, g0 + g))]


def bwd_makespan(bh: int, L: int, lpt_ctas: int = 0, sms: int = SMS, c: float = SETUP) -> float:
    """Makespan over the ideal (total work / SMs) of the causal backward's one CTA per key
    tile, dispatched in launch order; a key tile costs its query tiles plus ``c`` of set-up."""
    nkt, nqt = L // 128, L // 64
    free = [0.0] * sms
    total = 0.0
    for n in bwd_order(bh, nkt, lpt_ctas):
        cost = bwd_key_tile_work(n, nqt) + c
        total += cost
        t = heapq.heappop(free)
        heapq.heappush(free, t + cost)
    return max(free) / (total / sms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bh", type=int, help="batch x heads of one shape")
    ap.add_argument("--L", type=int, help="sequence length (a multiple of 128) of one shape")
    ap.add_argument("--setup", type=float, default=SETUP, help="per-CTA set-up, key tiles")
    ap.add_argument("--bwd", action="store_true",
                    help="the causal backward's launch order instead: default, longest first")
    a = ap.parse_args()
    if a.bwd:
        print("causal backward, makespan / ideal (bench rows: B x H = 16384 x 2048 / (L x D)):")
        for D in (64, 128):
            for L in (2048, 8192, 16384):
                bh = 16384 * 2048 // (L * D)
                print(f"  D = {D:3d}, L = {L:5d}: default {bwd_makespan(bh, L, c=a.setup):.3f}, "
                      f"longest first (256 CTAs a group) {bwd_makespan(bh, L, 256, c=a.setup):.3f}")
        return
    if a.bh and a.L:
        print(f"B x H = {a.bh}, L = {a.L}: pairs {speedup(a.bh, a.L, c=a.setup):.3f}x")
        return
    print("bench rows (B x H = 16384 x 16 / L, D = 128):")
    for L in (2048, 8192, 16384):
        print(f"  L = {L:5d}: pairs {speedup(16384 * 16 // L, L, c=a.setup):.3f}x")
    rows = [(speedup(bh, L, c=a.setup), bh, L) for bh in list(range(1, 65)) + [96, 128, 192, 256, 512]
            for L in (512, 768, 1024, 1152, 1536, 2048, 3072, 4096, 6144, 8192, 16384, 32768)]
    rows.sort()
    slow = sum(r < 0.97 for r, _, _ in rows) / len(rows)
    fast = sum(r > 1.03 for r, _, _ in rows) / len(rows)
    print(f"sweep of {len(rows)} shapes (B x H 1-64, 96-512; L 512-32768): pairs < 0.97x in "
          f"{slow:.0%}, > 1.03x in {fast:.0%}; slowest:")
    for r, bh, L in rows[:5]:
        print(f"  B x H = {bh:3d}, L = {L:5d}: {r:.3f}x")


if __name__ == "__main__":
    main()
