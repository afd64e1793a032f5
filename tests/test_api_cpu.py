"""Public API on NumPy arrays: dispatch to the float64 reference, argument order,
output dtypes and shapes, errors before any work. CPU only.

The expected values come from a dense torch float64 implementation written here
from docs/semantics.md, with autograd for the gradients, so a swapped argument on the way
to the reference shows up.
"""

from __future__ import annotations

import doctest
import math

import numpy as np
import pytest

import cupy_piecewise as cpw
from cupy_piecewise import api

torch = pytest.importorskip("torch")


def dense_torch(q1, k1, q2, k2, v, w, causal, sm_scale):
    """(o, lse) in float64 from the formulas; differentiable."""
    B, H, M, D = q1.shape
    Hkv, N = k1.shape[1], k1.shape[2]
    g = H // Hkv
    k1, k2, v = (t.repeat_interleave(g, dim=1) for t in (k1, k2, v))
    scale = 1 / math.sqrt(D) if sm_scale is None else sm_scale
    i = torch.arange(M).view(M, 1)
    j = torch.arange(N).view(1, N)
    d = i + (N - M) - j
    s = torch.where(d >= w, q2 @ k2.transpose(-1, -2), q1 @ k1.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(d < 0, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    p = torch.nan_to_num(p, nan=0.0)
    return p @ v, lse


def make(B=2, H=4, Hkv=2, M=6, N=9, D=16, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    q1, q2 = (rng.standard_normal((B, H, M, D)) * 0.7 for _ in range(2))
    k1, k2, v = (rng.standard_normal((B, Hkv, N, D)) * 0.7 for _ in range(3))
    return tuple(a.astype(dtype) for a in (q1, k1, q2, k2, v))


CASES = [
    dict(M=6, N=9, w=3, causal=False),
    dict(M=6, N=9, w=3, causal=True),
    dict(M=9, N=6, w=1, causal=True),  # M > N: leading rows see no key
    dict(M=7, N=7, w=-2, causal=False),  # negative w: keys after the query take q2·k2
    dict(M=5, N=8, w=100, causal=False),  # beyond every distance: only q1·k1
    dict(M=5, N=8, w=-100, causal=True),  # below every distance: only q2·k2
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_forward_matches_dense(case):
    q1, k1, q2, k2, v = make(M=case["M"], N=case["N"])
    o, lse = cpw.attention(q1, k1, q2, k2, v, case["w"], causal=case["causal"], return_lse=True)
    ref_o, ref_lse = dense_torch(*map(torch.from_numpy, (q1, k1, q2, k2, v)), case["w"], case["causal"], None)
    assert o.dtype == np.float64 and lse.dtype == np.float32
    assert o.shape == q1.shape and lse.shape == q1.shape[:3]
    np.testing.assert_allclose(o, ref_o.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse.numpy().astype(np.float32), rtol=1e-6)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_backward_matches_autograd(case):
    q1, k1, q2, k2, v = make(M=case["M"], N=case["N"], seed=1)
    w, causal, scale = case["w"], case["causal"], 0.3
    o, lse = cpw.attention(q1, k1, q2, k2, v, w, causal=causal, sm_scale=scale, return_lse=True)
    do = np.random.default_rng(2).standard_normal(o.shape)
    grads = cpw.attention_backward(do, q1, k1, q2, k2, v, o, lse, w, causal=causal, sm_scale=scale)

    ts = [torch.from_numpy(a).requires_grad_() for a in (q1, k1, q2, k2, v)]
    ref_o, _ = dense_torch(*ts, w, causal, scale)
    ref_o.backward(torch.from_numpy(do))
    names = ("dq1", "dk1", "dq2", "dk2", "dv")
    assert len(grads) == 5
    for name, got, t in zip(names, grads, ts):
        assert got.shape == t.shape, name
        assert got.dtype == np.float64, name
        # lse passes through float32, so p is recomputed to ~1e-7 relative.
        np.testing.assert_allclose(got, t.grad.numpy(), rtol=2e-5, atol=2e-6, err_msg=name)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_output_dtypes_follow_input(dtype):
    q1, k1, q2, k2, v = make(dtype=dtype)
    o = cpw.attention(q1, k1, q2, k2, v, 2)
    assert isinstance(o, np.ndarray) and o.dtype == dtype
    o, lse = cpw.attention(q1, k1, q2, k2, v, 2, return_lse=True)
    assert o.dtype == dtype and lse.dtype == np.float32
    grads = cpw.attention_backward(np.ones_like(o), q1, k1, q2, k2, v, o, lse, 2)
    assert [g.dtype for g in grads] == [dtype] * 5
    assert grads[1].shape == k1.shape and grads[0].shape == q1.shape


def test_default_sm_scale_is_inverse_sqrt_head_dim():
    q1, k1, q2, k2, v = make(D=16)
    a = cpw.attention(q1, k1, q2, k2, v, 2)
    b = cpw.attention(q1, k1, q2, k2, v, 2, sm_scale=0.25)
    np.testing.assert_array_equal(a, b)


def test_inputs_not_written():
    arrays = make()
    copies = [a.copy() for a in arrays]
    o, lse = cpw.attention(*arrays, 3, causal=True, return_lse=True)
    do = np.ones_like(o)
    o_copy, lse_copy = o.copy(), lse.copy()
    cpw.attention_backward(do, *arrays, o, lse, 3, causal=True)
    for a, c in zip(arrays, copies):
        np.testing.assert_array_equal(a, c)
    np.testing.assert_array_equal(o, o_copy)
    np.testing.assert_array_equal(lse, lse_copy)


def test_empty_rows_give_zero_and_minus_inf():
    q1, k1, q2, k2, v = make(M=8, N=3)
    o, lse = cpw.attention(q1, k1, q2, k2, v, 1, causal=True, return_lse=True)
    # P = N - M = -5: rows i < 5 have no admissible key.
    assert np.all(o[:, :, :5] == 0) and np.all(np.isneginf(lse[:, :, :5]))
    assert np.all(np.isfinite(lse[:, :, 5:]))


def test_bad_input_raises_before_reference(monkeypatch):
    from cupy_piecewise import reference

    def boom(*args, **kwargs):
        raise AssertionError("reference called despite bad input")

    monkeypatch.setattr(reference, "forward", boom)
    monkeypatch.setattr(reference, "backward", boom)
    q1, k1, q2, k2, v = make()
    with pytest.raises(TypeError, match="dist_threshold"):
        cpw.attention(q1, k1, q2, k2, v, 2.0)
    with pytest.raises(ValueError, match="v"):
        cpw.attention(q1, k1, q2, k2, v[:, :, :3], 2)
    o = np.zeros_like(q1)
    lse = np.zeros(q1.shape[:3], np.float32)
    with pytest.raises(ValueError, match="do"):
        cpw.attention_backward(o[:, :1], q1, k1, q2, k2, v, o, lse, 2)
    with pytest.raises(TypeError, match="lse"):
        cpw.attention_backward(o, q1, k1, q2, k2, v, o, lse.astype(np.int32), 2)


def test_keyword_only_options():
    q1, k1, q2, k2, v = make()
    with pytest.raises(TypeError):
        cpw.attention(q1, k1, q2, k2, v, 2, True)  # causal must be passed by keyword


def test_docstring_examples_run():
    result = doctest.testmod(api, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_readme_example_runs():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("## API", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["o"].shape == (1, 4, 8, 16)
    assert namespace["dk1"].shape == (1, 2, 8, 16)


def test_import_needs_neither_cupy_nor_torch():
    import subprocess
    import sys
    from pathlib import Path

    code = "import sys, cupy_piecewise; assert 'cupy' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_deterministic_flag(library):
    """``deterministic``: a bool on every entry point (the CPU paths are deterministic, so
    the results are those of the default); anything else is a TypeError naming it."""
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(s) for s in [(1, 2, 5, 16), (1, 1, 7, 16)] * 2 + [(1, 1, 7, 16)]]
    if library == "torch":
        arrays = [torch.from_numpy(a) for a in arrays]
    o, lse = cpw.attention(*arrays, 2, return_lse=True, deterministic=True)
    want = cpw.attention(*arrays, 2, return_lse=True)
    assert all((np.asarray(a) == np.asarray(b)).all() for a, b in zip((o, lse), want))
    do = arrays[0] * 0.5
    grads = cpw.attention_backward(do, *arrays, o, lse, 2, deterministic=True)
    ref = cpw.attention_backward(do, *arrays, o, lse, 2)
    assert all((np.asarray(a) == np.asarray(b)).all() for a, b in zip(grads, ref))
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="deterministic"):
            cpw.attention(*arrays, 2, deterministic=bad)
        with pytest.raises(TypeError, match="deterministic"):
            cpw.attention_backward(do, *arrays, o, lse, 2, deterministic=bad)
