"""The float64 NumPy reference against an independent dense torch float64 implementation
(autograd for the gradients), against central finite differences, its memory bound, and
the low-precision "lowp" implementation used by the tolerance rule.  CPU only."""

import math
import tracemalloc
import warnings

import numpy as np
import pytest
import torch

from cupy_piecewise import reference as R

REL = 1e-10


# --------------------------------------------------------------------------- helpers

def fresh_seed():
    return int(np.random.SeedSequence().entropy % (2**63))


def make_inputs(rng, B, H, Hkv, M, N, D, dtype=np.float64):
    """Fresh inputs: N(0, 1) times a per-tensor scale of 0.5 to 3 std, never zeros."""
    def draw(*shape):
        a = rng.standard_normal(shape) * rng.uniform(0.5, 3.0)
        a[a == 0] = 0.5
        return a.astype(dtype)
    q1, q2 = draw(B, H, M, D), draw(B, H, M, D)
    k1, k2, v = draw(B, Hkv, N, D), draw(B, Hkv, N, D), draw(B, Hkv, N, D)
    do = draw(B, H, M, D)
    return q1, k1, q2, k2, v, do


def torch_dense(q1, k1, q2, k2, v, w, causal, scale):
    """Independent dense implementation: two full score matrices, torch.where on d >= w."""
    B, H, M, D = q1.shape
    Hkv, N = k1.shape[1], k1.shape[2]
    rep = H // Hkv
    k1e, k2e, ve = (t.repeat_interleave(rep, dim=1) for t in (k1, k2, v))
    i = torch.arange(M, dtype=torch.float64)[:, None]
    j = torch.arange(N, dtype=torch.float64)[None, :]
    d = i + (N - M) - j                              # exact in float64; w may be huge
    s1 = scale * (q1 @ k1e.transpose(-1, -2))
    s2 = scale * (q2 @ k2e.transpose(-1, -2))
    s = torch.where(d >= float(w), s2, s1)
    if causal:
        s = s.masked_fill(d < 0, float("-inf"))
    empty = torch.isneginf(s).all(dim=-1)            # also True for every row when N == 0
    s_safe = s.masked_fill(empty[..., None], 0.0)    # keeps softmax and its gradient finite
    p = torch.softmax(s_safe, dim=-1) * (~empty)[..., None].to(s.dtype)
    o = p @ ve
    lse = torch.logsumexp(s_safe, dim=-1).masked_fill(empty, float("-inf"))
    return o, lse


def torch_grads(q1, k1, q2, k2, v, do, w, causal, scale):
    ts = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (q1, k1, q2, k2, v)]
    o, lse = torch_dense(*ts, w, causal, scale)
    grads = torch.autograd.grad(o, ts, torch.tensor(do), allow_unused=True)
    grads = [np.zeros(t.shape) if g is None else g.numpy() for g, t in zip(grads, ts)]
    return o.detach().numpy(), lse.detach().numpy(), grads


def assert_rel(name, got, want, rel=REL, msg=""):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape} {msg}"
    assert got.dtype == np.float64, f"{name}: dtype {got.dtype} {msg}"
    nf = ~np.isfinite(want)
    assert np.array_equal(got[nf], want[nf]), f"{name}: non-finite entries differ {msg}"
    assert np.isfinite(got[~nf]).all(), f"{name}: NaN/Inf where expected finite {msg}"
    err = np.linalg.norm(got[~nf] - want[~nf])
    ref = np.linalg.norm(want[~nf])
    # Absolute floor for mathematically-zero results that carry roundoff (e.g. N == 1,
    # where ds = dp - delta cancels exactly in exact arithmetic).
    floor = 1e-12 * math.sqrt(max(1, want.size))
    assert err <= rel * ref + floor, \
        f"{name}: ||err||={err:.3e}, ||ref||={ref:.3e}, rel {err / max(ref, 1e-300):.3e} {msg}"


