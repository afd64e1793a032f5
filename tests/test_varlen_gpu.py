"""Packed variable-length batches on the CUDA kernels (cupy_piecewise.varlen_gpu), and the
head dims 80, 96 and 256, against the float64 reference by the tolerance rule.

Packed cases draw fresh inputs, run the reference sequence by sequence, and compare the
packed outputs (NaN-poisoned before the kernels run, so a row no block writes fails) and all
five gradients, with a gradient into lse. torch: autograd, torch.compile(fullgraph=True)
and a CUDA graph replayed with other lengths.
"""
from __future__ import annotations

import numpy as np
import pytest

import cupy_piecewise
from cupy_piecewise import reference, tolerance
from cupy_piecewise.gpu_arrays import poisoned_outputs, round_to, to_host
from test_kernels_gpu import INPUT_SCALE, kernel_path  # noqa: F401  (fixture: mma / hopper paths)
from seeds import fresh_seed  # noqa: E402  (tests/ is on sys.path: tests/seeds.py)

pytestmark = pytest.mark.gpu

#: (query lengths, key lengths) per sequence: empty sequences, one sequence, more queries
#: than keys, tile edges (63/64/65, 127/128/129), a long one among short ones.
LENS = [
    ([3, 0, 5, 1], [4, 0, 9, 1]),
    ([300], [300]),
    ([0, 0], [3, 0]),
    ([64, 65, 63, 1], [128, 129, 127, 300]),
    ([700, 17, 129], [200, 900, 129]),
    ([1, 1, 1, 1, 1], [1000, 17, 0, 64, 333]),
]


def _packed_host(lq, lk, H, Hkv, D, dtype, rng):
    tq, tk = sum(lq), sum(lk)
    shapes = [(tq, H, D), (tk, Hkv, D), (tq, H, D), (tk, Hkv, D), (tk, Hkv, D)]
    host = [round_to(rng.standard_normal(s).astype(np.float32) * INPUT_SCALE[dtype], dtype)
            for s in shapes]
    cu = [np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lq, lk)]
    return host, cu


def _seq(x, a, b):
    return x[a:b].transpose(1, 0, 2)[None]


def _kind(dtype):
    """The yardstick of ``dtype``'s kernels: float32 inputs run TF32 products."""
    return "tf32" if dtype == "float32" else dtype


def _reference(host, cu, w, causal, sm_scale, dtype, do=None, o=None, lse=None, dlse=None):
    """Per-sequence reference (float64 and low precision), packed back: forward (o, lse),
    or with ``do`` the five gradients."""
    (cq, ck), B = cu, len(cu[0]) - 1
    q1, k1, q2, k2, v = host
    outs_ref, outs_low = [], []
    for b in range(B):
        qs, ks = (cq[b], cq[b + 1]), (ck[b], ck[b + 1])
        seq = [_seq(x, *s) for x, s in zip(host, (qs, ks, qs, ks, ks))]
        if do is None:
            outs_ref.append(reference.forward(*seq, w, causal, sm_scale))
            outs_low.append(reference.lowp_forward(*seq, w, causal, sm_scale, dtype=_kind(dtype)))
        else:
            extra = (_seq(o, *qs), lse[:, qs[0]:qs[1]][None], _seq(do, *qs))
            d = None if dlse is None else dlse[:, qs[0]:qs[1]][None]
            outs_ref.append(reference.backward(*seq, *extra, w, causal, sm_scale, dlse=d))
            outs_low.append(reference.lowp_backward(*seq, *extra, w, causal, sm_scale,
                                                    dtype=_kind(dtype), dlse=d))
    def pack(parts, which, kind):
        if kind == "lse":
            return np.concatenate([p[which][0] for p in parts], axis=1)
        return np.concatenate([p[which][0].transpose(1, 0, 2) for p in parts], axis=0)
    if do is None:
        return ([pack(outs_ref, 0, "o"), pack(outs_ref, 1, "lse")],
                [pack(outs_low, 0, "o"), pack(outs_low, 1, "lse")])
    return ([pack(outs_ref, i, "g") for i in range(5)], [pack(outs_low, i, "g") for i in range(5)])


