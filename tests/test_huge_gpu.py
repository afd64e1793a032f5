"""More than 2**31 elements in K and V: forward and backward through the public API on
CuPy arrays, against a float64 reference computed on the GPU a chunk of keys at a time,
by the tolerance rule.

SPEC.md promises that index arithmetic does not overflow ("tensors of more than 2^31
elements work"). One batch and one head of N = 2**24 + 37 keys of head dim 128 give k1, k2
and v 2**31 + 4736 elements each (4 GiB of bfloat16 apiece): keys from 2**23 on start past
byte offset 2**31, and the last 37 keys, from 2**24 on, past element offset 2**31 and byte
offset 2**32, so a 32-bit offset anywhere in the kernels' addressing sends some keys, or
their gradients, to the wrong place. M = 96 queries, w = N // 2 (the projections switch
half way along the keys), bfloat16, not causal and causal (queries are aligned to the end
of the keys, so a causal row still sees almost every key), on the mma.sync kernels and on
the Hopper kernels (default backward, with float32 atomics, and deterministic). Outputs
start as NaN (``gpu_arrays.poisoned_outputs``) and the inputs are checked unchanged (row
checksums).

What is checked, and why so:

- The reference is ``cupy_piecewise.reference``'s, computed again on the GPU with CuPy
  matmuls over chunks of 2**18 keys (:func:`reference_pass`): in float64 for ``ref``, and
  in float32 with bfloat16 operands, probabilities and ``ds`` rounded to bfloat16 before
  their products and outputs rounded, for the yardstick ``lowp`` -- the formulas and
  roundings of ``reference.forward``/``backward`` and ``lowp_forward``/``lowp_backward``,
  which tests/test_huge_reference_cpu.py checks this code against with NumPy. (The NumPy
  reference itself would need the 13 GB of inputs in float64 on the host.) The backward
  reference starts from the kernel's own ``o`` and ``lse``, as in test_kernels_gpu.py.
  Float64 on an H200 takes seconds here, so SPEC.md's rule applies as written, with a
  float64 reference and its yardstick, rather than a bound made up for this test.
- ``o``, ``lse``, ``dq1``, ``dq2`` (96 x 128) go through ``tolerance.compare`` itself.
  ``dk1``, ``dk2``, ``dv`` (2**31 elements each) are judged by the same rule with its
  maxima and norms accumulated chunk by chunk (:class:`RuleAccumulator`), over the whole
  tensor and, each on its own, over three windows of 4096 keys where an overflow shows
  first: the first keys, the keys around 2**23 (byte offset 2**31; the projections switch
  there too) and the last keys (element offset 2**31, byte offset 2**32). A window's
  maximum error is held to twice the yardstick's in that window and its L2 error to that
  window's norm, so a local error cannot hide behind the rest of the tensor.
- Planted keys. Every element of o, lse and dq sums over all 16.8M keys, so a wrong read
  of the 37 keys past element offset 2**31 would change them by parts in 10**6, far inside
  any tolerance. Six query rows therefore get a key of their own at the boundaries (keys
  0, 2**23 - 1, 2**23, 2**24 - 1, 2**24, N - 1; :data:`PLANTED`): both projections of the
  key are set to a multiple of the row's queries, so that the pair scores about
  ``lse - 7`` in whichever projection it takes (probability about 1e-3; 1/N = 6e-8 on
  average, a few 1e-3 for the largest of the 1.6e9 pairs). Reading that key wrong moves
  the row's ``o`` by about 1e-3 per element, ten times rule 1's bound for ``o``. Their
  gradient rows are larger than the rest of their window, so the window rules leave them
  out; the whole-tensor rules, where they are not the largest, keep them.
- ``do`` is drawn with standard deviation 2**17. With 16.8M keys every probability is
  about 1e-7 and dk, dv would be about 1e-6: all below rule 1's absolute slack 1e-5, which
  would then pass anything. Gradients are linear in ``do`` and a power of two scales them
  exactly (loss scaling, as ``tolerance.float16_loss_scale`` does for float16): the scaled
  ones are of order one to a thousand, which the test asserts.
- ``lse`` is float32 near 19 (the log of a sum over 16.8M keys), where one float32 step is
  2e-6 and the kernels' running sum over 16.8M keys adds more, against rule 1's slack of
  1e-5, which is sized for outputs of order one. As ``test_fuzz_cpu.judge`` does (its
  allowance 2), an output that fails only rule 1 passes when rule 1 holds with the slack
  scaled by ``max(1, max|ref|)``, and its verdict says so. (For the other outputs the
  slack is negligible against the yardstick's error either way.)

Memory: about 30 GiB of the GPU at the peak (inputs 12 GiB, gradients 12 GiB, the
reference's chunk temporaries); without 40 GiB free the tests skip with a reason. Time:
estimated at a few seconds per case on an H200, the inputs drawn once for the module.
Run on an H200 (2026-12-01): the default path passes; bench/NOTES.md, "Rows of 2^24
keys", has what the forced paths showed.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from typing import NamedTuple

import numpy as np
import pytest

import cupy_piecewise
from cupy_piecewise import tolerance
from cupy_piecewise.gpu_arrays import bfloat16, poisoned_outputs
from seeds import fresh_seed  # tests/ is on sys.path: tests/seeds.py

pytestmark = pytest.mark.gpu

DTYPE = "bfloat16"
#: One batch, one head: k1, k2 and v hold N * D = 2**31 + 4736 elements each.
M, N, D = 96, 2**24 + 37, 128
W = N // 2
#: Inputs: several standard deviations, as tests/test_kernels_gpu.py draws them.
STD = 1.5
#: Standard deviation of ``do``: brings dk and dv from ~1e-6 to order one (module docstring).
DO_STD = 2.0**17
#: Keys per step of the reference and of the input draws.
CHUNK = 2**18
#: Key ranges whose gradient rows are judged on their own: first keys, around 2**23, last keys.
WINDOWS = ((0, 4096), (2**23 - 2048, 2**23 + 2048), (N - 4096, N))
#: query row -> its planted key (row + N - M >= key, so causal rows see theirs too).
PLANTED = {0: 0, 10: 2**23 - 1, 11: 2**23, 93: 2**24 - 1, 94: 2**24, 95: N - 1}
#: Score of a planted pair: lse is about log(N) + STD**4 / 2 (scores are normal with
#: variance sm_scale**2 * D * STD**4 = STD**4), and exp(S_PLANTED - lse) is then 1e-3.
S_PLANTED = math.log(N) + STD**4 / 2 + math.log(1e-3)
#: Free GPU memory the module needs (its peak is about 30 GiB).
NEEDS_BYTES = 40 * 2**30


class Case(NamedTuple):
    """Sizes of a problem with one batch and one head: M queries against N >= M keys (so
    that every query row has admissible keys), head dim D, threshold w, causal."""

    M: int
    N: int
    D: int
    w: int
    causal: bool

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.D)


# --------------------------------------------------------------------------- bfloat16 bits
# Integer operations only, so that the same code runs on NumPy and CuPy arrays and needs
# no bfloat16 arithmetic from either.

_U16, _U1, _HALF, _HIGH = np.uint32(16), np.uint32(1), np.uint32(0x7FFF), np.uint32(0xFFFF0000)


def _rne(bits):
    """float32 bit patterns plus the carry of rounding to nearest even at bit 16 (finite
    values, as ``reference.round_to_bf16``)."""
    return bits + (((bits >> _U16) & _U1) + _HALF)


def round_bf16(x):
    """float32 ``x`` (NumPy or CuPy) rounded to bfloat16, as float32."""
    return (_rne(x.view(np.uint32)) & _HIGH).view(np.float32)


def bf16_bits(x):
    """The bit patterns (uint16) of float32 ``x`` rounded to bfloat16."""
    return (_rne(x.view(np.uint32)) >> _U16).astype(np.uint16)


def as_f32(a):
    """The float32 values (exact) of a bfloat16 array (NumPy or CuPy), as a new array."""
    return (a.view(np.uint16).astype(np.uint32) << _U16).view(np.float32)


# --------------------------------------------------------------------------- the reference

#: (name, dtype, rounding of probabilities, ds and outputs): the float64 reference and the
#: float32 plain implementation with bfloat16 roundings (reference.lowp_forward/backward).
PRECISIONS = (("ref", np.float64, None), ("low", np.float32, round_bf16))


def _unchanged(a):
    return a


def _scores(xp, case: Case, q1, q2, k1, k2, j0: int):
    """Scaled scores of all query rows against keys ``j0, j0 + 1, ...`` (``len(k1)`` of
    them), in the operands' precision, ``-inf`` where causal excludes the key; and the mask
    of the pairs that take the second projection (``d = i + P - j >= w``)."""
    ct = q1.dtype.type
    P = case.N - case.M
    rows = xp.arange(case.M, dtype=xp.int64)[:, None]
    cols = xp.arange(j0, j0 + k1.shape[0], dtype=xp.int64)[None, :]
    far = rows + (P - case.w) >= cols
    s = xp.where(far, q2 @ k2.T, q1 @ k1.T)
    s *= ct(case.sm_scale)  # after the product, as reference._block_scores scales
    if case.causal:
        s = xp.where(rows + P < cols, ct(-np.inf), s)
    return s, far


def reference_pass(xp, case: Case, keys, q1, q2, o, lse, do, chunk: int, visit):
    """The float64 reference and the lowp yardstick of one case, over ``chunk`` keys at a
    time, in two passes over the keys (the lowp forward rounds ``exp(s - rowmax)``, so it
    needs the whole row's maximum first).

    Args:
        xp: the array module (CuPy on the GPU; NumPy for the CPU check of this code).
        keys: ``keys(j0, j1) -> (k1, k2, v)``, float32 ``(j1 - j0, D)`` arrays holding
            bfloat16 values.
        q1, q2, do: float32 ``(M, D)``, bfloat16 values.
        o, lse: the forward's results that the backward starts from (the kernel's, as
            autograd would pass them): float32 ``(M, D)`` of bfloat16 values, ``(M,)``.
        visit: called as ``visit(j0, j1, ref, low)`` for each chunk, with ``ref`` the
            float64 ``(dk1, dk2, dv)`` of keys ``j0 .. j1 - 1`` and ``low`` the yardstick's
            (float32, bfloat16 values): the key gradients are never whole.

    Returns:
        ``{"ref": {...}, "low": {...}}``, each with ``o`` ``(M, D)``, ``lse`` ``(M,)``,
        ``dq1``, ``dq2`` ``(M, D)``: the reference forward (from the inputs alone) and the
        query gradients.
    """
    ops = {name: [a.astype(ct) for a in (q1, q2, do, o)] for name, ct, _ in PRECISIONS}
    starts = range(0, case.N, chunk)
    rowmax = {name: xp.full(case.M, -np.inf, dtype=ct) for name, ct, _ in PRECISIONS}
    for j0 in starts:
        k1, k2, _ = keys(j0, min(case.N, j0 + chunk))
        for name, ct, _ in PRECISIONS:
            s, _ = _scores(xp, case, ops[name][0], ops[name][1], k1.astype(ct, copy=False),
                           k2.astype(ct, copy=False), j0)
            rowmax[name] = xp.maximum(rowmax[name], s.max(axis=1))
            del s

    # per precision: sum of exp(s - rowmax), its product with v, and ds @ k of each pair
    acc = {name: [xp.zeros(case.M, ct)] + [xp.zeros((case.M, case.D), ct) for _ in range(3)]
           for name, ct, _ in PRECISIONS}
    delta = {name: (ops[name][2] * ops[name][3]).sum(axis=1) for name, _, _ in PRECISIONS}
    lse_as = {name: lse.astype(ct) for name, ct, _ in PRECISIONS}
    for j0 in starts:
        j1 = min(case.N, j0 + chunk)
        ks = keys(j0, j1)
        grads = []
        for name, ct, rnd in PRECISIONS:
            r = rnd or _unchanged
            q1c, q2c, doc, _ = ops[name]
            k1c, k2c, vc = (k.astype(ct, copy=False) for k in ks)
            rowsum, pv, dq1, dq2 = acc[name]
            s, far = _scores(xp, case, q1c, q2c, k1c, k2c, j0)
            p = xp.exp(s - rowmax[name][:, None])
            rowsum += p.sum(axis=1)
            pv += r(p) @ vc
            p = xp.exp(s - lse_as[name][:, None])  # the backward's p, from the given lse
            del s
            dv = r(p).T @ doc
            ds = r(p * (doc @ vc.T - delta[name][:, None]))
            del p
            ds1, ds2 = xp.where(far, ct(0), ds), xp.where(far, ds, ct(0))
            del ds, far
            dq1 += ds1 @ k1c
            dq2 += ds2 @ k2c
            sc = ct(case.sm_scale)
            grads.append(tuple(r(g) for g in ((ds1.T @ q1c) * sc, (ds2.T @ q2c) * sc, dv)))
            del ds1, ds2, dv
        visit(j0, j1, *grads)

    out = {}
    for name, ct, rnd in PRECISIONS:
        r = rnd or _unchanged
        rowsum, pv, dq1, dq2 = acc[name]
        sc = ct(case.sm_scale)
        out[name] = {"o": r(pv / rowsum[:, None]), "lse": rowmax[name] + xp.log(rowsum),
                     "dq1": r(dq1 * sc), "dq2": r(dq2 * sc)}
    return out


# --------------------------------------------------------------------------- the rule

def with_scaled_slack(verdict: tolerance.Verdict, peak: float) -> tolerance.Verdict:
    """``verdict``, or a passing copy of it when it failed rule 1 only and rule 1 holds
    with the absolute slack scaled by ``max(1, peak)`` (``peak = max|ref|``): allowance 2
    of tests/test_fuzz_cpu.py's ``judge`` (the slack is sized for outputs of order one)."""
    if (verdict.passed or not verdict.finite or verdict.nonfinite_mismatch
            or verdict.rel_err > verdict.rel_bound):
        return verdict
    bound = verdict.bound + tolerance.ABS_SLACK * (max(1.0, peak) - 1.0)
    if verdict.max_err > bound:
        return verdict
    note = "; ".join(filter(None, [verdict.note, "passes with rule 1's slack scaled by "
                                                 f"max(1, max|ref|) = {max(1.0, peak):.3g}"]))
    return dataclasses.replace(verdict, bound=bound, passed=True, note=note)