def run_reference(args, w, causal, scale, chunk_rows):
    q1, k1, q2, k2, v, do = args
    with warnings.catch_warnings(), np.errstate(divide="raise", invalid="raise", over="raise"):
        warnings.simplefilter("error")
        o, lse = R.forward(q1, k1, q2, k2, v, w, causal, scale, chunk_rows=chunk_rows)
        grads = R.backward(q1, k1, q2, k2, v, o, lse, do, w, causal, scale,
                           chunk_rows=chunk_rows)
    return o, lse, grads


def resolve_w(spec, M, N, rng):
    """Distances lie in [1 - M, N - 1]."""
    lo, hi = 1 - M, N - 1
    if spec == "below":
        return lo - 7 if M + N > 0 else -7
    if spec == "above":
        return N + 5                                 # beyond every distance (w > N)
    if spec == "inside":
        return int(rng.integers(lo, hi + 1)) if hi >= lo else 0
    if spec == "neg":
        return int(rng.integers(min(lo, -1), 0))
    if spec == "on0":
        return 0                                     # the diagonal d == 0
    if spec == "onP":
        return N - M                                 # d(0, 0) = P
    if spec == "onMax":
        return hi                                    # exactly the largest distance
    if spec == "onMin":
        return lo                                    # exactly the smallest distance
    if spec == "huge":
        return 10**20
    if spec == "hugeneg":
        return -(10**20)
    raise ValueError(spec)


# (B, H, Hkv, M, N, D, causal, w)
CASES = [
    (1, 1, 1, 5, 7, 8, False, "inside"),
    (1, 1, 1, 5, 7, 8, True, "inside"),
    (2, 2, 1, 6, 6, 16, False, "below"),
    (2, 2, 1, 6, 6, 16, True, "below"),
    (1, 2, 2, 6, 6, 8, False, "above"),
    (1, 2, 2, 6, 6, 8, True, "above"),
    (1, 4, 1, 9, 5, 8, True, "inside"),      # M > N causal: empty rows
    (1, 4, 1, 9, 5, 8, False, "inside"),
    (1, 4, 2, 9, 5, 16, True, "neg"),
    (1, 2, 1, 4, 9, 8, False, "neg"),        # negative w without causal
    (1, 2, 1, 4, 9, 8, False, "on0"),
    (1, 2, 1, 4, 9, 8, True, "on0"),
    (1, 1, 1, 1, 9, 8, False, "inside"),     # M == 1
    (1, 1, 1, 1, 9, 8, True, "inside"),
    (1, 2, 2, 7, 1, 8, False, "on0"),        # N == 1
    (1, 2, 2, 7, 1, 8, True, "on0"),         # N == 1, causal: empty rows
    (1, 1, 1, 1, 1, 1, False, "on0"),
    (1, 1, 1, 1, 1, 1, True, "below"),
    (1, 2, 1, 0, 5, 8, False, "inside"),     # M == 0
    (1, 2, 1, 0, 5, 8, True, "inside"),
    (1, 2, 1, 5, 0, 8, False, "inside"),     # N == 0
    (1, 2, 1, 5, 0, 8, True, "inside"),
    (2, 4, 4, 11, 13, 1, True, "inside"),    # D == 1
    (2, 4, 2, 13, 11, 1, False, "onP"),
    (1, 4, 1, 16, 16, 16, True, "onP"),
    (1, 4, 4, 16, 16, 16, False, "huge"),
    (1, 2, 1, 10, 20, 8, True, "hugeneg"),
    (1, 2, 1, 20, 10, 8, True, "neg"),       # M > N causal, negative w
    (1, 1, 1, 3, 12, 16, False, "above"),
    (1, 2, 2, 12, 3, 16, True, "above"),
    (3, 2, 1, 8, 8, 8, True, "inside"),
    (1, 4, 2, 17, 23, 8, False, "inside"),
    (1, 4, 2, 23, 17, 16, True, "inside"),
    (1, 1, 1, 8, 8, 8, False, "onMax"),
    (1, 1, 1, 8, 8, 8, True, "onMin"),
    (1, 2, 1, 6, 10, 8, False, "onMin"),
    # the head dims issue 12 added to the CUDA kernels: 80, 96, 256
    (1, 2, 1, 9, 14, 80, True, "inside"),
    (2, 2, 2, 7, 7, 96, False, "onP"),
    (1, 2, 1, 5, 11, 256, True, "inside"),
]


