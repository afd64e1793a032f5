"""Adapter choice and translation on the CPU: subclasses, DLPack producers, empty
problems for every library, and w far outside int64 through every torch route."""
from __future__ import annotations

import sys

import numpy as np
import pytest

import cupy_piecewise
from cupy_piecewise import api, reference


def _inputs(B, H, Hkv, M, N, D, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    shapes = ((B, H, M, D), (B, Hkv, N, D), (B, H, M, D), (B, Hkv, N, D), (B, Hkv, N, D))
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


# ---------------------------------------------------------------------------
# Any DLPack producer.


class Bare:
    """Only __dlpack__ / __dlpack_device__: results come back as NumPy arrays."""

    __module__ = "some_library_without_from_dlpack"

    def __init__(self, a):
        self._a = np.asarray(a)

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


class Wrapped(Bare):
    """An array type that only speaks DLPack and can be rebuilt from it."""

    __module__ = __name__

    @classmethod
    def from_dlpack(cls, x):
        return cls(np.from_dlpack(x))


@pytest.mark.parametrize("kind", [Wrapped, Bare])
def test_dlpack_producer_runs_the_reference(kind):
    host = _inputs(1, 2, 1, 7, 9, 16, seed=1)
    w, causal = 3, True
    assert api.adapter_for(kind(host[0])).__name__ == "cupy_piecewise.adapters.dlpack"
    ins = [kind(x) for x in host]
    o, lse = cupy_piecewise.attention(*ins, w, causal=causal, return_lse=True)
    want_type = kind if kind is Wrapped else np.ndarray
    assert type(o) is want_type and type(lse) is want_type
    ro, rlse = reference.forward(*host, w, causal)
    np.testing.assert_allclose(np.from_dlpack(o), ro, rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.from_dlpack(lse), rlse, rtol=0, atol=1e-6)
    # without return_lse only o comes back
    assert type(cupy_piecewise.attention(*ins, w, causal=causal)) is want_type

    do = np.random.default_rng(2).standard_normal(ro.shape)
    grads = cupy_piecewise.attention_backward(kind(do), *ins, o, lse, w, causal=causal)
    want = reference.backward(*host, np.from_dlpack(o), np.from_dlpack(lse), do, w, causal)
    assert len(grads) == 5
    for g, r in zip(grads, want):
        assert type(g) is want_type
        np.testing.assert_allclose(np.from_dlpack(g), r, rtol=0, atol=1e-10)


def test_dlpack_zero_copy_on_the_way_in(monkeypatch):
    """The NumPy array the reference receives shares memory with the producer's."""
    host = _inputs(1, 1, 1, 3, 4, 8)
    ins = [Wrapped(x) for x in host]
    seen = []
    real = reference.forward

    def spy(q1, *rest, **kw):
        seen.append(q1)
        return real(q1, *rest, **kw)

    monkeypatch.setattr(reference, "forward", spy)
    cupy_piecewise.attention(*ins, 1)
    assert np.shares_memory(seen[0], host[0])


def test_dlpack_bad_device_is_named():
    class OnTPU(Wrapped):
        def __dlpack_device__(self):
            return (4, 0)  # OpenCL

    ins = [Wrapped(x) for x in _inputs(1, 1, 1, 3, 4, 8)]
    with pytest.raises(TypeError, match="k1 lives on DLPack device type 4"):
        cupy_piecewise.attention(ins[0], OnTPU(ins[1]._a), *ins[2:], 1)


def test_non_arrays_are_named():
    host = _inputs(1, 1, 1, 3, 4, 8)
    with pytest.raises(TypeError, match="q1"):
        cupy_piecewise.attention([[1.0]], *host[1:], 1)


def test_adapter_choice_needs_no_import():
    assert api.adapter_for(np.zeros(1)).__name__ == "cupy_piecewise.adapters.numpy"


class MyArray(np.ndarray):
    pass


def test_numpy_subclass_uses_the_reference():
    host = _inputs(1, 1, 1, 3, 4, 8)
    ins = [x.view(MyArray) for x in host]
    o = cupy_piecewise.attention(*ins, 1)
    np.testing.assert_allclose(np.asarray(o), reference.forward(*host, 1, False)[0], atol=1e-12)


# ---------------------------------------------------------------------------
# Empty problems for every CPU library, forward and backward.


EMPTY = [(0, 2, 2, 5, 6), (1, 0, 2, 5, 6), (1, 2, 2, 0, 6), (1, 2, 2, 5, 0), (0, 0, 1, 0, 0)]


@pytest.mark.parametrize("B,H,Hkv,M,N", EMPTY)
@pytest.mark.parametrize("library", ["numpy", "torch", "dlpack"])
def test_empty_problems(library, B, H, Hkv, M, N):
    host = _inputs(B, H, Hkv, M, N, 16)
    if library == "torch":
        torch = pytest.importorskip("torch")
        conv, back = torch.from_numpy, lambda t: t.numpy()
    elif library == "dlpack":
        conv, back = Wrapped, lambda a: np.from_dlpack(a)
    else:
        conv, back = (lambda a: a), (lambda a: a)
    ins = [conv(x) for x in host]
    o, lse = cupy_piecewise.attention(*ins, 1, return_lse=True)
    o_, lse_ = back(o), back(lse)
    assert o_.shape == (B, H, M, 16) and lse_.shape == (B, H, M)
    assert (o_ == 0).all() and np.isneginf(lse_).all()
    do = conv(np.ones((B, H, M, 16)))
    grads = cupy_piecewise.attention_backward(do, *ins, o, lse, 1)
    for g, x in zip(grads, host):
        g = back(g)
        assert g.shape == x.shape and not np.isnan(g).any() and (g == 0).all()


# ---------------------------------------------------------------------------
# torch: subclasses and w beyond int64 through every route.


def test_torch_subclass_cpu_returns_torch_tensors():
    torch = pytest.importorskip("torch")

    class Sub(torch.Tensor):
        pass

    host = _inputs(1, 2, 1, 5, 6, 8)
    ins = [torch.from_numpy(x).as_subclass(Sub) for x in host]
    assert api.adapter_for(ins[0]).__name__ == "cupy_piecewise.torch_ops"
    o, lse = cupy_piecewise.attention(*ins, 2, return_lse=True)
    assert isinstance(o, torch.Tensor) and isinstance(lse, torch.Tensor)
    np.testing.assert_allclose(o.detach().numpy() if hasattr(o, "detach") else o,
                               reference.forward(*host, 2, False)[0], atol=1e-12)
    # nn.Parameter is a subclass too
    p = [torch.nn.Parameter(torch.from_numpy(x)) for x in host]
    o = cupy_piecewise.attention(*p, 2)
    assert isinstance(o, torch.Tensor)
    o.sum().backward()
    assert p[0].grad is not None


@pytest.mark.parametrize("w", [10**20, -(10**20), 2**63, -(2**63) - 1, 2**62 + 1])
@pytest.mark.parametrize("route", ["direct", "autograd.Function", "operator", "parameter"])
def test_torch_huge_w_every_route(route, w, monkeypatch):
    torch = pytest.importorskip("torch")
    from cupy_piecewise import torch_ops

    host = _inputs(1, 2, 1, 6, 9, 8, seed=5)
    ins = [torch.from_numpy(x) for x in host]
    if route == "operator":
        monkeypatch.setattr(torch_ops, "DIRECT_EAGER_CALLS", False)
    if route == "parameter":
        ins = [torch.nn.Parameter(t) for t in ins]
    elif route != "direct":
        ins = [t.requires_grad_() for t in ins]
    o, lse = cupy_piecewise.attention(*ins, w, causal=False, return_lse=True)
    ro, rlse = reference.forward(*host, w, False)
    np.testing.assert_allclose(o.detach().numpy(), ro, atol=1e-12)
    if route != "direct":
        o.sum().backward()
        want = reference.backward(*host, ro, rlse, np.ones_like(ro), w, False)
        for t, r in zip(ins, want):
            np.testing.assert_allclose(t.grad.numpy(), r, atol=1e-10)


def test_torch_huge_w_under_compile():
    torch = pytest.importorskip("torch")
    host = _inputs(1, 2, 1, 6, 9, 8, seed=6)
    ins = [torch.from_numpy(x) for x in host]

    @torch.compile(backend="aot_eager", fullgraph=True)
    def f(*xs):
        return cupy_piecewise.attention(*xs, 10**20)

    np.testing.assert_allclose(f(*ins).numpy(), reference.forward(*host, 10**20, False)[0],
                               atol=1e-12)


def test_import_stays_light():
    import subprocess

    code = ("import sys, cupy_piecewise; "
            "assert 'torch' not in sys.modules and 'cupy' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_torch_as_f32_materialises_expanded_tensors():
    """ArrayOps.as_f32 must hand the kernels a dense float32 array: autograd gives
    ``lse.sum()`` an expanded gradient (every stride 0), whose one element a kernel reading
    (B, H, M) contiguous memory would run past (found by torch.library.opcheck on a GPU)."""
    torch = pytest.importorskip("torch")
    from cupy_piecewise.adapters import torch as torch_adapter

    as_f32 = torch_adapter.OPS.as_f32
    expanded = torch.full((), 2.5).expand(2, 3, 5)
    for t in (expanded, torch.randn(2, 5, 3).transpose(1, 2), torch.randn(2, 3, 5).half(),
              torch.randn(2, 3, 5, dtype=torch.float64)[:, :, ::1]):
        got = as_f32(t)
        assert got.dtype == torch.float32 and got.is_contiguous()
        assert got.stride() == (15, 5, 1) and torch.equal(got, t.to(torch.float32))
    dense = torch.randn(2, 3, 5)
    assert as_f32(dense) is dense  # no copy when nothing is needed
