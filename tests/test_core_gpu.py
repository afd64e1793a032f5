"""The core and its adapters on a GPU: fresh threads, CuPy bfloat16, DLPack round trips,
empty batches and heads, and alternating calls on two GPUs (skipped with a reason on a
machine with fewer). Marked ``gpu``."""
from __future__ import annotations

import threading

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")

import cupy_piecewise  # noqa: E402
from cupy_piecewise import reference, tolerance  # noqa: E402
from cupy_piecewise.gpu_arrays import poisoned_outputs, round_to, to_device, to_host  # noqa: E402
from seeds import fresh_seed  # noqa: E402  (tests/ is on sys.path: tests/seeds.py)


def _gpus() -> int:
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_gpus() == 0 or not torch.cuda.is_available(),
                       reason="needs a CUDA GPU visible to CuPy and torch"),
]
two_gpus = pytest.mark.skipif(_gpus() < 2, reason=f"needs 2 CUDA devices, CuPy sees {_gpus()}")
NAMES = ("dq1", "dk1", "dq2", "dk2", "dv")


def _torch_inputs(B, H, Hkv, M, N, D, seed, device="cuda:0", dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, M, D), (B, Hkv, N, D), (B, H, M, D), (B, Hkv, N, D), (B, Hkv, N, D))
    return [(torch.randn(s, generator=g) * 1.5).to(dtype).to(device) for s in shapes]


# The tests below compare runs bit for bit, so their backward runs in deterministic mode
# (the default Hopper backward adds dQ with float32 atomics, in an order that varies).
def _torch_fwd_bwd(ins, w, do):
    leaves = [t.detach().requires_grad_() for t in ins]
    o, lse = cupy_piecewise.attention(*leaves, w, causal=True, return_lse=True, deterministic=True)
    o.backward(do)
    return [o.detach(), lse] + [t.grad for t in leaves]


def _cupy_fwd_bwd(ins, w, do):
    o, lse = cupy_piecewise.attention(*ins, w, causal=True, return_lse=True)
    return [o, lse, *cupy_piecewise.attention_backward(do, *ins, o, lse, w, causal=True,
                                                       deterministic=True)]


def test_fresh_threads_torch_and_cupy():
    """16 threads that never touched CUDA call forward and backward through torch and
    CuPy: no errors, results equal (bit for bit: deterministic mode) to a single-thread
    run."""
    t_ins = _torch_inputs(2, 4, 2, 150, 170, 64, seed=1)
    t_do = torch.randn(2, 4, 150, 64, device="cuda:0").to(torch.bfloat16)
    c_ins = [cupy.from_dlpack(t.to(torch.float16)) for t in t_ins]
    c_do = cupy.from_dlpack(t_do.to(torch.float16))
    torch.cuda.synchronize()
    want_t = _torch_fwd_bwd(t_ins, 33, t_do)
    want_c = _cupy_fwd_bwd(c_ins, 33, c_do)
    torch.cuda.synchronize()
    results, errors = {}, []
    barrier = threading.Barrier(16)

    def work(i):
        try:
            barrier.wait()
            for _ in range(3):
                got_t = _torch_fwd_bwd(t_ins, 33, t_do)
                torch.cuda.current_stream().synchronize()
                got_c = _cupy_fwd_bwd(c_ins, 33, c_do)
                cupy.cuda.get_current_stream().synchronize()
            results[i] = (got_t, got_c)
        except Exception as e:  # noqa: BLE001 - reported below with the thread number
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, "\n".join(errors[:5])
    assert len(results) == 16
    for got_t, got_c in results.values():
        for a, b in zip(got_t, want_t):
            assert torch.equal(a, b)
        for a, b in zip(got_c, want_c):
            assert bool(cupy.array_equal(a, b))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_cupy_bfloat16_matches_reference(D, causal):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    B, H, Hkv, M, N, w = 2, 4, 2, 177, 301, 60
    shapes = [(B, H, M, D), (B, Hkv, N, D), (B, H, M, D), (B, Hkv, N, D), (B, Hkv, N, D)]
    host = [round_to(rng.standard_normal(s).astype(np.float32) * 1.5, "bfloat16") for s in shapes]
    dev = [to_device(x, "bfloat16") for x in host]
    assert dev[0].dtype.name == "bfloat16"
    with poisoned_outputs():
        o, lse = cupy_piecewise.attention(*dev, w, causal=causal, return_lse=True)
    assert o.dtype == dev[0].dtype and lse.dtype == cupy.float32
    ref = reference.forward(*host, w, causal)
    low = reference.lowp_forward(*host, w, causal, dtype="bfloat16")
    for name, got, r, lo in zip(("o", "lse"), (o, lse), ref, low):
        v = tolerance.compare(name, to_host(got), r, lo, "bfloat16")
        assert v.passed, f"{v} (seed {seed})"
    do_h = round_to(rng.standard_normal((B, H, M, D)).astype(np.float32), "bfloat16")
    with poisoned_outputs():
        grads = cupy_piecewise.attention_backward(to_device(do_h, "bfloat16"), *dev, o, lse, w,
                                                  causal=causal)
    o_used, lse_used = to_host(o), to_host(lse)
    rg = reference.backward(*host, o_used, lse_used, do_h, w, causal)
    lg = reference.lowp_backward(*host, o_used.astype(np.float32), lse_used, do_h, w, causal,
                                 dtype="bfloat16")
    for name, g, r, lo in zip(NAMES, grads, rg, lg):
        assert g.dtype == dev[0].dtype
        v = tolerance.compare(name, to_host(g), r, lo, "bfloat16")
        assert v.passed, f"{v} (seed {seed})"