def _case_id(c):
    B, H, Hkv, M, N, D, causal, w = c
    return f"B{B}H{H}kv{Hkv}M{M}N{N}D{D}{'c' if causal else ''}-{w}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_reference_matches_torch(case):
    B, H, Hkv, M, N, D, causal, wspec = case
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    args = make_inputs(rng, B, H, Hkv, M, N, D)
    w = resolve_w(wspec, M, N, rng)
    scale = None if rng.random() < 0.5 else float(rng.uniform(0.05, 0.5))
    scale_t = 1.0 / math.sqrt(D) if scale is None else scale
    msg = f"(seed={seed}, w={w}, sm_scale={scale})"

    o, lse, grads = run_reference(args, w, causal, scale, None)
    o_t, lse_t, grads_t = torch_grads(*args, w, causal, scale_t)

    assert o.shape == (B, H, M, D) and lse.shape == (B, H, M), msg
    for name, shape, g in zip(("dq1", "dk1", "dq2", "dk2", "dv"),
                              [(B, H, M, D), (B, Hkv, N, D)] * 2 + [(B, Hkv, N, D)], grads):
        assert g.shape == shape, f"{name}: {g.shape} != {shape} {msg}"
    assert_rel("o", o, o_t, msg=msg)
    assert_rel("lse", lse, lse_t, msg=msg)
    for name, g, gt in zip(("dq1", "dk1", "dq2", "dk2", "dv"), grads, grads_t):
        assert_rel(name, g, gt, msg=msg)

    # Rows with no admissible key: zeros / -inf in both paths, nothing in the gradients.
    rows = np.arange(M)
    empty = (rows + N - M < 0) if causal else np.full(M, N == 0)
    if empty.any():
        for arr in (o, o_t, grads[0], grads[2], grads_t[0], grads_t[2]):
            assert np.all(arr[:, :, empty] == 0), msg
        assert np.all(np.isneginf(lse[:, :, empty])), msg
        assert np.all(np.isneginf(lse_t[:, :, empty])), msg
    assert np.all(np.isfinite(lse[:, :, ~empty])), msg

    # A small chunk gives the same results (up to summation order across chunks).
    o3, lse3, grads3 = run_reference(args, w, causal, scale, 3)
    assert_rel("o(chunk=3)", o3, o, rel=1e-13, msg=msg)
    assert_rel("lse(chunk=3)", lse3, lse, rel=1e-13, msg=msg)
    for name, g3, g in zip(("dq1", "dk1", "dq2", "dk2", "dv"), grads3, grads):
        assert_rel(name + "(chunk=3)", g3, g, rel=1e-12, msg=msg)


