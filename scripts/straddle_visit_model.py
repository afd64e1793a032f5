#!/usr/bin/env python3
"""How many tile visits the mma.sync forward makes against one standard attention, no GPU
needed (bench/NOTES.md, forty-first section).

The forward (kernels_cu/forward.cu) sweeps a query tile's key tiles; a key tile that
straddles d = w (tile_mode 3: some pair d < w, some d >= w) needs both projections, and the
one-key-slot forms visit it twice, a whole score product, online softmax and P·V each. A
standard attention on the same tiles (FlashAttention-2's work, the SDPA flash peer) visits
every key tile once. At equal speed per visit, standard / ours bounds our speed ratio from
above. With halves (``PW_FWD_STRADDLE_HALVES``, an A/B build timed on an H100 on 2026-12-07
and removed: none of the bound's gain at D = 128, +2-3% at D = 64 non-causal only; its patch
is in bench/results/2026-12-07-h100-straddle-parts) a straddling tile costs, per warp of 32 rows,
two half visits (0.5 each) plus a quarter visit for each half where the warp's rows cross
d = w (the second score product over half the keys: a product is half a visit's tensor
work); the block waits for its slowest warp, so a tile costs the largest warp's sum.

    python3 scripts/straddle_visit_model.py                 # the SPEC table's rows, D = 128
    python3 scripts/straddle_visit_model.py --bm 128 --bn 128 --L 2048

Square problems (M = N = L), w = L / 4 (the bench's), no query offset. A model of work, not
of time: per-block set-up, the exposed loads of the straddling tiles and the phase changes of
the rotating-slot sweep are not in it.
"""
from __future__ import annotations

import argparse


def tile_mode(q0: int, qn: int, k0: int, kn: int, w: int) -> int:
    """kernels_cu/common.cuh tile_mode with P = 0: bit 0 some d < w, bit 1 some d >= w."""
    dmin = q0 - (k0 + kn - 1)
    dmax = q0 + qn - 1 - k0
    return (1 if dmin < w else 0) | (2 if dmax >= w else 0)


def visits(L: int, causal: bool, bm: int = 128, bn: int = 64, warp_rows: int = 32,
           w: int | None = None) -> tuple[int, int, float]:
    """(standard visits, ours, ours with straddle halves) summed over the query tiles of one
    (sequence, head) of length L."""
    w = L // 4 if w is None else w
    standard = ours = 0
    halves = 0.0
    hb = bn // 2
    for m0 in range(0, L, bm):
        n_end = min(m0 + bm, L) if causal else L
        for t in range((n_end + bn - 1) // bn):
            standard += 1
            if tile_mode(m0, bm, t * bn, bn, w) != 3:
                ours += 1
                halves += 1
                continue
            ours += 2
            halves += max(
                sum(0.5 + (0.25 if tile_mode(m0 + r, warp_rows, t * bn + h * hb, hb, w) == 3
                           else 0.0) for h in range(2))
                for r in range(0, bm, warp_rows))
    return standard, ours, halves


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--L", type=int, nargs="*", default=[2048, 8192, 16384])
    ap.add_argument("--bm", type=int, default=128)
    ap.add_argument("--bn", type=int, default=64)
    ap.add_argument("--warp-rows", type=int, default=32)
    a = ap.parse_args(argv)
    print(f"tile {a.bm}x{a.bn}, {a.warp_rows} rows per warp, w = L / 4; bound = standard / ours")
    print("| L | causal | standard | ours | bound | with halves | bound |")
    print("|---|---|---|---|---|---|---|")
    for L in a.L:
        for causal in (False, True):
            s, o, h = visits(L, causal, a.bm, a.bn, a.warp_rows)
            print(f"| {L} | {'yes' if causal else 'no'} | {s} | {o} | {s / o:.3f} | {h:g} | "
                  f"{s / h:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
