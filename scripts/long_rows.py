"""Accuracy against row length: where do o, lse and dq of one long row start to miss the
tolerance rule? (tests/test_huge_gpu.py found misses at N = 2**24 + 37 on some paths.)

M = 96 queries, one batch and head, D = 128, bfloat16, w = N // 2, not causal, for N from
2**14 to 2**24; each kernel path (the mma.sync kernels forced, the Hopper forward forced;
the backward's dq from the Hopper kernel's float32 atomics and from the mma.sync dq kernel,
deterministic=True), against the float64 reference and the bfloat16 yardstick of
tests/test_huge_gpu.py, computed on the GPU. Prints one line per (N, path): each output's
max error over its bound and relative L2 error, and the rule's verdict.

    PYTHONPATH=$PWD python3 scripts/long_rows.py [--max-log2 24]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import test_huge_gpu as H  # noqa: E402

import cupy_piecewise  # noqa: E402
from cupy_piecewise import capability, tolerance  # noqa: E402


def main(argv=None) -> int:
    import cupy

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-log2", type=int, default=24)
    args = ap.parse_args(argv)
    M, D = 96, 128
    rng = cupy.random.default_rng(1)
    for lg in range(14, args.max_log2 + 1, 2):
        N = 1 << lg
        case = H.Case(M, N, D, N // 2, False)
        x = {name: H._draw(rng, rows, H.STD) for name, rows in
             (("q1", M), ("q2", M), ("k1", N), ("k2", N), ("v", N))}
        x["do"] = H._draw(rng, M, H.DO_STD)
        ins = [x[n] for n in H.INPUTS]

        def rows(a):
            return H.as_f32(a[0, 0])

        def keys(j0, j1):
            return tuple(H.as_f32(x[n][0, 0, j0:j1]) for n in ("k1", "k2", "v"))

        for path, det in (("mma", True), ("hopper", False)):
            os.environ[capability.PATH_VAR] = path
            capability.refresh_env_override()
            o, lse = cupy_piecewise.attention(*ins, case.w, return_lse=True)
            dq1, _, dq2, _, _ = cupy_piecewise.attention_backward(
                x["do"], *ins, o, lse, case.w, deterministic=det)
            out = H.reference_pass(cupy, case, keys, rows(x["q1"]), rows(x["q2"]), rows(o),
                                   lse[0, 0], rows(x["do"]), H.CHUNK, lambda *a: None)
            line = []
            for name, impl in (("o", rows(o)), ("lse", lse[0, 0]), ("dq1", rows(dq1)),
                               ("dq2", rows(dq2))):
                ref = H._host(out["ref"][name])
                v = tolerance.compare(name, H._host(impl), ref, H._host(out["low"][name]), "bfloat16")
                line.append(f"{name} {v.max_err / v.bound:5.2f}x/{v.rel_err:.1e}"
                            f"{'' if v.passed else '!'}")
            fwd = path
            bwd = "mma dq" if det else "hopper dq"
            print(f"N=2^{lg:<2} fwd {fwd:6} bwd {bwd:9} " + "  ".join(line), flush=True)
        os.environ.pop(capability.PATH_VAR)
        capability.refresh_env_override()
        x.clear()
        cupy.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
