"""torch integration on the CPU: the torch implementation, autograd, the custom ops,
torch.compile and autocast. Runs everywhere (no GPU needed)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupy_piecewise  # noqa: E402
from cupy_piecewise import reference, tolerance, torch_cpu, torch_ops  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def make_inputs(B, H, Hkv, M, N, D, dtype=torch.float64, seed=0, scale=1.0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        t = (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)
        return t.requires_grad_(requires_grad)

    return r(B, H, M, D), r(B, Hkv, N, D), r(B, H, M, D), r(B, Hkv, N, D), r(B, Hkv, N, D)


def np64(*ts):
    return [t.detach().to(torch.float64).numpy() for t in ts]


def assert_allclose_inf(name, got, want, atol):
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert not np.isnan(got).any(), f"{name}: NaN"
    inf = np.isinf(want)
    assert np.array_equal(np.isinf(got), inf), f"{name}: -inf pattern differs"
    assert np.array_equal(got[inf], want[inf]), f"{name}: inf signs differ"
    if (~inf).any():
        err = np.abs(got[~inf] - want[~inf]).max()
        assert err <= atol, f"{name}: max abs error {err:.3e} > {atol:.1e}"


# (B, H, Hkv, M, N, D, w, causal)
CASES = [
    (1, 1, 1, 8, 8, 16, 3, False),
    (2, 2, 2, 13, 13, 32, 5, True),
    (1, 4, 1, 7, 19, 16, 6, True),  # GQA 4, M < N
    (2, 4, 2, 11, 11, 8, 4, False),  # GQA 2
    (1, 2, 2, 17, 6, 16, 2, True),  # causal M > N: rows 0..10 are empty
    (1, 2, 1, 9, 4, 8, 1, True),  # GQA + empty rows
    (1, 2, 2, 10, 12, 16, -3, False),  # negative w: some future keys take pair 2
    (1, 2, 2, 10, 12, 16, -3, True),
    (1, 1, 1, 10, 12, 16, 0, False),  # w = 0: all past keys take pair 2
    (1, 2, 2, 9, 9, 16, 100, True),  # w beyond every distance: pair 1 only
    (1, 2, 2, 9, 9, 16, -100, False),  # w below every distance: pair 2 only
    (2, 3, 3, 1, 20, 64, 7, True),  # a single query row (decoding)
    (1, 2, 2, 20, 1, 16, 0, True),  # a single key, most rows empty
    (1, 6, 3, 33, 31, 24, 10, False),  # non-power-of-two head dim
]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_forward_backward_match_reference(case, dtype, atol):
    B, H, Hkv, M, N, D, w, causal = case
    q1, k1, q2, k2, v = make_inputs(B, H, Hkv, M, N, D, dtype, seed=hash(case) % 1000)
    copies = [t.clone() for t in (q1, k1, q2, k2, v)]
    o, lse = torch_ops.attention(q1, k1, q2, k2, v, w, causal=causal, return_lse=True)
    assert o.dtype == dtype and o.shape == (B, H, M, D) and o.is_contiguous()
    assert lse.shape == (B, H, M)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    ro, rlse = reference.forward(*np64(q1, k1, q2, k2, v), w, causal, None)
    assert_allclose_inf("o", o.numpy(), ro, atol)
    assert_allclose_inf("lse", lse.numpy(), rlse, atol * 10)

    do = make_inputs(B, H, H, M, 1, D, dtype, seed=7)[0]
    grads = torch_ops.attention_backward(do, q1, k1, q2, k2, v, o, lse, w, causal=causal)
    rgrads = reference.backward(*np64(q1, k1, q2, k2, v), ro, rlse, *np64(do), w, causal, None)
    for name, g, rg in zip(("dq1", "dk1", "dq2", "dk2", "dv"), grads, rgrads):
        assert g.dtype == dtype and g.is_contiguous()
        assert_allclose_inf(name, g.numpy(), rg, atol * 10)

    # autograd gives the same gradients as attention_backward
    leaves = [t.detach().clone().requires_grad_() for t in (q1, k1, q2, k2, v)]
    torch_ops.attention(*leaves, w, causal=causal).backward(do)
    for name, leaf, g in zip(("dq1", "dk1", "dq2", "dk2", "dv"), leaves, grads):
        torch.testing.assert_close(leaf.grad, g, rtol=0, atol=0, msg=name)
        assert not torch.isnan(leaf.grad).any()

    for t, c in zip((q1, k1, q2, k2, v), copies):
        assert torch.equal(t, c), "inputs were modified"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_types_follow_tolerance_rule(dtype):
    tdt = getattr(torch, dtype)
    q1, k1, q2, k2, v = make_inputs(2, 4, 2, 37, 45, 32, tdt, seed=3, scale=2.0)
    w, causal = 9, True
    o, lse = torch_ops.attention(q1, k1, q2, k2, v, w, causal=causal, return_lse=True)
    assert o.dtype == tdt and lse.dtype == torch.float32
    args = np64(q1, k1, q2, k2, v)
    ro, rlse = reference.forward(*args, w, causal)
    lo, llse = reference.lowp_forward(*args, w, causal, dtype=dtype)
    tolerance.assert_close("o", o.float().numpy(), ro, lo, dtype)
    tolerance.assert_close("lse", lse.numpy(), rlse, llse, dtype)
    do = make_inputs(2, 4, 4, 37, 1, 32, tdt, seed=4)[0]
    grads = torch_ops.attention_backward(do, q1, k1, q2, k2, v, o, lse, w, causal=causal)
    rg = reference.backward(*args, *np64(o, lse, do), w, causal)
    lg = reference.lowp_backward(*args, *np64(o, lse, do), w, causal, dtype=dtype)
    for name, g, r, lw in zip(("dq1", "dk1", "dq2", "dk2", "dv"), grads, rg, lg):
        assert g.dtype == tdt
        tolerance.assert_close(name, g.float().numpy(), r, lw, dtype)


def test_chunking_gives_same_result(monkeypatch):
    """Small chunk budget: many row chunks, including a ragged last one."""
    q1, k1, q2, k2, v = make_inputs(1, 4, 2, 29, 23, 16, seed=11)
    do = torch.randn(1, 4, 29, 16, dtype=torch.float64)
    o, lse = torch_ops.attention(q1, k1, q2, k2, v, 4, causal=True, return_lse=True)
    g = torch_ops.attention_backward(do, q1, k1, q2, k2, v, o, lse, 4, causal=True)
    monkeypatch.setattr(torch_cpu, "_CPU_CHUNK_ELEMENTS", 4 * 23 * 3)  # 3 rows per chunk
    assert torch_cpu._chunk_rows(1, 4, 23) == 3
    o2, lse2 = torch_ops.attention(q1, k1, q2, k2, v, 4, causal=True, return_lse=True)
    g2 = torch_ops.attention_backward(do, q1, k1, q2, k2, v, o2, lse2, 4, causal=True)
    torch.testing.assert_close(o2, o, rtol=0, atol=1e-13)
    torch.testing.assert_close(lse2, lse, rtol=0, atol=1e-13)
    for a, b in zip(g2, g):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)


def test_strided_inputs():
    """(B, L, H, D) memory read as (B, H, L, D), and a non-unit last stride."""
    B, H, Hkv, M, N, D = 2, 4, 2, 10, 12, 16
    q1, k1, q2, k2, v = make_inputs(B, H, Hkv, M, N, D, seed=5)
    tr = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q1, k1, q2, k2, v)]
    assert not tr[0].is_contiguous()
    sl = [torch.stack([t, -t], dim=-1).flatten(-2)[..., ::2] for t in (q1, k1, q2, k2, v)]
    assert sl[0].stride(-1) == 2
    want = torch_ops.attention(q1, k1, q2, k2, v, 3, causal=True)
    torch.testing.assert_close(torch_ops.attention(*tr, 3, causal=True), want, rtol=0, atol=1e-14)
    torch.testing.assert_close(torch_ops.attention(*sl, 3, causal=True), want, rtol=0, atol=1e-14)


def test_empty_sizes():
    q1, k1, q2, k2, v = make_inputs(1, 2, 2, 0, 5, 16, requires_grad=True)
    o, lse = torch_ops.attention(q1, k1, q2, k2, v, 1, return_lse=True)
    assert o.shape == (1, 2, 0, 16) and lse.shape == (1, 2, 0)
    o.sum().backward()
    assert k1.grad.shape == k1.shape and torch.count_nonzero(k1.grad) == 0

    q1, k1, q2, k2, v = make_inputs(1, 2, 2, 4, 0, 16, requires_grad=True)
    o, lse = torch_ops.attention(q1, k1, q2, k2, v, 1, return_lse=True)
    assert torch.equal(o, torch.zeros_like(o))
    assert torch.isneginf(lse).all()
    o.sum().backward()
    assert torch.equal(q1.grad, torch.zeros_like(q1))


def test_empty_rows_have_no_nan_gradients():
    q1, k1, q2, k2, v = make_inputs(1, 2, 1, 12, 5, 16, requires_grad=True)
    o, lse = torch_ops.attention(q1, k1, q2, k2, v, 2, causal=True, return_lse=True)
    assert torch.isneginf(lse[:, :, :7]).all() and torch.isfinite(lse[:, :, 7:]).all()
    assert torch.equal(o[:, :, :7], torch.zeros_like(o[:, :, :7]))
    (o * torch.randn_like(o)).sum().backward()
    for t in (q1, k1, q2, k2, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q1.grad[:, :, :7], torch.zeros_like(q1.grad[:, :, :7]))


GRADCHECK_CASES = [
    # (B, H, Hkv, M, N, D, w, causal)
    (1, 2, 2, 5, 6, 4, 2, False),
    (1, 2, 2, 6, 6, 4, 2, True),
    (2, 4, 2, 4, 5, 3, 1, True),  # GQA
    (1, 2, 1, 7, 4, 4, 1, True),  # GQA, M > N: empty rows
    (1, 1, 1, 5, 5, 4, -1, False),  # negative w
]


@pytest.mark.parametrize("direct", [True, False], ids=["autograd.Function", "custom_op"])
@pytest.mark.parametrize("case", GRADCHECK_CASES, ids=[str(c) for c in GRADCHECK_CASES])
def test_gradcheck(case, direct, monkeypatch):
    """Both autograd routes: eager calls record an autograd.Function, the rest the op's formula."""
    monkeypatch.setattr(torch_ops, "DIRECT_EAGER_CALLS", direct)
    B, H, Hkv, M, N, D, w, causal = case
    ins = make_inputs(B, H, Hkv, M, N, D, torch.float64, seed=1, requires_grad=True)

    def f(*xs):
        return torch_ops.attention(*xs, w, causal=causal, sm_scale=0.7)

    assert torch.autograd.gradcheck(f, ins)


