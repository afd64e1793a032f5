"""Property-based fuzzing of the CUDA kernels (issue "Reliability", item 1): the GPU profile.

One hypothesis property, :func:`test_gpu_fuzz`, draws every axis of the API
(test_fuzz_cpu.py's :func:`~test_fuzz_cpu.cases`): the array library (torch CUDA tensors
or CuPy arrays), the kernel path (``CUPY_PIECEWISE_PATH=mma`` or ``hopper``), dtype
(float16, bfloat16), D (16, 32, 64, 128), B, H and Hkv, M and N from 0 to 3000 (tile edges
+-1 of the 16/32/64/128-row mma tiles and of the Hopper forward's query tiles (192 rows at
D = 64, 128 otherwise) and 128-key tiles, and of 96, its former D = 128 key tile), w (below, inside, beyond, negative, on tile edges, beyond 64 bits),
causal, sm_scale, the memory layout of every input and of ``do`` (transposed, packed
slot, stride-0 heads or batch, last axis of stride 2, misaligned start, length slice with
NaN rows behind it, reversed for CuPy), a non-default stream, and for torch autograd or
``attention_backward``, the eager route and which inputs require grad.

Each example runs a forward without grad (with or without ``lse``), a forward whose
``o``/``lse`` feed the backward, and the backward, with outputs filled with NaN
beforehand (mostly: one draw in three keeps the real allocator, whose fast path the NaN
hook bypasses). All results are judged by the tolerance rule against the float64
reference (``cupy_piecewise.reference``) with the low-precision yardstick, the backward
from the kernel's own ``o`` and ``lse`` and float16 gradients with loss scaling, as in
tests/test_kernels_gpu.py::run_case (with test_fuzz_cpu.judge's two allowances: outputs so
ill-conditioned that the yardstick itself misses rule 2, and rule 1's slack scaled for
outputs above 1; the summary lists every pass they decide). Inputs
(padding included) must be bitwise unchanged and no output may hold NaN.

Size: ``CUPY_PIECEWISE_FUZZ_GPU_EXAMPLES`` examples (default 200), drawn within a host
budget (``CUPY_PIECEWISE_FUZZ_GPU_BUDGET``, B*H*M*N*(D+16) <= 6e8: the float64 reference
and the yardstick run on the host and dominate the time: about 0.5 s per example on
average, a few seconds for the largest; about 2 minutes for 200 examples on an H200
host is the estimate, plus NVRTC compiles on a fresh machine). Random by default
(``CUPY_PIECEWISE_FUZZ_RANDOM=0`` derandomizes), replaying the committed database
tests/fuzz_db first and saving failures to ``CUPY_PIECEWISE_FUZZ_DB`` (see
test_fuzz_cpu.fuzz_settings). The test prints how many
examples it tried, per library, path and dtype, and how many took the Hopper forward.

Run on an H200 (2026-12-01): 217 examples in 56 s, 0 failures.
"""
from __future__ import annotations

import collections
import contextlib
import math
import os
import sys
import time
from dataclasses import replace

import pytest
from hypothesis import event, example, given
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))
import test_fuzz_cpu as fz  # noqa: E402
from test_fuzz_cpu import Case  # noqa: E402,F401  (Case(...) of a falsifying example)

import cupy_piecewise  # noqa: E402
from cupy_piecewise import reference, tolerance  # noqa: E402

pytestmark = pytest.mark.gpu

GPU_EXAMPLES = int(os.environ.get("CUPY_PIECEWISE_FUZZ_GPU_EXAMPLES", "200"))
GPU_RANDOM = fz.env_flag("CUPY_PIECEWISE_FUZZ_RANDOM", True)
GPU_BUDGET = int(float(os.environ.get("CUPY_PIECEWISE_FUZZ_GPU_BUDGET", "6e8")))

