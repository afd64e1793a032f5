"""Forward and backward once per kernel path x dtype x causal x D at a size that is not a
tile multiple (the Hopper forward and backward forced as well as the mma.sync kernels; the
Hopper backward with fused dQ and in deterministic mode).

Run under compute-sanitizer (memcheck, racecheck) by scripts/gpu_run.sh; each case is also
checked against the reference, so a clean report is a report on correct runs.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from test_kernels_gpu import run_case  # noqa: E402

from cupy_piecewise import capability  # noqa: E402

for path in ("mma", "hopper"):  # the mma.sync kernels, then the Hopper forward forced
    os.environ[capability.PATH_VAR] = path
    capability.refresh_env_override()
    for dtype in ("float16", "bfloat16"):
        for causal in (False, True):
            for D in (64, 128):
                for det in (False, True) if path == "hopper" else (False,):
                    # position offsets (P = 40, not N - M = 51) and a gradient into lse
                    run_case(D=D, dtype=dtype, causal=causal, M=150, N=201, w=40, group=2,
                             transposed=(D == 128), deterministic=det, q_offset=40, k_offset=0,
                             with_dlse=True)
                    print(f"ok {path} {dtype} causal={causal} D={D} deterministic={det}", flush=True)
os.environ.pop(capability.PATH_VAR)
capability.refresh_env_override()

# torch tensors through the memoised fast path: without lse (a null pointer the kernels
# skip), with it, and a decode shape that splits the keys and merges the splits.
import torch  # noqa: E402

from cupy_piecewise import torch_ops  # noqa: E402

for M, N in ((150, 201), (1, 5000)):
    g = torch.Generator(device="cuda").manual_seed(M + N)
    q1, q2 = (torch.randn(1, 4, M, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k1, k2, v = (torch.randn(1, 2, N, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    for _ in range(2):  # the second call hits the memo
        o = torch_ops.attention(q1, k1, q2, k2, v, 40)
        o2, lse = torch_ops.attention(q1, k1, q2, k2, v, 40, return_lse=True)
    torch.cuda.synchronize()
    assert torch.equal(o, o2) and not torch.isnan(lse).any()
    print(f"ok torch M={M} N={N}", flush=True)
