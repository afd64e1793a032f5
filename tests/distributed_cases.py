"""Worker for the context-parallel tests (tests/test_distributed_*.py): one process per rank,
started by torch.multiprocessing. Each rank builds the same full inputs from a seed, takes
its shard, runs cupy_piecewise.distributed.attention forward and backward, and gathers o
and the five gradients back; rank 0 compares them with one single-device call over the
whole sequence and writes a JSON report (one entry per case) for the parent to assert on.
"""
from __future__ import annotations

import json
import os
import traceback


def cases(world: int, local_len: int):
    """(method, layout, causal, w) combinations, with w inside a shard, on a shard boundary,
    across one, negative and beyond the sequence."""
    L = world * local_len
    ws = (3, local_len, local_len + 3, local_len // 2, -2, L + 5)
    return [(m, lay, c, w) for m in ("allgather", "ring") for lay in ("contiguous", "zigzag")
            for c in (False, True) for w in ws]


def worker(rank: int, world: int, init: str, out: str, backend: str, local_len: int,
           dtype_name: str, B: int, H: int, Hkv: int, D: int) -> None:
    import torch
    import torch.distributed as dist

    import cupy_piecewise
    from cupy_piecewise import distributed as cpd

    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = getattr(torch, dtype_name)
    report = []
    try:
        for i, (method, layout, causal, w) in enumerate(cases(world, local_len)):
            entry = dict(method=method, layout=layout, causal=causal, w=w)
            try:
                L = world * local_len
                g = torch.Generator().manual_seed(1000 + i)
                shapes = [(B, H, L, D), (B, Hkv, L, D), (B, H, L, D), (B, Hkv, L, D), (B, Hkv, L, D)]
                full = [torch.randn(s, dtype=torch.float64, generator=g) for s in shapes]
                do_full = torch.randn(B, H, L, D, dtype=torch.float64, generator=g)
                loc = [cpd.shard(t, layout=layout).to(dev, dtype).requires_grad_() for t in full]
                o = cpd.attention(*loc, w, causal=causal, layout=layout, method=method)
                o.backward(cpd.shard(do_full, layout=layout).to(dev, dtype))
                got = [cpd.unshard(o.detach(), layout=layout)]
                got += [cpd.unshard(t.grad, layout=layout) for t in loc]
                if rank == 0:
                    entry.update(_compare(got, full, do_full, w, causal, dtype_name, cupy_piecewise))
            except Exception:  # noqa: BLE001 - reported to the parent
                entry["error"] = traceback.format_exc()
                if rank == 0:
                    report.append(entry)
                raise
            if rank == 0:
                report.append(entry)
    finally:
        if rank == 0:
            with open(os.path.join(out, f"report_{world}.json"), "w") as f:
                json.dump(report, f)
        dist.destroy_process_group()


def _compare(got, full, do_full, w, causal, dtype_name, cupy_piecewise):
    """float64 inputs: equal to one call within 1e-9 (relative); 16-bit: the tolerance rule
    against the float64 reference with the low-precision reference's error."""
    import numpy as np
    import torch

    from cupy_piecewise import reference, tolerance

    names = ("o", "dq1", "dk1", "dq2", "dk2", "dv")
    got = [g.detach().cpu().double() for g in got]
    if dtype_name == "float64":
        leaves = [t.clone().requires_grad_() for t in full]
        o = cupy_piecewise.attention(*leaves, w, causal=causal)
        o.backward(do_full)
        want = [o.detach()] + [t.grad[:, :, :, :] for t in leaves]
        order = (0, 1, 2, 3, 4, 5)  # leaves: q1, k1, q2, k2, v -> dq1, dk1, dq2, dk2, dv
        errs = {}
        for n, k in zip(names, order):
            scale = float(want[k].abs().max()) or 1.0
            errs[n] = float((got[k] - want[k]).abs().max()) / scale
        return dict(errors=errs, passed=all(e <= 1e-9 for e in errs.values()))
    host = [np.asarray(t.to(getattr(torch, dtype_name)).double().numpy()) for t in full]
    do_h = np.asarray(do_full.to(getattr(torch, dtype_name)).double().numpy())
    o_ref, lse_ref = reference.forward(*host, w, causal)
    o_low, lse_low = reference.lowp_forward(*host, w, causal, dtype=dtype_name)
    g_ref = reference.backward(*host, o_ref, lse_ref, do_h, w, causal)
    g_low = reference.lowp_backward(*host, o_low, lse_low, do_h, w, causal, dtype=dtype_name)
    verdicts = [tolerance.compare("o", got[0].numpy(), o_ref, o_low, dtype_name)]
    for n, g, r, lw in zip(names[1:], got[1:], g_ref, g_low):
        verdicts.append(tolerance.compare(n, g.numpy(), r, lw, dtype_name))
    return dict(errors={v.name: str(v) for v in verdicts}, passed=all(v.passed for v in verdicts))
