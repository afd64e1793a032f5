#!/usr/bin/env python3
"""Context-parallel scaling: cupy_piecewise.distributed on 2 GPUs against one GPU.

    PYTHONPATH=$PWD python3 bench/context_parallel.py --out DIR [--lengths 32768,131072]

B = 1, H = 16, D = 128, bfloat16, causal, w = L/4, zigzag layout. For each length: one GPU
(cupy_piecewise.attention over the whole sequence on cuda:0) and two GPUs (one process per
GPU, NCCL) with each method; forward and forward+backward medians of CUDA-event timings
after warm-up (the slowest rank's), and peak memory allocated per GPU during
forward+backward. Writes DIR/context_parallel.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from timing import event_median_ms  # noqa: E402  (bench/timing.py)


def _inputs(L, H, Hkv, D, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    mk = lambda h: torch.randn(1, h, L, D, device=dev, dtype=torch.bfloat16, generator=g)  # noqa: E731
    return [mk(H), mk(Hkv), mk(H), mk(Hkv), mk(Hkv)]


def _measure(run_fwd, leaves, do, iters):
    """(forward ms, forward+backward ms, peak MiB of forward+backward)."""
    def fwd():
        with torch.no_grad():
            run_fwd(*leaves)

    def fwd_bwd():
        for t in leaves:
            t.grad = None
        run_fwd(*leaves).backward(do)

    t_f = event_median_ms(fwd, warmup=1, reps=iters)
    t_fb = event_median_ms(fwd_bwd, warmup=1, reps=iters)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd()
    torch.cuda.synchronize()
    return t_f, t_fb, (torch.cuda.max_memory_allocated() - base) / 2**20


def single(L, H, Hkv, D, iters):
    import cupy_piecewise

    dev = torch.device("cuda", 0)
    leaves = [t.requires_grad_() for t in _inputs(L, H, Hkv, D, dev)]
    do = torch.randn(1, H, L, D, device=dev, dtype=torch.bfloat16)
    run = lambda *x: cupy_piecewise.attention(*x, L // 4, causal=True)  # noqa: E731
    return _measure(run, leaves, do, iters)


def worker(rank, world, init, L, H, Hkv, D, method, iters, out):
    import torch.distributed as dist

    from cupy_piecewise import distributed as cpd

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    dev = torch.device("cuda", rank)
    full = _inputs(L, H, Hkv, D, dev)
    leaves = [cpd.shard(t).requires_grad_() for t in full]
    del full
    do = cpd.shard(torch.randn(1, H, L, D, device=dev, dtype=torch.bfloat16))
    run = lambda *x: cpd.attention(*x, L // 4, causal=True, method=method)  # noqa: E731
    dist.barrier()
    res = torch.tensor(_measure(run, leaves, do, iters), dtype=torch.float64, device=dev)
    dist.all_reduce(res, op=dist.ReduceOp.MAX)  # the slowest rank; the larger peak
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res.tolist(), f)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--kv-heads", default="16,4")
    ap.add_argument("--methods", default="allgather,ring")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch.multiprocessing as mp

    os.makedirs(args.out, exist_ok=True)
    H, D, rows = 16, 128, []
    for L in (int(x) for x in args.lengths.split(",")):
        for Hkv in (int(x) for x in args.kv_heads.split(",")):
            t0 = time.time()
            f1, fb1, m1 = single(L, H, Hkv, D, args.iters)
            torch.cuda.empty_cache()
            row = dict(L=L, H=H, Hkv=Hkv, D=D, one_gpu=dict(fwd_ms=f1, fwd_bwd_ms=fb1, peak_mib=m1))
            for method in args.methods.split(","):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                tmp = os.path.join(args.out, f".cp_{L}_{Hkv}_{method}.json")
                mp.spawn(worker, args=(2, f"tcp://127.0.0.1:{port}", L, H, Hkv, D, method,
                                       args.iters, tmp), nprocs=2, join=True)
                f2, fb2, m2 = json.load(open(tmp))
                os.remove(tmp)
                row[method] = dict(fwd_ms=f2, fwd_bwd_ms=fb2, peak_mib=m2,
                                   speedup_fwd_bwd=fb1 / fb2, memory_ratio=m2 / m1)
            rows.append(row)
            print(json.dumps(row), f"({time.time() - t0:.0f} s)", flush=True)
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
                command=" ".join(sys.argv))
    with open(os.path.join(args.out, "context_parallel.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# Context parallelism, {meta['gpu']}, {meta['date']}", "", f"command: `{meta['command']}`", "",
             "B = 1, H = 16, D = 128, bf16, causal, w = L/4, zigzag. Times: ms (median, slowest rank); "
             "peak: MiB allocated during forward+backward on one GPU.", "",
             "| L | Hkv | 1 GPU fwd | 1 GPU f+b | 1 GPU peak | method | 2 GPU fwd | 2 GPU f+b | 2 GPU peak | f+b speedup | peak ratio |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        for m in args.methods.split(","):
            x, o = r[m], r["one_gpu"]
            lines.append(f"| {r['L']} | {r['Hkv']} | {o['fwd_ms']:.1f} | {o['fwd_bwd_ms']:.1f} | {o['peak_mib']:.0f} | "
                         f"{m} | {x['fwd_ms']:.1f} | {x['fwd_bwd_ms']:.1f} | {x['peak_mib']:.0f} | "
                         f"{x['speedup_fwd_bwd']:.2f}x | {x['memory_ratio']:.2f} |")
    open(os.path.join(args.out, "context_parallel.md"), "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
