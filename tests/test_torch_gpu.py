"""torch CUDA tensors through the CUDA kernels: accuracy by the tolerance rule (docs/semantics.md),
zero copy, streams, autograd, torch.compile, CUDA graphs, opcheck, autocast, a
second device. Marked ``gpu``: skipped with a reason where there is no GPU."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

import cupy_piecewise  # noqa: E402
from cupy_piecewise import reference, tolerance, torch_ops  # noqa: E402
from cupy_piecewise.adapters import torch as torch_adapter  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda is not available (no GPU or a CPU-only torch)"),
]

NAMES = ("dq1", "dk1", "dq2", "dk2", "dv")


@pytest.fixture
def nan_outputs(monkeypatch):
    """Outputs (and the delta workspace) start as NaN, so unwritten elements show."""

    def empty(shape, dtype, device):
        return torch.full(shape, math.nan, dtype=dtype, device=device)

    monkeypatch.setattr(torch_adapter, "_empty", empty)


def make(B, H, Hkv, M, N, D, dtype, layout="contiguous", seed=0, scale=1.0, device="cuda"):
    """Fresh random inputs (normal, never zero) in the given memory layout.

    layout: 'contiguous' (B, H, L, D); 'transposed' ((B, L, H, D) memory viewed as
    (B, H, L, D)); 'last_stride_2' (every other element of the last dim, copied once).
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for shape in ((B, H, M, D), (B, Hkv, N, D), (B, H, M, D), (B, Hkv, N, D), (B, Hkv, N, D)):
        t = (torch.randn(shape, generator=g) * scale).to(dtype)
        t = t.to(device)
        if layout == "transposed":
            t = t.transpose(1, 2).contiguous().transpose(1, 2)
        elif layout == "last_stride_2":
            t = torch.stack([t, -t], dim=-1).flatten(-2)[..., ::2]
        out.append(t)
    return out


def np64(t):
    return t.detach().to(torch.float64).cpu().numpy()


def dtype_name(dtype):
    return str(dtype).split(".")[1]


# (B, H, Hkv, M, N, w, layout)
ACCURACY_CASES = [
    (2, 4, 4, 197, 197, 50, "contiguous"),  # M == N, lengths off tile multiples
    (1, 8, 2, 130, 257, 64, "transposed"),  # GQA 4, M < N, w on a tile edge
    (1, 4, 1, 300, 77, 10, "contiguous"),  # GQA 4, M > N: empty rows when causal
    (2, 2, 2, 1, 333, -5, "transposed"),  # one query row, negative w
    (1, 2, 2, 129, 129, 1000, "contiguous"),  # w beyond every distance
    (1, 4, 2, 64, 192, 0, "last_stride_2"),  # tile multiples, w = 0, copied inputs
]


@pytest.fixture(params=["auto", "hopper"])
def kernel_path(request, monkeypatch):
    """The default choice of kernels, and the Hopper forward forced for every shape it takes."""
    from cupy_piecewise import capability

    monkeypatch.setenv(capability.PATH_VAR, request.param)
    capability.refresh_env_override()
    return request.param


@pytest.mark.parametrize("case", ACCURACY_CASES, ids=[str(c) for c in ACCURACY_CASES])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_accuracy_forward_backward(nan_outputs, kernel_path, case, causal, D, dtype):
    B, H, Hkv, M, N, w, layout = case
    name = dtype_name(dtype)
    ins = make(B, H, Hkv, M, N, D, dtype, layout, seed=M * 7 + N + D, scale=1.5)
    before = [t.clone() for t in ins]
    leaves = [t.detach().requires_grad_() for t in ins]
    o, lse = torch_ops.attention(*leaves, w, causal=causal, return_lse=True)
    assert o.dtype == dtype and o.shape == (B, H, M, D) and o.device == ins[0].device
    assert lse.dtype == torch.float32 and lse.shape == (B, H, M)
    do = make(B, H, H, M, 1, D, dtype, "transposed", seed=99)[0]
    o.backward(do)
    torch.cuda.synchronize()

    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    for leaf in leaves:
        assert leaf.grad is not None and not torch.isnan(leaf.grad).any()
    for t, b in zip(ins, before):
        assert torch.equal(t, b), "inputs were modified"

    args = [np64(t) for t in ins]
    ro, rlse = reference.forward(*args, w, causal)
    lo, llse = reference.lowp_forward(*args, w, causal, dtype=name)
    tolerance.assert_close("o", np64(o), ro, lo, name)
    tolerance.assert_close("lse", np64(lse), rlse, llse, name)
    rg = reference.backward(*args, ro, rlse, np64(do), w, causal)
    lg = reference.lowp_backward(*args, lo, llse, np64(do), w, causal, dtype=name)
    for n, leaf, r, lw in zip(NAMES, leaves, rg, lg):
        assert leaf.grad.dtype == dtype and leaf.grad.shape == leaf.shape
        tolerance.assert_close(n, np64(leaf.grad), r, lw, name)


