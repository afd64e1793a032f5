"""Host overhead of one forward call on a tiny problem, next to SDPA flash.

The problem (default 1x1x128x64 bfloat16, w = 32, not causal) is so small that the GPU
finishes each kernel long before the host issues the next one: the wall time per call
of a loop of back-to-back calls is the Python/dispatch cost of a call (the device time
per call of the loop is printed too, to show it). The GPU is kept busy for a second
first so that its clocks are up; each variant is warmed up, then timed as
``synchronize; 2000 calls; synchronize``, the variants taking turns for --repeats
rounds; the median of the rounds is the figure (the best is recorded too).

Variants:
  cupy_piecewise.attention     public entry point (array-library dispatch + torch_ops)
  torch_ops.attention          the torch wrapper (eager calls skip the dispatcher)
  torch.ops.cupy_piecewise.fwd the registered custom op through torch's dispatcher
  ... requires_grad            torch_ops.attention on leaves that require grad (records an
                               autograd.Function node)
  ..., CuPy float16             cupy_piecewise.attention on CuPy arrays (float16: CuPy has
                               no bfloat16)
  sdpa flash                   F.scaled_dot_product_attention, SDPBackend.FLASH_ATTENTION

It also times the steps of a direct call one by one (signature memo, routing, output
allocation, stream query, the launch itself) to show where the time goes.

Usage: python bench/overhead.py --out bench/results/overhead.json
Needs a CUDA GPU. Prints a table and writes the numbers, date, GPU and command as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy_piecewise  # noqa: E402
from cupy_piecewise import torch_ops  # noqa: E402


def spin_up(seconds: float = 1.0) -> None:
    """Keep the GPU busy for a while so that its clocks are up before anything is timed
    (an idle H200 sits at a few hundred MHz, where even a tiny kernel outlasts a call)."""
    x = torch.randn(4096, 4096, device="cuda")
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        x = x @ x
        x /= x.norm()
        torch.cuda.synchronize()


def per_call_us(fns: dict, iters: int, warmup: int, repeats: int) -> dict:
    """{name: [us per call of each timed loop]}: ``synchronize; iters calls; synchronize``.

    The variants take turns (one loop of each per round), so that a change of the host's
    or the GPU's state during the run affects all of them alike.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    out = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
            out[name].append((time.perf_counter() - t0) / iters * 1e6)
    return out