def test_only_some_inputs_require_grad():
    q1, k1, q2, k2, v = make_inputs(1, 2, 2, 6, 7, 8)
    q2.requires_grad_()
    v.requires_grad_()
    o, lse = torch_ops.attention(q1, k1, q2, k2, v, 2, causal=True, return_lse=True)
    do = torch.randn_like(o)
    o.backward(do)
    assert q1.grad is None and k1.grad is None and k2.grad is None
    want = torch_ops.attention_backward(do, q1, k1, q2.detach(), k2, v.detach(), o.detach(), lse, 2, causal=True)
    torch.testing.assert_close(q2.grad, want[2], rtol=0, atol=0)
    torch.testing.assert_close(v.grad, want[4], rtol=0, atol=0)

    # the autograd formula itself returns None for inputs that need no gradient
    class Ctx:
        pass

    ctx = Ctx()
    ctx.saved_tensors = (q1, k1, q2.detach(), k2, v.detach(), o.detach(), lse)
    # the operator's inputs: q1, k1, q2, k2, v, w, causal, sm_scale, deterministic, q_offset,
    # k_offset
    ctx.needs_input_grad = (False, False, True, False, True) + (False,) * 6
    ctx.w, ctx.causal, ctx.sm_scale, ctx.deterministic = 2, True, 1 / math.sqrt(8), False
    ctx.q_offset, ctx.k_offset, ctx.n_inputs = None, 0, 11
    grads = torch_ops._backward(ctx, do, None)
    assert len(grads) == 11
    assert [g is not None for g in grads] == list(ctx.needs_input_grad)
    ctx.needs_input_grad = (False,) * 11
    assert torch_ops._backward(ctx, do, None) == (None,) * 11


