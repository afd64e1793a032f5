"""The machinery of tests/test_huge_gpu.py, run with NumPy: its chunked float64 reference
and lowp yardstick against ``cupy_piecewise.reference``, its piecewise rule against
``tolerance.compare``, and its bfloat16 bit helpers against ml_dtypes.

The huge test computes its reference with code of its own (on the GPU, a chunk of keys at
a time: the NumPy reference cannot hold its 2**31-element tensors) and only runs where
there is a GPU; these checks make sure, on any machine, that the code computes the same
function, the same yardstick and the same verdicts.
"""
from __future__ import annotations

import numpy as np
import pytest

from cupy_piecewise import reference, tolerance
from cupy_piecewise.gpu_arrays import bfloat16
from test_huge_gpu import (Case, RuleAccumulator, as_f32, bf16_bits, judge_case, reference_pass,
                           round_bf16)


def _inputs(case: Case, seed: int):
    """q1, k1, q2, k2, v, do: float32 (rows, D) arrays of bfloat16 values."""
    rng = np.random.default_rng(seed)
    rows = (case.M, case.N, case.M, case.N, case.N, case.M)
    return [reference.round_to_bf16(rng.standard_normal((r, case.D)).astype(np.float32) * 1.5)
            for r in rows]


def _4d(a):
    return a[None, None]


def test_bf16_bits_round_like_ml_dtypes():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(100_000) * 10.0 ** rng.integers(-30, 30, 100_000)).astype(np.float32)
    x[:4] = [0.0, -0.0, 1.00390625, 1.01171875]  # ties, rounded to even either way
    expected = x.astype(bfloat16())
    assert np.array_equal(bf16_bits(x), expected.view(np.uint16))
    assert np.array_equal(round_bf16(x), reference.round_to_bf16(x))
    assert np.array_equal(as_f32(expected), expected.astype(np.float32))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("w", [-3, 40, 250, 1000])
def test_chunked_reference_is_the_reference(causal, w):
    """reference_pass with chunks of 64 keys (the last one partial) gives
    reference.forward/backward to float64 rounding and lowp_forward/lowp_backward to
    float32 summation order (at most one bfloat16 step apart, where a sum landed on the
    other side of a rounding boundary)."""
    case = Case(M=37, N=300, D=32, w=w, causal=causal)
    q1, k1, q2, k2, v, do = _inputs(case, seed=w + 10 + 17 * causal)
    ins4 = [_4d(a) for a in (q1, k1, q2, k2, v)]
    o_ref, lse_ref = reference.forward(*ins4, w, causal)
    # the backward starts from a kernel's o (bfloat16) and lse (float32)
    o = round_bf16(o_ref[0, 0].astype(np.float32))
    lse = lse_ref[0, 0].astype(np.float32)
    chunks = {"ref": [], "low": []}

    def visit(j0, j1, ref, low):
        assert j1 - j0 == min(64, case.N - j0)
        chunks["ref"].append(ref)
        chunks["low"].append(low)

    out = reference_pass(np, case, lambda j0, j1: (k1[j0:j1], k2[j0:j1], v[j0:j1]), q1, q2, o,
                         lse, do, 64, visit)
    grads = {name: [np.concatenate([c[i] for c in chunks[name]]) for i in range(3)]
             for name in chunks}
    ref_bwd = reference.backward(*ins4, _4d(o), _4d(lse), _4d(do), w, causal)
    o_low, lse_low = reference.lowp_forward(*ins4, w, causal, dtype="bfloat16")
    low_bwd = reference.lowp_backward(*ins4, _4d(o), _4d(lse), _4d(do), w, causal,
                                      dtype="bfloat16")
    ref = out["ref"]
    pairs = [("o", ref["o"], o_ref), ("lse", ref["lse"], lse_ref), ("dq1", ref["dq1"], ref_bwd[0]),
             ("dk1", grads["ref"][0], ref_bwd[1]), ("dq2", ref["dq2"], ref_bwd[2]),
             ("dk2", grads["ref"][1], ref_bwd[3]), ("dv", grads["ref"][2], ref_bwd[4])]
    for name, got, want in pairs:
        assert got.dtype == np.float64
        np.testing.assert_allclose(got, want[0, 0], rtol=1e-11, atol=1e-13, err_msg=name)
    low = out["low"]
    pairs = [("o", low["o"], o_low), ("dq1", low["dq1"], low_bwd[0]),
             ("dk1", grads["low"][0], low_bwd[1]), ("dq2", low["dq2"], low_bwd[2]),
             ("dk2", grads["low"][1], low_bwd[3]), ("dv", grads["low"][2], low_bwd[4])]
    for name, got, want in pairs:
        assert got.dtype == np.float32 and np.array_equal(got, round_bf16(got)), name
        want = want[0, 0]
        step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 1e-30))) - 7)  # one bf16 ulp
        assert np.all(np.abs(got - want) <= step + 1e-6 * np.abs(want).max()), name
    np.testing.assert_allclose(low["lse"], lse_low[0, 0], rtol=1e-6)


