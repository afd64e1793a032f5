#!/usr/bin/env python3
"""Context-parallel scaling: cupy_piecewise.distributed on 2 GPUs against one GPU.

    PYTHONPATH=$PWD python3 bench/context_parallel.py --out DIR [--lengths 32768,131072]

B = 1, H = 16, D = 128, bfloat16, causal, w = L/4, zigzag layout. For each length and
number of kv heads: one GPU (cupy_piecewise.attention over the whole sequence on cuda:0)
and two GPUs (one process per GPU, NCCL) with each method; forward and forward+backward
medians of CUDA-event timings after warm-up (the slowest rank's), and peak memory per GPU
(torch's allocator, the larger rank's), in MiB above what was allocated before the call
(the inputs and dO):

- ``fwd``: during a forward without autograd (o and every temporary);
- ``f+b``: during forward+backward, the gradient tensors it creates included;
- ``f+b excl. grads``: the same less the five gradients' own bytes (what the call holds
  beyond its outputs; the measure of the first results, 2026-11-30, which took it as the
  gradients of the previous iteration freed and made again).

Writes DIR/context_parallel.json and .md.
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


def _peak_mib(fn):
    """Peak MiB allocated while ``fn`` runs, above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _measure(run_fwd, leaves, do, iters):
    """(forward ms, forward+backward ms, peak MiB of the forward, of forward+backward, and
    of forward+backward less the gradients' bytes)."""
    def fwd():
        with torch.no_grad():
            run_fwd(*leaves)

    def fwd_bwd():
        run_fwd(*leaves).backward(do)

    def clear():
        for t in leaves:
            t.grad = None

    t_f = event_median_ms(fwd, warmup=1, reps=iters)
    t_fb = event_median_ms(lambda: (clear(), fwd_bwd()), warmup=1, reps=iters)
    clear()
    m_f = _peak_mib(fwd)
    m_fb = _peak_mib(fwd_bwd)
    grads = sum(t.grad.numel() * t.grad.element_size() for t in leaves) / 2**20
    clear()
    return t_f, t_fb, m_f, m_fb, m_fb - grads


def single(L, H, Hkv, D, iters):
    import cupy_piecewise

    dev = torch.device("cuda", 0)
    leaves = [t.requires_grad_() for t in _inputs(L, H, Hkv, D, dev)]
    do = torch.randn(1, H, L, D, device=dev, dtype=torch.bfloat16)
    run = lambda *x: cupy_piecewise.attention(*x, L // 4, causal=True)  # noqa: E731
    return _measure(run, leaves, do, iters)


def worker(rank, world, init, L, H, Hkv, D, method, iters, out, piece):
    import torch.distributed as dist

    from cupy_piecewise import distributed as cpd

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    dev = torch.device("cuda", rank)
    full = _inputs(L, H, Hkv, D, dev)
    leaves = [cpd.shard(t).requires_grad_() for t in full]
    del full
    do = cpd.shard(torch.randn(1, H, L, D, device=dev, dtype=torch.bfloat16))
    run = lambda *x: cpd.attention(*x, L // 4, causal=True, method=method,  # noqa: E731
                                   ring_piece=piece)
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
    ap.add_argument("--methods", default="allgather,ring",
                    help="comma-separated; 'ring@N' runs the ring with ring_piece=N in the same run")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--ring-piece", type=int, default=None,
                    help="keys per ring message (default: the library's choice)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch.multiprocessing as mp

    os.makedirs(args.out, exist_ok=True)
    H, D, rows = 16, 128, []
    for L in (int(x) for x in args.lengths.split(",")):
        for Hkv in (int(x) for x in args.kv_heads.split(",")):
            t0 = time.time()
            f1, fb1, mf1, m1, mx1 = single(L, H, Hkv, D, args.iters)
            torch.cuda.empty_cache()
            row = dict(L=L, H=H, Hkv=Hkv, D=D, one_gpu=dict(
                fwd_ms=f1, fwd_bwd_ms=fb1, fwd_peak_mib=mf1, peak_mib=m1, peak_excl_grads_mib=mx1))
            for method in args.methods.split(","):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                tmp = os.path.join(args.out, f".cp_{L}_{Hkv}_{method}.json")
                name, _, piece = method.partition("@")
                piece = int(piece) if piece else args.ring_piece
                mp.spawn(worker, args=(2, f"tcp://127.0.0.1:{port}", L, H, Hkv, D, name,
                                       args.iters, tmp, piece), nprocs=2, join=True)
                f2, fb2, mf2, m2, mx2 = json.load(open(tmp))
                os.remove(tmp)
                row[method] = dict(fwd_ms=f2, fwd_bwd_ms=fb2, fwd_peak_mib=mf2, peak_mib=m2,
                                   peak_excl_grads_mib=mx2, speedup_fwd_bwd=fb1 / fb2,
                                   speedup_fwd=f1 / f2, fwd_memory_ratio=mf2 / mf1,
                                   memory_ratio=m2 / m1, memory_ratio_excl_grads=mx2 / mx1)
            rows.append(row)
            print(json.dumps(row), f"({time.time() - t0:.0f} s)", flush=True)
    from cupy_piecewise.distributed import _piece_keys

    meta = dict(date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
                command=" ".join(sys.argv),
                ring_piece={h: _piece_keys(args.ring_piece, 1, h, torch.device("cuda", 0))
                            for h in (int(x) for x in args.kv_heads.split(","))})
    with open(os.path.join(args.out, "context_parallel.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# Context parallelism, {meta['gpu']}, {meta['date']}", "", f"command: `{meta['command']}`", "",
             "B = 1, H = 16, D = 128, bf16, causal, w = L/4, zigzag; ring pieces (keys per "
             f"backward message) by Hkv: {meta['ring_piece']}. Times: ms (median, slowest rank). "
             "Peaks: MiB per GPU above the inputs and dO (larger rank): forward alone; "
             "forward+backward; forward+backward less the gradients' own bytes. Ratios: 2 GPUs / 1 GPU.", "",
             "| L | Hkv | method | 1 GPU fwd | 2 GPU fwd | 1 GPU f+b | 2 GPU f+b | f+b speedup | "
             "fwd peak 1 / 2 | f+b peak 1 / 2 | f+b peak ratio | excl. grads 1 / 2 | excl. grads ratio |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        for m in args.methods.split(","):
            x, o = r[m], r["one_gpu"]
            lines.append(f"| {r['L']} | {r['Hkv']} | {m} | {o['fwd_ms']:.1f} | {x['fwd_ms']:.1f} | "
                         f"{o['fwd_bwd_ms']:.1f} | {x['fwd_bwd_ms']:.1f} | {x['speedup_fwd_bwd']:.2f}x | "
                         f"{o['fwd_peak_mib']:.0f} / {x['fwd_peak_mib']:.0f} | "
                         f"{o['peak_mib']:.0f} / {x['peak_mib']:.0f} | {x['memory_ratio']:.3f} | "
                         f"{o['peak_excl_grads_mib']:.0f} / {x['peak_excl_grads_mib']:.0f} | "
                         f"{x['memory_ratio_excl_grads']:.3f} |")
    open(os.path.join(args.out, "context_parallel.md"), "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