@pytest.mark.parametrize("direct", [True, False], ids=["autograd.Function", "custom_op"])
def test_eager_autograd_routes(direct, monkeypatch):
    monkeypatch.setattr(torch_ops, "DIRECT_EAGER_CALLS", direct)
    ins = make_inputs(2, 4, 2, 9, 11, 16, torch.float64, seed=5, requires_grad=True)
    o, lse = torch_ops.attention(*ins, 4, causal=True, return_lse=True)
    node = type(o.grad_fn).__name__
    assert ("_Attention" in node) == direct, node
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, ins, do)
    want = torch_ops.attention_backward(do, *[t.detach() for t in ins], o.detach(), lse, 4,
                                        causal=True)
    for g, wg in zip(grads, want):
        assert torch.equal(g, wg)
    # no double backward through either route
    o = torch_ops.attention(*ins, 4, causal=True)
    (g,) = torch.autograd.grad(o, ins[0], torch.ones_like(o), create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(g.sum(), ins[1])


def test_lse_is_differentiable():
    """A loss on lse alone reaches the inputs (see test_training_features_cpu.py for values)."""
    q1, k1, q2, k2, v = make_inputs(1, 1, 1, 4, 4, 8, requires_grad=True)
    o, lse = torch_ops.attention(q1, k1, q2, k2, v, 2, return_lse=True)
    assert o.requires_grad and lse.requires_grad
    lse.sum().backward()
    assert q1.grad is not None and float(q1.grad.abs().sum()) > 0
    assert float(v.grad.abs().sum()) == 0  # lse does not depend on v


def test_direct_and_dispatcher_paths_agree(monkeypatch):
    q1, k1, q2, k2, v = make_inputs(2, 4, 2, 9, 11, 16, seed=2)
    do = torch.randn(2, 4, 9, 16, dtype=torch.float64)
    assert torch_ops._direct_ok(q1, k1, q2, k2, v)
    o, lse = torch_ops.attention(q1, k1, q2, k2, v, 3, causal=True, return_lse=True)
    g = torch_ops.attention_backward(do, q1, k1, q2, k2, v, o, lse, 3, causal=True)
    monkeypatch.setattr(torch_ops, "DIRECT_EAGER_CALLS", False)
    calls = []
    real = torch_ops._fwd_impl
    monkeypatch.setattr(torch_ops, "_fwd_impl", lambda *a, **k: calls.append(1) or real(*a, **k))
    o2, lse2 = torch_ops.attention(q1, k1, q2, k2, v, 3, causal=True, return_lse=True)
    g2 = torch_ops.attention_backward(do, q1, k1, q2, k2, v, o2, lse2, 3, causal=True)
    assert calls, "the custom op was not used"
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    for a, b in zip(g, g2):
        assert torch.equal(a, b)


def test_direct_path_not_taken_under_modes():
    q1, k1, q2, k2, v = make_inputs(1, 1, 1, 4, 4, 8)
    assert torch_ops._direct_ok(q1, k1, q2, k2, v)
    with torch.enable_grad():
        assert not torch_ops._direct_ok(q1.requires_grad_(), k1, q2, k2, v)
    q1.requires_grad_(False)
    with torch.no_grad():
        assert torch_ops._direct_ok(torch.nn.Parameter(q1), k1, q2, k2, v) is False
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Mode.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Mode():
        torch_ops.attention(q1, k1, q2, k2, v, 2)
    assert any("cupy_piecewise" in name for name in Mode.ops)
    # functorch transforms (vmap) are not bypassed either
    seen = []
    torch.vmap(lambda x: seen.append(torch_ops._direct_ok(x, k1, q2, k2, v)) or x)(q1)
    assert seen == [False]


def test_opcheck_cpu():
    for case in [(1, 2, 2, 5, 6, 8, 2, True), (2, 4, 2, 6, 6, 8, -1, False), (1, 2, 1, 7, 3, 8, 1, True)]:
        B, H, Hkv, M, N, D, w, causal = case
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            ins = make_inputs(B, H, Hkv, M, N, D, dtype, requires_grad=True)
            torch.library.opcheck(torch.ops.cupy_piecewise.fwd.default, (*ins, w, causal, 0.3))
            plain = [t.detach() for t in ins]
            o, lse = torch.ops.cupy_piecewise.fwd(*plain, w, causal, 0.3)
            do = torch.randn_like(o)
            torch.library.opcheck(
                torch.ops.cupy_piecewise.bwd.default, (do, *plain, o, lse, w, causal, 0.3)
            )


class PiecewiseLayer(torch.nn.Module):
    def __init__(self, public_api=False):
        super().__init__()
        self.fn = cupy_piecewise.attention if public_api else torch_ops.attention

    def forward(self, q1, k1, q2, k2, v, w):
        return self.fn(q1, k1, q2, k2, v, w, causal=True).square().sum(dim=-1)


def _compile_backend():
    """inductor where a C++ compiler is found (it compiles CPU kernels), else aot_eager.

    CUPY_PIECEWISE_TEST_COMPILE_BACKEND overrides the choice.
    """
    import shutil

    env = os.environ.get("CUPY_PIECEWISE_TEST_COMPILE_BACKEND")
    if env:
        return env
    return "inductor" if (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")) else "aot_eager"


@pytest.mark.parametrize("public_api", [False, True])
def test_torch_compile_fullgraph(public_api):
    torch._dynamo.reset()
    layer = PiecewiseLayer(public_api)
    compiled = torch.compile(layer, fullgraph=True, backend=_compile_backend())
    for w, M in ((3, 9), (5, 9), (2, 12)):  # new w and new length: recompiles or symbolic
        ins = make_inputs(1, 4, 2, M, 10, 16, torch.float32, seed=w, requires_grad=True)
        ref_ins = [t.detach().clone().requires_grad_() for t in ins]
        y = compiled(*ins, w)
        y_ref = layer(*ref_ins, w)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        y.sum().backward()
        y_ref.sum().backward()
        for a, b in zip(ins, ref_ins):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)


def test_autocast_cpu():
    ins = make_inputs(1, 2, 2, 8, 8, 16, torch.float32, seed=9)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = torch_ops.attention(*ins, 3, causal=True)
    assert o.dtype == torch.bfloat16
    want = torch_ops.attention(*(t.to(torch.bfloat16) for t in ins), 3, causal=True)
    torch.testing.assert_close(o, want, rtol=0, atol=0)
    # backward under autocast: float32 leaves get float32 gradients through the cast
    leaves = [t.clone().requires_grad_() for t in ins]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = torch_ops.attention(*leaves, 3, causal=True)
    o.float().square().sum().backward()
    for t in leaves:
        assert t.grad.dtype == torch.float32 and torch.isfinite(t.grad).all()
    # float64 inputs are left alone by autocast
    ins64 = make_inputs(1, 2, 2, 8, 8, 16, torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch_ops.attention(*ins64, 3).dtype == torch.float64


def test_public_api_dispatches_to_torch():
    ins = make_inputs(1, 2, 1, 6, 6, 16, torch.float32, requires_grad=True)
    o, lse = cupy_piecewise.attention(*ins, 2, causal=True, return_lse=True)
    assert isinstance(o, torch.Tensor) and o.grad_fn is not None
    want = torch_ops.attention(*ins, 2, causal=True)
    torch.testing.assert_close(o, want, rtol=0, atol=0)
    do = torch.randn_like(o)
    grads = cupy_piecewise.attention_backward(do, *[t.detach() for t in ins], o.detach(), lse, 2, causal=True)
    o.backward(do)
    for t, g in zip(ins, grads):
        torch.testing.assert_close(t.grad, g, rtol=0, atol=0)


@pytest.mark.parametrize(
    "mutate,exc,word",
    [
        (lambda a: a.__setitem__(1, a[1].float()), TypeError, "k1"),  # mixed dtypes
        (lambda a: a.__setitem__(4, a[4][:, :, :-1]), ValueError, "v"),  # length mismatch
        (lambda a: a.__setitem__(0, a[0][0]), ValueError, "q1"),  # rank 3
        (lambda a: a.__setitem__(5, 2.0), TypeError, "dist_threshold"),
        (lambda a: a.__setitem__(5, True), TypeError, "dist_threshold"),
        (lambda a: a.__setitem__(2, a[2].numpy()), TypeError, "q2"),
    ],
)
def test_bad_input_errors(mutate, exc, word):
    args = [*make_inputs(1, 2, 2, 4, 4, 8, torch.float64), 2]
    mutate(args)
    with pytest.raises(exc, match=word):
        torch_ops.attention(*args)
    # a failed call leaves nothing cached that would let a later call skip the check
    with pytest.raises(exc, match=word):
        torch_ops.attention(*args)


def test_problem_cache_distinguishes_scalar_types():
    ins = make_inputs(1, 1, 1, 4, 4, 8)
    torch_ops.attention(*ins, 3)
    with pytest.raises(TypeError, match="dist_threshold"):
        torch_ops.attention(*ins, 3.0)
    with pytest.raises(TypeError, match="causal"):
        torch_ops.attention(*ins, 3, causal=1)


def test_example_script_runs():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "rerope_attention.py")],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("w,kw,match", [
    (True, {}, "dist_threshold"), (2.5, {}, "dist_threshold"), (2, {"causal": 1}, "causal"),
    (2, {"causal": "yes"}, "causal"), (2, {"sm_scale": True}, "sm_scale"),
    (2, {"sm_scale": -1.0}, "sm_scale"),
])
def test_bad_scalars_are_refused_under_torch_compile_as_in_eager(w, kw, match):
    """The compiled call checks its scalars before the operator's schema converts them
    (w=True would become 1, causal=1 True): the same TypeError/ValueError as eager."""
    g = torch.Generator().manual_seed(3)
    x = [torch.randn(1, 2, 8, 16, generator=g) for _ in range(5)]
    with pytest.raises((TypeError, ValueError), match=match):
        cupy_piecewise.attention(*x, w, **kw)
    torch._dynamo.reset()
    fn = torch.compile(lambda *a: cupy_piecewise.attention(*a, w, **kw), backend="eager")
    with pytest.raises((TypeError, ValueError), match=match):
        fn(*x)
