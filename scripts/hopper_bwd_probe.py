#!/usr/bin/env python3
"""Probe of the Hopper (sm_90a) backward prototype, kernels_cu/sm90/backward.cu, on one GPU.

Run from the repository root on a machine with a compute-capability 9.0 GPU:

    PYTHONPATH=$PWD python3 scripts/hopper_bwd_probe.py --out $OUT/hopper_bwd.txt

Three phases, each in its own worker process (a hung or crashed kernel cannot take the rest
down; the parent kills a worker that prints nothing for a while and, in the check phase,
resumes after the case that hung or lost the CUDA context):

1. build: compile every instantiation through ``cupy.RawModule`` with ('-std=c++17',
   '-arch=sm_90a'); ptxas registers/spills and C75xx (wgmma serialisation) remarks through
   cuda.bindings' NVRTC with -Xptxas=-v; SASS instruction counts (HGMMA, UTMALDG, LDL/STL,
   RED) per kernel when cuobjdump is found.
2. check: forward by the package (cupy_piecewise.attention on torch tensors, return_lse=True),
   then this prototype's backward, both dQ modes:
     fused  pw90_bwd<..., DQ=true>: all five gradients (dQ by float32 atomics + convert);
     nodq   pw90_bwd<..., DQ=false>: dK1, dK2, dV only (the deterministic-mode kernel; dQ
            would come from the mma.sync dq kernel), also run twice and compared bitwise.
   Every gradient against the float64 reference (cupy_piecewise.reference.backward) with the
   project's rule (tolerance.compare, lowp = reference.lowp_backward; float16 with
   tolerance.float16_loss_scale as tests/test_kernels_gpu.py does); outputs NaN-poisoned.
   Grid: bf16/fp16 x D 64/128 x causal or not x M = N in {128, 200, 1000} x w in {-3, 37,
   5000} with GQA 2, plus M != N, tiny, tile-edge, GQA 4 and (B, L, H, D)-layout cases.
3. time: bf16, L = 2048 and 8192 (B = 16384 / L, H = 2048 / D, w = L / 4), D 64/128, causal
   or not: backward alone and forward + backward for this prototype (fused; nodq alone as a
   dK/dV-only lower bound), the package's default backward ("package default":
   cupy_piecewise.attention_backward, the Hopper kernels on an H100/H200), SDPA flash and
   SDPA cuDNN (standard attention on q1/k1/v, autograd).
   TFLOP/s with forward FLOPs 4 B H M N D (half when causal), backward 2.5x forward.
   AGREE lines compare this prototype's gradients with the package's at full scale.

Everything is printed with flush and also written to --out; the whole run stays under about
4 minutes (phase deadlines below). Not part of the package: the kernels are a standalone
prototype launched here through cuLaunchKernel. Options: --phases, --opt (extra NVRTC option,
e.g. -DPW90_WAIT_SPIN_LIMIT=100000000 to turn a pipeline deadlock into a launch error), --cases (comma-separated check-case indices), --via cubin.
"""
from __future__ import annotations

import argparse
import ctypes
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

import probe_common  # noqa: E402  (scripts/ is on sys.path)
from probe_common import ROOT, find_tool, say, splice  # noqa: E402

SOURCE = "sm90/backward.cu"
ELEM = {"bfloat16": "pw90::bf16", "float16": "pw90::f16"}
THREADS = 384
BM, BN = 64, 128  # mirrors pw90::bwd::BM / BN
LOG2E = 1.4426950408889634

# Phase deadlines and inactivity limits (seconds): build + check + time < 240.
PHASES = {"build": (70, 60), "check": (95, 30), "time": (70, 45)}


#: set by main() from --opt -DPW90_BWD_STAGES=n (ring stages)
STAGES = 2
#: set by main() when --opt -DPW90_BWD_DQ_WRITER=1 is given (dQ staging buffers, writer warp)
DQ_WRITER = False
#: set by main() from --ours-only: the time phase skips the package default and SDPA
OURS_ONLY = False


def smem_bytes(D: int) -> int:
    """Dynamic shared memory of pw90_bwd<T, D, *, *> (pw90::bwd::Smem<D>::BYTES)."""
    from cupy_piecewise import capability

    return capability.hopper_bwd_shared_bytes(D, STAGES, DQ_WRITER)


def main_name(dtype, D, causal, dq):
    return f"pw90_bwd<{ELEM[dtype]}, {D}, {'true' if causal else 'false'}, {'true' if dq else 'false'}>"


def prep_name(dtype, D):
    return f"pw90_bwd_prep<{ELEM[dtype]}, {D}>"


def conv_name(dtype, D):
    return f"pw90_bwd_dq_convert<{ELEM[dtype]}, {D}>"


