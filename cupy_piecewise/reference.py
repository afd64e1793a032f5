"""Float64 NumPy reference for piecewise attention, plus a "lowp" plain implementation.

Written from the formulas of docs/semantics.md (The function, Backward), independent of
the rest of the package
(imports only NumPy).

Layout: queries ``(B, H, M, D)``, keys/values ``(B, Hkv, N, D)``; ``H`` is a multiple of
``Hkv`` and query head ``h`` reads key/value head ``h // (H // Hkv)``.  With
``P = N - M`` the signed distance of query row ``i`` to key column ``j`` is
``d(i, j) = i + P - j``.  The score is ``sm_scale * q2[i]·k2[j]`` where ``d >= w`` and
``sm_scale * q1[i]·k1[j]`` otherwise; ``causal`` excludes ``d < 0``.  A row with no
admissible key gives ``o = 0``, ``lse = -inf`` and contributes nothing to any gradient.

Memory: the work is done per (batch, head, block of query rows); only a few
``(rows, N)`` matrices are alive at a time, so the peak stays around
``chunk_rows * N * 8 bytes * a few`` plus the inputs and outputs.

``forward`` / ``backward``  -- float64 reference (any float input dtype, computed in float64).
``lowp_forward`` / ``lowp_backward`` -- the "plain implementation in the input precision"
used by the tolerance rule: operands rounded to the input dtype, scores / softmax /
accumulation in float32, probabilities (and ``ds`` in backward) rounded to the input
dtype before their products, as a tensor-core kernel does; outputs rounded to the input
dtype (``lse`` stays float32).  Returned as float32 arrays holding dtype-rounded values.
"""

from __future__ import annotations

import math
import operator

import numpy as np

__all__ = [
    "forward",
    "backward",
    "lowp_forward",
    "lowp_backward",
    "round_to_bf16",
    "round_to_tf32",
    "default_chunk_rows",
]

#: Memory budget (bytes) for the (chunk_rows, N) temporaries of one block.
_CHUNK_BUDGET_BYTES = 256 * 1024 * 1024
#: Number of (chunk_rows, N) float64-sized temporaries assumed alive at once.
_CHUNK_TEMPORARIES = 6


def default_chunk_rows(n_keys: int) -> int:
    """Rows per block so that ``rows * N * 8 B * 6 temporaries <= 256 MiB``."""
    per_row = max(1, int(n_keys)) * 8 * _CHUNK_TEMPORARIES
    return max(1, _CHUNK_BUDGET_BYTES // per_row)


# --------------------------------------------------------------------------- rounding

def round_to_bf16(x) -> np.ndarray:
    """Round to bfloat16 (round to nearest, ties to even), returned as float32.

    The input is first converted to float32 (as ``torch``'s conversion does); the
    bfloat16 value is the float32 bit pattern rounded to its upper 16 bits.  Infinities
    are kept, NaN stays NaN (quiet), finite values too large for bfloat16 round to inf.
    """
    a = np.asarray(x, dtype=np.float32)
    f = np.ascontiguousarray(a).reshape(-1)
    bits = f.view(np.uint32).astype(np.uint64)
    lsb = (bits >> np.uint64(16)) & np.uint64(1)
    rounded = ((bits + np.uint64(0x7FFF) + lsb) & np.uint64(0xFFFF0000)).astype(np.uint32)
    out = rounded.view(np.float32).copy()
    nan = np.isnan(f)
    if nan.any():
        out[nan] = np.float32(np.nan)
    return out.reshape(a.shape)


def round_to_tf32(x) -> np.ndarray:
    """Round to TF32 (float32 with 10 mantissa bits; to nearest, ties away from zero, as
    ``cvt.rna.tf32.f32`` does), returned as float32. Infinities and NaN are kept."""
    a = np.asarray(x, dtype=np.float32)
    bits = a.view(np.uint32).astype(np.uint64)
    rounded = ((bits + np.uint64(0x1000)) & np.uint64(0xFFFFE000)).astype(np.uint32)
    out = rounded.view(np.float32).copy()
    keep = ~np.isfinite(a)
    if keep.any():
        out[keep] = a[keep]
    return out


def _rounder(dtype):
    """-> (name, function rounding a float32 array to ``dtype``, returning float32).
    ``'tf32'``: float32 inputs on the GPU, whose products round their operands to TF32."""
    name = str(dtype).replace("torch.", "").lower()
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16",
            "fp32": "float32", "float": "float32"}.get(name, name)
    if name == "float16":
        return name, lambda a: np.asarray(a, np.float32).astype(np.float16).astype(np.float32)
    if name == "bfloat16":
        return name, round_to_bf16
    if name == "float32":
        return name, lambda a: np.asarray(a, np.float32)
    if name == "tf32":
        return name, round_to_tf32
    raise ValueError(f"dtype: expected 'float16', 'bfloat16', 'float32' or 'tf32', got {dtype!r}")


