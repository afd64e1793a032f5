"""Packed variable-length batches: ``attention_varlen`` / ``attention_varlen_backward``.

``B`` sequences of different lengths are packed along one axis, FlashAttention's varlen
layout: queries ``(total_q, H, D)``, keys and values ``(total_k, Hkv, D)``, and
``cu_seqlens_q`` / ``cu_seqlens_k`` the ``B + 1`` running totals (``cu[0] = 0``,
``cu[B] = total``). Sequence ``b`` is the rows ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]``
of the queries against the rows ``cu_seqlens_k[b] : cu_seqlens_k[b + 1]`` of the keys,
an independent problem whose queries are aligned to the end of its own keys
(docs/semantics.md, "Packed variable-length batches"). Zero-length sequences are allowed.

CUDA arrays (CuPy; torch CUDA tensors, with autograd through ``o`` and ``lse``, custom
operators for ``torch.compile``) run packed kernels (:mod:`cupy_piecewise.varlen_gpu`): one
grid over (query tile, head, sequence), no padding, and no host synchronisation when
``max_seqlen_q`` and ``max_seqlen_k`` are given (CUDA-graph capture). The CPU paths (NumPy:
the float64 reference; torch CPU tensors: the torch implementation, with autograd, the lse
differentiable) run each sequence through :func:`cupy_piecewise.attention`.
"""
from __future__ import annotations

import operator

import numpy as np

from . import api, validate

__all__ = ["attention_varlen", "attention_varlen_backward"]


def _host_ints(cu, name: str, library: str, device):
    """``cu`` as a list of Python ints, checked: a 1-D integer array of the inputs' library
    and device with at least two entries, starting at 0, non-decreasing."""
    lib = validate.library_of(cu, name)
    if lib != library:
        raise TypeError(f"{name} is a {lib} array but the inputs are {library} arrays")
    dev = validate._device_key(cu, library)
    if dev != device:
        raise ValueError(f"{name} is on {validate._describe_device(dev)}; the running totals "
                         f"must be on the inputs' device ({validate._describe_device(device)})")
    shape = tuple(int(n) for n in cu.shape)
    if len(shape) != 1 or shape[0] < 2:
        raise ValueError(f"{name} must be 1-D with B + 1 >= 2 entries, got shape {shape}")
    dt = validate.dtype_name(cu)
    if dt not in ("int32", "int64"):
        raise TypeError(f"{name} must hold int32 (or int64) running totals, got {dt}")
    values = [int(x) for x in (cu.tolist() if hasattr(cu, "tolist") else cu)]
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    for a, b in zip(values, values[1:]):
        if b < a:
            raise ValueError(f"{name} must be non-decreasing (running totals), got {values}")
    return values


def _as_4d(library: str, x):
    """A packed (total, heads, D) array as a (1, heads, total, D) view (for the checks)."""
    return x.transpose(0, 1)[None] if library == "torch" else x.transpose(1, 0, 2)[None]


