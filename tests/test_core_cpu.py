"""The array core (prepare, run_forward, run_backward, the memo) without a GPU.

A stand-in for cupy_piecewise.launch reads the pointers the core hands it back as host
memory and computes with the torch CPU implementation, so the core's decisions (read in
place or copy, fast path or general path, argument order, empty problems, the clamp of
w) are checked on any machine. The GPU tests check the same paths against the kernels.
"""
from __future__ import annotations

import ctypes
import dataclasses
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cupy_piecewise import core, launch, torch_cpu, torch_ops, validate  # noqa: E402
from cupy_piecewise.adapters import torch as torch_adapter  # noqa: E402
from cupy_piecewise.core import plan as core_plan  # noqa: E402


def make_inputs(B, H, Hkv, M, N, D, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, M, D), (B, Hkv, N, D), (B, H, M, D), (B, Hkv, N, D), (B, Hkv, N, D))
    return [torch.randn(*s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]


def _host_view(ptr, shape, strides, dtype):
    itemsize = torch.empty((), dtype=dtype).element_size()
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if all(shape) else 0
    buf = (ctypes.c_char * (extent * itemsize)).from_address(ptr)
    return torch.frombuffer(buf, dtype=dtype, count=extent).as_strided(shape, strides)


class _FakeLaunch:
    """Same interface as cupy_piecewise.launch, computing on host memory."""

    ArrayRef = launch.ArrayRef
    kernel_ready = staticmethod(launch.kernel_ready)
    Launches = launch.Launches

    def __init__(self):
        self.calls = []

    def _views(self, problem, refs, kinds, dtype):
        shapes = {"q": (problem.B, problem.H, problem.M, problem.D),
                  "k": (problem.B, problem.Hkv, problem.N, problem.D)}
        out = []
        for r, kind in zip(refs, kinds):
            assert isinstance(r, self.ArrayRef)
            assert self.kernel_ready(shapes[kind], r.strides, r.ptr, 2), "not kernel_ready"
            out.append(_host_view(r.ptr, shapes[kind], r.strides, dtype))
        return out

    def forward(self, problem, q1, k1, q2, k2, v, o, lse, *, stream, workspace=None):
        assert isinstance(lse, int) and stream == 1234
        # clamp_w: within M + N + 1 of 0 (default alignment) or 2 (M + N) + 1 (offsets)
        assert abs(problem.w) <= 2 * (problem.M + problem.N) + 1, "w reaches the kernels unclamped"
        self.calls.append(("fwd", (q1, k1, q2, k2, v, o, lse)))
        dt = getattr(torch, problem.dtype)
        Q1, K1, Q2, K2, V, O = self._views(problem, (q1, k1, q2, k2, v, o), "qkqkkq", dt)
        oo, ll = torch_cpu.forward(Q1, K1, Q2, K2, V, problem.w, problem.causal, problem.sm_scale,
                                   problem.shift)
        O.copy_(oo)
        if lse:  # a null lse is not stored (as the kernels do)
            _host_view(lse, (problem.B, problem.H, problem.M),
                       (problem.H * problem.M, problem.M, 1), torch.float32).copy_(ll)

    def forward_launches(self, problem, strides, *, split):
        """Stand-in for launch.forward_launches: run() reads the pointers as host memory."""
        assert split and problem.B and problem.H and problem.M and problem.N
        fake = self

        class Launches:
            workspace_bytes = 0

            def run(self, ptrs, stream, workspace=0):
                refs = [fake.ArrayRef(p, s) for p, s in zip(ptrs[:6], strides)]
                fake.forward(problem, *refs, ptrs[6], stream=stream)
                fake.calls[-1] = ("fwd fast",) + fake.calls[-1][1:]

        return Launches()

    def backward(self, problem, q1, k1, q2, k2, v, o, lse, do, dq1, dk1, dq2, dk2, dv, delta, *, stream,
                 workspace=None, deterministic=False, dlse=0):
        assert isinstance(lse, int) and isinstance(delta, int) and stream == 1234
        assert callable(workspace) and deterministic in (False, True)
        assert problem.B and problem.H and problem.M and problem.N, "launched an empty problem"
        self.calls.append(("bwd", (q1, k1, q2, k2, v, o, lse, do)))
        dt = getattr(torch, problem.dtype)
        views = self._views(problem, (q1, k1, q2, k2, v, o, do, dq1, dk1, dq2, dk2, dv),
                            "qkqkkqqqkqkk", dt)
        L = _host_view(lse, (problem.B, problem.H, problem.M),
                       (problem.H * problem.M, problem.M, 1), torch.float32)
        Q1, K1, Q2, K2, V, O, DO = views[:7]
        DL = None if not dlse else _host_view(dlse, (problem.B, problem.H, problem.M),
                                              (problem.H * problem.M, problem.M, 1), torch.float32)
        grads = torch_cpu.backward(DO, Q1, K1, Q2, K2, V, O, L, problem.w, problem.causal,
                                   problem.sm_scale, problem.shift, DL)
        for view, g in zip(views[7:], grads):
            view.copy_(g)


_DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _host_copy(t):
    c = torch.empty(t.shape, dtype=t.dtype)
    c.copy_(t)
    return c


#: The torch adapter's operations with host allocations and a fixed stream.
HOST_OPS = torch_adapter.OPS._replace(
    empty=lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=_DT[dtype]),
    empty_like=lambda t, device: torch.full(t.shape, float("nan"), dtype=t.dtype),
    scratch=lambda nbytes, device: torch.empty(nbytes, dtype=torch.uint8),
    copy=_host_copy,
    stream=lambda device: 1234,
)


