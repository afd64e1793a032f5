"""Property-based fuzzing of the packed variable-length entry points on the CPU
(issue "Reliability", item 1, for ``attention_varlen`` / ``attention_varlen_backward``,
which have no CUDA kernels yet): the number of sequences, each one's query and key lengths
(0 included, more queries than keys included), heads and key/value heads, head dim, w
(below, inside, beyond every distance, negative), causal, and a gradient into lse, against
a dense float64 implementation written here in torch over the whole packed batch (a
block-diagonal mask, positions per sequence), whose gradients torch autograd computes.
Derandomized, ``CUPY_PIECEWISE_FUZZ_EXAMPLES`` examples (default 60); the committed
database tests/fuzz_db replays with ``CUPY_PIECEWISE_FUZZ_RANDOM=1``.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))
import test_fuzz_cpu as fz  # noqa: E402

from cupy_piecewise import varlen  # noqa: E402

torch = pytest.importorskip("torch")


def dense(q1, k1, q2, k2, v, lq, lk, w, causal, scale):
    """o (total_q, H, D) and lse (H, total_q) of the packed batch, float64 torch tensors,
    differentiable: one score matrix over all rows and keys, pairs of different sequences
    and excluded pairs masked."""
    H, Hkv = q1.shape[1], k1.shape[1]
    g = H // Hkv
    seq_q = torch.repeat_interleave(torch.arange(len(lq)), torch.tensor(lq))
    seq_k = torch.repeat_interleave(torch.arange(len(lk)), torch.tensor(lk))
    start_q = torch.tensor(np.concatenate([[0], np.cumsum(lq)[:-1]]), dtype=torch.long)
    start_k = torch.tensor(np.concatenate([[0], np.cumsum(lk)[:-1]]), dtype=torch.long)
    # position of each query (aligned to the end of its own keys) and each key
    pos_q = (torch.arange(sum(lq)) - start_q[seq_q]) + (torch.tensor(lk) - torch.tensor(lq))[seq_q]
    pos_k = torch.arange(sum(lk)) - start_k[seq_k]
    d = pos_q[:, None] - pos_k[None, :]
    same = seq_q[:, None] == seq_k[None, :]
    keep = same & (d >= 0) if causal else same
    kk1, kk2, vv = (x.repeat_interleave(g, dim=1) for x in (k1, k2, v))
    s1 = torch.einsum("qhd,khd->hqk", q1, kk1)
    s2 = torch.einsum("qhd,khd->hqk", q2, kk2)
    s = torch.where(d >= w, s2, s1) * scale
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    has = torch.isfinite(lse)
    p = torch.where(has[..., None], torch.exp(s - torch.where(has, lse, 0.0)[..., None]), 0.0)
    o = torch.einsum("hqk,khd->qhd", p, vv)
    return o, lse


@st.composite
def cases(draw):
    B = draw(st.integers(1, 5))
    lq = [draw(st.sampled_from([0, 1, 2, 7, 16, 17])) for _ in range(B)]
    lk = [draw(st.sampled_from([0, 1, 3, 16, 17, 30])) for _ in range(B)]
    Hkv = draw(st.integers(1, 2))
    H = Hkv * draw(st.sampled_from([1, 2, 3]))
    D = draw(st.sampled_from([8, 16]))
    w = draw(st.one_of(st.integers(-35, 35), st.sampled_from([-(2 ** 40), 2 ** 40])))
    return dict(lq=lq, lk=lk, H=H, Hkv=Hkv, D=D, w=w, causal=draw(st.booleans()),
                seed=draw(st.integers(0, 2 ** 32 - 1)))


@fz.fuzz_settings(int(os.environ.get("CUPY_PIECEWISE_FUZZ_EXAMPLES", "0")) or 60,
                  random=fz.CPU_RANDOM)
@given(case=cases())
def test_varlen_fuzz_against_dense(case):
    lq, lk, H, Hkv, D = case["lq"], case["lk"], case["H"], case["Hkv"], case["D"]
    rng = np.random.default_rng(case["seed"])
    tq, tk = sum(lq), sum(lk)
    xs = [rng.standard_normal(s) for s in [(tq, H, D), (tk, Hkv, D), (tq, H, D), (tk, Hkv, D),
                                           (tk, Hkv, D)]]
    cq, ck = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lq, lk))
    w, causal, scale = case["w"], case["causal"], 1 / np.sqrt(D)
    o, lse = varlen.attention_varlen(*xs, cq, ck, w, causal=causal, return_lse=True)

    leaves = [torch.tensor(x, requires_grad=True) for x in xs]
    o_d, lse_d = dense(*leaves, lq, lk, max(-10 ** 6, min(10 ** 6, w)), causal, scale)
    np.testing.assert_allclose(o, o_d.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), torch.isneginf(lse_d).numpy())
    fin = np.isfinite(lse)
    lse64 = lse_d.detach().numpy()
    # lse comes back in float32 (the API's contract): equal to float32 rounding
    np.testing.assert_allclose(lse[fin], lse64[fin], rtol=2 ** -23, atol=0)

    do = rng.standard_normal(o.shape)
    dl = np.where(fin, rng.standard_normal(lse.shape), 0.0)  # lse = -inf rows take no gradient
    # the float64 lse (accepted on the CPU paths) keeps the gradients at float64 precision
    grads = varlen.attention_varlen_backward(do, *xs, o, lse64, cq, ck, w, causal=causal, dlse=dl)
    loss = (o_d * torch.tensor(do)).sum() + (torch.where(torch.isfinite(lse_d), lse_d, 0.0)
                                             * torch.tensor(dl)).sum()
    want = torch.autograd.grad(loss, leaves, allow_unused=True)
    for name, g, wg in zip(("dq1", "dk1", "dq2", "dk2", "dv"), grads, want):
        wg = np.zeros(g.shape) if wg is None else wg.numpy()
        np.testing.assert_allclose(g, wg, rtol=1e-9, atol=1e-10, err_msg=f"{name} {case}")