def test_cupy_from_dlpack_of_torch_shares_memory():
    t_ins = _torch_inputs(1, 2, 2, 96, 128, 64, seed=4)
    c_ins = [cupy.from_dlpack(t) for t in t_ins]
    for c, t in zip(c_ins, t_ins):
        assert c.data.ptr == t.data_ptr() and c.dtype.name == "bfloat16"
    o_c, lse_c = cupy_piecewise.attention(*c_ins, 20, return_lse=True)
    o_t = torch.from_dlpack(o_c)
    assert o_t.data_ptr() == o_c.data.ptr  # zero copy on the way back too
    cupy.cuda.get_current_stream().synchronize()
    want = cupy_piecewise.attention(*t_ins, 20)
    torch.cuda.synchronize()
    assert torch.equal(o_t, want)


class _Producer:
    """A GPU array type that only speaks DLPack (wrapping a torch tensor)."""

    def __init__(self, t):
        self.t = t

    def __dlpack__(self, **kw):
        return self.t.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()

    @classmethod
    def from_dlpack(cls, x):
        return cls(torch.from_dlpack(x))


def test_generic_dlpack_producer_on_the_gpu():
    t_ins = _torch_inputs(1, 4, 2, 80, 120, 128, seed=5)
    ins = [_Producer(t) for t in t_ins]
    o, lse = cupy_piecewise.attention(*ins, 30, causal=True, return_lse=True)
    assert isinstance(o, _Producer) and o.t.device.type == "cuda"
    torch.cuda.synchronize()
    want_o, want_lse = cupy_piecewise.attention(*t_ins, 30, causal=True, return_lse=True)
    torch.cuda.synchronize()
    assert torch.equal(o.t, want_o) and torch.equal(lse.t, want_lse)
    do = torch.randn_like(want_o)
    grads = cupy_piecewise.attention_backward(_Producer(do), *ins, o, lse, 30, causal=True)
    want = cupy_piecewise.attention_backward(do, *t_ins, want_o, want_lse, 30, causal=True)
    torch.cuda.synchronize()
    for g, wg in zip(grads, want):
        assert isinstance(g, _Producer) and torch.equal(g.t, wg)