# --------------------------------------------------------------------------- validation

def _check_w(w):
    if isinstance(w, (bool, np.bool_)):
        raise TypeError(f"w (dist_threshold): expected an integer, got bool {w!r}")
    try:
        return operator.index(w)
    except TypeError:
        raise TypeError(f"w (dist_threshold): expected an integer, got {type(w).__name__} {w!r}") from None


def _check_inputs(q1, k1, q2, k2, v):
    for name, a in (("q1", q1), ("k1", k1), ("q2", q2), ("k2", k2), ("v", v)):
        if a.ndim != 4:
            raise ValueError(f"{name}: expected rank 4 (B, H, L, D), got shape {a.shape}")
    if q1.shape != q2.shape:
        raise ValueError(f"q2: expected the shape of q1 {q1.shape}, got {q2.shape}")
    if k1.shape != k2.shape:
        raise ValueError(f"k2: expected the shape of k1 {k1.shape}, got {k2.shape}")
    if v.shape != k1.shape:
        raise ValueError(f"v: expected the shape of k1 {k1.shape}, got {v.shape}")
    B, H, M, D = q1.shape
    Bk, Hkv, N, Dk = k1.shape
    if Bk != B:
        raise ValueError(f"k1: expected batch {B} (from q1), got {Bk}")
    if Dk != D:
        raise ValueError(f"k1: expected head dim {D} (from q1), got {Dk}")
    if D < 1:
        raise ValueError("q1: expected head dim >= 1, got 0")
    if Hkv < 1 or H % Hkv != 0:
        raise ValueError(f"k1: expected a number of heads dividing H={H}, got {Hkv}")
    return B, H, Hkv, M, N, D


def _check_grad_inputs(shape_q, o, lse, do):
    B, H, M, D = shape_q
    if o.shape != shape_q:
        raise ValueError(f"o: expected shape {shape_q}, got {o.shape}")
    if do.shape != shape_q:
        raise ValueError(f"do: expected shape {shape_q}, got {do.shape}")
    if lse.shape != (B, H, M):
        raise ValueError(f"lse: expected shape {(B, H, M)}, got {lse.shape}")


def _scale(sm_scale, D):
    return 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)


def _chunk(chunk_rows, N):
    if chunk_rows is None:
        return default_chunk_rows(N)
    c = operator.index(chunk_rows)
    if c < 1:
        raise ValueError(f"chunk_rows: expected a positive integer, got {chunk_rows!r}")
    return c


# --------------------------------------------------------------------------- core

def _offset(M, N, q_offset, k_offset) -> int:
    """P with d(i, j) = i + P - j: ``(q_offset + i) - (k_offset + j)``; ``q_offset=None``
    aligns the queries to the end of the keys (``k_offset + N - M``)."""
    k0 = operator.index(k_offset)
    q0 = k0 + N - M if q_offset is None else operator.index(q_offset)
    return q0 - k0


