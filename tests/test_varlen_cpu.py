"""Packed variable-length batches on the CPU paths (cupy_piecewise.varlen): each sequence
equals its own padded call, empty sequences, one sequence equals the batched call, torch
autograd through o and lse against per-sequence calls, the NumPy backward with dlse, and
the checks on the running totals."""
from __future__ import annotations

import numpy as np
import pytest

import cupy_piecewise as cpw
from cupy_piecewise import varlen

torch = pytest.importorskip("torch")

LENS = [([3, 0, 5, 1], [4, 0, 9, 1]), ([6], [6]), ([0, 0], [3, 0]), ([2, 7], [7, 2])]


def packed(lq, lk, H=4, Hkv=2, D=16, seed=0):
    rng = np.random.default_rng(seed)
    tq, tk = sum(lq), sum(lk)
    xs = [rng.standard_normal(s) for s in [(tq, H, D), (tk, Hkv, D), (tq, H, D), (tk, Hkv, D), (tk, Hkv, D)]]
    cu = [np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lq, lk)]
    return xs, cu


@pytest.mark.parametrize("lq,lk", LENS)
@pytest.mark.parametrize("causal", [False, True])
def test_numpy_varlen_equals_each_sequence(lq, lk, causal):
    (q1, k1, q2, k2, v), (cq, ck) = packed(lq, lk)
    o, lse = varlen.attention_varlen(q1, k1, q2, k2, v, cq, ck, 2, causal=causal, return_lse=True)
    assert o.shape == q1.shape and lse.shape == (q1.shape[1], q1.shape[0])
    for b in range(len(lq)):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        seq = [x[s].transpose(1, 0, 2)[None] for x, s in zip((q1, k1, q2, k2, v), (qs, ks, qs, ks, ks))]
        ob, lb = cpw.attention(*seq, 2, causal=causal, return_lse=True)
        np.testing.assert_array_equal(o[qs], ob[0].transpose(1, 0, 2))
        np.testing.assert_array_equal(lse[:, qs], lb[0])
    # backward with a gradient into lse, sequence by sequence as well
    rng = np.random.default_rng(1)
    do, dl = rng.standard_normal(o.shape), rng.standard_normal(lse.shape).astype(np.float32)
    grads = varlen.attention_varlen_backward(do, q1, k1, q2, k2, v, o, lse, cq, ck, 2,
                                             causal=causal, dlse=dl)
    for b in range(len(lq)):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        T = lambda x, s: x[s].transpose(1, 0, 2)[None]  # noqa: E731
        gb = cpw.attention_backward(T(do, qs), T(q1, qs), T(k1, ks), T(q2, qs), T(k2, ks), T(v, ks),
                                    T(o, qs), lse[:, qs][None], 2, causal=causal, dlse=dl[:, qs][None])
        for g, w, s in zip(grads, gb, (qs, ks, qs, ks, ks)):
            np.testing.assert_array_equal(g[s], w[0].transpose(1, 0, 2))


def test_one_sequence_equals_the_batched_call():
    (q1, k1, q2, k2, v), (cq, ck) = packed([5], [8])
    o = varlen.attention_varlen(q1, k1, q2, k2, v, cq, ck, 3, causal=True)
    want = cpw.attention(*[x.transpose(1, 0, 2)[None] for x in (q1, k1, q2, k2, v)], 3, causal=True)
    np.testing.assert_array_equal(o, want[0].transpose(1, 0, 2))


@pytest.mark.parametrize("lq,lk", LENS)
def test_torch_varlen_autograd(lq, lk):
    """torch CPU float64: o, lse and the gradients of a loss on both equal per-sequence
    calls'."""
    xs, (cq, ck) = packed(lq, lk, seed=4)
    leaves = [torch.tensor(x, requires_grad=True) for x in xs]
    o, lse = varlen.attention_varlen(*leaves, torch.from_numpy(cq), torch.from_numpy(ck), 1,
                                     causal=True, return_lse=True)
    g = torch.Generator().manual_seed(0)
    do = torch.randn(o.shape, dtype=torch.float64, generator=g)
    dl = torch.randn(lse.shape, dtype=torch.float64, generator=g)
    (o * do).sum().add((torch.nan_to_num(lse, neginf=0.0) * dl).sum()).backward()
    refs = [torch.tensor(x, requires_grad=True) for x in xs]
    loss = 0
    for b in range(len(lq)):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        seq = [x[s].transpose(0, 1)[None] for x, s in zip(refs, (qs, ks, qs, ks, ks))]
        ob, lb = cpw.attention(*seq, 1, causal=True, return_lse=True)
        torch.testing.assert_close(o[qs], ob[0].transpose(0, 1))
        loss = loss + (ob[0].transpose(0, 1) * do[qs]).sum() + (torch.nan_to_num(lb[0], neginf=0.0) * dl[:, qs]).sum()
    if torch.is_tensor(loss):
        loss.backward()
    for a, r in zip(leaves, refs):
        if r.grad is None:  # every sequence empty: no gradient anywhere
            assert a.grad is None or not a.grad.any()
        else:
            torch.testing.assert_close(a.grad, r.grad)