GPU_CASES = fz.cases(
    libs=("torch", "cupy"), dtypes=("bfloat16", "float16"),
    dims=st.sampled_from((16, 32, 64, 128)), paths=("mma", "hopper"),
    small=64, limit=3000, edge_limit=4 * 128 + 2,
    extra_lengths=(767, 768, 769, 1023, 1024, 1025, 2047, 2048, 2049, 2999, 3000),
    kv_heads=4, groups=(1, 2, 3, 4, 8), batches=(1, 2, 3), budget=GPU_BUDGET,
    torch_axes=True, gpu=True)


def gedge(**kw) -> Case:
    """A GPU Case with defaults for what is not given (for ``@example``s)."""
    base = dict(lib="cupy", dtype="bfloat16", B=1, H=2, Hkv=1, M=129, N=97, D=64, w=40,
                path="mma")
    base.update(kw)
    return Case(**base)


# ------------------------------------------------------------------------------ bookkeeping

class Stats:
    def __init__(self):
        self.tried = 0
        self.by = collections.Counter()
        self.hopper_examples = 0
        self.hopper_launches = 0
        self.torch_fallback = 0

    def summary(self, seconds: float) -> str:
        kinds = ", ".join(f"{k}: {n}" for k, n in sorted(self.by.items()))
        text = (f"\nGPU fuzz: {self.tried} examples tried in {seconds:.0f} s "
                f"(settings: max_examples={GPU_EXAMPLES}, random={GPU_RANDOM}, "
                f"budget={GPU_BUDGET:.2g}); {self.hopper_examples} ran the Hopper forward; "
                f"{kinds}")
        if self.torch_fallback:
            text += f"; {self.torch_fallback} torch draws ran on CuPy (no torch CUDA)"
        text += f"; {len(fz.ALLOWED)} outputs passed by an allowance of test_fuzz_cpu.judge"
        return "\n".join([text] + [f"  allowance: {a}" for a in fz.ALLOWED[:10]])


STATS = Stats()


@contextlib.contextmanager
def count_hopper_launches():
    """Count launches of the Hopper forward (launch.HopperLaunches.run) into STATS."""
    from cupy_piecewise import launch

    real = launch.HopperLaunches.run

    def run(self, *args, **kwargs):
        STATS.hopper_launches += 1
        return real(self, *args, **kwargs)

    with fz.patched(launch.HopperLaunches, "run", run):
        yield


@contextlib.contextmanager
def kernel_path(path: str):
    """CUPY_PIECEWISE_PATH=path inside the block (read again by the package on entry and
    on exit)."""
    from cupy_piecewise import capability

    old = os.environ.get(capability.PATH_VAR)
    os.environ[capability.PATH_VAR] = path
    capability.refresh_env_override()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(capability.PATH_VAR, None)
        else:
            os.environ[capability.PATH_VAR] = old
        capability.refresh_env_override()


@contextlib.contextmanager
def poisoned(case: Case):
    """Outputs the adapter allocates start as NaN (when the case says so)."""
    if not case.poison:
        yield
        return
    if case.lib == "torch":
        import torch

        from cupy_piecewise.adapters import torch as torch_adapter

        def empty(shape, dtype, device):
            return torch.full(shape, math.nan, dtype=dtype, device=device)

        with fz.patched(torch_adapter, "_empty", empty):
            yield
    else:
        from cupy_piecewise.gpu_arrays import poisoned_outputs

        with poisoned_outputs():
            yield


@contextlib.contextmanager
def on_stream(case: Case):
    """A new non-default stream for the block (when the case says so), ordered after the
    current one, synchronised at the end."""
    if case.lib == "torch":
        import torch

        if case.stream:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                yield
            s.synchronize()
        else:
            yield
        torch.cuda.synchronize()
    else:
        import cupy

        if case.stream:
            cupy.cuda.Device().synchronize()
            s = cupy.cuda.Stream(non_blocking=True)
            with s:
                yield
            s.synchronize()
        else:
            yield
        cupy.cuda.Device().synchronize()


def torch_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


# ------------------------------------------------------------------------------ one example

