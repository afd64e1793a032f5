"""The float64 reference with position offsets and a gradient into lse (docs/semantics.md,
planned extensions), against torch autograd on an independent dense float64 version and
against finite differences. Groundwork for offsets, varlen, merges by lse and context
parallelism: the kernels do not take these yet."""
from __future__ import annotations

import numpy as np
import pytest

from cupy_piecewise import reference

torch = pytest.importorskip("torch")


def dense(q1, k1, q2, k2, v, w, causal, scale, q_offset, k_offset):
    """Piecewise attention written out densely in torch (float64, autograd)."""
    B, H, M, D = q1.shape
    Hkv, N = k1.shape[1], k1.shape[2]
    g = H // Hkv
    rep = lambda t: t.repeat_interleave(g, dim=1)  # noqa: E731
    q0 = k_offset + N - M if q_offset is None else q_offset
    d = (q0 + torch.arange(M))[:, None] - (k_offset + torch.arange(N))[None, :]
    s = torch.where(d >= w, q2 @ rep(k2).transpose(-1, -2), q1 @ rep(k1).transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(d < 0, -torch.inf)
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe[..., None])
    return p @ rep(v), lse


CASES = [  # B, H, Hkv, M, N, D, w, causal, q_offset, k_offset
    (1, 2, 2, 7, 9, 8, 3, True, None, 0),       # the default alignment
    (1, 2, 1, 7, 9, 8, 3, True, 100, 95),       # queries after a chunk of keys
    (2, 2, 2, 6, 10, 4, 5, False, 0, 20),       # keys entirely in the future
    (1, 4, 2, 8, 8, 8, 2, True, 30, 0),         # keys far behind: pair 2 where d >= w
    (1, 2, 2, 5, 12, 8, -4, True, -7, -12),     # negative offsets and w
    (1, 2, 2, 9, 6, 8, 1, True, 0, 4),          # some rows have no admissible key
]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_offsets_and_lse_gradient_match_autograd(case):
    B, H, Hkv, M, N, D, w, causal, q0, k0 = case
    rng = np.random.default_rng(abs(hash(case)) % 2**32)
    shapes = [(B, H, M, D), (B, Hkv, N, D), (B, H, M, D), (B, Hkv, N, D), (B, Hkv, N, D)]
    host = [rng.standard_normal(s) for s in shapes]
    scale = 0.6
    o, lse = reference.forward(*host, w, causal, scale, q_offset=q0, k_offset=k0)
    ts = [torch.tensor(x, requires_grad=True) for x in host]
    to, tlse = dense(*ts, w, causal, scale, q0, k0)
    np.testing.assert_allclose(o, to.detach().numpy(), rtol=0, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(lse), torch.isinf(tlse).numpy())
    fin = np.isfinite(lse)
    np.testing.assert_allclose(lse[fin], tlse.detach().numpy()[fin], rtol=0, atol=1e-12)

    do = rng.standard_normal(o.shape)
    dlse = rng.standard_normal(lse.shape)
    loss = (to * torch.tensor(do)).sum() + (torch.where(torch.isinf(tlse), 0, tlse) *
                                            torch.tensor(dlse)).sum()
    loss.backward()
    grads = reference.backward(*host, o, lse, do, w, causal, scale, q_offset=q0, k_offset=k0,
                               dlse=dlse)
    for name, g, t in zip(("dq1", "dk1", "dq2", "dk2", "dv"), grads, ts):
        np.testing.assert_allclose(g, t.grad.numpy(), rtol=0, atol=1e-10, err_msg=name)


def test_lse_gradient_by_finite_differences():
    rng = np.random.default_rng(3)
    B, H, Hkv, M, N, D, w = 1, 1, 1, 4, 6, 3, 2
    host = [rng.standard_normal(s) for s in [(B, H, M, D), (B, Hkv, N, D), (B, H, M, D),
                                              (B, Hkv, N, D), (B, Hkv, N, D)]]
    dlse = rng.standard_normal((B, H, M))

    def f(xs):
        _, lse = reference.forward(*xs, w, True, 0.5)
        return float((np.where(np.isinf(lse), 0, lse) * dlse).sum())

    o, lse = reference.forward(*host, w, True, 0.5)
    grads = reference.backward(*host, o, lse, np.zeros_like(o), w, True, 0.5, dlse=dlse)
    eps = 1e-6
    for gi, (g, x) in enumerate(zip(grads, host)):
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            xp = [a.copy() for a in host]
            xm = [a.copy() for a in host]
            xp[gi][idx] += eps
            xm[gi][idx] -= eps
            num[idx] = (f(xp) - f(xm)) / (2 * eps)
        np.testing.assert_allclose(g, num, rtol=1e-5, atol=1e-7)


def test_default_offsets_are_todays_alignment():
    rng = np.random.default_rng(5)
    host = [rng.standard_normal(s) for s in [(1, 2, 5, 8), (1, 2, 9, 8), (1, 2, 5, 8),
                                              (1, 2, 9, 8), (1, 2, 9, 8)]]
    a = reference.forward(*host, 2, True)
    b = reference.forward(*host, 2, True, q_offset=104, k_offset=100)
    c = reference.forward(*host, 2, True, q_offset=None, k_offset=-50)
    for x, y, z in zip(a, b, c):
        np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(x, z)


def test_merge_of_two_key_ranges_equals_one_call():
    """Splitting the keys into two ranges (offsets keep the global positions) and merging
    the partial results by their lse gives the whole call: the identity context
    parallelism and varlen merges rely on."""
    rng = np.random.default_rng(7)
    M, N, D, w = 6, 14, 8, 4
    q1, q2 = rng.standard_normal((2, 1, 2, M, D))
    k1, k2, v = rng.standard_normal((3, 1, 2, N, D))
    q0 = N - M
    o, lse = reference.forward(q1, k1, q2, k2, v, w, True)
    cut = 9
    parts = [reference.forward(q1, k1[:, :, a:b], q2, k2[:, :, a:b], v[:, :, a:b], w, True,
                               q_offset=q0, k_offset=a) for a, b in ((0, cut), (cut, N))]
    (oa, la), (ob, lb) = parts
    m = np.maximum(la, lb)
    m_safe = np.where(np.isinf(m), 0, m)
    wa, wb = np.exp(la - m_safe), np.exp(lb - m_safe)
    merged = (wa[..., None] * oa + wb[..., None] * ob) / (wa + wb)[..., None]
    np.testing.assert_allclose(merged, o, rtol=0, atol=1e-12)
    np.testing.assert_allclose(m_safe + np.log(wa + wb), lse, rtol=0, atol=1e-12)


def test_lowp_takes_offsets_and_dlse():
    rng = np.random.default_rng(9)
    host = [rng.standard_normal(s).astype(np.float32) for s in
            [(1, 2, 6, 16), (1, 2, 9, 16), (1, 2, 6, 16), (1, 2, 9, 16), (1, 2, 9, 16)]]
    kw = dict(q_offset=40, k_offset=30)
    o, lse = reference.forward(*host, 5, True, **kw)
    lo, llse = reference.lowp_forward(*host, 5, True, dtype="float32", **kw)
    np.testing.assert_allclose(lo, o, rtol=1e-5, atol=1e-5)
    do, dlse = rng.standard_normal(o.shape), rng.standard_normal(lse.shape)
    g = reference.backward(*host, o, lse, do, 5, True, dlse=dlse, **kw)
    lg = reference.lowp_backward(*host, o, lse, do, 5, True, dtype="float32", dlse=dlse, **kw)
    for a, b in zip(g, lg):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)
