"""Piecewise attention as a PyTorch user writes it without cupy-piecewise: two FlexAttention
calls merged by log-sum-exp (the ``flex_composite`` benchmark provider).

    near = flex_attention(q1, k1, v, block_mask: d < w   [and d >= 0 when causal])
    far  = flex_attention(q2, k2, v, block_mask: d >= w  [and d >= 0 when causal])
    o    = (exp(lse1 - m) o1 + exp(lse2 - m) o2) / (exp(lse1 - m) + exp(lse2 - m)),  m = max(lse1, lse2)

with d = i + (N - M) - j (docs/semantics.md, "Alignment": query i sits at position i + N - M,
key j at j). Scores use ``sm_scale`` (default 1/sqrt(D)). A row without keys in one part has
lse = -inf there and that part gets weight 0; a row without keys in either part gives o = 0
(docs/semantics.md, "Empty rows"). Autograd runs through both calls and the merge, so the
same function serves forward and forward+backward.

Only the merge (:func:`lse_merge`) and the mask predicates need no FlexAttention; they are
tested on CPU against the float64 reference (tests/test_bench_flex_cpu.py).
"""
from __future__ import annotations

import inspect

import torch


# ----------------------------------------------------------------------------- masks
def near_mask_mod(offset, w, causal):
    """mask_mod of the first pair: keys with d < w (and d >= 0 when causal); offset = N - M."""
    def near(b, h, q_idx, kv_idx):
        d = q_idx + offset - kv_idx
        m = d < w
        if causal:
            m = m & (d >= 0)
        return m
    return near


def far_mask_mod(offset, w, causal):
    """mask_mod of the second pair: keys with d >= w (and d >= 0 when causal); offset = N - M."""
    def far(b, h, q_idx, kv_idx):
        d = q_idx + offset - kv_idx
        m = d >= w
        if causal:
            m = m & (d >= 0)
        return m
    return far


def dense_mask(mask_mod, M, N, device=None):
    """(M, N) bool tensor of a mask_mod (for tests and small checks)."""
    qi = torch.arange(M, device=device)[:, None]
    kj = torch.arange(N, device=device)[None, :]
    return mask_mod(0, 0, qi, kj)


# ----------------------------------------------------------------------------- merge
def lse_merge(o1, lse1, o2, lse2, return_lse=False):
    """Combine two attention results over disjoint key sets by their log-sum-exps.

    o1, o2: (..., M, D); lse1, lse2: (..., M), natural log, -inf for a row without keys.
    Returns o (dtype of o1; computed in float32 or wider), and with ``return_lse`` the
    combined lse (-inf where both parts are empty; o is 0 there).

    The shift m = max(lse1, lse2) only keeps exp() in range; it cancels in the result, so it
    is taken out of the autograd graph (detach), and replaced by 0 where both lse are -inf,
    so that no inf - inf = nan appears in the forward or the backward.
    """
    acc = torch.promote_types(lse1.dtype, torch.float32)
    lse1 = lse1.to(acc)
    lse2 = lse2.to(acc)
    m = torch.maximum(lse1, lse2).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    a1 = torch.exp(lse1 - m)
    a2 = torch.exp(lse2 - m)
    den = a1 + a2
    den_safe = torch.where(den > 0, den, torch.ones_like(den))
    o = (a1.unsqueeze(-1) * o1.to(acc) + a2.unsqueeze(-1) * o2.to(acc)) / den_safe.unsqueeze(-1)
    o = o.to(o1.dtype)
    if not return_lse:
        return o
    lse = torch.where(den > 0, m + torch.log(den_safe), torch.full_like(den, float("-inf")))
    return o, lse


# ----------------------------------------------------------------------------- flex calls
def flex_available():
    """None when torch.nn.attention.flex_attention imports, else the reason."""
    try:
        from torch.nn.attention import flex_attention as _fa  # noqa: F401
        return None
    except Exception as e:  # pragma: no cover - depends on the torch version
        return f"{type(e).__name__}: {e}"


def _flex_features():
    from torch.nn.attention import flex_attention as fa
    params = inspect.signature(fa.flex_attention).parameters
    return {
        "gqa": "enable_gqa" in params,
        "aux": "return_aux" in params and hasattr(fa, "AuxRequest"),
    }


def block_masks(M, N, w, causal, device, block_size=None):
    """(near, far) BlockMasks for M queries and N keys (B and H broadcast)."""
    from torch.nn.attention.flex_attention import create_block_mask
    off = N - M
    kw = {} if block_size is None else {"BLOCK_SIZE": block_size}
    near = create_block_mask(near_mask_mod(off, w, causal), None, None, M, N, device=device, **kw)
    far = create_block_mask(far_mask_mod(off, w, causal), None, None, M, N, device=device, **kw)
    return near, far


def make_composite(sm_scale, compile=True, dynamic=False, fullgraph=True, backend="inductor"):
    """The composite as one function ``f(q1, k1, q2, k2, v, near_mask, far_mask) -> o``
    (shapes (B, H, M, D) and (B, Hkv, N, D)), under ``torch.compile`` when ``compile``
    (static shapes, one graph: a graph break would leave flex_attention unfused, so it is
    an error instead). ``sm_scale`` is a constant of the function. ``backend`` other than
    inductor (e.g. ``"aot_eager"``) only for tests: it traces the same graph without fusing.

    Grouped-query heads: ``enable_gqa=True`` when this flex_attention has it, else k1, k2, v
    are expanded to H heads (repeat_interleave, as docs/semantics.md: head h reads h // (H // Hkv)).
    """
    from torch.nn.attention import flex_attention as fa
    feats = _flex_features()
    flex = fa.flex_attention

    def part(q, k, v, mask, scale):
        gqa = q.shape[-3] != k.shape[-3]
        kw = {}
        if gqa:
            if feats["gqa"]:
                kw["enable_gqa"] = True
            else:
                g = q.shape[-3] // k.shape[-3]
                k = k.repeat_interleave(g, dim=-3)
                v = v.repeat_interleave(g, dim=-3)
        if feats["aux"]:
            o, aux = flex(q, k, v, block_mask=mask, scale=scale, return_aux=fa.AuxRequest(lse=True), **kw)
            return o, aux.lse
        return flex(q, k, v, block_mask=mask, scale=scale, return_lse=True, **kw)

    scale = float(sm_scale)

    def composite(q1, k1, q2, k2, v, near_mask, far_mask):
        o1, lse1 = part(q1, k1, v, near_mask, scale)
        o2, lse2 = part(q2, k2, v, far_mask, scale)
        return lse_merge(o1, lse1, o2, lse2)

    if compile:
        return torch.compile(composite, dynamic=dynamic, fullgraph=fullgraph, backend=backend)
    return composite


def flex_piecewise(q1, k1, q2, k2, v, w, causal=False, sm_scale=None, compile=False):
    """One-shot convenience (tests, small checks): masks built and the composite called."""
    M, N, D = q1.shape[-2], k1.shape[-2], q1.shape[-1]
    if sm_scale is None:
        sm_scale = D ** -0.5
    near, far = block_masks(M, N, w, causal, q1.device)
    return make_composite(sm_scale, compile=compile)(q1, k1, q2, k2, v, near, far)