def run_gpu_case(case: Case):
    if case.lib == "torch" and not torch_cuda():
        STATS.torch_fallback += 1
        case = replace(case, lib="cupy")
    STATS.tried += 1
    STATS.by[f"{case.lib}/{case.path}/{case.dtype}"] += 1
    event(f"{case.lib}/{case.path}/{case.dtype}")
    ops = fz.TorchOps("cuda") if case.lib == "torch" else fz.CupyOps()
    where = f"({case!r})"
    sc = fz.scale_of(case)
    dtype = case.dtype
    kw = dict(causal=case.causal, sm_scale=case.sm_scale)
    vals = fz.draw_values(case)
    x = fz.make_inputs(case, ops, vals)
    host = x.values[:5]
    before = [ops.bits(b) for b in x.buffers[:5]]

    o_ref, lse_ref = reference.forward(*host, case.w, case.causal, sc)
    o_low, lse_low = reference.lowp_forward(*host, case.w, case.causal, sc, dtype=dtype)
    autograd = case.lib == "torch" and case.api == "autograd"
    hopper_before = STATS.hopper_launches
    routing = contextlib.nullcontext()
    if case.lib == "torch":
        from cupy_piecewise import torch_ops

        routing = fz.patched(torch_ops, "DIRECT_EAGER_CALLS", case.route == "direct")

    with kernel_path(case.path), routing:
        # 1. A forward without grad, with or without lse.
        with on_stream(case), poisoned(case):
            out = cupy_piecewise.attention(*x.views[:5], case.w, return_lse=case.return_lse, **kw)
        o_a, lse_a = out if case.return_lse else (out, None)
        assert tuple(o_a.shape) == case.shapes()[0], where
        fz.judge("o", ops.host(o_a), o_ref, o_low, dtype, f"(no-grad forward) {where}")
        if lse_a is not None:
            fz.judge("lse", ops.host(lse_a), lse_ref, lse_low, dtype, f"(no-grad forward) {where}")

        # 2. The forward whose o and lse the backward uses.
        leaves = None
        with on_stream(case), poisoned(case):
            if autograd:
                leaves = [t.detach().requires_grad_(r) for t, r in zip(x.views[:5], case.grads)]
                o, lse = cupy_piecewise.attention(*leaves, case.w, return_lse=True, **kw)
            else:
                o, lse = cupy_piecewise.attention(*x.views[:5], case.w, return_lse=True, **kw)
        assert tuple(o.shape) == case.shapes()[0] and tuple(lse.shape) == case.shapes()[0][:3]
        assert str(lse.dtype).endswith("float32"), lse.dtype
        fz.judge("o", ops.host(o), o_ref, o_low, dtype, where)
        fz.judge("lse", ops.host(lse), lse_ref, lse_low, dtype, where)
        if STATS.hopper_launches > hopper_before:
            STATS.hopper_examples += 1
            event("hopper forward ran")

        # 3. The backward from the kernel's own o and lse, as autograd runs it.
        o_used, lse_used = ops.host(o), ops.host(lse)
        do_h = x.values[5]
        grads_ref = reference.backward(*host, o_used, lse_used, do_h, case.w, case.causal, sc)
        s = 1.0
        if dtype == "float16":  # loss scaling keeps float16 gradients normal (tolerance.py)
            s = tolerance.float16_loss_scale(grads_ref, do_h)
            grads_ref = [g * s for g in grads_ref]
        do_vals, do_buf, do_view = fz.make_one(case, ops, 5, vals[5] * s)
        before.append(ops.bits(do_buf))
        grads_low = reference.lowp_backward(*host, o_used, lse_used, do_vals, case.w, case.causal,
                                            sc, dtype=dtype)
        with on_stream(case), poisoned(case):
            if autograd:
                o.backward(do_view)
                grads = [t.grad for t in leaves]
            else:
                grads = cupy_piecewise.attention_backward(do_view, *x.views[:5], o, lse, case.w,
                                                          **kw)
    grads_ref = fz.exact_zeros(case, grads_ref)
    hints = fz.term_scales(case, host + [do_vals])
    for i, (name, g, r, lw, shape) in enumerate(zip(fz.NAMES, grads, grads_ref, grads_low,
                                                    case.shapes())):
        if autograd and not case.grads[i]:
            assert g is None, f"{name}: a gradient for an input without requires_grad {where}"
            continue
        assert g is not None, f"{name}: no gradient {where}"
        assert tuple(g.shape) == shape and str(g.dtype).endswith(dtype), (name, g.shape, g.dtype)
        fz.judge(name, ops.host(g), r, lw, dtype, f"(loss scale {s:g}) {where}",
                 scale_hint=hints[i])
    fz.check_unchanged(ops, x.buffers[:5] + [do_buf], before, where)


