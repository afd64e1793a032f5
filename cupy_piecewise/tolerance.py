"""The tolerance rule (docs/semantics.md, Tolerance), as a function.

A result ``impl`` (o, lse or one gradient) passes against the float64 reference ``ref``
and the plain low-precision implementation ``lowp`` (see ``reference.lowp_forward`` /
``lowp_backward``) when

1. ``max|impl - ref| <= 2 * max|lowp - ref| + 1e-5``,
2. ``||impl - ref||_2 / ||ref||_2 <= rel_bound(dtype)`` -- 2e-3 for float16, 1e-2 for
   bfloat16; 2e-3 for ``"tf32"`` (float32 inputs on the GPU, whose products run in TF32:
   the SPEC's bound); 1e-4 for float32 and 1e-10 for float64 (bounds for the CPU paths,
   chosen by this project: float32 kernels use float32 throughout, so 1e-4
   leaves room for reduction order over long rows, and float64 is the reference's own
   precision). When ``||ref|| == 0`` the absolute norm ``||impl - ref||`` is used.
3. no NaN or Inf in ``impl`` where ``ref`` is finite, and
4. non-finite entries of ``ref`` (the ``-inf`` of ``lse`` for rows with no admissible
   key) are matched exactly by ``impl`` (``-inf`` in both; NaN matches NaN).

Entries where ``ref`` is not finite are excluded from the error norms.  Entries where
``lowp`` is not finite (e.g. float16 overflow) are left out of ``max|lowp - ref|``.
With ``inputs_finite=False`` (inputs holding NaN/Inf) rules 3 and 4 are waived and the
norms are taken over the entries where both ``ref`` and ``impl`` are finite.

Inputs are converted with ``np.asarray(x, float64)``; callers convert GPU arrays first.

float16 gradients and loss scaling: a gradient whose entries fall below float16's
smallest normal number (6.1e-5) cannot be stored to rule 2's precision at all (the
correctly rounded float64 answer itself can miss 2e-3 -- e.g. dq1 of one query row
against 4096 keys with w = 1, where only one key uses the first projection). float16
training avoids this with loss scaling (``torch.amp.GradScaler``), and the checks do
the same: :func:`float16_loss_scale` picks a power of two for ``do``, which scales
every exact gradient by exactly that factor and changes nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Verdict", "compare", "assert_close", "rel_bound", "float16_loss_scale", "ABS_SLACK",
           "REL_BOUNDS"]

#: Absolute slack added to twice the low-precision error.
ABS_SLACK = 1e-5

#: Relative (L2) bounds by input dtype (docs/semantics.md, Tolerance): float16 / bfloat16
#: for the GPU kernels, float32 and float64 for the CPU paths.
REL_BOUNDS = {
    "float16": 2e-3,
    "bfloat16": 1e-2,
    "float32": 1e-4,
    "float64": 1e-10,
    # float32 inputs on the GPU: products in TF32 (SPEC, float32 on the GPU); compare with
    # dtype "tf32" and the "tf32" lowp (reference.lowp_forward / lowp_backward)
    "tf32": 2e-3,
}


def _dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = str(dtype)
    name = name.replace("torch.", "").lower()
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16",
            "fp32": "float32", "float": "float32", "fp64": "float64",
            "double": "float64"}.get(name, name)


def rel_bound(dtype) -> float:
    """Relative L2 bound for inputs of ``dtype`` (str, NumPy, torch or CuPy dtype)."""
    name = _dtype_name(dtype)
    try:
        return REL_BOUNDS[name]
    except KeyError:
        raise ValueError(
            f"dtype: expected one of {sorted(REL_BOUNDS)}, got {dtype!r}") from None


@dataclass
class Verdict:
    name: str
    max_err: float
    bound: float
    rel_err: float
    rel_bound: float
    finite: bool
    passed: bool
    #: entries where ref is non-finite (-inf lse) and impl differs from it
    nonfinite_mismatch: int = 0
    note: str = ""

    def __str__(self) -> str:
        status = "PASS" if self.passed else "FAIL"
        text = (f"{status} {self.name}: max|impl-ref|={self.max_err:.3e} "
                f"(bound {self.bound:.3e}), ||impl-ref||/||ref||={self.rel_err:.3e} "
                f"(bound {self.rel_bound:.1e}), finite={self.finite}")
        if self.nonfinite_mismatch:
            text += f", {self.nonfinite_mismatch} non-finite ref entries not matched"
        if self.note:
            text += f" [{self.note}]"
        return text


def compare(name, impl, ref, lowp, dtype, *, inputs_finite=True) -> Verdict:
    """Apply the tolerance rule (docs/semantics.md, Tolerance) to one output; see the module docstring."""
    rb = rel_bound(dtype)
    impl = np.asarray(impl, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    lowp = np.asarray(lowp, dtype=np.float64)
    if impl.shape != ref.shape or lowp.shape != ref.shape:
        return Verdict(name, float("inf"), float("nan"), float("inf"), rb, False, False,
                       note=f"shape mismatch: impl {impl.shape}, ref {ref.shape}, "
                            f"lowp {lowp.shape}")

    ref_fin = np.isfinite(ref)
    impl_fin = np.isfinite(impl)
    notes = []
    if inputs_finite:
        finite = bool(impl_fin[ref_fin].all())
        nf = ~ref_fin
        same = (impl[nf] == ref[nf]) | (np.isnan(impl[nf]) & np.isnan(ref[nf]))
        mismatch = int(np.count_nonzero(~same))
        mask = ref_fin
    else:
        finite = True
        mismatch = 0
        mask = ref_fin & impl_fin
        notes.append("inputs not finite: NaN/Inf checks waived")

    diff = np.abs(impl[mask] - ref[mask])
    if diff.size:
        diff = np.where(np.isfinite(diff), diff, np.inf)
        max_err = float(diff.max())
        err_norm = float(np.sqrt(np.sum(np.square(diff)))) if np.isfinite(max_err) else float("inf")
    else:
        max_err, err_norm = 0.0, 0.0

    lmask = mask & np.isfinite(lowp)
    if np.count_nonzero(mask & ~np.isfinite(lowp)):
        notes.append(f"{np.count_nonzero(mask & ~np.isfinite(lowp))} non-finite lowp "
                     "entries left out of the bound")
    ldiff = np.abs(lowp[lmask] - ref[lmask])
    lowp_err = float(ldiff.max()) if ldiff.size else 0.0
    bound = 2.0 * lowp_err + ABS_SLACK

    ref_norm = float(np.linalg.norm(ref[mask])) if mask.any() else 0.0
    if ref_norm > 0.0:
        rel_err = err_norm / ref_norm
    else:
        rel_err = err_norm
        notes.append("||ref|| == 0: absolute norm used")

    passed = (finite and mismatch == 0 and max_err <= bound and rel_err <= rb)
    return Verdict(name, max_err, bound, rel_err, rb, finite, bool(passed),
                   nonfinite_mismatch=mismatch, note="; ".join(notes))


def assert_close(name, impl, ref, lowp, dtype) -> Verdict:
    """:func:`compare`, raising ``AssertionError(str(verdict))`` when it fails."""
    verdict = compare(name, impl, ref, lowp, dtype)
    if not verdict.passed:
        raise AssertionError(str(verdict))
    return verdict


def float16_loss_scale(grads, do) -> float:
    """Power-of-two factor for the upstream gradient ``do`` of a float16 backward check.

    ``grads``: the float64 reference gradients computed with ``do`` (they are linear in
    ``do``, so ``s * do`` gives exactly ``s * grads``). Returns 1.0 when every gradient
    that is not zero already reaches 2**-4 in magnitude (well inside float16's normal
    range); otherwise the smallest power of two that lifts the smallest such gradient
    there, limited so that the largest gradient stays at most 2**12 and ``s * max|do|``
    at most 2**14 (far from float16's 65504), and never below 1. Gradients that are zero
    (exactly, or below 1e-12 of the largest) are left out: scaling cannot help them, and
    their check falls back to an absolute norm that a scale would only inflate.
    """
    mags = [float(np.max(np.abs(g))) for g in grads if np.size(g)]
    peak = max(mags, default=0.0)
    if peak == 0.0 or not np.isfinite(peak):
        return 1.0
    smallest = min(m for m in mags if m > 1e-12 * peak)
    if smallest >= 2.0**-4:
        return 1.0
    scale = 2.0 ** np.ceil(np.log2(2.0**-4 / smallest))
    scale = min(scale, 2.0 ** np.floor(np.log2(2.0**12 / peak)))
    do_peak = float(np.max(np.abs(do))) if np.size(do) else 0.0
    if do_peak > 0.0:
        scale = min(scale, 2.0 ** np.floor(np.log2(2.0**14 / do_peak)))
    return float(max(1.0, scale))
