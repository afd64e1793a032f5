"""The torch CPU implementation of piecewise attention (docs/semantics.md).

Computed in float32 for float16/bfloat16/float32 inputs and in float64 for float64
inputs, processing query rows in chunks so that the score matrices stay below a fixed
memory budget. Used by :mod:`cupy_piecewise.torch_ops` for CPU tensors (and so by the
gloo context-parallel tests and CI).
"""
from __future__ import annotations

import math

import torch

__all__ = ["forward", "backward", "lse_dtype"]


def lse_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """float64 for float64 CPU inputs (so gradcheck holds), float32 otherwise."""
    return torch.float64 if (dtype == torch.float64 and device.type == "cpu") else torch.float32


#: Upper bound on the elements of one (B, H, rows, N) score matrix per chunk.
_CPU_CHUNK_ELEMENTS = 1 << 22


def _chunk_rows(B: int, H: int, N: int) -> int:
    return max(1, _CPU_CHUNK_ELEMENTS // max(1, B * H * N))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scores(q1c, q2c, k1, k2, r0, r1, P, N, w, causal, sm_scale, G):
    """Scaled, masked scores of query rows [r0, r1) against all keys.

    q1c, q2c: (B, Hkv, G*rows, D); k1, k2: (B, Hkv, N, D), compute dtype.
    -> s (B, Hkv, G*rows, N) with -inf at excluded keys, and use2 (rows, N), True
    where d(i, j) >= w (the second projection).
    """
    dev = q1c.device
    i = torch.arange(r0, r1, device=dev).unsqueeze(1)
    j = torch.arange(N, device=dev).unsqueeze(0)
    d = i + P - j  # signed distance, (rows, N)
    use2 = d >= w
    s1 = torch.matmul(q1c, k1.transpose(-1, -2))
    s2 = torch.matmul(q2c, k2.transpose(-1, -2))
    B, Hkv, GR, _ = s1.shape
    s = torch.where(use2, s2.view(B, Hkv, G, r1 - r0, N), s1.view(B, Hkv, G, r1 - r0, N))
    s = s * sm_scale
    if causal:
        s = s.masked_fill(d < 0, -math.inf)
    return s.view(B, Hkv, GR, N), use2


def _rows(x, r0, r1, Hkv, G, ct):
    """Rows [r0, r1) of a (B, H, M, D) tensor as (B, Hkv, G*rows, D) in dtype ct."""
    B, H, _, D = x.shape
    return x[:, :, r0:r1].to(ct).reshape(B, Hkv, G * (r1 - r0), D)


def _unrows(x, B, H, rows, D):
    return x.reshape(B, H, rows, D)


def forward(q1, k1, q2, k2, v, w, causal, sm_scale, shift=None):
    """CPU forward -> ``(o, lse)``: q1, q2 (B, H, M, D); k1, k2, v (B, Hkv, N, D), one dtype;
    ``o`` (B, H, M, D) in that dtype, ``lse`` (B, H, M) per :func:`lse_dtype`. ``shift``: P
    of ``d = i + P - j`` (None: ``N - M``). Arguments must already be checked
    (:func:`cupy_piecewise.validate.check_inputs`) and ``w``/``shift`` clamped
    (:func:`cupy_piecewise.core.clamp_w`)."""
    B, H, M, D = q1.shape
    dev = q1.device  # CPU tensors in the package; tests also run it on CUDA in float64
    _, Hkv, N, _ = k1.shape
    ct = _compute_dtype(q1.dtype)
    o = torch.empty((B, H, M, D), dtype=q1.dtype, device=dev)
    lse = torch.empty((B, H, M), dtype=lse_dtype(q1.dtype, q1.device), device=dev)
    if o.numel() == 0:
        return o, lse
    G = H // Hkv
    P = N - M if shift is None else shift
    k1c, k2c, vc = k1.to(ct), k2.to(ct), v.to(ct)
    step = _chunk_rows(B, H, N)
    for r0 in range(0, M, step):
        r1 = min(M, r0 + step)
        rows = r1 - r0
        s, _ = _scores(
            _rows(q1, r0, r1, Hkv, G, ct), _rows(q2, r0, r1, Hkv, G, ct),
            k1c, k2c, r0, r1, P, N, w, causal, sm_scale, G,
        )
        m = torch.logsumexp(s, dim=-1, keepdim=True)  # -inf for rows without keys
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m_safe)  # exactly 0 at excluded keys and on empty rows
        oc = torch.matmul(p, vc)
        o[:, :, r0:r1] = _unrows(oc, B, H, rows, D)
        lse[:, :, r0:r1] = m.reshape(B, H, rows)
    return o, lse