# ------------------------------------------------------------------------------ the property

@fz.fuzz_settings(GPU_EXAMPLES, random=GPU_RANDOM)
@given(case=GPU_CASES)
@example(case=gedge(M=0, N=0, w=0))
@example(case=gedge(lib="torch", M=0, N=300, w=3, D=128, path="hopper"))
@example(case=gedge(lib="torch", M=300, N=0, w=3, causal=True, dtype="float16"))
@example(case=gedge(M=1, N=1, w=0, D=16))
@example(case=gedge(M=4096 - 1096, N=1, w=1, D=32, dtype="float16"))                 # decode-like
@example(case=gedge(M=1, N=3000, w=1500, D=128, H=8, Hkv=1))                         # split-KV
@example(case=gedge(M=16, N=2049, w=-5, D=64, dtype="float16", causal=True))         # decode tiles
@example(case=gedge(M=129, N=97, w=96 - 32, D=128, path="hopper"))                   # Hopper tile edges
@example(case=gedge(M=129, N=257, w=128 - 32, D=128, path="hopper"))                 # (128-key tiles)
@example(case=gedge(lib="torch", M=255, N=129, w=127, D=128, path="hopper", causal=True))
@example(case=gedge(lib="torch", M=128, N=128, w=0, D=64, path="hopper", causal=True))
@example(case=gedge(lib="torch", M=257, N=191, w=97, D=128, path="hopper", causal=True,
                    dtype="float16", layouts=("transposed",) * 6))
@example(case=gedge(M=385, N=289, w=-97, D=128, path="hopper",
                    layouts=("packed", "packed", "packed", "packed", "packed", "offset")))
@example(case=gedge(lib="torch", M=300, N=100, w=10, causal=True, H=8, Hkv=2, D=64,
                    path="hopper"))                                                  # empty rows
@example(case=gedge(lib="torch", M=700, N=900, w=127, D=64, path="hopper", api="function",
                    layouts=("contiguous", "expanded", "contiguous", "expanded", "broadcast",
                             "transposed")))                                         # stride 0
@example(case=gedge(M=333, N=410, w=2**63 - 1, D=32, layouts=("last_stride",) * 6))
@example(case=gedge(lib="torch", M=190, N=200, w=-2**70, D=128, path="hopper",
                    layouts=("sliced_len",) * 6, route="operator"))
@example(case=gedge(M=200, N=513, w=2**31, causal=True, D=64, path="hopper",
                    layouts=("reversed", "sliced_len", "offset", "sliced_len", "sliced_len",
                             "reversed"), stream=True))
@example(case=gedge(lib="torch", M=1025, N=1023, w=1023 - 1025 + 128, causal=True, D=128,
                    path="hopper", dtype="float16", poison=False, return_lse=False,
                    grads=(True, False, True, False, False)))
def _fuzz_gpu(case):
    run_gpu_case(case)


def test_gpu_fuzz(capsys):
    """The GPU profile (module docstring); prints the number of examples tried."""
    STATS.__init__()
    fz.ALLOWED.clear()
    t0 = time.time()
    try:
        with count_hopper_launches():
            _fuzz_gpu()
    finally:
        with capsys.disabled():
            print(STATS.summary(time.time() - t0), flush=True)
