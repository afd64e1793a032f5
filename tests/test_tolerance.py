"""The tolerance rule (cupy_piecewise.tolerance) on hand-made and reference results."""

import numpy as np
import pytest

from cupy_piecewise import reference as R
from cupy_piecewise import tolerance
from cupy_piecewise.tolerance import REL_BOUNDS, Verdict, assert_close, compare, rel_bound


def _seed():
    return int(np.random.SeedSequence().entropy % (2**63))


@pytest.fixture
def results():
    """Reference and bfloat16 lowp forward on a causal case with empty rows (M > N)."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    B, H, Hkv, M, N, D = 1, 2, 1, 12, 9, 16
    q1, q2 = rng.standard_normal((2, B, H, M, D))
    k1, k2, v = rng.standard_normal((3, B, Hkv, N, D))
    ref = R.forward(q1, k1, q2, k2, v, 2, True)
    lowp = R.lowp_forward(q1, k1, q2, k2, v, 2, True, dtype="bfloat16")
    return seed, ref, lowp


def test_good_result_passes(results):
    seed, (o, lse), (ol, lsel) = results
    # A result as good as the plain low-precision one passes.
    v = compare("o", ol, o, ol, "bfloat16")
    assert v.passed, f"{v} seed={seed}"
    assert isinstance(v, Verdict) and v.finite and v.nonfinite_mismatch == 0
    assert v.max_err <= v.bound and v.rel_err <= v.rel_bound == 1e-2
    assert str(v).startswith("PASS o:")
    assert compare("lse", lsel, lse, lsel, "bfloat16").passed
    # The reference itself passes trivially.
    assert compare("o", o, o, ol, "bfloat16").max_err == 0.0
    assert assert_close("o", ol, o, ol, "bfloat16").passed


def test_shifted_element_fails(results):
    seed, (o, _), (ol, _) = results
    bad = o.copy()
    bad[0, 1, 10, 3] += 0.5
    v = compare("o", bad, o, ol, "bfloat16")
    assert not v.passed and v.finite, f"{v} seed={seed}"
    assert v.max_err == pytest.approx(0.5) and v.max_err > v.bound
    assert str(v).startswith("FAIL o:")
    with pytest.raises(AssertionError, match="FAIL o"):
        assert_close("o", bad, o, ol, "bfloat16")


def test_uniformly_worse_fails_relative_bound():
    # Every element off by 1.5 % of itself: passes the max rule thanks to a loose lowp,
    # fails the relative L2 rule of bfloat16 (1e-2).
    ref = np.linspace(1.0, 2.0, 100)
    lowp = ref + 0.1
    impl = ref * 1.015
    v = compare("x", impl, ref, lowp, "bfloat16")
    assert v.max_err <= v.bound and v.rel_err > v.rel_bound and not v.passed


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_nonfinite_in_impl_fails(results, value):
    seed, (o, lse), (ol, lsel) = results
    bad = ol.copy()
    bad[0, 0, 11, 0] = value
    v = compare("o", bad, o, ol, "bfloat16")
    assert not v.passed and not v.finite, f"{v} seed={seed}"
    with pytest.raises(AssertionError):
        assert_close("o", bad, o, ol, "bfloat16")


def test_lse_neg_inf_rows(results):
    seed, (_, lse), (_, lsel) = results
    empty = np.isneginf(lse)
    assert empty.any() and (~empty).any()           # M > N causal: rows 0..2 are empty
    assert np.array_equal(np.isneginf(lsel), empty)
    v = compare("lse", lsel, lse, lsel, "bfloat16")
    assert v.passed and v.nonfinite_mismatch == 0 and np.isfinite(v.max_err), f"{v} seed={seed}"
    # A finite value where the reference has -inf fails.
    bad = lsel.copy()
    bad[empty] = 0.0
    v = compare("lse", bad, lse, lsel, "bfloat16")
    assert not v.passed and v.nonfinite_mismatch == int(empty.sum())
    # +inf or NaN where the reference has -inf fails too.
    for value in (np.inf, np.nan):
        bad = lsel.copy()
        bad[empty] = value
        assert not compare("lse", bad, lse, lsel, "bfloat16").passed
    # -inf where the reference is finite fails (finite flag).
    bad = lsel.copy()
    bad[~empty] = -np.inf
    v = compare("lse", bad, lse, lsel, "bfloat16")
    assert not v.passed and not v.finite


def test_zero_reference_uses_absolute_norm():
    ref = np.zeros((2, 3))
    v = compare("dq2", np.full((2, 3), 1e-7), ref, ref, "float16")
    assert v.passed and "absolute" in v.note
    v = compare("dq2", np.full((2, 3), 1e-3), ref, ref, "float16")
    assert not v.passed


def test_inputs_not_finite_waives_checks():
    ref = np.array([1.0, np.nan, 2.0])
    impl = np.array([1.0, np.inf, 2.0])
    assert not compare("o", impl, ref, ref, "float16").passed
    v = compare("o", impl, ref, ref, "float16", inputs_finite=False)
    assert v.passed and "waived" in v.note


def test_shape_mismatch_fails():
    v = compare("o", np.zeros(3), np.zeros(4), np.zeros(4), "float16")
    assert not v.passed and "shape" in v.note


def test_empty_arrays_pass():
    e = np.zeros((1, 2, 0, 8))
    assert compare("o", e, e, e, "float16").passed


def test_lowp_nonfinite_left_out_of_bound():
    ref = np.array([1.0, 2.0])
    lowp = np.array([np.inf, 2.001])
    v = compare("o", np.array([1.0, 2.0015]), ref, lowp, "float16")
    assert v.bound == pytest.approx(2 * 0.001 + 1e-5) and v.passed and "lowp" in v.note


def test_dtype_names():
    assert rel_bound("float16") == rel_bound(np.float16) == rel_bound("fp16") == 2e-3
    assert rel_bound("bfloat16") == rel_bound("torch.bfloat16") == rel_bound("bf16") == 1e-2
    assert rel_bound("float32") == rel_bound(np.float32) == REL_BOUNDS["float32"] == 1e-4
    assert rel_bound(np.float64) == 1e-10
    with pytest.raises(ValueError, match="dtype"):
        rel_bound("int8")
    torch = pytest.importorskip("torch")
    assert rel_bound(torch.bfloat16) == 1e-2 and rel_bound(torch.float16) == 2e-3


def test_accepts_lists_and_float32():
    v = compare("o", [1.0, 2.0], np.array([1.0, 2.0], np.float32), [1.0, 2.0], "float32")
    assert v.passed and v.max_err == 0.0


def test_reference_lowp_gradients_pass_their_own_rule():
    """End to end: the float16 lowp backward, taken as impl, passes against the reference."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    B, H, Hkv, M, N, D = 1, 2, 2, 20, 25, 16
    q1, q2, do = rng.standard_normal((3, B, H, M, D))
    k1, k2, v = rng.standard_normal((3, B, Hkv, N, D))
    # inputs hold float16 values, as a float16 kernel's inputs do
    q1, q2, do, k1, k2, v = (a.astype(np.float16) for a in (q1, q2, do, k1, k2, v))
    o, lse = R.forward(q1, k1, q2, k2, v, 4, False)
    ol, lsel = R.lowp_forward(q1, k1, q2, k2, v, 4, False, dtype="float16")
    g = R.backward(q1, k1, q2, k2, v, o, lse, do, 4, False)
    gl = R.lowp_backward(q1, k1, q2, k2, v, ol, lsel, do, 4, False, dtype="float16")
    for name, a, b in zip(("dq1", "dk1", "dq2", "dk2", "dv"), gl, g):
        assert_close(name, a, b, a, "float16")


