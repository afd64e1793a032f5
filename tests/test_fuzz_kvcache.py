"""Property-based fuzzing of ``attention_with_kvcache`` (issue "Reliability", item 1, for the
KV-cache entry point): batch, key/value heads and group size, new tokens M (1 runs the
kvdecode kernel, more the kvcache kernel), head dim, dtype, causal, with or without keys
appended, contiguous or paged caches (block sizes 16, 32, 64, shuffled pages, spare
pages), a transposed (FlashAttention-layout) contiguous cache, capacities from 16 to 700,
per-sequence lengths from 0 to full (tile edges likely), and w anywhere from below every
distance to beyond every one.

- CPU profile (CI): the NumPy reference (``kvcache.reference_with_kvcache``) against the
  dense implementation of tests/kvcache_cases.py, exactly (float64), the caches after
  the append included; derandomized, ``CUPY_PIECEWISE_FUZZ_EXAMPLES`` examples (default
  60).
- GPU profile (marked ``gpu``): CuPy arrays through the kernels with NaN-filled outputs,
  against the float64 reference and the low-precision yardstick by the tolerance rule,
  and the caches bitwise: exactly the appended rows changed.
  ``CUPY_PIECEWISE_FUZZ_GPU_EXAMPLES`` examples (default 200), random unless
  ``CUPY_PIECEWISE_FUZZ_RANDOM=0``; failures are saved as test_fuzz_cpu.fuzz_settings says.

``attention_with_rotary_kvcache`` is fuzzed the same way on the same cases, with one raw
key cache, a layout (halves or interleaved) and two group sizes (None, 1, 2, 3, 8, 64): on
the CPU its reference against the dense implementation on keys rotated here by complex
multiplication (40 examples by default), on the GPU the rotary kernels (half the GPU
example count).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))
import kvcache_cases as kc  # noqa: E402
import test_fuzz_cpu as fz  # noqa: E402

from cupy_piecewise import kvcache  # noqa: E402


@dataclass(frozen=True)
class KVCase:
    """One drawn call; its repr is valid Python (paste it into an ``@example``)."""

    dtype: str
    B: int
    Hkv: int
    group: int
    M: int
    D: int
    capacity: int
    block_size: int  # 0: contiguous
    transposed: bool  # contiguous caches stored as (B, N, Hkv, D)
    appended: bool
    causal: bool
    seqlens: tuple
    w: int
    seed: int


@st.composite
def kv_cases(draw, gpu: bool):
    dtype = draw(st.sampled_from(["float16", "bfloat16"] if gpu else ["float64"]))
    D = draw(st.sampled_from([16, 32, 64, 128]))
    B = draw(st.integers(1, 4))
    Hkv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4, 8]))
    M = draw(st.sampled_from([1, 1, 1, 2, 3, 5, 16, 17]))
    block_size = draw(st.sampled_from([0, 0, 16, 32, 64]))
    unit = block_size or 1
    capacity = unit * draw(st.integers(max(1, -(-(M + 1) // unit)), 700 // unit))
    appended = draw(st.booleans())
    room = capacity - (M if appended else 0)
    edges = st.sampled_from([0, 1, room, room - 1, 63, 64, 65, 127, 128]).filter(
        lambda n: 0 <= n <= room)
    seqlens = tuple(draw(st.one_of(edges, st.integers(0, room))) for _ in range(B))
    w = draw(st.one_of(st.integers(-3, capacity + 3),
                       st.sampled_from([-(2 ** 40), 2 ** 40, 0, 1, -1]),
                       st.integers(-M - 2, M + 2)))
    transposed = block_size == 0 and draw(st.booleans())
    return KVCase(dtype, B, Hkv, group, M, D, capacity, block_size, transposed, appended,
                  draw(st.booleans()), seqlens, w, draw(st.integers(0, 2 ** 32 - 1)))


def _host_inputs(case: KVCase, round_to=lambda x: x):
    """(q1, q2, contiguous caches, new rows) as float arrays holding ``case.dtype`` values."""
    rng = np.random.default_rng(case.seed)
    H = case.Hkv * case.group

    def draw(shape, scale=1.0):
        return round_to((rng.standard_normal(shape) * scale).astype(np.float32)).astype(np.float64)

    q1, q2 = (draw((case.B, H, case.M, case.D), 1.5) for _ in range(2))
    caches = [draw((case.B, case.Hkv, case.capacity, case.D), 1.5) for _ in range(3)]
    new = [draw((case.B, case.Hkv, case.M, case.D)) for _ in range(3)]
    return q1, q2, caches, new


def _after_append(case: KVCase, caches, new):
    full = [c.copy() for c in caches]
    if case.appended:
        for c, n in zip(full, new):
            for b, s in enumerate(case.seqlens):
                c[b, :, s:s + case.M] = n[b]
    return full


def _layout(case: KVCase, caches, rng, to_array):
    """The caches as the call takes them, and the block table (None when contiguous)."""
    if case.block_size:
        pages, table = kc.page_all(caches, case.block_size, rng)
        return [to_array(np.nan_to_num(p)) for p in pages], table
    if case.transposed:
        return [to_array(np.ascontiguousarray(c.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
                for c in caches], None
    return [to_array(c) for c in caches], None


def _read_back(case: KVCase, arrays, table):
    """Contiguous (B, Hkv, capacity, D) float64 copies of the caches as the call left them."""
    out = []
    for a in arrays:
        a = np.asarray(a.get() if hasattr(a, "get") else a, np.float64)
        if table is not None:
            a = np.stack([np.concatenate([a[p] for p in table[b]], axis=1) for b in range(case.B)])
        out.append(a)
    return out


@fz.fuzz_settings(int(os.environ.get("CUPY_PIECEWISE_FUZZ_EXAMPLES", "0")) or 60,
                  random=fz.CPU_RANDOM)
@given(case=kv_cases(gpu=False))
def test_kvcache_reference_fuzz(case):
    q1, q2, caches, new = _host_inputs(case)
    rng = np.random.default_rng(case.seed + 1)
    work, table = _layout(case, caches, rng, lambda x: x.copy())
    seq = np.array(case.seqlens, np.int32)
    kw = dict(k1_new=new[0], k2_new=new[1], v_new=new[2]) if case.appended else {}
    o, lse = kvcache.reference_with_kvcache(q1, q2, *work, case.w, seq, block_table=table,
                                            causal=case.causal, **kw)
    full = _after_append(case, caches, new)
    for got, want in zip(_read_back(case, work, table), full):
        np.testing.assert_array_equal(got, want)
    o_d, lse_d = kc.dense(q1, q2, *full, max(-10 ** 6, min(10 ** 6, case.w)), seq,
                          case.M if case.appended else 0, case.causal, 1 / np.sqrt(case.D))
    np.testing.assert_allclose(o, o_d, rtol=1e-11, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_d))
    fin = np.isfinite(lse_d)
    np.testing.assert_allclose(lse[fin], lse_d[fin], rtol=1e-11, atol=1e-12)


@pytest.mark.gpu
@fz.fuzz_settings(int(os.environ.get("CUPY_PIECEWISE_FUZZ_GPU_EXAMPLES", "200")),
                  random=fz.env_flag("CUPY_PIECEWISE_FUZZ_RANDOM", True))
@given(case=kv_cases(gpu=True))
def test_kvcache_gpu_fuzz(case):
    import cupy

    from cupy_piecewise import tolerance
    from cupy_piecewise.gpu_arrays import _np_dtype, poisoned, round_to
    from test_kvcache_gpu import _expected

    nd = _np_dtype(case.dtype)
    q1, q2, caches, new = _host_inputs(case, lambda x: round_to(x, case.dtype))
    rng = np.random.default_rng(case.seed + 1)
    work, table = _layout(case, caches, rng, lambda x: cupy.asarray(x.astype(nd)))
    seq = np.array(case.seqlens, np.int32)
    kw = {}
    if case.appended:
        kw = {k: cupy.asarray(n.astype(nd)) for k, n in zip(("k1_new", "k2_new", "v_new"), new)}

    def empty(shape, dtype):
        return poisoned(shape, "float32" if np.dtype(dtype) == np.float32 else case.dtype)

    real, kvcache._empty = kvcache._empty, empty
    try:
        o, lse = kvcache.attention_with_kvcache(
            cupy.asarray(q1.astype(nd)), cupy.asarray(q2.astype(nd)), *work, case.w,
            cache_seqlens=cupy.asarray(seq), causal=case.causal, return_lse=True,
            block_table=None if table is None else cupy.asarray(table), **kw)
    finally:
        kvcache._empty = real
    full = _after_append(case, caches, new)
    for got, want in zip(_read_back(case, work, table), full):
        np.testing.assert_array_equal(got, want)  # the appended rows and nothing else
    w = max(-10 ** 6, min(10 ** 6, case.w))  # the same comparisons for these lengths
    ref, low = _expected(q1, q2, full, w, seq, case.M, case.appended, case.causal,
                         1 / np.sqrt(case.D), case.dtype)
    for name, g, r, lw in zip(("o", "lse"), (cupy.asnumpy(o), cupy.asnumpy(lse)), ref, low):
        verdict = tolerance.compare(name, np.asarray(g, np.float64), r, lw, case.dtype)
        assert verdict.passed, f"{verdict} {case!r}"


# ---------------------------------------------------------------------------------------
# attention_with_rotary_kvcache: the same cases with one raw key cache and a rotary mode

@dataclass(frozen=True)
class RotCase:
    """A drawn KV-cache case and its rotation; the repr is valid Python."""

    kv: KVCase
    interleaved: bool
    groups: tuple  # (k1, k2) group sizes, None: not rotated


@st.composite
def rot_cases(draw, gpu: bool):
    kv = draw(kv_cases(gpu))
    g = st.sampled_from([None, 1, 1, 2, 3, 8, 64])
    return RotCase(kv, draw(st.booleans()), (draw(g), draw(g)))


def _tables(positions, D):
    ang = np.arange(positions)[:, None] * 10000.0 ** (-np.arange(D // 2) / (D // 2))
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _rot_inputs(case: RotCase, round_to=lambda x: x):
    """q1, q2, the raw key and value caches, their new rows, and the tables."""
    q1, q2, caches, new = _host_inputs(case.kv, round_to)
    return q1, q2, [caches[0], caches[2]], [new[0], new[2]], _tables(case.kv.capacity, case.kv.D)


def _rotate_by_tables(x, cos, sin, pos, interleaved):
    """x (..., n, D) with pair i of row j multiplied, as a complex number, by
    cos[pos[j], i] + i sin[pos[j], i] (written apart from kvcache_rotary.apply_rotary)."""
    from test_kvcache_rotary_cpu import _rotate_complex

    return _rotate_complex(x, None, interleaved, factor=cos[pos].astype(np.float64)
                           + 1j * sin[pos].astype(np.float64))


def _rot_kwargs(case: RotCase):
    return dict(k1_group_size=case.groups[0], k2_group_size=case.groups[1],
                interleaved=case.interleaved, causal=case.kv.causal)


@fz.fuzz_settings(int(os.environ.get("CUPY_PIECEWISE_FUZZ_EXAMPLES", "0")) or 40,
                  random=fz.CPU_RANDOM)
@given(case=rot_cases(gpu=False))
def test_rotary_kvcache_reference_fuzz(case):
    """The rotary reference against the dense implementation on key caches rotated here by
    complex multiplication with the tables' entries, the append included."""
    from cupy_piecewise import kvcache_rotary

    kv = case.kv
    q1, q2, caches, new, (cos, sin) = _rot_inputs(case)
    work, table = _layout(kv, caches, np.random.default_rng(kv.seed + 1), lambda x: x.copy())
    seq = np.array(kv.seqlens, np.int32)
    app = dict(k_new=new[0], v_new=new[1]) if kv.appended else {}
    o, lse = kvcache_rotary.reference_with_rotary_kvcache(
        q1, q2, *work, kv.w, cos, sin, seq, block_table=table, **app, **_rot_kwargs(case))
    full = _after_append(kv, caches, new)  # the raw keys and the values
    for got, want in zip(_read_back(kv, work, table), full):
        np.testing.assert_array_equal(got, want)
    n = np.arange(kv.capacity)
    k12 = [full[0] if g is None else _rotate_by_tables(full[0], cos, sin, n // g,
                                                       case.interleaved) for g in case.groups]
    o_d, lse_d = kc.dense(q1, q2, k12[0], k12[1], full[1], max(-10 ** 6, min(10 ** 6, kv.w)),
                          seq, kv.M if kv.appended else 0, kv.causal, 1 / np.sqrt(kv.D))
    np.testing.assert_allclose(o, o_d, rtol=1e-11, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_d))
    fin = np.isfinite(lse_d)
    np.testing.assert_allclose(lse[fin], lse_d[fin], rtol=1e-11, atol=1e-12)