def run_packed(lq, lk, D=64, dtype="bfloat16", causal=False, w=3, H=4, Hkv=2, give_max=True,
               deterministic=False):
    """One packed call and its backward against the reference; returns the gradients (CuPy)."""
    import cupy

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    host, cu = _packed_host(lq, lk, H, Hkv, D, dtype, rng)
    sm_scale = 1.0 / np.sqrt(D)
    from cupy_piecewise.gpu_arrays import _np_dtype

    dev = [cupy.asarray(x.astype(_np_dtype(dtype))) for x in host]
    cu_d = [cupy.asarray(c) for c in cu]
    before = [a.copy() for a in dev]
    kw = dict(max_seqlen_q=max(lq), max_seqlen_k=max(lk)) if give_max else {}
    with poisoned_outputs():
        o, lse = cupy_piecewise.attention_varlen(*dev, *cu_d, w, causal=causal,
                                                 sm_scale=float(sm_scale), return_lse=True, **kw)
    assert o.shape == dev[0].shape and lse.shape == (H, sum(lq)) and lse.dtype == cupy.float32
    (o_ref, lse_ref), (o_low, lse_low) = _reference(host, cu, w, causal, sm_scale, dtype)
    o_k, lse_k = to_host(o), cupy.asnumpy(lse).astype(np.float64)
    for name, got, ref, low in (("o", o_k, o_ref, o_low), ("lse", lse_k, lse_ref, lse_low)):
        verdict = tolerance.compare(name, got, ref, low, _kind(dtype))
        assert verdict.passed, f"{verdict} (seed {seed}, lengths {lq} / {lk})"

    o_used = round_to(o_k.astype(np.float32), dtype)
    do_h = round_to(rng.standard_normal(o_used.shape).astype(np.float32), dtype)
    dlse_h = rng.standard_normal(lse_k.shape).astype(np.float32)
    grads_ref, grads_low = _reference(host, cu, w, causal, sm_scale, dtype, do_h, o_used, lse_k,
                                      dlse_h)
    if dtype == "float16" and sum(lq):  # loss scaling keeps float16 gradients normal
        s = tolerance.float16_loss_scale([g[None] for g in grads_ref], do_h[None])
        do_h, dlse_h = do_h * np.float32(s), dlse_h * np.float32(s)
        grads_ref, grads_low = _reference(host, cu, w, causal, sm_scale, dtype, do_h, o_used,
                                          lse_k, dlse_h)
    do_d = cupy.asarray(do_h.astype(_np_dtype(dtype)))
    with poisoned_outputs():
        grads = cupy_piecewise.attention_varlen_backward(
            do_d, *dev, o, lse, *cu_d, w, causal=causal, sm_scale=float(sm_scale),
            dlse=cupy.asarray(dlse_h), deterministic=deterministic, **kw)
    for name, got, ref, low in zip(("dq1", "dk1", "dq2", "dk2", "dv"), grads, grads_ref, grads_low):
        assert got.shape == ref.shape and got.dtype == dev[0].dtype
        verdict = tolerance.compare(name, to_host(got), ref, low, _kind(dtype))
        assert verdict.passed, f"{verdict} (seed {seed}, lengths {lq} / {lk})"
    for a, b in zip(dev, before):
        assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all()), "an input was written"
    if deterministic:  # a second run gives the same bits
        again = cupy_piecewise.attention_varlen_backward(
            do_d, *dev, o, lse, *cu_d, w, causal=causal, sm_scale=float(sm_scale),
            dlse=cupy.asarray(dlse_h), deterministic=True, **kw)
        for name, a, b in zip(("dq1", "dk1", "dq2", "dk2", "dv"), grads, again):
            assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all()), f"{name} changed"
    return grads


