"""Decode against a KV cache: effective bandwidth of ``attention_with_kvcache`` (contiguous
and paged) beside PyTorch's SDPA (cuDNN and flash) on the same shapes, in one run.

Each step attends M = 1 new query per sequence and head to N cached keys. Effective bytes
are what the step must move at least: per cached key one key projection plus v (the other
projection is not read), the queries and the output (bench/common.decode_bytes; SDPA reads
one query). Every call is captured in a CUDA graph (20 calls per graph) and the graph
replayed: what a serving engine does, and what makes the figure the kernels' and not
Python's. Medians of CUDA-event timings after warm-up; the device copy bandwidth
(``dst.copy_(src)`` of 2 GiB) is measured in the same run. ``piecewise_kvcache_mma`` is the
same call with ``CUPY_PIECEWISE_PATH=mma``: the cp.async decode kernel, which an H200
replaces with the TMA one (kernels_cu/sm90/kvdecode.cu); ``--variants`` adds rows under
tuning settings of the latter. ``--rotary`` adds ``attention_with_rotary_kvcache`` rows
(one cache of raw keys rotated in the kernel: ReRoPE, and SelfExtend with groups of 8; the
same effective bytes, the float32 cos/sin reads not counted; on both decode kernels).

    PYTHONPATH=$PWD python3 bench/kvcache_decode.py --out bench/results/DIR/kvcache_decode.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import time

import torch
import torch.nn.attention
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import decode_bytes  # noqa: E402
from timing import event_median_ms  # noqa: E402

import cupy_piecewise  # noqa: E402

CALLS_PER_GRAPH = 20


def graph_ms(fn, reps: int = 15) -> float:
    """Median time of one ``fn()`` from CUDA-event timings of a graph of CALLS_PER_GRAPH calls
    (captured after three eager warm-up calls on a side stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / CALLS_PER_GRAPH)
    return statistics.median(times)


