"""Checks pair_groups (kernels_cu/common.cuh, forward.cu's PW_FWD_COL_RANGE) against the mask.

For random warp geometries (base in +-2^30 with its extremes, w over the int range, cols_left
in [-1, 2^30], pair 1 or 2, causal or not) every column c < BN that holds an admissible element
of some row r < ROWS (d = base + r - c; pair 1: d < w, pair 2: d >= w; causal: d >= 0;
c < cols_left) must lie in a group glo <= c // 16 < ghi, with glo and ghi computed as the
kernel does (int32, sub.sat.s32). Also checks it against pair_window's per-row bounds (the
mask the kernel applies), and prints the groups computed in the aligned straddle / causal
diagonal cases of a 128x128x4 tile.

    python scripts/col_range_model.py [--trials N] [--seed S]
"""
from __future__ import annotations

import argparse

import numpy as np

I32_MIN, I32_MAX = -(2**31), 2**31 - 1
NONE = 0x7FFFFFFF


def sub_sat(a: int, b: int) -> int:
    return min(max(a - b, I32_MIN), I32_MAX)


def wrap32(x: int) -> int:
    return (x + 2**31) % 2**32 - 2**31


def pair_groups(base, w, cols_left, pair, causal, rows=32, bn=128):
    """As the C++ does (pair_groups): 32-bit ints, saturating subtraction."""
    lo = (0 if causal else -NONE) if pair == 1 else (max(0, w) if causal else w)
    hi = w if pair == 1 else NONE
    first = max(sub_sat(sub_sat(base, hi), -1), 0)
    last = min(sub_sat(wrap32(base + (rows - 1)), lo), min(cols_left, bn) - 1)
    glo = first >> 4
    ghi = (last >> 4) + 1 if first <= last else 0
    return glo, ghi


def admissible(base, w, cols_left, pair, causal, rows=32, bn=128):
    """(rows, bn) bool: the elements the visit keeps (exact integers)."""
    r = np.arange(rows, dtype=np.int64)[:, None]
    c = np.arange(bn, dtype=np.int64)[None, :]
    d = base + r - c
    keep = (d < w) if pair == 1 else (d >= w)
    if causal:
        keep &= d >= 0
    keep &= c < cols_left
    return keep


def window_keep(base, w, cols_left, pair, causal, rows=32, bn=128):
    """pair_window + scale_in_window's test, per lane and fragment element, as the C++ does."""
    lo = (0 if causal else -NONE) if pair == 1 else (max(0, w) if causal else w)
    hi = w if pair == 1 else NONE
    keep = np.zeros((rows, bn), bool)
    for row in range(rows):
        rb = base + row  # |rb| <= 2^30 + 32
        for c0 in range(0, 8, 2):
            cmin = sub_sat(sub_sat(rb, hi), c0 - 1)
            cmax = sub_sat(min(sub_sat(rb, lo), cols_left - 1), c0)
            for nb in range(bn // 8):
                for e in range(2):
                    cc = nb * 8 + e
                    if not (cc < cmin or cc > cmax):
                        keep[row, c0 + cc] = True
    return keep


def random_geoms(rng, n):
    ext_base = [-(2**30), 2**30, 0, -1, 1, -(2**30) + 1, 2**30 - 1]
    ext_w = [I32_MIN + 1, I32_MAX, 0, -1, 1, 2**30, -(2**30)]
    ext_cl = [-1, 0, 1, 2**30, 127, 128, 129]
    for _ in range(n):
        k = rng.integers(4)
        if k == 0:  # near the tile: the interesting cases
            base = int(rng.integers(-300, 300))
            w = int(rng.integers(-300, 300))
            cols_left = int(rng.integers(-1, 300))
        elif k == 1:  # extremes mixed with small values
            base = int(rng.choice(ext_base + [int(rng.integers(-200, 200))]))
            w = int(rng.choice(ext_w + [int(rng.integers(-200, 200))]))
            cols_left = int(rng.choice(ext_cl + [int(rng.integers(-1, 200))]))
        else:  # the whole documented range
            base = int(rng.integers(-(2**30), 2**30 + 1))
            w = int(rng.integers(-(2**31) + 1, 2**31))
            if rng.integers(2):
                w = base + int(rng.integers(-200, 200))
            cols_left = int(rng.integers(-1, 2**30 + 1))
        yield base, w, cols_left, int(rng.integers(1, 3)), bool(rng.integers(2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=200000)
    ap.add_argument("--window-trials", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    bad = 0
    tight = 0
    for i, (base, w, cl, pair, causal) in enumerate(random_geoms(rng, args.trials)):
        keep = admissible(base, w, cl, pair, causal)
        glo, ghi = pair_groups(base, w, cl, pair, causal)
        cols = np.nonzero(keep.any(axis=0))[0]
        groups = set(int(c) // 16 for c in cols)
        if any(not (glo <= gr < ghi) for gr in groups):
            bad += 1
            if bad <= 10:
                print("MISS", base, w, cl, pair, causal, (glo, ghi), sorted(groups))
        if groups and (min(groups), max(groups) + 1) == (glo, ghi):
            tight += 1
        elif not groups and ghi <= glo:
            tight += 1
        if i < args.window_trials:  # the kernel's own mask agrees with the model
            if not np.array_equal(window_keep(base, w, cl, pair, causal), keep):
                bad += 1
                print("WINDOW", base, w, cl, pair, causal)
    print(f"{args.trials} geometries: {bad} failures; range exactly the admissible groups' "
          f"span in {tight}")
    # aligned cases of a 128x128x4 tile: warp k's rows start at 32k, w a multiple of 128
    for ch in (1, 2, 4):
        def chunks(glo, ghi):
            return sum(ch for c in range(8 // ch) if c * ch < ghi and (c + 1) * ch > glo)
        # straddling tile, w a multiple of BN: base = w + 32k for warp k (its rows' d span
        # [w + 32k - 127, w + 32k + 31]); causal diagonal tile: base = 32k
        strad = [(chunks(*pair_groups(1024 + 32 * k, 1024, 2**30, 1, False)),
                  chunks(*pair_groups(1024 + 32 * k, 1024, 2**30, 2, False))) for k in range(4)]
        diag = [chunks(*pair_groups(32 * k, 1024, 2**30, 1, True)) for k in range(4)]
        print(f"CH={ch}: straddle (base = w + 32k): groups per warp (pair 1, pair 2) {strad}, "
              f"total {sum(a + b for a, b in strad)} of 64; causal diagonal (base = 32k): "
              f"{diag}, total {sum(diag)} of 32")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