@pytest.fixture
def fake_cuda(monkeypatch):
    """The core sees CPU tensors as if on device 0 and launches the host stand-in."""
    fake = _FakeLaunch()
    monkeypatch.setattr(core_plan, "launch", fake)
    real = validate.check_inputs
    monkeypatch.setattr(core_plan.validate, "check_inputs",
                        lambda *a: dataclasses.replace(real(*a), device=0))
    monkeypatch.setattr(core_plan.validate, "check_gpu_support", lambda problem: None)
    core.MEMO.clear()
    yield fake
    core.MEMO.clear()


def _layout(base, layout, dtype):
    if layout == "contiguous":
        return base
    if layout == "transposed":  # (B, L, H, D) memory
        return [t.transpose(1, 2).contiguous().transpose(1, 2) for t in base]
    if layout == "last_stride_2":
        return [torch.stack([t, -t], dim=-1).flatten(-2)[..., ::2] for t in base]
    ins = []  # contiguous for torch, but the data pointer is 2 bytes off 16-byte alignment
    for t in base:
        flat = torch.empty(t.numel() + 8, dtype=dtype)
        start = next(i for i in range(8) if (flat.data_ptr() + 2 * i) % 16 == 2)
        view = flat[start : start + t.numel()].view(t.shape)
        view.copy_(t)
        assert view.is_contiguous()
        ins.append(view)
    return ins


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "last_stride_2", "misaligned"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_core_paths_with_fake_launch(fake_cuda, layout, dtype):
    B, H, Hkv, M, N, D, w = 2, 4, 2, 19, 23, 16, 5
    base = make_inputs(B, H, Hkv, M, N, D, dtype, seed=21)
    ins = _layout(base, layout, dtype)
    call = core.prepare(HOST_OPS, torch_adapter.key(*ins, w, True, None), *ins, w, True, None)
    assert call.problem.device == 0
    want_o, want_lse = torch_cpu.forward(*base, w, True, call.problem.sm_scale)
    zero_copy = layout in ("contiguous", "transposed")
    # Prepared launches exist for every layout the kernels read in place by strides (a
    # misaligned pointer is only seen at run time).
    assert (call.fwd is None) == (layout == "last_stride_2")
    for c in (call, call._replace(fwd=None)):  # the fast path, then the general path
        o, lse = core.run_forward(c, HOST_OPS, *ins)
        assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
        kind, refs = fake_cuda.calls.pop()
        assert kind == ("fwd fast" if c.fwd is not None and zero_copy else "fwd")
        for r, t in zip(refs[:5], ins):
            assert (r.ptr == t.data_ptr()) == zero_copy
        assert refs[5].ptr == o.data_ptr() and refs[6] == lse.data_ptr()
    assert fake_cuda.calls == []
    # without need_lse the fast path passes a null lse and returns None for it
    o_only, no_lse = core.run_forward(call, HOST_OPS, *ins, need_lse=False)
    assert torch.equal(o_only, want_o)
    kind, refs = fake_cuda.calls.pop()
    assert (no_lse is None) == (kind == "fwd fast") == (refs[6] == 0) == zero_copy

    do = make_inputs(B, H, H, M, 1, D, dtype, seed=3)[0].transpose(1, 2).contiguous().transpose(1, 2)
    grads = core.run_backward(call, HOST_OPS, do, *ins, o, lse)
    want = torch_cpu.backward(do, *base, want_o, want_lse, w, True, call.problem.sm_scale)
    for g, wg in zip(grads, want):
        assert torch.equal(g, wg) and g.is_contiguous()
    _, refs = fake_cuda.calls[0]
    assert refs[7].ptr == do.data_ptr()  # transposed do is read in place


