"""attention_with_kvcache on the CPU: the reference against a dense implementation written
from the docstring, append in place, positions, paged against contiguous, torch CPU tensors
and the operator's registration, argument checks."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import kvcache_cases as kc  # noqa: E402

import cupy_piecewise  # noqa: E402
from cupy_piecewise import kvcache  # noqa: E402


def _setup(rng, B=3, H=4, Hkv=2, M=2, D=16, N=48):
    q1, q2 = (rng.standard_normal((B, H, M, D)) for _ in range(2))
    caches = [rng.standard_normal((B, Hkv, N, D)) for _ in range(3)]
    return q1, q2, caches


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("w", [-3, 0, 1, 5, 100])
def test_reference_matches_dense(causal, w):
    rng = np.random.default_rng(abs(w) * 2 + causal)
    q1, q2, caches = _setup(rng)
    seq = np.array([0, 7, 46], np.int32)  # empty, short, nearly full
    o, lse = kvcache.reference_with_kvcache(q1, q2, *caches, w, seq, causal=causal)
    o_d, lse_d = kc.dense(q1, q2, *caches, w, seq, 0, causal, 0.25)
    np.testing.assert_allclose(o, o_d, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(lse_d))
    np.testing.assert_allclose(lse[np.isfinite(lse)], lse_d[np.isfinite(lse_d)], rtol=1e-12)
    # sequence 0 has no keys: o = 0, lse = -inf; with causal the queries of a sequence of
    # 7 keys sit at positions 5 and 6
    assert (o[0] == 0).all() and np.isneginf(lse[0]).all()


@pytest.mark.parametrize("paged", [False, True])
def test_append_writes_exactly_the_new_rows_then_attends_them(paged):
    rng = np.random.default_rng(7)
    B, H, Hkv, M, D, N = 3, 4, 2, 3, 16, 64
    q1, q2, caches = _setup(rng, B, H, Hkv, M, D, N)
    seq = np.array([0, 10, 61], np.int32)  # the last fills the cache exactly
    new = [rng.standard_normal((B, Hkv, M, D)) for _ in range(3)]
    # poison every row that is neither cached nor appended: attention must not read it
    for c in caches:
        for b in range(B):
            c[b, :, seq[b]:] = np.nan
    want = [c.copy() for c in caches]
    for c, n in zip(want, new):
        for b in range(B):
            c[b, :, seq[b]:seq[b] + M] = n[b]
    if paged:
        work, table = kc.page_all(caches, 16, rng)
    else:
        work, table = [c.copy() for c in caches], None
    o, lse = kvcache.reference_with_kvcache(
        q1, q2, *work, 4, seq, k1_new=new[0], k2_new=new[1], v_new=new[2], block_table=table)
    for got, exp in zip(work, want):
        if paged:  # read the pages back in sequence order (the spare pages stay NaN)
            got = np.stack([np.concatenate([got[p] for p in table[b]], axis=1) for b in range(B)])
        np.testing.assert_array_equal(got, exp)  # NaN where poisoned, new rows where appended
    o_d, lse_d = kc.dense(q1, q2, *want, 4, seq, M, True, 0.25)
    np.testing.assert_allclose(o, o_d, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_d, rtol=1e-12)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("causal", [True, False])
def test_paged_equals_contiguous(block_size, causal):
    rng = np.random.default_rng(block_size + causal)
    q1, q2, caches = _setup(rng, M=5, N=64)
    seq = np.array([0, 33, 64], np.int32)
    pages, table = kc.page_all(caches, block_size, rng)
    a = cupy_piecewise.attention_with_kvcache(q1, q2, *caches, 9, cache_seqlens=seq,
                                              causal=causal, return_lse=True)
    b = cupy_piecewise.attention_with_kvcache(q1, q2, *pages, 9, cache_seqlens=seq,
                                              block_table=table, causal=causal, return_lse=True)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


def test_a_transposed_cache_view_is_the_same_cache():
    """FlashAttention's (B, N, Hkv, D) memory, passed as a (B, Hkv, N, D) view."""
    rng = np.random.default_rng(3)
    q1, q2, caches = _setup(rng)
    seq = np.array([3, 20, 48], np.int32)
    views = [np.ascontiguousarray(c.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for c in caches]
    assert not views[0].flags.c_contiguous
    a = cupy_piecewise.attention_with_kvcache(q1, q2, *caches, 2, cache_seqlens=seq)
    b = cupy_piecewise.attention_with_kvcache(q1, q2, *views, 2, cache_seqlens=seq)
    np.testing.assert_array_equal(a, b)


def test_numpy_results_take_the_input_dtype():
    rng = np.random.default_rng(4)
    q1, q2, caches = _setup(rng)
    f32 = [x.astype(np.float32) for x in (q1, q2, *caches)]
    o, lse = cupy_piecewise.attention_with_kvcache(*f32, 1, cache_seqlens=np.array([1, 2, 3], np.int32),
                                                   return_lse=True)
    assert o.dtype == np.float32 and lse.dtype == np.float32


def test_decode_steps_equal_one_prefill():
    """Appending one token per step and decoding it gives, row for row, what one call with
    all the tokens as queries gives (M rows against the full cache, causal)."""
    rng = np.random.default_rng(5)
    B, H, Hkv, D, N, steps = 2, 2, 1, 16, 32, 6
    q1, q2 = (rng.standard_normal((B, H, steps, D)) for _ in range(2))
    new = [rng.standard_normal((B, Hkv, steps, D)) for _ in range(3)]
    start = np.array([4, 9], np.int32)
    caches = [rng.standard_normal((B, Hkv, N, D)) for _ in range(3)]
    full = [c.copy() for c in caches]
    o_all = cupy_piecewise.attention_with_kvcache(
        q1, q2, *full, 3, cache_seqlens=start, k1_new=new[0], k2_new=new[1], v_new=new[2])
    for t in range(steps):
        o_t = cupy_piecewise.attention_with_kvcache(
            q1[:, :, t:t + 1], q2[:, :, t:t + 1], *caches, 3, cache_seqlens=start + t,
            k1_new=new[0][:, :, t:t + 1], k2_new=new[1][:, :, t:t + 1],
            v_new=new[2][:, :, t:t + 1])
        np.testing.assert_allclose(o_t[:, :, 0], o_all[:, :, t], rtol=1e-12, atol=1e-12)
    for a, b in zip(caches, full):
        np.testing.assert_array_equal(a, b)


torch = pytest.importorskip("torch")


def test_torch_cpu_matches_numpy_and_appends_in_place():
    rng = np.random.default_rng(6)
    q1, q2, caches = _setup(rng, M=3)
    seq = np.array([0, 5, 40], np.int32)
    new = [rng.standard_normal((3, 2, 3, 16)) for _ in range(3)]
    np_caches = [c.copy() for c in caches]
    o_np, lse_np = cupy_piecewise.attention_with_kvcache(
        q1, q2, *np_caches, 2, cache_seqlens=seq, k1_new=new[0], k2_new=new[1], v_new=new[2],
        return_lse=True)
    t_caches = [torch.from_numpy(c.copy()) for c in caches]
    o_t, lse_t = cupy_piecewise.attention_with_kvcache(
        torch.from_numpy(q1), torch.from_numpy(q2), *t_caches, 2,
        cache_seqlens=torch.from_numpy(seq), k1_new=torch.from_numpy(new[0]),
        k2_new=torch.from_numpy(new[1]), v_new=torch.from_numpy(new[2]), return_lse=True)
    np.testing.assert_allclose(o_t.numpy(), o_np, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse_t.numpy(), lse_np, rtol=1e-6)
    assert lse_t.dtype == torch.float32
    for a, b in zip(t_caches, np_caches):
        np.testing.assert_array_equal(a.numpy(), b)


def test_torch_operator_passes_opcheck():
    """The registered operator's schema, fake implementation and declared mutation of the
    caches agree with what it does (torch.library.opcheck, CPU tensors)."""
    from cupy_piecewise import kvcache_torch

    g = torch.Generator().manual_seed(0)
    B, H, Hkv, M, D, N = 2, 4, 2, 2, 16, 32
    q1, q2 = (torch.randn(B, H, M, D, generator=g) for _ in range(2))
    caches = [torch.randn(B, Hkv, N, D, generator=g) for _ in range(3)]
    new = [torch.randn(B, Hkv, M, D, generator=g) for _ in range(3)]
    seq = torch.tensor([3, 17], dtype=torch.int32)
    torch.library.opcheck(kvcache_torch.kvcache_op,
                          (q1, q2, *caches, 4, seq, *new, None, True, 0.25))
    torch.library.opcheck(kvcache_torch.kvcache_op,
                          (q1, q2, *caches, 4, seq, None, None, None, None, False, 0.25))


@pytest.mark.parametrize("change,error,match", [
    (dict(k1_new="only"), ValueError, "come together"),
    (dict(cache_seqlens="int64"), TypeError, "int32"),
    (dict(cache_seqlens="short"), ValueError, r"shape \(B,\)"),
    (dict(k2_cache="shorter"), ValueError, "share one 4-d shape"),
    (dict(q2="other"), ValueError, "share one shape"),
    (dict(block_table="bs8"), ValueError, "multiple of 16"),
    (dict(dist_threshold=1.5), TypeError, "dist_threshold"),
    (dict(causal=1), TypeError, "causal"),
    (dict(sm_scale=-1.0), ValueError, "sm_scale"),
    (dict(cache_seqlens="overflow"), ValueError, "capacity"),
])
def test_bad_arguments_are_refused(change, error, match):
    rng = np.random.default_rng(8)
    q1, q2, caches = _setup(rng)
    kw = dict(cache_seqlens=np.array([1, 2, 3], np.int32))
    args = [q1, q2, *caches, 2]
    c = change
    if c.get("k1_new") == "only":
        kw["k1_new"] = rng.standard_normal((3, 2, 2, 16))
    if c.get("cache_seqlens") == "int64":
        kw["cache_seqlens"] = np.array([1, 2, 3])
    if c.get("cache_seqlens") == "short":
        kw["cache_seqlens"] = np.array([1, 2], np.int32)
    if c.get("cache_seqlens") == "overflow":
        kw["cache_seqlens"] = np.array([1, 2, 47], np.int32)
        kw.update(k1_new=q1[:, :2], k2_new=q1[:, :2], v_new=q1[:, :2])
    if c.get("k2_cache") == "shorter":
        args[3] = caches[1][:, :, :32]
    if c.get("q2") == "other":
        args[1] = q2[:, :, :1]
    if c.get("block_table") == "bs8":
        args[2:5] = [np.zeros((12, 2, 8, 16)) for _ in range(3)]
        kw["block_table"] = np.zeros((3, 6), np.int32)
    if "dist_threshold" in c:
        args[5] = c["dist_threshold"]
    for name in ("causal", "sm_scale"):
        if name in c:
            kw[name] = c[name]
    with pytest.raises(error, match=match):
        cupy_piecewise.attention_with_kvcache(*args, **kw)


def test_checked_call_reports_capacity_and_paging():
    rng = np.random.default_rng(9)
    q1, q2, caches = _setup(rng, N=64)
    pages, table = kc.page_all(caches, 32, rng)
    a = kvcache.check_kvcache_args(q1, q2, *pages, 3, np.zeros(3, np.int32), block_table=table)
    assert a.paged and a.block_size == 32 and a.capacity == 64 and a.Hkv == 2 and a.M == 2
    assert not a.appended and a.causal and a.sm_scale == 0.25


def test_kv_param_layout_matches_the_kernel_struct(nvrtc):
    """KV_FIELDS mirrors KVParams (kernels_cu/kvcache.cu) slot for slot: NVRTC checks the
    size and the offset of every named scalar."""
    from cupy_piecewise.compile import source
    from cupy_piecewise.kvcache_launch import KV_FIELDS

    checks = [f"static_assert(sizeof(KVParams) == {8 * len(KV_FIELDS)}, \"size\");"]
    for i, name in enumerate(KV_FIELDS):
        member = name.split("|")[0]
        checks.append(f"static_assert(offsetof(KVParams, {member}) == {8 * i}, \"{name}\");")
    src = source("kvcache.cu") + "\n#define offsetof(t, m) __builtin_offsetof(t, m)\n" + "\n".join(checks)
    prog = nvrtc.createProgram(src, "kv_layout.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, ["-std=c++17", "-arch=compute_90"])
        except nvrtc.NVRTCError:
            pytest.fail(nvrtc.getProgramLog(prog))
    finally:
        nvrtc.destroyProgram(prog)


def test_torch_any_integer_w_and_torch_compile():
    """w beyond int64 reaches the operator clamped (same result as the largest useful w),
    and torch.compile(fullgraph=True) runs the call through the operator's fake
    implementation with the same result as eager."""
    g = torch.Generator().manual_seed(1)
    B, H, Hkv, M, D, N = 2, 4, 2, 1, 16, 32
    q1, q2 = (torch.randn(B, H, M, D, generator=g) for _ in range(2))
    caches = [torch.randn(B, Hkv, N, D, generator=g) for _ in range(3)]
    seq = torch.tensor([5, 30], dtype=torch.int32)
    huge = cupy_piecewise.attention_with_kvcache(q1, q2, *caches, 2 ** 70, cache_seqlens=seq)
    far = cupy_piecewise.attention_with_kvcache(q1, q2, *caches, N + 5, cache_seqlens=seq)
    assert torch.equal(huge, far)
    fn = torch.compile(lambda *a: cupy_piecewise.attention_with_kvcache(
        *a, 3, cache_seqlens=seq, return_lse=True), fullgraph=True, backend="eager")
    o_c, lse_c = fn(q1, q2, *caches)
    o_e, lse_e = cupy_piecewise.attention_with_kvcache(q1, q2, *caches, 3, cache_seqlens=seq,
                                                       return_lse=True)
    assert torch.equal(o_c, o_e) and torch.equal(lse_c, lse_e)


def test_negative_lengths_are_refused_on_the_host_paths():
    rng = np.random.default_rng(10)
    q1, q2, caches = _setup(rng)
    with pytest.raises(ValueError, match="capacity"):
        cupy_piecewise.attention_with_kvcache(q1, q2, *caches, 2,
                                              cache_seqlens=np.array([1, -1, 3], np.int32))


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("entry", [-1, 99])
def test_a_used_block_table_entry_outside_the_pages_is_refused_before_any_write(lib, entry):
    """Paged host paths: a used entry that names no page raises ValueError naming
    block_table, and the caches are unchanged (no partial append); garbage in entries past
    a sequence's last used block is never read."""
    rng = np.random.default_rng(11)
    B, H, Hkv, M, D = 2, 2, 1, 2, 16
    q1, q2 = (rng.standard_normal((B, H, M, D)) for _ in range(2))
    pages = [rng.standard_normal((4, Hkv, 16, D)) for _ in range(3)]
    new = [rng.standard_normal((B, Hkv, M, D)) for _ in range(3)]
    seq = np.array([15, 3], np.int32)  # sequence 0's append spills into its second block
    table = np.array([[0, entry], [2, entry]], np.int32)  # sequence 1 uses only block 0
    conv = (lambda x: torch.from_numpy(x)) if lib == "torch" else (lambda x: x)
    if lib == "torch":
        pytest.importorskip("torch")
    work = [conv(p.copy()) for p in pages]
    with pytest.raises(ValueError, match=r"block_table\[0\] uses page"):
        cupy_piecewise.attention_with_kvcache(
            conv(q1), conv(q2), *work, 3, cache_seqlens=conv(seq), block_table=conv(table),
            k1_new=conv(new[0]), k2_new=conv(new[1]), v_new=conv(new[2]))
    for w_, p in zip(work, pages):
        np.testing.assert_array_equal(np.asarray(w_), p)
    # sequence 0 now fits its first block: entry 1 of both rows is unused garbage
    seq = np.array([13, 3], np.int32)
    o = cupy_piecewise.attention_with_kvcache(
        conv(q1), conv(q2), *work, 3, cache_seqlens=conv(seq), block_table=conv(table),
        k1_new=conv(new[0]), k2_new=conv(new[1]), v_new=conv(new[2]))
    assert np.isfinite(np.asarray(o)).all()


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", ["int32", "bool", "complex128"])
def test_non_float_dtypes_are_refused(lib, dtype):
    if lib == "torch":
        pytest.importorskip("torch")
    q = np.ones((1, 1, 1, 16), dtype)
    c = np.ones((1, 1, 8, 16), dtype)
    conv = (lambda x: torch.from_numpy(x)) if lib == "torch" else (lambda x: x)
    with pytest.raises(TypeError, match="q1 has dtype"):
        cupy_piecewise.attention_with_kvcache(conv(q), conv(q), conv(c), conv(c), conv(c), 0,
                                              cache_seqlens=conv(np.array([3], np.int32)))


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_head_dim_zero_is_refused_naming_q1(lib):
    if lib == "torch":
        pytest.importorskip("torch")
    conv = (lambda x: torch.from_numpy(x)) if lib == "torch" else (lambda x: x)
    q = np.ones((1, 1, 1, 0))
    c = np.ones((1, 1, 8, 0))
    with pytest.raises(ValueError, match="q1 has head_dim 0"):
        cupy_piecewise.attention_with_kvcache(conv(q), conv(q), conv(c), conv(c), conv(c), 0,
                                              cache_seqlens=conv(np.array([3], np.int32)))


def test_torch_new_keys_that_are_not_tensors_are_refused_by_name():
    torch = pytest.importorskip("torch")
    q = torch.ones(1, 1, 1, 16, dtype=torch.float64)
    c = [torch.ones(1, 1, 8, 16, dtype=torch.float64) for _ in range(3)]
    with pytest.raises(TypeError, match="k1_new"):
        cupy_piecewise.attention_with_kvcache(
            q, q, *c, 0, cache_seqlens=torch.tensor([3], dtype=torch.int32),
            k1_new=np.ones((1, 1, 1, 16)), k2_new=q, v_new=q)


def test_a_paged_cache_without_pages_attends_nothing():
    q = np.ones((2, 1, 1, 16))
    pages = [np.ones((0, 1, 16, 16)) for _ in range(3)]
    o, lse = cupy_piecewise.attention_with_kvcache(
        q, q, *pages, 0, cache_seqlens=np.zeros(2, np.int32),
        block_table=np.zeros((2, 0), np.int32), return_lse=True)
    assert (o == 0).all() and np.isneginf(lse).all()


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_an_expanded_cache_is_refused_when_new_keys_are_written(lib):
    """A stride-0 (broadcast) cache axis would alias rows: refused naming the cache on
    every path, not only on the GPU."""
    if lib == "torch":
        torch = pytest.importorskip("torch")
        row = torch.ones(1, 1, 1, 16, dtype=torch.float64)
        cache = row.expand(1, 1, 8, 16)
        conv = torch.from_numpy
    else:
        cache = np.lib.stride_tricks.as_strided(np.ones(16), (1, 1, 8, 16), (0, 0, 0, 8),
                                                writeable=True)
        conv = lambda x: x  # noqa: E731
    q = conv(np.ones((1, 1, 1, 16)))
    fresh = [conv(np.ones((1, 1, 8, 16))) for _ in range(2)]
    with pytest.raises(ValueError, match="k1_cache: new keys are written"):
        cupy_piecewise.attention_with_kvcache(
            q, q, cache, *fresh, 0, cache_seqlens=conv(np.array([3], np.int32)),
            k1_new=q, k2_new=q, v_new=q)
