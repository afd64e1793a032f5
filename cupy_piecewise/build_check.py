"""``python -m cupy_piecewise build``: compile every selectable kernel variant, no GPU needed.

For each architecture asked for, every (phase, head dim, dtype, causal) entry the capability
table can select is compiled through NVRTC with ptxas's verbose report, and a table of
registers, stack and spill bytes per variant is printed. Exit status 1 on a compile error or
on any spill (a spilling variant is a tuning bug: fix the table or the kernel).

``--install`` instead compiles, on this machine's GPU, every variant its capability-table row
(and, on compute capability 9.0, the Hopper kernels) can select, and loads each once: CuPy
keeps the compiled modules in its on-disk kernel cache (``CUPY_CACHE_DIR``, default
``~/.cupy/kernel_cache``), so a fresh process's first call loads a cubin instead of
compiling (README, "Cold start").
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from . import capability
from .compile import (HOPPER_KERNELS, HOPPER_UNCAUSAL, HOPPER_VARLEN_PHASES, ROTARY_LAYOUTS,
                      Variant, compile_offline, get_function)


def variants_for(cc, hopper: bool = False) -> list[Variant]:
    """Every kernel variant the table can select on ``cc``, plus the per-row kernels and the
    KV-cache kernels' rotary-inside forms; with ``hopper`` (``--arch sm_90a``) the wgmma +
    TMA kernels instead (the TMA decode with its rotary forms too, their staged-table
    forms at cluster 1, the only cluster kvcache_launch.staged_tables picks them for, and the
    paged D = 64 entry at every cluster size)."""
    if hopper:
        return [Variant(phase, dtype, d, capability.kv90_tiles(d) if phase == "kvdecode_sm90"
                        else None, causal, varlen, cluster, rotary, staged, pages)
                for phase in HOPPER_KERNELS
                for dtype in capability.HALF_DTYPES for d in capability.hopper_head_dims(phase)
                for causal in ((False,) if phase in HOPPER_UNCAUSAL else (False, True))
                for varlen in ((False, True) if phase in HOPPER_VARLEN_PHASES else (False,))
                for cluster in (capability.KV90_CLUSTERS if phase == "kvdecode_sm90" else (1,))
                for rotary in ((0,) + tuple(ROTARY_LAYOUTS.values()) if phase == "kvdecode_sm90"
                               else (0,))
                for staged in ((False, True) if rotary and cluster == 1 else (False,))
                # the paged D = 64 entry (kvcache_launch.page_box)
                for pages in ((False, True) if phase == "kvdecode_sm90" and not rotary
                              and d == 64 and capability.KV90_PAGE_BOX else (False,))]
    out = set()
    for phase, head_dim, dtype, causal, tiles in capability.selectable_configs(cc):
        out.add(Variant(phase, dtype, head_dim, tiles, causal))
        out.add(Variant("bwd_delta", dtype, head_dim, None, False))
        out.add(Variant("fwd_combine", dtype, head_dim, None, False))
        if phase in capability.KV_PHASES:  # the KV-cache append, for the KV head dims
            out.add(Variant("kv_append", dtype, head_dim, None, False))
            for rotary in ROTARY_LAYOUTS.values():  # attention_with_rotary_kvcache
                out.add(Variant(phase, dtype, head_dim, tiles, causal, rotary=rotary))
        if phase in ("bwd_fused", "bwd_grid"):  # their float32 dQ sums to dq1, dq2
            out.add(Variant("bwd_dq_convert", dtype, head_dim, None, False))
    for phase, head_dim, dtype, causal, tiles in capability.selectable_configs(cc, varlen=True):
        out.add(Variant(phase, dtype, head_dim, tiles, causal, varlen=True))
    return sorted(out, key=lambda v: (v.filename, v.name_expression))


#: Registers per thread from which a variant is flagged as near the limit (255): such
#: variants have started to spill when the NVRTC version changed (sm_80 bwd_dkv D=128 at
#: 32x128x8 with NVRTC 13.5), so the table should give them room before that happens.
NEAR_LIMIT_REGISTERS = 250


def near_limit(report) -> bool:
    """True for an mma.sync variant (Hopper kernels report their setmaxnreg entry cap) that
    uses :data:`NEAR_LIMIT_REGISTERS` or more registers without spilling yet."""
    return (report.variant.phase not in HOPPER_KERNELS and report.ok
            and (report.registers or 0) >= NEAR_LIMIT_REGISTERS)


def _parse_arch(text: str) -> tuple[tuple[int, int], bool]:
    """``'sm_90'`` -> ((9, 0), False); ``'sm_90a'`` -> ((9, 0), True): the Hopper kernels."""
    t = text.strip().lower().removeprefix("sm_")
    hopper = t.endswith("a")
    t = t.removesuffix("a")
    if not t.isdigit() or len(t) < 2 or (hopper and t != "90"):
        raise argparse.ArgumentTypeError(f"--arch: cannot read {text!r}; expected e.g. sm_90 or sm_90a")
    return (int(t[:-1]), int(t[-1])), hopper


class _NoBar:
    """Stands in for tqdm where it is missing: iterates, counts nothing."""

    def __init__(self, it=None, **kw):
        self.it = it

    def __iter__(self):
        return iter(self.it)

    def update(self, n=1):
        pass

    def close(self):
        pass


def _progress():
    try:
        from tqdm import tqdm
    except ImportError:  # progress is a nicety; the summary line is the result
        return _NoBar
    return tqdm


def install_variants(cc: tuple[int, int]) -> list[Variant]:
    """What ``--install`` compiles for a GPU of compute capability ``cc``: every variant the
    capability table can select there and, on 9.0, the Hopper kernels."""
    out = variants_for(cc)
    if tuple(cc) == (9, 0):
        out += variants_for(cc, hopper=True)
    return out


def _install_some(device: int, variants: list[Variant]) -> list[str]:
    """Compile and load ``variants`` on ``device`` (in a worker process); the failures."""
    failed = []
    for v in variants:
        try:
            get_function(device, v)
        except Exception as e:  # report every variant that fails, then fail the command
            failed.append(f"{v.name_expression}: {type(e).__name__}: {e}")
    return failed


def install(device: int | None = None, jobs: int | None = None) -> int:
    """Compile and load every variant :func:`install_variants` lists on ``device`` (default:
    CuPy's current device), filling CuPy's on-disk kernel cache; returns the exit status.

    NVRTC holds the interpreter, so ``jobs`` worker processes (default: up to 8, one per
    core) compile in parallel, a few variants per task so the progress bar moves; this
    process then loads every variant once more, from the cache, to prove it is there.

    Raises RuntimeError when no CUDA GPU is visible (there is nothing to install for)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    import cupy

    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        count = 0
    if count == 0:
        raise RuntimeError("build --install needs a CUDA GPU visible to CuPy (it compiles for and "
                           "loads on that GPU); `build` without --install needs none")
    dev = cupy.cuda.Device(device)
    cc = (int(dev.compute_capability[:-1]), int(dev.compute_capability[-1]))
    variants = install_variants(cc)
    jobs = max(1, jobs or min(8, os.cpu_count() or 1))
    chunks = [variants[i:i + 4] for i in range(0, len(variants), 4)]
    t0 = time.time()
    failures: list[str] = []
    bar = _progress()(total=len(variants), desc=f"installing for sm_{cc[0]}{cc[1]}",
                      unit="kernel", file=sys.stderr)
    # spawn, not fork: a forked child of a process with a CUDA context cannot use CUDA
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_install_some, dev.id, chunk): len(chunk) for chunk in chunks}
        for fut in as_completed(futures):
            failures += fut.result()
            bar.update(futures[fut])
    bar.close()
    if not failures:
        failures = _install_some(dev.id, variants)  # cache hits now: seconds
    for line in failures:
        print(line, file=sys.stderr)
    cache_dir = os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))
    print(f"{len(variants) - len(failures)} of {len(variants)} kernel variants for "
          f"sm_{cc[0]}{cc[1]} compiled and cached in {cache_dir} in {time.time() - t0:.0f} s "
          f"({jobs} processes); {len(failures)} failure(s)")
    return 1 if failures else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cupy_piecewise build", description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=None,
                    help="--install: compiler processes (default: up to 8)")
    ap.add_argument("--install", action="store_true",
                    help="compile the variants this machine's GPU selects into CuPy's on-disk "
                         "kernel cache (needs the GPU; --arch is ignored), so that a fresh "
                         "process's first call does not compile")
    ap.add_argument("--arch", default=",".join(
                        [f"sm_{a}{b}" for a, b in capability.LISTED_ARCHS] + ["sm_90a"]),
                    help="comma-separated architectures (default: every listed one, and sm_90a "
                         "for the Hopper kernels)")
    args = ap.parse_args(argv)
    if args.install:
        try:
            return install(jobs=args.jobs)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 2
    archs = [_parse_arch(a) for a in args.arch.split(",") if a.strip()]
    tqdm = _progress()

    jobs = []
    for cc, hopper in archs:
        by_file: dict[str, list[Variant]] = {}
        for v in variants_for(cc, hopper):
            by_file.setdefault(v.filename, []).append(v)
        jobs += [(cc, vs) for vs in by_file.values()]

    failures = warnings = 0
    rows = []
    t0 = time.time()
    for cc, vs in tqdm(jobs, desc="compiling", unit="module", file=sys.stderr):
        try:
            rows += compile_offline(cc, vs)
        except RuntimeError as e:
            failures += 1
            print(e, file=sys.stderr)
    print(f"{'arch':6} {'regs':>4} {'stack':>5} {'spill st/ld':>11}  variant")
    for r in rows:
        bad = not r.ok or (r.spill_stores or 0) or (r.spill_loads or 0)
        failures += bool(bad)
        close = not bad and near_limit(r)
        warnings += close
        mark = "   <-- FAIL" if bad else ("   (near the register limit)" if close else "")
        print(f"{r.arch:6} {r.registers or 0:4d} {r.stack_bytes or 0:5d} "
              f"{r.spill_stores or 0:5d}/{r.spill_loads or 0:<5d}  {r.variant.name_expression}{mark}")
    names = ", ".join(f"sm_{a}{b}{'a' if h else ''}" for (a, b), h in archs)
    print(f"{len(rows)} variants compiled for {names} "
          f"in {time.time() - t0:.0f} s; {failures} failure(s)"
          + (f"; {warnings} variant(s) at {NEAR_LIMIT_REGISTERS}+ registers (not failures)"
             if warnings else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
