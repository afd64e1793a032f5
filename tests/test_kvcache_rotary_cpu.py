"""attention_with_rotary_kvcache on the host (NumPy, torch CPU): the reference semantics
against rotations written independently here (complex multiplication, angles from the
frequencies rather than the tables), the ReRoPE and SelfExtend recipes against attention
scored from clipped or grouped relative positions directly, the in-place append, paged
caches, the torch operator, and bad arguments refused with their names."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import kvcache_cases as kc  # noqa: E402

import cupy_piecewise as cpw  # noqa: E402
from cupy_piecewise import kvcache_rotary as kr  # noqa: E402


def _freqs(D, base=10000.0):
    return base ** (-np.arange(D // 2) / (D // 2))


def _tables(positions, D, dtype=np.float64):
    ang = np.arange(positions)[:, None] * _freqs(D)
    return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)


def _rotate_complex(x, angles, interleaved, factor=None):
    """x (..., n, D) rotated by ``angles`` (n, D/2) radians, pair i by angle i, through
    complex numbers: the pair (a, b) is a + ib, times e^{i angle} (or times ``factor``,
    (n, D/2) complex, when given: e.g. a table's cos + i sin)."""
    x = np.asarray(x, np.float64)
    h = x.shape[-1] // 2
    z = (x[..., 0::2] + 1j * x[..., 1::2]) if interleaved else (x[..., :h] + 1j * x[..., h:])
    z = z * (np.exp(1j * angles) if factor is None else factor)
    out = np.empty_like(x)
    if interleaved:
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
    else:
        out[..., :h], out[..., h:] = z.real, z.imag
    return out


def _setup(rng, B=3, H=4, Hkv=2, M=2, N=48, D=16):
    q1, q2 = (rng.standard_normal((B, H, M, D)) for _ in range(2))
    k, v = (rng.standard_normal((B, Hkv, N, D)) for _ in range(2))
    return q1, q2, k, v


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("groups", [(1, None), (1, 4), (None, 3), (2, 1)])
@pytest.mark.parametrize("appended", [False, True])
def test_reference_equals_attention_on_independently_rotated_caches(interleaved, groups,
                                                                     appended):
    rng = np.random.default_rng(7)
    B, H, Hkv, M, N, D = 3, 4, 2, 2, 48, 16
    q1, q2, k, v = _setup(rng, B, H, Hkv, M, N, D)
    cos, sin = _tables(N, D)
    seq = np.array([0, 17, N - M if appended else N], np.int32)
    new = [rng.standard_normal((B, Hkv, M, D)) for _ in range(2)] if appended else None
    full_k, full_v = k.copy(), v.copy()
    if appended:
        for b in range(B):
            full_k[b, :, seq[b]:seq[b] + M] = new[0][b]
            full_v[b, :, seq[b]:seq[b] + M] = new[1][b]
    n = np.arange(N)
    k12 = [full_k if g is None else
           _rotate_complex(full_k, (n // g)[:, None] * _freqs(D), interleaved) for g in groups]
    want = kc.dense(q1, q2, k12[0], k12[1], full_v, 5, seq, M if appended else 0, True,
                    1 / np.sqrt(D))
    kw = dict(k_new=new[0], v_new=new[1]) if appended else {}
    kcache, vcache = k.copy(), v.copy()
    o, lse = cpw.attention_with_rotary_kvcache(
        q1, q2, kcache, vcache, 5, cos=cos, sin=sin, cache_seqlens=seq, k1_group_size=groups[0],
        k2_group_size=groups[1], interleaved=interleaved, return_lse=True, **kw)
    np.testing.assert_allclose(o, want[0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, want[1].astype(np.float32), rtol=1e-6)
    np.testing.assert_array_equal(kcache, full_k)  # the raw keys, appended in place
    np.testing.assert_array_equal(vcache, full_v)


def _attend_by_angle(q, k, v, angle_of, sm_scale):
    """Causal attention of the last M positions of each sequence to keys 0 .. L-1, the
    score of query position i and key j being q_i . R(-angle_of(i, j)) k_j, where R(a)
    rotates pair p by a times its frequency (R(i) q . R(j) k = q . R(j - i) k)."""
    B, H, M, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = H // Hkv
    f = _freqs(D)
    o = np.zeros((B, H, M, D))
    for b in range(B):
        for h in range(H):
            for t in range(M):
                i = L - M + t
                s = np.full(L, -np.inf)
                for j in range(i + 1):
                    kj = _rotate_complex(k[b, h // G, j][None], -angle_of(i, j) * f[None], False)[0]
                    s[j] = sm_scale * q[b, h, t] @ kj
                p = np.exp(s - s.max())
                o[b, h, t] = p @ v[b, h // G] / p.sum()
    return o


def test_rerope_recipe_scores_relative_positions_clipped_at_w():
    """ReRoPE: q1 at the query's position, q2 at w, k1 at the key's position, k2 raw. The
    score of a pair at distance d is then q . R(-min(d, w)) k (R(a): the rotation by a times
    each pair's frequency): relative positions clipped at w, from the angles directly."""
    rng = np.random.default_rng(11)
    B, H, Hkv, M, L, D, w = 2, 4, 2, 3, 40, 16, 9
    q, _, k, v = _setup(rng, B, H, Hkv, M, L, D)
    cos, sin = _tables(L, D)
    pos = np.arange(L - M, L)
    q1 = cpw.apply_rotary(q, cos, sin, pos)
    q2 = cpw.apply_rotary(q, cos, sin, np.full(M, w))
    got = cpw.attention_with_rotary_kvcache(q1, q2, k, v, w, cos=cos, sin=sin,
                                            cache_seqlens=np.full(B, L, np.int32))
    want = _attend_by_angle(q, k, v, lambda i, j: min(i - j, w), 1 / np.sqrt(D))
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11)


def test_selfextend_recipe_scores_grouped_positions_beyond_the_window():
    """SelfExtend with group G and window w: q2 at i // G + w - w // G, k2 at j // G; pairs at
    distance d >= w score with the grouped distance i // G - j // G + w - w // G."""
    rng = np.random.default_rng(12)
    B, H, Hkv, M, L, D, w, G = 2, 2, 1, 2, 50, 32, 12, 4
    q, _, k, v = _setup(rng, B, H, Hkv, M, L, D)
    cos, sin = _tables(L, D)
    pos = np.arange(L - M, L)
    q1 = cpw.apply_rotary(q, cos, sin, pos)
    q2 = cpw.apply_rotary(q, cos, sin, pos // G + w - w // G)
    got = cpw.attention_with_rotary_kvcache(q1, q2, k, v, w, cos=cos, sin=sin,
                                            cache_seqlens=np.full(B, L, np.int32),
                                            k2_group_size=G)
    want = _attend_by_angle(
        q, k, v, lambda i, j: i - j if i - j < w else i // G - j // G + w - w // G,
        1 / np.sqrt(D))
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_equals_contiguous(block_size):
    rng = np.random.default_rng(13)
    q1, q2, k, v = _setup(rng, N=64)
    cos, sin = _tables(64, 16)
    seq = np.array([3, 40, 64], np.int32)
    kw = dict(cos=cos, sin=sin, cache_seqlens=seq, k2_group_size=2, interleaved=True,
              return_lse=True)
    want = cpw.attention_with_rotary_kvcache(q1, q2, k, v, 6, **kw)
    (kp, vp), table = kc.page_all([k, v], block_size, rng)
    got = cpw.attention_with_rotary_kvcache(q1, q2, kp, vp, 6, block_table=table, **kw)
    for g, w_ in zip(got, want):
        np.testing.assert_array_equal(g, w_)


def test_decode_steps_append_raw_keys_once():
    """Ten decode steps that append one raw key each leave the cache holding the raw keys
    (no projection written) and give the one-shot call's rows."""
    rng = np.random.default_rng(14)
    B, H, Hkv, D, N, start, steps = 2, 2, 1, 16, 32, 5, 10
    cos, sin = _tables(N, D)
    q = rng.standard_normal((B, H, steps, D))
    keys, vals = (rng.standard_normal((B, Hkv, start + steps, D)) for _ in range(2))
    kc_, vc_ = np.zeros((B, Hkv, N, D)), np.zeros((B, Hkv, N, D))
    kc_[:, :, :start], vc_[:, :, :start] = keys[:, :, :start], vals[:, :, :start]
    outs = []
    for t in range(steps):
        seq = np.full(B, start + t, np.int32)
        outs.append(cpw.attention_with_rotary_kvcache(
            q[:, :, t:t + 1], q[:, :, t:t + 1], kc_, vc_, 4, cos=cos, sin=sin,
            cache_seqlens=seq, k_new=keys[:, :, start + t:start + t + 1],
            v_new=vals[:, :, start + t:start + t + 1]))
    np.testing.assert_array_equal(kc_[:, :, :start + steps], keys)
    full = cpw.attention_with_rotary_kvcache(q, q, keys, vals, 4, cos=cos, sin=sin,
                                             cache_seqlens=np.full(B, start + steps, np.int32))
    np.testing.assert_allclose(np.concatenate(outs, axis=2), full, rtol=1e-12, atol=1e-14)


def test_torch_cpu_matches_numpy_and_appends_in_place():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(15)
    q1, q2, k, v = _setup(rng)
    cos, sin = _tables(48, 16)
    seq = np.array([0, 9, 46], np.int32)
    new = [rng.standard_normal((3, 2, 2, 16)) for _ in range(2)]
    kn, vn = k.copy(), v.copy()
    want = cpw.attention_with_rotary_kvcache(q1, q2, kn, vn, 3, cos=cos, sin=sin,
                                             cache_seqlens=seq, k_new=new[0], v_new=new[1],
                                             k2_group_size=4, return_lse=True)
    t = [torch.from_numpy(x.copy()) for x in (q1, q2, k, v)]
    got = cpw.attention_with_rotary_kvcache(
        t[0], t[1], t[2], t[3], 3, cos=torch.from_numpy(cos), sin=torch.from_numpy(sin),
        cache_seqlens=torch.from_numpy(seq), k_new=torch.from_numpy(new[0]),
        v_new=torch.from_numpy(new[1]), k2_group_size=4, return_lse=True)
    np.testing.assert_allclose(got[0].numpy(), want[0], rtol=1e-12)
    np.testing.assert_allclose(got[1].numpy(), want[1], rtol=1e-6)
    np.testing.assert_array_equal(t[2].numpy(), kn)
    np.testing.assert_array_equal(t[3].numpy(), vn)


def test_torch_operator_passes_opcheck():
    torch = pytest.importorskip("torch")
    from cupy_piecewise import kvcache_torch

    rng = np.random.default_rng(16)
    q1, q2, k, v = (torch.from_numpy(x) for x in _setup(rng, N=32))
    cos, sin = (torch.from_numpy(x) for x in _tables(32, 16))
    seq = torch.tensor([2, 10, 30], dtype=torch.int32)
    kn, vn = (torch.from_numpy(rng.standard_normal((3, 2, 2, 16))) for _ in range(2))
    torch.library.opcheck(kvcache_torch.rotary_kvcache_op,
                          (q1, q2, k, v, 4, cos, sin, seq, kn, vn, None, 1, 2, False, True, 0.25))


def _good(rng):
    q1, q2, k, v = _setup(rng, N=32)
    cos, sin = _tables(32, 16)
    return dict(q1=q1, q2=q2, k_cache=k, v_cache=v, dist_threshold=4, cos=cos, sin=sin,
                cache_seqlens=np.array([1, 2, 3], np.int32))


BAD = [
    (dict(cos="tables"), TypeError, "cos"),
    (dict(cos=np.zeros((32, 16))), ValueError, "cos and sin must share one shape"),
    (dict(cos=np.zeros((32, 16)), sin=np.zeros((32, 16))), ValueError, r"\(positions, 8\)"),
    (dict(cos=np.zeros((31, 8)), sin=np.zeros((31, 8))), ValueError, "k1_group_size=1 reaches position 31"),
    (dict(k1_group_size=0), ValueError, "k1_group_size"),
    (dict(k2_group_size=True), TypeError, "k2_group_size"),
    (dict(k2_group_size=2.0), TypeError, "k2_group_size"),
    (dict(interleaved=1), TypeError, "interleaved"),
    (dict(k_new=np.zeros((3, 2, 2, 16))), ValueError, "v_new missing"),
    (dict(v_cache=np.zeros((3, 2, 32, 8))), ValueError, "k_cache and v_cache must share"),
    (dict(cos=np.zeros((32, 8), np.int32), sin=np.zeros((32, 8), np.int32)), TypeError,
     "floating point"),
    (dict(dist_threshold=1.5), TypeError, "dist_threshold"),
]


@pytest.mark.parametrize("change,error,match", BAD, ids=[m for _, _, m in BAD])
def test_bad_arguments_are_refused(change, error, match):
    kw = _good(np.random.default_rng(17))
    kw.update(change)
    args = [kw.pop(n) for n in ("q1", "q2", "k_cache", "v_cache", "dist_threshold")]
    with pytest.raises(error, match=match):
        cpw.attention_with_rotary_kvcache(*args, **kw)


def test_kvcache_messages_name_the_single_key_cache():
    kw = _good(np.random.default_rng(18))
    kw["k_cache"] = kw["k_cache"].astype(np.float32)
    args = [kw.pop(n) for n in ("q1", "q2", "k_cache", "v_cache", "dist_threshold")]
    with pytest.raises(TypeError, match=r"^k_cache has dtype float32"):
        cpw.attention_with_rotary_kvcache(*args, **kw)


def test_mixed_libraries_are_refused():
    torch = pytest.importorskip("torch")
    kw = _good(np.random.default_rng(19))
    kw["cos"] = torch.from_numpy(kw["cos"])
    args = [kw.pop(n) for n in ("q1", "q2", "k_cache", "v_cache", "dist_threshold")]
    with pytest.raises(TypeError, match="cos is a torch array but q1 is a numpy array"):
        cpw.attention_with_rotary_kvcache(*args, **kw)


def test_apply_rotary_matches_complex_rotation_and_refuses_bad_tables():
    rng = np.random.default_rng(20)
    x = rng.standard_normal((2, 5, 12))
    cos, sin = _tables(9, 12)
    pos = np.array([0, 3, 8, 8, 1])
    for inter in (False, True):
        np.testing.assert_allclose(cpw.apply_rotary(x, cos, sin, pos, inter),
                                   _rotate_complex(x, pos[:, None] * _freqs(12), inter),
                                   rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="apply_rotary"):
        cpw.apply_rotary(x, cos[:, :5], sin[:, :5], pos)
    with pytest.raises(ValueError, match="head dim must be even, got 11"):
        cpw.apply_rotary(x[..., :11], cos, sin, pos)
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 9\)"):
        cpw.apply_rotary(x, cos, sin, np.array([0, 3, 9, 8, 1]))
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 9\)"):
        cpw.apply_rotary(x, cos, sin, np.array([0, -1, 2, 8, 1]))
    with pytest.raises(ValueError, match=r"positions must be \(5,\) integers"):
        cpw.apply_rotary(x, cos, sin, pos[:4])
    with pytest.raises(ValueError, match=r"positions must be \(5,\) integers"):
        cpw.apply_rotary(x, cos, sin, pos.astype(float))


def test_the_gpu_tests_host_code_runs_on_numpy():
    """tests/test_kvcache_rotary_gpu.py's reference and stale-row tests, dry-run with NumPy
    standing in for CuPy (scripts/dry_run_gpu_tests.py): their inputs, paging, yardstick and
    tolerance calls run here, so a mistake in the tests themselves shows before a device
    call. The kernels are not involved (the calls take the NumPy reference path)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run(
        [sys.executable, "scripts/dry_run_gpu_tests.py", "tests/test_kvcache_rotary_gpu.py",
         "-k", "matches_reference or never_reads"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "110 passed" in run.stdout, run.stdout[-1000:]


def test_torch_compile_runs_through_the_fake_and_large_w_is_clamped():
    """torch.compile(fullgraph=True) traces the rotary call through the operator's fake
    implementation with eager's result, and a w beyond int64 reaches the operator clamped
    (the largest useful w's result)."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(2)
    B, H, Hkv, M, D, N = 2, 4, 2, 1, 16, 32
    q1, q2 = (torch.randn(B, H, M, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, Hkv, N, D, generator=g, dtype=torch.float64) for _ in range(2))
    cos, sin = (torch.from_numpy(t) for t in _tables(N, D))
    seq = torch.tensor([5, 30], dtype=torch.int32)
    kw = dict(cos=cos, sin=sin, cache_seqlens=seq, k2_group_size=4)
    huge = cpw.attention_with_rotary_kvcache(q1, q2, k, v, 2 ** 70, **kw)
    far = cpw.attention_with_rotary_kvcache(q1, q2, k, v, N + 5, **kw)
    assert torch.equal(huge, far)
    fn = torch.compile(lambda *a: cpw.attention_with_rotary_kvcache(*a, 3, return_lse=True, **kw),
                       fullgraph=True, backend="eager")
    o_c, lse_c = fn(q1, q2, k, v)
    o_e, lse_e = cpw.attention_with_rotary_kvcache(q1, q2, k, v, 3, return_lse=True, **kw)
    assert torch.equal(o_c, o_e) and torch.equal(lse_c, lse_e)
