#!/usr/bin/env python3
"""CPU model of how often the float16 backward's range fit takes its per-row path.

kernels_cu/common.cuh's fit_scaled_rows votes per 16-row block and tile: a block where some
row's largest |dS| (at the row's current scale 2^e) reached 2^15 rescales, which sets that
row's largest to [2^(14-H), 2^(15-H)) for headroom H (PW_FIT_HEADROOM); other blocks skip the
per-row work. This model draws the probes' inputs (N(0, 1) q1, k1, q2, k2, v, dO of one head,
w = L / 4, scale 1/sqrt(D)), computes dS = P (dP - delta) in float64, and replays the
scale of every row over the tiles in kernel order: the dq kernel's rows are queries over key
tiles of --bn-dq keys, the dk/dv kernel's rows are keys over query tiles of --bm-dkv queries.
It prints the fraction of (16-row block, tile) pairs that vote. Causal tiles with no
unmasked entry are not counted (the kernels skip them). Every row's first tile votes (the
scale starts at 2^60), so 1 / tiles is the floor.

    python3 scripts/fit_vote_model.py --lengths 2048,8192 --dims 64 --headroom 0,2,4
"""
from __future__ import annotations

import argparse

import numpy as np

SCALE_INIT = 60  # kernels_cu/common.cuh, PW_SCALE_INIT


def ds_magnitudes(L: int, D: int, causal: bool, seed: int = 0) -> np.ndarray:
    """|dS| (L queries x L keys) of one head of piecewise attention on N(0, 1) inputs."""
    rng = np.random.default_rng(seed)
    q1, k1, q2, k2, v, do = (rng.standard_normal((L, D)) for _ in range(6))
    d = np.arange(L)[:, None] - np.arange(L)[None, :]
    s = np.where(d < L // 4, q1 @ k1.T, q2 @ k2.T) / np.sqrt(D)
    if causal:
        s = np.where(d >= 0, s, -np.inf)
    p = np.exp(s - s.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    delta = (do * (p @ v)).sum(1, keepdims=True)
    return np.abs(p * (do @ v.T - delta))


def vote_fraction(mag: np.ndarray, tile: int, headroom: int) -> float:
    """Fraction of (16-row block, tile) pairs of ``mag`` (rows x columns, tiles along the
    columns) whose block votes, replaying fit_scaled_rows' exponents."""
    rows, cols = mag.shape
    ex = np.full(rows, SCALE_INIT)
    votes = pairs = 0
    for t0 in range(0, cols, tile):
        mx = mag[:, t0:t0 + tile].max(1)
        live = (mx > 0).reshape(-1, 16).any(1)
        crossed = mx * np.exp2(ex.astype(np.float64)) >= 2.0 ** 15
        m = np.floor(np.log2(np.where(mx > 0, mx, 1.0))).astype(int)
        ex = np.where(crossed, np.maximum(-100, 14 - headroom - m), ex)
        votes += int(crossed.reshape(-1, 16).any(1)[live].sum())
        pairs += int(live.sum())
    return votes / max(pairs, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--headroom", default="0,1,2,3,4")
    ap.add_argument("--bn-dq", type=int, default=32, help="key tile of the dq kernel")
    ap.add_argument("--bm-dkv", type=int, default=64, help="query tile of the dk/dv kernel")
    args = ap.parse_args()
    print("| L | D | causal | H | dq votes | dk/dv votes |\n|---|---|---|---|---|---|")
    for L in (int(x) for x in args.lengths.split(",")):
        for D in (int(x) for x in args.dims.split(",")):
            for causal in (False, True):
                mag = ds_magnitudes(L, D, causal)
                for H in (int(x) for x in args.headroom.split(",")):
                    print(f"| {L} | {D} | {int(causal)} | {H} | "
                          f"{vote_fraction(mag, args.bn_dq, H):.3f} | "
                          f"{vote_fraction(mag.T, args.bm_dkv, H):.3f} |", flush=True)


if __name__ == "__main__":
    main()
