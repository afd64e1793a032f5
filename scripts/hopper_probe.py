#!/usr/bin/env python3
"""Probe of the Hopper (sm_90a) forward, kernels_cu/sm90/forward.cu, on one GPU.

Run from the repository root on a machine with a compute-capability 9.0 GPU:

    PYTHONPATH=$PWD python3 scripts/hopper_probe.py --out $OUT/hopper.txt

Three phases (four when the check fails), each in its own worker process (a hung or crashed kernel cannot take the
rest down; the parent kills a worker that prints nothing for a while and, in the check
phase, restarts it after the case that hung):

1. build: compile every instantiation through ``cupy.RawModule`` with
   ('-std=c++17', '-arch=sm_90a'); ptxas registers/spills (NVRTC with -Xptxas=-v); SASS
   instruction counts (HGMMA, UTMALDG, local memory) when ``cuobjdump`` is found.
2. check: a grid of cases (bf16/fp16, D 64/128, causal or not, M = N in {128, 200, 1000},
   w in {-3, 37, 5000}, GQA 2, plus M != N, tiny, strided and tile-edge cases) against the
   float64 reference with the project's tolerance rule; outputs NaN-poisoned first.
   When some case fails, a subset is re-run with -DPW90_PV_SPLIT=1 (P·V per 64-column panel).
3. time: bf16, B = 2, H = 2048 / D, L = 8192, w = L / 4, causal and not: this kernel, SDPA
   flash, SDPA cuDNN and the package's mma.sync path; CUDA events, median of 20 after
   warm-up; TFLOP/s with FLOPs = 4 B H M N D (half when causal).

With ``--variants "PW90_PERSIST=0;PW90_PINGPONG=1 PW90_PERSIST=0"`` it instead
A/B-tests compile-time variants of the kernel: the default build and each variant (its macros
as -D options) in turn get a 128-case check (the 96 of phase 2 plus 32 more: both dtypes, D
64/128, causal or not, ragged M/N, negative w, GQA, the blhd layout) and bf16 timings at L = 2048 and 8192 (B = 16384 / L, H =
2048 / D, w = L / 4), beside SDPA cuDNN and flash; a table compares them (about 1 minute
per variant). Each timing sample is a batch of VT_BATCH launches (this probe encodes the
tensor maps on the host at every launch). ``--rounds 3`` times every build three times in
interleaved order (the check runs once) and tables the medians with each build's spread
over the rounds: the causal cells of one build vary by up to 11% from run to run on an
H200, so a difference smaller than the spread is not one. ``--vt-lengths 2048,8192,16384``
widens the timing grid. Tile-shape macros (PW90_BN128, PW90_KSLOTS128,
PW90_BN64, PW90_KSLOTS64) are read by tiles() for the tensor-map boxes and shared memory;
-DPW90_PROBE_SOURCE=NAME builds kernels_cu/sm90/NAME.cu instead of forward.cu, e.g. the
previous kernel written out by `git show REV:kernels_cu/sm90/forward.cu`.

Everything is printed with flush and also written to --out. The whole run stays under
about 4 minutes (phase deadlines below). The probe launches the kernel directly through
cuLaunchKernel with its own tensor maps, not through the package's dispatch.
"""
from __future__ import annotations

import argparse
import ctypes
import math
import os
import re
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import traceback

import probe_common  # noqa: E402  (scripts/ is on sys.path)
from cupy_piecewise import capability  # noqa: E402
from probe_common import ROOT, find_tool, say, splice  # noqa: E402

SOURCE = "sm90/forward.cu"
ELEM = {"bfloat16": "pw90::bf16", "float16": "pw90::f16"}
#: query rows per CTA of the default build (pw90::FwdCfg; -DPW90_BM64 changes D = 64)
BM = {d: capability.HOPPER_BLOCK_M[d] for d in (64, 128)}
#: key rows per tile of the default build (pw90::FwdCfg; -DPW90_BN128 changes D = 128)
BN = {d: capability.HOPPER_BLOCK_N[d] for d in (64, 128)}
LOG2E = 1.4426950408889634

# Phase deadlines and inactivity limits (seconds): build + check + time < 240.
PHASES = {"build": (45, 40), "check": (85, 20), "variant": (35, 20), "time": (70, 50),
          "vrun": (90, 25), "vbase": (40, 30)}
#: cases re-run with -DPW90_PV_SPLIT=1 (P·V as one m64n64 product per 64-column panel of V,
#: no reliance on the descriptor's leading byte offset) when the main check saw failures
VARIANT_CASES = (0, 1, 4, 9, 10, 13, 18, 22, 27, 31)


def macro_value(options, name, default: int) -> int:
    """The integer value -D``name``=V sets among the NVRTC options, else ``default``."""
    for o in options:
        m = re.match(rf"-D{name}=\s*(\d+)\s*$", o)
        if m:
            return int(m.group(1))
    return default


def macro_off(options, name) -> bool:
    """True when the NVRTC options set macro ``name`` to 0 (-DNAME=0)."""
    return any(re.match(rf"-D{name}=\s*0\s*$", o) for o in options)


