"""float32 inputs on the GPU: the mma.sync kernels with TF32 products (m16n8k8, float32
accumulation), float32 outputs, judged by the SPEC's float32 rule (the "tf32" yardstick of
reference.lowp_forward / lowp_backward, relative L2 bound 2e-3).

Every case runs forward and all five gradients against the float64 reference with NaN-
poisoned outputs (test_kernels_gpu.run_case, test_varlen_gpu.run_packed), on every head
dim the architecture's table has float32 tiles for, causal and not, grouped-query heads,
strided inputs, w on and off tile edges, split-KV decoding, position offsets with a
gradient into lse, and the PyTorch autograd path. The Hopper kernels are 16-bit only, so on
an H100/H200 these run the mma.sync kernels whatever CUPY_PIECEWISE_PATH says.
"""
from __future__ import annotations

import numpy as np
import pytest

from test_kernels_gpu import LENGTHS, case_id, case_list, run_case
from test_varlen_gpu import LENS, run_packed

pytestmark = pytest.mark.gpu


def _cc():
    import cupy

    return cupy.cuda.Device().compute_capability


def _has_float32_tiles(D):
    """False where the table has no float32 kernel of head dim D for this GPU
    (capability.TF32_TABLE: 256 nowhere, its tiles spill or do not fit)."""
    from cupy_piecewise import capability

    cc = _cc()
    return capability.has_float32_kernels((int(cc[:-1]), int(cc[-1])), D)


#: every head dim with float32 kernels (6 of them against 7 values of w, so that each head
#: dim meets several w), one-key rows and a decode shape among the lengths
CASES = case_list(dims=(16, 32, 64, 80, 96, 128), dtypes=("float32",), count=30,
                  lengths=LENGTHS[:6] + (LENGTHS[7], LENGTHS[6]), causal_every=6)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_float32_matches_reference(case):
    if not _has_float32_tiles(case["D"]):
        pytest.skip(f"no float32 kernel of head dim {case['D']} on this GPU (capability.TF32_TABLE)")
    run_case(**case)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("w", [-1000, 31, 32, 33, 127, 128, 500])
@pytest.mark.parametrize("D", [64, 128])
def test_float32_w_on_and_off_tile_edges(causal, w, D):
    run_case(D=D, dtype="float32", causal=causal, M=700, N=700, w=w, group=2, transposed=False)