def _block_scores(q1c, q2c, k1, k2, r0, r1, M, N, w, causal, scale, ct, P):
    """Scaled, masked scores of query rows [r0, r1) against all keys, distances
    ``d = i + P - j``.

    -> (s, use2): s (rows, N) of dtype ``ct`` with -inf at causally excluded entries;
    use2 a bool (rows, N) mask of d >= w (None when no entry, True when all entries).
    """
    rows = np.arange(r0, r1, dtype=np.int64)
    cols = np.arange(N, dtype=np.int64)
    # d >= w  <=>  i + P - w >= j.  w is clamped into a range that keeps the meaning
    # (distances lie in [P + 1 - N, P + M - 1]) and fits int64.
    w_c = min(max(w, P - N - 1), P + M + 1)
    use2 = (rows + (P - w_c))[:, None] >= cols[None, :]
    any2 = bool(use2.any())
    all2 = bool(use2.all())
    if all2:
        s = q2c @ k2.T
        use2 = True
    elif not any2:
        s = q1c @ k1.T
        use2 = None
    else:
        s = q1c @ k1.T
        s2 = q2c @ k2.T
        np.copyto(s, s2, where=use2)
        del s2
    s = np.asarray(s, dtype=ct)
    s *= ct(scale)
    if causal:
        excl = (rows + P)[:, None] < cols[None, :]  # d < 0
        np.copyto(s, -np.inf, where=excl)
    return s, use2


def _split_ds(ds, use2):
    """-> (ds1, ds2): ds restricted to d < w and to d >= w (ds is consumed)."""
    if use2 is None:
        return ds, None
    if use2 is True:
        return None, ds
    ds2 = np.where(use2, ds, 0)
    np.copyto(ds, 0, where=use2)
    return ds, ds2


def _forward_impl(q1, k1, q2, k2, v, w, causal, sm_scale, chunk_rows, ct, rnd,
                  q_offset=None, k_offset=0, round_out=True):
    w = _check_w(w)
    B, H, Hkv, M, N, D = _check_inputs(q1, k1, q2, k2, v)
    P = _offset(M, N, q_offset, k_offset)
    scale = _scale(sm_scale, D)
    o = np.zeros((B, H, M, D), dtype=ct)
    lse = np.full((B, H, M), -np.inf, dtype=ct)
    if M == 0 or N == 0:
        return o, lse
    rep = H // Hkv
    cr = _chunk(chunk_rows, N)
    for b in range(B):
        for h in range(H):
            g = h // rep
            k1g, k2g, vg = k1[b, g], k2[b, g], v[b, g]
            for r0 in range(0, M, cr):
                r1 = min(M, r0 + cr)
                s, _ = _block_scores(q1[b, h, r0:r1], q2[b, h, r0:r1], k1g, k2g,
                                     r0, r1, M, N, w, causal, scale, ct, P)
                m = s.max(axis=1)
                empty = m == -np.inf
                m_safe = np.where(empty, ct(0), m)
                s -= m_safe[:, None]
                np.exp(s, out=s)                   # unnormalised p, 0 at excluded keys
                l = s.sum(axis=1)
                if rnd is not None:
                    s = rnd(s)                      # p rounded as a tensor-core kernel does
                acc = s @ vg
                del s
                l_safe = np.where(empty, ct(1), l)
                acc /= l_safe[:, None]
                acc[empty] = 0
                with np.errstate(divide="ignore"):
                    lrow = m_safe + np.log(l_safe)
                lrow[empty] = -np.inf
                o[b, h, r0:r1] = acc
                lse[b, h, r0:r1] = lrow
    if rnd is not None and round_out:
        o = rnd(o)
    return o, lse


