"""Where and how the benchmark times: the device environment (Env), the median timer (Timer),
one provider x phase over rotating input sets (time_phase) and its error-catching wrapper
(measure).

Timing: a first untimed call (compilation, autotuning, handle creation), then
triton.testing.do_bench(return_mode='median') when triton imports (it flushes L2 before
every repeat), else a CUDA-event loop; a dry run on CPU uses time.perf_counter.
"""
from __future__ import annotations

import gc
import statistics
import time
import warnings

import torch

from common import _err_text


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


# ----------------------------------------------------------------------------- measuring
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


def event_median_ms(fn, warmup: int = 5, reps: int = 20) -> float:
    """Median of ``reps`` CUDA-event timings (ms) of ``fn()`` on the current stream after
    ``warmup`` calls: the plain timer of the one-off scripts (forward_paths, tiles)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)
