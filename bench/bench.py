#!/usr/bin/env python3
"""Benchmark cupy_piecewise.attention against PyTorch SDPA and plain PyTorch.

One command on a GPU machine (see bench/README.md):

    PYTHONPATH=$PWD python3 bench/bench.py --out bench/results          # full sweep
    PYTHONPATH=$PWD python3 bench/bench.py --quick --out bench/results  # ~ a few minutes

On a machine without a GPU, ``--dry-run`` runs every code path with tiny sizes on CPU
tensors (timing with time.perf_counter instead of CUDA events).

Sections (``--sections``, all on by default):
  main    TFLOP/s per provider x phase over the default sweep (bench/README.md), plus a correctness spot check
  wsweep  sensitivity of our kernels to the distance threshold w
  decode  small-M shapes, effective GB/s against the measured device copy bandwidth
  memory  peak GPU memory of forward+backward, ours vs plain PyTorch (and SDPA flash)

Timing: warm-up, then repeats, MEDIAN in ms.  triton.testing.do_bench(return_mode='median')
when triton imports (it also flushes L2 before every repeat), else a CUDA-event loop.
Inputs smaller than 4x L2 are rotated among several input sets.

Phases:
  fwd      forward only, under torch.no_grad()
  bwd      backward alone: the forward graph is built once outside the timed region and
           torch.autograd.grad(o, inputs, do, retain_graph=True) is timed (no .grad
           accumulation kernels are timed)
  fwd_bwd  forward (with autograd) followed by torch.autograd.grad, timed together

FLOP convention (docs/semantics.md, as FlashAttention counts): forward 4*B*H*M*N*D, halved when causal
with M == N; backward 2.5x forward; forward+backward 3.5x forward.  Piecewise attention is
counted like standard attention, so TFLOP/s compare directly.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
import traceback
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:  # so `python3 bench/bench.py` finds cupy_piecewise without PYTHONPATH
    sys.path.insert(0, _ROOT)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

try:
    from tqdm import tqdm as _tqdm
except Exception:  # pragma: no cover - tqdm is optional
    _tqdm = None

PHASES = ("fwd", "bwd", "fwd_bwd")
PHASE_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
PHASE_LABEL = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward+backward"}
PROVIDERS = ("piecewise", "sdpa_flash", "sdpa_cudnn", "torch_plain", "flag_attn")
SECTIONS = ("main", "wsweep", "decode", "memory")
DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32,
}
DTYPE_NAME = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
REF_PROVIDERS = ("sdpa_flash", "sdpa_cudnn")


# ----------------------------------------------------------------------------- FLOPs / bytes
def attn_flops(B, H, M, N, D, causal, phase="fwd"):
    """FLOPs by the convention of docs/semantics.md (FlashAttention's count)."""
    f = 4.0 * B * H * M * N * D
    if causal and M == N:
        f /= 2.0
    return f * PHASE_FACTOR[phase]


def tflops_from_ms(flops, ms):
    if ms is None or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12


def decode_bytes(B, H, Hkv, M, N, D, elt_bytes, n_queries=2):
    """Fewest bytes a decode step must move: per key one of k1/k2 plus v, the queries, o."""
    return elt_bytes * (B * Hkv * N * D * 2 + B * H * M * D * (n_queries + 1))


def plain_mem_estimate(B, H, M, N):
    """Rough bytes plain PyTorch needs: B*H*M*N fp32 score-sized buffers, ~4 of them."""
    return B * H * M * N * 4 * 4


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


# ----------------------------------------------------------------------------- environment
class Env:
    def __init__(self, dry_run: bool):
        self.dry = dry_run
        self.cuda = (not dry_run) and torch.cuda.is_available()
        if not dry_run and not self.cuda:
            raise SystemExit("bench.py: no CUDA device visible; use --dry-run on a CPU machine")
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.broken = None  # set to a message once the CUDA context is unusable
        self.l2_bytes = 60 * 2**20
        if self.cuda:
            props = torch.cuda.get_device_properties(self.device)
            self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or self.l2_bytes)
        self.do_bench = None
        self.triton_version = None
        try:
            import triton
            self.triton_version = getattr(triton, "__version__", "?")
            if self.cuda:
                from triton.testing import do_bench
                self.do_bench = do_bench
        except Exception:
            pass

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def check_alive(self):
        """After an error: is the CUDA context still usable?  Sticky errors poison it."""
        if not self.cuda or self.broken:
            return self.broken is None
        try:
            torch.cuda.synchronize(self.device)
            x = torch.ones(4, device=self.device)
            float((x + 1).sum().item())
            return True
        except Exception as e:  # pragma: no cover - GPU only
            self.broken = f"CUDA context unusable: {type(e).__name__}: {str(e)[:200]}"
            return False

    def cleanup(self):
        gc.collect()
        if self.cuda and not self.broken:
            try:
                torch.cuda.empty_cache()
            except Exception:
                pass


class Timer:
    """Median time of fn() in ms."""

    def __init__(self, env: Env, warmup_ms: float, rep_ms: float, slow_s: float = 1.0):
        self.env = env
        self.warmup_ms = warmup_ms
        self.rep_ms = rep_ms
        self.slow_s = slow_s

    def describe(self):
        if not self.env.cuda:
            return f"time.perf_counter loop (dry run), median, warmup {self.warmup_ms} ms, rep {self.rep_ms} ms"
        if self.env.do_bench is not None:
            return (f"triton.testing.do_bench(warmup={self.warmup_ms}, rep={self.rep_ms}, "
                    f"return_mode='median'); own 3-repeat CUDA-event loop when one call > {self.slow_s} s")
        return f"CUDA-event loop, median, warmup {self.warmup_ms} ms, rep {self.rep_ms} ms"

    def __call__(self, fn):
        env = self.env
        # first call: compilation, autotuning, handle creation stay out of the numbers
        t0 = time.perf_counter()
        fn()
        env.sync()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        fn()
        env.sync()
        est = max(time.perf_counter() - t0, 1e-7)
        if not env.cuda:
            n_warm = int(self.warmup_ms * 1e-3 / est)
            n_rep = min(max(3, int(self.rep_ms * 1e-3 / est)), 200)
            for _ in range(n_warm):
                fn()
            ts = []
            for _ in range(n_rep):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(ts), {"reps": n_rep, "first_call_s": first}
        if est > self.slow_s:
            return self._event_loop(fn, 0, 3), {"reps": 3, "first_call_s": first, "slow": True}
        if env.do_bench is not None:
            try:
                ms = env.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median")
                return float(ms), {"first_call_s": first, "timer": "do_bench"}
            except TypeError:  # an incompatible do_bench signature: fall back to our own loop
                env.do_bench = None
        n_warm = max(1, int(self.warmup_ms * 1e-3 / est))
        n_rep = min(max(5, int(self.rep_ms * 1e-3 / est)), 1000)
        return self._event_loop(fn, n_warm, n_rep), {"reps": n_rep, "first_call_s": first}

    def _event_loop(self, fn, n_warm, n_rep):
        for _ in range(n_warm):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
        for i in range(n_rep):
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