def tiles(D: int, options=()) -> tuple:
    """(key rows per tile, K slots, V slots) of pw90::FwdCfg<D> built with ``options``."""
    bn, (ks, vs) = BN[D], capability.HOPPER_FWD_SLOTS[D]
    if D == 128:
        bn, ks = macro_value(options, "PW90_BN128", bn), macro_value(options, "PW90_KSLOTS128", ks)
    else:
        bn, ks = macro_value(options, "PW90_BN64", bn), macro_value(options, "PW90_KSLOTS64", ks)
    return bn, ks, vs


def block_m(D: int, options=()) -> int:
    """Query rows per CTA of pw90::FwdCfg<D> built with ``options`` (-DPW90_BM64=128: two
    consumer warpgroups at D = 64, the default before 192); the kernel runs 128 threads per
    64 rows plus a producer warpgroup. Without the macro, the default of the source built
    (source_of: a -DPW90_PROBE_SOURCE kernel written out from an older revision may have
    another)."""
    if D != 64:
        return BM[D]
    path = os.path.join(ROOT, "kernels_cu", source_of(options))
    with open(path) as f:
        m = re.search(r"^#define PW90_BM64 (\d+)\s*$", f.read(), re.M)
    return macro_value(options, "PW90_BM64", int(m.group(1)) if m else 128)


def smem_bytes(D: int, options=()) -> int:
    """Dynamic shared memory of pw90_forward<T, D, *> built with ``options``: the package's
    figure (capability.hopper_shared_bytes) with the tiles those macros set."""
    bn, ks, vs = tiles(D, options)
    return capability.hopper_shared_bytes(D, block_n=bn, slots=(ks, vs),
                                          block_m=block_m(D, options))


def source_of(options=()) -> str:
    """The kernel file to build: SOURCE, or kernels_cu/sm90/<NAME>.cu for a variant with
    -DPW90_PROBE_SOURCE=NAME (an A/B against another version of the kernel, e.g. one
    written out by `git show REV:kernels_cu/sm90/forward.cu`; give it the -D options that
    make tiles() describe its tile shape)."""
    for o in options:
        m = re.match(r"-DPW90_PROBE_SOURCE=(\w+)$", o)
        if m:
            return f"sm90/{m.group(1)}.cu"
    return SOURCE


def name_expr(dtype: str, D: int, causal: bool) -> str:
    return f"pw90_forward<{ELEM[dtype]}, {D}, {'true' if causal else 'false'}>"


NAMES = [name_expr(t, d, c) for t in ("bfloat16", "float16") for d in (64, 128) for c in (False, True)]


# ============================================================================ kernel loading

def nvrtc_cubin(names, options):
    """The kernel file of ``options`` (:func:`source_of`) compiled by cuda.bindings' NVRTC:
    (cubin, {name: lowered}, log)."""
    return probe_common.nvrtc_cubin(source_of(options), names, options)