def gpu_us(fn, iters: int = 500) -> float:
    """Device time per call: the GPU is held by a sleep kernel while the host queues
    ``iters`` calls, so the events around them time the kernels back to back, not the
    host. Shows that the wall-time loops above are bound by the host."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # ~0.2 s at 2 GHz: longer than queueing the calls
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="path of the JSON file to write")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7, help="timed loops per variant (median and best reported)")
    ap.add_argument("--shape", default="1,1,128,64", help="B,H,L,D")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--w", type=int, default=32)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/overhead.py needs a CUDA GPU (torch.cuda.is_available() is False)")

    B, H, L, D = (int(x) for x in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    q1, k1, q2, k2, v = (torch.randn(B, H, L, D, device="cuda", dtype=dtype, generator=g) for _ in range(5))
    leaves = [t.detach().clone().requires_grad_() for t in (q1, k1, q2, k2, v)]
    scale = 1.0 / math.sqrt(D)
    w = args.w
    op = torch.ops.cupy_piecewise.fwd

    import cupy

    # The same tensors seen by CuPy (bfloat16 through ml_dtypes), zero copy.
    cp_ins = [cupy.from_dlpack(t) for t in (q1, k1, q2, k2, v)]
    variants = {
        "cupy_piecewise.attention": lambda: cupy_piecewise.attention(q1, k1, q2, k2, v, w),
        "torch_ops.attention": lambda: torch_ops.attention(q1, k1, q2, k2, v, w),
        "torch_ops.attention, return_lse": lambda: torch_ops.attention(q1, k1, q2, k2, v, w, return_lse=True),
        "torch.ops.cupy_piecewise.fwd": lambda: op(q1, k1, q2, k2, v, w, False, scale),
        "torch_ops.attention, requires_grad": lambda: torch_ops.attention(*leaves, w),
        "cupy_piecewise.attention, CuPy arrays": lambda: cupy_piecewise.attention(*cp_ins, w),
        "sdpa flash": lambda: F.scaled_dot_product_attention(q1, k1, v),
        "sdpa flash, requires_grad": lambda: F.scaled_dot_product_attention(leaves[0], leaves[1], leaves[4]),
    }
    # Where a direct call's time goes: its steps, each timed alone in the same loop.
    from cupy_piecewise import tma
    from cupy_piecewise.adapters import torch as torch_adapter

    call = torch_ops._call(q1, k1, q2, k2, v, w, False, None)
    o_shape = (B, H, L, D)
    o, lse = torch_ops.attention(q1, k1, q2, k2, v, w, return_lse=True)
    ptrs = tuple(t.data_ptr() for t in (q1, k1, q2, k2, v, o, lse))
    stream = torch.cuda.current_stream().cuda_stream
    dev = q1.device
    steps = {
        "step: signature key + memo lookup (_call)": lambda: torch_ops._call(q1, k1, q2, k2, v, w, False, None),
        "step: route (grad mode, modes, subclasses)": lambda: torch_ops._route(q1, k1, q2, k2, v),
        "step: torch.empty of o": lambda: torch.empty(o_shape, dtype=dtype, device=dev),
        "step: torch.empty_like of q1 (what the core uses for o)":
            lambda: torch.empty_like(q1, memory_format=torch.contiguous_format),
        "step: current stream": lambda: torch_adapter.OPS.stream(0),
        # device-bound when timed alone: back-to-back launches wait for the queue to drain,
        # so this reads the kernel's device time (see device_us_per_call), not host cost
        "step: Launches.run (parameter block + cuLaunchKernel; device-bound alone)":
            lambda: call.fwd.run(ptrs, stream),
        # the Hopper forward encodes five of these per new set of data pointers (cached per
        # signature and pointers): what a call with fresh tensors pays on top
        "step: encode one TMA tensor map (Hopper path, new pointers)":
            lambda: tma.tensor_map_bhld(q1.data_ptr(), q1.shape, q1.stride(), args.dtype, 128),
    }
    spin_up()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        loops = per_call_us({**variants, **steps}, args.iters, args.warmup, args.repeats)
        device = {"torch_ops.attention": gpu_us(variants["torch_ops.attention"]),
                  "sdpa flash": gpu_us(variants["sdpa flash"])}
    results = {name: statistics.median(loops[name]) for name in variants}
    best = {name: min(loops[name]) for name in variants}
    breakdown = {name: statistics.median(loops[name]) for name in steps}

    flash = results["sdpa flash"]
    gpu = torch.cuda.get_device_name()
    print(f"forward call, {B}x{H}x{L}x{D} {args.dtype}, w={w}; wall time per call over "
          f"{args.iters} back-to-back calls (median and best of {args.repeats} loops); {gpu}")
    print(f"{'variant':40s} {'median us':>9s} {'best us':>8s} {'vs sdpa flash':>14s}")
    for name, us in results.items():
        print(f"{name:40s} {us:9.2f} {best[name]:8.2f} {us / flash:13.2f}x")
    print("device time per call, kernels queued back to back (CUDA events): "
          + ", ".join(f"{k} {v:.2f} us" for k, v in device.items()))
    print("\nsteps of a direct call, each timed alone:")
    for name, us in breakdown.items():
        print(f"{name:56s} {us:7.2f} us")

    record = {
        "benchmark": "host overhead of one forward call",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cupy_piecewise": cupy_piecewise.__version__,
        "shape_BHLD": [B, H, L, D],
        "dtype": args.dtype,
        "w": w,
        "causal": False,
        "iters": args.iters,
        "statistic": "median over repeats of wall time per call",
        "warmup": args.warmup,
        "repeats": args.repeats,
        "us_per_call": results,
        "us_per_call_best": best,
        "device_us_per_call": device,
        "ratio_to_sdpa_flash": {k: v / flash for k, v in results.items()},
        "steps_us": breakdown,
        "target_us_per_call": 30.0,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