class RuleAccumulator:
    """``tolerance.compare``'s rule for an output that arrives in pieces (on the GPU: the
    maxima and squared norms are reduced there, so a 2**31-element gradient is never whole
    in float64, nor on the host). The reference must be finite (every query row of these
    cases has admissible keys), so rules 3 and 4 reduce to "``impl`` is finite"."""

    def __init__(self, xp, name: str):
        self.xp, self.name = xp, name
        self.max_err = self.low_err = self.err_sq = self.ref_sq = self.peak = 0.0
        self.count = 0
        self.finite = True

    def add(self, impl, ref, low) -> None:
        """One piece: the result ``impl``, the float64 ``ref`` and the yardstick ``low``."""
        xp = self.xp
        if not ref.size:
            return
        assert bool(xp.isfinite(ref).all()), f"{self.name}: the reference is not finite"
        finite = bool(xp.isfinite(impl).all())
        self.finite = self.finite and finite
        diff = xp.abs(impl - ref)
        if not finite:  # as compare: a non-finite result is an infinite error
            diff = xp.where(xp.isfinite(diff), diff, np.inf)
        self.max_err = max(self.max_err, float(diff.max()))
        self.err_sq += float((diff * diff).sum())
        self.low_err = max(self.low_err, float(xp.abs(low - ref).max()))
        self.ref_sq += float((ref * ref).sum())
        self.peak = max(self.peak, float(xp.abs(ref).max()))
        self.count += ref.size

    def verdict(self, dtype: str = DTYPE) -> tolerance.Verdict:
        rb = tolerance.rel_bound(dtype)
        err, norm = math.sqrt(self.err_sq), math.sqrt(self.ref_sq)
        rel = err / norm if norm > 0.0 else err
        bound = 2.0 * self.low_err + tolerance.ABS_SLACK
        passed = self.finite and self.max_err <= bound and rel <= rb
        note = "" if norm > 0.0 else "||ref|| == 0: absolute norm used"
        verdict = tolerance.Verdict(self.name, self.max_err, bound, rel, rb, self.finite,
                                    bool(passed), note=note)
        return with_scaled_slack(verdict, self.peak)