@pytest.mark.parametrize("B,H,Hkv,M,N", [(0, 2, 2, 5, 6), (1, 0, 2, 5, 6), (1, 2, 2, 0, 6),
                                         (1, 2, 2, 5, 0), (0, 0, 1, 0, 0)])
def test_core_empty_problems(fake_cuda, B, H, Hkv, M, N):
    """B, H, M or N = 0: nothing launched; o = 0 and lse = -inf for rows without keys,
    zero gradients (the outputs start as NaN, so an unwritten element shows)."""
    ins = make_inputs(B, H, Hkv, M, N, 16)
    call = core.prepare(HOST_OPS, None, *ins, 1, False, None)
    assert call.fwd is None
    o, lse = core.run_forward(call, HOST_OPS, *ins)
    assert o.shape == (B, H, M, 16) and lse.shape == (B, H, M)
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()
    grads = core.run_backward(call, HOST_OPS, torch.ones_like(o), *ins, o, lse)
    for g, t in zip(grads, ins):
        assert g.shape == t.shape and torch.count_nonzero(g) == 0 and not g.isnan().any()
    assert fake_cuda.calls == []


@pytest.mark.parametrize("w", [10**20, -(10**20), 2**63, -(2**63) - 1])
def test_core_clamps_w_for_the_kernels(fake_cuda, w):
    ins = make_inputs(1, 2, 2, 9, 11, 16, seed=4)
    call = core.prepare(HOST_OPS, None, *ins, w, False, None)
    assert call.problem.w == (1 if w > 0 else -1) * (9 + 11 + 1)
    o, _ = core.run_forward(call, HOST_OPS, *ins)  # the stand-in asserts the clamp
    # beyond every distance (|d| < 11): one projection only, as any w past the lengths gives
    want, _ = torch_cpu.forward(*ins, 100 if w > 0 else -100, False, call.problem.sm_scale)
    assert torch.equal(o, want)


def test_clamp_w_keeps_every_comparison():
    p = validate.Problem("numpy", 1, 1, 1, 5, 7, 16, "float32", 0, False, 0.25, None)
    d = np.arange(-4, 7)[:, None] - np.arange(7)[None, :]  # every distance of M=5, N=7 and more
    for w in (-50, -13, -12, -5, 0, 6, 7, 12, 13, 14, 50, 10**30):
        c = core.clamp_w(dataclasses.replace(p, w=w))
        assert np.array_equal(d >= w, d >= c.w), w