def _rounded_rel_err(x):
    r = x.astype(np.float16).astype(np.float64)
    return np.linalg.norm(r - x) / np.linalg.norm(x)


def test_float16_loss_scale_makes_subnormal_gradients_checkable():
    """dq1 of one query row against 4096 keys with w = 1 (one key on the first projection)
    lies around float16's smallest normal number: even the correctly rounded exact answer
    misses the 2e-3 bound. Under the loss scale every gradient rounds to well inside it."""
    rng = np.random.default_rng(0)
    D, M, N, w = 16, 1, 4096, 1
    shapes = [(1, 1, M, D), (1, 1, N, D), (1, 1, M, D), (1, 1, N, D), (1, 1, N, D)]
    host = [(rng.standard_normal(s) * 1.5).astype(np.float16).astype(np.float64) for s in shapes]
    do = rng.standard_normal((1, 1, M, D)).astype(np.float16).astype(np.float64)
    o, lse = R.forward(*host, w, False, 0.25)
    grads = R.backward(*host, o, lse, do, w, False, 0.25)
    assert _rounded_rel_err(grads[0]) > tolerance.rel_bound("float16")
    s = tolerance.float16_loss_scale(grads, do)
    assert s > 1 and s == 2.0 ** round(np.log2(s))
    scaled = R.backward(*host, o, lse, do * s, w, False, 0.25)
    for g, gs in zip(grads, scaled):
        np.testing.assert_array_equal(gs, g * s)  # exact: gradients are linear in do
        assert _rounded_rel_err(gs) < tolerance.rel_bound("float16") / 4


def test_float16_loss_scale_limits():
    do = np.full((2, 3), 4.0)
    scale = tolerance.float16_loss_scale
    assert scale([np.full(3, 1e-9)], do) == 2.0**12  # capped by do
    assert scale([np.full(3, 1e-4), np.full(3, 100.0)], do) == 32.0  # capped by the peak
    assert scale([np.full(3, 1e-3), np.full(3, 0.5)], do) == 64.0  # 1e-3 * 64 >= 2**-4
    assert scale([np.full(3, 1e3)], do) == 1.0  # already normal
    assert scale([np.full(3, 1e6), np.full(3, 1e-5)], do) == 1.0  # never below 1
    # zero gradients (e.g. dq when there is one key: ds = 0) neither need nor get a scale
    assert scale([np.zeros(3), np.full(3, 4.0), np.full(3, 1e-20)], do) == 1.0
    assert scale([np.zeros(3), np.zeros(0)], do) == 1.0
