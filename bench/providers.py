"""Benchmark providers: one object per implementation, each with ``forward(s, w, causal, sm_scale)``
on an InputSet ``s`` (q1, k1, q2, k2, v of shapes (B, H, M, D) and (B, Hkv, N, D)).

Names (docs/semantics.md / SPEC "Benchmark results format"):
  piecewise       cupy_piecewise.attention, the package's default path on this GPU (on an
                  H100/H200 the Hopper wgmma + TMA forward and backward, dQ by float32 atomics)
  piecewise_det   the same with deterministic=True (on Hopper: dQ by the mma.sync dq kernel)
  piecewise_mma   the same with the mma.sync kernels forced: CUPY_PIECEWISE_PATH=mma and
                  cupy_piecewise.capability.refresh_env_override() for the measurement, restored after
  piecewise_mma_det
                  piecewise_mma with deterministic=True (the two-kernel backward, where
                  piecewise_mma takes the one-kernel one)
  flex_composite  two torch.compile'd FlexAttention calls (d < w on q1, k1; d >= w on q2, k2) merged
                  by log-sum-exp (bench/flex_composite.py): what a PyTorch user writes without us
  sdpa_flash, sdpa_cudnn, sdpa_efficient
                  F.scaled_dot_product_attention on q1, k1, v (standard attention), one backend
                  each; the memory-efficient one also takes float32
  torch_plain     two score matrices, torch.where, float32 softmax, @ v
  flag_attn       the original Triton design: flag_attn.piecewise_attention when the package
                  imports, else FlagAttention's piecewise.py found by bench/flag_attn_seed.py
                  (PW_FLAG_ATTN_SOURCE, .baselines/flag_attn/piecewise.py, the design seed),
                  with its A100 tile table on any GPU (PW_FLAG_ATTN_TABLE=native: its own)
"""
from __future__ import annotations

import contextlib
import math
import os

import torch
import torch.nn.functional as F

import flex_composite
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


class PiecewiseDeterministic(Piecewise):
    """cupy_piecewise.attention(..., deterministic=True): bitwise-reproducible gradients."""
    name = "piecewise_det"

    def forward(self, s, w, causal, sm_scale):
        return self._mod.attention(s.q1, s.k1, s.q2, s.k2, s.v, w, causal=causal, sm_scale=sm_scale,
                                   deterministic=True)


class FlagAttn(Provider):
    """The original Triton design: the installed ``flag_attn`` package's piecewise_attention,
    else FlagAttention's piecewise.py found by bench/flag_attn_seed.py, run with its A100
    tile table (``PW_FLAG_ATTN_TABLE``: a100, rtx3090 or native)."""
    name = "flag_attn"

    def __init__(self, env, plain_mem_bytes):
        super().__init__(env, plain_mem_bytes)
        self._fn = None
        self._err = None
        self.origin = None
        try:
            import flag_attn
            self._fn, self.origin = flag_attn.piecewise_attention, "flag_attn package"
        except Exception as e:
            self._err = f"not installed ({type(e).__name__}: {str(e)[:120]})"
            import flag_attn_seed
            path = flag_attn_seed.find_source()
            if path is not None:
                table = os.environ.get("PW_FLAG_ATTN_TABLE", "a100")
                try:
                    mod = flag_attn_seed.load(path, table)
                    self._fn, self._err = mod.attention, None
                    self.origin = (f"{os.path.basename(path)} ({table} table, "
                                   f"{flag_attn_seed.mma_flavour()})")
                except Exception as e2:
                    self._err += (f"; {path} did not load ({type(e2).__name__}: "
                                  f"{str(e2)[:120]})")
        if self._fn is not None and not env.cuda:
            self._err = "skipped: flag_attn needs a CUDA device (dry run)"

    def unavailable(self):
        return self._err

    def forward(self, s, w, causal, sm_scale):
        return self._fn(s.q1, s.k1, s.q2, s.k2, s.v, w, causal=causal, sm_scale=sm_scale)


class Sdpa(Provider):
    n_queries = 1

    def __init__(self, env, plain_mem_bytes, backend_name):
        super().__init__(env, plain_mem_bytes)
        from torch.nn.attention import SDPBackend
        self.backend = getattr(SDPBackend, backend_name)
        self.name = {"FLASH_ATTENTION": "sdpa_flash", "CUDNN_ATTENTION": "sdpa_cudnn",
                     "EFFICIENT_ATTENTION": "sdpa_efficient"}[backend_name]

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


@contextlib.contextmanager
def forced_path(capability, path):
    """Set CUPY_PIECEWISE_PATH=path for the block (the package reads it once at import and at
    capability.refresh_env_override()); the previous value, or its absence, is restored after."""
    var = getattr(capability, "PATH_VAR", "CUPY_PIECEWISE_PATH")
    old = os.environ.get(var)
    os.environ[var] = path
    capability.refresh_env_override()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = old
        capability.refresh_env_override()


class PiecewiseMma(Piecewise):
    """cupy_piecewise.attention with the mma.sync kernels forced (CUPY_PIECEWISE_PATH=mma) during
    each measurement (context()), forward and backward."""
    name = "piecewise_mma"
    path = "mma"

    def __init__(self, env, plain_mem_bytes):
        super().__init__(env, plain_mem_bytes)
        self._cap = None
        if self._err is None:
            try:
                from cupy_piecewise import capability
                if not hasattr(capability, "refresh_env_override"):
                    self._err = "error: cupy_piecewise.capability has no refresh_env_override (path cannot be forced)"
                else:
                    self._cap = capability
            except Exception as e:
                self._err = f"error: import cupy_piecewise.capability failed: {_err_text(e)}"

    def context(self):
        return forced_path(self._cap, self.path)