def test_memo_is_bounded_and_thread_safe():
    memo = core.Memo(cap=64)

    def work(t):
        for i in range(2000):
            k = (t, i % 100)
            if memo.get(k) is None:
                memo.put(k, i)
            assert len(memo) <= 64

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 0 < len(memo) <= 64
    held = memo.values()
    assert len(held) == len(memo) and all(isinstance(v, int) for v in held)
    memo.clear()
    assert len(memo) == 0


def test_prepare_memoises_per_signature(fake_cuda):
    ins = make_inputs(1, 2, 2, 9, 11, 16)
    key = torch_adapter.key(*ins, 3, False, None)
    a = core.prepare(HOST_OPS, key, *ins, 3, False, None)
    assert core.prepare(HOST_OPS, key, *ins, 3, False, None) is a
    b = core.prepare(HOST_OPS, torch_adapter.key(*ins, 4, False, None), *ins, 4, False, None)
    assert b is not a and b.problem.w == 4
    # an unhashable scalar is not memoised; check_inputs rejects it
    with pytest.raises(TypeError, match="dist_threshold"):
        core.prepare(HOST_OPS, torch_adapter.key(*ins, [3], False, None), *ins, [3], False, None)


def test_prepare_rejects_another_library():
    ins = [t.numpy() for t in make_inputs(1, 1, 1, 4, 4, 8, torch.float32)]
    with pytest.raises(TypeError, match="torch"):
        core.prepare(torch_adapter.OPS, None, *ins, 1, False, None)


def test_adapters_share_the_core():
    """The torch and CuPy adapters only translate: no memo, copies or fills of their own."""
    import inspect

    from cupy_piecewise.adapters import torch as t_ad

    src = inspect.getsource(t_ad)
    for word in ("MEMO", "kernel_ready", "forward_launches", "launch.forward"):
        assert word not in src, word
    assert torch_ops._call.__module__ == "cupy_piecewise.torch_ops"


@pytest.mark.parametrize("q_offset,k_offset", [(None, 5), (40, 3), (-7, 0), (2**62, -2**62)])
def test_core_offsets_and_dlse_with_fake_launch(fake_cuda, q_offset, k_offset):
    """Offsets reach the launch layer as the clamped (shift, w) of the problem, dlse as a
    float32 pointer; results equal the torch CPU path given the same arguments."""
    B, H, Hkv, M, N, D, w = 1, 4, 2, 11, 17, 16, 3
    ins = make_inputs(B, H, Hkv, M, N, D, torch.bfloat16, seed=4)
    key = torch_adapter.key(*ins, w, True, None, q_offset, k_offset)
    call = core.prepare(HOST_OPS, key, *ins, w, True, None, q_offset, k_offset)
    p = call.problem
    assert p.shift is None or -M <= p.shift <= N
    o, lse = core.run_forward(call, HOST_OPS, *ins)
    want_o, want_lse = torch_cpu.forward(*ins, p.w, True, p.sm_scale, p.shift)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
    do = make_inputs(B, H, H, M, 1, D, torch.bfloat16, seed=5)[0]
    dlse = torch.randn(B, H, M, dtype=torch.float64)  # converted to float32 for the kernels
    grads = core.run_backward(call, HOST_OPS, do, *ins, o, lse, dlse=dlse)
    want = torch_cpu.backward(do, *ins, o, lse, p.w, True, p.sm_scale, p.shift,
                              dlse.to(torch.float32))
    for g, wg in zip(grads, want):
        assert torch.equal(g, wg)
    no_dlse = core.run_backward(call, HOST_OPS, do, *ins, o, lse)
    assert any(not torch.equal(a, b) for a, b in zip(no_dlse, grads))  # dlse took effect