def _host(a) -> np.ndarray:
    return np.asarray(a.get() if hasattr(a, "get") else a, dtype=np.float64)


def judge_case(xp, case: Case, q1, q2, do, keys, o, lse, dq, dkv, *, chunk: int, windows,
               planted):
    """Every verdict of one case, and the RMS of each reference gradient.

    ``q1``, ``q2``, ``do``, ``keys``, ``o``, ``lse``: as :func:`reference_pass` takes them
    (``o``, ``lse`` the kernel's forward). ``dq``: the kernel's ``(dq1, dq2)``, float32
    ``(M, D)``; ``dkv(j0, j1)``: the kernel's ``(dk1, dk2, dv)`` rows ``j0 .. j1 - 1`` as
    new float32 arrays (the planted rows are zeroed in them once the whole-tensor rule has
    seen them). ``windows``: ``(lo, hi)`` key ranges judged on their own; ``planted``:
    ``{query row: key}``, keys left out of the windows.

    Verdicts, in order: o, lse, dq1, dq2 (``tolerance.compare``), then dk1, dk2, dv over
    all keys, then each of them in each window.
    """
    names = ("dk1", "dk2", "dv")
    whole = {n: RuleAccumulator(xp, n) for n in names}
    parts = {(n, lo): RuleAccumulator(xp, f"{n}[{lo}:{hi}]") for n in names for lo, hi in windows}

    def visit(j0, j1, ref, low):
        for name, impl, r, lw in zip(names, dkv(j0, j1), ref, low):
            whole[name].add(impl, r, lw)
            for key in planted.values():
                if j0 <= key < j1:
                    impl[key - j0] = r[key - j0] = lw[key - j0] = 0.0
            for lo, hi in windows:
                a, b = max(lo, j0) - j0, min(hi, j1) - j0
                if a < b:
                    parts[name, lo].add(impl[a:b], r[a:b], lw[a:b])

    out = reference_pass(xp, case, keys, q1, q2, o, lse, do, chunk, visit)
    verdicts = []
    rms = {}
    for name, impl in (("o", o), ("lse", lse), ("dq1", dq[0]), ("dq2", dq[1])):
        ref = _host(out["ref"][name])
        verdict = tolerance.compare(name, _host(impl), ref, _host(out["low"][name]), DTYPE)
        verdicts.append(with_scaled_slack(verdict, float(np.abs(ref).max())))
        rms[name] = float(np.sqrt(np.mean(np.square(ref))))
    verdicts += [a.verdict() for a in whole.values()] + [a.verdict() for a in parts.values()]
    rms.update({n: math.sqrt(a.ref_sq / a.count) for n, a in whole.items()})
    return verdicts, rms