def copy_gbps() -> float:
    """Device copy bandwidth, as bench.py's decode section measures it: ``dst.copy_(src)``
    of 2 GiB, (read + write bytes) / median of eager CUDA-event timings."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = event_median_ms(lambda: dst.copy_(src), warmup=3, reps=10)
    return 2 * 2 * n / (ms * 1e-3) / 1e9


@contextlib.contextmanager
def kernel_choice(path=None, stages=None, head_dim=None, min_tiles=None, max_cluster=None,
                  pdl=None, pdl_decode=None, l2=None, rot_stage_unsplit=None):
    """Run the body with ``CUPY_PIECEWISE_PATH=path`` (``'mma'``: the cp.async decode kernel
    instead of the Hopper TMA one) and/or, for tuning comparisons, the Hopper decode's ring
    depth for ``head_dim`` set to ``stages``, its fewest key tiles per split to ``min_tiles``,
    its largest cluster of splits merged on chip to ``max_cluster``, its programmatic
    launches of the merge (``pdl``) and of the decode (``pdl_decode``) on or off, and the L2
    promotion of the caches' tensor maps to ``l2`` bytes (0, 64, 128 or 256), and the rotary
    decode's staged-table form where it does not split (``rot_stage_unsplit``,
    capability.KV90_ROT_STAGE_UNSPLIT) on or off. Restores all
    of it and drops the KV-cache plans built meanwhile (a plan keeps its kernel, split count
    and launch flags, and no tuning knob is in the plan's key)."""
    from cupy_piecewise import capability, kvcache_launch, tma

    saved_env = os.environ.get(capability.PATH_VAR)
    saved = (dict(capability.KV90_TILES), dict(capability.KV90_MIN_TILES),
             capability.KV90_MAX_CLUSTER, capability.KV90_PDL, capability.KV90_PDL_DECODE,
             tma._L2_PROMOTION_128B, capability.KV90_ROT_STAGE_UNSPLIT)
    try:
        if rot_stage_unsplit is not None:
            capability.KV90_ROT_STAGE_UNSPLIT = bool(rot_stage_unsplit)
        if pdl is not None:
            capability.KV90_PDL = bool(pdl)
        if pdl_decode is not None:
            capability.KV90_PDL_DECODE = bool(pdl_decode)
        if l2 is not None:
            tma._L2_PROMOTION_128B = {0: 0, 64: 1, 128: 2, 256: 3}[l2]
        if path is not None:
            os.environ[capability.PATH_VAR] = path
            capability.refresh_env_override()
        if stages is not None:
            t = capability.KV90_TILES[head_dim]
            capability.KV90_TILES[head_dim] = capability.TileConfig(
                t.block_m, t.block_n, t.num_warps, stages)
        if min_tiles is not None:
            capability.KV90_MIN_TILES[head_dim] = min_tiles
        if max_cluster is not None:
            capability.KV90_MAX_CLUSTER = max_cluster
        kvcache_launch._plans._data.clear()
        yield
    finally:
        if saved_env is None:
            os.environ.pop(capability.PATH_VAR, None)
        else:
            os.environ[capability.PATH_VAR] = saved_env
        capability.refresh_env_override()
        capability.KV90_TILES.clear()
        capability.KV90_TILES.update(saved[0])
        capability.KV90_MIN_TILES.clear()
        capability.KV90_MIN_TILES.update(saved[1])
        capability.KV90_MAX_CLUSTER = saved[2]
        (capability.KV90_PDL, capability.KV90_PDL_DECODE, tma._L2_PROMOTION_128B,
         capability.KV90_ROT_STAGE_UNSPLIT) = saved[3:]
        kvcache_launch._plans._data.clear()


def run_case(dtype, D, B, H, Hkv, N, block_sizes, w_frac=0.25, variants=(), rotary=False):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(N + H + D)
    q1, q2 = (torch.randn(B, H, 1, D, device=dev, dtype=dtype, generator=g) for _ in range(2))
    k1, k2, v = (torch.randn(B, Hkv, N, D, device=dev, dtype=dtype, generator=g) for _ in range(3))
    seq = torch.full((B,), N, dtype=torch.int32, device=dev)
    w = int(N * w_frac)
    elt = torch.empty((), dtype=dtype).element_size()
    rows = []

    def add(name, fn, n_queries, note=""):
        nbytes = decode_bytes(B, H, Hkv, 1, N, D, elt, n_queries)
        try:
            ms = graph_ms(fn)
            rows.append(dict(provider=name, ms=ms, gbps=nbytes / (ms * 1e-3) / 1e9, note=note))
        except Exception as e:  # a provider that cannot run this shape is reported, not fatal
            rows.append(dict(provider=name, ms=None, gbps=None, note=f"{type(e).__name__}: {e}"[:200]))
            torch.cuda.synchronize()

    def ours():
        return cupy_piecewise.attention_with_kvcache(q1, q2, k1, k2, v, w, cache_seqlens=seq)

    add("piecewise_kvcache", ours, 2)
    with kernel_choice(path="mma"):  # the cp.async kernel (the only one off Hopper)
        add("piecewise_kvcache_mma", ours, 2, "CUPY_PIECEWISE_PATH=mma")
    for name in variants:  # tuning: e.g. "s4c2m16" = 4 stages, clusters <= 2, >= 16 tiles
        knobs = {k: int(v) for k, v in re.findall(r"([scm])(\d+)", name)}
        with kernel_choice(stages=knobs.get("s"), head_dim=D, min_tiles=knobs.get("m"),
                           max_cluster=knobs.get("c")):
            add(f"piecewise_kvcache_{name}", ours, 2, f"Hopper decode {name}")
    if rotary:  # k1 serves as the raw key cache; tables of N positions
        ang = torch.arange(N, device=dev, dtype=torch.float32)[:, None] * 10000.0 ** (
            -torch.arange(D // 2, device=dev, dtype=torch.float32) / (D // 2))
        cos, sin = ang.cos(), ang.sin()
        for name, g2 in (("rerope", None), ("selfextend", 8)):
            def rot(g2=g2):
                return cupy_piecewise.attention_with_rotary_kvcache(
                    q1, q2, k1, v, w, cos=cos, sin=sin, cache_seqlens=seq, k2_group_size=g2)
            add(f"piecewise_rotary_{name}", rot, 2, "rotary inside")
            with kernel_choice(path="mma"):
                add(f"piecewise_rotary_{name}_mma", rot, 2,
                    "rotary inside, CUPY_PIECEWISE_PATH=mma")
    for bs in block_sizes:
        # one shuffled page order for the three caches, as a paged allocator hands them out
        table = torch.randperm(B * (N // bs), device=dev).view(B, N // bs).to(torch.int32)
        p1, p2, pv = (paged_with(c, table, bs) for c in (k1, k2, v))
        add(f"piecewise_kvcache_paged{bs}", lambda p1=p1, p2=p2, pv=pv, t=table:
            cupy_piecewise.attention_with_kvcache(q1, q2, p1, p2, pv, w, cache_seqlens=seq,
                                                  block_table=t), 2)
        del p1, p2, pv
    gqa = dict(enable_gqa=True) if H != Hkv else {}
    for name, backend in (("sdpa_cudnn", torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
                          ("sdpa_flash", torch.nn.attention.SDPBackend.FLASH_ATTENTION)):
        def sdpa(backend=backend):
            with torch.nn.attention.sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q1, k1, v, **gqa)
        add(name, sdpa, 1)
    return rows


def paged_with(cache, table, bs):
    """The cache's rows in the pages ``table`` (B, nb) assigns -> (B * nb, Hkv, bs, D)."""
    B, Hkv, N, D = cache.shape
    nb = N // bs
    pages = torch.empty(B * nb, Hkv, bs, D, dtype=cache.dtype, device=cache.device)
    pages[table.flatten().long()] = cache.view(B, Hkv, nb, bs, D).permute(0, 2, 1, 3, 4).reshape(
        B * nb, Hkv, bs, D)
    return pages


#: providers SPEC's results format lists that this script does not run, and why
NOT_RUN = {"flex_composite": "not run: FlexAttention has no KV-cache decode entry; bench.py's "
                             "decode section leaves it out too (one torch.compile per shape)"}


def results_json(rows, copy_gbps_, *, date, gpu, versions, command) -> dict:
    """SPEC.md's results format: ``header`` and the ``decode`` rows (effective bytes per
    second beside the copy bandwidth of the same run), plus a skipped row per provider of
    :data:`NOT_RUN` for each shape."""
    decode = []
    shapes = []
    for r in rows:
        row = dict(r, phase="fwd", causal=True, status="ok" if r["ms"] else "error",
                   error=r.get("note") or None, pct_of_copy_bw=r.get("pct_of_copy"))
        row.pop("note", None)
        row.pop("pct_of_copy", None)
        decode.append(row)
        key = tuple(r[k] for k in ("dtype", "B", "H", "Hkv", "M", "N", "D"))
        if key not in shapes:
            shapes.append(key)
    for key in shapes:
        for name, why in NOT_RUN.items():
            decode.append(dict(zip(("dtype", "B", "H", "Hkv", "M", "N", "D"), key),
                               provider=name, phase="fwd", causal=True, status="skipped",
                               error=why, ms=None, gbps=None))
    return {"header": {"date": date, "gpu": gpu, "versions": versions, "command": command,
                       "method": f"every call in a CUDA graph of {CALLS_PER_GRAPH}, median of "
                                 "15 replays (CUDA events)",
                       "bytes": "per cached key one key projection + v, the queries, the output",
                       "w": "N // 4"},
            "copy_bandwidth": {"gbps": copy_gbps_,
                               "method": "dst.copy_(src) of 2 GiB, (read + write) / median time"},
            "decode": decode}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="JSON results here")
    ap.add_argument("--quick", action="store_true", help="bf16, D 64 and 128, three shapes")
    ap.add_argument("--paged", default="64,256", help="block sizes of the paged rows ('' for none)")
    ap.add_argument("--rotary", action="store_true",
                    help="also time attention_with_rotary_kvcache (ReRoPE, SelfExtend G = 8)")
    ap.add_argument("--variants", default="",
                    help="tuning: also time the Hopper decode under these knob settings, comma-"
                         "separated, each of s<ring stages>, c<largest cluster>, m<fewest key "
                         "tiles per split> (e.g. c1,c4m16,s4)")
    args = ap.parse_args(argv)
    # an A/B build of kernels_cu/ timed through the whole table (PW_TEST_MACROS, as the GPU
    # suite takes it: compile.apply_test_macros), named in the output and the JSON's command
    from cupy_piecewise import compile as C

    macros = " ".join(m.removeprefix("-D") for m in C.apply_test_macros())
    if macros:
        print(f"PW_TEST_MACROS: {macros} (every kernel built with these -D options)", flush=True)
    cb = copy_gbps()
    print(f"device copy bandwidth {cb:.0f} GB/s", flush=True)
    # (B, H, Hkv, N): B*H = 32 and 256, short and long caches, one GQA shape
    shapes = [(1, 32, 32, 4096), (1, 32, 32, 32768), (1, 32, 32, 131072), (8, 32, 32, 4096),
              (8, 32, 32, 32768), (4, 32, 8, 32768)]
    dtypes = [torch.bfloat16, torch.float16]
    dims = [64, 128]
    if args.quick:
        shapes, dtypes, dims = [shapes[0], shapes[2], shapes[4]], [torch.bfloat16], [64, 128]
    results = []
    for dtype in dtypes:
        for D in dims:
            for B, H, Hkv, N in shapes:
                rows = run_case(dtype, D, B, H, Hkv, N,
                                tuple(int(b) for b in args.paged.split(",") if b),
                                variants=tuple(v for v in args.variants.split(",") if v),
                                rotary=args.rotary)
                torch.cuda.empty_cache()
                cudnn = next((r["gbps"] for r in rows if r["provider"] == "sdpa_cudnn"), None)
                contig = rows[0]["gbps"]
                for r in rows:
                    r.update(dtype=str(dtype).removeprefix("torch."), D=D, B=B, H=H, Hkv=Hkv,
                             M=1, N=N, pct_of_copy=100 * r["gbps"] / cb if r["gbps"] else None,
                             vs_cudnn=r["gbps"] / cudnn if r["gbps"] and cudnn else None,
                             vs_contiguous=r["gbps"] / contig if r["gbps"] and contig else None)
                    results.append(r)
                    print(f"{r['dtype']:8} D{D:<4} B{B} H{H:<3} Hkv{Hkv:<3} N{N:<7} "
                          f"{r['provider']:27} {r['ms'] or float('nan'):8.4f} ms "
                          f"{r['gbps'] or float('nan'):7.0f} GB/s "
                          f"{r['pct_of_copy'] or float('nan'):5.1f}% of copy  "
                          f"x{r['vs_cudnn'] or float('nan'):.2f} cuDNN {r['note']}", flush=True)
    if args.out:
        import cupy
        import numpy

        with open(args.out, "w") as f:
            json.dump(results_json(
                results, cb, date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(),
                versions={"torch": torch.__version__, "cupy": cupy.__version__,
                          "numpy": numpy.__version__},
                command=(f"PW_TEST_MACROS='{macros}' " if macros else "")
                + "PYTHONPATH=$PWD python3 bench/kvcache_decode.py "
                        + " ".join(argv if argv is not None else sys.argv[1:])), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
