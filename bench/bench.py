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

Providers (--providers, all by default): piecewise (the package's default path on this GPU),
piecewise_det (the same, deterministic=True), piecewise_mma (mma.sync kernels forced),
piecewise_mma_det (that with deterministic=True: the two-kernel mma.sync backward),
flex_composite (two compiled FlexAttention calls
merged by log-sum-exp), sdpa_flash, sdpa_cudnn, torch_plain, flag_attn.

This file is the entry point only; the work is split by job into modules beside it:
  common.py         names, dtypes, FLOP/byte counts, text and progress helpers
  timing.py         Env (device, L2 size, triton), Timer (median), time_phase, measure
  inputs.py         random input sets, rotation over L2, slices for the spot checks
  providers.py      one class per provider, plain_piecewise (plain PyTorch reference)
  flex_composite.py the two-call FlexAttention composite and its log-sum-exp merge
  runner.py         the sections (main + spot checks, w sweep, decode, memory), results.json
  reporting.py      ratios, results.md tables, stdout summary, merging, plots
  cli.py            options and main()
"""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:  # so `python3 bench/bench.py` finds cupy_piecewise without PYTHONPATH
    sys.path.insert(0, _ROOT)
if _HERE not in sys.path:  # the modules beside this file (also when loaded by path, as the tests do)
    sys.path.insert(0, _HERE)

# The names below were all defined in this file before the split; they stay importable from it.
from common import (DTYPE_NAME, DTYPES, PHASE_FACTOR, PHASE_LABEL, PHASES, PROVIDERS,  # noqa: E402,F401
                    RATIO_PROVIDERS, REF_PROVIDERS, SECTIONS, _err_text, _f, _status_of, attn_flops,
                    decode_bytes, plain_mem_estimate, tflops_from_ms)
from timing import Env, Timer, measure, time_phase  # noqa: E402,F401
from inputs import InputSet, _Slice, make_sets, n_sets_for  # noqa: E402,F401
from providers import (FlagAttn, FlexComposite, Piecewise, PiecewiseMma, Provider, Sdpa,  # noqa: E402,F401
                       TorchPlain, forced_path, make_providers, plain_piecewise)
from runner import Runner  # noqa: E402,F401
from reporting import (LEGEND, annotate_ratios, make_plots, merge_results, render_checks,  # noqa: E402,F401
                       render_decode, render_errors, render_header, render_main_detail, render_markdown,
                       render_memory, render_stdout, render_summary, render_wsweep)
from cli import DESCRIPTION, main, parse_args  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(main())
