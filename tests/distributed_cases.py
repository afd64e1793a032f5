"""Worker for the context-parallel tests (tests/test_distributed_*.py): one process per rank,
started by torch.multiprocessing. Each rank builds the same full inputs from a seed, takes
its shard, runs cupy_piecewise.distributed.attention forward and backward, and gathers o
and the five gradients back; rank 0 compares them with one single-device call over the
whole sequence and writes a JSON report (one entry per case) for the parent to assert on.
"""
from __future__ import annotations

import json
import math
import os
import socket
import traceback


def run_and_check(world: int, tmp_path, backend: str, local_len: int, dtype_name: str,
                  B: int, H: int, Hkv: int, D: int, piece: int) -> None:
    """Spawn ``world`` ranks of :func:`worker` and assert that every case passed
    (:func:`cases`; ``piece``: the ring's small ``ring_piece``)."""
    _spawn(worker, world, str(tmp_path), backend, local_len, dtype_name, B, H, Hkv, D, piece)
    with open(os.path.join(str(tmp_path), f"report_{world}.json")) as f:
        report = json.load(f)
    assert len(report) == len(cases(world, local_len, piece))
    bad = [r for r in report if "error" in r or not r["passed"]]
    assert not bad, json.dumps(bad[:3], indent=1)


def _spawn(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, init, *args)`` in ``world`` processes (a fresh TCP rendezvous)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    mp.spawn(fn, args=(world, init, *args), nprocs=world, join=True)


def _join(rank: int, world: int, init: str, backend: str):
    """Join the process group; returns this rank's device (its GPU with NCCL, else the CPU)."""
    import torch
    import torch.distributed as dist

    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    return torch.device("cuda", rank) if cuda else torch.device("cpu")


def cases(world: int, local_len: int, piece: int):
    """(method, layout, causal, w, ring_piece) combinations, with w inside a shard, on a
    shard boundary, across one, negative and beyond the sequence; the ring with whole
    chunks (``ring_piece`` None on the CPU, the CUDA default elsewhere) and with ``piece``
    keys per message (chunks cut into several pieces, the last one shorter)."""
    L = world * local_len
    ws = (3, local_len, local_len + 3, local_len // 2, -2, L + 5)
    out = [(m, lay, c, w, None) for m in ("allgather", "ring") for lay in ("contiguous", "zigzag")
           for c in (False, True) for w in ws]
    out += [("ring", lay, c, w, piece) for lay in ("contiguous", "zigzag") for c in (False, True)
            for w in (3, local_len + 3, -2)]
    return out


def worker(rank: int, world: int, init: str, out: str, backend: str, local_len: int,
           dtype_name: str, B: int, H: int, Hkv: int, D: int, piece: int) -> None:
    import torch
    import torch.distributed as dist

    import cupy_piecewise
    from cupy_piecewise import distributed as cpd

    dev = _join(rank, world, init, backend)
    cuda = dev.type == "cuda"
    dtype = getattr(torch, dtype_name)
    report = []
    default_fwd_pieces = cpd.FWD_PIECES
    try:
        for i, (method, layout, causal, w, rp) in enumerate(cases(world, local_len, piece)):
            entry = dict(method=method, layout=layout, causal=causal, w=w, ring_piece=rp)
            try:
                L = world * local_len
                g = torch.Generator().manual_seed(1000 + i)
                shapes = [(B, H, L, D), (B, Hkv, L, D), (B, H, L, D), (B, Hkv, L, D), (B, Hkv, L, D)]
                full = [torch.randn(s, dtype=torch.float64, generator=g) for s in shapes]
                do_full = torch.randn(B, H, L, D, dtype=torch.float64, generator=g)
                loc = [cpd.shard(t, layout=layout).to(dev, dtype).requires_grad_() for t in full]
                # with small pieces, forward packets of two of them (the default, 16, would
                # make every forward packet a whole chunk at these lengths)
                cpd.FWD_PIECES = 2 if rp is not None else default_fwd_pieces
                o = cpd.attention(*loc, w, causal=causal, layout=layout, method=method,
                                  ring_piece=rp)
                if rp is None and method == "ring":  # the piece the call chose
                    rp = cpd._piece_keys(None, B, Hkv, dev)
                entry["fwd_pieces"] = cpd.FWD_PIECES
                o.backward(cpd.shard(do_full, layout=layout).to(dev, dtype))
                got = [cpd.unshard(o.detach(), layout=layout)]
                got += [cpd.unshard(t.grad, layout=layout) for t in loc]
                if rank == 0:
                    entry.update(_compare(got, full, do_full, w, causal, dtype_name, cupy_piecewise,
                                          method, layout, world, rp, cuda, cpd.FWD_PIECES))
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
             layout=None, world=None, piece=None, cuda=False, fwd_pieces=1):
    """float64 inputs: equal to one call within 1e-9 (relative). 16-bit inputs: the tolerance
    rule against the float64 reference of one call, with the low-precision error of the same
    blockwise computation (:func:`blockwise_lowp`: each block's result rounded to the input
    dtype before the float32 merge and sums, as the kernels' outputs are; dq summed unrounded
    where the Hopper backward adds every block into its float32 accumulator)."""
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
    low = blockwise_lowp(host, do_h, w, causal, dtype_name, method, layout, world, piece,
                         dq_rounded=not (cuda and _hopper_backward(full, dtype_name)),
                         fwd_pieces=fwd_pieces)
    verdicts = [tolerance.compare(n, g.numpy(), r, lw, dtype_name)
                for n, g, r, lw in zip(names, got, [o_ref] + list(g_ref), low)]
    return dict(errors={v.name: str(v) for v in verdicts}, passed=all(v.passed for v in verdicts))


