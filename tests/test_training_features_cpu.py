"""Position offsets (q_offset, k_offset) and the gradient through lse, on the CPU paths
(NumPy reference, torch CPU, torch autograd), against a dense float64 torch implementation
written here from docs/semantics.md with torch's own autograd; finite differences for the
lse gradient; the merge of partial attentions over complementary key ranges; the clamping
that brings offsets and w to the kernels' range; argument errors. CPU only.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import cupy_piecewise as cpw
from cupy_piecewise import core, validate

torch = pytest.importorskip("torch")


def dense(q1, k1, q2, k2, v, w, causal, sm_scale=None, q_offset=None, k_offset=0):
    """(o, lse) in float64 from the definition, differentiable by torch autograd."""
    B, H, M, D = q1.shape
    Hkv, N = k1.shape[1], k1.shape[2]
    g = H // Hkv
    k1, k2, v = (t.repeat_interleave(g, dim=1) for t in (k1, k2, v))
    scale = 1 / math.sqrt(D) if sm_scale is None else sm_scale
    q0 = k_offset + N - M if q_offset is None else q_offset
    P = q0 - k_offset  # Python ints: exact at any size
    # d = x + P with x = i - j in [1 - N, M - 1]: d >= t  <=>  x >= t - P, and a threshold
    # beyond [-N, M] acts like that bound (keeps the tensors in int64)
    x = torch.arange(M).view(M, 1) - torch.arange(N).view(1, N)
    far = x >= max(-N, min(M, w - P))
    s = torch.where(far, q2 @ k2.transpose(-1, -2), q1 @ k1.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(x < max(-N, min(M, -P)), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    return torch.nan_to_num(p, nan=0.0) @ v, lse


def inputs(B=1, H=4, Hkv=2, M=7, N=9, D=16, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, H, M, D), (B, Hkv, N, D), (B, H, M, D), (B, Hkv, N, D), (B, Hkv, N, D)]
    return [torch.randn(s, dtype=torch.float64, generator=g).requires_grad_(grad) for s in shapes]


OFFSETS = [(None, 0), (None, 123), (0, 0), (5, 0), (0, 5), (-40, -37), (100, 3), (3, 100),
           (2**62, 2**62 - 4), (-2**62, -2**62 + 6), (2**40, 0), (0, 2**40)]


@pytest.mark.parametrize("q_offset,k_offset", OFFSETS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("w", [-3, 0, 2, 6, 2**62])
def test_offsets_forward_and_gradients(q_offset, k_offset, causal, w):
    """torch CPU (autograd) and NumPy (reference) with offsets equal the dense definition."""
    ins = inputs(seed=abs(hash((q_offset, k_offset, w))) % 1000, grad=True)
    o, lse = cpw.attention(*ins, w, causal=causal, return_lse=True, q_offset=q_offset,
                           k_offset=k_offset)
    leaves = [t.detach().clone().requires_grad_() for t in ins]
    ro, rlse = dense(*leaves, w, causal, q_offset=q_offset, k_offset=k_offset)
    torch.testing.assert_close(o, ro)
    torch.testing.assert_close(lse, rlse)
    g = torch.Generator().manual_seed(7)
    do, dl = torch.randn(o.shape, dtype=torch.float64, generator=g), torch.randn(lse.shape, dtype=torch.float64, generator=g)
    dl = torch.where(torch.isinf(rlse), torch.zeros_like(dl), dl)
    (o * do).sum().add_((torch.nan_to_num(lse, neginf=0.0) * dl).sum()).backward()
    (ro * do).sum().add_((torch.nan_to_num(rlse, neginf=0.0) * dl).sum()).backward()
    for a, b in zip(ins, leaves):
        torch.testing.assert_close(a.grad, b.grad)
    # NumPy: the float64 reference through the public API, dlse included
    npi = [t.detach().numpy() for t in ins]
    no, nlse = cpw.attention(*npi, w, causal=causal, return_lse=True, q_offset=q_offset,
                             k_offset=k_offset)
    np.testing.assert_allclose(no, ro.detach().numpy(), rtol=1e-12, atol=1e-12)
    ngrads = cpw.attention_backward(do.numpy(), *npi, no, nlse.astype(np.float64), w,
                                    causal=causal, q_offset=q_offset, k_offset=k_offset,
                                    dlse=dl.numpy())
    for a, b in zip(ngrads, leaves):
        np.testing.assert_allclose(a, b.grad.numpy(), rtol=1e-5, atol=1e-6)  # lse was float32


@pytest.mark.parametrize("k_offset", [0, 7, -1000, 2**50])
def test_q_offset_none_is_the_default_alignment(k_offset):
    """q_offset=None means k_offset + N - M: k_offset cancels out of every distance."""
    ins = inputs(M=5, N=11, seed=3)
    want = cpw.attention(*ins, 4, causal=True, return_lse=True)
    got = cpw.attention(*ins, 4, causal=True, return_lse=True, k_offset=k_offset)
    explicit = cpw.attention(*ins, 4, causal=True, return_lse=True, q_offset=k_offset + 6,
                             k_offset=k_offset)
    for a, b, c in zip(want, got, explicit):
        assert torch.equal(a, b) and torch.equal(a, c)


def _masks(M, N, P, w):
    """(far, admissible) masks of d = i - j + P in Python integers: P and w range over
    +-2**63 here, where int64 arithmetic would overflow."""
    d = [[i - j + P for j in range(N)] for i in range(M)]
    return (np.array([[x >= w for x in row] for row in d], dtype=bool),
            np.array([[x >= 0 for x in row] for row in d], dtype=bool))


@settings(max_examples=400, deadline=None)
@example(M=1, N=1, q0=2**62, k0=-2**62, w=0, default=False)  # shift 2**63: past int64
@given(M=st.integers(0, 40), N=st.integers(0, 40),
       q0=st.integers(-2**62, 2**62), k0=st.integers(-2**62, 2**62),
       w=st.integers(-2**63, 2**63), default=st.booleans())
def test_clamp_keeps_every_comparison(M, N, q0, k0, w, default):
    """core.clamp_w maps (shift, w) into the kernels' range without changing which pairs
    use the second projection or are causally admissible; results stay within 32 bits for
    lengths below 2**30 (|P| <= max(M, N), |w| <= 2 (M + N) + 1)."""
    shift = None if default else q0 - k0
    p = validate.Problem("torch", 1, 1, 1, M, N, 16, "float64", w, True, 0.25, None, shift)
    c = core.clamp_w(p)
    P0 = N - M if shift is None else shift
    assert c.P == (N - M if c.shift is None else c.shift)
    assert abs(c.P) <= max(M, N) and abs(c.w) <= 2 * (M + N) + 1
    if M and N:
        for a, b in zip(_masks(M, N, P0, w), _masks(M, N, c.P, c.w)):
            assert np.array_equal(a, b)
    assert core.clamp_w(c) == c  # idempotent (the torch operators re-check)


def test_merge_of_two_key_ranges_equals_one_call():
    """The worked example of docs/semantics.md: keys split at s into two calls placed by
    k_offset, merged by their lse, equal one call in value and in every gradient."""
    B, H, Hkv, M, N, D, w, s = 1, 4, 2, 6, 13, 16, 4, 5
    ins = inputs(B, H, Hkv, M, N, D, seed=11, grad=True)
    q1, k1, q2, k2, v = ins
    q0 = N - M  # queries aligned to the end of all N keys
    oa, la = cpw.attention(q1, k1[:, :, :s], q2, k2[:, :, :s], v[:, :, :s], w, causal=True,
                           return_lse=True, q_offset=q0, k_offset=0)
    ob, lb = cpw.attention(q1, k1[:, :, s:], q2, k2[:, :, s:], v[:, :, s:], w, causal=True,
                           return_lse=True, q_offset=q0, k_offset=s)
    lse = torch.logaddexp(la, lb)
    o = torch.exp(la - lse)[..., None] * oa + torch.exp(lb - lse)[..., None] * ob
    leaves = [t.detach().clone().requires_grad_() for t in ins]
    o1, lse1 = cpw.attention(*leaves, w, causal=True, return_lse=True)
    torch.testing.assert_close(o, o1)
    torch.testing.assert_close(lse, lse1)
    do = torch.randn(o.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (o * do).sum().backward()
    (o1 * do).sum().backward()
    for a, b in zip(ins, leaves):
        torch.testing.assert_close(a.grad, b.grad)


def test_lse_gradient_by_finite_differences():
    """torch.autograd.gradcheck (central differences, float64) of o and lse with offsets."""
    ins = inputs(B=1, H=2, Hkv=1, M=4, N=6, D=8, seed=5, grad=True)

    def f(*xs):
        return cpw.attention(*xs, 1, causal=True, return_lse=True, q_offset=3, k_offset=1)

    assert torch.autograd.gradcheck(f, tuple(ins), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_dlse_on_rows_without_keys_contributes_nothing():
    """Causal rows before every key have lse = -inf: any dlse there (even inf or NaN)
    changes no gradient."""
    ins = inputs(M=6, N=4, seed=9)
    o, lse = cpw.attention(*ins, 2, causal=True, return_lse=True, q_offset=-3, k_offset=0)
    empty = torch.isneginf(lse)
    assert empty.any() and not empty.all()
    do = torch.ones_like(o)
    dl = torch.randn(lse.shape, dtype=torch.float64)
    base = cpw.attention_backward(do, *ins, o, lse, 2, causal=True, q_offset=-3, dlse=dl)
    for bad in (math.inf, math.nan):
        dl2 = torch.where(empty, torch.full_like(dl, bad), dl)
        got = cpw.attention_backward(do, *ins, o, lse, 2, causal=True, q_offset=-3, dlse=dl2)
        for a, b in zip(base, got):
            assert torch.equal(a, b)


@pytest.mark.parametrize("kw,err,match", [
    (dict(q_offset=1.5), TypeError, "q_offset"),
    (dict(q_offset=True), TypeError, "q_offset"),
    (dict(k_offset=None), TypeError, "k_offset"),
    (dict(k_offset="3"), TypeError, "k_offset"),
    (dict(q_offset=2**62 + 1), ValueError, "q_offset"),
    (dict(k_offset=-2**62 - 1), ValueError, "k_offset"),
])
@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_offset_errors(kw, err, match, library):
    ins = inputs()
    if library == "numpy":
        ins = [t.numpy() for t in ins]
    with pytest.raises(err, match=match):
        cpw.attention(*ins, 2, **kw)


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_dlse_errors(library):
    ins = inputs()
    if library == "numpy":
        ins = [t.numpy() for t in ins]
    o, lse = cpw.attention(*ins, 2, return_lse=True)
    bad_shape = lse[:, :, :-1]
    with pytest.raises(ValueError, match="dlse"):
        cpw.attention_backward(o, *ins, o, lse, 2, dlse=bad_shape)
    with pytest.raises(TypeError, match="dlse"):
        cpw.attention_backward(o, *ins, o, lse, 2, dlse=o[..., 0].astype(np.int32)
                               if library == "numpy" else o[..., 0].to(torch.int32))


def test_problem_shift_is_normalised():
    """A shift equal to N - M is the default alignment (one memo entry, one kernel form)."""
    ins = inputs(M=5, N=9)
    p = validate.check_inputs(*ins, 3, False, None, 4, 0)
    assert p.shift == 4 and core.clamp_w(p).shift is None
    q = core.clamp_w(dataclasses.replace(p, shift=100))
    assert q.shift == 9 and q.P == 9
