"""Model of PW_FWD_WARP_SKIP (kernels_cu/forward.cu, rotating-slot visit) against the
kernel's mask (common.cuh pair_window / scale_in_window), in numpy. A copy of the kernel's
rules (warp_visit_empty, make_geom's clamps, fwd_rotate_phases): change it with them.

    python scripts/warp_skip_model.py        # about a minute; tests/test_probe_cpu.py runs less

(1) proof: over random and boundary geometries, every visit the skip condition drops has no
    admissible element in the warp's 32 rows x 64 keys (the kernel's exact window, int32
    saturating arithmetic), and the window agrees with the direct definition;
(2) the share of warp-visits skipped at a given L, w (rotating-slot phases, fwd_rotate_phases).
"""
import numpy as np

BM, BN, WARPS, ROWS = 128, 64, 4, 32
I32_MIN, I32_MAX = -(1 << 31), (1 << 31) - 1
NONE = 0x7FFFFFFF

def sat(x):
    return np.clip(x, I32_MIN, I32_MAX)

def window_admissible(base, w, cols_left, pair, causal):
    """bool[32, 64]: the kernel's pair_window + scale_in_window test, element by element
    (rows: mi*16 + lane/4 + 8*hh; columns c0 + off, c0 = 2*(lane%4), off = nb*8 + e%2)."""
    lo = (0 if causal else -NONE) if pair == 1 else (max(0, w) if causal else w)
    hi = w if pair == 1 else NONE
    adm = np.zeros((ROWS, BN), bool)
    r = np.arange(ROWS)
    rb = base + r                                     # |rb| <= 2^30 + 32
    for c0 in (0, 2, 4, 6):
        cmin = sat(sat(rb - hi) - (c0 - 1))
        cmax = sat(np.minimum(sat(rb - lo), cols_left - 1) - c0)
        for nb in range(BN // 8):
            for e in (0, 1):
                off = nb * 8 + e
                adm[:, c0 + off] = (off >= cmin) & (off <= cmax)
    return adm

def direct_admissible(base, w, cols_left, pair, causal):
    r = np.arange(ROWS)[:, None]; c = np.arange(BN)[None, :]
    d = base + r - c
    ok = (d < w) if pair == 1 else (d >= w)
    if causal: ok &= d >= 0
    return ok & (c < cols_left)

def skip(base, w, pair, causal):
    """warp_visit_empty<PAIR, CAUSAL, 32, 64>(g.base, g.w), int32 (no operand overflows)."""
    dmax = base + (ROWS - 1)
    for v in (dmax, base - (BN - 1)):
        assert I32_MIN <= v <= I32_MAX
    if pair == 1:
        return base - (BN - 1) >= w or (causal and dmax < 0)
    return dmax < w or (causal and dmax < 0)

def geom(m0, P, warp, n0, N):
    row_p = m0 + P + warp * ROWS
    assert I32_MIN <= row_p <= I32_MAX
    base = min(max(row_p - n0, -(1 << 30)), 1 << 30)
    cols_left = min(max(N - n0, -1), 1 << 30)
    return base, cols_left

def proof(trials=60000, seed=1):
    """Random and boundary geometries: (visits checked, skipped, empty)."""
    rng = np.random.default_rng(seed)
    n_skip = n_empty = n_vis = 0
    for i in range(trials):
        big = rng.random() < 0.3
        hiL = (1 << 30) - 1 if big else 5000
        M, N = int(rng.integers(1, hiL)), int(rng.integers(1, hiL))
        causal = bool(rng.integers(2))
        P = N - M if rng.random() < 0.5 else int(rng.integers(-M, N + 1))
        mt = int(rng.integers(0, (M + BM - 1) // BM))
        m0 = mt * BM
        warp = int(rng.integers(WARPS))
        ntile = (N + BN - 1) // BN
        # key tiles near the interesting places: the w boundary, the diagonal, N, or anywhere
        wlim = M + N + 1
        w = int(rng.integers(-wlim, wlim + 1)) if rng.random() < 0.3 else \
            int(np.clip(rng.integers(-300, 300) + (int(rng.integers(-M, N)) if rng.random() < 0.5 else 0), -wlim, wlim))
        anchor = [m0 + P - w, m0 + P, N, int(rng.integers(0, N))][int(rng.integers(4))]
        t = int(np.clip(anchor // BN + int(rng.integers(-4, 5)), 0, ntile - 1))
        n0 = t * BN
        base, cols_left = geom(m0, P, warp, n0, N)
        for pair in (1, 2):
            a = window_admissible(base, w, cols_left, pair, causal)
            b = direct_admissible(base, w, cols_left, pair, causal)
            assert (a == b).all(), (M, N, P, w, m0, n0, warp, pair, causal)
            s = skip(base, w, pair, causal)
            n_vis += 1; n_skip += s; n_empty += not a.any()
            assert not (s and a.any()), ("skipped a visit with work", M, N, P, w, m0, n0, warp, pair, causal)
    print(f"proof: {n_vis} visits checked (random + boundary geometries, L up to 2^30): "
          f"skip => empty held everywhere; {n_skip} skipped of {n_empty} empty "
          f"(window == direct definition on all)")
    return n_vis, n_skip, n_empty

def exhaustive_small():
    """Every (m0, warp, tile, pair, causal) for small M, N, P, w: skip => empty, and which
    empty visits the condition misses."""
    cnt = missed = 0
    for M in (1, 37, 128, 200, 300):
        for N in (1, 64, 65, 200, 333):
            for P in sorted({N - M, 0, -M, N, 17}):
                for w in range(-(M + N + 1), M + N + 2, 7):
                    for causal in (False, True):
                        for m0 in range(0, M, BM):
                            for t in range((N + BN - 1) // BN):
                                for warp in range(WARPS):
                                    base, cl = geom(m0, P, warp, t * BN, N)
                                    for pair in (1, 2):
                                        e = not direct_admissible(base, w, cl, pair, causal).any()
                                        s = skip(base, w, pair, causal)
                                        assert not (s and not e)
                                        cnt += 1; missed += e and not s
    print(f"exhaustive small grid: {cnt} warp-visits, skip => empty everywhere; "
          f"{missed} empty visits not skipped (a partial last tile, where the condition "
          f"ignores cols_left, or causal pair 1 with w <= 0)")

def phases(m0, P, w, N, t_begin, ntiles, causal):
    fdiv = lambda a, b: a // b               # Python floors like floor_div
    cdiv = lambda a, b: -((-a) // b)
    far_end = int(np.clip(cdiv(m0 + P - w - BN + 2, BN), t_begin, ntiles))
    near_begin = int(np.clip(fdiv(m0 + BM - 1 + P - w, BN) + 1, far_end, ntiles))
    past_n = N // BN
    diagonal = fdiv(m0 + P + 1, BN)
    return far_end, near_begin, (diagonal if causal and diagonal < past_n else past_n)

def share(L, w, causal, M=None, N=None):
    """Warp-visits of a whole (L, w) attention: (all, masked, skipped)."""
    M = M or L; N = N or L; P = N - M
    tot = masked = skipped = 0
    by = {1: 0, 2: 0}
    for mt in range((M + BM - 1) // BM):
        m0 = mt * BM
        n_end = min(max(m0 + BM + P, 0), N) if causal else N
        ntiles = (n_end + BN - 1) // BN
        tA, tC, tmask = phases(m0, P, w, N, 0, ntiles, causal)
        far_plain_end = min(tA, tmask)
        near_plain = max(tmask - tC, 0)
        visits = [(t, 2, t >= far_plain_end) for t in range(0, tC)] + \
                 [(t, 1, (t - tC) % (1 << 32) >= near_plain) for t in range(tA, ntiles)]
        for t, pair, msk in visits:
            for warp in range(WARPS):
                tot += 1
                if not msk: continue
                masked += 1
                base, cl = geom(m0, P, warp, t * BN, N)
                if skip(base, w, pair, causal):
                    skipped += 1; by[pair] += 1
                # sanity: unmasked visits are full (no element masked)
            if not msk:
                for warp in range(WARPS):
                    base, cl = geom(m0, P, warp, t * BN, N)
                    assert direct_admissible(base, w, cl, pair, causal).all()
    print(f"L={L} w={w} {'causal' if causal else 'non-causal'}: {tot} warp-visits, "
          f"{masked} masked, {skipped} skipped = {100 * skipped / tot:.2f}% of all "
          f"({100 * skipped / max(masked, 1):.1f}% of masked); far phase (pair 2) {by[2]}, "
          f"near phase (pair 1) {by[1]}")
    return tot, masked, skipped

if __name__ == "__main__":
    exhaustive_small()
    proof()
    for causal in (False, True):
        share(2048, 512, causal)
    for L, w in ((8192, 2048), (2048, 2048), (2048, 128)):
        for causal in (False, True):
            share(L, w, causal)
