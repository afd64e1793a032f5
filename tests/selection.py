"""The exact-selection construction (shared by the CPU and GPU selection tests).

One projection pair scores every key with a large constant, the other with exactly zero,
so each row's softmax puts all but e^-32 of its mass, uniformly, on exactly the keys the
rule gives that pair (d >= w for pair 2, d < w for pair 1, admissible keys only). Values
are one-hot (key j -> unit vector j mod D), so o[i] counts the selected keys per residue:
including or excluding a single key moves some element of o[i] by at least 1/|S_i|, while
rounding to bfloat16 moves none by more than 2^-8 of its value (at most 2/|S_i| when
N <= 2 D). Any off-by-one at the boundary, at any tile position, fails outright.
"""
from __future__ import annotations

import numpy as np

SCORE = 32.0  # sm_scale * (8 * 8) with sm_scale = 0.5: exactly representable everywhere


def inputs(B, H, M, N, D, pair):
    """(q1, k1, q2, k2, v) as float32 arrays holding exact bf16/fp16 values; ``pair`` (1 or
    2) is the projection that scores the constant."""
    q = np.zeros((B, H, M, D), np.float32)
    k = np.zeros((B, H, N, D), np.float32)
    q[..., 0] = 8.0
    k[..., 0] = 8.0
    zq, zk = np.zeros_like(q), np.zeros_like(k)
    v = np.zeros((B, H, N, D), np.float32)
    v[:, :, np.arange(N), np.arange(N) % D] = 1.0
    return (q, k, zq, zk, v) if pair == 1 else (zq, zk, q, k, v)


def expected(M, N, D, w, causal, pair):
    """o for one (batch, head), float64, and the selected-set sizes per row."""
    i = np.arange(M)[:, None]
    j = np.arange(N)[None, :]
    d = i + (N - M) - j
    chosen = (d >= w) if pair == 2 else (d < w)
    admissible = (d >= 0) if causal else np.ones_like(d, dtype=bool)
    s = np.where(chosen, SCORE, 0.0)
    s = np.where(admissible, s, -np.inf)
    m = s.max(axis=1, keepdims=True)
    has = np.isfinite(m)
    p = np.where(has, np.exp(s - np.where(has, m, 0.0)), 0.0)
    p /= np.where(has, p.sum(axis=1, keepdims=True), 1.0)
    v = np.zeros((N, D))
    v[np.arange(N), np.arange(N) % D] = 1.0
    sizes = np.where((chosen & admissible).any(axis=1), (chosen & admissible).sum(axis=1),
                     admissible.sum(axis=1))
    return p @ v, sizes


def check(o, M, N, D, w, causal, pair, where=""):
    """Assert ``o`` (..., M, D) matches the exact selection to a quarter of one key's
    weight per row."""
    want, sizes = expected(M, N, D, w, causal, pair)
    err = np.abs(np.asarray(o, np.float64) - want).max(axis=-1)  # (..., M)
    limit = 0.25 / np.maximum(sizes, 1)
    bad = np.argwhere(err > limit)
    assert bad.size == 0, (f"{where} w={w} causal={causal} pair={pair}: {len(bad)} rows off, "
                           f"first at {tuple(bad[0])}: error {err[tuple(bad[0])]:.3g} > "
                           f"{limit[bad[0][-1]]:.3g}")