class Kernels:
    """The eight instantiations loaded on the current device: name -> (CUfunction ptr, smem)."""

    def __init__(self, extra_options=(), via="rawmodule"):
        import cupy

        self.fns = {}
        self.via = via
        opts = ("-std=c++17", "-arch=sm_90a") + tuple(extra_options)
        if via == "rawmodule":
            self.mod = cupy.RawModule(code=splice(source_of(opts)), options=opts,
                                      name_expressions=NAMES)
            get = lambda n: self.mod.get_function(n)  # noqa: E731
        else:  # our own NVRTC cubin, loaded from a file
            cubin, lowered, _ = nvrtc_cubin(NAMES, list(opts))
            fd, path = tempfile.mkstemp(suffix=".cubin")
            os.write(fd, cubin)
            os.close(fd)
            self.mod = cupy.RawModule(path=path)
            get = lambda n: self.mod.get_function(lowered[n])  # noqa: E731
        #: PW90_PERSIST (default on; -DPW90_PERSIST=0 turns it off): non-causal launches get a
        #: grid of at most one CTA per SM
        self.persist = not macro_off(opts, "PW90_PERSIST")
        #: FwdCfg<D>::PAIRS (PW90_PAIRS64 / PW90_PAIRS128): causal launches of that head dim
        #: get the persistent grid too, over units of two query tiles
        #: (a -DPW90_PROBE_SOURCE kernel may predate the pairs walk: off unless the macro
        #: says otherwise)
        older = any(o.startswith("-DPW90_PROBE_SOURCE=") for o in opts)
        self.pairs = {D: self.persist and bool(macro_value(
            opts, f"PW90_PAIRS{D}", 0 if older else int(capability.HOPPER_CAUSAL_PAIRS[D])))
            for D in (64, 128)}
        self.sms = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["multiProcessorCount"]
        for n in NAMES:
            k = get(n)
            D = 64 if ", 64," in n else 128
            k.max_dynamic_shared_size_bytes = smem_bytes(D, opts)
            self.fns[n] = (k, smem_bytes(D, opts))
        self.bn = {D: tiles(D, opts)[0] for D in (64, 128)}
        self.bm = {D: block_m(D, opts) for D in (64, 128)}

    def launch(self, q1, k1, q2, k2, v, o, lse, w, causal, sm_scale=None):
        """o, lse: preallocated torch tensors ((B,H,M,D) unit-stride D; (B,H,M) contiguous)."""
        import cupy
        import torch

        from cupy_piecewise import tma

        dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[q1.dtype]
        B, H, M, D = q1.shape
        Hkv, N = k1.shape[1], k1.shape[2]
        if M == 0:
            return
        assert N > 0, "N == 0 is the caller's (o = 0, lse = -inf)"
        k, smem = self.fns[name_expr(dtype, D, causal)]
        bn = self.bn[D]
        bm = self.bm[D]
        maps = [tma.tensor_map_bhld(t.data_ptr(), t.shape, t.stride(), dtype, bm) for t in (q1, q2)]
        maps += [tma.tensor_map_bhld(t.data_ptr(), t.shape, t.stride(), dtype, bn) for t in (k1, k2, v)]
        scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
        nd = M + N + 1
        wc = max(-nd, min(nd, int(w)))
        # FwdParams: o and its strides, lse, H, group, M, N, w, shift (P = N - M), the two
        # float32 scales, the batch, then the packed batch's cu_q, cu_k (0)
        fields = (o.data_ptr(), o.stride(0), o.stride(1), o.stride(2),
                  lse.data_ptr() if lse is not None else 0, H, H // Hkv, M, N, wc, N - M,
                  scale * LOG2E, scale)
        grid = ((M + bm - 1) // bm, H, B)
        params = ctypes.create_string_buffer(struct.pack("<Qqqq Q qqqqqq ff q QQ", *fields, B, 0, 0))
        if self.persist and not causal:  # the kernel's PERSIST: dense, non-causal
            grid = (min(grid[0] * H * B, self.sms), 1, 1)
        elif self.pairs[D]:  # causal, PERSIST_PAIRS
            grid = (min((grid[0] + 1) // 2 * H * B, self.sms), 1, 1)
        ptrs = [m.address() for m in (maps[0], maps[1], maps[2], maps[3], maps[4])]
        ptrs.append(ctypes.addressof(params))
        args = (ctypes.c_void_p * 6)(*ptrs)
        stream = torch.cuda.current_stream().cuda_stream
        cupy.cuda.driver.launchKernel(k.kernel.ptr, grid[0], grid[1], grid[2], 128 + 2 * bm, 1, 1, smem,
                                      stream, ctypes.addressof(args), 0)
        self._keep = (maps, params, args)  # alive until the launch has copied them (it has)


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
        dev = cupy.cuda.Device(0)
        cc = dev.compute_capability
        props = cupy.cuda.runtime.getDeviceProperties(0)
    except Exception as e:
        say(f"SKIP: no usable CUDA device ({type(e).__name__}: {e})")
        return 2
    say(f"device 0: {props['name'].decode() if isinstance(props['name'], bytes) else props['name']}, "
        f"cc {cc}, SMs {props['multiProcessorCount']}, smem/block optin "
        f"{props.get('sharedMemPerBlockOptin', '?')}, driver {cupy.cuda.runtime.driverGetVersion()}")
    if cc != "90":
        say(f"SKIP: compute capability {cc}, this probe needs 9.0")
        return 2
    for D in (64, 128):
        say(f"smem bytes D={D}: {smem_bytes(D)} (block_n {BN[D]})")

    # 1. through cupy.RawModule, as the package would
    t = time.time()
    try:
        Kernels(via="rawmodule")
        say(f"BUILD rawmodule OK ({time.time() - t:.1f} s): options ('-std=c++17', '-arch=sm_90a'); "
            f"wgmma/setmaxnreg assembled, so the target was sm_90a")
    except Exception as e:
        say(f"BUILD rawmodule FAIL ({time.time() - t:.1f} s): {type(e).__name__}: {str(e)[:3000]}")
        t = time.time()
        try:
            Kernels(via="cubin")
            say(f"BUILD cubin OK ({time.time() - t:.1f} s): later phases load the NVRTC cubin")
        except Exception as e2:
            say(f"BUILD cubin FAIL: {type(e2).__name__}: {str(e2)[:3000]}")
    # 2. offline NVRTC: ptxas report + cubin
    cubin = None
    try:
        cubin, lowered, log = nvrtc_cubin(NAMES, ["-std=c++17", "-arch=sm_90a", "-Xptxas=-v"])
        blocks, cur = {}, None
        for line in log.splitlines():
            m = re.search(r"Compiling entry function '([^']+)'", line)
            if m:
                cur = m.group(1)
                blocks[cur] = ""
            elif cur:
                blocks[cur] += line + "\n"
            if "C75" in line:
                say("ptxas: " + line.strip())
        for n in NAMES:
            b = blocks.get(lowered[n], "")
            regs = re.search(r"Used (\d+) registers", b)
            sp = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", b)
            say(f"REGS {n}: {regs.group(1) if regs else '?'} registers (entry cap; setmaxnreg "
                f"moves consumers to 232), stack/spill st/ld {sp.groups() if sp else '?'}")
    except Exception as e:
        say(f"NVRTC offline: {type(e).__name__}: {str(e)[:2000]}")
    # 3. SASS
    tool = find_tool("cuobjdump")
    if cubin and tool:
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "fwd.cubin")
            with open(p, "wb") as f:
                f.write(cubin)
            r = subprocess.run([tool, "-sass", p], capture_output=True, text=True, timeout=60)
            sass = r.stdout
            if not sass.strip():
                say(f"cuobjdump gave no SASS: {r.stderr[:500]}")
            funcs = re.split(r"\n\s*Function : ", sass)[1:]
            for f in funcs:
                fname = f.split("\n", 1)[0].strip()
                cnt = {k: len(re.findall(k, f)) for k in
                       ("HGMMA", "UTMALDG", "SYNCS", "WARPGROUP.ARRIVE", "USETMAXREG", "LDL", "STL",
                        "MUFU.EX2", "BAR.SYNC")}
                regs = [int(x) for x in re.findall(r"\bR(\d+)\b", f)]
                say(f"SASS {fname}: max R{max(regs) if regs else '?'}, " +
                    ", ".join(f"{k} {v}" for k, v in cnt.items()))
    else:
        say(f"SASS: skipped (cuobjdump {'not found' if not tool else 'ok'}, cubin "
            f"{'ok' if cubin else 'missing'})")
    return 0


def make_cases():
    cases = []
    for dt in ("bfloat16", "float16"):
        for D in (64, 128):
            for causal in (False, True):
                for L in (128, 200, 1000):
                    for w in (-3, 37, 5000):
                        cases.append(dict(dtype=dt, D=D, causal=causal, B=1, H=4, Hkv=2, M=L, N=L, w=w))
    for D in (64, 128):
        for causal in (False, True):
            extra = [dict(M=200, N=1000, w=300), dict(M=1000, N=200, w=5),
                     dict(M=50, N=50, w=10), dict(M=300, N=300, w=BN[D]),
                     dict(M=300, N=300, w=128, layout="blhd", B=2, H=4, Hkv=4),
                     dict(M=257, N=385, w=-200, B=2, H=8, Hkv=2)]
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
    return q1, k1, q2, k2, v


def run_case(torch, kern, c, seed):
    from cupy_piecewise import reference, tolerance

    q1, k1, q2, k2, v = make_inputs(torch, c, seed)
    B, H, M, D = c["B"], c["H"], c["M"], c["D"]
    o = torch.full((B, H, M, D), float("nan"), device="cuda", dtype=q1.dtype)
    lse = torch.full((B, H, M), float("nan"), device="cuda", dtype=torch.float32)
    kern.launch(q1, k1, q2, k2, v, o, lse, c["w"], c["causal"])
    torch.cuda.synchronize()
    G = H // c["Hkv"]

    def np64(t, rep=1):
        x = t.float().cpu().numpy()
        return x.repeat(rep, axis=1) if rep > 1 else x

    args = [np64(q1), np64(k1, G), np64(q2), np64(k2, G), np64(v, G)]
    ro, rl = reference.forward(*args, c["w"], c["causal"])
    lo, ll = reference.lowp_forward(*args, c["w"], c["causal"], dtype=c["dtype"])
    vo = tolerance.compare("o", np64(o), ro, lo, c["dtype"])
    vl = tolerance.compare("lse", lse.cpu().numpy(), rl, ll, c["dtype"])
    return vo, vl


def phase_check(args):
    import torch

    kern = Kernels(via=args.via, extra_options=tuple(args.opt))
    cases = make_cases()
    todo = range(args.start, len(cases))
    if args.cases:
        todo = [int(x) for x in args.cases.split(",") if int(x) >= args.start]
    say(f"check: {len(cases)} cases, running {len(todo)} from {args.start}, kernels via {args.via} "
        f"{args.opt}")
    npass = nfail = 0
    for i in todo:
        c = cases[i]
        say(f"CASE {i} START {describe(c)}")
        t = time.time()
        try:
            vo, vl = run_case(torch, kern, c, seed=1000 + i)
            ok = vo.passed and vl.passed
            npass += ok
            nfail += not ok
            say(f"{'PASS' if ok else 'FAIL'} {i} {describe(c)} ({time.time() - t:.1f} s)\n"
                f"     o:   max {vo.max_err:.3e} (bound {vo.bound:.3e}) rel {vo.rel_err:.2e} finite {vo.finite}\n"
                f"     lse: max {vl.max_err:.3e} (bound {vl.bound:.3e}) rel {vl.rel_err:.2e} "
                f"finite {vl.finite} nonfinite-mismatch {vl.nonfinite_mismatch}")
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


def cuda_time(torch, fn, warmup=3, reps=20):
    return probe_common.cuda_time(torch, fn, warmup, reps)


#: calls per timed sample of the --variants grid: this probe encodes five tensor maps on the
#: host for every launch (tens of microseconds), which a sample of one call would count as
#: GPU time; a back-to-back batch keeps the GPU busy while the host prepares the next launch
VT_BATCH = 8


def batch_time(torch, fn, warmup=2, reps=15):
    """Median milliseconds per call of ``fn`` over samples of :data:`VT_BATCH` calls."""
    def many():
        for _ in range(VT_BATCH):
            fn()
    return cuda_time(torch, many, warmup, reps) / VT_BATCH


def phase_time(args):
    import torch
    import torch.nn.functional as F

    kern = None
    if not args.skip_ours:
        try:
            kern = Kernels(via=args.via, extra_options=tuple(args.opt))
        except Exception as e:
            say(f"time: our kernels failed to load: {e!r}")
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception:
        SDPBackend = sdpa_kernel = None
    try:
        import cupy_piecewise
    except Exception as e:
        cupy_piecewise = None
        say(f"cupy_piecewise import failed: {e!r}")
    B, L = 2, 8192
    for D in (64, 128):
        for causal in (False, True):
            try:
                rc = _time_config(torch, F, kern, SDPBackend, sdpa_kernel, cupy_piecewise, B, L, D, causal)
                torch.cuda.empty_cache()
            except Exception as e:
                say(f"TIME D={D} causal={causal}: ERROR {type(e).__name__}: {str(e)[:300]}")
                rc = 0
                try:
                    torch.cuda.synchronize()
                except Exception:
                    rc = 3
            if rc:
                say("CUDA context lost: stopping the time phase")
                return rc
    return 0


def _time_config(torch, F, kern, SDPBackend, sdpa_kernel, cupy_piecewise, B, L, D, causal):
    """Times one (D, causal) configuration for every provider; prints TIME and AGREE lines."""
    H = 2048 // D
    w = L // 4
    g = torch.Generator(device="cuda")
    g.manual_seed(7)
    mk = lambda: torch.randn(B, H, L, D, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q1, k1, q2, k2, v = mk(), mk(), mk(), mk(), mk()
    o = torch.empty_like(q1)
    lse = torch.empty(B, H, L, device="cuda", dtype=torch.float32)
    flops = 4 * B * H * L * L * D * (0.5 if causal else 1.0)
    head = f"bf16 B={B} H={H} L={L} D={D} w={w} {'causal' if causal else 'full'}"
    provs = {}
    if kern is not None:
        provs["pw90 (this)"] = lambda: kern.launch(q1, k1, q2, k2, v, o, lse, w, causal)
    if sdpa_kernel is not None:
        def flash():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q1, k1, v, is_causal=causal)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q1, k1, v, is_causal=causal)
        provs["sdpa_flash"] = flash
        provs["sdpa_cudnn"] = cudnn
    if cupy_piecewise is not None:
        provs["piecewise_mma"] = lambda: cupy_piecewise.attention(q1, k1, q2, k2, v, w, causal=causal)
    for name, fn in provs.items():
        try:
            ms = cuda_time(torch, fn)
            say(f"TIME {head} {name:14s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s")
        except Exception as e:
            say(f"TIME {head} {name:14s} ERROR {type(e).__name__}: {str(e)[:300]}")
            torch.cuda.synchronize()  # raises if the context is lost
    if kern is not None and cupy_piecewise is not None:
        try:  # large-scale agreement with the mma.sync path
            kern.launch(q1, k1, q2, k2, v, o, lse, w, causal)
            ref = cupy_piecewise.attention(q1, k1, q2, k2, v, w, causal=causal).float()
            rel = ((o.float() - ref).norm() / ref.norm()).item()
            say(f"AGREE {head}: ||pw90 - mma|| / ||mma|| = {rel:.3e}, "
                f"max {(o.float() - ref).abs().max().item():.3e}")
        except Exception as e:
            say(f"AGREE {head}: ERROR {type(e).__name__}: {str(e)[:300]}")
    return 0  # the tensors die with this frame


# ============================================================================ --variants

#: timing grid of --variants: bf16, B = 16384 / L, H = 2048 / D, w = L / 4, at these lengths
#: (--vt-lengths replaces them), D 64 and 128, causal or not
VT_LENGTHS = (2048, 8192)
#: (no -DPW90_WAIT_SPIN_LIMIT in --variants: it changes register allocation, e.g. spills in
#: PW90_PINGPONG=1 PW90_OVERLAP=1 PW90_PERSIST=0, so the check would not run the timed code; a deadlock
#: shows as a hung worker instead, killed after PHASES["vrun"][1] s of silence, its last
#: "CASE i START" line naming the case)


def vt_configs(lengths=VT_LENGTHS) -> list:
    """The --variants timing cells: (L, D, causal) for each length, D 64/128, causal or not."""
    return [(L, D, c) for L in lengths for D in (64, 128) for c in (0, 1)]


def reduced_cases():
    """32 cases for --variants (run after make_cases()'s 96): every (dtype, D, causal) with M = N = 200 (w = 37: straddling
    tiles), M = N = 1000 (w = -3, far only / 5000, near only) and M = 257, N = 385, w = -200,
    GQA 4:1; plus bf16 blhd layout, M < N and M > N cases."""
    cases = []
    for dt in ("bfloat16", "float16"):
        for D in (64, 128):
            for causal in (False, True):
                base = dict(dtype=dt, D=D, causal=causal, B=1, H=4, Hkv=2)
                cases.append(dict(base, M=200, N=200, w=37))
                cases.append(dict(base, M=1000, N=1000, w=-3 if dt == "bfloat16" else 5000))
                cases.append(dict(base, M=257, N=385, w=-200, B=2, H=8, Hkv=2))
    for D in (64, 128):
        for causal in (False, True):
            base = dict(dtype="bfloat16", D=D, causal=causal, B=1, H=4, Hkv=2)
            cases.append(dict(base, M=300, N=300, w=128, layout="blhd", B=2, H=4, Hkv=4))
            cases.append(dict(base, M=200, N=1000, w=300) if D == 128 else dict(base, M=1000, N=200, w=5))
    return cases


def variant_options(spec: str):
    """'PW90_PINGPONG=1 PW90_PERSIST=0' -> ['-DPW90_PINGPONG=1', '-DPW90_PERSIST=0']."""
    return [t if t.startswith("-") else f"-D{t}" for t in spec.split()]


def phase_vrun(args):
    """One variant (its -D options in args.opt): reduced check, then the timing grid."""
    import torch

    opts = tuple(args.opt)
    tag = " ".join(o[2:] if o.startswith("-D") else o for o in opts) or "(default)"
    t = time.time()
    try:
        kern = Kernels(via=args.via, extra_options=opts)
    except Exception as e:
        say(f"VBUILD FAIL {tag}: {type(e).__name__}: {str(e)[:2000]}")
        return 1
    say(f"VBUILD OK {tag} ({time.time() - t:.1f} s)")
    sms = kern.sms
    if kern.persist:
        kern.sms = 3  # the check's grids are small: make each CTA walk several work tiles
    # 128 cases, a few seconds on an H200 (none in a later round: --time-only)
    cases = [] if args.time_only else make_cases() + reduced_cases()
    npass = nfail = 0
    worst = 0.0
    for i, c in enumerate(cases):
        if i < args.start:
            continue
        say(f"CASE {i} START {describe(c)}")
        try:
            vo, vl = run_case(torch, kern, c, seed=2000 + i)
            ok = vo.passed and vl.passed
            worst = max(worst, vo.max_err / vo.bound if vo.bound else 0.0)
            npass += ok
            nfail += not ok
            if not ok:
                say(f"FAIL {i} {describe(c)}: o max {vo.max_err:.3e} (bound {vo.bound:.3e}) finite "
                    f"{vo.finite}; lse max {vl.max_err:.3e} (bound {vl.bound:.3e}) finite {vl.finite}")
        except Exception as e:
            nfail += 1
            say(f"ERROR {i} {describe(c)}: {type(e).__name__}: {str(e)[:500]}")
            try:
                torch.cuda.synchronize()
            except Exception:
                say(f"VCHECK {tag}: {npass} pass, {nfail} fail, CUDA context lost at case {i}")
                return 3
    if not args.time_only:
        say(f"VCHECK {tag}: {npass} pass, {nfail} fail of {len(cases) - args.start} "
            f"(worst o error / bound {worst:.2f})")
    if args.skip_ours:
        return 0
    kern.sms = sms
    try:
        import cupy_piecewise
    except Exception as e:
        cupy_piecewise = None
        say(f"cupy_piecewise import failed (no large-scale agreement check): {e!r}")
    for L, D, causal in vt_configs(args.vt_lengths):
        _vtime_ours(torch, kern, tag, L, D, bool(causal), cupy_piecewise if not args.time_only else None)
        torch.cuda.empty_cache()
    return 0


def _vtime_ours(torch, kern, tag, L, D, causal, cupy_piecewise=None):
    B, H, w = 16384 // L, 2048 // D, L // 4
    g = torch.Generator(device="cuda")
    g.manual_seed(7)
    mk = lambda: torch.randn(B, H, L, D, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q1, k1, q2, k2, v = mk(), mk(), mk(), mk(), mk()
    o = torch.empty_like(q1)
    lse = torch.empty(B, H, L, device="cuda", dtype=torch.float32)
    flops = 4 * B * H * L * L * D * (0.5 if causal else 1.0)
    try:
        ms = batch_time(torch, lambda: kern.launch(q1, k1, q2, k2, v, o, lse, w, causal))
        say(f"VTIME {tag} | L={L} D={D} causal={int(causal)} | {ms:.4f} ms {flops / ms / 1e9:.1f} TFLOP/s")
    except Exception as e:
        say(f"VTIME {tag} | L={L} D={D} causal={int(causal)} | ERROR {type(e).__name__}: {str(e)[:200]}")
        torch.cuda.synchronize()
        return
    if cupy_piecewise is not None:  # agreement with the package's forward at full scale
        try:
            kern.launch(q1, k1, q2, k2, v, o, lse, w, causal)
            ref = cupy_piecewise.attention(q1, k1, q2, k2, v, w, causal=causal).float()
            rel = ((o.float() - ref).norm() / ref.norm()).item()
            say(f"VAGREE {tag} | L={L} D={D} causal={int(causal)} | {rel:.3e}")
        except Exception as e:
            say(f"VAGREE {tag} | L={L} D={D} causal={int(causal)} | ERROR {type(e).__name__}: {str(e)[:200]}")
            torch.cuda.synchronize()


def phase_vbase(args):
    """SDPA cuDNN and flash (standard attention, q1/k1/v) on the --variants timing grid."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for L, D, causal in vt_configs(args.vt_lengths):
        _vtime_sdpa(torch, F, SDPBackend, sdpa_kernel, L, D, bool(causal))
        torch.cuda.empty_cache()
    return 0


def _vtime_sdpa(torch, F, SDPBackend, sdpa_kernel, L, D, causal):
    B, H = 16384 // L, 2048 // D
    g = torch.Generator(device="cuda")
    g.manual_seed(7)
    mk = lambda: torch.randn(B, H, L, D, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v = mk(), mk(), mk()
    flops = 4 * B * H * L * L * D * (0.5 if causal else 1.0)
    for name, be in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        def fn(be=be):
            with sdpa_kernel(be):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        try:
            ms = batch_time(torch, fn)
            say(f"VTIME {name} | L={L} D={D} causal={int(causal)} | {ms:.4f} ms {flops / ms / 1e9:.1f} TFLOP/s")
        except Exception as e:
            say(f"VTIME {name} | L={L} D={D} causal={int(causal)} | ERROR {type(e).__name__}: {str(e)[:200]}")
            torch.cuda.synchronize()


def run_variants(specs, via, log, budget_s=225.0, rounds=1, lengths=VT_LENGTHS):
    """--variants: the default build and each variant in its own worker, ``rounds`` times in
    interleaved order (default, A, B, default, A, B, ...), each round after a run of the SDPA
    baselines; the first round also checks each build (128 cases), later ones time only.
    Prints the comparison table (:func:`variants_table`). Stays within budget_s seconds."""
    t0 = time.time()
    specs = [""] + [" ".join(v.split()) for v in specs if v.strip()]
    grid = ["--vt-lengths", ",".join(map(str, lengths))]
    log("=" * 20 + f" variants: {len(specs)} builds (the default first), {rounds} round(s), "
        f"L {', '.join(map(str, lengths))}, budget {budget_s:.0f} s")
    allines, checks = [], {}
    # a first-round run checks and times (about twice a later round's time-only run)
    weight_left = (2 + (rounds - 1)) * len(specs)
    for r in range(rounds):
        status, lines = run_worker("vbase", ["--via", via] + grid, 40 + 10 * len(lengths), 30, log)
        log(f"[round {r + 1}: vbase worker: {status}]")
        allines += lines
        for spec in specs:
            tag = spec or "(default)"
            weight = 2 if r == 0 else 1
            share = (budget_s - (time.time() - t0)) * weight / weight_left
            weight_left -= weight
            if share < 15:
                log(f"[variants: out of time before round {r + 1} of '{tag}']")
                continue
            extra = ["--via", via] + grid + [f"--opt={o}" for o in variant_options(spec)]
            if r > 0:
                extra.append("--time-only")
            status, lines = run_worker("vrun", extra, min(share, 90), 25, log)
            log(f"[round {r + 1}: vrun worker '{tag}': {status}]")
            allines += lines
            if r == 0:
                vc = [ln for ln in lines if ln.startswith("VCHECK")]
                started = [ln for ln in lines if re.match(r"CASE \d+ START", ln)]
                checks[tag] = (vc[-1].split(":", 1)[1].strip() if vc else
                               f"no result ({status}{'; last: ' + started[-1] if started else ''})")
    for line in variants_table(allines, [s or "(default)" for s in specs], checks, lengths):
        log(line)
    log(f"[variants done in {time.time() - t0:.0f} s]")


def variants_table(lines, tags, checks, lengths=VT_LENGTHS) -> list:
    """The --variants comparison from the workers' VTIME / VAGREE lines: per build (``tags``,
    then sdpa_cudnn and sdpa_flash) and cell, the median TFLOP/s over the rounds that timed
    it; under each build its ratio to sdpa_cudnn's median, and with several rounds the
    spread (max - min) / median in percent, so that a difference can be read against the
    noise of the same build. ``checks``: tag -> the first round's check verdict."""
    times = {}
    for ln in lines:
        m = re.match(r"VTIME (.+?) \| L=(\d+) D=(\d+) causal=(\d) \| ([\d.]+) ms ([\d.]+) TFLOP/s", ln)
        if m:
            key = (m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)))
            times.setdefault(key, []).append(float(m.group(6)))
    agree = {}
    for ln in lines:
        m = re.match(r"VAGREE (.+?) \| .*\| ([\d.e+-]+)$", ln)
        if m:
            agree[m.group(1)] = max(agree.get(m.group(1), 0.0), float(m.group(2)))
        elif ln.startswith("VAGREE") and "ERROR" in ln:
            agree[ln.split("|")[0][7:].strip()] = float("nan")
    checks = dict(checks)
    for tag in checks:
        if tag in agree:
            checks[tag] += f"; vs package fwd at scale: max rel {agree[tag]:.1e}"
    med = {k: statistics.median(v) for k, v in times.items()}
    several = any(len(v) > 1 for v in times.values())
    cols = vt_configs(lengths)
    head = "".join("{:>12s}".format(f"L{L // 1024}k D{D}" + (" c" if c else "")) for L, D, c in cols)
    out = ["=" * 20 + " variants table: bf16 TFLOP/s (B = 16384/L, H = 2048/D, w = L/4), median "
           "over rounds; under each variant: ratio to sdpa_cudnn"
           + ("; spread = (max - min) / median over rounds, %" if several else ""),
           f"{'variant':34s}{head}  check"]
    for r in list(tags) + ["sdpa_cudnn", "sdpa_flash"]:
        vals = [med.get((r,) + c) for c in cols]
        out.append(f"{r[:34]:34s}" + "".join(f"{v:12.1f}" if v else f"{'-':>12s}" for v in vals)
                   + (f"  {checks.get(r, '')}" if r in checks else ""))
        if r not in ("sdpa_cudnn", "sdpa_flash"):
            ref = [med.get(("sdpa_cudnn",) + c) for c in cols]
            out.append(f"{'  / cudnn':34s}" + "".join(f"{v / b:12.3f}" if v and b else f"{'-':>12s}"
                                                     for v, b in zip(vals, ref)))
        if several:
            spread = []
            for c in cols:
                v = times.get((r,) + c, [])
                spread.append(f"{100 * (max(v) - min(v)) / statistics.median(v):11.1f}%"
                              if len(v) > 1 else f"{'-':>12s}")
            out.append(f"{'  spread (n = rounds timed)':34s}" + "".join(spread))
    return out