# --------------------------------------------------------------------------- GPU inputs

def _draw(rng, rows: int, std: float):
    """A ``(1, 1, rows, D)`` bfloat16 CuPy array of normal draws of standard deviation
    ``std``, drawn CHUNK rows at a time (a float32 draw of a whole key tensor is 8 GiB)."""
    import cupy

    bits = cupy.empty((rows, D), dtype=cupy.uint16)
    for r0 in range(0, rows, CHUNK):
        x = rng.standard_normal((min(rows - r0, CHUNK), D), dtype=cupy.float32)
        x *= np.float32(std)
        bits[r0:r0 + x.shape[0]] = bf16_bits(x)
    return bits.view(bfloat16()).reshape(1, 1, rows, D)


def _plant(x: dict) -> None:
    """Set both projections of each planted key to the multiple of its row's queries that
    scores S_PLANTED: ``k[key] = beta * q[row]``, ``beta = S / (sm_scale * |q[row]|^2)``."""
    import cupy

    sm_scale = 1.0 / math.sqrt(D)
    for row, key in PLANTED.items():
        for qn, kn in (("q1", "k1"), ("q2", "k2")):
            q = as_f32(x[qn][0, 0, row])
            beta = S_PLANTED / (sm_scale * float((q * q).sum()))
            x[kn].view(cupy.uint16)[0, 0, key] = bf16_bits(q * np.float32(beta))


