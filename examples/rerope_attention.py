"""ReRoPE attention with cupy_piecewise: a small attention layer and its checks.

ReRoPE (rectified rotary position embedding) scores nearby keys with ordinary rotary
positions and clips the relative position of distant keys at a window ``w``: a key at
distance ``d = i - j`` behind query ``i`` is scored as if it were at distance
``min(d, w)``. That is piecewise attention with two projections:

* ``q1 = rope(q, pos_q)``, ``k1 = rope(k, pos_k)``: rotary embeddings at the absolute
  positions. Rotary embeddings are relative, ``rope(q, m)·rope(k, n)`` depends only on
  ``m - n``, so ``q1[i]·k1[j]`` sees the true distance ``d`` (used when ``d < w``).
* ``q2 = rope(q, w)`` (every query rotated by the constant position ``w``) and
  ``k2 = k = rope(k, 0)`` (keys unrotated): ``q2[i]·k2[j]`` sees relative position
  exactly ``w`` whatever the true distance (used when ``d >= w``).

With ``w`` larger than the sequence every pair takes the first projection, and the
layer equals causal scaled-dot-product attention with plain rotary embeddings; the
script asserts that, asserts that a small ``w`` equals a direct evaluation of the
clipped positions, runs backward, and decodes the last tokens against one cache of raw
keys that ``attention_with_rotary_kvcache`` rotates inside the kernel. It runs on the CPU (float64 / float32 torch
implementation) and, when a GPU is present, on CUDA (bfloat16 and float16 kernels,
checked against float32 references with the same weights).

Run: ``python examples/rerope_attention.py``
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import cupy_piecewise


def rope(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding (rotate-half convention) of x (..., L, D) at positions pos (L,)."""
    D = x.shape[-1]
    inv_freq = base ** (-torch.arange(0, D, 2, device=x.device, dtype=torch.float64) / D)
    ang = pos.to(torch.float64)[:, None] * inv_freq[None, :]  # (L, D/2)
    cos = torch.cat([ang.cos(), ang.cos()], dim=-1).to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], dim=-1).to(x.dtype)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class ReRoPEAttention(torch.nn.Module):
    """Causal self-attention with ReRoPE positions and grouped-query heads.

    Input and output ``(B, L, dim)``. ``window`` is ReRoPE's ``w``: keys ``w`` or more
    positions behind a query are scored at relative position ``w``.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, window: int):
        super().__init__()
        self.h, self.hkv, self.d = n_heads, n_kv_heads, dim // n_heads
        self.window = window
        self.wq = torch.nn.Linear(dim, n_heads * self.d, bias=False)
        self.wk = torch.nn.Linear(dim, n_kv_heads * self.d, bias=False)
        self.wv = torch.nn.Linear(dim, n_kv_heads * self.d, bias=False)
        self.wo = torch.nn.Linear(n_heads * self.d, dim, bias=False)

    def projections(self, x):
        """-> q1, k1, q2, k2, v as (B, heads, L, D) views of (B, L, heads, D) memory."""
        B, L, _ = x.shape
        q = self.wq(x).view(B, L, self.h, self.d).transpose(1, 2)
        k = self.wk(x).view(B, L, self.hkv, self.d).transpose(1, 2)
        v = self.wv(x).view(B, L, self.hkv, self.d).transpose(1, 2)
        pos = torch.arange(L, device=x.device)
        q1, k1 = rope(q, pos), rope(k, pos)
        q2 = rope(q, torch.full((L,), self.window, device=x.device))
        k2 = k  # rope at position 0 is the identity
        return q1, k1, q2, k2, v

    def forward(self, x):
        B, L, _ = x.shape
        q1, k1, q2, k2, v = self.projections(x)
        o = cupy_piecewise.attention(q1, k1, q2, k2, v, self.window, causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, L, self.h * self.d))

    def forward_rotary_sdpa(self, x):
        """Plain causal attention with rotary positions (what w >= L must equal)."""
        B, L, _ = x.shape
        q1, k1, _, _, v = self.projections(x)
        g = self.h // self.hkv
        k1, v = k1.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        o = F.scaled_dot_product_attention(q1, k1, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, L, self.h * self.d))

    def forward_clipped_direct(self, x):
        """O(L^2) evaluation of ReRoPE's definition: relative position min(i - j, w)."""
        B, L, _ = x.shape
        q = self.wq(x).view(B, L, self.h, self.d).transpose(1, 2)
        k = self.wk(x).view(B, L, self.hkv, self.d).transpose(1, 2)
        v = self.wv(x).view(B, L, self.hkv, self.d).transpose(1, 2)
        g = self.h // self.hkv
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        i = torch.arange(L, device=x.device)
        rel = (i[:, None] - i[None, :]).clamp(max=self.window)  # (L, L)
        s = torch.empty(B, self.h, L, L, dtype=q.dtype, device=x.device)
        for r in range(L):  # rope(q, m)·rope(k, n) == rope(q, m - n)·k
            qr = rope(q[:, :, r : r + 1].expand(-1, -1, L, -1), rel[r])
            s[:, :, r] = (qr * k).sum(-1)
        s = s / self.d**0.5
        s = s.masked_fill(rel < 0, float("-inf"))
        o = torch.softmax(s, dim=-1) @ v
        return self.wo(o.transpose(1, 2).reshape(B, L, self.h * self.d))


