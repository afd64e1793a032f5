"""Benchmark providers: one object per implementation, each with ``forward(s, w, causal, sm_scale)``
on an InputSet ``s`` (q1, k1, q2, k2, v of shapes (B, H, M, D) and (B, Hkv, N, D)).

Names (docs/semantics.md / SPEC "Benchmark results format"):
  piecewise       cupy_piecewise.attention, the package's default path on this GPU
  sdpa_flash, sdpa_cudnn   F.scaled_dot_product_attention on q1, k1, v (standard attention)
  torch_plain     two score matrices, torch.where, float32 softmax, @ v
  flag_attn       flag_attn.piecewise_attention (the original Triton design) when it imports
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from common import PROVIDERS, _err_text, plain_mem_estimate


# ----------------------------------------------------------------------------- reference math
def plain_piecewise(q1, k1, q2, k2, v, w, causal=False, sm_scale=None, upcast=False):
    """Plain PyTorch piecewise attention: two score matrices, torch.where, softmax, @ v.

    Shapes (B,H,M,D), (B,Hkv,N,D).  Scores and softmax in float32; probabilities are cast
    back to the input dtype before the product with v (unless upcast, then all float32).
    """
    M, N, D = q1.shape[-2], k1.shape[-2], q1.shape[-1]
    H, Hkv = q1.shape[1], k1.shape[1]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    if H != Hkv:
        g = H // Hkv
        k1, k2, v = (t.repeat_interleave(g, dim=1) for t in (k1, k2, v))
    out_dtype = v.dtype
    if upcast:
        q1, k1, q2, k2, v = (t.float() for t in (q1, k1, q2, k2, v))
    dev = q1.device
    d = (torch.arange(M, device=dev)[:, None] + (N - M)) - torch.arange(N, device=dev)[None, :]
    s1 = torch.matmul(q1, k1.transpose(-1, -2))
    s2 = torch.matmul(q2, k2.transpose(-1, -2))
    s = torch.where(d >= w, s2, s1)
    s = s.to(torch.promote_types(s.dtype, torch.float32)) * sm_scale
    del s1, s2
    if causal:
        s = s.masked_fill(d < 0, float("-inf"))
    p = torch.softmax(s, dim=-1)
    if causal and M > N:  # rows without any admissible key give o = 0
        p = torch.where((torch.arange(M, device=dev) + (N - M) >= 0)[:, None], p, 0.0)
    o = torch.matmul(p.to(v.dtype), v)
    return o.to(out_dtype)


# ----------------------------------------------------------------------------- providers
class Provider:
    name = "?"
    n_queries = 2  # queries read by this provider (for decode bytes)

    def __init__(self, env, plain_mem_bytes):
        self.env = env
        self.plain_mem_bytes = plain_mem_bytes

    def unavailable(self):
        """None, or a reason string (e.g. 'not installed: ...')."""
        return None

    def skip_reason(self, shape, causal):
        return None

    def context(self):
        return contextlib.nullcontext()

    def grad_inputs(self, s):
        return [s.q1, s.k1, s.q2, s.k2, s.v]

    def forward(self, s, w, causal, sm_scale):  # pragma: no cover - abstract
        raise NotImplementedError


class Piecewise(Provider):
    name = "piecewise"

    def __init__(self, env, plain_mem_bytes):
        super().__init__(env, plain_mem_bytes)
        self._mod = None
        self._err = None
        try:
            import cupy_piecewise
            self._mod = cupy_piecewise
            if not hasattr(cupy_piecewise, "attention"):
                self._err = "error: cupy_piecewise has no attribute 'attention'"
        except Exception as e:
            self._err = f"error: import cupy_piecewise failed: {type(e).__name__}: {e}"

    def unavailable(self):
        return self._err

    def forward(self, s, w, causal, sm_scale):
        return self._mod.attention(s.q1, s.k1, s.q2, s.k2, s.v, w, causal=causal, sm_scale=sm_scale)


class FlagAttn(Provider):
    name = "flag_attn"

    def __init__(self, env, plain_mem_bytes):
        super().__init__(env, plain_mem_bytes)
        self._mod = None
        self._err = None
        try:
            import flag_attn
            self._mod = flag_attn
        except Exception as e:
            self._err = f"not installed ({type(e).__name__}: {str(e)[:120]})"
        if self._mod is not None and not env.cuda:
            self._err = "skipped: flag_attn needs a CUDA device (dry run)"

    def unavailable(self):
        return self._err

    def forward(self, s, w, causal, sm_scale):
        return self._mod.piecewise_attention(s.q1, s.k1, s.q2, s.k2, s.v, w, causal=causal, sm_scale=sm_scale)


class Sdpa(Provider):
    n_queries = 1

    def __init__(self, env, plain_mem_bytes, backend_name):
        super().__init__(env, plain_mem_bytes)
        from torch.nn.attention import SDPBackend
        self.backend = getattr(SDPBackend, backend_name)
        self.name = {"FLASH_ATTENTION": "sdpa_flash", "CUDNN_ATTENTION": "sdpa_cudnn"}[backend_name]

    def context(self):
        from torch.nn.attention import sdpa_kernel
        return sdpa_kernel([self.backend])

    def grad_inputs(self, s):
        return [s.q1, s.k1, s.v]

    def forward(self, s, w, causal, sm_scale):
        return F.scaled_dot_product_attention(s.q1, s.k1, s.v, is_causal=causal, scale=sm_scale)


class TorchPlain(Provider):
    name = "torch_plain"

    def skip_reason(self, shape, causal):
        B, H, Hkv, M, N, D = shape
        need = plain_mem_estimate(B, H, M, N)
        if need > self.plain_mem_bytes:
            return f"skipped: memory (estimate {need / 1e9:.1f} GB > {self.plain_mem_bytes / 1e9:.0f} GB)"
        return None

    def forward(self, s, w, causal, sm_scale):
        return plain_piecewise(s.q1, s.k1, s.q2, s.k2, s.v, w, causal, sm_scale)



def make_providers(names, env, plain_mem_bytes):
    out = {}
    for n in names:
        if n == "piecewise":
            out[n] = Piecewise(env, plain_mem_bytes)
        elif n == "sdpa_flash":
            out[n] = Sdpa(env, plain_mem_bytes, "FLASH_ATTENTION")
        elif n == "sdpa_cudnn":
            out[n] = Sdpa(env, plain_mem_bytes, "CUDNN_ATTENTION")
        elif n == "torch_plain":
            out[n] = TorchPlain(env, plain_mem_bytes)
        elif n == "flag_attn":
            out[n] = FlagAttn(env, plain_mem_bytes)
        else:
            raise SystemExit(f"unknown provider {n!r}; choose from {', '.join(PROVIDERS)}")
    return out

