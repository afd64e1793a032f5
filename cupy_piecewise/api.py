"""Public entry points: :func:`attention` and :func:`attention_backward`.

Both pick an adapter (:mod:`cupy_piecewise.adapters`) from the type of ``q1``, once per
type, with ``isinstance`` checks so subclasses go where their base class goes:

- torch tensors: :mod:`cupy_piecewise.torch_ops` (CUDA kernels for CUDA tensors, with
  autograd, ``torch.compile`` and CUDA graphs; a torch implementation for CPU tensors);
- CuPy arrays: the CUDA kernels (:mod:`cupy_piecewise.adapters.cupy`), on CuPy's current
  stream;
- NumPy arrays: the float64 reference, results cast back to the input dtype (``lse``
  to float32);
- anything else with ``__dlpack__`` / ``__dlpack_device__``: zero-copy through CuPy or
  NumPy and back (:mod:`cupy_piecewise.adapters.dlpack`).

Each adapter is imported on first use, so ``import cupy_piecewise`` needs neither CuPy
nor torch. Arguments are checked (metadata only, :mod:`cupy_piecewise.validate`) before
any work.
"""

from __future__ import annotations

import sys

import numpy as np

__all__ = ["attention", "attention_backward", "adapter_for"]

_by_type: dict = {}


def _load(library: str):
    # import statements (not importlib) so torch.compile can trace a first call
    if library == "torch":
        from . import torch_ops as mod
    elif library == "cupy":
        from .adapters import cupy as mod
    elif library == "dlpack":
        from .adapters import dlpack as mod
    else:
        from .adapters import numpy as mod
    return mod


def _library(x) -> str:
    # An object of torch's or CuPy's types exists only once that library is imported,
    # so sys.modules answers without importing anything.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return "cupy"
    if isinstance(x, np.ndarray):
        return "numpy"
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        return "dlpack"
    return "numpy"  # not an array: validate's TypeError names the argument


def adapter_for(x):
    """The module that runs calls whose ``q1`` is ``x``: it has ``attention`` and
    ``attention_backward`` with this module's signatures. Decided once per type."""
    t = type(x)
    mod = _by_type.get(t)
    if mod is None:
        mod = _by_type[t] = _load(_library(x))
    return mod


def attention(q1, k1, q2, k2, v, dist_threshold, *, causal=False, sm_scale=None, return_lse=False,
              deterministic=False, q_offset=None, k_offset=0):
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
        deterministic: (torch autograd) compute the gradients of this call
            bitwise reproducibly, as :func:`attention_backward` does with
            ``deterministic=True``; ``torch.use_deterministic_algorithms(True)``
            has the same effect. The forward itself is always deterministic.
        q_offset, k_offset: positions (run-time integers, negative allowed,
            within ``+-2**62``): query row ``i`` sits at ``q_offset + i`` and
            key ``j`` at ``k_offset + j``, and the distance is their
            difference. ``q_offset=None`` (default) means ``k_offset + N - M``:
            the queries end where the keys end, the rule above. Use them to
            split the keys of one attention into chunks (and merge the chunks
            by ``lse``: docs/semantics.md, "Gradient through lse").

    All five arrays come from one library (NumPy, CuPy, torch, or any other
    with ``__dlpack__``), live on one device and share one dtype:

    - NumPy: float16, float32, float64 (float64 reference on the CPU);
    - torch CPU: float16, bfloat16, float32, float64;
    - CUDA (CuPy arrays, torch CUDA tensors, DLPack producers in CUDA
      memory): float16 and bfloat16 (CuPy's ``bfloat16`` needs ml_dtypes),
      head dims 16, 32, 64, 80, 96, 128, 256; float32 with TF32 products
      and float32 outputs, head dims 16 to 128 (docs/semantics.md,
      "float32 on the GPU"; head dim 256 raises ValueError);
      GPUs sm_80, sm_86, sm_89, sm_90 (newer ones fall back to the nearest
      listed table). A last dimension that is not unit-stride, or strides
      the kernels cannot load aligned, is copied once. Inputs are never
      written.

    Returns:
        ``o`` of shape ``(B, H, M, D)`` in the input dtype, or ``(o, lse)``
        with ``lse`` of shape ``(B, H, M)``, float32 (natural log), as arrays
        of the caller's library (DLPack producers: see
        :mod:`cupy_piecewise.adapters.dlpack`).

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
    return adapter_for(q1).attention(q1, k1, q2, k2, v, dist_threshold, causal=causal,
                                     sm_scale=sm_scale, return_lse=return_lse,
                                     deterministic=deterministic, q_offset=q_offset,
                                     k_offset=k_offset)


def attention_backward(do, q1, k1, q2, k2, v, o, lse, dist_threshold, *, causal=False, sm_scale=None,
                       deterministic=False, q_offset=None, k_offset=0, dlse=None):
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
            ``(B, H, M)``, float32 (float64 accepted for CPU arrays). It must be
            the forward's: the float16 mma.sync backward relies on ``p <= 1``
            (it scales ``p`` by a fixed 2^14), so an lse more than ln 4 below a
            row's largest scaled score gives inf/NaN gradients there, not just
            wrong ones.
        deterministic: bitwise-identical gradients from run to run (default
            False). Two backward kernels are otherwise not: the Hopper backward
            (sm_90, head dims 64 to 128) and the mma.sync one-kernel backward
            (float16/bfloat16 where the tile table has a ``bwd_grid`` or ``bwd_fused``
            entry) add
            dQ contributions with float32 atomics, whose order varies; with True
            dQ comes from a separate kernel instead (slower: see README, "Kernel
            paths"). Every other path is deterministic either way.
        q_offset, k_offset: as given to :func:`attention`.
        dlse: the gradient of the loss with respect to ``lse``, shape
            ``(B, H, M)``, float32 (float64 accepted for CPU arrays), or None
            (zero). It adds ``p * dlse`` to the score gradient:
            ``ds = p * (do @ v.T - delta + dlse)``. torch autograd passes it
            when the loss uses the ``lse`` of ``attention(...,
            return_lse=True)``.

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
    return adapter_for(q1).attention_backward(do, q1, k1, q2, k2, v, o, lse, dist_threshold,
                                              causal=causal, sm_scale=sm_scale,
                                              deterministic=deterministic, q_offset=q_offset,
                                              k_offset=k_offset, dlse=dlse)