# ----------------------------------------------------------------------------- inputs
class InputSet:
    def __init__(self, B, H, Hkv, M, N, D, dtype, device, requires_grad, gen):
        def r(*shape):
            t = torch.randn(*shape, dtype=torch.float32, device=device, generator=gen).to(dtype)
            return t.requires_grad_(requires_grad)
        self.q1 = r(B, H, M, D)
        self.k1 = r(B, Hkv, N, D)
        self.q2 = r(B, H, M, D)
        self.k2 = r(B, Hkv, N, D)
        self.v = r(B, Hkv, N, D)
        self.do = torch.randn(B, H, M, D, dtype=torch.float32, device=device, generator=gen).to(dtype)

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in (self.q1, self.k1, self.q2, self.k2, self.v))


def n_sets_for(bytes_per_set, l2_bytes, max_sets=8):
    """Rotate among >= 2 input sets when one set is smaller than 4x L2."""
    if bytes_per_set >= 4 * l2_bytes:
        return 1
    return int(min(max_sets, max(2, math.ceil(4 * l2_bytes / max(bytes_per_set, 1)))))


def make_sets(shape, dtype, env, requires_grad=True, seed=0):
    B, H, Hkv, M, N, D = shape
    gen = torch.Generator(device=env.device)
    gen.manual_seed(seed)
    first = InputSet(B, H, Hkv, M, N, D, dtype, env.device, requires_grad, gen)
    n = n_sets_for(first.nbytes(), env.l2_bytes)
    return [first] + [InputSet(B, H, Hkv, M, N, D, dtype, env.device, requires_grad, gen) for _ in range(n - 1)]


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


# ----------------------------------------------------------------------------- measuring
def _err_text(e):
    msg = f"{type(e).__name__}: {e}"
    msg = " ".join(msg.split())
    return msg[:600]


def _status_of(msg):
    if msg.startswith("not installed"):
        return "not installed"
    if msg.startswith("skipped"):
        return "skipped"
    return "error"


def time_phase(prov, sets, phase, w, causal, sm_scale, timer):
    """Median ms of one provider/phase over rotating input sets."""
    idx = [0]
    n = len(sets)
    if phase == "fwd":
        def fn():
            s = sets[idx[0] % n]
            idx[0] += 1
            with torch.no_grad():
                return prov.forward(s, w, causal, sm_scale)
        return timer(fn)
    if phase == "fwd_bwd":
        def fn():
            s = sets[idx[0] % n]
            idx[0] += 1
            o = prov.forward(s, w, causal, sm_scale)
            return torch.autograd.grad(o, prov.grad_inputs(s), s.do)
        return timer(fn)
    if phase == "bwd":
        outs = [prov.forward(s, w, causal, sm_scale) for s in sets]

        def fn():
            i = idx[0] % n
            idx[0] += 1
            return torch.autograd.grad(outs[i], prov.grad_inputs(sets[i]), sets[i].do, retain_graph=True)
        try:
            return timer(fn)
        finally:
            del outs
    raise ValueError(phase)


