"""attention_with_kvcache on the CUDA kernels (marked ``gpu``): contiguous and paged caches
against the float64 reference by the tolerance rule (outputs NaN-poisoned), cache lengths
that differ per sequence (0 included), M in {1, 4, 17}, GQA, appended keys written in
place exactly where they belong, the torch operator, and a decode loop captured in a CUDA
graph replayed with new lengths against eager calls."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from seeds import fresh_seed  # noqa: E402  (tests/seeds.py)
import kvcache_cases as kc  # noqa: E402

from cupy_piecewise import kvcache, reference, tolerance  # noqa: E402
from cupy_piecewise.gpu_arrays import NAN_BITS, poisoned, round_to  # noqa: E402

pytestmark = pytest.mark.gpu


def _np_dtype(dtype):
    from cupy_piecewise.gpu_arrays import _np_dtype as f

    return f(dtype)


def _expected(q1, q2, caches, w, seq, M, appended, causal, scale, dtype):
    """(o, lse) float64 reference and the low-precision yardstick, per sequence, from
    contiguous host caches that already hold every attended key."""
    B, H = q1.shape[:2]
    D = q1.shape[3]
    ref = [np.zeros((B, H, M, D)), np.full((B, H, M), -np.inf)]
    low = [np.zeros((B, H, M, D)), np.full((B, H, M), -np.inf)]
    for b in range(B):
        L = int(seq[b]) + (M if appended else 0)
        ks = [c[b:b + 1, :, :L] for c in caches]
        args = (q1[b:b + 1], ks[0], q2[b:b + 1], ks[1], ks[2], w, causal, scale)
        o, lse = reference.forward(*args, q_offset=L - M, k_offset=0)
        ol, ll = reference.lowp_forward(*args, dtype=dtype, q_offset=L - M, k_offset=0)
        ref[0][b], ref[1][b], low[0][b], low[1][b] = o[0], lse[0], ol[0], ll[0]
    return ref, low


def _poisoned_outputs(monkeypatch):
    import cupy

    def empty(shape, dtype):
        name = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}.get(
            np.dtype(dtype), "bfloat16")
        return poisoned(shape, name)

    monkeypatch.setattr(kvcache, "_empty", empty)
    return cupy


CASES = [  # (dtype, D, M, paged block size or 0, causal, appended)
    (dt, D, M, bs, causal, app)
    for dt in ("bfloat16", "float16") for D in (64, 128) for M in (1, 4, 17)
    for bs, causal, app in ((0, True, False), (64, True, True), (0, False, True), (16, False, False))
]


@pytest.mark.parametrize("dtype,D,M,bs,causal,appended", CASES,
                         ids=[f"{c[0]}-D{c[1]}-M{c[2]}-{'paged' + str(c[3]) if c[3] else 'contig'}"
                              f"-{'causal' if c[4] else 'full'}-{'append' if c[5] else 'cached'}"
                              for c in CASES])
def test_kvcache_matches_reference(dtype, D, M, bs, causal, appended, monkeypatch):
    cupy = _poisoned_outputs(monkeypatch)
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    B, H, Hkv, N = 4, 8, 2, 1024
    seq = np.array([0, 1, 300, N - (M if appended else 0)], np.int32)  # empty .. full
    w = int(rng.choice([-3, 0, 1, 5, 200, 700]))
    scale = 1.0 / np.sqrt(D)
    q1, q2 = (round_to(rng.standard_normal((B, H, M, D)).astype(np.float32) * 1.5, dtype)
              for _ in range(2))
    host = [round_to(rng.standard_normal((B, Hkv, N, D)).astype(np.float32) * 1.5, dtype)
            for _ in range(3)]
    new = [round_to(rng.standard_normal((B, Hkv, M, D)).astype(np.float32), dtype)
           for _ in range(3)]
    full = [c.copy() for c in host]  # what the caches hold after the append
    if appended:
        for c, n in zip(full, new):
            for b in range(B):
                c[b, :, seq[b]:seq[b] + M] = n[b]
    ref, low = _expected(q1, q2, full, w, seq, M, appended, causal, scale, dtype)

    nd = _np_dtype(dtype)
    if bs:
        pages, table = kc.page_all([c.astype(np.float32) for c in host], bs, rng)
        dev_caches = [cupy.asarray(np.nan_to_num(p).astype(nd)) for p in pages]
        dev_table = cupy.asarray(table)
    else:
        dev_caches = [cupy.asarray(c.astype(nd)) for c in host]
        dev_table = None
    kw = dict(cache_seqlens=cupy.asarray(seq), block_table=dev_table, causal=causal,
              sm_scale=float(scale), return_lse=True)
    if appended:
        kw.update(k1_new=cupy.asarray(new[0].astype(nd)), k2_new=cupy.asarray(new[1].astype(nd)),
                  v_new=cupy.asarray(new[2].astype(nd)))
    o, lse = kvcache.attention_with_kvcache(cupy.asarray(q1.astype(nd)), cupy.asarray(q2.astype(nd)),
                                            *dev_caches, w, **kw)
    got = [cupy.asnumpy(o).astype(np.float64), cupy.asnumpy(lse).astype(np.float64)]
    for name, g, r, lw in zip(("o", "lse"), got, ref, low):
        verdict = tolerance.compare(name, g, r, lw, dtype)
        assert verdict.passed, f"{verdict} (w={w}, input seed {seed})"
    if appended:  # the caches now hold the new rows, read back in sequence order
        for dc, want in zip(dev_caches, full):
            h = cupy.asnumpy(dc).astype(np.float32)
            if bs:
                h = np.stack([np.concatenate([h[p] for p in table[b]], axis=1) for b in range(B)])
            np.testing.assert_array_equal(h, want)


@pytest.mark.parametrize("paged", [False, True])
def test_append_writes_exactly_the_new_positions(paged):
    """Caches full of NaN bit patterns: after the call exactly rows seqlens[b] .. + M - 1
    hold the new keys and every other bit is unchanged (the spare pages too)."""
    import cupy

    rng = np.random.default_rng(1)
    dtype, B, H, Hkv, M, D, N = "bfloat16", 3, 4, 2, 5, 64, 256
    nd = _np_dtype(dtype)
    seq = np.array([0, 77, N - M], np.int32)
    new = [round_to(rng.standard_normal((B, Hkv, M, D)).astype(np.float32), dtype) for _ in range(3)]
    shape = (B * (N // 64) + 2, Hkv, 64, D) if paged else (B, Hkv, N, D)
    caches = [cupy.full(shape, NAN_BITS[dtype], dtype=cupy.uint16).view(nd) for _ in range(3)]
    table = (rng.permutation(shape[0])[:B * (N // 64)].reshape(B, N // 64).astype(np.int32)
             if paged else None)
    q = cupy.asarray(rng.standard_normal((B, H, M, D)).astype(nd))
    kvcache.attention_with_kvcache(
        q, q, *caches, 3, cache_seqlens=cupy.asarray(seq),
        block_table=None if table is None else cupy.asarray(table),
        k1_new=cupy.asarray(new[0].astype(nd)), k2_new=cupy.asarray(new[1].astype(nd)),
        v_new=cupy.asarray(new[2].astype(nd)))
    for dc, n in zip(caches, new):
        bits = cupy.asnumpy(dc.view(cupy.uint16))
        want = np.full(shape, NAN_BITS[dtype], np.uint16)
        for b in range(B):
            for t in range(M):
                pos = int(seq[b]) + t
                row = n[b, :, t].astype(nd).view(np.uint16)
                if paged:
                    want[table[b, pos // 64], :, pos % 64] = row
                else:
                    want[b, :, pos] = row
        np.testing.assert_array_equal(bits, want)


@pytest.mark.parametrize("split", [False, True])
def test_torch_decode_loop_in_a_cuda_graph_matches_eager(split, monkeypatch):
    """A decode step (append one token, attend) captured once in a CUDA graph and replayed
    for several steps with the lengths advanced on the device gives the eager results, and
    leaves the same caches. ``split``: on the Hopper decode, the keys in 8 splits that
    pw_forward_combine merges (a second kernel node, reading the graph's workspace)."""
    torch = pytest.importorskip("torch")
    import cupy_piecewise
    from cupy_piecewise import capability, kvcache_launch as kl, launch

    if split and launch._compute_capability(0) != (9, 0):
        pytest.skip("the split-count knob is the Hopper decode's (compute capability 9.0)")
    if split:  # one 64-key tile per split at least: the 512-row cache makes 8 splits
        monkeypatch.setitem(capability.KV90_MIN_TILES, 128, 1)
    kl._plans._data.clear()  # plans keep their split count, which the knobs do not key
    try:
        _check_decode_graph(torch, cupy_piecewise, kl, split)
    finally:
        kl._plans._data.clear()


def _check_decode_graph(torch, cupy_piecewise, kl, split):
    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, Hkv, D, N, steps, bs = 3, 8, 2, 128, 512, 5, 64
    dt = torch.bfloat16
    start = torch.tensor([0, 100, 400], dtype=torch.int32, device="cuda")
    caches_e = [torch.randn(B * N // bs + 1, Hkv, bs, D, device="cuda", dtype=dt, generator=g)
                for _ in range(3)]
    caches_g = [c.clone() for c in caches_e]
    table = torch.randperm(B * N // bs, device="cuda", generator=g).view(B, N // bs).to(torch.int32)
    qs = [torch.randn(steps, B, H, 1, D, device="cuda", dtype=dt, generator=g) for _ in range(2)]
    news = [torch.randn(steps, B, Hkv, 1, D, device="cuda", dtype=dt, generator=g) for _ in range(3)]

    def step(q1, q2, caches, seq, n1, n2, nv):
        return cupy_piecewise.attention_with_kvcache(
            q1, q2, *caches, 64, cache_seqlens=seq, k1_new=n1, k2_new=n2, v_new=nv,
            block_table=table, return_lse=True)

    eager = [step(qs[0][t], qs[1][t], caches_e, start + t, news[0][t], news[1][t], news[2][t])
             for t in range(steps)]
    # static buffers the graph reads; the first replay's inputs are copied in before capture
    sq1, sq2 = qs[0][0].clone(), qs[1][0].clone()
    sn = [n[0].clone() for n in news]
    seq = start.clone()
    warm = [c.clone() for c in caches_g]
    step(sq1, sq2, warm, seq, *sn)  # compile and load outside the capture
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
    (plan,) = [pl for (shape, _), pl in kl._plans._data.items() if shape.capacity == N]
    if plan._maps is not None:  # the Hopper decode, whose split count the knob sets
        assert (plan.nsplit > 1) == split and bool(plan._combine) == split, plan.nsplit


def test_split_and_unsplit_grids_agree_with_the_reference():
    """Many heads (one block per (sequence, head): no split) and few (keys split across
    blocks, merged by lse) on the same keys."""
    import cupy

    from cupy_piecewise import kvcache_launch as kl

    rng = np.random.default_rng(2)
    dtype, D, N = "bfloat16", 128, 4096
    nd = _np_dtype(dtype)
    for B, H in ((1, 2), (2, 160)):
        q1, q2 = (round_to(rng.standard_normal((B, H, 1, D)).astype(np.float32), dtype)
                  for _ in range(2))
        host = [round_to(rng.standard_normal((B, H, N, D)).astype(np.float32), dtype)
                for _ in range(3)]
        seq = np.full(B, N - 5, np.int32)
        ref, low = _expected(q1, q2, host, 1000, seq, 1, False, True, 1 / np.sqrt(D), dtype)
        o, lse = kvcache.attention_with_kvcache(
            cupy.asarray(q1.astype(nd)), cupy.asarray(q2.astype(nd)),
            *[cupy.asarray(c.astype(nd)) for c in host], 1000, cache_seqlens=cupy.asarray(seq),
            return_lse=True)
        # this call's plans (other tests of the session leave plans of other shapes)
        plans = [pl for (shape, _), pl in kl._plans._data.items()
                 if (shape.B, shape.H, shape.Hkv, shape.M, shape.D, shape.capacity,
                     shape.appended) == (B, H, H, 1, D, N, False)]
        assert plans and all((pl.nsplit > 1) == (H == 2) for pl in plans), \
            [pl.nsplit for pl in plans]
        for name, g, r, lw in zip(("o", "lse"), (cupy.asnumpy(o), cupy.asnumpy(lse)), ref, low):
            verdict = tolerance.compare(name, np.asarray(g, np.float64), r, lw, dtype)
            assert verdict.passed, f"B={B} H={H}: {verdict}"


def test_transposed_cache_view_on_the_gpu():
    """FlashAttention's (B, N, Hkv, D) cache memory passed as a (B, Hkv, N, D) view: read and
    appended in place, equal to the contiguous call."""
    import cupy

    rng = np.random.default_rng(3)
    B, H, Hkv, M, D, N = 2, 4, 4, 2, 64, 128
    nd = _np_dtype("float16")
    q = [cupy.asarray(rng.standard_normal((B, H, M, D)).astype(nd)) for _ in range(2)]
    host = [rng.standard_normal((B, Hkv, N, D)).astype(nd) for _ in range(3)]
    new = [cupy.asarray(rng.standard_normal((B, Hkv, M, D)).astype(nd)) for _ in range(3)]
    seq = cupy.asarray(np.array([5, 90], np.int32))
    contig = [cupy.asarray(h) for h in host]
    views = [cupy.asarray(np.ascontiguousarray(h.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
             for h in host]
    a = kvcache.attention_with_kvcache(*q, *contig, 7, cache_seqlens=seq, k1_new=new[0],
                                       k2_new=new[1], v_new=new[2])
    b = kvcache.attention_with_kvcache(*q, *views, 7, cache_seqlens=seq, k1_new=new[0],
                                       k2_new=new[1], v_new=new[2])
    assert bool((a == b).all())
    for c, v in zip(contig, views):
        assert bool((c == v).all())


def test_strided_lengths_and_table_misaligned_queries_and_no_query_heads():
    """Lengths and block table given as strided views, queries and new keys at a pointer
    that is not 16-byte aligned (copied, not read in place): the same results as plain
    arrays. And with no query heads (H = 0) the new keys are still written."""
    import cupy

    rng = np.random.default_rng(4)
    nd = _np_dtype("bfloat16")
    B, H, Hkv, M, D, N, bs = 3, 4, 2, 2, 64, 256, 64
    q = [rng.standard_normal((B, H, M, D)).astype(nd) for _ in range(2)]
    host = [rng.standard_normal((B, Hkv, N, D)).astype(nd) for _ in range(3)]
    new = [rng.standard_normal((B, Hkv, M, D)).astype(nd) for _ in range(3)]
    seq = np.array([0, 77, 200], np.int32)
    pages, table = kc.page_all([h.astype(np.float32) for h in host], bs, rng)

    def run(q_dev, new_dev, seq_dev, table_dev):
        caches = [cupy.asarray(np.nan_to_num(p).astype(nd)) for p in pages]
        o, lse = kvcache.attention_with_kvcache(
            *q_dev, *caches, 9, cache_seqlens=seq_dev, block_table=table_dev, return_lse=True,
            k1_new=new_dev[0], k2_new=new_dev[1], v_new=new_dev[2])
        return cupy.asnumpy(o), cupy.asnumpy(lse), [cupy.asnumpy(c) for c in caches]

    def misaligned(x):
        flat = cupy.empty(x.size + 1, dtype=x.dtype)
        view = flat[1:].reshape(x.shape)  # contiguous, 2 bytes past an aligned start
        view[...] = cupy.asarray(x)
        assert view.data.ptr % 16
        return view

    plain = run([cupy.asarray(x) for x in q], [cupy.asarray(x) for x in new],
                cupy.asarray(seq), cupy.asarray(table))
    seq2 = cupy.asarray(np.stack([seq, seq + 1], axis=1))[:, 0]       # stride 8 bytes
    table_f = cupy.asfortranarray(cupy.asarray(table))                # column stride != 1
    odd = run([misaligned(x) for x in q], [misaligned(x) for x in new], seq2, table_f)
    for a, b in zip(plain[:2], odd[:2]):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(plain[2], odd[2]):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))

    # no query heads: nothing to attend, the append still happens
    caches = [cupy.asarray(h) for h in host]
    empty_q = cupy.zeros((B, 0, M, D), nd)
    o = kvcache.attention_with_kvcache(
        empty_q, empty_q, *caches, 9, cache_seqlens=cupy.asarray(seq),
        k1_new=cupy.asarray(new[0]), k2_new=cupy.asarray(new[1]), v_new=cupy.asarray(new[2]))
    assert o.shape == (B, 0, M, D)
    for c, n in zip(caches, new):
        got = cupy.asnumpy(c)
        for b in range(B):
            np.testing.assert_array_equal(got[b, :, seq[b]:seq[b] + M].view(np.uint16),
                                          n[b].view(np.uint16))


DECODE_CASES = [  # (dtype, D, H, Hkv, layout): layouts of the cache memory
    ("bfloat16", 128, 8, 2, "contig"), ("float16", 64, 8, 8, "contig"),
    ("bfloat16", 64, 40, 2, "transposed"), ("float16", 128, 4, 4, "paged16"),
    ("bfloat16", 128, 20, 1, "paged64"), ("bfloat16", 32, 4, 2, "contig"),
    ("float16", 128, 8, 2, "contig500"),  # a capacity that ends inside a 64-key tile
]


@pytest.mark.parametrize("path", ["auto", "mma"])
@pytest.mark.parametrize("dtype,D,H,Hkv,layout", DECODE_CASES,
                         ids=[f"{c[0]}-D{c[1]}-H{c[2]}-Hkv{c[3]}-{c[4]}" for c in DECODE_CASES])
def test_decode_never_reads_cache_rows_past_the_lengths(dtype, D, H, Hkv, layout, path,
                                                         monkeypatch):
    """M = 1 on both decode kernels (on an H200 ``auto`` runs the TMA kernel of
    kernels_cu/sm90/kvdecode.cu for D 64 and 128, ``mma`` forces the cp.async one): every
    cache row past a sequence's length, and every unused page, holds NaN, so a kernel that
    lets one reach P·V (0 * NaN) or a score fails. Lengths end inside and on the edge of
    16-key chunks and 64-key tiles; w puts the d = w boundary inside a chunk, on a chunk
    edge, before every key and after every key; groups of 20 heads need two 16-row tiles.
    ``contig500``: a cache of 500 rows, whose last 64-key tile runs past it (the TMA loads
    fill those rows with zeros; under -DKV90_TILE_BOX=1 as one 64-row box)."""
    import cupy

    from cupy_piecewise import capability, kvcache_launch as kl, launch

    monkeypatch.setenv(capability.PATH_VAR, path)
    capability.refresh_env_override()
    _poisoned_outputs(monkeypatch)
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    B, N = 6, 500 if layout == "contig500" else 512
    seq = np.array([0, 1, 15, 64, 300, N], np.int32)
    nd = _np_dtype(dtype)
    q1, q2 = (round_to(rng.standard_normal((B, H, 1, D)).astype(np.float32) * 1.5, dtype)
              for _ in range(2))
    host = [round_to(rng.standard_normal((B, Hkv, N, D)).astype(np.float32) * 1.5, dtype)
            for _ in range(3)]
    stale = [c.copy() for c in host]  # what the device caches hold: NaN past each length
    for c in stale:
        for b in range(B):
            c[b, :, seq[b]:] = np.nan
    for w in (int(rng.integers(2, 300)), 48, -(N + 5), N + 5):
        ref, low = _expected(q1, q2, host, w, seq, 1, False, True, 1 / np.sqrt(D), dtype)
        if layout.startswith("paged"):
            pages, table = kc.page_all(stale, int(layout[5:]), rng)
            caches = [cupy.asarray(p.astype(nd)) for p in pages]  # unused pages stay NaN
            kw = dict(block_table=cupy.asarray(table))
        elif layout == "transposed":  # (B, N, Hkv, D) memory read as (B, Hkv, N, D)
            caches = [cupy.asarray(np.ascontiguousarray(c.astype(nd).transpose(0, 2, 1, 3)))
                      .transpose(0, 2, 1, 3) for c in stale]
            kw = {}
        else:
            caches = [cupy.asarray(c.astype(nd)) for c in stale]
            kw = {}
        o, lse = kvcache.attention_with_kvcache(
            cupy.asarray(q1.astype(nd)), cupy.asarray(q2.astype(nd)), *caches, w,
            cache_seqlens=cupy.asarray(seq), return_lse=True, **kw)
        for name, g, r, lw in zip(("o", "lse"), (cupy.asnumpy(o), cupy.asnumpy(lse)), ref, low):
            verdict = tolerance.compare(name, np.asarray(g, np.float64), r, lw, dtype)
            assert verdict.passed, f"w={w}: {verdict} (input seed {seed})"
    hopper = (path == "auto" and D in capability.KV90_HEAD_DIMS
              and launch._compute_capability(0) == (9, 0))
    plans = [pl for (shape, switches), pl in kl._plans._data.items()
             if (shape.B, shape.H, shape.Hkv, shape.M, shape.D) == (B, H, Hkv, 1, D)
             and switches == capability.plan_switches()]
    assert plans and all((pl._maps is not None) == hopper for pl in plans)


@pytest.mark.parametrize("splits", [1, 2, 3, 4, 5, 7, 8, 12])
def test_hopper_decode_merges_splits_in_a_cluster(splits, monkeypatch):
    """The Hopper decode with 1 to 8 key splits per (head, sequence) merges them inside a
    thread-block cluster (no combine launch, no workspace); 12 splits exceed a cluster and go
    through pw_forward_combine. Each against the float64 reference, with NaN in every cache
    row past a sequence's length and groups of 20 query heads (two 16-row tiles)."""
    from cupy_piecewise import capability, kvcache_launch as kl, launch

    if launch._compute_capability(0) != (9, 0):
        pytest.skip("the Hopper decode kernel runs on compute capability 9.0 only")
    monkeypatch.setitem(capability.KV90_MIN_TILES, 128, 4)
    monkeypatch.setattr(capability, "KV90_MAX_CLUSTER", 8)  # every cluster size the build has
    kl._plans._data.clear()  # plans keep their split count, which the knobs do not key
    try:
        _check_decode_splits(splits, monkeypatch, kl, capability)
    finally:  # no plan built under the knobs outlives them, whatever the outcome
        kl._plans._data.clear()


def _check_decode_splits(splits, monkeypatch, kl, capability):
    import cupy

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    dtype, D, B, H, Hkv = "bfloat16", 128, 3, 40, 2
    N = 64 * (4 * splits + 1) - 9  # 4 * splits + 1 tiles: `splits` splits of at least 4
    seq = np.array([0, N // 2 + 7, N], np.int32)
    nd = _np_dtype(dtype)
    q1, q2 = (round_to(rng.standard_normal((B, H, 1, D)).astype(np.float32), dtype)
              for _ in range(2))
    host = [round_to(rng.standard_normal((B, Hkv, N, D)).astype(np.float32), dtype)
            for _ in range(3)]
    stale = [c.copy() for c in host]
    for c in stale:
        for b in range(B):
            c[b, :, seq[b]:] = np.nan
    w = int(rng.integers(1, N // 2))
    ref, low = _expected(q1, q2, host, w, seq, 1, False, True, 1 / np.sqrt(D), dtype)
    _poisoned_outputs(monkeypatch)
    o, lse = kvcache.attention_with_kvcache(
        cupy.asarray(q1.astype(nd)), cupy.asarray(q2.astype(nd)),
        *[cupy.asarray(c.astype(nd)) for c in stale], w, cache_seqlens=cupy.asarray(seq),
        return_lse=True)
    for name, g, r, lw in zip(("o", "lse"), (cupy.asnumpy(o), cupy.asnumpy(lse)), ref, low):
        verdict = tolerance.compare(name, np.asarray(g, np.float64), r, lw, dtype)
        assert verdict.passed, f"w={w}: {verdict} (input seed {seed})"
    (plan,) = [pl for (shape, _), pl in kl._plans._data.items() if shape.capacity == N]
    assert plan.nsplit == splits
    clustered = splits <= capability.KV90_MAX_CLUSTER
    assert plan.cluster == (splits if clustered else 1)
    assert (plan.workspace_bytes > 0) == (not clustered and splits > 1)


@pytest.mark.parametrize("path", ["auto", "mma"])
def test_sixty_four_splits_merge_by_lse(path, monkeypatch):
    """The most key splits a KV-cache call makes (kvcache_launch.MAX_SPLITS = 64 on an H200:
    one key head, two sequences, 79 key tiles), merged by pw_forward_combine, whose warp
    takes the splits' lse 32 at a time (two rounds here). Many splits hold no key at all
    (2 tiles each: splits 40-63 are empty, as is every split of the empty sequence), so
    their lse is -inf and they must weigh nothing. Against the float64 reference, outputs
    NaN-poisoned, NaN in every cache row past a length. ``auto``: the Hopper decode on
    compute capability 9.0; ``mma``: the cp.async kernel. A GPU whose resident blocks call
    for 32 splits or fewer (split_count) checks the result, then skips: its merge takes one
    round."""
    import cupy

    from cupy_piecewise import capability, kvcache_launch as kl

    if path == "mma":
        monkeypatch.setenv(capability.PATH_VAR, "mma")
        capability.refresh_env_override()
    monkeypatch.setitem(capability.KV90_MIN_TILES, 128, 1)  # 64 splits > any cluster
    kl._plans._data.clear()  # plans keep their split count, which the knobs do not key
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    dtype, D, B, H, Hkv, N = "float16", 128, 2, 1, 1, 64 * 79 - 5
    seq = np.array([0, N], np.int32)
    nd = _np_dtype(dtype)
    q1, q2 = (round_to(rng.standard_normal((B, H, 1, D)).astype(np.float32), dtype)
              for _ in range(2))
    host = [round_to(rng.standard_normal((B, Hkv, N, D)).astype(np.float32), dtype)
            for _ in range(3)]
    stale = [c.copy() for c in host]
    for c in stale:
        c[0] = np.nan  # every row of the empty sequence
    w = int(rng.integers(1, N))
    ref, low = _expected(q1, q2, host, w, seq, 1, False, True, 1 / np.sqrt(D), dtype)
    _poisoned_outputs(monkeypatch)
    try:
        o, lse = kvcache.attention_with_kvcache(
            *[cupy.asarray(x.astype(nd)) for x in (q1, q2)],
            *[cupy.asarray(c.astype(nd)) for c in stale], w, cache_seqlens=cupy.asarray(seq),
            return_lse=True)
        (plan,) = [pl for (shape, _), pl in kl._plans._data.items() if shape.capacity == N]
    finally:
        kl._plans._data.clear()
    assert plan.nsplit > 1 and plan._combine, plan.nsplit
    for name, g, r, lw in zip(("o", "lse"), (cupy.asnumpy(o), cupy.asnumpy(lse)), ref, low):
        verdict = tolerance.compare(name, np.asarray(g, np.float64), r, lw, dtype)
        assert verdict.passed, f"{path} w={w}: {verdict} (input seed {seed})"
    if plan.nsplit <= 32:
        pytest.skip(f"{plan.nsplit} splits on this GPU (64 on an H200): result checked, but "
                    "the merge's second round of 32 splits was not exercised")


# A kernel that lets the next kernel on its stream start at once (a programmatic launch
# may), then writes its data late: what a decode that skipped its wait would miss.
_LATE_WRITER = r"""
extern "C" __global__ void pw_test_late_writer(int* dst, const int* src, long long n,
                                               unsigned long long delay_ns) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < delay_ns);
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x)
    dst[i] = src[i];
}
"""


def _late_write(torch, dst, src, delay_ns):
    """dst <- src (same bytes, a multiple of 4) by _LATE_WRITER on torch's current stream."""
    import cupy

    kern = cupy.RawKernel(_LATE_WRITER, "pw_test_late_writer")
    d, s_ = (cupy.asarray(t.view(torch.int32).reshape(-1)) for t in (dst, src))
    ts = torch.cuda.current_stream()
    # CuPy 14 deprecates ExternalStream for the CUDA stream protocol (__cuda_stream__), which
    # torch's streams implement; the fallback keeps older pairs working
    stream = (cupy.cuda.Stream.from_external(ts) if hasattr(ts, "__cuda_stream__")
              and hasattr(cupy.cuda.Stream, "from_external")
              else cupy.cuda.ExternalStream(ts.cuda_stream))
    with stream:
        kern((4,), (256,), (d, s_, cupy.int64(d.size), cupy.uint64(delay_ns)))


def _decode_reference_f32(torch, q1, q2, k1, k2, v, w, lens, scale):
    """float32 decode of one token per sequence at position lens[b] - 1 over keys < lens[b]."""
    N = k1.shape[2]
    n = torch.arange(N, device=q1.device)
    pos = (lens.long() - 1)[:, None, None, None]
    s1 = torch.einsum("bhmd,bhnd->bhmn", q1.float(), k1.float())
    s2 = torch.einsum("bhmd,bhnd->bhmn", q2.float(), k2.float())
    s = torch.where(pos - n >= w, s2, s1) * scale
    s = s.masked_fill(n >= lens.long()[:, None, None, None], float("-inf"))
    return torch.einsum("bhmn,bhnd->bhmd", torch.softmax(s, dim=-1), v.float())


@pytest.mark.parametrize("layout", ["unsplit", "cluster", "combine"])
def test_programmatic_launches_read_what_the_kernel_before_wrote(layout, monkeypatch):
    """The Hopper decode and its merge start early (programmatic dependent launches,
    capability.KV90_PDL*), so each must wait before touching global memory. Per round, on
    fresh inputs: the queries and lengths are poisoned (NaN, 0), then written by kernels
    queued just before the call; the last of them lets the decode start at once
    (griddepcontrol.launch_dependents) and writes the lengths 50 us later; the split-KV
    workspace is NaN-filled before those kernels (the call launches nothing of its own
    before the decode). The outputs must equal, bit for bit, those of plain launches
    on the same inputs, be finite, and match a float32 reference. ``layout``: unsplit,
    splits merged in a cluster, or merged by pw_forward_combine."""
    torch = pytest.importorskip("torch")
    import cupy_piecewise
    from cupy_piecewise import capability, kvcache_launch as kl, launch
    from cupy_piecewise.adapters import torch as torch_adapter

    if launch._compute_capability(0) != (9, 0):
        pytest.skip("the programmatic launches are the Hopper decode's (compute capability 9.0)")
    B, H, N, D = {"unsplit": (8, 32, 2048, 128), "cluster": (2, 8, 4096, 128),
                  "combine": (2, 8, 4096, 64)}[layout]
    if layout == "combine":  # one tile per split at least: 16 splits, more than a cluster
        monkeypatch.setitem(capability.KV90_MIN_TILES, 64, 1)
    # The split-KV workspace: one buffer, NaN-filled (0xFF bytes) before the kernels that
    # precede each call, so that the call itself launches nothing before the decode.
    ws = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")

    def scratch(nbytes, device):
        assert nbytes <= ws.numel() and device == 0, (nbytes, device)
        return ws[:nbytes]
    monkeypatch.setattr(torch_adapter, "OPS", torch_adapter.OPS._replace(scratch=scratch))
    dt, w = torch.bfloat16, N // 4
    qs = [torch.empty(B, H, 1, D, device="cuda", dtype=dt) for _ in range(2)]
    seq = torch.empty(B, dtype=torch.int32, device="cuda")
    for rnd in range(3):
        seed = fresh_seed()
        g = torch.Generator(device="cuda").manual_seed(seed)
        caches = [torch.randn(B, H, N, D, device="cuda", dtype=dt, generator=g) for _ in range(3)]
        qsrc = [torch.randn(B, H, 1, D, device="cuda", dtype=dt, generator=g) for _ in range(2)]
        lens = torch.randint(N // 2, N + 1, (B,), device="cuda", generator=g).to(torch.int32)
        results = {}
        for pdl in (False, True):
            monkeypatch.setattr(capability, "KV90_PDL", pdl)
            monkeypatch.setattr(capability, "KV90_PDL_DECODE", pdl)
            kl._plans._data.clear()
            for q in qs:
                q.fill_(float("nan"))
            seq.fill_(0)
            ws.fill_(0xFF)
            _late_write(torch, qs[0], qsrc[0], 0)
            _late_write(torch, qs[1], qsrc[1], 0)
            _late_write(torch, seq, lens, 50_000)  # the decode's predecessor
            results[pdl] = cupy_piecewise.attention_with_kvcache(
                qs[0], qs[1], *caches, w, cache_seqlens=seq, return_lse=True)
            torch.cuda.synchronize()
            (plan,) = kl._plans._data.values()
            assert plan.programmatic == (pdl, pdl and layout == "combine"), plan.programmatic
            want = {"unsplit": (1, 1), "cluster": (plan.nsplit, plan.nsplit),
                    "combine": (16, 1)}[layout]
            assert (plan.nsplit, plan.cluster) == want and (plan.nsplit > 1) == (
                layout != "unsplit"), (plan.nsplit, plan.cluster)
        (o0, l0), (o1, l1) = results[False], results[True]
        assert torch.isfinite(o0).all() and torch.isfinite(l0).all(), f"seed {seed}"
        assert torch.equal(o1, o0) and torch.equal(l1, l0), f"round {rnd}, seed {seed}"
        ref = _decode_reference_f32(torch, *qsrc, *caches, w, lens, D ** -0.5)
        err = float((o0.float() - ref).abs().max() / ref.abs().max())
        assert err < 2e-2, f"max |o - ref| / max |ref| = {err:.3g} (seed {seed})"
    kl._plans._data.clear()
