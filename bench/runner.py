"""The benchmark's sections, run in order by bench/cli.py: main sweep (+ spot checks), w sweep,
decode, peak memory. Results are kept in one dict (header + one list per section) and
written to <out>/results.json after every shape, so a killed run keeps what it measured."""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from common import (DTYPES, _err_text, _f, _git_commit, _progress, _status_of, _version_of, _write,
                    attn_flops, decode_bytes, tflops_from_ms)
from inputs import InputSet, _Slice, make_sets
from providers import Sdpa, make_providers, plain_piecewise
from reporting import annotate_ratios, make_plots, render_markdown
from timing import Timer, measure

#: Order in which the main sweep runs the providers of one shape: the references first, so that
#: if one of ours poisons the CUDA context the references of that shape survive.
RUN_ORDER = {"sdpa_flash": 0, "sdpa_cudnn": 1, "torch_plain": 2, "flag_attn": 3, "flex_composite": 4}
#: Providers whose forward the spot check compares with ours (piecewise) at the benchmark's w.
CHECK_VS_OURS = ("piecewise_mma", "flex_composite")


class Runner:
    def __init__(self, args, env):
        self.args = args
        self.env = env
        self.timer = Timer(env, args.warmup_ms, args.rep_ms)
        # an A/B build of kernels_cu/ timed through the whole table (PW_TEST_MACROS, as the GPU
        # suite takes it), before any provider compiles a kernel; named in the header
        from cupy_piecewise import compile as _compile

        self.macros = " ".join(m.removeprefix("-D") for m in _compile.apply_test_macros())
        if self.macros:
            print(f"PW_TEST_MACROS: {self.macros} (every kernel built with these -D options)",
                  flush=True)
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
        if "float32" in args.dtypes and env.cuda:
            # float32 rows: every provider may use TF32 tensor cores, as cupy_piecewise's
            # float32 kernels do (SPEC: float32 on the GPU is TF32); without this the peers'
            # float32 matmuls run on the FP32 pipe and the comparison says nothing
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
            self.results["notes"].append(
                "float32 rows: torch.backends.cuda.matmul.allow_tf32 and cudnn.allow_tf32 set, so the "
                "peers may use TF32 tensor cores as cupy_piecewise's float32 kernels do")
        path = (os.environ.get("CUPY_PIECEWISE_PATH") or "").strip().lower()
        if path not in ("", "auto") and "piecewise" in self.providers:
            self.results["notes"].append(f"CUPY_PIECEWISE_PATH={path} is set: provider 'piecewise' runs that path, "
                                         "not the package's default")

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
            "command": (f"PW_TEST_MACROS={shlex.quote(self.macros)} " if self.macros else "")
            + "python3 " + " ".join(shlex.quote(x) for x in sys.argv),
            "dry_run": a.dry_run,
            "quick": a.quick,
            "timer": self.timer.describe(),
            "l2_bytes": env.l2_bytes,
            "phases_note": "fwd under torch.no_grad(); bwd = torch.autograd.grad(..., retain_graph=True) alone, "
                           "forward graph built outside the timed region; fwd_bwd = forward + autograd.grad",
            "flop_convention": "fwd 4*B*H*M*N*D (x0.5 when causal and M == N); bwd 2.5x fwd; fwd_bwd 3.5x fwd",
            "git_commit": _git_commit(),
            "env": {k: os.environ.get(k) for k in ("CUPY_PIECEWISE_PATH", "CUPY_PIECEWISE_TILES",
                                                     "PW_TEST_MACROS")},
            # where a provider's code came from, when that can differ (flag_attn: the package or
            # FlagAttention's piecewise.py and the tile table it ran with)
            "provider_origins": {n: p.origin for n, p in self.providers.items()
                                 if getattr(p, "origin", None)},
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
        provs.sort(key=lambda p: RUN_ORDER.get(p.name, len(RUN_ORDER)))
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
            self._check_others(s, causal, w, sm, rec)
            rec["status"] = "ok"
        except Exception as e:
            rec.update(status="error", error=_err_text(e))
            self.env.cleanup()
            self.env.check_alive()
        self.log(f"[check] {dtype_name} D={D} causal={causal} L={N}: {rec}")
        return rec

    def _check_others(self, s, causal, w, sm, rec):
        """max |other - ours| of the forward at the benchmark's w on the whole input set, for the
        other piecewise providers of this run (rec['vs_ours']: provider -> value or error text).
        flex_composite only when the fwd phase ran (its compiled no-grad graph exists)."""
        names = [n for n in CHECK_VS_OURS if n in self.providers
                 and not self.providers[n].unavailable()
                 and (n != "flex_composite" or "fwd" in self.args.phases)]
        if not names:
            return
        out = {}
        with torch.no_grad():
            ours = self.providers["piecewise"].forward(s, w, causal, sm).float()
            for n in names:
                prov = self.providers[n]
                try:
                    with prov.context():
                        o = prov.forward(s, w, causal, sm)
                    out[n] = float((o.float() - ours).abs().max().item())
                    del o
                except Exception as e:
                    out[n] = "error: " + _err_text(e)[:300]
                    self.env.cleanup()
                    self.env.check_alive()
            del ours
        rec["vs_ours"] = out

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
                          or prov.skip_reason(shape, False) or self._decode_skip(prov))
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

    def _decode_skip(self, prov):
        """flex_composite compiles once per shape (tens of seconds each): left out of decode
        unless --flex-decode."""
        if prov.name == "flex_composite" and not getattr(self.args, "flex_decode", False):
            return "skipped: flex_composite is left out of decode (one torch.compile per case); --flex-decode runs it"
        return None

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