def measure(prov, sets, phase, w, causal, sm_scale, timer, env):
    """Returns dict(status, ms, error, meta) and never raises for provider failures."""
    rec = {"status": "ok", "ms": None, "error": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with prov.context():
                ms, meta = time_phase(prov, sets, phase, w, causal, sm_scale, timer)
            rec["ms"] = ms
            rec["timer_meta"] = meta
        except Exception as e:
            rec["status"] = "error"
            msg = _err_text(e)
            warn = "; ".join(" ".join(str(c.message).split())[:200] for c in caught[:4])
            rec["error"] = msg + (f" [warnings: {warn}]" if warn else "")
            env.cleanup()
            env.check_alive()
    return rec


# ----------------------------------------------------------------------------- runner
class Runner:
    def __init__(self, args, env):
        self.args = args
        self.env = env
        self.timer = Timer(env, args.warmup_ms, args.rep_ms)
        self.providers = make_providers(args.providers, env, args.plain_mem_gb * 1e9)
        self.t_start = time.perf_counter()
        self.results = {
            "header": self._header(),
            "main": [], "spot_checks": [], "w_sweep": [], "w_sweep_summary": [],
            "decode": [], "copy_bandwidth": None, "memory": [], "plots": [], "notes": [],
        }
        os.makedirs(args.out, exist_ok=True)
        self.log_path = os.path.join(args.out, "bench.log")
        self._log = open(self.log_path, "w")
        self._seen_errors = set()
        self._section = None

    # -- bookkeeping
    def _header(self):
        a = self.args
        env = self.env
        h = {
            "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "gpu": torch.cuda.get_device_name(env.device) if env.cuda else "none (dry run on CPU)",
            "torch": torch.__version__,
            "cupy": _version_of("cupy"),
            "triton": env.triton_version,
            "numpy": _version_of("numpy"),
            "cuda_runtime": torch.version.cuda,
            "python": platform.python_version(),
            "host": platform.node(),
            "command": "python3 " + " ".join(shlex.quote(x) for x in sys.argv),
            "dry_run": a.dry_run,
            "quick": a.quick,
            "timer": self.timer.describe(),
            "l2_bytes": env.l2_bytes,
            "phases_note": "fwd under torch.no_grad(); bwd = torch.autograd.grad(..., retain_graph=True) alone, "
                           "forward graph built outside the timed region; fwd_bwd = forward + autograd.grad",
            "flop_convention": "fwd 4*B*H*M*N*D (x0.5 when causal and M == N); bwd 2.5x fwd; fwd_bwd 3.5x fwd",
            "git_commit": _git_commit(),
        }
        if env.cuda:
            p = torch.cuda.get_device_properties(env.device)
            h["gpu_props"] = {"sm_count": p.multi_processor_count, "total_memory_bytes": p.total_memory,
                              "capability": f"{p.major}.{p.minor}"}
        return h

    def log(self, msg, echo=False):
        self._log.write(msg + "\n")
        self._log.flush()
        if echo:
            _write(msg)

    def _echo_error(self, prov, where, err):
        """Print each distinct (provider, message) once to stderr; bench.log has them all."""
        key = (prov, err[:120])
        if key not in self._seen_errors:
            self._seen_errors.add(key)
            _write(f"  ! {prov} {where}: {err[:240]}")

    def over_budget(self):
        b = self.args.budget_s
        if not b:
            return False
        if self._section == "main":  # leave time for the (short) extra sections that follow
            b -= 60.0 * sum(1 for s in self.args.sections if s != "main")
        return (time.perf_counter() - self.t_start) > b

    def save(self, render=False, plots=False):
        annotate_ratios(self.results["main"])
        self.results["header"]["elapsed_s"] = round(time.perf_counter() - self.t_start, 1)
        path = os.path.join(self.args.out, "results.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.results, f, indent=1, default=str)
        os.replace(tmp, path)
        if plots:
            self.results["plots"] = make_plots(self.results, self.args.out)
            with open(tmp, "w") as f:
                json.dump(self.results, f, indent=1, default=str)
            os.replace(tmp, path)
        if render:
            with open(os.path.join(self.args.out, "results.md"), "w") as f:
                f.write(render_markdown(self.results))

    def _skip_all_msg(self):
        if self.env.broken:
            return "skipped: " + self.env.broken
        if self.over_budget():
            return f"skipped: time budget ({self.args.budget_s} s) spent"
        return None

    # -- main sweep
    def main_shapes(self):
        a = self.args
        shapes = []
        for dtype in a.dtypes:
            for D in a.dims:
                for causal in a.causal:
                    for L in a.lengths:
                        B = max(1, a.tokens // L)
                        H = max(1, a.head_total // D)
                        shapes.append((dtype, causal, (B, H, H, L, L, D), L // 4))
        return shapes

    def run_main(self):
        a = self.args
        shapes = self.main_shapes()
        provs = list(self.providers.values())
        # SDPA first: if ours poisons the CUDA context, the references of that shape survive
        provs.sort(key=lambda p: {"sdpa_flash": 0, "sdpa_cudnn": 1, "torch_plain": 2, "flag_attn": 3}.get(p.name, 4))
        total = len(shapes) * len(provs) * len(a.phases)
        bar = _progress(total, "main")
        for dtype_name, causal, shape, w in shapes:
            dtype = DTYPES[dtype_name]
            B, H, Hkv, M, N, D = shape
            sm = 1.0 / math.sqrt(D)
            tag = f"{dtype_name} D={D} causal={causal} L={N} B={B} H={H}"
            base = {"dtype": dtype_name, "B": B, "H": H, "Hkv": Hkv, "M": M, "N": N, "D": D,
                    "L": N, "causal": causal, "w": w}
            sets = None
            try:
                if not self._skip_all_msg():
                    sets = make_sets(shape, dtype, self.env, requires_grad=True, seed=N * 7 + D)
            except Exception as e:
                self.log(f"[main] {tag}: input allocation failed: {_err_text(e)}", echo=True)
                self.env.cleanup()
                self.env.check_alive()
                sets = None
                alloc_err = "error: input allocation failed: " + _err_text(e)
            else:
                alloc_err = None
            for prov in provs:
                for phase in a.phases:
                    bar.set_postfix_str(f"{tag} {prov.name} {phase}")
                    rec = dict(base, provider=prov.name, phase=phase,
                               flops=attn_flops(B, H, M, N, D, causal, phase),
                               n_input_sets=len(sets) if sets else 0)
                    reason = (prov.unavailable() or self._skip_all_msg() or alloc_err
                              or prov.skip_reason(shape, causal))
                    if reason:
                        rec.update(status=_status_of(reason), ms=None, error=reason)
                    else:
                        rec.update(measure(prov, sets, phase, w, causal, sm, self.timer, self.env))
                    rec["tflops"] = tflops_from_ms(rec["flops"], rec["ms"])
                    self.results["main"].append(rec)
                    self.log(f"[main] {tag} {prov.name:11s} {phase:7s} {rec['status']:8s} "
                             f"ms={_f(rec['ms'], 4)} TFLOP/s={_f(rec['tflops'], 1)} {rec['error'] or ''}")
                    if rec["status"] == "error":
                        self._echo_error(prov.name, f"{tag} {phase}", rec["error"])
                    bar.update(1)
            if sets is not None and "piecewise" in self.providers and not self._skip_all_msg():
                self.results["spot_checks"].append(self.spot_check(sets[0], dtype_name, causal, shape, w))
            del sets
            self.env.cleanup()
            self.save()
        bar.close()
        self.save(render=True, plots=not (a.no_plots or a.dry_run))

    def spot_check(self, s, dtype_name, causal, shape, w):
        """Ours vs SDPA with w = N (piecewise == standard attention on q1, k1), and ours vs a
        float32 plain implementation at the benchmark's w on a small slice."""
        B, H, Hkv, M, N, D = shape
        sm = 1.0 / math.sqrt(D)
        rec = {"dtype": dtype_name, "B": B, "H": H, "M": M, "N": N, "D": D, "L": N, "causal": causal,
               "w_std": N, "w": w}
        prov = self.providers["piecewise"]
        if prov.unavailable():
            rec.update(status="skipped", error=prov.unavailable())
            return rec
        try:
            with torch.no_grad():
                ours = prov.forward(s, N, causal, sm)
                ref = None
                for name in ("sdpa_flash", "sdpa_cudnn", None):
                    try:
                        if name is None:
                            ref = F.scaled_dot_product_attention(s.q1, s.k1, s.v, is_causal=causal, scale=sm)
                            rec["reference"] = "sdpa (default backend)"
                        else:
                            with Sdpa(self.env, 0, {"sdpa_flash": "FLASH_ATTENTION",
                                                    "sdpa_cudnn": "CUDNN_ATTENTION"}[name]).context():
                                ref = F.scaled_dot_product_attention(s.q1, s.k1, s.v, is_causal=causal, scale=sm)
                            rec["reference"] = name
                        break
                    except Exception:
                        continue
                rec["max_abs_diff_vs_sdpa"] = float((ours.float() - ref.float()).abs().max().item())
                rec["ref_max_abs"] = float(ref.float().abs().max().item())
                del ours, ref
                # piecewise region itself: small slice against float32 plain PyTorch
                h = max(1, min(H, 4, (2**28) // max(1, M * N)))
                sl = _Slice(s, h)
                ours = prov.forward(sl, w, causal, sm)
                ref = plain_piecewise(sl.q1, sl.k1, sl.q2, sl.k2, sl.v, w, causal, sm, upcast=True)
                rec["max_abs_diff_vs_plain_fp32"] = float((ours.float() - ref).abs().max().item())
                rec["plain_slice_heads"] = h
                del ours, ref
            rec["status"] = "ok"
        except Exception as e:
            rec.update(status="error", error=_err_text(e))
            self.env.cleanup()
            self.env.check_alive()
        self.log(f"[check] {dtype_name} D={D} causal={causal} L={N}: {rec}")
        return rec

    # -- w sweep
    def run_wsweep(self):
        a = self.args
        prov = self.providers.get("piecewise")
        if prov is None:
            self.results["notes"].append("w sweep skipped: provider 'piecewise' not selected")
            return
        if a.dry_run:
            L, D, dtype_name, ws = 64, 32, a.dtypes[0], [0, 8, 16, 64]
        else:
            L, D, dtype_name = 8192, 128, "bfloat16"
            ws = [0, 64, L // 4, L]
        causals = a.causal
        phases = [p for p in a.phases if (not a.quick or p != "bwd")] or list(a.phases)
        B = max(1, a.tokens // L)
        H = max(1, a.head_total // D)
        shape = (B, H, H, L, L, D)
        sm = 1.0 / math.sqrt(D)
        bar = _progress(len(causals) * len(phases) * len(ws), "w sweep")
        sets = None
        alloc_err = None
        try:
            if not self._skip_all_msg():
                sets = make_sets(shape, DTYPES[dtype_name], self.env, requires_grad=True, seed=11)
        except Exception as e:
            alloc_err = "error: input allocation failed: " + _err_text(e)
            self.env.cleanup()
        for causal in causals:
            for phase in phases:
                for w in ws:
                    rec = {"provider": prov.name, "dtype": dtype_name, "B": B, "H": H, "M": L, "N": L, "D": D,
                           "L": L, "causal": causal, "w": w, "phase": phase,
                           "flops": attn_flops(B, H, L, L, D, causal, phase)}
                    reason = prov.unavailable() or self._skip_all_msg() or alloc_err
                    if reason:
                        rec.update(status=_status_of(reason), ms=None, error=reason)
                    else:
                        rec.update(measure(prov, sets, phase, w, causal, sm, self.timer, self.env))
                    rec["tflops"] = tflops_from_ms(rec["flops"], rec["ms"])
                    self.results["w_sweep"].append(rec)
                    self.log(f"[wsweep] causal={causal} {phase} w={w}: {rec['status']} ms={_f(rec['ms'], 4)} "
                             f"{rec['error'] or ''}")
                    bar.update(1)
                ok = [r["ms"] for r in self.results["w_sweep"]
                      if r["causal"] == causal and r["phase"] == phase and r["status"] == "ok"]
                summ = {"causal": causal, "phase": phase, "L": L, "D": D, "dtype": dtype_name, "n": len(ok),
                        "mean_ms": None, "max_dev_pct": None}
                if ok:
                    mean = statistics.fmean(ok)
                    summ["mean_ms"] = mean
                    summ["max_dev_pct"] = max(abs(x - mean) for x in ok) / mean * 100.0
                self.results["w_sweep_summary"].append(summ)
        bar.close()
        del sets
        self.env.cleanup()
        self.save(render=True)

    # -- decode
    def measure_copy_bandwidth(self):
        nbytes = (8 << 20) if self.args.dry_run else (2 << 30)
        rec = {"bytes_per_buffer": nbytes}
        try:
            src = torch.randn(nbytes // 2, device=self.env.device, dtype=torch.float32).to(torch.bfloat16)
            bufs = [src, torch.empty_like(src)]
            del src
            ms, _ = self.timer(lambda: bufs[1].copy_(bufs[0]))
            rec.update(status="ok", ms=ms, gbps=2 * nbytes / (ms * 1e-3) / 1e9,
                       method="dst.copy_(src), (read + write bytes) / median time")
            bufs.clear()
        except Exception as e:
            rec.update(status="error", ms=None, gbps=None, error=_err_text(e))
        self.env.cleanup()
        return rec

    def run_decode(self):
        a = self.args
        if self._skip_all_msg():
            self.results["notes"].append("decode " + self._skip_all_msg())
            return
        self.results["copy_bandwidth"] = cb = self.measure_copy_bandwidth()
        copy_gbps = cb.get("gbps")
        if a.dry_run:
            Ms, Ns, BHs, D = [1, 4], [64, 256], [2], 32
        elif a.quick:
            Ms, Ns, BHs, D = [1, 16], [4096, 131072], [32, 256], 128
        else:
            Ms, Ns, BHs, D = [1, 16], [4096, 32768, 131072], [32, 256], 128
        dtype_name = "bfloat16" if "bfloat16" in a.dtypes or not a.dry_run else a.dtypes[0]
        dtype = DTYPES[dtype_name]
        provs = [p for p in self.providers.values()]
        cases = [(M, N, BH) for BH in BHs for N in Ns for M in Ms]
        bar = _progress(len(cases) * len(provs), "decode")
        sm = 1.0 / math.sqrt(D)
        for M, N, BH in cases:
            B, H = 1, BH
            shape = (B, H, H, M, N, D)
            w = N // 4
            sets = None
            alloc_err = None
            try:
                if not self._skip_all_msg():
                    sets = make_sets(shape, dtype, self.env, requires_grad=False, seed=N + M + BH)
            except Exception as e:
                alloc_err = "error: input allocation failed: " + _err_text(e)
                self.env.cleanup()
            for prov in provs:
                nbytes = decode_bytes(B, H, H, M, N, D, torch.empty((), dtype=dtype).element_size(), prov.n_queries)
                rec = {"provider": prov.name, "dtype": dtype_name, "B": B, "H": H, "M": M, "N": N, "D": D,
                       "causal": False, "w": w, "phase": "fwd", "bytes": nbytes,
                       "n_input_sets": len(sets) if sets else 0}
                reason = (prov.unavailable() or self._skip_all_msg() or alloc_err
                          or prov.skip_reason(shape, False))
                if reason:
                    rec.update(status=_status_of(reason), ms=None, error=reason)
                else:
                    rec.update(measure(prov, sets, "fwd", w, False, sm, self.timer, self.env))
                rec["gbps"] = (nbytes / (rec["ms"] * 1e-3) / 1e9) if rec["ms"] else None
                rec["pct_of_copy_bw"] = (100.0 * rec["gbps"] / copy_gbps) if (rec["gbps"] and copy_gbps) else None
                rec["tflops"] = tflops_from_ms(attn_flops(B, H, M, N, D, False), rec["ms"])
                self.results["decode"].append(rec)
                self.log(f"[decode] M={M} N={N} BH={BH} {prov.name}: {rec['status']} ms={_f(rec['ms'], 4)} "
                         f"GB/s={_f(rec['gbps'], 0)} {rec['error'] or ''}")
                bar.update(1)
            del sets
            self.env.cleanup()
        bar.close()
        self.save(render=True)

    # -- memory
    def run_memory(self):
        a = self.args
        if a.dry_run:
            Ls, D = [32, 64], 16
        elif a.quick:
            Ls, D = [2048, 4096], 128
        else:
            Ls, D = [1024, 2048, 4096, 8192], 128
        dtype_name = a.dtypes[0] if a.dry_run else "bfloat16"
        dtype = DTYPES[dtype_name]
        names = [n for n in ("piecewise", "torch_plain", "sdpa_flash") if n in self.providers]
        bar = _progress(len(Ls) * len(names), "memory")
        for L in Ls:
            B = max(1, a.tokens // L)
            H = max(1, a.head_total // D)
            shape = (B, H, H, L, L, D)
            w = L // 4
            sm = 1.0 / math.sqrt(D)
            for name in names:
                prov = self.providers[name]
                rec = {"provider": name, "dtype": dtype_name, "B": B, "H": H, "M": L, "N": L, "D": D, "L": L,
                       "causal": False, "w": w, "phase": "fwd_bwd"}
                reason = prov.unavailable() or self._skip_all_msg() or prov.skip_reason(shape, False)
                if reason:
                    rec.update(status=_status_of(reason), error=reason)
                else:
                    rec.update(self._peak_memory(prov, shape, dtype, w, sm))
                self.results["memory"].append(rec)
                self.log(f"[memory] L={L} {name}: {rec}")
                bar.update(1)
        bar.close()
        self.save(render=True)

    def _peak_memory(self, prov, shape, dtype, w, sm):
        env = self.env
        rec = {}
        s = None
        try:
            env.cleanup()
            gen = torch.Generator(device=env.device)
            gen.manual_seed(5)
            s = InputSet(*shape, dtype, env.device, True, gen)
            with prov.context():
                # warm call (compilation, workspaces), then the measured one
                o = prov.forward(s, w, False, sm)
                g = torch.autograd.grad(o, prov.grad_inputs(s), s.do)
                del o, g
                env.sync()
                if env.cuda:
                    torch.cuda.empty_cache()
                    base = torch.cuda.memory_allocated(env.device)
                    torch.cuda.reset_peak_memory_stats(env.device)
                o = prov.forward(s, w, False, sm)
                g = torch.autograd.grad(o, prov.grad_inputs(s), s.do)
                env.sync()
                del o, g
            inputs = s.nbytes() + s.do.numel() * s.do.element_size()
            if env.cuda:
                peak = torch.cuda.max_memory_allocated(env.device)
                rec.update(status="ok", peak_bytes=peak, inputs_bytes=inputs, base_bytes=base,
                           extra_bytes=peak - base)
            else:
                rec.update(status="ok", peak_bytes=None, inputs_bytes=inputs, base_bytes=None, extra_bytes=None,
                           note="dry run: no CUDA memory statistics on CPU")
        except Exception as e:
            rec.update(status="error", error=_err_text(e))
        finally:
            del s
            env.cleanup()
            env.check_alive()
        return rec


class _Slice:
    """First batch and first h heads of an InputSet (strided views, no copy)."""

    def __init__(self, s, h):
        for n in ("q1", "k1", "q2", "k2", "v"):
            setattr(self, n, getattr(s, n).detach()[:1, :h])


# ----------------------------------------------------------------------------- reporting
def annotate_ratios(rows):
    """ratio_vs_<ref> = tflops / tflops(ref) on the same shape and phase (> 1: faster than ref)."""
    def key(r):
        return (r["dtype"], r["B"], r["H"], r["M"], r["N"], r["D"], r["causal"], r["phase"])
    ref = {}
    for r in rows:
        if r["provider"] in REF_PROVIDERS and r.get("status") == "ok" and r.get("ms"):
            ref[(r["provider"],) + key(r)] = r["ms"]
    for r in rows:
        for p in REF_PROVIDERS:
            m = ref.get((p,) + key(r))
            r[f"ratio_vs_{p}"] = (m / r["ms"]) if (m and r.get("status") == "ok" and r.get("ms")) else None


def _f(x, nd=1):
    if x is None:
        return "-"
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return str(x)
    return f"{x:.{nd}f}"


def _cell(r, value_key="tflops", nd=1):
    if r is None:
        return ""
    st = r.get("status")
    if st == "ok":
        x = r.get(value_key)
        if x is not None and 0 < abs(x) < 10 ** -nd * 10:  # tiny dry-run numbers: keep 2 significant digits
            return f"{x:.2g}"
        return _f(x, nd)
    err = r.get("error") or ""
    if st == "not installed":
        return "n/i"
    if st == "skipped":
        if "memory" in err:
            return "skip:mem"
        if "budget" in err:
            return "skip:time"
        return "skip"
    return "err"


def _table(headers, rows):
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    for row in rows:
        out.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(out)


def _configs(rows):
    seen = []
    for r in rows:
        k = (r["dtype"], r["D"], r["causal"])
        if k not in seen:
            seen.append(k)
    return seen


def render_summary(res):
    """Compact table: one line per shape (what the lead reads at the end of stdout)."""
    rows = res["main"]
    idx = {(r["dtype"], r["D"], r["causal"], r["L"], r["provider"], r["phase"]): r for r in rows}
    shapes = []
    for r in rows:
        k = (r["dtype"], r["D"], r["causal"], r["L"])
        if k not in shapes:
            shapes.append(k)
    if not shapes:
        return "(no main-sweep measurements)"
    hdr = ["dtype", "D", "causal", "L", "ours fwd", "ours bwd", "ours f+b", "flash fwd", "flash f+b",
           "cudnn fwd", "cudnn f+b", "ours/flash fwd", "ours/flash f+b", "ours/cudnn fwd", "ours/cudnn f+b"]
    out = []
    for (dt, D, c, L) in shapes:
        g = lambda p, ph: idx.get((dt, D, c, L, p, ph))  # noqa: E731
        ours_f, ours_fb = g("piecewise", "fwd"), g("piecewise", "fwd_bwd")
        out.append([dt, D, "yes" if c else "no", L,
                    _cell(ours_f), _cell(g("piecewise", "bwd")), _cell(ours_fb),
                    _cell(g("sdpa_flash", "fwd")), _cell(g("sdpa_flash", "fwd_bwd")),
                    _cell(g("sdpa_cudnn", "fwd")), _cell(g("sdpa_cudnn", "fwd_bwd")),
                    _f((ours_f or {}).get("ratio_vs_sdpa_flash"), 2),
                    _f((ours_fb or {}).get("ratio_vs_sdpa_flash"), 2),
                    _f((ours_f or {}).get("ratio_vs_sdpa_cudnn"), 2),
                    _f((ours_fb or {}).get("ratio_vs_sdpa_cudnn"), 2)])
    return _table(hdr, out)


def render_wsweep(res):
    if not res["w_sweep"]:
        return "(w sweep not run)"
    r0 = res["w_sweep"][0]
    ws = []
    for r in res["w_sweep"]:
        if r["w"] not in ws:
            ws.append(r["w"])
    hdr = ["causal", "phase"] + [f"w={w} ms (TFLOP/s)" for w in ws] + ["mean ms", "max dev from mean %"]
    out = []
    for s in res["w_sweep_summary"]:
        cells = []
        for w in ws:
            r = next((x for x in res["w_sweep"] if x["w"] == w and x["causal"] == s["causal"]
                      and x["phase"] == s["phase"]), None)
            cells.append(f"{_f(r['ms'], 3)} ({_f(r['tflops'], 1)})" if r and r["status"] == "ok" else _cell(r))
        out.append(["yes" if s["causal"] else "no", s["phase"]] + cells + [_f(s["mean_ms"], 3), _f(s["max_dev_pct"], 1)])
    title = (f"piecewise, {r0['dtype']}, L={r0['L']}, D={r0['D']}, B={r0['B']}, H={r0['H']}; "
             f"max deviation = max over w of |ms - mean| / mean")
    return title + "\n\n" + _table(hdr, out)


def render_decode(res):
    if not res["decode"]:
        return "(decode section not run)"
    cb = res.get("copy_bandwidth") or {}
    provs = []
    for r in res["decode"]:
        if r["provider"] not in provs:
            provs.append(r["provider"])
    idx = {(r["M"], r["N"], r["H"], r["provider"]): r for r in res["decode"]}
    cases = []
    for r in res["decode"]:
        k = (r["M"], r["N"], r["H"])
        if k not in cases:
            cases.append(k)
    hdr = ["M", "N", "B*H"] + [f"{p} GB/s (% copy)" for p in provs] + ["ours us"]
    out = []
    for (M, N, BH) in cases:
        cells = []
        for p in provs:
            r = idx.get((M, N, BH, p))
            if r and r["status"] == "ok":
                pct = f" ({_f(r['pct_of_copy_bw'], 0)}%)" if r.get("pct_of_copy_bw") is not None else ""
                cells.append(_f(r["gbps"], 0) + pct)
            else:
                cells.append(_cell(r))
        ours = idx.get((M, N, BH, "piecewise"))
        us = _f(ours["ms"] * 1e3, 1) if ours and ours.get("ms") else "-"
        out.append([M, N, BH] + cells + [us])
    d0 = res["decode"][0]
    head = (f"{d0['dtype']}, D={d0['D']}, B=1, not causal, w=N/4; bytes = (one of k1/k2 + v) per key + queries + o; "
            f"device copy bandwidth {_f(cb.get('gbps'), 0)} GB/s ({cb.get('method', cb.get('error', ''))})")
    return head + "\n\n" + _table(hdr, out)


def render_memory(res):
    if not res["memory"]:
        return "(memory section not run)"
    provs = []
    for r in res["memory"]:
        if r["provider"] not in provs:
            provs.append(r["provider"])
    Ls = []
    for r in res["memory"]:
        if r["L"] not in Ls:
            Ls.append(r["L"])
    idx = {(r["L"], r["provider"]): r for r in res["memory"]}
    hdr = ["L", "B", "H"] + [f"{p} peak GB (extra GB)" for p in provs]
    out = []
    for L in Ls:
        any_r = next(r for r in res["memory"] if r["L"] == L)
        cells = []
        for p in provs:
            r = idx.get((L, p))
            if r and r["status"] == "ok" and r.get("peak_bytes") is not None:
                cells.append(f"{r['peak_bytes'] / 1e9:.2f} ({r['extra_bytes'] / 1e9:.2f})")
            elif r and r["status"] == "ok":
                cells.append("n/a (cpu)")
            else:
                cells.append(_cell(r))
        out.append([L, any_r["B"], any_r["H"]] + cells)
    r0 = res["memory"][0]
    head = (f"forward+backward, {r0['dtype']}, D={r0['D']}, not causal, w=L/4. peak = "
            f"torch.cuda.max_memory_allocated after reset_peak_memory_stats (inputs and do included); "
            f"extra = peak minus memory allocated before the call")
    return head + "\n\n" + _table(hdr, out)


def render_main_detail(res):
    rows = res["main"]
    if not rows:
        return "(main sweep not run)"
    provs = sorted({r["provider"] for r in rows}, key=lambda p: PROVIDERS.index(p) if p in PROVIDERS else 99)
    idx = {(r["dtype"], r["D"], r["causal"], r["L"], r["provider"], r["phase"]): r for r in rows}
    parts = []
    for (dt, D, c) in _configs(rows):
        Ls, phases = [], []
        for r in rows:
            if (r["dtype"], r["D"], r["causal"]) == (dt, D, c):
                if r["L"] not in Ls:
                    Ls.append(r["L"])
                if r["phase"] not in phases:
                    phases.append(r["phase"])
        hdr = ["L", "B x H", "phase"] + provs + ["ours/flash", "ours/cudnn", "ours ms"]
        out = []
        for L in Ls:
            for ph in phases:
                cells = [_cell(idx.get((dt, D, c, L, p, ph))) for p in provs]
                ours = idx.get((dt, D, c, L, "piecewise", ph)) or {}
                any_r = next(r for r in rows if (r["dtype"], r["D"], r["causal"], r["L"]) == (dt, D, c, L))
                out.append([L, f"{any_r['B']} x {any_r['H']}", ph] + cells +
                           [_f(ours.get("ratio_vs_sdpa_flash"), 2), _f(ours.get("ratio_vs_sdpa_cudnn"), 2),
                            _f(ours.get("ms"), 3)])
        parts.append(f"#### {dt}, D={D}, {'causal' if c else 'not causal'} (TFLOP/s; w = L/4)\n\n" + _table(hdr, out))
    return "\n\n".join(parts)


def render_checks(res):
    if not res["spot_checks"]:
        return "(no spot checks)"
    hdr = ["dtype", "D", "causal", "L", "max|ours - sdpa| (w=N)", "reference", "max|ref|",
           "max|ours - fp32 plain| (w=L/4, slice)", "status"]
    out = []
    for r in res["spot_checks"]:
        out.append([r["dtype"], r["D"], "yes" if r["causal"] else "no", r["L"],
                    _f(r.get("max_abs_diff_vs_sdpa"), 5), r.get("reference", "-"), _f(r.get("ref_max_abs"), 3),
                    _f(r.get("max_abs_diff_vs_plain_fp32"), 5),
                    r["status"] + (f": {r['error'][:80]}" if r.get("error") else "")])
    return _table(hdr, out)


def render_errors(res):
    msgs = {}
    for sec in ("main", "w_sweep", "decode", "memory", "spot_checks"):
        for r in res.get(sec) or []:
            if r.get("status") in ("error", "skipped", "not installed") and r.get("error"):
                k = (sec, r.get("provider", "piecewise"), r["error"][:300])
                msgs[k] = msgs.get(k, 0) + 1
    if not msgs:
        return "none"
    return "\n".join(f"- [{sec}] {p} (x{n}): {m}" for (sec, p, m), n in msgs.items())


def render_header(res):
    h = res["header"]
    return "\n".join([
        f"- date: {h['date_utc']}",
        f"- GPU: {h['gpu']}",
        f"- torch {h['torch']}, cupy {h['cupy']}, triton {h['triton']}, numpy {h['numpy']}, CUDA {h['cuda_runtime']}",
        f"- command: `{h['command']}`",
        f"- git commit: {h.get('git_commit')}",
        f"- timer: {h['timer']}",
        f"- phases: {h['phases_note']}",
        f"- FLOPs: {h['flop_convention']}",
        f"- elapsed: {h.get('elapsed_s')} s" + ("  **DRY RUN: tiny CPU sizes, numbers mean nothing**" if h["dry_run"] else ""),
    ])


LEGEND = ("Cells: TFLOP/s (effective, FlashAttention's FLOP count). `n/i` not installed, `skip:mem` plain PyTorch would "
          "need too much memory, `skip:time` time budget spent, `err` the provider failed (see Errors). "
          "ours/flash, ours/cudnn = time of SDPA / time of ours on the same shape and phase (> 1: ours faster).")


def render_markdown(res):
    return "\n\n".join([
        "# cupy-piecewise benchmark results",
        render_header(res),
        LEGEND,
        "## Summary (TFLOP/s)",
        render_summary(res),
        "## Main sweep, all providers",
        render_main_detail(res),
        "## Spot checks",
        render_checks(res),
        "## w sweep",
        render_wsweep(res),
        "## Decode",
        render_decode(res),
        "## Peak memory",
        render_memory(res),
        "## Plots",
        "\n".join(f"- {os.path.basename(p)}" for p in res.get("plots") or []) or "(none)",
        "## Errors and skips",
        render_errors(res),
        "## Notes",
        "\n".join(f"- {n}" for n in res.get("notes") or []) or "none",
    ]) + "\n"


def render_checks_line(res):
    cs = res.get("spot_checks") or []
    ok = [c for c in cs if c.get("status") == "ok"]
    if not cs:
        return "spot checks: none"
    line = f"spot checks: {len(ok)}/{len(cs)} ran"
    for key, label in (("max_abs_diff_vs_sdpa", "max|ours - sdpa| (w=N)"),
                       ("max_abs_diff_vs_plain_fp32", "max|ours - fp32 plain| (w=L/4)")):
        vals = [c for c in ok if c.get(key) is not None]
        if vals:
            worst = max(vals, key=lambda c: c[key])
            line += (f"; {label} = {worst[key]:.3g} at {worst['dtype']} D={worst['D']} "
                     f"causal={worst['causal']} L={worst['L']}")
    bad = [c for c in cs if c.get("status") != "ok"]
    if bad:
        line += f"; not run: {bad[0].get('error', '')[:160]}"
    return line


def render_stdout(res, out_dir):
    """Most important last: the caller reads the tail of stdout."""
    h = res["header"]
    return "\n\n".join([
        "Errors and skips:",
        render_errors(res)[:2500],
        "w sweep:",
        render_wsweep(res),
        "Decode:",
        render_decode(res),
        "Peak memory:",
        render_memory(res),
        f"=== cupy-piecewise bench: {h['date_utc']} | {h['gpu']} | torch {h['torch']} cupy {h['cupy']} "
        f"triton {h['triton']} | {h.get('elapsed_s')} s ===\ncommand: {h['command']}\n" + render_checks_line(res),
        "Summary (TFLOP/s; ratio = SDPA time / ours, > 1: ours faster):",
        render_summary(res),
        f"Full tables: {os.path.join(out_dir, 'results.md')}; data: {os.path.join(out_dir, 'results.json')}; "
        f"plots: {len(res.get('plots') or [])} PNG",
    ])


def merge_results(paths):
    """Concatenate the measurement lists of several results.json files (header of the first,
    with every command kept)."""
    merged = None
    for p in paths:
        with open(p) as f:
            r = json.load(f)
        if merged is None:
            merged = r
            merged["header"]["commands"] = [r["header"].get("command")]
            continue
        merged["header"]["commands"].append(r["header"].get("command"))
        for k in ("main", "spot_checks", "w_sweep", "w_sweep_summary", "decode", "memory", "notes"):
            merged[k] = (merged.get(k) or []) + (r.get(k) or [])
        if not merged.get("copy_bandwidth"):
            merged["copy_bandwidth"] = r.get("copy_bandwidth")
    if len(paths) > 1:
        merged["header"]["command"] = " ; ".join(str(c) for c in merged["header"]["commands"])
    annotate_ratios(merged["main"])
    return merged


def make_plots(res, out_dir):
    try:
        import plot as _plot
    except Exception:
        try:
            from bench import plot as _plot
        except Exception as e:
            res["notes"].append(f"plots skipped: cannot import bench/plot.py ({_err_text(e)})")
            return []
    try:
        return _plot.plot_main(res, out_dir)
    except ImportError as e:
        res["notes"].append(f"plots skipped: {e}")
        return []
    except Exception as e:
        res["notes"].append(f"plots failed: {_err_text(e)}")
        return []


# ----------------------------------------------------------------------------- utilities
def _version_of(mod):
    try:
        m = __import__(mod)
        return getattr(m, "__version__", "?")
    except Exception as e:
        return f"not importable ({type(e).__name__})"


def _git_commit():
    try:
        import subprocess
        return subprocess.run(["git", "-C", _ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5).stdout.strip() or None
    except Exception:
        return None


def _write(msg):
    if _tqdm is not None:
        _tqdm.write(msg, file=sys.stderr)
    else:
        print(msg, file=sys.stderr)


class _NoBar:
    def __init__(self, total, desc):
        self.total, self.n, self.desc = total, 0, desc

    def update(self, k=1):
        self.n += k

    def set_postfix_str(self, s):
        pass

    def close(self):
        print(f"[{self.desc}] {self.n}/{self.total} done", file=sys.stderr)


def _progress(total, desc):
    if _tqdm is None:
        return _NoBar(total, desc)
    return _tqdm(total=total, desc=desc, file=sys.stderr, mininterval=2.0, dynamic_ncols=True)


def _csv(kind):
    def parse(s):
        items = [x.strip() for x in s.split(",") if x.strip()]
        if kind is int:
            return [int(x) for x in items]
        if kind == "bool":
            m = {"true": True, "1": True, "yes": True, "causal": True,
                 "false": False, "0": False, "no": False, "full": False}
            if items == ["both"]:
                return [False, True]
            try:
                return [m[x.lower()] for x in items]
            except KeyError as e:
                raise argparse.ArgumentTypeError(f"causal values are true/false/both, got {e}")
        return items
    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=_csv(int), help="L values (M = N = L), default 1024,2048,4096,8192,16384")
    p.add_argument("--dims", type=_csv(int), help="head dims, default 64,128")
    p.add_argument("--dtypes", type=_csv(str), help="bfloat16,float16 (aliases bf16, fp16; float32 allowed)")
    p.add_argument("--causal", type=_csv("bool"), help="false,true or both (default both)")
    p.add_argument("--providers", type=_csv(str), help=f"subset of {','.join(PROVIDERS)}")
    p.add_argument("--phases", type=_csv(str), help=f"subset of {','.join(PHASES)}")
    p.add_argument("--sections", type=_csv(str), help=f"subset of {','.join(SECTIONS)} (default all)")
    p.add_argument("--skip", type=_csv(str), default=[], help="sections to leave out")
    p.add_argument("--quick", action="store_true", help="short subset: L 2048,8192, bf16, trimmed extra sections")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU tensors, perf_counter timing")
    p.add_argument("--out", default=os.path.join(_HERE, "results"), help="output folder (default bench/results)")
    p.add_argument("--tokens", type=int, default=None, help="batch = tokens // L (default 16384; dry run 2*L)")
    p.add_argument("--head-total", type=int, default=None, help="heads = head_total // D (default 2048)")
    p.add_argument("--warmup-ms", type=float, default=None, help="do_bench warm-up in ms")
    p.add_argument("--rep-ms", type=float, default=None, help="do_bench repeat time in ms")
    p.add_argument("--plain-mem-gb", type=float, default=40.0,
                   help="skip torch_plain when B*H*M*N*4 bytes*4 exceeds this (GB)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop starting new measurements after this many seconds, the rest recorded as "
                        "'skipped: time budget' (default 520 on a GPU, so one 600 s call ends cleanly; 0 = none)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--report-only", metavar="RESULTS_JSON", nargs="+",
                   help="re-render results.md and plots from existing results.json file(s) into --out; "
                        "several files (e.g. one run per dtype) are merged")
    a = p.parse_args(argv)

    if a.dry_run:
        dflt = dict(lengths=[32, 64], dims=[16], dtypes=["bfloat16", "float32"], causal=[False, True])
        a.tokens = a.tokens or 64     # B = 64 // L -> 2 or 1
        a.head_total = a.head_total or 32  # H = 32 // D -> 2
        a.warmup_ms = 0.0 if a.warmup_ms is None else a.warmup_ms
        a.rep_ms = 2.0 if a.rep_ms is None else a.rep_ms
    elif a.quick:
        dflt = dict(lengths=[2048, 8192], dims=[64, 128], dtypes=["bfloat16"], causal=[False, True])
        a.warmup_ms = 10.0 if a.warmup_ms is None else a.warmup_ms
        a.rep_ms = 40.0 if a.rep_ms is None else a.rep_ms
    else:
        dflt = dict(lengths=[1024, 2048, 4096, 8192, 16384], dims=[64, 128], dtypes=["bfloat16", "float16"],
                    causal=[False, True])
        a.warmup_ms = 25.0 if a.warmup_ms is None else a.warmup_ms
        a.rep_ms = 100.0 if a.rep_ms is None else a.rep_ms
    for k, v in dflt.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.budget_s is None:
        a.budget_s = 0 if a.dry_run else 520.0
    a.tokens = a.tokens or 16384
    a.head_total = a.head_total or 2048
    a.dtypes = [DTYPE_NAME[DTYPES[d]] if d in DTYPES else d for d in a.dtypes]
    for d in a.dtypes:
        if d not in DTYPES:
            p.error(f"unknown dtype {d!r}")
    a.providers = a.providers or list(PROVIDERS)
    for n in a.providers:
        if n not in PROVIDERS:
            p.error(f"unknown provider {n!r}; choose from {', '.join(PROVIDERS)}")
    a.phases = a.phases or list(PHASES)
    a.phases = ["fwd_bwd" if x in ("fwd+bwd", "fwdbwd") else x for x in a.phases]
    for ph in a.phases:
        if ph not in PHASES:
            p.error(f"unknown phase {ph!r}; choose from {', '.join(PHASES)}")
    a.sections = [s for s in (a.sections or list(SECTIONS)) if s not in a.skip]
    for s in a.sections + list(a.skip):
        if s not in SECTIONS:
            p.error(f"unknown section {s!r}; choose from {', '.join(SECTIONS)}")
    return a


def main(argv=None):
    args = parse_args(argv)
    if args.report_only:
        res = merge_results(args.report_only)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
        if not args.no_plots:
            res["plots"] = make_plots(res, args.out)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(render_markdown(res))
        print(render_stdout(res, args.out))
        return 0
    if args.dry_run:
        torch.set_num_threads(1)  # tiny CPU problems: threads only add noise
    env = Env(args.dry_run)
    runner = Runner(args, env)
    _write(f"bench: {runner.results['header']['gpu']}; sections {','.join(args.sections)}; out {args.out}")
    steps = {"main": runner.run_main, "wsweep": runner.run_wsweep, "decode": runner.run_decode,
             "memory": runner.run_memory}
    for sec in SECTIONS:
        if sec not in args.sections:
            continue
        runner._section = sec
        try:
            steps[sec]()
        except Exception as e:  # a bug in one section must not lose the others
            runner.results["notes"].append(f"section {sec} aborted: {_err_text(e)}")
            runner.log(traceback.format_exc(), echo=True)
            env.cleanup()
            env.check_alive()
    if env.broken:
        runner.results["notes"].append(env.broken)
    runner.save(render=True, plots=(not args.no_plots) and "main" in args.sections)
    print(render_stdout(runner.results, args.out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
