"""Public entry points: :func:`attention` and :func:`attention_backward`.

Both check their arguments (metadata only, see :mod:`cupy_piecewise.validate`)
and dispatch on the array library of the inputs:

- NumPy arrays: the float64 reference (:mod:`cupy_piecewise.reference`),
  results cast back to the input dtype (``lse`` to float32).
- CuPy arrays: the CUDA kernels (:mod:`cupy_piecewise.cupy_backend`), on
  CuPy's current stream.
- torch tensors: :mod:`cupy_piecewise.torch_ops` (CUDA kernels for CUDA
  tensors, with autograd; a torch implementation for CPU tensors).

The back-end modules are imported on first use, so ``import cupy_piecewise``
needs neither CuPy nor torch.
"""

from __future__ import annotations

import numpy as np

from .validate import Problem, check_backward_inputs, check_gpu_support, check_inputs

__all__ = ["attention", "attention_backward"]


_torch_ops = None  # cupy_piecewise.torch_ops once a torch tensor has been seen


def _load_torch_ops():
    global _torch_ops
    from . import torch_ops

    _torch_ops = torch_ops
    return torch_ops


def attention(q1, k1, q2, k2, v, dist_threshold, *, causal=False, sm_scale=None, return_lse=False):
    """Piecewise attention forward.

    The score of query ``i`` and key ``j`` is ``sm_scale * q2[i]·k2[j]`` when the
    signed distance ``d = i + (N - M) - j`` is at least ``dist_threshold`` and
    ``sm_scale * q1[i]·k1[j]`` otherwise (queries are aligned to the end of the
    keys); ``o = softmax(scores) @ v``. With ``causal=True`` keys with ``d < 0``
    are excluded. A query row with no admissible key gives ``o = 0`` and
    ``lse = -inf``.

    Args:
        q1, q2: queries, shape ``(B, H, M, D)``.
        k1, k2: keys, shape ``(B, Hkv, N, D)``; ``H`` a multiple of ``Hkv``
            (grouped-query attention: query head ``h`` reads key/value head
            ``h // (H // Hkv)``).
        v: values, shape ``(B, Hkv, N, D)``.
        dist_threshold: the distance ``w`` (any ``int`` or NumPy integer,
            negative allowed) from which on the second projection is used.
        causal: exclude keys after the query (``d < 0``).
        sm_scale: score scale, a finite positive real; ``None`` means
            ``1 / sqrt(D)``.
        return_lse: also return the log-sum-exp of the scores.

    All five arrays come from one library (NumPy, CuPy or torch), live on one
    device and share one dtype:

    - NumPy: float16, float32, float64 (float64 reference on the CPU);
    - torch CPU: float16, bfloat16, float32, float64;
    - CUDA (CuPy arrays, torch CUDA tensors): float16, and bfloat16 for
      torch (CuPy has no bfloat16 dtype); head dims 16, 32, 64, 128;
      GPUs sm_80, sm_86, sm_89, sm_90 (newer ones fall back to the nearest
      listed table). A last dimension that is not unit-stride, or strides
      the kernels cannot load aligned, is copied once. Inputs are never
      written.

    Returns:
        ``o`` of shape ``(B, H, M, D)`` in the input dtype, or ``(o, lse)``
        with ``lse`` of shape ``(B, H, M)``, float32 (natural log).

    Raises:
        TypeError, ValueError: bad arguments, before any work is done; the
            message names the argument (see :func:`cupy_piecewise.validate.check_inputs`
            and, for GPU arrays, :func:`~cupy_piecewise.validate.check_gpu_support`).

    Example:
        >>> import numpy as np
        >>> import cupy_piecewise as cpw
        >>> rng = np.random.default_rng(0)
        >>> q1, q2 = rng.standard_normal((2, 1, 2, 4, 16))   # B=1, H=2, M=4, D=16
        >>> k1, k2, v = rng.standard_normal((3, 1, 1, 6, 16))  # Hkv=1, N=6
        >>> o, lse = cpw.attention(q1, k1, q2, k2, v, 2, causal=True, return_lse=True)
        >>> o.shape, o.dtype, lse.shape, lse.dtype
        ((1, 2, 4, 16), dtype('float64'), (1, 2, 4), dtype('float32'))
    """
    if type(q1).__module__.startswith("torch"):
        # torch_ops validates the same way (same messages) and memoises the result per
        # signature, which keeps the per-call host cost of small problems low.
        return (_torch_ops or _load_torch_ops()).attention(
            q1, k1, q2, k2, v, dist_threshold, causal=causal, sm_scale=sm_scale, return_lse=return_lse
        )

    if type(q1).__module__.startswith("cupy"):
        # Checked and planned once per signature (cupy_backend.prepare).
        from . import cupy_backend

        problem, launches = cupy_backend.prepare(q1, k1, q2, k2, v, dist_threshold, causal, sm_scale)
        o, lse = cupy_backend.forward(problem, q1, k1, q2, k2, v, launches=launches,
                                      need_lse=return_lse)
        return (o, lse) if return_lse else o

    problem = check_inputs(q1, k1, q2, k2, v, dist_threshold, causal, sm_scale)

    o, lse = _numpy_forward(problem, q1, k1, q2, k2, v)
    return (o, lse) if return_lse else o


