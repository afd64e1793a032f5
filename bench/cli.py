"""Command line of the benchmark: options (parse_args) and the run (main). bench/bench.py is
the entry point: ``python3 bench/bench.py --help``."""
from __future__ import annotations

import argparse
import json
import os
import traceback

import torch

from common import DTYPE_NAME, DTYPES, PHASES, PROVIDERS, SECTIONS, _HERE, _err_text, _write
from reporting import make_plots, merge_results, render_markdown, render_stdout
from runner import Runner
from timing import Env

DESCRIPTION = "Benchmark cupy_piecewise.attention against PyTorch SDPA and plain PyTorch."


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
    p = argparse.ArgumentParser(description=DESCRIPTION,
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
    p.add_argument("--flex-decode", action="store_true",
                   help="also run flex_composite in the decode section (one torch.compile per decode case)")
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