@pytest.mark.parametrize("D", [16, 32])
def test_small_head_dims(nan_outputs, D):
    dtype, w = torch.bfloat16, 20
    ins = make(2, 4, 2, 100, 90, D, dtype, seed=D)
    leaves = [t.detach().requires_grad_() for t in ins]
    o, lse = torch_ops.attention(*leaves, w, causal=True, return_lse=True)
    do = torch.randn_like(o)
    o.backward(do)
    args = [np64(t) for t in ins]
    ro, rlse = reference.forward(*args, w, True)
    lo, llse = reference.lowp_forward(*args, w, True, dtype="bfloat16")
    tolerance.assert_close("o", np64(o), ro, lo, "bfloat16")
    tolerance.assert_close("lse", np64(lse), rlse, llse, "bfloat16")
    rg = reference.backward(*args, ro, rlse, np64(do), w, True)
    lg = reference.lowp_backward(*args, lo, llse, np64(do), w, True, dtype="bfloat16")
    for n, leaf, r, lw in zip(NAMES, leaves, rg, lg):
        tolerance.assert_close(n, np64(leaf.grad), r, lw, "bfloat16")


@pytest.mark.parametrize("how", ["argument", "torch.use_deterministic_algorithms"])
def test_attention_backward_matches_autograd(nan_outputs, how):
    """attention_backward and autograd run the same kernels: in deterministic mode (asked
    for either way) their gradients are equal bit for bit."""
    ins = make(1, 4, 2, 150, 170, 64, torch.float16, "transposed", seed=5)
    leaves = [t.detach().requires_grad_() for t in ins]
    flag = how == "argument"
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(not flag or was)
    try:
        o, lse = cupy_piecewise.attention(*leaves, 30, causal=True, return_lse=True,
                                          deterministic=flag)
        do = torch.randn_like(o)
        o.backward(do)
        grads = cupy_piecewise.attention_backward(do, *ins, o.detach(), lse, 30, causal=True,
                                                  deterministic=flag)
    finally:
        torch.use_deterministic_algorithms(was)
    for n, leaf, g in zip(NAMES, leaves, grads):
        assert g.is_contiguous()
        assert torch.equal(g, leaf.grad), n


def test_empty_sizes():
    for M, N in ((0, 50), (50, 0)):
        ins = [t.requires_grad_() for t in make(1, 2, 2, M, N, 64, torch.bfloat16)]
        o, lse = torch_ops.attention(*ins, 3, causal=True, return_lse=True)
        assert o.shape == (1, 2, M, 64) and lse.shape == (1, 2, M)
        assert torch.count_nonzero(o) == 0 and torch.isneginf(lse).all()
        o.sum().backward()
        for t in ins:
            assert t.grad.shape == t.shape and torch.count_nonzero(t.grad) == 0