def _backward_impl(q1, k1, q2, k2, v, o, lse, do, w, causal, sm_scale, chunk_rows, ct, rnd,
                   q_offset=None, k_offset=0, dlse=None, round_out=True, do_mm=None):
    """``do_mm``: ``do`` as the products see it (TF32-rounded), where delta takes ``do``
    itself; ``round_out``: round the gradients with ``rnd``."""
    w = _check_w(w)
    B, H, Hkv, M, N, D = _check_inputs(q1, k1, q2, k2, v)
    _check_grad_inputs(q1.shape, o, lse, do)
    P = _offset(M, N, q_offset, k_offset)
    if dlse is not None and tuple(dlse.shape) != tuple(lse.shape):
        raise ValueError(f"dlse: expected shape {tuple(lse.shape)} (that of lse), got {tuple(dlse.shape)}")
    scale = _scale(sm_scale, D)
    dq1 = np.zeros((B, H, M, D), dtype=ct)
    dq2 = np.zeros((B, H, M, D), dtype=ct)
    dk1 = np.zeros((B, Hkv, N, D), dtype=ct)
    dk2 = np.zeros((B, Hkv, N, D), dtype=ct)
    dv = np.zeros((B, Hkv, N, D), dtype=ct)
    if M == 0 or N == 0:
        return dq1, dk1, dq2, dk2, dv
    rep = H // Hkv
    cr = _chunk(chunk_rows, N)
    sc = ct(scale)
    # delta = rowsum(do * o), from the o given; a gradient into lse enters as
    # ds = p * (dp - delta + dlse), i.e. through delta. A row without admissible keys has
    # lse = -inf whatever the inputs: its dlse contributes nothing (even if not finite).
    delta = np.einsum("bhmd,bhmd->bhm", do, o)
    if dlse is not None:
        dl = np.asarray(dlse, dtype=delta.dtype)
        delta = delta - np.where(np.isneginf(np.asarray(lse)), 0, dl)
    for b in range(B):
        for h in range(H):
            g = h // rep
            k1g, k2g, vg = k1[b, g], k2[b, g], v[b, g]
            for r0 in range(0, M, cr):
                r1 = min(M, r0 + cr)
                q1c, q2c = q1[b, h, r0:r1], q2[b, h, r0:r1]
                doc = (do if do_mm is None else do_mm)[b, h, r0:r1]
                s, use2 = _block_scores(q1c, q2c, k1g, k2g, r0, r1, M, N, w,
                                        causal, scale, ct, P)
                # p = exp(s - lse); rows with lse = -inf (no admissible key) give p = 0.
                lrow = lse[b, h, r0:r1]
                l_safe = np.where(np.isfinite(lrow), lrow, ct(np.inf))
                s -= l_safe[:, None]
                p = np.exp(s, out=s)
                del s
                dv[b, g] += (p if rnd is None else rnd(p)).T @ doc
                dp = doc @ vg.T
                dp -= delta[b, h, r0:r1, None]
                dp *= p                             # ds = p * (dp - delta)
                del p
                ds = dp if rnd is None else rnd(dp)
                del dp
                ds1, ds2 = _split_ds(ds, use2)
                del ds
                if ds1 is not None:
                    dq1[b, h, r0:r1] = (ds1 @ k1g) * sc
                    dk1[b, g] += (ds1.T @ q1c) * sc
                if ds2 is not None:
                    dq2[b, h, r0:r1] = (ds2 @ k2g) * sc
                    dk2[b, g] += (ds2.T @ q2c) * sc
                del ds1, ds2
    if rnd is not None and round_out:
        dq1, dk1, dq2, dk2, dv = (rnd(x) for x in (dq1, dk1, dq2, dk2, dv))
    return dq1, dk1, dq2, dk2, dv


# --------------------------------------------------------------------------- public API

def _f64(*arrays):
    return tuple(np.asarray(a, dtype=np.float64) for a in arrays)


def forward(q1, k1, q2, k2, v, w, causal=False, sm_scale=None, *, chunk_rows=None,
            q_offset=None, k_offset=0):
    """Float64 reference forward.

    -> (o, lse): o float64 (B, H, M, D), lse float64 (B, H, M).  Inputs of any float
    dtype are computed in float64.  ``chunk_rows`` query rows are processed per block
    (default: :func:`default_chunk_rows`).  ``q_offset``/``k_offset`` (docs/semantics.md,
    planned extensions): query row ``i`` sits at ``q_offset + i``, key ``j`` at
    ``k_offset + j``; ``q_offset=None`` means ``k_offset + N - M`` (the default alignment).
    """
    q1, k1, q2, k2, v = _f64(q1, k1, q2, k2, v)
    return _forward_impl(q1, k1, q2, k2, v, w, bool(causal), sm_scale, chunk_rows,
                         np.float64, None, q_offset, k_offset)


