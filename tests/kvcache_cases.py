"""Shared pieces of the KV-cache tests: random caches, paging them, and a dense float64
implementation of the semantics written from the docstring (independent of the package's
reference, which works through reference.forward)."""
from __future__ import annotations

import numpy as np


def dense(q1, q2, k1c, k2c, vc, w, seqlens, appended_M, causal, sm_scale):
    """(o, lse) in float64 for contiguous caches that already hold every key attended:
    sequence b attends keys 0 .. seqlens[b] + appended_M - 1, query t sits at L - M + t."""
    B, H, M, D = q1.shape
    Hkv = k1c.shape[1]
    G = H // Hkv
    o = np.zeros((B, H, M, D))
    lse = np.full((B, H, M), -np.inf)
    for b in range(B):
        L = int(seqlens[b]) + appended_M
        for h in range(H):
            hk = h // G
            for t in range(M):
                pos = L - M + t
                s = np.full(L, -np.inf)
                for n in range(L):
                    d = pos - n
                    if causal and d < 0:
                        continue
                    if d >= w:
                        s[n] = sm_scale * np.dot(q2[b, h, t].astype(np.float64), k2c[b, hk, n])
                    else:
                        s[n] = sm_scale * np.dot(q1[b, h, t].astype(np.float64), k1c[b, hk, n])
                if L == 0 or not np.isfinite(s).any():
                    continue
                m = s.max()
                p = np.exp(s - m)
                lse[b, h, t] = m + np.log(p.sum())
                o[b, h, t] = (p / p.sum()) @ vc[b, hk, :L].astype(np.float64)
    return o, lse


def page(cache, block_size, rng, spare=3):
    """A paged copy of a contiguous cache (B, Hkv, N, D) (N a multiple of ``block_size``):
    pages in a random order among ``spare`` unused ones -> (pages, block_table int32)."""
    B, Hkv, N, D = cache.shape
    nb = N // block_size
    total = B * nb + spare
    order = rng.permutation(total)[:B * nb]
    pages = np.full((total, Hkv, block_size, D), np.nan, cache.dtype)
    table = np.zeros((B, nb), np.int32)
    for b in range(B):
        for j in range(nb):
            p = order[b * nb + j]
            table[b, j] = p
            pages[p] = cache[b, :, j * block_size:(j + 1) * block_size]
    return pages, table


def page_all(caches, block_size, rng):
    """:func:`page` for several caches with one shared block table."""
    state = rng.bit_generator.state
    out = []
    for c in caches:
        rng.bit_generator.state = state  # the same permutation for each cache
        pages, table = page(c, block_size, rng)
        out.append(pages)
    return out, table