def _hopper_backward(full, dtype_name) -> bool:
    """True when this GPU runs the blocks' backward on the Hopper kernels (float32 dQ
    accumulator), as cupy_piecewise.launch.use_hopper_backward decides."""
    import torch

    from cupy_piecewise import capability

    D = full[0].shape[3]
    return (torch.cuda.get_device_capability() == (9, 0) and capability.path_override() != "mma"
            and D in capability.HOPPER_BWD_HEAD_DIMS and dtype_name in ("float16", "bfloat16"))


def _blocks(method, layout, world, L, causal, piece):
    """(query start, length, key start, length) of every block the distributed call runs."""
    from cupy_piecewise.distributed import _pieces, chunks

    local = L // world
    out = []
    for r in range(world):
        for qc in chunks(r, world, local, layout):
            if method == "allgather":
                out.append((qc.start, qc.length, 0, qc.start + qc.length if causal else L))
                continue
            for owner in range(world):
                for kc in _pieces(chunks(owner, world, local, layout), piece):
                    if not causal or kc.start <= qc.start + qc.length - 1:
                        out.append((qc.start, qc.length, kc.start, kc.length))
    return out


def blockwise_lowp(host, do_h, w, causal, dtype, method, layout, world, piece=None,
                   dq_rounded=True, fwd_pieces=1):
    """The plain low-precision version of the distributed computation: the same blocks
    (query chunk x key range, per method and layout; the ring's forward in packets of
    ``fwd_pieces * piece`` keys, its backward of ``piece``), each through
    reference.lowp_forward / lowp_backward with its position offsets, results rounded to
    ``dtype`` (dq only with ``dq_rounded``), merged by lse and summed in float32, final
    values rounded to ``dtype``. Returns [o, dq1, dk1, dq2, dk2, dv]."""
    import numpy as np

    from cupy_piecewise import reference
    from cupy_piecewise.gpu_arrays import round_to

    q1, k1, q2, k2, v = host
    L = q1.shape[2]
    blocks = _blocks(method, layout, world, L, causal, None if piece is None else fwd_pieces * piece)
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
    keep = (lambda x: np.asarray(x, np.float32).astype(np.float64))  # noqa: E731
    for qs, qn, ks, kn in _blocks(method, layout, world, L, causal, piece):
        g = reference.lowp_backward(part(q1, qs, qn), part(k1, ks, kn), part(q2, qs, qn),
                                    part(k2, ks, kn), part(v, ks, kn), part(o, qs, qn),
                                    lse32[:, :, qs:qs + qn], part(do_h, qs, qn), w, causal,
                                    dtype=dtype, q_offset=qs, k_offset=ks)
        for i, (acc, x, (a, n)) in enumerate(zip(grads, g, ((qs, qn), (ks, kn), (qs, qn), (ks, kn),
                                                             (ks, kn)))):
            acc[:, :, a:a + n] += keep(x) if i in (0, 2) and not dq_rounded else rnd(x)
    return [o] + [rnd(g) for g in grads]


