"""Bitwise A/B of a build macro: the same inputs through the default build and the build with
``--macros``, one process per build, on the mma.sync path; o, lse and the five gradients (the
deterministic backward) must agree bit for bit.

For the builds whose results are argued to be identical (bench/NOTES.md, twenty-second and
twenty-third sessions): ``PW_FWD_LAZY_RESCALE=0`` against the default lazy rescale (head dim
128), ``PW_BWD_DS_PRESCALE=0`` (fit_rows' per-row dS fit) against the prescaled dS at
``PW_FIT_HEADROOM=0`` (``--base``: the baseline build's macros, default none; the default
headroom 4 changes float16 subnormal bits by design), and ``PW_BWD_P_FIXED=0`` as a control
that must differ in float16. ``--default-backward`` compares the default
backward instead (the one-kernel scheme where the tile table picks it), without dq1 and dq2,
whose float32 atomics add in any order. ``--decode`` compares ``attention_with_kvcache``
instead (o and lse, caches of B = 2 sequences x 16 heads, lengths N and N // 3 + 1, M = 1
and 4), on the Hopper decode where the GPU has it and on the mma.sync decode
(``--decode-path mma``): for ``PW_COMBINE_PREFETCH=0`` against the default split merge.
Run on a GPU from the repo root::

    PYTHONPATH=$PWD python3 scripts/bitwise_ab.py --macros PW_BWD_DS_PRESCALE=0 \
        --base PW_FIT_HEADROOM=0
    PYTHONPATH=$PWD python3 scripts/bitwise_ab.py --macros PW_FWD_LAZY_RESCALE=0
    PYTHONPATH=$PWD python3 scripts/bitwise_ab.py --decode --macros PW_COMBINE_PREFETCH=0

Exit status 1 when a compared output differs (unless ``--expect-differ``), 0 otherwise.
"""
from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile


