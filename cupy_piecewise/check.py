"""``python -m cupy_piecewise check``: the package against its float64 reference, here.

Draws a dozen fresh random problems (``--quick``: three) and runs them on the best
back end this machine has:

- ``cuda``: CuPy sees a GPU. float16, bfloat16 (ml_dtypes) and float32 (TF32 products,
  judged as ``"tf32"``: docs/semantics.md, "float32 on the GPU") cases go through the
  public API on CuPy arrays (:func:`cupy_piecewise.attention` /
  :func:`~cupy_piecewise.attention_backward`), with outputs that start as NaN so an
  element a kernel forgets to write fails. Inputs are checked unchanged afterwards.
- ``numpy``: no GPU. :func:`cupy_piecewise.attention` on float32 NumPy arrays (the
  NumPy back end), judged with the float32 bound. This checks the plumbing of the
  CPU path, not the kernels.

``o``, ``lse`` and all five gradients are compared with the float64 reference by
the tolerance rule of docs/semantics.md (:func:`cupy_piecewise.tolerance.compare`; the low-precision
bound comes from :func:`cupy_piecewise.reference.lowp_forward` / ``lowp_backward``).
Gradients are checked against the reference backward taken from the implementation's
own ``o`` and ``lse``, as autograd would run it. One table row per case; a progress bar
on stderr (tqdm when stderr is a terminal, else a line per case); the last line is
``N passed, M failed``. Exit status 1
on any failure.

The problems are random (seeded by ``--seed``; the seed used is printed) but their
structure is fixed so any run covers: causal on and off, grouped-query attention
(1, 2 and 4 query heads per key/value head), M < N, M == N and M > N (causal M > N
leaves rows with no admissible key: ``lse = -inf``), w below, inside and beyond the
range of distances, head dims 64 and 128 on the GPU (16 and 32 on the CPU, kept
small so the CPU run takes seconds), and (GPU) transposed-view inputs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from . import api, reference, tolerance
from .gpu_arrays import poisoned_outputs, round_to, to_device, to_host

__all__ = ["Case", "CaseResult", "make_cases", "gpu_available", "run_case", "main"]

OUTPUTS = ("o", "lse", "dq1", "dk1", "dq2", "dk2", "dv")
_MN_KINDS = ("M<N", "M=N", "M>N")
_W_KINDS = ("inside", "below", "inside", "beyond")  # indexed by i // 2: not tied to causal


@dataclass(frozen=True)
class Case:
    B: int
    H: int
    Hkv: int
    M: int
    N: int
    D: int
    w: int
    causal: bool
    dtype: str
    transposed: bool = False

    def label(self) -> str:
        return (f"B{self.B} H{self.H} Hkv{self.Hkv} M{self.M} N{self.N} D{self.D} w{self.w}"
                f"{' causal' if self.causal else ''}{' T' if self.transposed else ''}")


@dataclass
class CaseResult:
    index: int
    case: Case
    backend: str
    passed: bool
    worst: str
    max_err: float
    bound: float
    rel_err: float
    rel_bound: float
    time_ms: float
    verdicts: list = field(default_factory=list)  # str(Verdict) per output
    error: str = ""


# ----------------------------------------------------------------------------
# Problems.


def make_cases(rng: np.random.Generator, backend: str, n: int = 12) -> list[Case]:
    """``n`` random problems whose structure cycles through the axes listed in the module doc."""
    gpu = backend == "cuda"
    cases = []
    for i in range(n):
        causal = i % 2 == 1
        group = (1, 2, 4)[i % 3]
        mn = _MN_KINDS[(i // 2) % 3] if i < 6 else _MN_KINDS[(i + 1) % 3]
        wk = _W_KINDS[(i // 2) % 4]
        if gpu:
            D = (64, 128)[(i // 2) % 2] if i < 4 else (64, 128)[i % 2]
            dtype = ("float16", "bfloat16")[(i // 2) % 2] if i < 4 else \
                ("float16", "bfloat16", "float32")[(i // 3) % 3]
            lo, hi = 1, 1200
            B = int(rng.integers(1, 3))
        else:
            D = (16, 32)[(i // 2) % 2]
            dtype = "float32"
            lo, hi = 1, 256
            B = int(rng.integers(1, 3))
        a, b = sorted(int(x) for x in rng.integers(lo, hi + 1, size=2))
        if a == b:
            b = a + 1
        M, N = {"M<N": (a, b), "M=N": (b, b), "M>N": (b, a)}[mn]
        if dtype == "float32" and gpu and N == 1:
            # one key per row: TF32's dq, dk are rounding residue the relative bound cannot
            # judge (docs/semantics.md, "float32 on the GPU")
            N = 2
        # Distances d = i + N - M - j lie in [1 - M, N - 1].
        if wk == "below":
            w = int(rng.integers(-M - 20, 1 - M + 1))
        elif wk == "beyond":
            w = int(rng.integers(N, N + 20))
        else:
            w = int(rng.integers(1 - M, N)) if not causal else int(rng.integers(0, max(1, N)))
        Hkv = int(rng.integers(1, 3))
        cases.append(Case(B, Hkv * group, Hkv, M, N, D, w, causal, dtype,
                          transposed=gpu and i % 3 == 0))
    return cases


def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:
        return False


def _inputs(case: Case, rng: np.random.Generator, scale: float = 1.5):
    """Host inputs (float32 arrays holding ``dtype``-rounded values, standard deviation
    ``scale``) and ``do``."""
    B, H, Hkv, M, N, D = case.B, case.H, case.Hkv, case.M, case.N, case.D
    shapes = [(B, H, M, D), (B, Hkv, N, D), (B, H, M, D), (B, Hkv, N, D), (B, Hkv, N, D)]
    # Several standard deviations, essentially never zero; the two projections differ.
    host = [round_to(rng.standard_normal(s).astype(np.float32) * scale, case.dtype) for s in shapes]
    do = round_to(rng.standard_normal((B, H, M, D)).astype(np.float32), case.dtype)
    return host, do


# ----------------------------------------------------------------------------
# Back ends: each returns (o, lse, grads) as float64 host arrays, plus the elapsed ms
# of the implementation's forward + backward (wall clock, synchronised; the first
# case of a variant includes its NVRTC compile or cache load).


def _run_numpy(case: Case, host, do, sm_scale):
    args = [x.astype(np.float32) for x in host]
    t0 = time.perf_counter()
    o, lse = api.attention(*args, case.w, causal=case.causal, sm_scale=sm_scale, return_lse=True)
    grads = api.attention_backward(do.astype(np.float32), *args, o, lse, case.w,
                                   causal=case.causal, sm_scale=sm_scale)
    ms = (time.perf_counter() - t0) * 1e3
    f64 = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    return f64(o), f64(lse), [f64(g) for g in grads], ms, ""


def _run_cuda(case: Case, host, do, sm_scale):
    import cupy

    dtype = case.dtype
    dev = [to_device(x, dtype, case.transposed) for x in host]
    do_d = to_device(do, dtype, case.transposed)
    before = [a.copy() for a in dev]
    stream = cupy.cuda.get_current_stream()
    stream.synchronize()
    # The public API on CuPy arrays, as a user calls it (bfloat16 through ml_dtypes), with
    # outputs that start as NaN so an element a kernel forgets to write fails.
    with poisoned_outputs():
        t0 = time.perf_counter()
        o, lse = api.attention(*dev, case.w, causal=case.causal, sm_scale=sm_scale, return_lse=True)
        grads = api.attention_backward(do_d, *dev, o, lse, case.w, causal=case.causal,
                                       sm_scale=sm_scale)
        stream.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    written = [i for i, (a, b) in enumerate(zip(dev, before))
               if not bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all())]
    error = "" if not written else \
        "input(s) written: " + ", ".join(("q1", "k1", "q2", "k2", "v")[i] for i in written)
    return (to_host(o), cupy.asnumpy(lse).astype(np.float64), [to_host(g) for g in grads], ms,
            error)


_BACKENDS = {"numpy": _run_numpy, "cuda": _run_cuda}


def _badness(v: tolerance.Verdict) -> float:
    """How close to (>1: past) its bounds a verdict is; failures sort first."""
    ratio = max(v.max_err / v.bound if v.bound > 0 else float("inf"),
                v.rel_err / v.rel_bound if v.rel_bound > 0 else float("inf"))
    if not np.isfinite(ratio):
        ratio = float("inf")
    return (0.0 if v.passed else 1e300) + ratio


def run_case(index: int, case: Case, backend: str, seed: int) -> CaseResult:
    """Run one case on ``backend`` ('cuda' or 'numpy') and judge every output."""
    rng = np.random.default_rng([seed, index])
    # float32 on the GPU runs TF32 products: judged as "tf32", on unit-variance inputs like
    # its tests (docs/semantics.md, "float32 on the GPU"); the rest at 1.5 standard deviations
    low_dtype = "tf32" if backend == "cuda" and case.dtype == "float32" else case.dtype
    host, do = _inputs(case, rng, 1.0 if low_dtype == "tf32" else 1.5)
    sm_scale = 1.0 / np.sqrt(case.D)
    w, causal = case.w, case.causal
    o_ref, lse_ref = reference.forward(*host, w, causal, sm_scale)
    if case.dtype == "float16":  # loss scaling keeps float16 gradients normal (tolerance.py)
        g_unit = reference.backward(*host, o_ref, lse_ref, do, w, causal, sm_scale)
        do = do * np.float32(tolerance.float16_loss_scale(g_unit, do))
    try:
        o, lse, grads, ms, error = _BACKENDS[backend](case, host, do, sm_scale)
    except Exception as exc:  # a crash is a failed case, reported, not a traceback
        return CaseResult(index, case, backend, False, "-", float("nan"), float("nan"),
                          float("nan"), tolerance.rel_bound(low_dtype), float("nan"),
                          error=f"{type(exc).__name__}: {exc}")

    o_low, lse_low = reference.lowp_forward(*host, w, causal, sm_scale, dtype=low_dtype)
    # Backward from the implementation's own o and lse (rounded as it stored them).
    o_used = round_to(o.astype(np.float32), case.dtype)
    g_ref = reference.backward(*host, o_used, lse, do, w, causal, sm_scale)
    g_low = reference.lowp_backward(*host, o_used, lse, do, w, causal, sm_scale, dtype=low_dtype)

    verdicts = [tolerance.compare("o", o, o_ref, o_low, low_dtype),
                tolerance.compare("lse", lse, lse_ref, lse_low, low_dtype)]
    verdicts += [tolerance.compare(name, g, r, lo, low_dtype)
                 for name, g, r, lo in zip(OUTPUTS[2:], grads, g_ref, g_low)]
    worst = max(verdicts, key=_badness)
    passed = all(v.passed for v in verdicts) and not error
    return CaseResult(index, case, backend, passed, worst.name, worst.max_err, worst.bound,
                      worst.rel_err, worst.rel_bound, ms, [str(v) for v in verdicts], error)


# ----------------------------------------------------------------------------
# Output.

_HEAD = (f"{'#':>2}  {'case':<46} {'backend':<7} {'dtype':<8} {'worst':<5} {'max err':>9} "
         f"{'bound':>9} {'rel err':>9} {'pass':<4} {'time ms':>8}")


def _row(r: CaseResult) -> str:
    return (f"{r.index:>2}  {r.case.label():<46} {r.backend:<7} {r.case.dtype:<8} {r.worst:<5} "
            f"{r.max_err:9.2e} {r.bound:9.2e} {r.rel_err:9.2e} {'PASS' if r.passed else 'FAIL':<4} "
            f"{r.time_ms:8.1f}")


def _progress(items, total):
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None and sys.stderr.isatty():
        bar = tqdm(items, total=total, desc="check", unit="case", file=sys.stderr, leave=False)
        return bar, lambda line: bar.write(line, file=sys.stdout)

    # Without tqdm, or when stderr is a log file (a redrawn bar there is noise): a line a case.
    def plain():
        for k, item in enumerate(items, 1):
            print(f"check: case {k}/{total}", file=sys.stderr, flush=True)
            yield item

    return plain(), lambda line: print(line, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cupy_piecewise check",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 cases instead of 12")
    ap.add_argument("--seed", type=int, default=None,
                    help="random seed (default: a fresh one, printed)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    ap.add_argument("--backend", choices=("auto", "cuda", "numpy"), default="auto",
                    help="auto: the CUDA kernels when CuPy sees a GPU, else the NumPy path")
    args = ap.parse_args(argv)

    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
    if args.backend == "auto":
        backend = "cuda" if gpu_available() else "numpy"
    else:
        backend = args.backend
        if backend == "cuda" and not gpu_available():
            print("check: --backend cuda asked for, but CuPy sees no CUDA GPU", file=sys.stderr)
            return 2
    what = ("CUDA kernels through the public API on CuPy arrays (float16, bfloat16, float32 in TF32)"
            if backend == "cuda" else
            "no CUDA GPU visible to CuPy: NumPy path (cupy_piecewise.attention on float32 "
            "NumPy arrays), float32 bound; the CUDA kernels are not exercised")
    cases = make_cases(np.random.default_rng(seed), backend)
    if args.quick:
        cases = cases[:3]
    print(f"check: {len(cases)} random cases, seed {seed}, backend {backend}: {what}")
    print(f"time ms: {backend} forward + backward, wall clock (the first use of a kernel "
          "variant includes its compile or cache load)" if backend == "cuda" else
          "time ms: forward + backward through the public API, wall clock")
    print(_HEAD)

    results = []
    t0 = time.perf_counter()
    items, emit = _progress(list(enumerate(cases)), len(cases))
    for i, case in items:
        r = run_case(i, case, backend, seed)
        results.append(r)
        emit(_row(r))
    if hasattr(items, "close"):
        items.close()
    elapsed = time.perf_counter() - t0

    failed = [r for r in results if not r.passed]
    for r in failed:
        print(f"\ncase {r.index} ({r.case.label()}, {r.case.dtype}) failed:")
        if r.error:
            print(f"  {r.error}")
        for v in r.verdicts:
            if v.startswith("FAIL"):
                print(f"  {v}")
    n_pass, n_fail = len(results) - len(failed), len(failed)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seed": seed, "backend": backend, "passed": n_pass, "failed": n_fail,
                       "seconds": elapsed, "cases": [asdict(r) for r in results]},
                      f, indent=2, default=str)
    print(f"seed {seed}, backend {backend}, {elapsed:.1f} s")
    print(f"{n_pass} passed, {n_fail} failed")  # alone on the last line, as CI logs read it
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