@pytest.mark.parametrize("cu_q,cu_k,err,match", [
    ([1, 3], [0, 3], ValueError, "start at 0"),
    ([0, 3, 2], [0, 1, 3], ValueError, "non-decreasing"),
    ([0, 2], [0, 3], ValueError, "end at the packed length"),
    ([0, 3], [0, 1, 3], ValueError, "same number of sequences"),
    ([[0, 3]], [0, 3], ValueError, "1-D"),
])
def test_running_total_errors(cu_q, cu_k, err, match):
    (q1, k1, q2, k2, v), _ = packed([3], [3])
    with pytest.raises(err, match=match):
        varlen.attention_varlen(q1, k1, q2, k2, v, np.array(cu_q, np.int32), np.array(cu_k, np.int32), 1)


def test_dtype_library_and_max_seqlen_errors():
    (q1, k1, q2, k2, v), (cq, ck) = packed([3, 2], [3, 4])
    with pytest.raises(TypeError, match="int32"):
        varlen.attention_varlen(q1, k1, q2, k2, v, cq.astype(np.float32), ck, 1)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        varlen.attention_varlen(q1, k1, q2, k2, v, torch.from_numpy(cq), ck, 1)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        varlen.attention_varlen(q1, k1, q2, k2, v, cq, ck, 1, max_seqlen_k=3)
    varlen.attention_varlen(q1, k1, q2, k2, v, cq, ck, 1, max_seqlen_q=3, max_seqlen_k=4)
    with pytest.raises(ValueError, match="3 dimensions"):
        varlen.attention_varlen(q1[None], k1, q2, k2, v, cq, ck, 1)


@pytest.mark.parametrize("D", [80, 96, 256])
def test_varlen_new_head_dims_numpy_and_torch_cpu(D):
    """Head dims 80, 96, 256 through both CPU paths of attention_varlen: the torch CPU
    implementation (float64, with autograd) against the NumPy reference, forward and the
    five gradients of a loss through o and lse."""
    (q1, k1, q2, k2, v), (cq, ck) = packed([4, 0, 6], [7, 2, 6], H=2, Hkv=1, D=D, seed=D)
    o, lse = varlen.attention_varlen(q1, k1, q2, k2, v, cq, ck, 2, causal=True, return_lse=True)
    leaves = [torch.from_numpy(x).requires_grad_() for x in (q1, k1, q2, k2, v)]
    ot, lt = varlen.attention_varlen(*leaves, torch.from_numpy(cq), torch.from_numpy(ck), 2,
                                     causal=True, return_lse=True)
    np.testing.assert_allclose(ot.detach().numpy(), o, rtol=1e-10, atol=1e-12)
    # the NumPy path returns lse in float32 (the package's lse dtype there)
    np.testing.assert_allclose(lt.detach().numpy(), lse, rtol=2e-7, atol=0)
    rng = np.random.default_rng(D)
    do, dl = rng.standard_normal(o.shape), rng.standard_normal(lse.shape)
    ((ot * torch.from_numpy(do)).sum() + (lt * torch.from_numpy(dl)).sum()).backward()
    grads = varlen.attention_varlen_backward(do, q1, k1, q2, k2, v, o, lt.detach().numpy(), cq,
                                             ck, 2, causal=True, dlse=dl)
    for g, x in zip(grads, leaves):
        np.testing.assert_allclose(x.grad.numpy(), g, rtol=1e-8, atol=1e-10)


