"""``python -m cupy_piecewise build``: compile every selectable kernel variant, no GPU needed.

For each architecture asked for, every (phase, head dim, dtype, causal) entry the capability
table can select is compiled through NVRTC with ptxas's verbose report, and a table of
registers, stack and spill bytes per variant is printed. Exit status 1 on a compile error or
on any spill (a spilling variant is a tuning bug: fix the table or the kernel).
"""
from __future__ import annotations

import argparse
import sys
import time

from . import capability
from .compile import HOPPER_KERNELS, HOPPER_ROW_KERNELS, Variant, compile_offline


def variants_for(cc, hopper: bool = False) -> list[Variant]:
    """Every kernel variant the table can select on ``cc``, plus the per-row kernels; with
    ``hopper`` (``--arch sm_90a``) the wgmma + TMA kernels instead."""
    if hopper:
        return [Variant(phase, dtype, d, None, causal) for phase in HOPPER_KERNELS
                for dtype in capability.TABLE_DTYPES for d in capability.HOPPER_HEAD_DIMS
                for causal in ((False,) if phase in HOPPER_ROW_KERNELS else (False, True))]
    out = set()
    for phase, head_dim, dtype, causal, tiles in capability.selectable_configs(cc):
        out.add(Variant(phase, dtype, head_dim, tiles, causal))
        out.add(Variant("bwd_delta", dtype, head_dim, None, False))
        out.add(Variant("fwd_combine", dtype, head_dim, None, False))
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cupy_piecewise build", description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default=",".join(
                        [f"sm_{a}{b}" for a, b in capability.LISTED_ARCHS] + ["sm_90a"]),
                    help="comma-separated architectures (default: every listed one, and sm_90a "
                         "for the Hopper kernels)")
    args = ap.parse_args(argv)
    archs = [_parse_arch(a) for a in args.arch.split(",") if a.strip()]

    try:
        from tqdm import tqdm
    except ImportError:  # progress is a nicety; the table below is the result
        def tqdm(it, **kw):
            return it

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