def _row_sums(a):
    """Sum of the bit patterns of each row of a ``(1, 1, rows, D)`` bfloat16 array: a
    write to it almost surely changes one."""
    import cupy

    return a.view(cupy.uint16).reshape(-1, D).sum(axis=1, dtype=cupy.uint64)


INPUTS = ("q1", "k1", "q2", "k2", "v")


@pytest.fixture(scope="module")
def huge():
    """The inputs, drawn once for the module on the GPU: ``{"seed", "q1", "k1", "q2",
    "k2", "v", "do"}`` (bfloat16 CuPy arrays, the keys planted) and ``"sums"``, their row
    checksums. Freed at the end of the module."""
    import cupy

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # what earlier torch tests of the session left cached
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    free = cupy.cuda.runtime.memGetInfo()[0]
    if free < NEEDS_BYTES:
        pytest.skip(f"needs {NEEDS_BYTES / 2**30:.0f} GiB of free GPU memory, "
                    f"{free / 2**30:.1f} GiB free")
    seed = fresh_seed()  # fresh inputs; printed on failure
    rng = cupy.random.default_rng(seed)
    x = {"seed": seed}
    for name, rows, std in (("q1", M, STD), ("q2", M, STD), ("k1", N, STD), ("k2", N, STD),
                            ("v", N, STD), ("do", M, DO_STD)):
        x[name] = _draw(rng, rows, std)
    _plant(x)
    x["sums"] = {name: _row_sums(x[name]) for name in INPUTS + ("do",)}
    yield x
    x.clear()  # pytest keeps the fixture's value until the session ends
    pool.free_all_blocks()