@pytest.mark.gpu
@fz.fuzz_settings(int(os.environ.get("CUPY_PIECEWISE_FUZZ_GPU_EXAMPLES", "200")) // 2,
                  random=fz.env_flag("CUPY_PIECEWISE_FUZZ_RANDOM", True))
@given(case=rot_cases(gpu=True))
def test_rotary_kvcache_gpu_fuzz(case):
    """The rotary-inside kernels (both decode kernels for one token on an H200, as the
    shape picks) against the float64 reference and the yardstick that rotates in float32
    and rounds the keys to the dtype (tests/test_kvcache_rotary_gpu.py), NaN-filled
    outputs, and the caches bitwise: exactly the appended raw rows changed."""
    import cupy

    from cupy_piecewise import kvcache_rotary, tolerance
    from cupy_piecewise.gpu_arrays import _np_dtype, poisoned, round_to
    from test_kvcache_rotary_gpu import _lowp

    kv = case.kv
    nd = _np_dtype(kv.dtype)
    q1, q2, caches, new, (cos, sin) = _rot_inputs(case, lambda x: round_to(x, kv.dtype))
    work, table = _layout(kv, caches, np.random.default_rng(kv.seed + 1),
                          lambda x: cupy.asarray(x.astype(nd)))
    seq = np.array(kv.seqlens, np.int32)
    app = {}
    if kv.appended:
        app = {k: cupy.asarray(n.astype(nd)) for k, n in zip(("k_new", "v_new"), new)}

    def empty(shape, dtype):
        return poisoned(shape, "float32" if np.dtype(dtype) == np.float32 else kv.dtype)

    real, kvcache._empty = kvcache._empty, empty
    try:
        o, lse = kvcache_rotary.attention_with_rotary_kvcache(
            cupy.asarray(q1.astype(nd)), cupy.asarray(q2.astype(nd)), *work, kv.w,
            cos=cupy.asarray(cos), sin=cupy.asarray(sin), cache_seqlens=cupy.asarray(seq),
            block_table=None if table is None else cupy.asarray(table), return_lse=True,
            **app, **_rot_kwargs(case))
    finally:
        kvcache._empty = real
    full = _after_append(kv, caches, new)
    for got, want in zip(_read_back(kv, work, table), full):
        np.testing.assert_array_equal(got, want)  # the appended raw rows and nothing else
    w = max(-10 ** 6, min(10 ** 6, kv.w))
    lengths = seq + (kv.M if kv.appended else 0)
    f32 = [c.astype(np.float32) for c in full]  # dtype values, as the kernels read them
    ref = kvcache_rotary.reference_with_rotary_kvcache(
        q1.astype(np.float32), q2.astype(np.float32), *f32, w, cos, sin, lengths,
        sm_scale=1 / np.sqrt(kv.D), **_rot_kwargs(case))
    low = _lowp(q1.astype(np.float32), q2.astype(np.float32), *f32, cos, sin,
                [g or 0 for g in case.groups], case.interleaved, w, lengths, kv.M, kv.causal,
                1 / np.sqrt(kv.D), kv.dtype)
    for name, g, r, lw in zip(("o", "lse"), (cupy.asnumpy(o), cupy.asnumpy(lse)), ref, low):
        verdict = tolerance.compare(name, np.asarray(g, np.float64), r, lw, kv.dtype)
        assert verdict.passed, f"{verdict} {case!r}"
