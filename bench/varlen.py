"""Packed variable-length batches: ``attention_varlen`` against padding, in one run.

A training step on packed documents: B sequences of different lengths (drawn once from a
fixed seed), H = 2048 / D heads, bfloat16, causal, one ``w`` for the call (a quarter of the
mean length). Providers:

- ``piecewise``: :func:`cupy_piecewise.attention_varlen` on the packed tensors (no padding);
- ``piecewise_padded``: :func:`cupy_piecewise.attention` on the batch padded to the longest
  sequence, what a user without a packed entry point runs: the work of every padded row
  and key is paid. Timing only: without a key-padding mask the padded call's values are
  not the packed call's (real rows also see the zero keys in front of them);
- ``sdpa_flash`` / ``sdpa_cudnn``: PyTorch's standard (not piecewise) attention on the
  padded batch, the yardstick a standard-attention user has; ``sdpa_*_per_seq``: the same
  one sequence at a time on the packed tensors; ``sdpa_nested``: SDPA on jagged nested
  tensors (PyTorch's own packed form), where this torch supports it.

Effective TFLOP/s count only real tokens (SPEC.md's convention summed over sequences:
``4·H·M_b·N_b·D``, halved for causal, backward 2.5x), for every provider, so padding shows
up as lost throughput. Medians of CUDA-event timings after warm-up (bench/timing.py).

    PYTHONPATH=$PWD python3 bench/varlen.py --out bench/results/DIR/varlen.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.attention
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import _git_commit, _version_of, attn_flops, tflops_from_ms  # noqa: E402
from timing import event_median_ms  # noqa: E402

import cupy_piecewise  # noqa: E402

PHASES = ("fwd", "fwd_bwd")
_BACKENDS = {"sdpa_flash": torch.nn.attention.SDPBackend.FLASH_ATTENTION,
             "sdpa_cudnn": torch.nn.attention.SDPBackend.CUDNN_ATTENTION}


def lengths(batch: int, mean: int, seed: int = 0) -> list[int]:
    """Sequence lengths between mean/4 and 7*mean/4, multiples of 8 (fixed seed)."""
    rng = np.random.default_rng(seed)
    return [int(x) // 8 * 8 for x in rng.integers(mean // 4, 7 * mean // 4, size=batch)]


def lengths_to_total(lo: int, hi: int, total: int, seed: int = 0) -> list[int]:
    """Lengths drawn uniformly from [lo, hi] (multiples of 8) until they sum to ``total``
    (the last one cut to fit)."""
    rng = np.random.default_rng(seed)
    out = []
    while sum(out) < total:
        out.append(min(int(rng.integers(lo, hi + 1)) // 8 * 8, total - sum(out)))
    return out


def _timed(fn, phase, outs_of):
    if phase == "fwd":
        with torch.no_grad():
            return event_median_ms(fn)

    def step():
        out = outs_of(fn())
        out.backward(torch.ones_like(out))
    return event_median_ms(step)


def run_case(lens, D, dtype, providers):
    dev = torch.device("cuda")
    H = 2048 // D
    total, L = sum(lens), max(lens)
    w = max(1, (total // len(lens)) // 4)
    g = torch.Generator(device="cpu").manual_seed(1)
    mk = lambda *s: torch.randn(*s, generator=g).to(dev, dtype)  # noqa: E731
    packed = [mk(total, H, D).requires_grad_() for _ in range(5)]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device=dev)
    starts = [int(x) for x in np.concatenate([[0], np.cumsum(lens)])[:-1]]
    # padded: each sequence at the end of its row (the front is padding)
    pad = [torch.zeros(len(lens), H, L, D, device=dev, dtype=dtype) for _ in range(5)]
    with torch.no_grad():
        for b, (a, n) in enumerate(zip(cu[:-1].tolist(), lens)):
            for x, p in zip(packed, pad):
                p[b, :, L - n:] = x[a:a + n].transpose(0, 1)
    pad = [p.requires_grad_() for p in pad]
    flops = {ph: sum(attn_flops(1, H, n, n, D, True, ph) for n in lens) for ph in PHASES}
    calls = {
        "piecewise": lambda: cupy_piecewise.attention_varlen(
            *packed, cu, cu, w, causal=True, max_seqlen_q=L, max_seqlen_k=L),
        "piecewise_padded": lambda: cupy_piecewise.attention(*pad, w, causal=True),
    }
    for name, backend in _BACKENDS.items():
        def sdpa(backend=backend):
            with torch.nn.attention.sdpa_kernel(backend):
                return F.scaled_dot_product_attention(pad[0], pad[1], pad[4], is_causal=True)
        calls[name] = sdpa

        # standard attention one sequence at a time on the packed tensors (no padding)
        def per_seq(backend=backend):
            outs = []
            with torch.nn.attention.sdpa_kernel(backend):
                for a, n in zip(starts, lens):
                    q, k, v = (x[a:a + n].transpose(0, 1)[None] for x in (packed[0], packed[1], packed[4]))
                    outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True))
            return torch.cat([o[0].transpose(0, 1) for o in outs])
        calls[name + "_per_seq"] = per_seq

    # standard attention on a jagged nested tensor (SDPA's own packed form)
    def nested():
        q, k, v = (torch.nested.nested_tensor_from_jagged(x, offsets=cu.to(torch.int64))
                   .transpose(1, 2) for x in (packed[0], packed[1], packed[4]))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).values()
    calls["sdpa_nested"] = nested
    rows = []
    for prov in providers:
        for phase in PHASES:
            row = dict(dtype=str(dtype).replace("torch.", ""), B=len(lens), H=H, Hkv=H, M=L,
                       N=L, D=D, L=L, causal=True, w=w, provider=prov, phase=phase,
                       tokens=total, lengths=lens)
            try:
                ms = _timed(calls[prov], phase, lambda o: o)
                row.update(ms=round(ms, 4), tflops=round(tflops_from_ms(flops[phase], ms), 1),
                           status="ok")
            except Exception as e:  # recorded, not hidden: an unsupported back end
                row.update(ms=None, tflops=None, status="error", error=f"{type(e).__name__}: {e}"[:300])
            rows.append(row)
            print(f"{row['dtype']:9} D={D:3} B={len(lens):3} tokens={total:6} {prov:17} {phase:7} "
                  f"{row['ms'] or float('nan'):8.3f} ms {row['tflops'] or float('nan'):7.1f} TFLOP/s",
                  flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="JSON results here")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--batches", default="16:2048,64:512",
                    help="comma-separated BATCH:MEAN_LENGTH pairs, or LO-HI/TOTAL (lengths drawn "
                         "from [LO, HI] until they sum to TOTAL), e.g. 512-8192/65536")
    ap.add_argument("--providers", default="piecewise,piecewise_padded,sdpa_flash,sdpa_cudnn",
                    help="also: sdpa_flash_per_seq, sdpa_cudnn_per_seq (one SDPA call per "
                         "sequence), sdpa_nested (SDPA on a jagged nested tensor)")
    args = ap.parse_args(argv)
    t0 = time.time()
    rows = []
    for spec in args.batches.split(","):
        if "/" in spec:
            span, total = spec.split("/")
            lo, hi = (int(x) for x in span.split("-"))
            lens = lengths_to_total(lo, hi, int(total))
        else:
            batch, mean = (int(x) for x in spec.split(":"))
            lens = lengths(batch, mean)
        for D in (int(d) for d in args.dims.split(",")):
            rows += run_case(lens, D, torch.bfloat16, args.providers.split(","))
    res = {"header": {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                      "gpu": torch.cuda.get_device_name(), "commit": _git_commit(),
                      "versions": {m: _version_of(m) for m in ("torch", "cupy", "numpy")},
                      "command": "python3 bench/varlen.py " + " ".join(argv or sys.argv[1:]),
                      "flops": "real tokens only: sum over sequences of 4*H*n_b^2*D/2 (causal), "
                               "fwd_bwd 3.5x", "elapsed_s": round(time.time() - t0, 1)},
           "main": rows}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