def run(case, seed, deterministic=True):
    import cupy
    import numpy as np

    import cupy_piecewise
    from cupy_piecewise.gpu_arrays import round_to, to_device

    D, dtype, causal, L = case
    rng = np.random.default_rng(seed)
    B, H = 2, 4
    host = [round_to(rng.standard_normal((B, H, L, D)).astype(np.float32) * 1.5, dtype)
            for _ in range(5)]
    q1, k1, q2, k2, v = (to_device(x, dtype, False) for x in host)
    do = to_device(round_to(rng.standard_normal((B, H, L, D)).astype(np.float32), dtype), dtype,
                   False)
    o, lse = cupy_piecewise.attention(q1, k1, q2, k2, v, L // 4, causal=causal, return_lse=True)
    grads = cupy_piecewise.attention_backward(do, q1, k1, q2, k2, v, o, lse, L // 4,
                                              causal=causal, deterministic=deterministic)
    cupy.cuda.runtime.deviceSynchronize()
    out = {"o": o, "lse": lse, **dict(zip(("dq1", "dk1", "dq2", "dk2", "dv"), grads))}
    if not deterministic:  # dQ's float32 atomics add in any order: its bits vary run to run
        del out["dq1"], out["dq2"]
    return out


def run_decode(case, seed):
    """o and lse of one decode step (no new keys) whose split count comes from the shape
    (B·H = 32: 8 splits at N = 4096, D = 64 on the Hopper decode); the second sequence's
    cache is shorter, so its splits past its end see no key (lse = -inf partials)."""
    import cupy
    import numpy as np

    import cupy_piecewise
    from cupy_piecewise.gpu_arrays import round_to, to_device

    D, dtype, M, N = case
    rng = np.random.default_rng(seed)
    B, H = 2, 16
    qs = [to_device(round_to(rng.standard_normal((B, H, M, D)).astype(np.float32), dtype),
                    dtype, False) for _ in range(2)]
    caches = [to_device(round_to(rng.standard_normal((B, H, N, D)).astype(np.float32) * 1.5,
                                 dtype), dtype, False) for _ in range(3)]
    seqlens = cupy.asarray([N, N // 3 + 1], dtype=cupy.int32)
    o, lse = cupy_piecewise.attention_with_kvcache(*qs, *caches, N // 4, cache_seqlens=seqlens,
                                                   return_lse=True)
    cupy.cuda.runtime.deviceSynchronize()
    return {"o": o, "lse": lse}


def worker(a) -> int:
    """One build in this process: every case's outputs saved under --dump as .npy bytes."""
    import cupy
    import numpy as np

    from cupy_piecewise import capability
    from cupy_piecewise import compile as comp

    comp.BASE_OPTIONS = comp.BASE_OPTIONS + tuple(f"-D{m}" for m in a.macros.split() if m)
    if not a.decode or a.decode_path == "mma":
        os.environ[capability.PATH_VAR] = "mma"
    capability.refresh_env_override()
    for i, case in enumerate(cases_of(a)):
        outs = (run_decode(case, a.seed + i) if a.decode
                else run(case, a.seed + i, not a.default_backward))
        for name, arr in outs.items():
            np.save(os.path.join(a.dump, f"{i}_{name}.npy"), cupy.asnumpy(arr.view("uint8")))
    return 0


def cases_of(a):
    """(D, dtype, causal, L) per case, or (D, dtype, M, N) with --decode"""
    third = (1, 4) if a.decode else (False, True)
    return list(itertools.product([int(d) for d in a.dims.split(",")], a.dtypes.split(","),
                                  third, [int(n) for n in a.lengths.split(",")]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--macros", required=True, help="space-separated, e.g. 'PW_BWD_DS_PRESCALE=0'")
    ap.add_argument("--base", default="", help="the baseline build's macros (default: none)")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--lengths", default="1024,4096")
    ap.add_argument("--seed", type=int, default=20261204)
    ap.add_argument("--default-backward", action="store_true",
                    help="the default backward (the one-kernel scheme where the table picks it) "
                         "instead of deterministic=True; dq1 and dq2 are then not compared")
    ap.add_argument("--decode", action="store_true",
                    help="compare attention_with_kvcache's o and lse (lengths are cache sizes)")
    ap.add_argument("--decode-path", choices=("default", "mma"), default="default",
                    help="with --decode: the package's choice, or the mma.sync decode")
    ap.add_argument("--expect-differ", action="store_true",
                    help="a control: exit 1 when every output agrees instead")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dump", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a)

    import numpy as np

    # each build in a process of its own: no compiled kernel or launch plan is shared
    common = ["--dims", a.dims, "--dtypes", a.dtypes, "--lengths", a.lengths,
              "--seed", str(a.seed), "--worker"] + (["--default-backward"] * a.default_backward) + (
                  ["--decode", "--decode-path", a.decode_path] if a.decode else [])
    with tempfile.TemporaryDirectory() as tmp:
        dirs = []
        for k, macros in enumerate((a.base, a.macros)):
            d = os.path.join(tmp, str(k))
            os.mkdir(d)
            subprocess.run([sys.executable, __file__, "--macros", macros, "--dump", d, *common],
                           check=True)
            dirs.append(d)
        cases = cases_of(a)
        differ = 0
        names = ("o", "lse") if a.decode else ("o", "lse", "dk1", "dk2", "dv") + (
            () if a.default_backward else ("dq1", "dq2"))
        for i, case in enumerate(cases):
            bad = [n for n in names
                   if not np.array_equal(*(np.load(os.path.join(d, f"{i}_{n}.npy"))
                                           for d in dirs))]
            differ += bool(bad)
            third = f"M={case[2]} N" if a.decode else f"causal={case[2]} L"
            print(f"D{case[0]} {case[1]} {third}={case[3]}: "
                  + (f"DIFFER in {', '.join(bad)}" if bad else "bitwise identical"))
    print(f"{a.macros}" + (f" against {a.base}" if a.base else "")
          + f": {differ} of {len(cases)} cases differ")
    if a.expect_differ:
        return 0 if differ else 1
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