def backward(q1, k1, q2, k2, v, o, lse, do, w, causal=False, sm_scale=None, *, chunk_rows=None,
             q_offset=None, k_offset=0, dlse=None):
    """Float64 reference backward.

    Recomputes p from the ``lse`` given and uses ``delta = rowsum(do * o)`` from the
    ``o`` given.  -> (dq1, dk1, dq2, dk2, dv), float64; dk1, dk2, dv are (B, Hkv, N, D),
    summed over the query heads of each group.  ``q_offset``/``k_offset`` as in
    :func:`forward`; ``dlse`` (B, H, M), the gradient of the loss with respect to
    ``lse``, adds to it: ``ds = p * (dp - delta + dlse)``.
    """
    q1, k1, q2, k2, v, o, lse, do = _f64(q1, k1, q2, k2, v, o, lse, do)
    if dlse is not None:
        (dlse,) = _f64(dlse)
    return _backward_impl(q1, k1, q2, k2, v, o, lse, do, w, bool(causal), sm_scale,
                          chunk_rows, np.float64, None, q_offset, k_offset, dlse)


def lowp_forward(q1, k1, q2, k2, v, w, causal=False, sm_scale=None, *, dtype, chunk_rows=None,
                 q_offset=None, k_offset=0):
    """Plain forward in the precision ``dtype`` ('float16', 'bfloat16', 'float32', 'tf32').

    Operands rounded to ``dtype``; scores, softmax and accumulation in float32; the
    unnormalised probabilities rounded to ``dtype`` before the product with v; o rounded
    to ``dtype``.  -> (o, lse) float32 arrays (o holds dtype-rounded values).  Offsets as
    in :func:`forward`.  ``'tf32'`` (float32 inputs on the GPU): q, k, v and the
    probabilities rounded to TF32, as the products see them; o stays float32.
    """
    name, rnd = _rounder(dtype)
    q1, k1, q2, k2, v = (rnd(np.asarray(a)) for a in (q1, k1, q2, k2, v))
    return _forward_impl(q1, k1, q2, k2, v, w, bool(causal), sm_scale, chunk_rows,
                         np.float32, rnd, q_offset, k_offset, round_out=name != "tf32")


def lowp_backward(q1, k1, q2, k2, v, o, lse, do, w, causal=False, sm_scale=None, *, dtype,
                  chunk_rows=None, q_offset=None, k_offset=0, dlse=None):
    """Plain backward in the precision ``dtype`` ('float16', 'bfloat16', 'float32', 'tf32').

    Operands (q, k, v, o, do) rounded to ``dtype``, lse taken as float32; p, dp, ds and
    accumulation in float32; p rounded to ``dtype`` before p^T·do and ds rounded before
    ds·k and ds^T·q; gradients rounded to ``dtype``.
    -> (dq1, dk1, dq2, dk2, dv) float32 arrays holding dtype-rounded values.  Offsets
    and ``dlse`` (taken as float32) as in :func:`backward`.  ``'tf32'``: q, k, v, p, ds
    and ``do`` where it enters a product rounded to TF32; delta from float32 o and do;
    gradients stay float32.
    """
    name, rnd = _rounder(dtype)
    tf32 = name == "tf32"
    q1, k1, q2, k2, v = (rnd(np.asarray(a)) for a in (q1, k1, q2, k2, v))
    if tf32:  # o and do stay float32 (delta = rowsum(do * o) is no product); do is rounded
        # where it enters a product
        o, do = (np.asarray(a, dtype=np.float32) for a in (o, do))
        do_mm = rnd(do)
    else:
        o, do = rnd(np.asarray(o)), rnd(np.asarray(do))
        do_mm = None
    lse = np.asarray(lse, dtype=np.float32)
    if dlse is not None:
        dlse = np.asarray(dlse, dtype=np.float32)
    return _backward_impl(q1, k1, q2, k2, v, o, lse, do, w, bool(causal), sm_scale,
                          chunk_rows, np.float32, rnd, q_offset, k_offset, dlse,
                          round_out=not tf32, do_mm=do_mm)