def _check_max(value, name: str, total: int) -> int:
    """A ``max_seqlen`` argument as an int in [0, total]; TypeError / ValueError naming it."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int or None, got bool")
    try:
        value = operator.index(value)  # int and NumPy integers
    except TypeError:
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}") from None
    if not 0 <= value <= total:
        raise ValueError(f"{name}={value} must lie in [0, {total}] (the packed length)")
    return value


def check_packed(library: str, q1, k1, q2, k2, v, w, causal, sm_scale) -> validate.Problem:
    """The five packed arrays checked as :func:`cupy_piecewise.validate.check_inputs` checks
    a (1, H, total, D) call (after a rank check that names the array): ranks, shapes, one
    dtype, library and device, and the scalars. Returns that (1, H, total, D) Problem."""
    for name, x in (("q1", q1), ("k1", k1), ("q2", q2), ("k2", k2), ("v", v)):
        validate.library_of(x, name)
        if len(x.shape) != 3:
            raise ValueError(f"{name} must have 3 dimensions (total, heads, head_dim) in a packed "
                             f"batch, got shape {tuple(x.shape)}")
    return validate.check_inputs(*(_as_4d(library, x) for x in (q1, k1, q2, k2, v)), w, causal,
                                 sm_scale)


def _plan(q1, k1, q2, k2, v, cu_q, cu_k, max_q, max_k, w, causal, sm_scale):
    """Checked (cu_q, cu_k) lists for a CPU call: the five packed arrays as
    :func:`cupy_piecewise.validate.check_inputs` checks a (1, H, total, D) call (ranks,
    shapes, one dtype, library and device), the running totals and the max_seqlen bounds."""
    library = validate.library_of(q1, "q1")
    dense = check_packed(library, q1, k1, q2, k2, v, w, causal, sm_scale)
    device = validate._device_key(q1, library)
    cq = _host_ints(cu_q, "cu_seqlens_q", library, device)
    ck = _host_ints(cu_k, "cu_seqlens_k", library, device)
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of "
                         f"sequences, got {len(cq) - 1} and {len(ck) - 1}")
    for name, cu, total in (("cu_seqlens_q", cq, dense.M), ("cu_seqlens_k", ck, dense.N)):
        if cu[-1] != total:
            raise ValueError(f"{name} must end at the packed length {total}, got {cu[-1]}")
    for name, cu, limit, total in (("max_seqlen_q", cq, max_q, dense.M),
                                   ("max_seqlen_k", ck, max_k, dense.N)):
        longest = max(b - a for a, b in zip(cu, cu[1:]))
        if limit is not None and _check_max(limit, name, total) < longest:
            raise ValueError(f"{name}={limit} is below the longest sequence ({longest})")
    return library, cq, ck


def check_backward_shapes(total_q: int, H: int, D: int, do, o, lse, dlse) -> None:
    """``do`` and ``o`` of shape (total_q, H, D), ``lse`` and ``dlse`` (None: absent) of
    shape (H, total_q); ValueError naming the first that is not (both paths' backward)."""
    for name, x, shape in (("do", do, (total_q, H, D)), ("o", o, (total_q, H, D)),
                           ("lse", lse, (H, total_q)), ("dlse", dlse, (H, total_q))):
        if x is not None and tuple(int(n) for n in x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")


def _seq(x, a: int, b: int):
    """Rows a:b of a packed (total, heads, D) array as a (1, heads, b - a, D) view."""
    return x[a:b].transpose(1, 0, 2)[None] if isinstance(x, np.ndarray) else x[a:b].transpose(0, 1)[None]


def _unseq(x):
    """(1, heads, n, D) -> (n, heads, D)."""
    return x[0].transpose(1, 0, 2) if isinstance(x, np.ndarray) else x[0].transpose(0, 1)


def _cat(parts, axis: int, like):
    if isinstance(like, np.ndarray):
        return np.concatenate(parts, axis=axis)
    import torch

    return torch.cat(parts, dim=axis)


def _on_gpu(q1) -> str | None:
    """``'cupy'`` or ``'torch'`` for CUDA arrays of those libraries, else None."""
    library = validate.library_of(q1, "q1")
    if library == "cupy":
        return library
    if library == "torch" and getattr(getattr(q1, "device", None), "type", "cpu") == "cuda":
        return library
    return None


def attention_varlen(q1, k1, q2, k2, v, cu_seqlens_q, cu_seqlens_k, dist_threshold, *,
                     max_seqlen_q=None, max_seqlen_k=None, causal=False, sm_scale=None,
                     return_lse=False, deterministic=False):
    """Piecewise attention of a packed batch of variable-length sequences.

    Args:
        q1, q2: ``(total_q, H, D)`` packed queries; k1, k2, v: ``(total_k, Hkv, D)`` packed
            keys and values (NumPy, CuPy or torch arrays: one library, device and dtype).
        cu_seqlens_q, cu_seqlens_k: ``(B + 1,)`` int32 (or int64) running totals of the
            sequences' lengths, arrays of the inputs' library: 0, then non-decreasing, ending
            at ``total_q`` / ``total_k``. Zero-length sequences are allowed.
        dist_threshold, causal, sm_scale: as :func:`cupy_piecewise.attention`, applied to
            each sequence with its queries aligned to the end of its own keys.
        max_seqlen_q, max_seqlen_k: optional bounds on the sequence lengths (checked).
        return_lse: also return ``lse`` of shape ``(H, total_q)``.
        deterministic: (torch autograd) make the gradients of this call bitwise
            reproducible, as :func:`attention_varlen_backward`'s ``deterministic`` does;
            ``torch.use_deterministic_algorithms(True)`` has the same effect.

    Returns ``o`` ``(total_q, H, D)`` in the input dtype (or ``(o, lse)``); with torch
    tensors, differentiable (``o`` and ``lse``).

    CUDA arrays (CuPy, torch CUDA; float16/bfloat16, the CUDA head dims): ``cu_seqlens_*``
    must be int32 on the inputs' device. With both ``max_seqlen_*`` given the host never
    reads the running totals (no synchronisation: CUDA graphs, ``torch.compile``); they
    must then bound every sequence and the totals must be valid (start at 0,
    non-decreasing, end at the packed lengths), or results are undefined. A ``max_seqlen``
    left None is found by reading the totals on the host, which checks them too. On an
    H100/H200 the packed forward and backward run the Hopper kernels (head dims 64, 80, 96
    and 128, and the forward at 256; the others run the mma.sync kernels). Neither splits the keys of decode-like batches (one
    query per sequence): use :func:`cupy_piecewise.attention_with_kvcache` for those.

    Raises:
        TypeError, ValueError: bad inputs, as :func:`cupy_piecewise.attention` for each
            sequence, and for running totals that are not 1-D integers starting at 0,
            non-decreasing and ending at the packed lengths (on CUDA: not int32 on the
            inputs' device), or a max_seqlen below the longest sequence (on CUDA, when
            the host reads the totals) or outside [0, total].

    Example:
        >>> import numpy as np, cupy_piecewise.varlen as vl
        >>> rng = np.random.default_rng(0)
        >>> q1, q2 = rng.standard_normal((2, 7, 2, 16))       # sequences of 3, 0 and 4 rows
        >>> k1, k2, v = rng.standard_normal((3, 9, 1, 16))    # ... against 5, 0 and 4 keys
        >>> cu_q, cu_k = np.array([0, 3, 3, 7], np.int32), np.array([0, 5, 5, 9], np.int32)
        >>> o, lse = vl.attention_varlen(q1, k1, q2, k2, v, cu_q, cu_k, 2, causal=True, return_lse=True)
        >>> o.shape, lse.shape
        ((7, 2, 16), (2, 7))
    """
    gpu = _on_gpu(q1)
    if gpu == "torch":
        from . import varlen_torch

        return varlen_torch.attention_varlen(q1, k1, q2, k2, v, cu_seqlens_q, cu_seqlens_k,
                                             dist_threshold, max_seqlen_q, max_seqlen_k, causal,
                                             sm_scale, return_lse, deterministic)
    validate.check_deterministic(deterministic)
    if gpu == "cupy":
        from . import varlen_gpu
        from .adapters import cupy as ad

        pk = varlen_gpu.prepare(ad.OPS, q1, k1, q2, k2, v, cu_seqlens_q, cu_seqlens_k,
                                dist_threshold, max_seqlen_q, max_seqlen_k, causal, sm_scale)
        o, lse = varlen_gpu.forward(pk, ad.OPS, q1, k1, q2, k2, v, cu_seqlens_q, cu_seqlens_k)
        return (o, lse) if return_lse else o
    library, cq, ck = _plan(q1, k1, q2, k2, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, dist_threshold, causal, sm_scale)
    os, ls = [], []
    for (qa, qb), (ka, kb) in zip(zip(cq, cq[1:]), zip(ck, ck[1:])):
        o, lse = api.attention(_seq(q1, qa, qb), _seq(k1, ka, kb), _seq(q2, qa, qb),
                               _seq(k2, ka, kb), _seq(v, ka, kb), dist_threshold, causal=causal,
                               sm_scale=sm_scale, return_lse=True)
        os.append(_unseq(o))
        ls.append(lse[0])
    o = _cat(os, 0, os[0])
    return (o, _cat(ls, 1, ls[0])) if return_lse else o


def attention_varlen_backward(do, q1, k1, q2, k2, v, o, lse, cu_seqlens_q, cu_seqlens_k,
                              dist_threshold, *, max_seqlen_q=None, max_seqlen_k=None,
                              causal=False, sm_scale=None, dlse=None, deterministic=False):
    """Gradients of :func:`attention_varlen` -> ``(dq1, dk1, dq2, dk2, dv)``, packed like the
    inputs (``dq*`` ``(total_q, H, D)``, ``dk*``/``dv`` ``(total_k, Hkv, D)``).

    ``do``, ``o``: ``(total_q, H, D)``; ``lse`` and ``dlse`` (optional gradient of lse):
    ``(H, total_q)``; ``max_seqlen_*`` as for :func:`attention_varlen` (on CUDA: given,
    nothing synchronises). ``deterministic``: bitwise-identical gradients run to run. The
    Hopper packed backward (H100/H200), and the mma.sync one-kernel backward where the tile
    table has it, add dQ with float32 atomics unless it is set (then the mma.sync dq kernel
    computes dQ, about as :func:`cupy_piecewise.attention_backward`'s deterministic mode
    costs); every other path is deterministic either way. Errors as
    :func:`attention_varlen` and :func:`cupy_piecewise.attention_backward`."""
    deterministic = validate.check_deterministic(deterministic)
    gpu = _on_gpu(q1)
    if gpu == "torch":
        from . import varlen_torch

        return varlen_torch.attention_varlen_backward(
            do, q1, k1, q2, k2, v, o, lse, cu_seqlens_q, cu_seqlens_k, dist_threshold,
            max_seqlen_q, max_seqlen_k, causal, sm_scale, dlse, deterministic)
    if gpu == "cupy":
        from . import varlen_gpu
        from .adapters import cupy as ad

        pk = varlen_gpu.prepare(ad.OPS, q1, k1, q2, k2, v, cu_seqlens_q, cu_seqlens_k,
                                dist_threshold, max_seqlen_q, max_seqlen_k, causal, sm_scale)
        return varlen_gpu.backward(pk, ad.OPS, do, q1, k1, q2, k2, v, o, lse, cu_seqlens_q,
                                   cu_seqlens_k, dlse, deterministic)
    library, cq, ck = _plan(q1, k1, q2, k2, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, dist_threshold, causal, sm_scale)
    for name, x in (("do", do), ("o", o), ("lse", lse), ("dlse", dlse)):
        if x is not None and validate.library_of(x, name) != library:
            raise TypeError(f"{name} is a {validate.library_of(x, name)} array but the inputs "
                            f"are {library} arrays")
    check_backward_shapes(*(int(n) for n in q1.shape), do, o, lse, dlse)
    parts = [[] for _ in range(5)]
    for (qa, qb), (ka, kb) in zip(zip(cq, cq[1:]), zip(ck, ck[1:])):
        d = None if dlse is None else dlse[:, qa:qb][None]
        g = api.attention_backward(_seq(do, qa, qb), _seq(q1, qa, qb), _seq(k1, ka, kb),
                                   _seq(q2, qa, qb), _seq(k2, ka, kb), _seq(v, ka, kb),
                                   _seq(o, qa, qb), lse[:, qa:qb][None], dist_threshold,
                                   causal=causal, sm_scale=sm_scale, dlse=d)
        for acc, x in zip(parts, g):
            acc.append(_unseq(x))
    return tuple(_cat(p, 0, p[0]) for p in parts)