class PiecewiseMmaDeterministic(PiecewiseMma):
    """piecewise_mma with deterministic=True: the mma.sync two-kernel backward (dq and dk/dv
    kernels) everywhere, beside piecewise_mma's one-kernel backward where the table has it."""
    name = "piecewise_mma_det"

    def forward(self, s, w, causal, sm_scale):
        return self._mod.attention(s.q1, s.k1, s.q2, s.k2, s.v, w, causal=causal, sm_scale=sm_scale,
                                   deterministic=True)


class FlexComposite(Provider):
    """Two FlexAttention calls with block masks d < w (q1, k1) and d >= w (q2, k2) (and d >= 0 when
    causal), each returning its lse, merged by log-sum-exp; the whole function under torch.compile
    (static shapes, fullgraph). One compiled function per shape: on a new shape (or w, causal,
    dtype) torch._dynamo.reset() drops the previous one and the block masks are rebuilt, both
    in the untimed first call. Forward and forward+backward (autograd through the merge).

    ``compile=None``: compile on a GPU; on the CPU (dry run) the uncompiled (unfused, eager)
    flex_attention runs the forward, and the backward fails as torch's CPU flex has none.
    """
    name = "flex_composite"
    #: after this many shapes whose first call failed, and no success at all, the provider is
    #: reported unavailable instead of compiling again (a compile can take a minute)
    MAX_FAILED_SHAPES = 3

    def __init__(self, env, plain_mem_bytes, compile=None, backend="inductor"):
        super().__init__(env, plain_mem_bytes)
        self.backend = backend  # another torch.compile backend only for tests (aot_eager on CPU)
        why = flex_composite.flex_available()
        self._err = f"not installed (torch.nn.attention.flex_attention: {why[:200]})" if why else None
        self.compile = env.cuda if compile is None else compile
        self._key = None
        self._fn = None
        self._masks = None
        self._failed = {}     # (shape key, grad enabled) -> error of its first call: not compiled again
        self._n_ok = 0        # calls that returned
        self._fail_streak = 0  # shapes whose first call failed since the last success

    def unavailable(self):
        if self._err is None and self._n_ok == 0 and self._fail_streak >= self.MAX_FAILED_SHAPES:
            first = next(iter(self._failed.values()))
            return (f"error: disabled after its first call failed on {self._fail_streak} shapes "
                    f"(no call ever succeeded); first error: {first}")
        return self._err

    def _prepare(self, s, w, causal, sm_scale):
        q, k = s.q1, s.k1
        key = (tuple(q.shape), tuple(k.shape), q.dtype, str(q.device), w, bool(causal), sm_scale)
        if key == self._key:
            return
        self._key = self._fn = self._masks = None
        if self.compile:
            torch._dynamo.reset()  # previous shape's graphs: no recompile limit, no guard chain per call
        self._masks = flex_composite.block_masks(q.shape[-2], k.shape[-2], w, causal, q.device)
        self._fn = flex_composite.make_composite(sm_scale, compile=self.compile, backend=self.backend)
        self._key = key

    def forward(self, s, w, causal, sm_scale):
        if sm_scale is None:
            sm_scale = 1.0 / math.sqrt(s.q1.shape[-1])
        self._prepare(s, w, causal, sm_scale)
        t = (s.q1, s.k1, s.q2, s.k2, s.v)
        grad = torch.is_grad_enabled()
        if t[0].device.type == "cpu" and not grad:
            t = tuple(x.detach() for x in t)  # CPU flex refuses inputs that require grad
        fkey = (self._key, grad)
        if fkey in self._failed:
            raise RuntimeError(self._failed[fkey] + " [first call's error on this shape; not compiled again]")
        try:
            o = self._fn(*t, *self._masks)
        except Exception as e:
            if not any(k[0] == self._key for k in self._failed):
                self._fail_streak += 1
            self._failed[fkey] = _err_text(e)
            raise
        self._n_ok += 1
        self._fail_streak = 0
        return o


def make_providers(names, env, plain_mem_bytes):
    out = {}
    for n in names:
        if n == "piecewise":
            out[n] = Piecewise(env, plain_mem_bytes)
        elif n == "piecewise_mma":
            out[n] = PiecewiseMma(env, plain_mem_bytes)
        elif n == "piecewise_det":
            out[n] = PiecewiseDeterministic(env, plain_mem_bytes)
        elif n == "piecewise_mma_det":
            out[n] = PiecewiseMmaDeterministic(env, plain_mem_bytes)
        elif n == "flex_composite":
            out[n] = FlexComposite(env, plain_mem_bytes)
        elif n == "sdpa_flash":
            out[n] = Sdpa(env, plain_mem_bytes, "FLASH_ATTENTION")
        elif n == "sdpa_cudnn":
            out[n] = Sdpa(env, plain_mem_bytes, "CUDNN_ATTENTION")
        elif n == "sdpa_efficient":
            out[n] = Sdpa(env, plain_mem_bytes, "EFFICIENT_ATTENTION")
        elif n == "torch_plain":
            out[n] = TorchPlain(env, plain_mem_bytes)
        elif n == "flag_attn":
            out[n] = FlagAttn(env, plain_mem_bytes)
        else:
            raise SystemExit(f"unknown provider {n!r}; choose from {', '.join(PROVIDERS)}")
    return out