@pytest.mark.parametrize("lq,lk", LENS, ids=[f"case{i}" for i in range(len(LENS))])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,D", [("bfloat16", 64), ("float16", 128), ("bfloat16", 128),
                                     ("float16", 32)])
def test_packed_batches_match_reference(kernel_path, lq, lk, causal, dtype, D):
    """On the mma.sync kernels and (CUPY_PIECEWISE_PATH=hopper, on an H100/H200, head dims 64
    and 128) the Hopper forward and backward built for packed batches (dQ by atomics)."""
    run_packed(lq, lk, D=D, dtype=dtype, causal=causal, w=max(1, max(lk) // 3))


@pytest.mark.parametrize("lq,lk", LENS[3:], ids=[f"case{i}" for i in range(3, len(LENS))])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,D", [("float16", 64), ("bfloat16", 128), ("float16", 80)])
def test_packed_deterministic_backward(kernel_path, lq, lk, causal, dtype, D):
    """deterministic=True: the reference by the rule and equal bits on a second run (on the
    Hopper path dK/dV from pw90_bwd without dQ, dQ from the packed mma.sync dq kernel)."""
    run_packed(lq, lk, D=D, dtype=dtype, causal=causal, w=max(1, max(lk) // 3), deterministic=True)


@pytest.mark.parametrize("D", [16, 80, 96, 256])
@pytest.mark.parametrize("w", [-2, 0, 50])
def test_packed_other_head_dims_and_w(kernel_path, D, w):
    """(hopper: D = 256 takes the Hopper packed forward, 32-key tiles; its backward and the
    other dims run the mma.sync kernels)"""
    run_packed([130, 0, 40], [100, 7, 300], D=D, dtype="bfloat16", causal=True, w=w, H=2, Hkv=1)


def test_packed_batch_takes_the_hopper_kernels_on_hopper(monkeypatch):
    """With CUPY_PIECEWISE_PATH=hopper a packed D = 128 forward runs pw90_forward<..., true>
    and its backward pw90_bwd<..., true> on compute capability 9.0 (and the mma.sync packed
    kernels elsewhere)."""
    import cupy

    from cupy_piecewise import capability, launch, varlen_gpu, varlen_launch

    monkeypatch.setenv(capability.PATH_VAR, "hopper")
    capability.refresh_env_override()
    varlen_gpu._launch_memo.clear()
    run_packed([200, 33, 0, 129], [300, 33, 7, 128], D=128, dtype="bfloat16", causal=True, w=40)
    made = [v for k, v in varlen_gpu._launch_memo._data.items() if k[0] == "fwd"]
    on_hopper = launch._compute_capability(cupy.cuda.Device().id) == (9, 0)
    assert made and all(isinstance(m, varlen_launch.HopperVarlenLaunches) == on_hopper
                        for m in made)
    made = [v for k, v in varlen_gpu._launch_memo._data.items() if k[0] == "bwd"]
    assert made and all(isinstance(m, launch.HopperBackward) == on_hopper for m in made)
    assert all(m.arrays == varlen_launch.BACKWARD_ARRAYS for m in made)


def test_packed_without_max_seqlen_reads_and_checks_the_totals():
    import cupy

    run_packed([5, 9], [20, 3], give_max=False)
    q = cupy.zeros((4, 2, 64), cupy.float16)
    k = cupy.zeros((6, 2, 64), cupy.float16)
    bad = cupy.asarray(np.array([0, 3, 2], np.int32))
    with pytest.raises(ValueError, match="non-decreasing"):
        cupy_piecewise.attention_varlen(q, k, q, k, k, bad, cupy.asarray(np.array([0, 3, 6], np.int32)), 1)
    with pytest.raises(TypeError, match="int32"):
        cupy_piecewise.attention_varlen(q, k, q, k, k, cupy.asarray(np.array([0, 2, 4])),
                                        cupy.asarray(np.array([0, 3, 6])), 1)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        cupy_piecewise.attention_varlen(q, k, q, k, k, cupy.asarray(np.array([0, 2, 4], np.int32)),
                                        cupy.asarray(np.array([0, 3, 6], np.int32)), 1,
                                        max_seqlen_q=5, max_seqlen_k=3)


def test_one_packed_sequence_equals_the_dense_call():
    """One sequence packed or as (1, H, L, D): the same values within the rule, and both
    against the reference (the dense call may take another kernel)."""
    import cupy

    rng = np.random.default_rng()
    H, D, L = 4, 128, 777
    xs = [cupy.asarray(rng.standard_normal((L, H, D)).astype(np.float16)) for _ in range(5)]
    cu = cupy.asarray(np.array([0, L], np.int32))
    o = cupy_piecewise.attention_varlen(*xs, cu, cu, 100, causal=True, max_seqlen_q=L,
                                        max_seqlen_k=L)
    dense = cupy_piecewise.attention(*[x.transpose(1, 0, 2)[None] for x in xs], 100, causal=True)
    host = [cupy.asnumpy(x).astype(np.float32).transpose(1, 0, 2)[None] for x in xs]
    ref, _ = reference.forward(*host, 100, True, 1 / np.sqrt(D))
    low, _ = reference.lowp_forward(*host, 100, True, 1 / np.sqrt(D), dtype="float16")
    for got in (to_host(o).transpose(1, 0, 2)[None], to_host(dense)):
        verdict = tolerance.compare("o", got, ref, low, "float16")
        assert verdict.passed, str(verdict)


@pytest.mark.parametrize("D", [80, 96, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_new_head_dims_dense(kernel_path, D, dtype, causal):
    """Head dims 80, 96, 256 on the dense entry points, grouped heads, a transposed layout:
    the mma.sync kernels, and (hopper, on an H100/H200) the Hopper kernels (80 and 96 on
    the D = 128 kernels with zero-padded columns; the forward only at 256), both backward
    modes."""
    from test_kernels_gpu import run_case

    run_case(D=D, dtype=dtype, causal=causal, M=300, N=517, w=130, group=2, transposed=True)
    run_case(D=D, dtype=dtype, causal=causal, M=5, N=3000, w=1000, group=1, transposed=False)
    run_case(D=D, dtype=dtype, causal=causal, M=700, N=450, w=-3, group=4, transposed=False,
             deterministic=True)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("M,N,w", [
    (129, 33, 16), (300, 517, 31), (1000, 1000, 32), (64, 4000, 33), (2048, 2048, 1000),
    (4096, 3, 1),
    # One key: every probability is 1. Without a gradient into lse the exact dq and dk are 0
    # and the rule would compare float32 summation residues (this case was an xfail for that
    # reason); run_case now gives 16-bit one-key cases a random dlse, so dS = dlse exactly and
    # the gradients are real (bench/NOTES.md, thirty-first section).
    (4096, 1, -5),
])
def test_head_dim_256_on_both_paths(kernel_path, dtype, causal, M, N, w):
    """D = 256 on the Hopper forward (32-key tiles: w on and beside a tile edge, edge tiles
    in M and N, few keys, long rows) and on the mma.sync kernels; backward on mma.sync."""
    from test_kernels_gpu import run_case

    run_case(D=256, dtype=dtype, causal=causal, M=M, N=N, w=w, group=2, transposed=M == 300)


def test_torch_packed_autograd_compile_and_cuda_graph():
    torch = pytest.importorskip("torch")
    dev = torch.device("cuda")
    lq, lk, H, Hkv, D = [37, 0, 130], [50, 9, 200], 4, 2, 64
    g = torch.Generator(device="cpu").manual_seed(int(np.random.SeedSequence().entropy % 2**31))
    mk = lambda *s: torch.randn(*s, generator=g).to(dev, torch.bfloat16)  # noqa: E731
    tq, tk = sum(lq), sum(lk)
    leaves = [mk(tq, H, D), mk(tk, Hkv, D), mk(tq, H, D), mk(tk, Hkv, D), mk(tk, Hkv, D)]
    leaves = [x.requires_grad_() for x in leaves]
    cq = torch.tensor(np.concatenate([[0], np.cumsum(lq)]), dtype=torch.int32, device=dev)
    ck = torch.tensor(np.concatenate([[0], np.cumsum(lk)]), dtype=torch.int32, device=dev)
    o, lse = cupy_piecewise.attention_varlen(*leaves, cq, ck, 20, causal=True, return_lse=True,
                                             max_seqlen_q=max(lq), max_seqlen_k=max(lk))
    do = torch.randn(o.shape, generator=g).to(dev, torch.bfloat16)
    wl = torch.randn(lse.shape, generator=g).to(dev)
    ((o.float() * do.float()).sum() + (lse * wl).sum()).backward()
    got = [x.grad.clone() for x in leaves]
    # the same loss through dense calls, one per sequence
    for x in leaves:
        x.grad = None
    loss = 0
    for b in range(len(lq)):
        qs, ks = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
        seq = [x[s].transpose(0, 1)[None] for x, s in zip(leaves, (qs, ks, qs, ks, ks))]
        ob, lb = cupy_piecewise.attention(*seq, 20, causal=True, return_lse=True)
        loss = loss + (ob[0].transpose(0, 1).float() * do[qs].float()).sum() + (lb[0] * wl[:, qs]).sum()
    loss.backward()
    for name, a, x in zip(("dq1", "dk1", "dq2", "dk2", "dv"), got, leaves):
        err = (a.float() - x.grad.float()).norm() / x.grad.float().norm().clamp_min(1e-30)
        assert err < 2e-2, f"{name}: relative L2 {float(err):.3g} against per-sequence calls"

    # deterministic=True through autograd: the same rule against the per-sequence calls,
    # and equal bits on a second run
    det = []
    for _ in range(2):
        for x in leaves:
            x.grad = None
        o2, lse2 = cupy_piecewise.attention_varlen(*leaves, cq, ck, 20, causal=True, return_lse=True,
                                                   max_seqlen_q=max(lq), max_seqlen_k=max(lk),
                                                   deterministic=True)
        ((o2.float() * do.float()).sum() + (lse2 * wl).sum()).backward()
        det.append([x.grad.clone() for x in leaves])
    for name, a, b, x in zip(("dq1", "dk1", "dq2", "dk2", "dv"), det[0], det[1], got):
        assert torch.equal(a, b), f"{name}: deterministic=True changed between runs"
        err = (a.float() - x.float()).norm() / x.float().norm().clamp_min(1e-30)
        assert err < 2e-2, f"{name}: relative L2 {float(err):.3g} (deterministic)"

    # torch.compile(fullgraph=True) traces the operator
    fn = torch.compile(lambda *a: cupy_piecewise.attention_varlen(
        *a, 20, causal=True, max_seqlen_q=max(lq), max_seqlen_k=max(lk)), fullgraph=True)
    args = [x.detach() for x in leaves] + [cq, ck]
    torch.testing.assert_close(fn(*args), o.detach(), rtol=0, atol=0)

    # a CUDA graph captured once replays with other lengths within the same max_seqlen
    static = [x.detach().clone() for x in leaves]
    cq_s, ck_s = cq.clone(), ck.clone()
    run = lambda: cupy_piecewise.attention_varlen(*static, cq_s, ck_s, 20, causal=True,  # noqa: E731
                                                  max_seqlen_q=max(lq), max_seqlen_k=max(lk))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm-up: compile and plan outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    new_q, new_k = [100, 30, 37], [10, 200, 49]
    cq_s.copy_(torch.tensor(np.concatenate([[0], np.cumsum(new_q)]), dtype=torch.int32))
    ck_s.copy_(torch.tensor(np.concatenate([[0], np.cumsum(new_k)]), dtype=torch.int32))
    graph.replay()
    want = cupy_piecewise.attention_varlen(*static, cq_s, ck_s, 20, causal=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