@pytest.fixture(params=[("auto", False), ("mma", False), ("hopper", False), ("hopper", True)],
                ids=["default", "mma", "hopper", "hopper-deterministic"])
def kernel_path(request, monkeypatch):
    """(CUPY_PIECEWISE_PATH, deterministic backward). By default this problem runs the
    mma.sync forward (96 queries are too few query tiles for the Hopper forward: split-KV)
    and the Hopper backward; the two forced paths cover both kernels of each phase."""
    import cupy

    from cupy_piecewise import capability

    path, deterministic = request.param
    if path == "hopper" and cupy.cuda.Device().compute_capability != "90":
        pytest.skip("no Hopper kernels on this GPU (compute capability 9.0 only): "
                    "the mma case covers it")
    monkeypatch.setenv(capability.PATH_VAR, path)
    capability.refresh_env_override()
    return path, deterministic


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_more_than_2_31_elements_in_k_and_v(huge, kernel_path, causal):
    import cupy

    x = huge
    path, deterministic = kernel_path
    where = (f"(path {path}, deterministic={deterministic}, causal={causal}, "
             f"input seed {x['seed']})")
    ins = [x[name] for name in INPUTS]
    with poisoned_outputs():
        o, lse = cupy_piecewise.attention(*ins, W, causal=causal, return_lse=True)
    with poisoned_outputs():
        dq1, dk1, dq2, dk2, dv = cupy_piecewise.attention_backward(
            x["do"], *ins, o, lse, W, causal=causal, deterministic=deterministic)
    for name, sums in x["sums"].items():
        assert bool((_row_sums(x[name]) == sums).all()), f"{name} was written {where}"

    def rows(a):
        return as_f32(a[0, 0])

    def keys(j0, j1):
        return tuple(as_f32(x[name][0, 0, j0:j1]) for name in ("k1", "k2", "v"))

    def dkv(j0, j1):
        return tuple(as_f32(g[0, 0, j0:j1]) for g in (dk1, dk2, dv))

    verdicts, rms = judge_case(cupy, Case(M, N, D, W, causal), rows(x["q1"]), rows(x["q2"]),
                               rows(x["do"]), keys, rows(o), lse[0, 0], (rows(dq1), rows(dq2)),
                               dkv, chunk=CHUNK, windows=WINDOWS, planted=PLANTED)
    report = "\n".join(map(str, verdicts))
    print(f"{where}\n{report}")
    # Known limits (bench/NOTES.md, "Rows of 2^24 keys"): a kernel that sums one query
    # row over all 2^24 keys in one set of tensor-core float32 accumulators misses the rule
    # at this length (within it up to 2^22 keys: scripts/long_rows.py): the mma.sync dq
    # kernel (the mma path and deterministic mode: dq1, dq2) and the Hopper forward when
    # forced (o). The default path (split-KV forward, Hopper backward) must pass whole, and
    # every other output everywhere.
    known = set()
    if path == "mma" or deterministic:
        known |= {"dq1", "dq2"}
    if path == "hopper":
        known |= {"o"}
    failed = [v for v in verdicts if not v.passed]
    assert all(v.name in known for v in failed), f"{report}\n{where}"
    if failed:
        pytest.xfail("known limit of tensor-core accumulation over 2^24 keys in one row: "
                     + "; ".join(map(str, failed)))
    # do's scale did its job: no gradient is so small that rule 1's slack decides it
    small = {name: value for name, value in rms.items()
             if name not in ("o", "lse") and value <= 1e3 * tolerance.ABS_SLACK}
    assert not small, f"reference gradients with RMS below {1e3 * tolerance.ABS_SLACK}: {small} {where}"