def test_rule_accumulator_is_tolerance_compare():
    """Pieces through RuleAccumulator give tolerance.compare's verdict on the whole."""
    rng = np.random.default_rng(1)
    ref = rng.standard_normal((500, 16))
    low = ref + rng.standard_normal(ref.shape) * 1e-3
    for impl in (ref + rng.standard_normal(ref.shape) * 1e-3,   # passes
                 ref + rng.standard_normal(ref.shape) * 3e-3,   # fails rule 1
                 np.where(np.arange(500)[:, None] == 321, np.nan, ref),  # not finite
                 np.zeros_like(ref)):                           # fails rule 2
        want = tolerance.compare("x", impl, ref, low, "bfloat16")
        acc = RuleAccumulator(np, "x")
        for a in range(0, 500, 64):
            acc.add(impl[a:a + 64], ref[a:a + 64], low[a:a + 64])
        got = acc.verdict("bfloat16")
        assert (got.passed, got.finite) == (want.passed, want.finite)
        for field in ("max_err", "bound", "rel_err"):
            assert np.isclose(getattr(got, field), getattr(want, field), rtol=1e-12), field


@pytest.mark.parametrize("causal", [False, True])
def test_judge_case_passes_a_good_result_and_finds_a_bad_key_row(causal):
    """judge_case end to end at a small size: the float64 reference rounded to bfloat16 (a
    perfect kernel) passes every verdict; one wrong row of dv in a window fails that
    window's verdict; a planted key's wrong row is left to the whole-tensor verdict."""
    case = Case(M=40, N=700, D=32, w=300, causal=causal)
    q1, k1, q2, k2, v, do = _inputs(case, seed=5 + causal)
    ins4 = [_4d(a) for a in (q1, k1, q2, k2, v)]
    o_ref, lse_ref = reference.forward(*ins4, case.w, causal)
    o, lse = round_bf16(o_ref[0, 0].astype(np.float32)), lse_ref[0, 0].astype(np.float32)
    grads = [round_bf16(g[0, 0].astype(np.float32)) for g in
             reference.backward(*ins4, _4d(o), _4d(lse), _4d(do), case.w, causal)]
    windows, planted = ((0, 50), (320, 400), (650, 700)), {0: 0, 39: 699}

    def run(dk1, dk2, dv):
        return judge_case(np, case, q1, q2, do, lambda j0, j1: (k1[j0:j1], k2[j0:j1], v[j0:j1]),
                          o, lse, (grads[0], grads[2]),
                          lambda j0, j1: (dk1[j0:j1].copy(), dk2[j0:j1].copy(), dv[j0:j1].copy()),
                          chunk=128, windows=windows, planted=planted)[0]

    verdicts = run(grads[1], grads[3], grads[4])
    assert [v.name for v in verdicts][:7] == ["o", "lse", "dq1", "dq2", "dk1", "dk2", "dv"]
    assert all(v.passed for v in verdicts), "\n".join(map(str, verdicts))
    bad = grads[4].copy()
    bad[350] += 0.5 * np.abs(bad).max()
    failed = [v.name for v in run(grads[1], grads[3], bad) if not v.passed]
    assert "dv[320:400]" in failed
    bad = grads[4].copy()
    bad[699] = np.nan
    failed = [v.name for v in run(grads[1], grads[3], bad) if not v.passed]
    assert failed == ["dv"]
