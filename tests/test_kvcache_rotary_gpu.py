"""attention_with_rotary_kvcache on the CUDA kernels (marked ``gpu``): the rotary-inside
pw_kvcache against the float64 reference by the tolerance rule (outputs NaN-poisoned; the
low-precision yardstick rotates in float32 and rounds the keys to the input dtype, as
rotating before caching would), both layouts, ReRoPE and SelfExtend position maps,
contiguous and paged caches, M in {1, 4, 17}, GQA, cache lengths from 0 to full, the raw
keys appended in place, a torch decode step replayed in a CUDA graph, and the rotary call
bitwise equal to a two-cache call on host-rotated caches."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from seeds import fresh_seed  # noqa: E402  (tests/seeds.py)
import kvcache_cases as kc  # noqa: E402

from cupy_piecewise import kvcache, kvcache_rotary as kr, reference, tolerance  # noqa: E402
from cupy_piecewise.gpu_arrays import _np_dtype, poisoned, round_to  # noqa: E402

pytestmark = pytest.mark.gpu


def _tables(positions, D):
    ang = np.arange(positions)[:, None] * 10000.0 ** (-np.arange(D // 2) / (D // 2))
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _rotate32(x, cos, sin, pos, interleaved):
    """The kernel's rotation: float32 arithmetic on float32 values of the dtype, each product
    and sum rounded (NumPy does not contract to FMA; the kernel uses __fmul_rn/__fadd_rn)."""
    c, s = cos[pos], sin[pos]
    out = np.empty_like(x, dtype=np.float32)
    if interleaved:
        e, o = x[..., 0::2], x[..., 1::2]
        out[..., 0::2], out[..., 1::2] = e * c - o * s, o * c + e * s
    else:
        h = x.shape[-1] // 2
        a, b = x[..., :h], x[..., h:]
        out[..., :h], out[..., h:] = a * c - b * s, b * c + a * s
    return out


def _lowp(q1, q2, keys, vals, cos, sin, groups, interleaved, w, seq, M, causal, scale, dtype):
    """The low-precision yardstick per sequence: keys rotated in float32, rounded to dtype."""
    B, H, _, D = q1.shape
    o, lse = np.zeros((B, H, M, D)), np.full((B, H, M), -np.inf)
    for b in range(B):
        L = int(seq[b])
        raw = keys[b:b + 1, :, :L]
        n = np.arange(L)
        k12 = [raw if not g else round_to(_rotate32(raw, cos, sin, n // g, interleaved), dtype)
               for g in groups]
        ol, ll = reference.lowp_forward(q1[b:b + 1], k12[0], q2[b:b + 1], k12[1],
                                        vals[b:b + 1, :, :L], w, causal, scale, dtype=dtype,
                                        q_offset=L - M, k_offset=0)
        o[b], lse[b] = ol[0], ll[0]
    return o, lse


CASES = [  # (dtype, D, M, layout, groups, paged block size or 0, causal, appended, path)
    (dt, D, M, lay, grp, bs, causal, app, path)
    for dt in ("bfloat16", "float16") for D in (64, 128) for M in (1, 4, 17)
    for lay, grp in (("half", (1, None)), ("interleaved", (1, 4)))
    for bs, causal, app in ((0, True, True), (64, True, False), (16, False, True))
    # one token on an H200: the TMA decode (auto) and the cp.async one (mma)
    for path in (("auto", "mma") if M == 1 else ("auto",))
] + [("bfloat16", D, 1, "half", (None, 2), 0, True, True, "auto") for D in (16, 32)]


@pytest.mark.parametrize("dtype,D,M,layout,groups,bs,causal,appended,path", CASES, ids=[
    f"{c[0]}-D{c[1]}-M{c[2]}-{c[3]}-g{c[4][0]}_{c[4][1]}-{'paged' + str(c[5]) if c[5] else 'contig'}"
    f"-{'causal' if c[6] else 'full'}-{'append' if c[7] else 'cached'}-{c[8]}" for c in CASES])
def test_rotary_kvcache_matches_reference(dtype, D, M, layout, groups, bs, causal, appended,
                                          path, monkeypatch):
    import cupy

    from cupy_piecewise import capability

    monkeypatch.setenv(capability.PATH_VAR, path)
    capability.refresh_env_override()
    monkeypatch.setattr(kvcache, "_empty", lambda shape, dt: poisoned(
        shape, "float32" if np.dtype(dt) == np.float32 else dtype))
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    B, H, Hkv, N = 4, 8, 2, 1024
    interleaved = layout == "interleaved"
    seq = np.array([0, 1, 300, N - (M if appended else 0)], np.int32)
    w = int(rng.choice([-3, 0, 1, 5, 200, 700]))
    scale = 1.0 / np.sqrt(D)
    cos, sin = _tables(N, D)
    q1, q2 = (round_to(rng.standard_normal((B, H, M, D)).astype(np.float32) * 1.5, dtype)
              for _ in range(2))
    keys, vals = (round_to(rng.standard_normal((B, Hkv, N, D)).astype(np.float32) * 1.5, dtype)
                  for _ in range(2))
    new = [round_to(rng.standard_normal((B, Hkv, M, D)).astype(np.float32), dtype)
           for _ in range(2)]
    full = [keys.copy(), vals.copy()]
    if appended:
        for c, n in zip(full, new):
            for b in range(B):
                c[b, :, seq[b]:seq[b] + M] = n[b]
    lengths = seq + (M if appended else 0)
    ref = kr.reference_with_rotary_kvcache(  # float32 arrays holding dtype values
        q1, q2, full[0], full[1], w, cos, sin, lengths,
        k1_group_size=groups[0], k2_group_size=groups[1], interleaved=interleaved,
        causal=causal, sm_scale=scale)
    low = _lowp(q1, q2, full[0], full[1], cos, sin, [g or 0 for g in groups], interleaved, w,
                lengths, M, causal, scale, dtype)

    nd = _np_dtype(dtype)
    if bs:
        pages, table = kc.page_all([keys, vals], bs, rng)
        dev = [cupy.asarray(np.nan_to_num(p).astype(nd)) for p in pages]
        dev_table = cupy.asarray(table)
    else:
        dev, dev_table = [cupy.asarray(c.astype(nd)) for c in (keys, vals)], None
    kw = dict(cos=cupy.asarray(cos), sin=cupy.asarray(sin), cache_seqlens=cupy.asarray(seq),
              block_table=dev_table, k1_group_size=groups[0], k2_group_size=groups[1],
              interleaved=interleaved, causal=causal, sm_scale=float(scale), return_lse=True)
    if appended:
        kw.update(k_new=cupy.asarray(new[0].astype(nd)), v_new=cupy.asarray(new[1].astype(nd)))
    o, lse = kr.attention_with_rotary_kvcache(cupy.asarray(q1.astype(nd)),
                                              cupy.asarray(q2.astype(nd)), *dev, w, **kw)
    got = [cupy.asnumpy(o).astype(np.float64), cupy.asnumpy(lse).astype(np.float64)]
    for name, g, r, lw in zip(("o", "lse"), got, ref, low):
        verdict = tolerance.compare(name, g, r, lw, dtype)
        assert verdict.passed, f"{verdict} (w={w}, input seed {seed})"
    if appended:  # the caches hold the raw new rows, read back in sequence order
        for dc, want in zip(dev, full):
            h = cupy.asnumpy(dc).astype(np.float32)
            if bs:
                h = np.stack([np.concatenate([h[p] for p in table[b]], axis=1) for b in range(B)])
            np.testing.assert_array_equal(h, want)


STALE_CASES = [("bfloat16", 128, 8, 2, "contig"), ("float16", 64, 20, 1, "paged64"),
               ("bfloat16", 64, 4, 2, "paged16")]


@pytest.mark.parametrize("path", ["auto", "mma"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype,D,H,Hkv,layout", STALE_CASES,
                         ids=[f"{c[0]}-D{c[1]}-H{c[2]}-Hkv{c[3]}-{c[4]}" for c in STALE_CASES])
def test_rotary_decode_never_reads_rows_past_the_lengths(dtype, D, H, Hkv, layout,
                                                         interleaved, path,
                                                         monkeypatch):
    """M = 1 on both decode kernels with every cache row past a sequence's length (and every
    unused page) NaN: the rotation must leave those rows alone and the kernels mask them.
    Lengths end inside and on the edge of 16-key chunks and 64-key tiles; w puts d = w
    inside a chunk (the TMA decode's straddling K2, rotated in its own slot), on a chunk
    edge, before every key and after every key; SelfExtend groups of 3 cross chunk edges."""
    import cupy

    from cupy_piecewise import capability

    monkeypatch.setenv(capability.PATH_VAR, path)
    capability.refresh_env_override()
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    B, N = 6, 512
    seq = np.array([0, 1, 15, 64, 300, N], np.int32)
    nd = _np_dtype(dtype)
    cos, sin = _tables(N, D)
    q1, q2 = (round_to(rng.standard_normal((B, H, 1, D)).astype(np.float32) * 1.5, dtype)
              for _ in range(2))
    keys, vals = (round_to(rng.standard_normal((B, Hkv, N, D)).astype(np.float32) * 1.5, dtype)
                  for _ in range(2))
    stale = [c.copy() for c in (keys, vals)]
    for c in stale:
        for b in range(B):
            c[b, :, seq[b]:] = np.nan
    for w in (int(rng.integers(2, 300)), 48, -(N + 5), N + 5):
        kw = dict(k1_group_size=1, k2_group_size=3, interleaved=interleaved, causal=True,
                  sm_scale=1 / np.sqrt(D))
        ref = kr.reference_with_rotary_kvcache(q1, q2, keys, vals, w, cos, sin, seq, **kw)
        low = _lowp(q1, q2, keys, vals, cos, sin, (1, 3), interleaved, w, seq, 1, True,
                    1 / np.sqrt(D), dtype)
        if layout.startswith("paged"):
            pages, table = kc.page_all(stale, int(layout[5:]), rng)
            dev = [cupy.asarray(p.astype(nd)) for p in pages]  # unused pages stay NaN
            extra = dict(block_table=cupy.asarray(table))
        else:
            dev, extra = [cupy.asarray(c.astype(nd)) for c in stale], {}
        o, lse = kr.attention_with_rotary_kvcache(
            cupy.asarray(q1.astype(nd)), cupy.asarray(q2.astype(nd)), *dev, w,
            cos=cupy.asarray(cos), sin=cupy.asarray(sin), cache_seqlens=cupy.asarray(seq),
            return_lse=True, **kw, **extra)
        for name, g, r, lw in zip(("o", "lse"), (cupy.asnumpy(o), cupy.asnumpy(lse)), ref, low):
            verdict = tolerance.compare(name, np.asarray(g, np.float64), r, lw, dtype)
            assert verdict.passed, f"w={w}: {verdict} (input seed {seed})"


BITWISE_CASES = [(dt, D, M, inter, path) for dt in ("bfloat16", "float16") for D in (16, 64, 128)
                 for M, path in ((1, "auto"), (1, "mma"), (5, "auto")) for inter in (False, True)]


@pytest.mark.parametrize("dtype,D,M,interleaved,path", BITWISE_CASES,
                         ids=[f"{c[0]}-D{c[1]}-M{c[2]}-{'inter' if c[3] else 'half'}-{c[4]}"
                              for c in BITWISE_CASES])
def test_rotary_kernel_equals_two_cache_kernel_bitwise(dtype, D, M, interleaved, path,
                                                       monkeypatch):
    """The rotation is the only difference between a rotary call and a two-cache call whose
    caches were rotated on the host in float32 (each product and sum rounded, as the kernel
    does) and rounded to the dtype: the same plan runs the same kernel with ROT = 0, so o and
    lse must agree bit for bit. This catches a rotation error on a few keys (one straddling
    chunk, one position off) that the tolerance rule could let through. Several w per case
    put the rotated near keys, the rotated far keys (k2 group 3) and the straddle in play.

    The key splits are pinned (kvcache_launch.split_count): the rotary forms split the key
    tiles strided and the plain ones contiguously, which sum in different orders unless
    each split holds at most one tile. So each case runs unsplit, one split per tile and
    twice that (empty splits); with 384 keys both split counts exceed a Hopper cluster (4),
    so both merge through pw_forward_combine, whatever the GPU's SM count would pick
    (test_rotary_cluster_merge_equals_two_cache_kernel_bitwise pins the cluster merge)."""
    _bitwise_rotary_vs_two_cache(dtype, D, M, interleaved, path, 384, (0, 1, 2), monkeypatch)


CLUSTER_CASES = [(dt, D, inter) for dt in ("bfloat16", "float16") for D in (64, 128)
                 for inter in (False, True)]


@pytest.mark.parametrize("dtype,D,interleaved", CLUSTER_CASES,
                         ids=[f"{c[0]}-D{c[1]}-{'inter' if c[2] else 'half'}"
                              for c in CLUSTER_CASES])
def test_rotary_cluster_merge_equals_two_cache_kernel_bitwise(dtype, D, interleaved,
                                                              monkeypatch):
    """As test_rotary_kernel_equals_two_cache_kernel_bitwise, with split counts a Hopper
    cluster holds (2 to capability.KV90_MAX_CLUSTER = 4), so that the Hopper decode (one
    token) merges its splits on chip instead of through pw_forward_combine: 128 keys in 2
    splits (one tile each) and 4 (two of them empty), 256 keys in 4. On an sm_90 GPU each
    plan must have taken the cluster merge; elsewhere the cp.async decode runs the same
    split counts through pw_forward_combine, and the bitwise check still holds."""
    import cupy

    from cupy_piecewise import capability

    plans = []
    for N, per_tile in ((128, 1), (128, 2), (256, 1)):
        plans += _bitwise_rotary_vs_two_cache(dtype, D, 1, interleaved, "auto", N, (per_tile,),
                                              monkeypatch)
    if cupy.cuda.Device().compute_capability == "90":
        got = sorted((p.nsplit, p.cluster) for p in plans)
        assert all(p.cluster == p.nsplit for p in plans) and {p.nsplit for p in plans} == {2, 4}, \
            f"(nsplit, cluster) of the plans: {got}"
        assert max(p.nsplit for p in plans) <= capability.KV90_MAX_CLUSTER


def _bitwise_rotary_vs_two_cache(dtype, D, M, interleaved, path, N, per_tiles, monkeypatch):
    """The bitwise check of the two tests above over a cache of N keys, with the key splits
    pinned to ``per_tile`` times the key tile count (0: unsplit) for each of ``per_tiles``;
    three sequences of 0, 77 and N cached keys (three query heads per key head over
    two key heads). Returns the plans (kvcache_launch.KVPlan) the calls made."""
    import math

    import cupy

    from cupy_piecewise import capability, kvcache_launch
    from cupy_piecewise.core.memo import Memo

    monkeypatch.setenv(capability.PATH_VAR, path)
    capability.refresh_env_override()
    rng = np.random.default_rng(fresh_seed())
    B, H, Hkv = 3, 8, 2
    nd = _np_dtype(dtype)
    seq = np.array([0, 77, N], np.int32)
    cos, sin = _tables(N, D)
    q1, q2 = (round_to(rng.standard_normal((B, H, M, D)).astype(np.float32), dtype)
              for _ in range(2))
    keys, vals = (round_to(rng.standard_normal((B, Hkv, N, D)).astype(np.float32), dtype)
                  for _ in range(2))
    n = np.arange(N)
    k1 = round_to(_rotate32(keys, cos, sin, n, interleaved), dtype)
    k2 = round_to(_rotate32(keys, cos, sin, n // 3, interleaved), dtype)
    dq1, dq2 = cupy.asarray(q1.astype(nd)), cupy.asarray(q2.astype(nd))
    dk, dv, d1, d2 = (cupy.asarray(x.astype(nd)) for x in (keys, vals, k1, k2))
    planned, plans = [], []
    for per_tile in per_tiles:
        def pinned(shape, tiles, *_args, **_kw):
            count = max(1, per_tile * math.ceil(shape.capacity / tiles.block_n))
            planned.append(count)
            return count

        memo = Memo()  # plans made with the pin
        monkeypatch.setattr(kvcache_launch, "split_count", pinned)
        monkeypatch.setattr(kvcache_launch, "_plans", memo)
        for w in (1, 40, 100, N + 5):
            kw = dict(cache_seqlens=cupy.asarray(seq), return_lse=True)
            o_r, l_r = kr.attention_with_rotary_kvcache(
                dq1, dq2, dk, dv, w, cos=cupy.asarray(cos), sin=cupy.asarray(sin),
                k2_group_size=3, interleaved=interleaved, **kw)
            o_2, l_2 = kvcache.attention_with_kvcache(dq1, dq2, d1, d2, dv, w, **kw)
            where = f"w={w}, nsplit={planned[-1]}"
            assert cupy.array_equal(o_r.view(cupy.uint16), o_2.view(cupy.uint16)), f"o, {where}"
            assert bool(cupy.all((l_r == l_2) | (cupy.isnan(l_r) & cupy.isnan(l_2)))), \
                f"lse, {where}"
        plans += memo.values()
    assert len(set(planned)) == len(set(per_tiles)), \
        f"the pinned split counts were not all planned: {planned}"
    return plans


def long_cache_case(D, interleaved, groups, seed, N=12288):
    """One rotary decode of a long cache (one sequence, one key head, eight query heads, bf16,
    w = N / 4) checked against the reference by the tolerance rule; returns the key splits
    the planner chose (0 when no kernel ran). With N = 12288 an H200 splits the keys (on the
    Hopper decode more than a cluster holds, so pw_forward_combine merges them), and
    ReRoPE's rotated keys, the last quarter, reach most of the strided splits.
    scripts/sanitize_cases.py runs it too."""
    import cupy

    from cupy_piecewise import kvcache_launch
    from cupy_piecewise.core.memo import Memo

    planned = []
    real, plans = kvcache_launch.split_count, kvcache_launch._plans

    def recorded(*args, **kw):
        planned.append(real(*args, **kw))
        return planned[-1]

    kvcache_launch.split_count, kvcache_launch._plans = recorded, Memo()  # plan afresh
    try:
        rng = np.random.default_rng(seed)
        dtype, B, H, Hkv = "bfloat16", 1, 8, 1
        nd = _np_dtype(dtype)
        cos, sin = _tables(N, D)
        seq = np.array([N - 5], np.int32)
        q1, q2 = (round_to(rng.standard_normal((B, H, 1, D)).astype(np.float32) * 1.5, dtype)
                  for _ in range(2))
        keys, vals = (round_to(rng.standard_normal((B, Hkv, N, D)).astype(np.float32), dtype)
                      for _ in range(2))
        w = N // 4
        kw = dict(k1_group_size=groups[0], k2_group_size=groups[1], interleaved=interleaved,
                  causal=True, sm_scale=1 / np.sqrt(D))
        ref = kr.reference_with_rotary_kvcache(q1, q2, keys, vals, w, cos, sin, seq, **kw)
        low = _lowp(q1, q2, keys, vals, cos, sin, [g or 0 for g in groups], interleaved, w,
                    seq, 1, True, 1 / np.sqrt(D), dtype)
        o, lse = kr.attention_with_rotary_kvcache(
            cupy.asarray(q1.astype(nd)), cupy.asarray(q2.astype(nd)),
            cupy.asarray(keys.astype(nd)), cupy.asarray(vals.astype(nd)), w,
            cos=cupy.asarray(cos), sin=cupy.asarray(sin), cache_seqlens=cupy.asarray(seq),
            return_lse=True, **kw)
        nsplit = planned[-1] if planned else 0
        for name, g, r, lw in zip(("o", "lse"), (cupy.asnumpy(o), cupy.asnumpy(lse)), ref, low):
            verdict = tolerance.compare(name, np.asarray(g, np.float64), r, lw, dtype)
            assert verdict.passed, f"D={D}, nsplit={nsplit}: {verdict} (input seed {seed})"
    finally:
        kvcache_launch.split_count, kvcache_launch._plans = real, plans
    return nsplit


LONG_CASES = [(128, False, (1, None)), (64, True, (1, 8))]  # ReRoPE halves, SelfExtend pairs


@pytest.mark.parametrize("D,interleaved,groups", LONG_CASES,
                         ids=[f"D{c[0]}-{'inter' if c[1] else 'half'}-g{c[2][1]}" for c in LONG_CASES])
def test_rotary_long_cache_splits_and_merges(D, interleaved, groups):
    """long_cache_case: the planner's own split count (more than one) on a long cache, with
    the strided splits of the rotary forms, gives the reference."""
    nsplit = long_cache_case(D, interleaved, groups, fresh_seed())
    assert nsplit > 1, f"D={D}: the planner did not split the keys"


def test_torch_rotary_decode_in_a_cuda_graph_matches_eager():
    """A rotary decode step (append one raw key, attend) captured once and replayed with the
    lengths advanced on the device gives the eager results and the same caches."""
    torch = pytest.importorskip("torch")
    import cupy_piecewise

    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, Hkv, D, N, steps, bs = 3, 8, 2, 128, 512, 4, 64
    dt = torch.bfloat16
    cos, sin = (torch.from_numpy(t).cuda() for t in _tables(N, D))
    start = torch.tensor([0, 100, 400], dtype=torch.int32, device="cuda")
    caches_e = [torch.randn(B * N // bs + 1, Hkv, bs, D, device="cuda", dtype=dt, generator=g)
                for _ in range(2)]
    caches_g = [c.clone() for c in caches_e]
    table = torch.randperm(B * N // bs, device="cuda", generator=g).view(B, N // bs).to(torch.int32)
    qs = [torch.randn(steps, B, H, 1, D, device="cuda", dtype=dt, generator=g) for _ in range(2)]
    news = [torch.randn(steps, B, Hkv, 1, D, device="cuda", dtype=dt, generator=g) for _ in range(2)]

    def step(q1, q2, caches, seq, kn, vn):
        return cupy_piecewise.attention_with_rotary_kvcache(
            q1, q2, *caches, 64, cos=cos, sin=sin, cache_seqlens=seq, k_new=kn, v_new=vn,
            block_table=table, k2_group_size=8, return_lse=True)

    eager = [step(qs[0][t], qs[1][t], caches_e, start + t, news[0][t], news[1][t])
             for t in range(steps)]
    sq1, sq2 = qs[0][0].clone(), qs[1][0].clone()
    sn = [n[0].clone() for n in news]
    seq = start.clone()
    step(sq1, sq2, [c.clone() for c in caches_g], seq, *sn)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(sq1, sq2, caches_g, seq, *sn)
    for t in range(steps):
        sq1.copy_(qs[0][t]), sq2.copy_(qs[1][t])
        for s, n in zip(sn, news):
            s.copy_(n[t])
        seq.copy_(start + t)
        graph.replay()
        assert torch.equal(out[0], eager[t][0]), f"o differs at step {t}"
        assert torch.equal(out[1], eager[t][1]), f"lse differs at step {t}"
    for a, b in zip(caches_g, caches_e):
        assert torch.equal(a, b)
