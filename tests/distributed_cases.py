"""Worker for the context-parallel tests (tests/test_distributed_*.py): one process per rank,
started by torch.multiprocessing. Each rank builds the same full inputs from a seed, takes
its shard, runs cupy_piecewise.distributed.attention forward and backward, and gathers o
and the five gradients back; rank 0 compares them with one single-device call over the
whole sequence and writes a JSON report (one entry per case) for the parent to assert on.
"""
from __future__ import annotations

import json
import os
import socket
import traceback


def run_and_check(world: int, tmp_path, backend: str, local_len: int, dtype_name: str,
                  B: int, H: int, Hkv: int, D: int) -> None:
    """Spawn ``world`` ranks of :func:`worker` and assert that every case passed."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    mp.spawn(worker, args=(world, init, str(tmp_path), backend, local_len, dtype_name, B, H, Hkv, D),
             nprocs=world, join=True)
    with open(os.path.join(str(tmp_path), f"report_{world}.json")) as f:
        report = json.load(f)
    assert len(report) == len(cases(world, local_len))
    bad = [r for r in report if "error" in r or not r["passed"]]
    assert not bad, json.dumps(bad[:3], indent=1)


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
                    entry.update(_compare(got, full, do_full, w, causal, dtype_name, cupy_piecewise,
                                          method, layout, world))
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


def _compare(got, full, do_full, w, causal, dtype_name, cupy_piecewise, method=None,
             layout=None, world=None):
    """float64 inputs: equal to one call within 1e-9 (relative). 16-bit inputs: the tolerance
    rule against the float64 reference of one call, with the low-precision error of the same
    blockwise computation (:func:`blockwise_lowp`: each block's result rounded to the input
    dtype before the float32 merge and sums, as the kernels' outputs are)."""
    import numpy as np
    import torch

    from cupy_piecewise import reference, tolerance

    names = ("o", "dq1", "dk1", "dq2", "dk2", "dv")
    got = [g.detach().cpu().double() for g in got]
    if dtype_name == "float64":
        leaves = [t.clone().requires_grad_() for t in full]
        o = cupy_piecewise.attention(*leaves, w, causal=causal)
        o.backward(do_full)
        want = [o.detach()] + [t.grad for t in leaves]
        errs = {}
        for k, n in enumerate(names):
            scale = float(want[k].abs().max()) or 1.0
            errs[n] = float((got[k] - want[k]).abs().max()) / scale
        return dict(errors=errs, passed=all(e <= 1e-9 for e in errs.values()))
    host = [np.asarray(t.to(getattr(torch, dtype_name)).double().numpy()) for t in full]
    do_h = np.asarray(do_full.to(getattr(torch, dtype_name)).double().numpy())
    o_ref, lse_ref = reference.forward(*host, w, causal)
    g_ref = reference.backward(*host, o_ref, lse_ref, do_h, w, causal)
    low = blockwise_lowp(host, do_h, w, causal, dtype_name, method, layout, world)
    verdicts = [tolerance.compare(n, g.numpy(), r, lw, dtype_name)
                for n, g, r, lw in zip(names, got, [o_ref] + list(g_ref), low)]
    return dict(errors={v.name: str(v) for v in verdicts}, passed=all(v.passed for v in verdicts))


def blockwise_lowp(host, do_h, w, causal, dtype, method, layout, world):
    """The plain low-precision version of the distributed computation: the same blocks
    (query chunk x key range, per method and layout), each through
    reference.lowp_forward / lowp_backward with its position offsets, results rounded to
    ``dtype``, merged by lse and summed in float32, final values rounded to ``dtype``.
    Returns [o, dq1, dk1, dq2, dk2, dv]."""
    import numpy as np

    from cupy_piecewise import reference
    from cupy_piecewise.distributed import chunks
    from cupy_piecewise.gpu_arrays import round_to

    q1, k1, q2, k2, v = host
    L = q1.shape[2]
    local = L // world
    blocks = []  # (query chunk start, length, key start, key length)
    for r in range(world):
        for qc in chunks(r, world, local, layout):
            if method == "allgather":
                blocks.append((qc.start, qc.length, 0, qc.start + qc.length if causal else L))
            else:
                for owner in range(world):
                    for kc in chunks(owner, world, local, layout):
                        if not causal or kc.start <= qc.start + qc.length - 1:
                            blocks.append((qc.start, qc.length, kc.start, kc.length))
    rnd = lambda x: round_to(np.asarray(x, np.float32), dtype).astype(np.float64)  # noqa: E731
    B, H, _, D = q1.shape
    o = np.zeros((B, H, L, D))
    lse = np.full((B, H, L), -np.inf)
    part = lambda x, a, n: x[:, :, a:a + n]  # noqa: E731
    for qs, qn, ks, kn in blocks:
        ob, lb = reference.lowp_forward(part(q1, qs, qn), part(k1, ks, kn), part(q2, qs, qn),
                                        part(k2, ks, kn), part(v, ks, kn), w, causal, dtype=dtype,
                                        q_offset=qs, k_offset=ks)
        ob, lb = rnd(ob), np.asarray(lb, np.float64)
        O, LSE = o[:, :, qs:qs + qn], lse[:, :, qs:qs + qn]
        new = np.logaddexp(LSE, lb)
        safe = np.where(np.isinf(new), 0, new)
        O[...] = np.exp(LSE - safe)[..., None] * O + np.exp(lb - safe)[..., None] * ob
        LSE[...] = new
    o = rnd(o)
    lse32 = lse.astype(np.float32)
    grads = [np.zeros_like(q1), np.zeros_like(k1), np.zeros_like(q2), np.zeros_like(k2),
             np.zeros_like(v)]
    for qs, qn, ks, kn in blocks:
        g = reference.lowp_backward(part(q1, qs, qn), part(k1, ks, kn), part(q2, qs, qn),
                                    part(k2, ks, kn), part(v, ks, kn), part(o, qs, qn),
                                    lse32[:, :, qs:qs + qn], part(do_h, qs, qn), w, causal,
                                    dtype=dtype, q_offset=qs, k_offset=ks)
        for acc, x, (a, n) in zip(grads, g, ((qs, qn), (ks, kn), (qs, qn), (ks, kn), (ks, kn))):
            acc[:, :, a:a + n] += rnd(x)
    return [o] + [rnd(g) for g in grads]
