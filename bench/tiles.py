"""Time kernel variants for the capability table: one phase, head dim and causal setting per row.

    PYTHONPATH=$PWD python3 bench/tiles.py --out tiles.json [--dims 64,128] [--L 8192]

Each candidate TileConfig is forced through CUPY_PIECEWISE_TILES and timed on the launch
layer directly (torch-allocated tensors, CUDA events, median after warm-up), so the numbers
compare kernels, not Python. FLOPs as in docs/semantics.md: forward 4·B·H·M·N·D (half when causal),
backward 2.5x that. Results feed cupy_piecewise/capability.py (sm_90 entries). The backward
phases time the whole backward: bwd_dq and bwd_dkv the deterministic scheme (delta, dq, dk/dv;
the other kernel at its table entry), bwd_fused and bwd_grid the one-kernel schemes (delta, the
dk/dv kernel with dQ by atomics or the warp-grid kernel, convert).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch

from cupy_piecewise import capability, launch
from timing import event_median_ms  # bench/ is on sys.path: run as a script
from cupy_piecewise.validate import check_inputs

CANDIDATES = {
    ("fwd", 128): ["128x64x8", "128x128x8", "64x64x4", "64x128x4", "128x32x4"],
    ("fwd", 64): ["128x64x4", "128x128x8", "128x64x8", "64x64x4", "128x128x4"],
    ("bwd_dq", 128): ["128x64x8", "64x32x4", "128x32x8", "64x64x4"],
    ("bwd_dq", 64): ["128x64x4", "128x64x8", "64x64x4", "128x32x4"],
    ("bwd_dkv", 128): ["32x64x4", "64x128x8", "32x128x8", "64x64x4"],
    ("bwd_dkv", 64): ["64x128x4", "32x128x4", "64x64x4", "64x128x8"],
    ("bwd_fused", 128): ["16x64x4", "32x64x4", "16x128x8", "32x128x8", "64x128x8"],
    ("bwd_fused", 64): ["64x64x4", "32x128x4", "64x128x8", "32x128x8", "128x128x8"],
    # the warp-grid backward: block_m 64, block_n = 16 x warps (capability.check_config)
    ("bwd_grid", 128): ["64x128x8", "64x64x4"],
    ("bwd_grid", 64): ["64x64x4", "64x128x8"],
}


def _scratch(nbytes):
    """launch.backward's workspace allocator: (keepalive, device pointer) on torch's stream."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return buf, buf.data_ptr()


def _time(fn, reps=20, warmup=3):
    return event_median_ms(fn, warmup=warmup, reps=reps)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--L", type=int, default=8192)
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--phases", default="fwd,bwd_dq,bwd_dkv,bwd_fused,bwd_grid")
    ap.add_argument("--out", default=None)
    ap.add_argument("--candidates", default=None,
                    help="comma-separated tile specs (e.g. 128x64x8,128x64x4) to time instead of "
                         "the built-in lists, for every phase and head dim asked for")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    L = args.L
    rows = []
    for D in [int(d) for d in args.dims.split(",")]:
        B, H = max(1, 16384 // L), 2048 // D
        t = lambda: torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16)  # noqa: E731
        q1, k1, q2, k2, v, do = (t() for _ in range(6))
        o = torch.empty_like(q1)
        lse = torch.empty(B, H, L, device=dev, dtype=torch.float32)
        delta = torch.empty_like(lse)
        grads = [torch.empty_like(q1) for _ in range(5)]
        ref = lambda x: launch.ArrayRef(x.data_ptr(), x.stride())  # noqa: E731
        for causal in [c == "1" for c in args.causal.split(",")]:
            problem = check_inputs(q1, k1, q2, k2, v, L // 4, causal)
            flops = 4 * B * H * L * L * D * (0.5 if causal else 1.0)
            stream = torch.cuda.current_stream().cuda_stream
            launch.forward(problem, *map(ref, (q1, k1, q2, k2, v, o)), lse.data_ptr(), stream=stream)
            for phase in args.phases.split(","):
                for spec in (args.candidates.split(",") if args.candidates else CANDIDATES[(phase, D)]):
                    if phase == "fwd":
                        fn = lambda: launch.forward(problem, *map(ref, (q1, k1, q2, k2, v, o)),  # noqa: E731
                                                    lse.data_ptr(), stream=stream)
                        fl = flops
                    else:
                        fn = lambda: launch.backward(  # noqa: E731
                            problem, *map(ref, (q1, k1, q2, k2, v, o)), lse.data_ptr(), ref(do),
                            *map(ref, grads), delta.data_ptr(), stream=stream,
                            workspace=_scratch,
                            deterministic=phase not in ("bwd_fused", "bwd_grid"))
                        fl = 2.5 * flops
                    other = {"bwd_dq": "bwd_dkv", "bwd_dkv": "bwd_dq"}.get(phase)
                    capability.set_tile_override(f"{phase}={spec}")
                    try:
                        ms = _time(fn)
                        rec = dict(phase=phase, D=D, causal=causal, tiles=spec, ms=ms,
                                   tflops=fl / ms / 1e9, note="bwd = delta+dq+dkv" if other else "")
                        if other:  # time the other backward kernel alone by difference later
                            rec["tflops_note"] = f"{other} at its table entry"
                    except Exception as e:  # a config that fails to compile or launch
                        rec = dict(phase=phase, D=D, causal=causal, tiles=spec, error=repr(e)[:200])
                    finally:
                        capability.set_tile_override(None)
                    rows.append(rec)
                    print(f"{phase:8} D={D:3} causal={int(causal)} {spec:10} "
                          + (f"{rec['ms']:8.3f} ms {rec['tflops']:6.1f} TFLOP/s" if "ms" in rec
                             else rec["error"]), flush=True)
    header = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  gpu=torch.cuda.get_device_name(), L=L, dtype="bfloat16",
                  command="python3 bench/tiles.py " + " ".join(sys.argv[1:]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(header=header, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