def check(device: str, dtype: torch.dtype, atol: float) -> None:
    """Run the layer in ``dtype``; references run in float64 on the CPU, float32 on CUDA."""
    torch.manual_seed(0)
    B, L, dim, heads, kv_heads = 2, 48, 256, 4, 2  # head dim 64
    ref_dtype = dtype if dtype == torch.float64 else torch.float32
    x_ref = torch.randn(B, L, dim, device=device, dtype=ref_dtype, requires_grad=True)
    x = x_ref.detach().to(dtype).requires_grad_()
    layer_ref = ReRoPEAttention(dim, heads, kv_heads, window=L + 5).to(device, ref_dtype)
    layer = ReRoPEAttention(dim, heads, kv_heads, window=L + 5).to(device, dtype)
    layer.load_state_dict(layer_ref.state_dict())

    def diff(a, b):
        return (a.to(ref_dtype) - b).abs().max().item()

    # 1. w beyond the sequence: plain rotary attention, forward and backward.
    y = layer(x)
    y_ref = layer_ref.forward_rotary_sdpa(x_ref)
    err = diff(y, y_ref)
    assert err <= atol, f"{device} {dtype}: w > L differs from rotary SDPA by {err:.3e}"
    gy = torch.randn_like(y_ref)
    (gx,) = torch.autograd.grad(y, x, gy.to(dtype))
    (gx_ref,) = torch.autograd.grad(y_ref, x_ref, gy)
    gerr = diff(gx, gx_ref)
    assert gerr <= 10 * atol, f"{device} {dtype}: dx differs by {gerr:.3e}"

    # 2. a real window: matches ReRoPE's definition (relative position min(d, w)).
    layer.window = layer_ref.window = 7
    y = layer(x)
    y_def = layer_ref.forward_clipped_direct(x_ref)
    err2 = diff(y, y_def)
    assert err2 <= atol, f"{device} {dtype}: w = 7 differs from the clipped definition by {err2:.3e}"
    y.float().square().mean().backward()
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in layer.parameters())
    # 3. serving: decode the last tokens against one cache of raw keys, rotated inside the
    #    kernel (attention_with_rotary_kvcache), equals the layer's attention rows.
    err3 = decode_with_raw_key_cache(layer, x.detach(), steps=4)
    assert err3 <= atol, f"{device} {dtype}: decode differs from the layer by {err3:.3e}"
    print(f"{device:5s} {str(dtype):15s} |y - rotary sdpa| {err:.2e}  |dx diff| {gerr:.2e}  "
          f"|y - clipped definition| {err2:.2e}  |decode - layer| "
          f"{err3:.2e}  ok")


def rope_tables(positions: int, D: int, device, dtype, base: float = 10000.0):
    """cos, sin of shape (positions, D // 2): rope()'s angles, the first half of each row
    (float32 on the GPU, which the kernel reads; any float dtype on the CPU)."""
    inv_freq = base ** (-torch.arange(0, D, 2, device=device, dtype=torch.float64) / D)
    ang = torch.arange(positions, device=device, dtype=torch.float64)[:, None] * inv_freq
    return ang.cos().to(dtype), ang.sin().to(dtype)


def decode_with_raw_key_cache(layer: ReRoPEAttention, x: torch.Tensor, steps: int):
    """Prefill the raw keys and values of all but the last ``steps`` tokens into a cache,
    then decode those tokens one at a time with attention_with_rotary_kvcache (queries
    rotated here, keys in the kernel); the rows must match the layer's own attention.
    Returns the largest difference."""
    B, L, _ = x.shape
    with torch.no_grad():
        q1, _, q2, _, v = layer.projections(x)
        q = layer.wq(x).view(B, L, layer.h, layer.d).transpose(1, 2)
        k = layer.wk(x).view(B, L, layer.hkv, layer.d).transpose(1, 2)  # raw keys
        want = cupy_piecewise.attention(q1, layer.projections(x)[1], q2, k, v, layer.window,
                                        causal=True)
        cos, sin = rope_tables(L, layer.d, x.device, torch.float32 if x.is_cuda else x.dtype)
        k_cache = torch.zeros(B, layer.hkv, L, layer.d, device=x.device, dtype=x.dtype)
        v_cache = torch.zeros_like(k_cache)
        start = L - steps
        k_cache[:, :, :start], v_cache[:, :, :start] = k[:, :, :start], v[:, :, :start]
        worst = 0.0
        for t in range(start, L):
            lengths = torch.full((B,), t, device=x.device, dtype=torch.int32)
            o = cupy_piecewise.attention_with_rotary_kvcache(
                q1[:, :, t:t + 1], q2[:, :, t:t + 1], k_cache, v_cache, layer.window, cos=cos,
                sin=sin, cache_seqlens=lengths, k_new=k[:, :, t:t + 1].contiguous(),
                v_new=v[:, :, t:t + 1].contiguous())
            worst = max(worst, (o.double() - want[:, :, t:t + 1].double()).abs().max().item())
        assert torch.equal(k_cache, k.contiguous()), "the cache must hold the raw keys"
    return worst


def main() -> None:
    check("cpu", torch.float64, 1e-10)
    check("cpu", torch.float32, 1e-5)
    if torch.cuda.is_available():
        check("cuda", torch.bfloat16, 2e-2)
        check("cuda", torch.float16, 4e-3)


if __name__ == "__main__":
    main()