def _record_launches(monkeypatch):
    """Spy on launch.Launches.run, launch.HopperLaunches.run and launch.HopperBackward.run,
    through which every kernel launch goes; returns the list of calls as dicts: 'kind'
    ('fwd'/'bwd'), 'ptr' and 'strides' by array name, and 'stream'."""
    from cupy_piecewise import launch

    calls = []
    for cls in (launch.Launches, launch.HopperLaunches, launch.HopperBackward):
        def spy(self, ptrs, stream, workspace=0, real=cls.run):
            kind = "fwd" if self.arrays == launch.FORWARD_ARRAYS else "bwd"
            calls.append(dict(kind=kind, ptr=dict(zip(self.arrays, ptrs)), strides=self.strides,
                              stream=stream))
            return real(self, ptrs, stream, workspace)

        monkeypatch.setattr(cls, "run", spy)
    return calls


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("direct", [True, False], ids=["autograd.Function", "custom_op"])
def test_zero_copy(monkeypatch, layout, direct):
    monkeypatch.setattr(torch_ops, "DIRECT_EAGER_CALLS", direct)
    calls = _record_launches(monkeypatch)
    ins = make(2, 4, 2, 100, 120, 64, torch.bfloat16, layout)
    leaves = [t.detach().requires_grad_() for t in ins]
    o, lse = torch_ops.attention(*leaves, 17, causal=True, return_lse=True)
    do = make(2, 4, 4, 100, 1, 64, torch.bfloat16, "transposed")[0]
    o.backward(do)
    fwd, bwd = calls
    assert fwd["kind"] == "fwd" and bwd["kind"] == "bwd"
    for call in (fwd, bwd):
        assert [call["ptr"][n] for n in ("q1", "k1", "q2", "k2", "v")] == [t.data_ptr() for t in ins]
        assert [call["strides"][n] for n in ("q1", "k1", "q2", "k2", "v")] == [t.stride() for t in ins]
        assert call["ptr"]["o"] == o.data_ptr() and call["ptr"]["lse"] == lse.data_ptr()
        assert call["stream"] == torch.cuda.current_stream().cuda_stream
    assert bwd["ptr"]["dout"] == do.data_ptr() and bwd["strides"]["dout"] == do.stride()
    for n, t in zip(NAMES, leaves):  # gradients: fresh contiguous outputs
        assert bwd["strides"][n] == torch.empty(t.shape).stride()


def test_non_unit_last_stride_is_copied(monkeypatch):
    calls = _record_launches(monkeypatch)
    ins = make(1, 2, 2, 64, 64, 64, torch.bfloat16, "last_stride_2")
    o = torch_ops.attention(*ins, 8)
    (call,) = calls
    for n, t in zip(("q1", "k1", "q2", "k2", "v"), ins):
        assert call["ptr"][n] != t.data_ptr() and call["strides"][n][-1] == 1
    torch.testing.assert_close(o, torch_ops.attention(*[t.contiguous() for t in ins], 8), rtol=0, atol=0)


@pytest.mark.parametrize("H,M,N,split", [(16, 8192, 2048, False), (8, 150, 201, True),
                                         (8, 1, 50000, True)])