def test_chunk_rows_forward():
    """Forward rows do not mix, so any chunking agrees to rounding (BLAS picks different
    kernels for different block shapes, so results are not bit-identical)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    q1, k1, q2, k2, v, do = make_inputs(rng, 1, 2, 1, 37, 41, 8)
    base = R.forward(q1, k1, q2, k2, v, 5, True)
    for c in (1, 3, 7, 36, 37, 1000):
        got = R.forward(q1, k1, q2, k2, v, 5, True, chunk_rows=c)
        for a, b in zip(got, base):
            assert_rel(f"chunk_rows={c}", a, b, rel=1e-13, msg=f"seed={seed}")


def test_torch_empty_rows_are_zero():
    """The torch path itself gives zeros (no NaN) for rows without a key."""
    rng = np.random.default_rng(fresh_seed())
    args = make_inputs(rng, 1, 1, 1, 6, 2, 4)
    o_t, lse_t, grads_t = torch_grads(*args, 1, True, 0.5)
    assert np.all(o_t[:, :, :4] == 0) and np.all(np.isneginf(lse_t[:, :, :4]))
    assert all(np.isfinite(g).all() for g in grads_t)


def test_inputs_not_modified_and_dtypes():
    rng = np.random.default_rng(fresh_seed())
    args = make_inputs(rng, 1, 2, 1, 5, 6, 8, dtype=np.float32)
    copies = [a.copy() for a in args]
    o, lse, grads = run_reference(args, 2, True, None, None)
    assert o.dtype == lse.dtype == np.float64
    assert all(g.dtype == np.float64 for g in grads)
    for a, c in zip(args, copies):
        np.testing.assert_array_equal(a, c)


# --------------------------------------------------------------------------- finite differences

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("w,M,N", [(-1, 3, 4), (1, 3, 4), (2, 3, 4), (0, 5, 3)])
def test_finite_differences(w, M, N, causal):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    B, H, Hkv, D = 1, 2, 1, 3
    q1, k1, q2, k2, v, _ = make_inputs(rng, B, H, Hkv, M, N, D)
    inputs = [q1, k1, q2, k2, v]
    g = rng.standard_normal((B, H, M, D))

    def loss(xs):
        o, _ = R.forward(*xs, w, causal)
        return float(np.sum(o * g))

    o, lse = R.forward(*inputs, w, causal)
    grads = R.backward(*inputs, o, lse, g, w, causal)
    eps = 1e-6
    for name, idx, an in zip(("q1", "k1", "q2", "k2", "v"), range(5), grads):
        fd = np.zeros_like(inputs[idx])
        for pos in np.ndindex(*inputs[idx].shape):
            xs = [x.copy() for x in inputs]
            xs[idx][pos] += eps
            up = loss(xs)
            xs[idx][pos] -= 2 * eps
            dn = loss(xs)
            fd[pos] = (up - dn) / (2 * eps)
        np.testing.assert_allclose(an, fd, rtol=1e-5, atol=1e-6,
                                   err_msg=f"d{name} (seed={seed}, w={w}, causal={causal})")


# --------------------------------------------------------------------------- memory

def test_memory_bounded():
    rng = np.random.default_rng(fresh_seed())
    M = N = 4096
    D = 64
    q1, k1, q2, k2, v, do = make_inputs(rng, 1, 1, 1, M, N, D)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        o, lse = R.forward(q1, k1, q2, k2, v, N // 4, True)
        grads = R.backward(q1, k1, q2, k2, v, o, lse, do, N // 4, True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 400 * 2**20, f"peak {peak / 2**20:.0f} MiB"
    assert np.isfinite(o).all() and all(np.isfinite(gr).all() for gr in grads)


# --------------------------------------------------------------------------- lowp

def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    f = np.isfinite(b)
    assert np.array_equal(a[~f], b[~f])
    return np.linalg.norm(a[f] - b[f]) / max(np.linalg.norm(b[f]), 1e-300)


@pytest.mark.parametrize("dtype,fwd_rel,bwd_rel", [
    ("float32", 1e-5, 1e-5), ("float16", 2e-3, 2e-3), ("bfloat16", 1e-2, 1e-2)])
@pytest.mark.parametrize("causal", [False, True])
def test_lowp_close_to_reference(dtype, fwd_rel, bwd_rel, causal):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    B, H, Hkv, M, N, D = 1, 4, 2, 40, 57, 16
    # Inputs already hold values of the low-precision type, as a kernel's inputs do; the
    # reference then sees the same numbers and only the kernel-internal roundings count.
    # (From unrounded float64 inputs at ~3 std, the bfloat16 gradients of lowp itself
    # reach ~1.6e-2, beyond the 1e-2 bound of docs/semantics.md, Tolerance: the rounding of the inputs dominates.)
    rnd = {"float32": lambda a: a.astype(np.float32),
           "float16": lambda a: a.astype(np.float16),
           "bfloat16": R.round_to_bf16}[dtype]
    q1, k1, q2, k2, v, do = (rnd(a / 2) for a in make_inputs(rng, B, H, Hkv, M, N, D))
    w = 9
    o, lse = R.forward(q1, k1, q2, k2, v, w, causal)
    ol, lsel = R.lowp_forward(q1, k1, q2, k2, v, w, causal, dtype=dtype, chunk_rows=7)
    assert ol.dtype == lsel.dtype == np.float32
    assert _rel(ol, o) <= fwd_rel, f"o seed={seed}"
    assert _rel(lsel, lse) <= fwd_rel, f"lse seed={seed}"
    grads = R.backward(q1, k1, q2, k2, v, o, lse, do, w, causal)
    grads_l = R.lowp_backward(q1, k1, q2, k2, v, ol, lsel, do, w, causal, dtype=dtype)
    for name, gl, g in zip(("dq1", "dk1", "dq2", "dk2", "dv"), grads_l, grads):
        assert gl.dtype == np.float32
        assert _rel(gl, g) <= bwd_rel, f"{name} rel {_rel(gl, g):.2e} seed={seed}"
    if dtype != "float32":   # outputs hold values of the low-precision type
        rnd = R.round_to_bf16 if dtype == "bfloat16" else (
            lambda a: a.astype(np.float16).astype(np.float32))
        for a in (ol, *grads_l):
            np.testing.assert_array_equal(rnd(a), a)


def test_lowp_empty_rows():
    rng = np.random.default_rng(fresh_seed())
    q1, k1, q2, k2, v, do = make_inputs(rng, 1, 1, 1, 6, 3, 8)
    for dtype in ("float16", "bfloat16", "float32"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            o, lse = R.lowp_forward(q1, k1, q2, k2, v, 1, True, dtype=dtype)
            grads = R.lowp_backward(q1, k1, q2, k2, v, o, lse, do, 1, True, dtype=dtype)
        assert np.all(o[:, :, :3] == 0) and np.all(np.isneginf(lse[:, :, :3]))
        assert np.all(np.isfinite(lse[:, :, 3:]))
        assert np.all(grads[0][:, :, :3] == 0) and np.all(grads[2][:, :, :3] == 0)


def test_lowp_bad_dtype():
    a = np.ones((1, 1, 2, 4))
    with pytest.raises(ValueError, match="dtype"):
        R.lowp_forward(a, a, a, a, a, 0, dtype="int8")


def test_round_to_bf16():
    f32 = np.float32
    cases = {
        1.0: 1.0,
        1 + 2**-8: 1.0,                    # tie, rounds to even (mantissa ...0)
        1 + 3 * 2**-8: 1 + 2**-6,          # tie, rounds up to even
        1 + 2**-8 + 2**-20: 1 + 2**-7,     # above the tie
        -(1 + 2**-8): -1.0,
        3.0e38: 3.0040553e38,              # large, stays finite
        3.4e38: np.inf,                    # beyond bfloat16's largest finite value
        65504.0: 65536.0,
        2.0**-130: 2.0**-130,              # subnormal, representable
        0.0: 0.0,
        np.inf: np.inf,
        -np.inf: -np.inf,
    }
    x = np.array(list(cases), dtype=f32)
    want = np.array(list(cases.values()), dtype=f32)
    got = R.round_to_bf16(x)
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_array_equal(got, want)
    assert np.isnan(R.round_to_bf16(np.float32(np.nan)))
    nan_payload = np.array([0x7FFFFFFF, 0xFFFFFFFF, 0x7F80FFFF], dtype=np.uint32).view(np.float32)
    assert np.isnan(R.round_to_bf16(nan_payload)).all()
    assert R.round_to_bf16(np.float32(1.0)).shape == ()
    # agrees with torch's own conversion on random values
    vals = (np.random.default_rng(fresh_seed()).standard_normal(10000) * 100).astype(f32)
    t = torch.from_numpy(vals).to(torch.bfloat16).to(torch.float32).numpy()
    np.testing.assert_array_equal(R.round_to_bf16(vals), t)


# --------------------------------------------------------------------------- bad input

def test_bad_input_messages():
    a = np.ones((1, 2, 3, 4))
    k = np.ones((1, 1, 5, 4))
    with pytest.raises(TypeError, match="w"):
        R.forward(a, k, a, k, k, 1.5)
    with pytest.raises(ValueError, match="q1"):
        R.forward(a[0], k, a, k, k, 1)
    with pytest.raises(ValueError, match="v"):
        R.forward(a, k, a, k, k[:, :, :4], 1)
    with pytest.raises(ValueError, match="heads"):
        R.forward(a, np.ones((1, 3, 5, 4)), a, np.ones((1, 3, 5, 4)), np.ones((1, 3, 5, 4)), 1)
    with pytest.raises(ValueError, match="chunk_rows"):
        R.forward(a, k, a, k, k, 1, chunk_rows=0)


def test_gpu_arrays_round_to():
    from cupy_piecewise.gpu_arrays import round_to

    x = np.array([1.0 + 2.0**-9, 1.0 + 2.0**-12, 3.0], dtype=np.float32)
    np.testing.assert_array_equal(round_to(x, "float32"), x)
    np.testing.assert_array_equal(round_to(x, "float16"), x.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(round_to(x, "bfloat16"), R.round_to_bf16(x))
    assert round_to(x, "bfloat16").dtype == np.float32


def test_round_to_tf32_rounds_to_nearest_ties_away():
    from cupy_piecewise.reference import round_to_tf32

    ulp = 2.0 ** -10  # of 1.0 in TF32 (10 mantissa bits)
    x = np.array([1.0, 1.0 + ulp / 2, -(1.0 + ulp / 2), 1.0 + ulp / 2 - 2.0 ** -23,
                  1.0 + 3 * ulp / 2, np.inf, -np.inf, np.nan, 0.0], dtype=np.float32)
    got = round_to_tf32(x)
    assert got.dtype == np.float32
    # ties go away from zero (cvt.rna), not to even: 1 + ulp/2 -> 1 + ulp (to even: 1.0);
    # 1 + 3/2 ulp -> 1 + 2 ulp either way
    want = [1.0, 1.0 + ulp, -(1.0 + ulp), 1.0, 1.0 + 2 * ulp, np.inf, -np.inf, np.nan, 0.0]
    np.testing.assert_array_equal(got, np.array(want, dtype=np.float32))
    r = np.random.default_rng(0).standard_normal(10000).astype(np.float32) * 100
    t = round_to_tf32(r)
    assert not (t.view(np.uint32) & 0x1FFF).any()  # 13 low mantissa bits cleared
    assert np.max(np.abs(t - r) / np.abs(r)) <= 2.0 ** -11


def test_lowp_tf32_rounds_products_only():
    """The "tf32" yardstick: errors of TF32 products (about 2^-11 relative), outputs not
    rounded further (float32 values with more than TF32's 10 mantissa bits)."""
    rng = np.random.default_rng(5)
    ins = [rng.standard_normal((1, 2, 64, 32)).astype(np.float32) for _ in range(5)]
    o_ref, _ = R.forward(*ins, 10, True)
    o_t, lse_t = R.lowp_forward(*ins, 10, True, dtype="tf32")
    o_f, _ = R.lowp_forward(*ins, 10, True, dtype="float32")
    err_t = np.linalg.norm(o_t - o_ref) / np.linalg.norm(o_ref)
    err_f = np.linalg.norm(o_f - o_ref) / np.linalg.norm(o_ref)
    assert 1e-5 < err_t < 2e-3 and err_f < 1e-5, (err_t, err_f)
    assert (o_t.view(np.uint32) & 0x1FFF).any()  # o itself is not TF32-rounded
    do = rng.standard_normal(o_t.shape).astype(np.float32)
    g_ref = R.backward(*ins, o_t, lse_t, do, 10, True)
    g_t = R.lowp_backward(*ins, o_t, lse_t, do, 10, True, dtype="tf32")
    for r, t in zip(g_ref, g_t):
        assert np.linalg.norm(t - r) / np.linalg.norm(r) < 2e-3
    from cupy_piecewise import tolerance

    assert tolerance.rel_bound("tf32") == 2e-3


def test_tf32_single_key_gradients_are_rounding_residue():
    """With one key per row (N = 1) p = 1, so the exact dq and dk vanish; the float64
    reference at a TF32 kernel's o (o = tf32(v), not v) returns only the residue
    do·(v - tf32(v)), and the SPEC's TF32 yardstick misses the 2e-3 relative bound on it by
    far, while dv stays well inside. This is why tests/test_kernels_gpu.py judges float32 dq
    and dk of N = 1 cases by the absolute rule alone."""
    from cupy_piecewise import tolerance

    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(5):
        ins = [(rng.standard_normal((1, 1, 1, 16)) * 1.5).astype(np.float32) for _ in range(5)]
        do = rng.standard_normal((1, 1, 1, 16)).astype(np.float32)
        o, lse = R.lowp_forward(*ins, -5, False, dtype="tf32")
        ref = R.backward(*ins, o, lse, do, -5, False)
        low = R.lowp_backward(*ins, o, lse, do, -5, False, dtype="tf32")
        rel = [tolerance.compare(n, lw, r, lw, "tf32").rel_err
               for n, r, lw in zip(("dq1", "dk1", "dq2", "dk2", "dv"), ref, low)]
        worst = max(worst, rel[2], rel[3])
        assert rel[4] < 2e-3
    assert worst > 50 * 2e-3


def test_tf32_yardstick_lse_needs_several_rows():
    """Why tests/test_kernels_gpu.run_case draws at least 8 lse rows: with one query and one
    key per row, lse is a single scaled score that can sit near zero, and with two rows the
    SPEC's TF32 yardstick itself misses the 2e-3 relative bound on lse in about 2% of draws
    (two float32 GPU cases failed that way); with 8 rows it meets it in every draw here."""
    from cupy_piecewise import tolerance

    rng = np.random.default_rng(20261203)

    def misses(rows, draws):
        n = 0
        for i in range(draws):
            d = (16, 32, 64, 128)[i % 4]
            ins = [rng.standard_normal((rows, 1, 1, d)).astype(np.float32) for _ in range(5)]
            _, lse_ref = R.forward(*ins, 1, False)
            _, lse_low = R.lowp_forward(*ins, 1, False, dtype="tf32")
            n += not tolerance.compare("lse", lse_low.astype(np.float64), lse_ref, lse_low,
                                       "tf32").passed
        return n

    assert misses(2, 800) >= 4  # the failure mode is real at two rows (18 of 800 here)
    assert misses(8, 800) == 0


def test_tf32_yardstick_at_wide_inputs():
    """Why the float32 GPU tests draw unit-variance inputs (test_kernels_gpu.INPUT_SCALE):
    with 1.5-std inputs the SPEC's TF32 yardstick itself misses the 2e-3 relative bound on
    dq1/dk1 of a 3-query, 700-key causal decode (seed 108 of a 25-seed scan: 2.5e-3, 2.7e-3);
    at unit variance the same shape stays near 6e-4."""
    from cupy_piecewise import tolerance

    def worst(seed, scale):
        rng = np.random.default_rng(seed)
        shapes = [(2, 2, 3, 64), (2, 1, 700, 64)] * 2 + [(2, 1, 700, 64)]
        host = [(rng.standard_normal(s) * scale).astype(np.float32) for s in shapes]
        do = rng.standard_normal((2, 2, 3, 64)).astype(np.float32)
        o, lse = R.lowp_forward(*host, 300, True, 0.125, dtype="tf32")
        ref = R.backward(*host, o, lse, do, 300, True, 0.125)
        low = R.lowp_backward(*host, o, lse, do, 300, True, 0.125, dtype="tf32")
        return max(tolerance.compare(n, lw, r, lw, "tf32").rel_err
                   for n, r, lw in zip(("dq1", "dk1", "dq2", "dk2", "dv"), ref, low))

    assert worst(108, 1.5) > 2e-3
    assert worst(108, 1.0) < 1e-3
