"""Argument checks (cupy_piecewise.validate): every bad input gets a TypeError or
ValueError naming the argument, before anything runs. CPU only."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cupy_piecewise import validate
from cupy_piecewise.validate import (
    Problem,
    check_backward_inputs,
    check_gpu_support,
    check_inputs,
)

torch = pytest.importorskip("torch")

B, H, HKV, M, N, D = 2, 4, 2, 5, 7, 16


def make(B=B, H=H, Hkv=HKV, M=M, N=N, D=D, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    q1 = rng.standard_normal((B, H, M, D)).astype(dtype)
    q2 = rng.standard_normal((B, H, M, D)).astype(dtype)
    k1 = rng.standard_normal((B, Hkv, N, D)).astype(dtype)
    k2 = rng.standard_normal((B, Hkv, N, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, N, D)).astype(dtype)
    return dict(q1=q1, k1=k1, q2=q2, k2=k2, v=v)


def call(arrays, w=3, causal=False, sm_scale=None):
    a = arrays
    return check_inputs(a["q1"], a["k1"], a["q2"], a["k2"], a["v"], w, causal, sm_scale)


def expect(exc_type, name, fn, *args, **kwargs):
    with pytest.raises(exc_type) as info:
        fn(*args, **kwargs)
    assert name in str(info.value), f"message {str(info.value)!r} does not name {name!r}"
    return str(info.value)


# --------------------------------------------------------------------- good input


def test_good_numpy_problem():
    p = call(make(), w=3, causal=True)
    assert p == Problem("numpy", B, H, HKV, M, N, D, "float32", 3, True, 1 / math.sqrt(D), None)
    assert p.group == H // HKV


def test_good_torch_cpu_bfloat16():
    t = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in make().items()}
    p = call(t, w=-2)
    assert (p.library, p.dtype, p.device, p.w) == ("torch", "bfloat16", None, -2)


def test_numpy_integer_w_and_scale_accepted():
    p = call(make(), w=np.int64(5), sm_scale=np.float32(0.5))
    assert p.w == 5 and type(p.w) is int
    assert p.sm_scale == 0.5 and type(p.sm_scale) is float


def test_numpy_bool_causal_accepted():
    assert call(make(), causal=np.bool_(True)).causal is True


def test_sm_scale_int_accepted():
    assert call(make(), sm_scale=2).sm_scale == 2.0


def test_empty_lengths_and_batch_accepted():
    p = call(make(B=0, M=0, N=0))
    assert (p.B, p.M, p.N) == (0, 0, 0)


def test_strided_views_accepted():
    a = make()
    # (B, L, H, D) memory read as (B, H, L, D)
    a["q1"] = np.ascontiguousarray(a["q1"].transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    assert call(a).M == M


def test_large_and_negative_w():
    assert call(make(), w=-(2**40)).w == -(2**40)
    assert call(make(), w=2**40).w == 2**40


# --------------------------------------------------------------------- libraries


def test_not_an_array():
    a = make()
    a["k2"] = a["k2"].tolist()
    expect(TypeError, "k2", call, a)


def test_scalar_instead_of_array():
    a = make()
    a["v"] = np.float32(1.0)
    expect(TypeError, "v", call, a)


def test_mixed_libraries_numpy_torch():
    a = make()
    a["k1"] = torch.from_numpy(a["k1"])
    msg = expect(TypeError, "k1", call, a)
    assert "torch" in msg and "numpy" in msg


def test_mixed_libraries_torch_first():
    a = {k: torch.from_numpy(v) for k, v in make().items()}
    a["v"] = a["v"].numpy()
    expect(TypeError, "v", call, a)


# --------------------------------------------------------------------- devices


def test_mixed_devices_meta_vs_cpu():
    a = {k: torch.from_numpy(v) for k, v in make().items()}
    a["q2"] = torch.empty(a["q2"].shape, dtype=a["q2"].dtype, device="meta")
    msg = expect(ValueError, "q2", call, a)
    assert "meta" in msg and "cpu" in msg


def test_unsupported_device_type():
    a = {k: torch.empty(v.shape, dtype=torch.float32, device="meta") for k, v in make().items()}
    expect(ValueError, "q1", call, a)


def test_backward_device_mismatch():
    t = {k: torch.from_numpy(v) for k, v in make().items()}
    p = call(t)
    o = torch.empty(B, H, M, D, device="meta")
    expect(ValueError, "o", check_backward_inputs, p, o, torch.zeros(B, H, M), torch.zeros(B, H, M, D))


# --------------------------------------------------------------------- dtypes


def test_mixed_dtypes():
    a = make()
    a["k2"] = a["k2"].astype(np.float64)
    msg = expect(TypeError, "k2", call, a)
    assert "float64" in msg and "float32" in msg


def test_integer_dtype_rejected():
    a = {k: v.astype(np.int32) for k, v in make().items()}
    expect(TypeError, "q1", call, a)


def test_complex_dtype_rejected():
    a = {k: v.astype(np.complex64) for k, v in make().items()}
    expect(TypeError, "q1", call, a)


def test_torch_int_dtype_rejected():
    a = {k: torch.from_numpy(v).to(torch.int64) for k, v in make().items()}
    expect(TypeError, "q1", call, a)


# --------------------------------------------------------------------- rank and shapes


@pytest.mark.parametrize("name", ["q1", "k1", "q2", "k2", "v"])
def test_wrong_rank(name):
    a = make()
    a[name] = a[name][0]
    msg = expect(ValueError, name, call, a)
    assert "4 dimensions" in msg


def test_rank_five_rejected():
    a = make()
    a["q1"] = a["q1"][None]
    expect(ValueError, "q1", call, a)


@pytest.mark.parametrize("name", ["k1", "q2", "k2", "v"])
def test_batch_mismatch(name):
    a = make()
    a[name] = a[name][:1]
    msg = expect(ValueError, name, call, a)
    assert "batch" in msg


@pytest.mark.parametrize("name", ["k1", "q2", "k2", "v"])
def test_head_dim_mismatch(name):
    a = make()
    a[name] = a[name][..., :8]
    msg = expect(ValueError, name, call, a)
    assert "head_dim" in msg


def test_q2_heads_mismatch():
    a = make()
    a["q2"] = a["q2"][:, :2]
    msg = expect(ValueError, "q2", call, a)
    assert "heads" in msg


def test_q2_length_mismatch():
    a = make()
    a["q2"] = a["q2"][:, :, :3]
    msg = expect(ValueError, "q2", call, a)
    assert "length" in msg


@pytest.mark.parametrize("name", ["k2", "v"])
def test_kv_heads_mismatch(name):
    a = make()
    a[name] = a[name][:, :1]
    msg = expect(ValueError, name, call, a)
    assert "heads" in msg


@pytest.mark.parametrize("name", ["k2", "v"])
def test_kv_length_mismatch(name):
    a = make()
    a[name] = a[name][:, :, :4]
    msg = expect(ValueError, name, call, a)
    assert "length" in msg


def test_heads_not_multiple_of_kv_heads():
    a = make(H=3, Hkv=2)
    msg = expect(ValueError, "q1", call, a)
    assert "multiple" in msg


def test_zero_kv_heads():
    a = make(H=0, Hkv=0)
    expect(ValueError, "k1", call, a)


def test_head_dim_zero():
    a = make(D=0)
    msg = expect(ValueError, "head_dim", call, a)
    assert "q1" in msg


# --------------------------------------------------------------------- scalars


@pytest.mark.parametrize("w", [3.0, 2.5, "3", None, [3], True, False, np.bool_(True)])
def test_non_integer_w(w):
    expect(TypeError, "dist_threshold", call, make(), w=w)


def test_torch_tensor_w_rejected():
    expect(TypeError, "dist_threshold", call, make(), w=torch.tensor(3))


@pytest.mark.parametrize("causal", [1, 0, "yes", None, 1.0])
def test_causal_not_bool(causal):
    expect(TypeError, "causal", call, make(), causal=causal)


@pytest.mark.parametrize("scale", ["0.1", [0.1], True, complex(1, 0)])
def test_sm_scale_wrong_type(scale):
    expect(TypeError, "sm_scale", call, make(), sm_scale=scale)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), -float("inf")])
def test_sm_scale_not_finite_positive(scale):
    expect(ValueError, "sm_scale", call, make(), sm_scale=scale)


# --------------------------------------------------------------------- backward inputs


def _fwd_outputs(p, dtype=np.float32):
    o = np.zeros((p.B, p.H, p.M, p.D), dtype)
    lse = np.zeros((p.B, p.H, p.M), np.float32)
    do = np.ones((p.B, p.H, p.M, p.D), dtype)
    return o, lse, do


def test_backward_good():
    p = call(make())
    check_backward_inputs(p, *_fwd_outputs(p))
    o, lse, do = _fwd_outputs(p)
    check_backward_inputs(p, o, lse.astype(np.float64), do)  # float64 lse ok on the CPU


@pytest.mark.parametrize("name", ["o", "do"])
def test_backward_wrong_shape(name):
    p = call(make())
    args = dict(zip(("o", "lse", "do"), _fwd_outputs(p)))
    args[name] = args[name][:, :, :2]
    expect(ValueError, name, check_backward_inputs, p, args["o"], args["lse"], args["do"])


@pytest.mark.parametrize("name", ["o", "do"])
def test_backward_wrong_dtype(name):
    p = call(make())
    args = dict(zip(("o", "lse", "do"), _fwd_outputs(p)))
    args[name] = args[name].astype(np.float16)
    expect(TypeError, name, check_backward_inputs, p, args["o"], args["lse"], args["do"])


def test_backward_lse_shape():
    p = call(make())
    o, lse, do = _fwd_outputs(p)
    expect(ValueError, "lse", check_backward_inputs, p, o, lse[..., None], do)


def test_backward_lse_dtype():
    p = call(make())
    o, lse, do = _fwd_outputs(p)
    expect(TypeError, "lse", check_backward_inputs, p, o, lse.astype(np.float16), do)


def test_backward_mixed_library():
    p = call(make())
    o, lse, do = _fwd_outputs(p)
    expect(TypeError, "do", check_backward_inputs, p, o, lse, torch.from_numpy(do))


def test_backward_not_array():
    p = call(make())
    o, lse, do = _fwd_outputs(p)
    expect(TypeError, "lse", check_backward_inputs, p, o, lse.tolist(), do)


# --------------------------------------------------------------------- GPU support (metadata only)


def _gpu_problem(**changes):
    base = dict(library="cupy", B=1, H=2, Hkv=1, M=8, N=8, D=64, dtype="float16", w=2, causal=False,
                sm_scale=0.125, device=0)
    base.update(changes)
    return Problem(**base)


def test_gpu_support_good():
    check_gpu_support(_gpu_problem())
    check_gpu_support(_gpu_problem(library="torch", dtype="bfloat16", D=128))
    check_gpu_support(_gpu_problem(dtype="float32", D=96))  # TF32 on the mma.sync kernels


@pytest.mark.parametrize("D", [8, 48, 112, 512])
def test_gpu_head_dim_unsupported(D):
    expect(ValueError, "head_dim", check_gpu_support, _gpu_problem(D=D))


def test_gpu_dtype_unsupported():
    expect(TypeError, "float64", check_gpu_support, _gpu_problem(dtype="float64"))


def test_gpu_support_cpu_problem():
    expect(ValueError, "q1", check_gpu_support, _gpu_problem(device=None, library="numpy"))


def test_validate_does_not_import_cupy():
    import subprocess
    import sys

    code = (
        "import sys, numpy as np\n"
        "from cupy_piecewise.validate import check_inputs\n"
        "a = np.zeros((1, 1, 2, 4), np.float32)\n"
        "check_inputs(a, a, a, a, a, 1)\n"
        "assert 'cupy' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
    )
    from pathlib import Path

    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def test_library_of_parameter_subclass():
    p = torch.nn.Parameter(torch.zeros(1, 1, 2, 4))
    assert validate.library_of(p) == "torch"


@pytest.mark.parametrize("M,N,name", [(1 << 30, 5, "q1"), (5, 1 << 30, "k1")])
def test_gpu_lengths_the_kernels_cannot_index(M, N, name):
    from cupy_piecewise.validate import GPU_MAX_LENGTH, Problem, check_gpu_support

    ok = Problem("torch", 1, 1, 1, GPU_MAX_LENGTH - 1, GPU_MAX_LENGTH - 1, 64, "bfloat16", 0,
                 False, 0.125, 0)
    check_gpu_support(ok)
    with pytest.raises(ValueError, match=f"{name} has length .* 2\\*\\*30"):
        check_gpu_support(Problem("torch", 1, 1, 1, M, N, 64, "bfloat16", 0, False, 0.125, 0))