def test_lse_not_requested(nan_outputs, monkeypatch, H, M, N, split):
    """A call without return_lse passes a null lse, with and without split-KV (whose merge
    kernel writes lse last), and gives the same o, bit for bit."""
    from cupy_piecewise import launch

    ins = make(1, H, 2, M, N, 128, torch.bfloat16, seed=M)
    o_lse, lse = torch_ops.attention(*ins, N // 3, return_lse=True)
    calls = _record_launches(monkeypatch)
    o = torch_ops.attention(*ins, N // 3)
    torch.cuda.synchronize()
    (call,) = calls
    assert call["ptr"]["lse"] == 0
    assert o.shape == (1, H, M, 128) and torch.equal(o, o_lse) and not torch.isnan(lse).any()
    problem = torch_ops._problem(*ins, N // 3, False, None)
    tiles = launch.plan(problem, "fwd_decode" if M <= launch.DECODE_ROWS else "fwd").tiles
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert (launch.split_plan(problem, tiles, sms)[0] > 1) == split


def test_memoised_signature_rechecks_alignment(monkeypatch):
    """Same shapes and strides, but a data pointer 2 bytes off 16-byte alignment: the memo
    (keyed without pointers) must not send it to the kernels in place."""
    base = make(1, 2, 2, 70, 90, 64, torch.float16, seed=8)
    want = torch_ops.attention(*base, 20)
    shifted = []
    for t in base:
        flat = torch.empty(t.numel() + 8, dtype=t.dtype, device=t.device)
        start = next(i for i in range(8) if (flat.data_ptr() + 2 * i) % 16 == 2)
        view = flat[start:start + t.numel()].view(t.shape)
        view.copy_(t)
        assert view.stride() == t.stride()
        shifted.append(view)
    calls = _record_launches(monkeypatch)
    got = torch_ops.attention(*shifted, 20)
    (call,) = calls
    for n, t in zip(("q1", "k1", "q2", "k2", "v"), shifted):
        assert call["ptr"][n] % 16 == 0 and call["ptr"][n] != t.data_ptr()
    assert torch.equal(got, want)


def test_non_default_stream(monkeypatch):
    ins = make(2, 4, 2, 200, 220, 128, torch.bfloat16, seed=3)
    do = make(2, 4, 4, 200, 1, 128, torch.bfloat16, seed=4)[0]

    def run():
        leaves = [t.detach().requires_grad_() for t in ins]
        o, lse = torch_ops.attention(*leaves, 40, causal=True, return_lse=True)
        o.backward(do)
        return o, lse, [t.grad for t in leaves]

    o0, lse0, g0 = run()
    calls = _record_launches(monkeypatch)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        o1, lse1, g1 = run()
    torch.cuda.current_stream().wait_stream(side)
    assert [c["kind"] for c in calls] == ["fwd", "bwd"]
    for c in calls:
        assert c["stream"] == side.cuda_stream != torch.cuda.current_stream().cuda_stream
    torch.cuda.synchronize()
    assert torch.equal(o0, o1) and torch.equal(lse0, lse1)
    for n, a, b in zip(NAMES, g0, g1):
        torch.testing.assert_close(b, a, msg=n)


class Layer(torch.nn.Module):
    def __init__(self, public_api=False):
        super().__init__()
        self.fn = cupy_piecewise.attention if public_api else torch_ops.attention

    def forward(self, q1, k1, q2, k2, v, w):
        o = self.fn(q1, k1, q2, k2, v, w, causal=True)
        return o * 2.0


@pytest.mark.parametrize("public_api", [False, True])
def test_torch_compile_fullgraph_matches_eager(public_api):
    torch._dynamo.reset()
    layer = Layer(public_api)
    compiled = torch.compile(layer, fullgraph=True)
    for w, M in ((33, 128), (60, 128), (20, 200)):
        ins = make(2, 4, 2, M, 150, 64, torch.bfloat16, "transposed", seed=w)
        a = [t.detach().requires_grad_() for t in ins]
        b = [t.detach().requires_grad_() for t in ins]
        y = compiled(*a, w)
        y_ref = layer(*b, w)
        torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
        gy = torch.randn_like(y)
        y.backward(gy)
        y_ref.backward(gy)
        for n, x, xr in zip(NAMES, a, b):
            torch.testing.assert_close(x.grad, xr.grad, msg=n)


def test_cuda_graph_capture_and_replay_forward():
    B, H, Hkv, M, N, D, w = 2, 4, 2, 150, 170, 64, 25
    static = make(B, H, Hkv, M, N, D, torch.bfloat16, seed=0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: kernels compiled and loaded, caches filled
        for _ in range(2):
            torch_ops.attention(*static, w, causal=True, return_lse=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static, lse_static = torch_ops.attention(*static, w, causal=True, return_lse=True)
    for seed in (1, 2, 3):
        fresh = make(B, H, Hkv, M, N, D, torch.bfloat16, seed=seed)
        for s, f in zip(static, fresh):
            s.copy_(f)
        graph.replay()
        o, lse = torch_ops.attention(*fresh, w, causal=True, return_lse=True)
        torch.cuda.synchronize()
        assert torch.equal(o_static, o) and torch.equal(lse_static, lse)


def test_cuda_graph_capture_forward_and_backward():
    B, H, Hkv, M, N, D, w = 1, 4, 2, 130, 130, 128, 40
    static = [t.requires_grad_() for t in make(B, H, Hkv, M, N, D, torch.float16, seed=0)]
    static_do = torch.randn(B, H, M, D, device="cuda", dtype=torch.float16)

    def step():
        o = torch_ops.attention(*static, w, causal=True)
        return (o,) + torch.autograd.grad(o, static, static_do)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in (5, 6):
        fresh = make(B, H, Hkv, M, N, D, torch.float16, seed=seed)
        fresh_do = torch.randn_like(static_do)
        with torch.no_grad():
            for s, f in zip(static, fresh):
                s.copy_(f)
            static_do.copy_(fresh_do)
        graph.replay()
        leaves = [t.detach().requires_grad_() for t in fresh]
        o = torch_ops.attention(*leaves, w, causal=True)
        want = (o,) + torch.autograd.grad(o, leaves, fresh_do)
        torch.cuda.synchronize()
        assert torch.equal(outs[0], want[0])
        for n, got, ref in zip(NAMES, outs[1:], want[1:]):
            torch.testing.assert_close(got, ref, msg=n)  # exact unless a kernel is nondeterministic


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_opcheck_cuda(dtype):
    for w, causal, Hkv in ((10, True, 2), (-3, False, 4), (500, True, 1)):
        ins = [t.requires_grad_() for t in make(1, 4, Hkv, 70, 90, 64, dtype, seed=w)]
        torch.library.opcheck(torch.ops.cupy_piecewise.fwd.default, (*ins, w, causal, 0.125))
        plain = [t.detach() for t in ins]
        o, lse = torch.ops.cupy_piecewise.fwd(*plain, w, causal, 0.125)
        do = torch.randn_like(o)
        torch.library.opcheck(torch.ops.cupy_piecewise.bwd.default, (do, *plain, o, lse, w, causal, 0.125))


def test_only_some_inputs_require_grad():
    ins = make(1, 4, 2, 90, 100, 64, torch.bfloat16, seed=8)
    all_leaves = [t.detach().requires_grad_() for t in ins]
    o_all = torch_ops.attention(*all_leaves, 12, causal=True)
    do = torch.randn_like(o_all)
    o_all.backward(do)
    some = [t.detach() for t in ins]
    some[1].requires_grad_()
    some[4].requires_grad_()
    o = torch_ops.attention(*some, 12, causal=True)
    o.backward(do)
    for i, t in enumerate(some):
        if i in (1, 4):
            torch.testing.assert_close(t.grad, all_leaves[i].grad)
        else:
            assert t.grad is None


def test_autocast_cuda():
    ins32 = make(1, 2, 2, 80, 80, 64, torch.float32, seed=2)
    leaves = [t.detach().requires_grad_() for t in ins32]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        o = torch_ops.attention(*leaves, 9, causal=True)
    assert o.dtype == torch.bfloat16
    want = torch_ops.attention(*[t.to(torch.bfloat16) for t in ins32], 9, causal=True)
    torch.testing.assert_close(o, want, rtol=0, atol=0)
    o.float().sum().backward()
    for t in leaves:
        assert t.grad.dtype == torch.float32 and torch.isfinite(t.grad).all()
    with torch.autocast("cuda", dtype=torch.float16):
        assert cupy_piecewise.attention(*ins32, 9).dtype == torch.float16


def test_unsupported_inputs_raise_before_launch(monkeypatch):
    from cupy_piecewise import launch

    def boom(*a, **k):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(launch, "forward", boom)
    ins64 = make(1, 2, 2, 16, 16, 64, torch.float64)
    with pytest.raises(TypeError, match="float64"):
        torch_ops.attention(*ins64, 3)
    ins48 = make(1, 2, 2, 16, 16, 48, torch.bfloat16)  # no kernels for head dim 48
    with pytest.raises(ValueError, match="head_dim"):
        torch_ops.attention(*ins48, 3)
    mixed = make(1, 2, 2, 16, 16, 64, torch.bfloat16)
    mixed[3] = mixed[3].cpu()
    with pytest.raises(ValueError, match="k2"):
        torch_ops.attention(*mixed, 3)


def test_second_device():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, torch sees {torch.cuda.device_count()}")
    ins0 = make(2, 4, 2, 120, 140, 64, torch.bfloat16, seed=11, device="cuda:0")
    ins1 = [t.to("cuda:1") for t in ins0]
    do0 = torch.randn(2, 4, 120, 64, device="cuda:0", dtype=torch.bfloat16)
    do1 = do0.to("cuda:1")
    results = []
    for ins, do in ((ins0, do0), (ins1, do1)):
        leaves = [t.detach().requires_grad_() for t in ins]
        o, lse = torch_ops.attention(*leaves, 30, causal=True, return_lse=True)
        o.backward(do)
        results.append((o, lse, [t.grad for t in leaves]))
    assert torch.cuda.current_device() == 0, "the call changed the current device"
    (o0, lse0, g0), (o1, lse1, g1) = results
    assert o1.device == lse1.device == torch.device("cuda:1")
    assert all(g.device == torch.device("cuda:1") for g in g1)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    assert torch.equal(o0, o1.to("cuda:0")) and torch.equal(lse0, lse1.to("cuda:0"))
    for n, a, b in zip(NAMES, g0, g1):
        torch.testing.assert_close(b.to("cuda:0"), a, msg=n)
    # device 1's current stream is used while device 0 is current
    side = torch.cuda.Stream(device=1)
    with torch.cuda.stream(side):
        o_side = torch_ops.attention(*ins1, 30, causal=True)
    torch.cuda.synchronize(1)
    assert torch.equal(o_side, o1.detach())


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_dq_accumulator_sums_key_blocks(nan_outputs, causal, D):
    """core.run_backward with a caller's dQ accumulator (what context parallelism uses): the
    keys of one call split into three blocks (placed by k_offset), each block's backward
    adding dQ into one float32 accumulator and finish_dq rounding the sum once; dq1, dq2 and
    every block's dk1, dk2, dv pass the tolerance rule against the float64 reference of the
    whole call; the rows' statistics are computed by the first block only (core.SharedRows).
    On a GPU whose backward has no accumulator (not the Hopper path) it skips."""
    from cupy_piecewise import core

    B, H, Hkv, M, N, w, dtype = 1, 4, 2, 300, 517, 90, torch.bfloat16
    ins = make(B, H, Hkv, M, N, D, dtype, seed=5 + D, scale=1.5)
    do = make(B, H, H, M, 1, D, dtype, seed=6)[0]
    shift = N - M  # queries aligned to the end of the keys, as in the whole call
    o, lse = torch_ops.attention(*ins, w, causal=causal, return_lse=True)
    q1, k1, q2, k2, v = ins
    shared, dk = None, [torch.full_like(k1, math.nan) for _ in range(3)]
    for a, b in ((0, 130), (130, 389), (389, N)):
        blk = (q1, k1[:, :, a:b], q2, k2[:, :, a:b], v[:, :, a:b])
        call = torch_ops._call(*blk, w, causal, None, shift, a)
        if shared is None:
            shared = core.shared_rows(call, torch_adapter.OPS, do, *blk, o)
            if shared is None:
                pytest.skip("this GPU's backward path has no float32 dQ accumulator")
        g = core.run_backward(call, torch_adapter.OPS, do, *blk, o, lse, shared=shared)
        assert g[0] is None and g[2] is None and shared.ready
        for d, x in zip(dk, (g[1], g[3], g[4])):
            d[:, :, a:b] = x
    dq1, dq2 = core.finish_dq(shared, torch_adapter.OPS)
    torch.cuda.synchronize()
    name = dtype_name(dtype)
    args = [np64(t) for t in ins]
    ro, rlse = reference.forward(*args, w, causal)
    rg = reference.backward(*args, ro, rlse, np64(do), w, causal)
    lo, llse = reference.lowp_forward(*args, w, causal, dtype=name)
    lg = reference.lowp_backward(*args, lo, llse, np64(do), w, causal, dtype=name)
    for n, got, r, lw in zip(NAMES, (dq1, dk[0], dq2, dk[1], dk[2]), rg, lg):
        assert not torch.isnan(got).any(), n
        tolerance.assert_close(n, np64(got), r, lw, name)