@pytest.mark.parametrize("B,H,Hkv", [(0, 4, 2), (2, 0, 2)])
def test_empty_batch_and_heads_on_the_gpu(B, H, Hkv):
    t_ins = [t.requires_grad_() for t in _torch_inputs(B, H, Hkv, 40, 50, 64, seed=6)]
    o, lse = cupy_piecewise.attention(*t_ins, 5, return_lse=True)
    assert o.shape == (B, H, 40, 64) and lse.shape == (B, H, 40)
    o.sum().backward()
    for t in t_ins:
        assert t.grad.shape == t.shape and torch.count_nonzero(t.grad) == 0
    c_ins = [cupy.from_dlpack(t.detach()) for t in t_ins]
    o, lse = cupy_piecewise.attention(*c_ins, 5, return_lse=True)
    assert o.shape == (B, H, 40, 64)
    grads = cupy_piecewise.attention_backward(cupy.ones_like(o), *c_ins, o, lse, 5)
    for g, c in zip(grads, c_ins):
        assert g.shape == c.shape and not bool(g.any())


@two_gpus
def test_alternating_devices_torch_and_cupy():
    """Calls alternate between cuda:0 and cuda:1 in one process (kernels loaded on one
    device must not be launched on the other), forward and backward, torch and CuPy."""
    ins0 = _torch_inputs(2, 4, 2, 120, 140, 64, seed=11, device="cuda:0")
    ins1 = [t.to("cuda:1") for t in ins0]
    do0 = torch.randn(2, 4, 120, 64, device="cuda:0").to(torch.bfloat16)
    do1 = do0.to("cuda:1")
    first = {}
    for rnd in range(3):
        for dev, ins, do in ((0, ins0, do0), (1, ins1, do1)):
            got = _torch_fwd_bwd(ins, 25, do)
            assert all(g.device == torch.device("cuda", dev) for g in got)
            first.setdefault(dev, got)
            for a, b in zip(got, first[dev]):
                assert torch.equal(a, b)
    assert torch.cuda.current_device() == 0, "a call changed the current device"
    for a, b in zip(first[0], first[1]):
        assert torch.equal(a, b.to("cuda:0"))

    c0 = [cupy.from_dlpack(t) for t in ins0]
    c1 = [cupy.from_dlpack(t) for t in ins1]
    assert c1[0].device.id == 1
    cdo0, cdo1 = cupy.from_dlpack(do0), cupy.from_dlpack(do1)
    outs = {}
    for rnd in range(3):
        for dev, ins, do in ((0, c0, cdo0), (1, c1, cdo1)):
            got = _cupy_fwd_bwd(ins, 25, do)
            assert all(g.device.id == dev for g in got)
            with cupy.cuda.Device(dev):
                cupy.cuda.get_current_stream().synchronize()
            host = [cupy.asnumpy(g) for g in got]
            outs.setdefault(dev, host)
            for a, b in zip(host, outs[dev]):
                assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    assert cupy.cuda.runtime.getDevice() == 0
    for a, b, t in zip(outs[0], outs[1], first[0]):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("path", ["auto", "hopper", "mma"])
def test_broadcast_heads_read_in_place(path, monkeypatch):
    """k/v heads expanded from one (stride 0) are no tensor map: the mma.sync kernels take
    them on every path, with the same result as materialised copies."""
    from cupy_piecewise import capability

    monkeypatch.setenv(capability.PATH_VAR, path)
    capability.refresh_env_override()
    q1, k1, q2, k2, v = _torch_inputs(2, 8, 1, 1024, 1024, 128, seed=12)
    ex = [t.expand(2, 8, 1024, 128) for t in (k1, k2, v)]
    assert ex[0].stride(1) == 0
    o = cupy_piecewise.attention(q1, ex[0], q2, ex[1], ex[2], 300, causal=True)
    want = cupy_piecewise.attention(q1, ex[0].contiguous(), q2, ex[1].contiguous(),
                                    ex[2].contiguous(), 300, causal=True)
    torch.cuda.synchronize()
    torch.testing.assert_close(o, want, rtol=2e-2, atol=2e-2)
