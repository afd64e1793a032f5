"""Host overhead of one forward call on a tiny problem, next to SDPA flash.

The problem (default 1x1x128x64 bfloat16, w = 32, not causal) is so small that the GPU
finishes each kernel long before the host issues the next one: the wall time per call
of a loop of back-to-back calls is the Python/dispatch cost of a call. Each variant is
warmed up, then timed as ``synchronize; 2000 calls; synchronize`` (best of --repeats).

Variants:
  cupy_piecewise.attention     public entry point (array-library dispatch + torch_ops)
  torch_ops.attention          the torch wrapper (eager calls skip the dispatcher)
  torch.ops.cupy_piecewise.fwd the registered custom op through torch's dispatcher
  ... requires_grad            torch_ops.attention on leaves that require grad (autograd node)
  sdpa flash                   F.scaled_dot_product_attention, SDPBackend.FLASH_ATTENTION

Usage: python bench/overhead.py --out bench/results/overhead.json
Needs a CUDA GPU. Prints a table and writes the numbers, date, GPU and command as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy_piecewise  # noqa: E402
from cupy_piecewise import torch_ops  # noqa: E402


def per_call_us(fn, iters: int, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / iters * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="path of the JSON file to write")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5, help="timed loops per variant; the best is kept")
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

    variants = {
        "cupy_piecewise.attention": lambda: cupy_piecewise.attention(q1, k1, q2, k2, v, w),
        "torch_ops.attention": lambda: torch_ops.attention(q1, k1, q2, k2, v, w),
        "torch.ops.cupy_piecewise.fwd": lambda: op(q1, k1, q2, k2, v, w, False, scale),
        "torch_ops.attention, requires_grad": lambda: torch_ops.attention(*leaves, w),
    }
    results = {}
    for name, fn in variants.items():
        results[name] = per_call_us(fn, args.iters, args.warmup, args.repeats)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        results["sdpa flash"] = per_call_us(
            lambda: F.scaled_dot_product_attention(q1, k1, v), args.iters, args.warmup, args.repeats)
        results["sdpa flash, requires_grad"] = per_call_us(
            lambda: F.scaled_dot_product_attention(leaves[0], leaves[1], leaves[4]),
            args.iters, args.warmup, args.repeats)

    flash = results["sdpa flash"]
    gpu = torch.cuda.get_device_name()
    print(f"forward call, {B}x{H}x{L}x{D} {args.dtype}, w={w}; wall time per call over "
          f"{args.iters} back-to-back calls (best of {args.repeats}); {gpu}")
    print(f"{'variant':40s} {'us/call':>9s} {'vs sdpa flash':>14s}")
    for name, us in results.items():
        print(f"{name:40s} {us:9.2f} {us / flash:13.2f}x")

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
        "warmup": args.warmup,
        "repeats": args.repeats,
        "us_per_call": results,
        "ratio_to_sdpa_flash": {k: v / flash for k, v in results.items()},
        "target_us_per_call": 30.0,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