def backward(do, q1, k1, q2, k2, v, o, lse, w, causal, sm_scale, shift=None, dlse=None):
    """CPU backward -> ``(dq1, dk1, dq2, dk2, dv)`` in the inputs' dtype, shapes of q1, k1,
    q2, k2, v; ``do``/``o`` (B, H, M, D), ``lse`` (B, H, M); ``shift`` as in :func:`forward`;
    ``dlse`` (B, H, M) or None: gradient of the loss with respect to ``lse`` (``ds = p * (dp
    - delta + dlse)``). Arguments must be checked."""
    B, H, M, D = q1.shape
    dev = q1.device  # CPU tensors in the package; tests also run it on CUDA in float64
    _, Hkv, N, _ = k1.shape
    ct = _compute_dtype(q1.dtype)
    dt = q1.dtype
    if B * Hkv == 0 or M == 0 or N == 0:
        return (
            torch.zeros((B, H, M, D), dtype=dt, device=dev),
            torch.zeros((B, Hkv, N, D), dtype=dt, device=dev),
            torch.zeros((B, H, M, D), dtype=dt, device=dev),
            torch.zeros((B, Hkv, N, D), dtype=dt, device=dev),
            torch.zeros((B, Hkv, N, D), dtype=dt, device=dev),
        )
    G = H // Hkv
    P = N - M if shift is None else shift
    k1c, k2c, vc = k1.to(ct), k2.to(ct), v.to(ct)
    dq1 = torch.empty((B, H, M, D), dtype=dt, device=dev)
    dq2 = torch.empty((B, H, M, D), dtype=dt, device=dev)
    dk1 = torch.zeros((B, Hkv, N, D), dtype=ct, device=dev)
    dk2 = torch.zeros((B, Hkv, N, D), dtype=ct, device=dev)
    dv = torch.zeros((B, Hkv, N, D), dtype=ct, device=dev)
    step = _chunk_rows(B, H, N)
    for r0 in range(0, M, step):
        r1 = min(M, r0 + step)
        rows = r1 - r0
        q1c, q2c = _rows(q1, r0, r1, Hkv, G, ct), _rows(q2, r0, r1, Hkv, G, ct)
        doc, oc = _rows(do, r0, r1, Hkv, G, ct), _rows(o, r0, r1, Hkv, G, ct)
        s, use2 = _scores(q1c, q2c, k1c, k2c, r0, r1, P, N, w, causal, sm_scale, G)
        m = lse[:, :, r0:r1].to(ct).reshape(B, Hkv, G * rows, 1)
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m_safe)
        delta = (doc * oc).sum(-1, keepdim=True)
        if dlse is not None:  # the lse gradient enters through delta (not on empty rows)
            dl = dlse[:, :, r0:r1].to(ct).reshape(B, Hkv, G * rows, 1)
            delta = delta - torch.where(torch.isinf(m), torch.zeros_like(dl), dl)
        dp = torch.matmul(doc, vc.transpose(-1, -2))
        ds = (p * (dp - delta)).view(B, Hkv, G, rows, N)
        zero = torch.zeros((), dtype=ct, device=dev)
        ds1 = torch.where(use2, zero, ds).view(B, Hkv, G * rows, N)
        ds2 = torch.where(use2, ds, zero).view(B, Hkv, G * rows, N)
        dv += torch.matmul(p.transpose(-1, -2), doc)
        dk1 += torch.matmul(ds1.transpose(-1, -2), q1c) * sm_scale
        dk2 += torch.matmul(ds2.transpose(-1, -2), q2c) * sm_scale
        dq1[:, :, r0:r1] = _unrows(torch.matmul(ds1, k1c) * sm_scale, B, H, rows, D)
        dq2[:, :, r0:r1] = _unrows(torch.matmul(ds2, k2c) * sm_scale, B, H, rows, D)
    return dq1, dk1.to(dt), dq2, dk2.to(dt), dv.to(dt)