def attention_backward(do, q1, k1, q2, k2, v, o, lse, dist_threshold, *, causal=False, sm_scale=None):
    """Gradients of piecewise attention.

    With ``p`` the attention probabilities (recomputed from ``lse``),
    ``delta = rowsum(do * o)`` and ``ds = p * (do @ v.T - delta)``:
    ``dv = p.T @ do``; ``dq1``/``dk1`` collect ``sm_scale * ds`` over pairs with
    ``d < w`` and ``dq2``/``dk2`` over pairs with ``d >= w``. With grouped-query
    attention ``dk1``, ``dk2``, ``dv`` sum over the query heads of a group.

    Args:
        do: gradient of the output, shape ``(B, H, M, D)``, input dtype.
        q1, k1, q2, k2, v, dist_threshold, causal, sm_scale: as given to
            :func:`attention`.
        o: the output of :func:`attention`, shape ``(B, H, M, D)``, input dtype.
        lse: the ``lse`` of :func:`attention` (``return_lse=True``), shape
            ``(B, H, M)``, float32 (float64 accepted for CPU arrays).

    Returns:
        ``(dq1, dk1, dq2, dk2, dv)`` in the input dtype: ``dq1``, ``dq2`` of
        shape ``(B, H, M, D)``; ``dk1``, ``dk2``, ``dv`` of shape
        ``(B, Hkv, N, D)``.

    Raises:
        TypeError, ValueError: bad arguments, before any work is done; the
            message names the argument (``do``, ``o``, ``lse`` included).

    Example:
        >>> import numpy as np
        >>> import cupy_piecewise as cpw
        >>> rng = np.random.default_rng(0)
        >>> q1, q2 = rng.standard_normal((2, 1, 2, 4, 16))
        >>> k1, k2, v = rng.standard_normal((3, 1, 1, 6, 16))
        >>> o, lse = cpw.attention(q1, k1, q2, k2, v, 2, return_lse=True)
        >>> do = rng.standard_normal(o.shape)
        >>> dq1, dk1, dq2, dk2, dv = cpw.attention_backward(do, q1, k1, q2, k2, v, o, lse, 2)
        >>> dq1.shape, dk1.shape
        ((1, 2, 4, 16), (1, 1, 6, 16))
    """
    problem = check_inputs(q1, k1, q2, k2, v, dist_threshold, causal, sm_scale)
    check_backward_inputs(problem, o, lse, do)

    if problem.library == "torch":
        from . import torch_ops

        return torch_ops.attention_backward(
            do, q1, k1, q2, k2, v, o, lse, dist_threshold, causal=causal, sm_scale=sm_scale
        )

    if problem.library == "cupy":
        check_gpu_support(problem)
        from . import cupy_backend

        return tuple(cupy_backend.backward(problem, q1, k1, q2, k2, v, o, lse, do))

    return _numpy_backward(problem, q1, k1, q2, k2, v, o, lse, do)


# ----------------------------------------------------------------------------
# NumPy: the float64 reference.


def _numpy_forward(problem: Problem, q1, k1, q2, k2, v):
    from . import reference

    o, lse = reference.forward(q1, k1, q2, k2, v, problem.w, problem.causal, problem.sm_scale)
    return np.asarray(o).astype(problem.dtype, copy=False), np.asarray(lse).astype(np.float32, copy=False)


def _numpy_backward(problem: Problem, q1, k1, q2, k2, v, o, lse, do):
    from . import reference

    grads = reference.backward(q1, k1, q2, k2, v, o, lse, do, problem.w, problem.causal, problem.sm_scale)
    return tuple(np.asarray(g).astype(problem.dtype, copy=False) for g in grads)