def run_and_check_long(world: int, tmp_path, L: int, B: int, H: int, Hkv: int, D: int,
                       dtype_name: str, w: int, backend: str = "nccl") -> None:
    """The issue's equality target at a real length: ``world`` ranks over NCCL, causal,
    zigzag, each method with its default pieces; o and the five gradients must pass the
    tolerance rule against the float64 reference (torch, on the GPU) with the single-GPU
    call over the whole sequence as the low-precision yardstick, i.e. the distributed result
    is within twice the single-GPU call's error of the exact answer (and inside the relative
    bound). The reference runs in float64 on the GPU through the torch implementation, which
    keeps lse in float32 on CUDA: a relative error near 1e-6 in the recomputed
    probabilities, far below the bfloat16 bounds."""
    path = os.path.join(str(tmp_path), "report_long.json")
    try:
        _spawn(long_worker, world, str(tmp_path), L, B, H, Hkv, D, dtype_name, w, backend)
    except Exception as e:  # a rank died: rank 0's report says why when it got that far
        detail = open(path).read() if os.path.exists(path) else "(no report from rank 0)"
        raise AssertionError(f"{e}\nrank 0 report: {detail}") from None
    with open(path) as f:
        report = json.load(f)
    assert len(report) == 2
    bad = [r for r in report if "error" in r or not r["passed"]]
    assert not bad, json.dumps(bad, indent=1)


def long_worker(rank, world, init, out, L, B, H, Hkv, D, dtype_name, w, backend):
    import torch
    import torch.distributed as dist

    import cupy_piecewise
    from cupy_piecewise import distributed as cpd
    from cupy_piecewise import tolerance, torch_cpu

    dev = _join(rank, world, init, backend)
    dtype = getattr(torch, dtype_name)
    report = []
    try:
        g = torch.Generator().manual_seed(7)
        shapes = [(B, H, L, D), (B, Hkv, L, D), (B, H, L, D), (B, Hkv, L, D), (B, Hkv, L, D)]
        full = [torch.randn(s, generator=g).to(dev, dtype) for s in shapes]
        do_full = torch.randn(B, H, L, D, generator=g).to(dev, dtype)
        if rank == 0:  # the float64 reference and the single-GPU call, on this GPU
            ref_in = [t.double() for t in full]
            scale = 1.0 / math.sqrt(D)
            o_ref, lse_ref = torch_cpu.forward(*ref_in, w, True, scale)
            g_ref = torch_cpu.backward(do_full.double(), *ref_in, o_ref, lse_ref, w, True, scale)
            ref = [o_ref] + list(g_ref)
            leaves = [t.clone().requires_grad_() for t in full]
            o1 = cupy_piecewise.attention(*leaves, w, causal=True)
            o1.backward(do_full)
            one = [o1.detach()] + [t.grad for t in leaves]
        for method in ("ring", "allgather"):
            entry = dict(method=method, L=L, w=w)
            loc = [cpd.shard(t).requires_grad_() for t in full]
            o = cpd.attention(*loc, w, causal=True, method=method)
            o.backward(cpd.shard(do_full))
            got = [cpd.unshard(o.detach())] + [cpd.unshard(t.grad) for t in loc]
            if rank == 0:
                names = ("o", "dq1", "dk1", "dq2", "dk2", "dv")
                verdicts = [tolerance.compare(n, x.double().cpu().numpy(), r.cpu().numpy(),
                                              s.double().cpu().numpy(), dtype_name)
                            for n, x, r, s in zip(names, got, ref, one)]
                # the same rule for the single-GPU call against the reference (context)
                alone = [tolerance.compare(n, s.double().cpu().numpy(), r.cpu().numpy(),
                                           s.double().cpu().numpy(), dtype_name)
                         for n, r, s in zip(names, ref, one)]
                entry.update(errors=[str(v) for v in verdicts],
                             single_gpu=[str(v) for v in alone],
                             passed=all(v.passed for v in verdicts))
                report.append(entry)
                print(json.dumps(entry, indent=1), flush=True)
            del loc, o, got
    except Exception:  # noqa: BLE001 - reported to the parent
        if rank == 0:
            report.append(dict(error=traceback.format_exc()))
        raise
    finally:
        if rank == 0:
            with open(os.path.join(out, "report_long.json"), "w") as f:
                json.dump(report, f)
        dist.destroy_process_group()