DTYPES = ("bfloat16", "float16")
NAMES = ([main_name(t, d, c, q) for t in DTYPES for d in (64, 128) for c in (False, True)
          for q in (True, False)]
         + [prep_name(t, d) for t in DTYPES for d in (64, 128)]
         + [conv_name(t, d) for t in DTYPES for d in (64, 128)])

def nvrtc_cubin(names, options):
    """SOURCE compiled by cuda.bindings' NVRTC: (cubin, {name: lowered}, log)."""
    return probe_common.nvrtc_cubin(SOURCE, names, options)


# ============================================================================ launching

# pw90::bwd::BwdParams, PrepParams, ConvertParams: the package's own packers' layouts
from cupy_piecewise.capability import hopper_bwd_helper_grid  # noqa: E402
from cupy_piecewise.launch import _BWD_CONV as _CONV_PARAMS  # noqa: E402
from cupy_piecewise.launch import _BWD_MAIN as _BWD_PARAMS  # noqa: E402
from cupy_piecewise.launch import _BWD_PREP as _PREP_PARAMS  # noqa: E402


class Kernels:
    """Every instantiation loaded on the current device: name -> CUfunction (cupy RawKernel)."""

    def __init__(self, extra_options=(), via="rawmodule"):
        import cupy

        self.fns = {}
        opts = ("-std=c++17", "-arch=sm_90a") + tuple(extra_options)
        if via == "rawmodule":
            self.mod = cupy.RawModule(code=splice(SOURCE), options=opts, name_expressions=NAMES)
            get = lambda n: self.mod.get_function(n)  # noqa: E731
        else:
            cubin, lowered, _ = nvrtc_cubin(NAMES, list(opts))
            fd, path = tempfile.mkstemp(suffix=".cubin")
            os.write(fd, cubin)
            os.close(fd)
            self.mod = cupy.RawModule(path=path)
            get = lambda n: self.mod.get_function(lowered[n])  # noqa: E731
        for n in NAMES:
            k = get(n)
            if n.startswith("pw90_bwd<"):
                D = 64 if ", 64," in n else 128
                k.max_dynamic_shared_size_bytes = smem_bytes(D)
            self.fns[n] = k

    @staticmethod
    def _launch(k, grid, threads, smem, args_ptrs, stream):
        import cupy

        arr = (ctypes.c_void_p * len(args_ptrs))(*args_ptrs)
        cupy.cuda.driver.launchKernel(k.kernel.ptr, grid[0], grid[1], grid[2], threads, 1, 1, smem,
                                      stream, ctypes.addressof(arr), 0)
        return arr

    def workspace(self, torch, B, H, M, D, device, dq=True):
        Mpad = (M + BM - 1) // BM * BM
        lse2 = torch.empty(B, H, Mpad, device=device, dtype=torch.float32)
        delta = torch.empty(B, H, Mpad, device=device, dtype=torch.float32)
        acc = torch.empty(2, B, H, Mpad, D, device=device, dtype=torch.float32) if dq else None
        return lse2, delta, acc

    def backward(self, q1, k1, q2, k2, v, o, lse, do, w, causal, outs, dq=True, ws=None,
                 sm_scale=None):
        """outs = (dq1, dk1, dq2, dk2, dv) preallocated torch tensors (unit stride along D);
        with dq=False dq1/dq2 are left untouched. ws: workspace() result (allocated if None)."""
        import torch

        from cupy_piecewise import tma

        dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[q1.dtype]
        B, H, M, D = q1.shape
        Hkv, N = k1.shape[1], k1.shape[2]
        dq1, dk1, dq2, dk2, dv = outs
        if M == 0 or N == 0:
            raise ValueError("empty problems are the caller's (zeros)")
        Mpad = (M + BM - 1) // BM * BM
        lse2, delta, acc = ws if ws is not None else self.workspace(torch, B, H, M, D, q1.device, dq)
        stream = torch.cuda.current_stream().cuda_stream
        scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
        keep = []
        # 1. prep: delta, lse2 (padded), zero dQ accumulator
        pp = ctypes.create_string_buffer(_PREP_PARAMS.pack(
            o.data_ptr(), *o.stride()[:3], do.data_ptr(), *do.stride()[:3], lse.data_ptr(),
            lse2.data_ptr(), delta.data_ptr(), acc.data_ptr() if dq else 0, B, H, M, Mpad, 0,
            Mpad, 0))  # dlse none; rows = Mpad; cu_q none (dense)
        keep.append(self._launch(self.fns[prep_name(dtype, D)], hopper_bwd_helper_grid(H, Mpad, B), 256, 0,
                                 [ctypes.addressof(pp)], stream))
        # 2. main kernel
        maps = [tma.tensor_map_bhld(t.data_ptr(), t.shape, t.stride(), dtype, BM) for t in (q1, q2, do)]
        maps += [tma.tensor_map_bhld(t.data_ptr(), t.shape, t.stride(), dtype, BN) for t in (k1, k2, v)]
        nd = M + N + 1
        wc = max(-nd, min(nd, int(w)))
        bp = ctypes.create_string_buffer(_BWD_PARAMS.pack(
            dk1.data_ptr(), *dk1.stride()[:3], dk2.data_ptr(), *dk2.stride()[:3],
            dv.data_ptr(), *dv.stride()[:3], acc.data_ptr() if dq else 0, lse2.data_ptr(),
            delta.data_ptr(), B, H, H // Hkv, M, N, Mpad, wc, N - M, scale * LOG2E, scale, 0, 0))
        ptrs = [m.address() for m in maps] + [ctypes.addressof(bp)]
        keep.append(self._launch(self.fns[main_name(dtype, D, causal, dq)], ((N + BN - 1) // BN, Hkv, B),
                                 THREADS, smem_bytes(D), ptrs, stream))
        # 3. dQ: float32 accumulator -> dtype, times sm_scale
        if dq:
            cp = ctypes.create_string_buffer(_CONV_PARAMS.pack(
                dq1.data_ptr(), *dq1.stride()[:3], dq2.data_ptr(), *dq2.stride()[:3],
                acc.data_ptr(), B, H, M, Mpad, scale, M, 0))
            keep.append(self._launch(self.fns[conv_name(dtype, D)], hopper_bwd_helper_grid(H, M, B), 256, 0,
                                     [ctypes.addressof(cp)], stream))
        self._keep = (keep, maps, pp, bp)  # alive until the launches have copied them (they have)


# ============================================================================ phases

def phase_build(args):
    import cupy

    say(f"python {sys.version.split()[0]}, cupy {cupy.__version__}")
    try:
        import torch

        say(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
    except Exception as e:
        say(f"torch: {e!r}")
    try:
        from cuda.bindings import nvrtc as N

        say(f"NVRTC (cuda.bindings) version {N.nvrtcVersion()[1:]}")
    except Exception as e:
        say(f"cuda.bindings nvrtc: {e!r}")
    try:
        cc = cupy.cuda.Device(0).compute_capability
        props = cupy.cuda.runtime.getDeviceProperties(0)
    except Exception as e:
        say(f"SKIP: no usable CUDA device ({type(e).__name__}: {e})")
        return 2
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    say(f"device 0: {name}, cc {cc}, SMs {props['multiProcessorCount']}, smem/block optin "
        f"{props.get('sharedMemPerBlockOptin', '?')}, driver {cupy.cuda.runtime.driverGetVersion()}")
    if cc != "90":
        say(f"SKIP: compute capability {cc}, this probe needs 9.0")
        return 2
    for D in (64, 128):
        say(f"smem bytes D={D}: {smem_bytes(D)} (BM {BM} queries streamed, BN {BN} keys per CTA)")
    t = time.time()
    try:
        Kernels(extra_options=tuple(args.opt), via="rawmodule")
        say(f"BUILD rawmodule OK ({time.time() - t:.1f} s)")
    except Exception as e:
        say(f"BUILD rawmodule FAIL ({time.time() - t:.1f} s): {type(e).__name__}: {str(e)[:3000]}")
        try:
            Kernels(extra_options=tuple(args.opt), via="cubin")
            say("BUILD cubin OK: later phases load the NVRTC cubin")
        except Exception as e2:
            say(f"BUILD cubin FAIL: {type(e2).__name__}: {str(e2)[:3000]}")
    cubin = None
    try:
        cubin, lowered, log = nvrtc_cubin(NAMES, ["-std=c++17", "-arch=sm_90a", "-Xptxas=-v"] + list(args.opt))
        blocks, cur = {}, None
        for line in log.splitlines():
            m = re.search(r"Compiling entry function '([^']+)'", line)
            if m:
                cur = m.group(1)
                blocks[cur] = ""
            elif cur:
                blocks[cur] += line + "\n"
        for n in NAMES:
            b = blocks.get(lowered[n], "")
            regs = re.search(r"Used (\d+) registers", b)
            sp = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", b)
            serial = "serialized" in b or "C751" in b
            say(f"REGS {n}: {regs.group(1) if regs else '?'} registers (entry cap; setmaxnreg gives "
                f"consumers 240), stack/spill st/ld {sp.groups() if sp else '?'}"
                f"{', WGMMA SERIALISED (C75xx)' if serial else ''}")
        lowmap = {v: k for k, v in lowered.items()}
        for line in log.splitlines():
            if "C75" in line:
                fn = re.search(r"function '([^']+)'", line)
                say("ptxas: " + re.sub(r"function '[^']+'", f"function {lowmap.get(fn.group(1), '?')}"
                                       if fn else "", line.strip())[:300])
    except Exception as e:
        say(f"NVRTC offline: {type(e).__name__}: {str(e)[:2000]}")
    tool = find_tool("cuobjdump")
    if cubin and tool:
        env = dict(os.environ)
        nvd = find_tool("nvdisasm")
        if nvd:
            env["PATH"] = os.path.dirname(nvd) + os.pathsep + env.get("PATH", "")
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "bwd.cubin")
            with open(p, "wb") as f:
                f.write(cubin)
            r = subprocess.run([tool, "-sass", p], capture_output=True, text=True, timeout=60, env=env)
            sass = r.stdout
            if not sass.strip():
                say(f"cuobjdump gave no SASS: {r.stderr[:500]}")
            for f in re.split(r"\n\s*Function : ", sass)[1:]:
                fname = f.split("\n", 1)[0].strip()
                cnt = {k: len(re.findall(k, f)) for k in
                       ("HGMMA", "WARPGROUP.DEPBAR", "UTMALDG", "UBLKCP", "SYNCS", "USETMAXREG", "LDL",
                        "STL", "REDG", "MUFU.EX2", "BAR.SYNC")}
                regs = [int(x) for x in re.findall(r"\bR(\d+)\b", f)]
                say(f"SASS {fname}: max R{max(regs) if regs else '?'}, " +
                    ", ".join(f"{k} {v}" for k, v in cnt.items()))
    else:
        say(f"SASS: skipped (cuobjdump {'not found' if not tool else 'ok'}, cubin {'ok' if cubin else 'missing'})")
    warm_package(t0=time.time(), budget_s=25.0)
    return 0


def warm_package(t0, budget_s):
    """Compile (into CuPy's disk cache) the package kernels the later phases call, so that
    the check and time workers do not spend their deadlines in NVRTC: the mma.sync forward
    of the small check cases, the Hopper forward and the mma.sync backward of the timed ones."""
    try:
        import torch

        import cupy_piecewise
    except Exception as e:
        say(f"WARM: skipped ({e!r})")
        return
    done = 0
    for dt in (torch.bfloat16, torch.float16):
        for D in (64, 128):
            for causal in (False, True):
                if time.time() - t0 > budget_s:
                    say(f"WARM: out of time after {done} calls")
                    return
                try:
                    mk = lambda h, n: torch.randn(1, h, n, D, device="cuda", dtype=dt)  # noqa: E731
                    q1, k1, q2, k2, v = mk(4, 200), mk(2, 200), mk(4, 200), mk(2, 200), mk(2, 200)
                    cupy_piecewise.attention(q1, k1, q2, k2, v, 37, causal=causal, return_lse=True)
                    if dt == torch.bfloat16:  # the timed configurations: Hopper forward, mma backward
                        q1, k1, q2, k2, v = (mk(32, 640) for _ in range(5))
                        o, lse = cupy_piecewise.attention(q1, k1, q2, k2, v, 160, causal=causal,
                                                          return_lse=True)
                        cupy_piecewise.attention_backward(torch.randn_like(o), q1, k1, q2, k2, v, o,
                                                          lse, 160, causal=causal)
                    torch.cuda.synchronize()
                    done += 1
                except Exception as e:
                    say(f"WARM {dt} D={D} causal={causal}: {type(e).__name__}: {str(e)[:200]}")
    say(f"WARM: package kernels compiled/loaded ({done} configurations, {time.time() - t0:.1f} s)")


def make_cases():
    cases = []
    for dt in DTYPES:
        for D in (64, 128):
            for causal in (False, True):
                for L in (128, 200, 1000):
                    for w in (-3, 37, 5000):
                        cases.append(dict(dtype=dt, D=D, causal=causal, B=1, H=4, Hkv=2, M=L, N=L, w=w))
    for D in (64, 128):
        for causal in (False, True):
            extra = [dict(M=200, N=1000, w=300), dict(M=1000, N=200, w=5), dict(M=50, N=50, w=10),
                     dict(M=300, N=300, w=BN), dict(M=300, N=300, w=64),
                     dict(M=300, N=300, w=128, layout="blhd", B=2, H=4, Hkv=4),
                     dict(M=257, N=385, w=-200, B=2, H=8, Hkv=2), dict(M=1, N=77, w=3)]
            for e in extra:
                c = dict(dtype="bfloat16", D=D, causal=causal, B=1, H=4, Hkv=2)
                c.update(e)
                cases.append(c)
    return cases


def describe(c):
    s = (f"{c['dtype'][:4]} D={c['D']} {'causal' if c['causal'] else 'full  '} B={c['B']} H={c['H']} "
         f"Hkv={c['Hkv']} M={c['M']} N={c['N']} w={c['w']}")
    if c.get("layout"):
        s += f" layout={c['layout']}"
    return s


def make_inputs(torch, c, seed):
    dt = {"bfloat16": torch.bfloat16, "float16": torch.float16}[c["dtype"]]
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    B, H, Hkv, M, N, D = c["B"], c["H"], c["Hkv"], c["M"], c["N"], c["D"]

    def rnd(heads, rows, scale):
        if c.get("layout") == "blhd":  # (B, L, H, D) memory viewed as (B, H, L, D)
            x = torch.randn(B, rows, heads, D, generator=g, device="cuda") * scale
            return x.to(dt).transpose(1, 2)
        return (torch.randn(B, heads, rows, D, generator=g, device="cuda") * scale).to(dt)

    q1, q2 = rnd(H, M, 1.5), rnd(H, M, 1.5)
    k1, k2, v = rnd(Hkv, N, 1.5), rnd(Hkv, N, 1.5), rnd(Hkv, N, 1.0)
    do = rnd(H, M, 1.0)
    return q1, k1, q2, k2, v, do


def run_case(torch, kern, c, seed):
    """-> list of (mode, name, Verdict) and a list of extra problems (strings)."""
    import numpy as np

    import cupy_piecewise
    from cupy_piecewise import reference, tolerance

    q1, k1, q2, k2, v, do = make_inputs(torch, c, seed)
    w, causal, dtype = c["w"], c["causal"], c["dtype"]
    o, lse = cupy_piecewise.attention(q1, k1, q2, k2, v, w, causal=causal, return_lse=True)
    torch.cuda.synchronize()

    def np64(t):
        return t.float().cpu().numpy().astype(np.float64)

    host = [np64(t) for t in (q1, k1, q2, k2, v)]
    o_h, lse_h, do_h = np64(o), lse.double().cpu().numpy(), np64(do)
    ref = reference.backward(*host, o_h, lse_h, do_h, w, causal)
    if dtype == "float16":  # loss scaling keeps float16 gradients normal (tolerance.py)
        s = tolerance.float16_loss_scale(ref, do_h)
        if s != 1.0:
            do = (do.float() * s).to(do.dtype)
            do_h = np64(do)
            ref = [g * s for g in ref]
    low = reference.lowp_backward(*host, o_h, lse_h, do_h, w, causal, dtype=dtype)
    names = ("dq1", "dk1", "dq2", "dk2", "dv")
    results, problems = [], []
    for mode in ("fused", "nodq"):
        outs = [torch.full_like(t, float("nan")) for t in (q1, k1, q2, k2, v)]
        kern.backward(q1, k1, q2, k2, v, o, lse, do, w, causal, outs, dq=(mode == "fused"))
        torch.cuda.synchronize()
        for nm, got, r, lo in zip(names, outs, ref, low):
            if mode == "nodq" and nm.startswith("dq"):
                continue
            g = np64(got)
            vd = tolerance.compare(nm, g, r, lo, dtype)  # (not `v`: that is the value tensor)
            results.append((mode, nm, vd))
            if not vd.passed:  # where: for the next engineer's debugging
                err = np.abs(np.nan_to_num(g, nan=np.inf) - r)
                idx = np.unravel_index(int(np.argmax(err)), err.shape)
                problems.append(f"{mode} {nm}: {int(np.isnan(g).sum())} NaN of {g.size}; worst at (b, h, row, "
                                f"col) {tuple(int(x) for x in idx)}: got {g[idx]:.4g}, ref {r[idx]:.4g}; rows "
                                f"with errors > bound: {_bad_rows(err, vd.bound)}")
        if mode == "nodq":  # deterministic mode: bitwise-equal dK/dV on a second run
            again = [torch.full_like(t, float("nan")) for t in (q1, k1, q2, k2, v)]
            kern.backward(q1, k1, q2, k2, v, o, lse, do, w, causal, again, dq=False)
            torch.cuda.synchronize()
            for nm, a, b in zip(names, outs, again):
                if not nm.startswith("dq") and not torch.equal(a.view(torch.int16), b.view(torch.int16)):
                    problems.append(f"nodq {nm} not bitwise reproducible")
    return results, problems


def _bad_rows(err, bound):
    """Compact list of (b, h, row) index ranges whose max error exceeds bound."""
    import numpy as np

    rows = np.argwhere(err.max(axis=-1) > bound)
    if not len(rows):
        return "none"
    out, prev = [], None
    for b, h, r in rows.tolist():
        if prev and prev[0] == b and prev[1] == h and prev[3] == r - 1:
            prev[3] = r
        else:
            prev = [b, h, r, r]
            out.append(prev)
    txt = ", ".join(f"b{b}h{h}:{r0}-{r1}" for b, h, r0, r1 in out[:8])
    return txt + (f" (+{len(out) - 8} more)" if len(out) > 8 else "")


def phase_check(args):
    import torch

    kern = Kernels(extra_options=tuple(args.opt), via=args.via)
    cases = make_cases()
    todo = list(range(args.start, len(cases)))
    if args.cases:
        todo = [int(x) for x in args.cases.split(",") if int(x) >= args.start]
    say(f"check: {len(cases)} cases, running {len(todo)} from {args.start}, kernels via {args.via} {args.opt}")
    npass = nfail = 0
    for i in todo:
        c = cases[i]
        say(f"CASE {i} START {describe(c)}")
        t = time.time()
        try:
            results, problems = run_case(torch, kern, c, seed=3000 + i)
            bad = [(m, n, v) for m, n, v in results if not v.passed]
            ok = not bad and not problems
            npass += ok
            nfail += not ok
            worst = max((v.max_err / v.bound if v.bound else 0.0) for _, _, v in results)
            say(f"{'PASS' if ok else 'FAIL'} {i} {describe(c)} ({time.time() - t:.1f} s, worst max-err/bound "
                f"{worst:.2f})")
            for m, n, v in results:
                if not v.passed or args.verbose:
                    say(f"     {m:5s} {n}: max {v.max_err:.3e} (bound {v.bound:.3e}) rel {v.rel_err:.2e} "
                        f"finite {v.finite}")
            for pr in problems:
                say(f"     {pr}")
        except Exception as e:
            nfail += 1
            say(f"ERROR {i} {describe(c)}: {type(e).__name__}: {str(e)[:800]}")
            try:
                torch.cuda.synchronize()
            except Exception as e2:
                say(f"CUDA context lost ({type(e2).__name__}): worker exits, parent resumes after case {i}")
                return 3
    say(f"check done in this worker: {npass} pass, {nfail} fail")
    return 0


def cuda_time(torch, fn, warmup=3, reps=10):
    return probe_common.cuda_time(torch, fn, warmup, reps)


TIME_CONFIGS = [(L, D, c) for L in (2048, 8192) for D in (64, 128) for c in (False, True)]


def phase_time(args):
    import torch

    kern = None
    if not args.skip_ours:
        try:
            kern = Kernels(extra_options=tuple(args.opt), via=args.via)
        except Exception as e:
            say(f"time: our kernels failed to load: {e!r}")
    import cupy_piecewise

    for L, D, causal in TIME_CONFIGS:
        try:
            _time_config(torch, kern, cupy_piecewise, L, D, causal)
        except Exception as e:
            say(f"TIME L={L} D={D} causal={int(causal)}: ERROR {type(e).__name__}: {str(e)[:300]}")
            try:
                torch.cuda.synchronize()
            except Exception:
                say("CUDA context lost: stopping the time phase")
                return 3
        torch.cuda.empty_cache()
    return 0


def _time_config(torch, kern, cpw, L, D, causal):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H, w = 16384 // L, 2048 // D, L // 4
    g = torch.Generator(device="cuda")
    g.manual_seed(7)
    mk = lambda: torch.randn(B, H, L, D, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q1, k1, q2, k2, v, do = mk(), mk(), mk(), mk(), mk(), mk()
    fwd = 4 * B * H * L * L * D * (0.5 if causal else 1.0)
    tag = f"L={L} D={D} causal={int(causal)}"
    o, lse = cpw.attention(q1, k1, q2, k2, v, w, causal=causal, return_lse=True)

    def report(name, phase, fn, flops):
        try:
            ms = cuda_time(torch, fn)
            say(f"TIME {tag} | {name:16s} | {phase:7s} | {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s")
        except Exception as e:
            say(f"TIME {tag} | {name:16s} | {phase:7s} | ERROR {type(e).__name__}: {str(e)[:200]}")
            torch.cuda.synchronize()

    if kern is not None:
        outs = [torch.empty_like(t) for t in (q1, k1, q2, k2, v)]
        ws = kern.workspace(torch, B, H, L, D, q1.device, dq=True)
        bwd = lambda: kern.backward(q1, k1, q2, k2, v, o, lse, do, w, causal, outs, ws=ws)  # noqa: E731
        report("pw90 fused", "bwd", bwd, 2.5 * fwd)

        def fb():
            oo, ll = cpw.attention(q1, k1, q2, k2, v, w, causal=causal, return_lse=True)
            kern.backward(q1, k1, q2, k2, v, oo, ll, do, w, causal, outs, ws=ws)
        report("pw90 fused", "fwd_bwd", fb, 3.5 * fwd)
        ws2 = kern.workspace(torch, B, H, L, D, q1.device, dq=False)
        report("pw90 nodq(dKdV)", "bwd", lambda: kern.backward(q1, k1, q2, k2, v, o, lse, do, w, causal,
                                                              outs, dq=False, ws=ws2), 2.5 * fwd)
        try:  # agreement with the package's backward at full scale
            kern.backward(q1, k1, q2, k2, v, o, lse, do, w, causal, outs, ws=ws)
            ref = cpw.attention_backward(do, q1, k1, q2, k2, v, o, lse, w, causal=causal)
            rels = []
            for nm, a, r in zip(("dq1", "dk1", "dq2", "dk2", "dv"), outs, ref):
                den = r.float().norm().item()
                rels.append(f"{nm} {((a.float() - r.float()).norm().item() / den if den else 0.0):.2e}")
            say(f"AGREE {tag}: ||pw90 - package|| / ||package||: " + ", ".join(rels))
        except Exception as e:
            say(f"AGREE {tag}: ERROR {type(e).__name__}: {str(e)[:300]}")
            torch.cuda.synchronize()
        del outs, ws, ws2
    if OURS_ONLY:
        return
    report("package default", "bwd", lambda: cpw.attention_backward(do, q1, k1, q2, k2, v, o, lse, w,
                                                                 causal=causal), 2.5 * fwd)

    def pk_fb():
        oo, ll = cpw.attention(q1, k1, q2, k2, v, w, causal=causal, return_lse=True)
        cpw.attention_backward(do, q1, k1, q2, k2, v, oo, ll, w, causal=causal)
    report("package default", "fwd_bwd", pk_fb, 3.5 * fwd)
    for name, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        qq, kk, vv = (t.detach().requires_grad_() for t in (q1, k1, v))
        try:
            with sdpa_kernel(be):
                out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)

            def sb():
                torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True)

            def sfb():
                with sdpa_kernel(be):
                    oo = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
                torch.autograd.grad(oo, (qq, kk, vv), do)
            report(name, "bwd", sb, 2.5 * fwd)
            report(name, "fwd_bwd", sfb, 3.5 * fwd)
        except Exception as e:
            say(f"TIME {tag} | {name:16s} | ERROR {type(e).__name__}: {str(e)[:200]}")
            torch.cuda.synchronize()



# ============================================================================ parent

def run_worker(phase, extra, deadline_s, idle_s, log):
    """This script's ``--worker phase`` in a fresh process (probe_common.run_worker)."""
    return probe_common.run_worker(__file__, phase, extra, deadline_s, idle_s, log)


def summarise(lines, log):
    """Per-(dtype, D, causal) pass counts of the check and a TFLOP/s table of the time phase."""
    groups = {}
    for ln in lines:
        m = re.match(r"(PASS|FAIL|ERROR) \d+ (\w+) D=(\d+) (causal|full)", ln)
        if m:
            k = (m.group(2), int(m.group(3)), m.group(4))
            a = groups.setdefault(k, [0, 0])
            a[0 if m.group(1) == "PASS" else 1] += 1
    if groups:
        log("=" * 20 + " check summary (pass / fail per dtype, D, mask)")
        for k in sorted(groups):
            log(f"  {k[0]:5s} D={k[1]:3d} {k[2]:6s}: {groups[k][0]} pass, {groups[k][1]} fail")
    times = {}
    for ln in lines:
        m = re.match(r"TIME L=(\d+) D=(\d+) causal=(\d) \| (.+?)\s*\| (\w+)\s*\|\s*[\d.]+ ms\s+([\d.]+) TFLOP/s", ln)
        if m:
            times[(m.group(4), m.group(5), int(m.group(1)), int(m.group(2)), int(m.group(3)))] = float(m.group(6))
    if times:
        cols = TIME_CONFIGS
        head = "".join("{:>11s}".format(f"L{L // 1024}k D{D}" + ("c" if c else "")) for L, D, c in cols)
        log("=" * 20 + " TFLOP/s (bf16, B = 16384/L, H = 2048/D, w = L/4; bwd = 2.5x fwd FLOPs)")
        log(f"{'provider / phase':28s}{head}")
        for prov in ("pw90 fused", "pw90 nodq(dKdV)", "package default", "sdpa_flash", "sdpa_cudnn"):
            for ph in ("bwd", "fwd_bwd"):
                vals = [times.get((prov, ph, L, D, int(c))) for L, D, c in cols]
                if any(vals):
                    log(f"{prov + ' ' + ph:28s}" + "".join(f"{v:11.1f}" if v else f"{'-':>11s}" for v in vals))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="also write the report here")
    ap.add_argument("--worker", choices=list(PHASES), help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--skip-ours", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--verbose", action="store_true", help="print every gradient's errors")
    ap.add_argument("--cases", default="", help="comma-separated check-case indices")
    ap.add_argument("--via", choices=("rawmodule", "cubin"), default="rawmodule")
    ap.add_argument("--opt", action="append", default=[], help="extra NVRTC option (repeatable)")
    ap.add_argument("--phases", default="build,check,time")
    ap.add_argument("--ours-only", action="store_true",
                    help="time phase: this prototype's kernels only (no package default, no SDPA); "
                         "what scripts/hopper_bwd_ab.py runs per round")
    args = ap.parse_args()
    global STAGES, DQ_WRITER, OURS_ONLY
    DQ_WRITER = any("PW90_BWD_DQ_WRITER=1" in o for o in args.opt)
    OURS_ONLY = args.ours_only
    for o in args.opt:
        m = re.search(r"PW90_BWD_STAGES=(\d+)", o)
        if m:
            STAGES = int(m.group(1))

    if args.worker:
        try:
            rc = {"build": phase_build, "check": phase_check, "time": phase_time}[args.worker](args)
        except Exception:
            say("WORKER EXCEPTION:\n" + traceback.format_exc())
            rc = 1
        sys.exit(rc or 0)

    out = open(args.out, "w") if args.out else None
    t_start = time.time()

    def log(line):
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    log(f"hopper_bwd_probe: {time.strftime('%Y-%m-%d %H:%M:%S')} repo {ROOT}")
    log(f"sources {probe_common.source_stamp()}")
    common = ["--via", args.via] + [f"--opt={o}" for o in args.opt] + (["--ours-only"] if args.ours_only else [])
    if args.verbose:
        common.append("--verbose")
    phases = args.phases.split(",")
    ours_ok = True
    all_lines = []
    if "build" in phases:
        log("=" * 20 + " build")
        status, lines = run_worker("build", common, *PHASES["build"], log)
        log(f"[build worker: {status}]")
        if status == 2:
            log("no cc 9.0 GPU: stopping")
            return
        if any(ln.startswith("BUILD rawmodule FAIL") for ln in lines) or status in ("hang", "deadline"):
            log("RawModule build did not finish: later phases load the NVRTC cubin instead")
            common = (["--via", "cubin"] + [f"--opt={o}" for o in args.opt] + (["--verbose"] if args.verbose else [])
                      + (["--ours-only"] if args.ours_only else []))
    if "check" in phases:
        log("=" * 20 + " check")
        start, restarts, hangs = 0, 0, 0
        t_check = time.time()
        extra_cases = ["--cases", args.cases] if args.cases else []
        while True:
            left = PHASES["check"][0] - (time.time() - t_check)
            if left < 10:
                log("[check: out of time]")
                break
            status, lines = run_worker("check", common + ["--start", str(start)] + extra_cases, left,
                                       PHASES["check"][1], log)
            all_lines += lines
            log(f"[check worker from case {start}: {status}]")
            if status == 0:
                break
            started = [int(m.group(1)) for ln in lines for m in [re.match(r"CASE (\d+) START", ln)] if m]
            if status == "hang":
                ours_ok = False
                hangs += 1
                if started:
                    log(f"HANG at case {started[-1]} (no output for {PHASES['check'][1]} s): likely a "
                        f"pipeline deadlock (mbarrier parity / expect_tx byte count); rerun with "
                        f"--opt=-DPW90_WAIT_SPIN_LIMIT=100000000 --cases {started[-1]}")
            if not started or restarts >= 4 or hangs >= 2:
                if hangs >= 2:
                    log("two hangs: giving up on the check phase")
                break
            start = started[-1] + 1
            restarts += 1
    if "time" in phases:
        log("=" * 20 + " time")
        extra = common + ([] if ours_ok else ["--skip-ours"])
        if not ours_ok:
            log("(our kernel hung in the check phase: timing only the baselines)")
        status, lines = run_worker("time", extra, *PHASES["time"], log)
        all_lines += lines
        log(f"[time worker: {status}]")
    summarise(all_lines, log)
    log(f"hopper_bwd_probe done in {time.time() - t_start:.0f} s")
    if out:
        out.close()


if __name__ == "__main__":
    main()