@pytest.mark.parametrize("M,N,D,group,causal", [
    (1, 50000, 128, 8, False),   # decode: split-KV over many key tiles, then the combine
    (16, 20011, 64, 1, True),
    (200, 9000, 64, 2, False),   # few query tiles: split-KV with the main tiles
])
def test_float32_split_kv(M, N, D, group, causal):
    from cupy_piecewise import launch
    from cupy_piecewise.validate import Problem

    run_case(D=D, dtype="float32", causal=causal, M=M, N=N, w=N // 3, group=group,
             transposed=False)
    problem = Problem("cupy", 1, group, 1, M, N, D, "float32", N // 3, causal, 0.1, 0)
    phase = "fwd_decode" if M <= launch.DECODE_ROWS else "fwd"
    assert launch.split_plan(problem, launch.plan(problem, phase).tiles, 132)[0] > 1


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_float32_offsets_dlse_and_deterministic(causal, D):
    run_case(D=D, dtype="float32", causal=causal, M=300, N=500, w=40, group=2, transposed=True,
             q_offset=700, k_offset=300, with_dlse=True, deterministic=True)


@pytest.mark.parametrize("lq,lk", LENS, ids=[f"case{i}" for i in range(len(LENS))])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_float32_packed_batches(lq, lk, causal, D):
    run_packed(lq, lk, D=D, dtype="float32", causal=causal, w=5, deterministic=True)


def test_float32_runs_the_mma_kernels_in_tf32():
    """The plan: the mma.sync kernels with the tf32_t element type, never a Hopper kernel;
    and the products really are TF32, not float32: the error of o sits near TF32's
    rounding (2^-11 relative), far above what float32 products would leave."""
    import cupy

    import cupy_piecewise
    from cupy_piecewise import launch, reference
    from cupy_piecewise.validate import Problem

    problem = Problem("cupy", 4, 16, 16, 4096, 4096, 128, "float32", 100, True, 0.1, 0)
    launches = launch.forward_launches(problem, [(16 * 4096 * 128, 4096 * 128, 128, 1)] * 6)
    assert type(launches) is launch.Launches
    assert launch.plan(problem, "fwd").name_expression.startswith("pw_forward<tf32_t, 128,")

    rng = np.random.default_rng(1)
    host = [rng.standard_normal((1, 2, 256, 64)).astype(np.float32) for _ in range(5)]
    o = cupy_piecewise.attention(*[cupy.asarray(x) for x in host], 50)
    assert o.dtype == cupy.float32
    ref, _ = reference.forward(*host, 50)
    err = np.linalg.norm(cupy.asnumpy(o) - ref) / np.linalg.norm(ref)
    assert 1e-5 < err < 2e-3, err


def test_float32_torch_autograd():
    """torch float32 tensors on CUDA: forward and backward through autograd, outputs and
    gradients float32, against the reference by the float32 (TF32) rule."""
    import torch

    from cupy_piecewise import reference, tolerance, torch_ops

    g = torch.Generator(device="cpu").manual_seed(3)
    B, H, Hkv, M, N, D, w = 2, 4, 2, 150, 230, 64, 40
    shapes = [(B, H, M, D), (B, Hkv, N, D), (B, H, M, D), (B, Hkv, N, D), (B, Hkv, N, D)]
    ins = [torch.randn(s, generator=g).cuda().requires_grad_() for s in shapes]  # INPUT_SCALE
    o, lse = torch_ops.attention(*ins, w, causal=True, return_lse=True)
    assert o.dtype == torch.float32 and lse.dtype == torch.float32
    do = torch.randn(o.shape, generator=g).cuda()
    o.backward(do)
    args = [t.detach().double().cpu().numpy() for t in ins]
    ro, rlse = reference.forward(*args, w, True)
    lo, llse = reference.lowp_forward(*args, w, True, dtype="tf32")
    np64 = [o.detach().double().cpu().numpy(), lse.detach().double().cpu().numpy()]
    tolerance.assert_close("o", np64[0], ro, lo, "tf32")
    tolerance.assert_close("lse", np64[1], rlse, llse, "tf32")
    dnp = do.double().cpu().numpy()
    rg = reference.backward(*args, np64[0], np64[1], dnp, w, True)
    lg = reference.lowp_backward(*args, np64[0], np64[1], dnp, w, True, dtype="tf32")
    for name, leaf, r, lw in zip(("dq1", "dk1", "dq2", "dk2", "dv"), ins, rg, lg):
        assert leaf.grad.dtype == torch.float32
        tolerance.assert_close(name, leaf.grad.double().cpu().numpy(), r, lw, "tf32")


@pytest.mark.parametrize("nan_bits", [0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF])
def test_float32_nan_inputs_give_nan_rows(nan_bits):
    """A NaN in one query row (the host's quiet NaN, and the GPU's canonical NaN, whose
    payload a rounding by integer add would carry into the sign bit: common.cuh, Elem<tf32_t>)
    makes that row's o NaN; every other row stays finite and right."""
    import cupy

    import cupy_piecewise
    from cupy_piecewise import reference, tolerance

    rng = np.random.default_rng(4)
    host = [rng.standard_normal((1, 2, 40, 64)).astype(np.float32) for _ in range(5)]
    host[0][0, 1, 7, 5] = np.array([nan_bits], np.uint32).view(np.float32)[0]
    w = 100  # beyond every distance: every pair scores with q1
    o = cupy.asnumpy(cupy_piecewise.attention(*[cupy.asarray(x) for x in host], w))
    assert np.isnan(o[0, 1, 7]).all()
    keep = np.ones(o.shape, bool)
    keep[0, 1, 7] = False
    assert np.isfinite(o[keep]).all()
    clean = [x.copy() for x in host]
    clean[0][0, 1, 7, 5] = 0.0
    ref, _ = reference.forward(*clean, w)
    low, _ = reference.lowp_forward(*clean, w, dtype="tf32")
    verdict = tolerance.compare("o", np.where(keep, o, ref), ref, low, "tf32")
    assert verdict.passed, verdict


def test_float32_kv_cache_is_refused_before_launch():
    import cupy

    import cupy_piecewise

    q = cupy.zeros((1, 2, 1, 64), cupy.float32)
    cache = cupy.zeros((1, 2, 32, 64), cupy.float32)
    lens = cupy.zeros((1,), cupy.int32)
    with pytest.raises(ValueError, match="float32 KV caches"):
        cupy_piecewise.attention_with_kvcache(q, q, cache, cache, cache, 4, cache_seqlens=lens)