def test_torch_varlen_backward_formula_binds_its_arguments(monkeypatch):
    """The packed autograd formula (varlen_torch._backward) calls cupy_piecewise::varlen_bwd
    with the forward's scalars (w, max_seqlen_q, max_seqlen_k, causal, sm_scale,
    deterministic) and the incoming gradient of lse in their schema places; dlse and
    deterministic come last in the schema, after the arguments the operator had before."""
    import inspect
    import types

    torch = pytest.importorskip("torch")
    from cupy_piecewise import varlen_torch

    schema = str(torch.ops.cupy_piecewise.varlen_bwd.default._schema)
    assert schema.index("float sm_scale") < schema.index("Tensor? dlse=None") < schema.index(
        "bool deterministic=False")
    assert "bool deterministic=False" in str(torch.ops.cupy_piecewise.varlen_fwd.default._schema)
    seen = {}

    def record(*args, **kwargs):
        seen["args"], seen["kwargs"] = args, kwargs
        return tuple(torch.zeros(1) for _ in range(5))

    real = varlen_torch.varlen_bwd_op
    monkeypatch.setattr(varlen_torch, "varlen_bwd_op", record)
    ctx = types.SimpleNamespace(saved_tensors=[torch.zeros(1)] * 9,
                                needs_input_grad=[True] * 5 + [False] * 8,
                                scalars=(7, 10, 12, True, 0.5, True))
    dlse = torch.ones(2)
    grads = varlen_torch._backward(ctx, torch.ones(1), dlse)
    assert len(grads) == 13 and all(g is None for g in grads[5:])
    bound = inspect.signature(getattr(real, "_init_fn", real)).bind(*seen["args"], **seen["kwargs"]).arguments
    assert (bound["w"], bound["max_seqlen_q"], bound["max_seqlen_k"], bound["causal"],
            bound["sm_scale"], bound["deterministic"]) == (7, 10, 12, True, 0.5, True)
    assert bound["dlse"] is dlse


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_every_packed_array_and_bound_is_checked_by_name(lib):
    """The CPU paths check all five packed arrays (not only q1 and k1), the backward's do,
    o, lse and dlse, the max_seqlen bounds' type and range, and the totals' device: extra
    rows are refused, never silently ignored."""
    (q1, k1, q2, k2, v), (cq, ck) = packed([3, 0, 4], [5, 0, 4])
    conv = torch.from_numpy if lib == "torch" else (lambda x: x)
    cat = (lambda x: torch.cat([x, x[:2]])) if lib == "torch" else (
        lambda x: np.concatenate([x, x[:2]]))
    q1, k1, q2, k2, v, cq, ck = map(conv, (q1, k1, q2, k2, v, cq, ck))
    call = cpw.attention_varlen
    for args, match in (((q1, k1, cat(q2), k2, v), "q2 has length"),
                        ((q1, k1, q2, k2, cat(v)), "v has length"),
                        ((q1, k1, q2[None], k2, v), "q2 must have 3 dimensions"),
                        ((q1, k1, q2, k2, v[:, :, 0]), "v must have 3 dimensions")):
        with pytest.raises(ValueError, match=match):
            call(*args, cq, ck, 1)
    for bound, err, match in ((3.5, TypeError, "max_seqlen_q must be an int"),
                              ("x", TypeError, "max_seqlen_q must be an int"),
                              (True, TypeError, "max_seqlen_q must be an int"),
                              (10 ** 6, ValueError, r"max_seqlen_q=1000000 must lie in \[0, 7\]"),
                              (3, ValueError, "below the longest sequence")):
        with pytest.raises(err, match=match):
            call(q1, k1, q2, k2, v, cq, ck, 1, max_seqlen_q=bound)
    o, lse = call(q1, k1, q2, k2, v, cq, ck, 1, return_lse=True, max_seqlen_q=4, max_seqlen_k=5)
    do = o * 0.5
    bwd = cpw.attention_varlen_backward
    for kw, match in ((dict(do=cat(do)), r"do must have shape \(7, 4, 16\)"),
                      (dict(o=o[:3]), r"o must have shape \(7, 4, 16\)"),
                      (dict(lse=lse[:, :3]), r"lse must have shape \(4, 7\)"),
                      (dict(dlse=lse[None]), r"dlse must have shape \(4, 7\)")):
        a = dict(do=do, o=o, lse=lse, dlse=None) | kw
        with pytest.raises(ValueError, match=match):
            bwd(a["do"], q1, k1, q2, k2, v, a["o"], a["lse"], cq, ck, 1, dlse=a["dlse"])
    if lib == "torch":
        with pytest.raises(ValueError, match="cu_seqlens_q is on meta"):
            call(q1, k1, q2, k2, v, cq.to("meta"), ck, 1)
