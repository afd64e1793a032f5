#!/usr/bin/env python3
"""Where forward+backward time goes, kernel by kernel, beside SDPA cuDNN's kernels.

    PYTHONPATH=$PWD python3 scripts/kernel_times.py [--lengths 2048,8192] [--dims 64,128] \
        [--out FILE]

For each (L, D, causal): B = 16384 / L, H = 2048 / D, bf16, w = L / 4 (the bench's shapes).
Runs ``cupy_piecewise.attention`` forward + ``backward`` and SDPA's cuDNN backend the same
way under ``torch.profiler`` (CUDA activity: device time of every kernel, whichever
library launched it; gradients by ``torch.autograd.grad``, as the bench's fwd_bwd phase), after warm-up, and prints per kernel: launches per iteration, device
microseconds per iteration and the share of the iteration's summed kernel time. The kernel
sums are device time only (no launch gaps); the bench's CUDA-event timings stay the figures
of record. Small tensor copies and fills that autograd adds appear as their own rows.
"""
from __future__ import annotations

import argparse
import collections
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import cupy_piecewise

ITERS = 5


def _short(name: str) -> str:
    """A kernel's name without template arguments and parameter lists (one line)."""
    for cut in ("<", "("):
        i = name.find(cut)
        if i > 0:
            name = name[:i]
    return name[:60]


def _profile(fn, iters: int = ITERS) -> "collections.OrderedDict[str, list]":
    for _ in range(3):  # warm-up: compile, tensor maps, cuDNN plans
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows: "collections.OrderedDict[str, list]" = collections.OrderedDict()
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        dur = getattr(ev, "device_time", None)
        if dur is None:
            dur = ev.cuda_time
        r = rows.setdefault(_short(ev.name), [0, 0.0])
        r[0] += 1
        r[1] += dur
    return collections.OrderedDict((k, [v[0] / iters, v[1] / iters]) for k, v in rows.items())


def _table(title: str, rows, say) -> float:
    total = sum(v[1] for v in rows.values())
    say(f"  {title}: {total:9.1f} us of kernels per iteration")
    for k, (n, us) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        say(f"    {us:9.1f} us {100 * us / total:5.1f}%  x{n:g}  {k}")
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--causal", default="0,1", help="comma list of 0/1")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--out", default=None, help="also write the report here")
    a = ap.parse_args()
    lines = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    say(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; {a.dtype}; "
        f"median-free sums over {ITERS} iterations (torch.profiler, CUDA activity)")
    dt = getattr(torch, a.dtype)
    for L in (int(x) for x in a.lengths.split(",")):
        for D in (int(x) for x in a.dims.split(",")):
            for causal in (bool(int(x)) for x in a.causal.split(",")):
                B, H = max(1, 16384 // L), max(1, 2048 // D)
                g = torch.Generator(device="cuda").manual_seed(L + D)
                ins = [torch.randn(B, H, L, D, device="cuda", dtype=dt, generator=g).requires_grad_()
                       for _ in range(5)]
                do = torch.randn(B, H, L, D, device="cuda", dtype=dt, generator=g)

                # torch.autograd.grad, as the bench's fwd_bwd phase: no .grad accumulation
                def ours():
                    o = cupy_piecewise.attention(*ins, L // 4, causal=causal)
                    torch.autograd.grad(o, ins, do)

                def cudnn():
                    from torch.nn.attention import SDPBackend, sdpa_kernel
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        o = torch.nn.functional.scaled_dot_product_attention(
                            ins[0], ins[1], ins[4], is_causal=causal)
                    torch.autograd.grad(o, (ins[0], ins[1], ins[4]), do)

                flops = 3.5 * 4 * B * H * L * L * D * (0.5 if causal else 1.0)
                say(f"L={L} D={D} causal={int(causal)} B={B} H={H}")
                t_ours = _table("piecewise", _profile(ours), say)
                t_cudnn = _table("sdpa_cudnn", _profile(cudnn), say)
                say(f"  kernel-sum TFLOP/s: piecewise {flops / t_ours / 1e6:.1f}, cudnn "
                    f"{flops / t_cudnn / 1e6:.1f}; ratio {t_cudnn / t_ours:.3f}")
                torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