# ============================================================================ parent

def run_worker(phase, extra, deadline_s, idle_s, log):
    """This script's ``--worker phase`` in a fresh process (probe_common.run_worker)."""
    return probe_common.run_worker(__file__, phase, extra, deadline_s, idle_s, log)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="also write the report here")
    ap.add_argument("--worker", choices=list(PHASES), help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--skip-ours", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cases", default="", help=argparse.SUPPRESS)
    ap.add_argument("--via", choices=("rawmodule", "cubin"), default="rawmodule",
                    help="load the kernels through cupy.RawModule(code=...) or our own NVRTC cubin")
    ap.add_argument("--opt", action="append", default=[],
                    help="extra NVRTC option for the kernels, e.g. -DPW90_PV_SPLIT=1 (repeatable)")
    ap.add_argument("--phases", default="build,check,time")
    ap.add_argument("--variants", default=None,
                    help="A/B compile-time variants instead of the phases: ';'-separated specs, each "
                         "space-separated NAME=VALUE macros, e.g. \"PW90_PERSIST=0;PW90_PINGPONG=1 "
                         "PW90_PERSIST=0\" (ping-pong needs PW90_PERSIST=0). The default build always "
                         "runs first. Per "
                         "build: 128-case check against float64, then bf16 timing at L 2048/8192, D "
                         "64/128, causal or not; SDPA cuDNN/flash once; a comparison table. < 4 min.")
    ap.add_argument("--rounds", type=int, default=1,
                    help="--variants: time every build this many times, interleaved (the first "
                         "round also checks); the table gives medians and the spread")
    ap.add_argument("--vt-lengths", type=lambda t: tuple(int(x) for x in t.split(",")),
                    default=VT_LENGTHS, help="--variants: sequence lengths of the timing grid "
                    "(default 2048,8192; each L takes B = 16384 / L)")
    ap.add_argument("--time-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--budget-s", type=float, default=225.0,
                    help="--variants: seconds for the whole comparison (default 225; about 30-60 "
                         "per build)")
    args = ap.parse_args()

    if args.worker:
        try:
            rc = {"build": phase_build, "check": phase_check, "variant": phase_check,
                  "time": phase_time, "vrun": phase_vrun, "vbase": phase_vbase}[args.worker](args)
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

    log(f"hopper_probe: {time.strftime('%Y-%m-%d %H:%M:%S')} repo {ROOT}")
    log(f"sources {probe_common.source_stamp()}")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.variants is not None:
        run_variants(args.variants.split(";"), args.via, log, args.budget_s, args.rounds,
                     args.vt_lengths)
        log(f"hopper_probe done in {time.time() - t_start:.0f} s")
        if out:
            out.close()
        return
    common = ["--via", args.via] + [f"--opt={o}" for o in args.opt]
    phases = args.phases.split(",")
    our_ok = True
    if "build" in phases:
        log("=" * 20 + " build")
        status, lines = run_worker("build", common, *PHASES["build"], log)
        log(f"[build worker: {status}]")
        if status == 2:
            log("no cc 9.0 GPU: stopping")
            return
        raw_failed = any(ln.startswith("BUILD rawmodule FAIL") for ln in lines)
        if (raw_failed or status in ("hang", "deadline")) and args.via == "rawmodule":
            log("RawModule build did not finish: later phases load the NVRTC cubin instead")
            common = ["--via", "cubin"] + [f"--opt={o}" for o in args.opt]
    if "check" in phases:
        log("=" * 20 + " check")
        start, restarts, hangs, failed = 0, 0, 0, False
        t_check = time.time()
        deadline = PHASES["check"][0]
        while True:
            left = deadline - (time.time() - t_check)
            if left < 10:
                log("[check: out of time]")
                break
            status, lines = run_worker("check", common + ["--start", str(start)], left,
                                       PHASES["check"][1], log)
            log(f"[check worker from case {start}: {status}]")
            failed |= any(ln.startswith(("FAIL", "ERROR")) for ln in lines)
            if status == 0:
                break
            started = [int(m.group(1)) for ln in lines for m in [re.match(r"CASE (\d+) START", ln)] if m]
            if status == "hang":
                our_ok = False
                hangs += 1
            if not started or restarts >= 4 or hangs >= 2:
                if hangs >= 2:
                    log("two hangs: giving up on the check phase")
                break
            log(f"HANG/CRASH at case {started[-1]}: resuming after it")
            failed = True
            start = started[-1] + 1
            restarts += 1
        if failed and our_ok and "-DPW90_PV_SPLIT=1" not in args.opt:
            log("=" * 20 + " variant: -DPW90_PV_SPLIT=1 on a subset (the main check failed)")
            status, _ = run_worker("variant", common + ["--opt=-DPW90_PV_SPLIT=1", "--cases",
                                   ",".join(map(str, VARIANT_CASES))], *PHASES["variant"], log)
            log(f"[variant worker: {status}]")
    if "time" in phases:
        log("=" * 20 + " time")
        extra = common + ([] if our_ok else ["--skip-ours"])
        if not our_ok:
            log("(our kernel hung in the check phase: timing only the baselines)")
        status, _ = run_worker("time", extra, *PHASES["time"], log)
        log(f"[time worker: {status}]")
    log(f"hopper_probe done in {time.time() - t_start:.0f} s")
    if out:
        out.close()


if __name__ == "__main__":
    main()
