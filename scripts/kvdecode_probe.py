#!/usr/bin/env python3
"""A/B probe of the Hopper KV-cache decode (kernels_cu/sm90/kvdecode.cu) on one GPU.

    PYTHONPATH=$PWD python3 scripts/kvdecode_probe.py --rounds 3 \\
        --configs "base;pdl=0;l2=256;KV90_QREG=1" --out $OUT/kvdecode_probe.txt

Each config is a set of space-separated tokens: ``NAME=VALUE`` compile-time macros of the
decode kernel and of the split merge ``pw_forward_combine`` (passed as -D options; e.g.
``PW_COMBINE_PREFETCH=1``, kernels_cu/forward.cu), ``pdl=0|1`` (the split merge as a programmatic
dependent launch, capability.KV90_PDL), ``pdld=0|1`` (the decode itself, KV90_PDL_DECODE),
``l2=128|256`` (the L2 promotion of the caches' tensor maps), ``s=N`` (ring stages,
KV90_TILES), ``c=N`` (most splits merged in a cluster, KV90_MAX_CLUSTER) and ``m=N`` (fewest
key tiles per split, KV90_MIN_TILES), the last three for the shape's head dim; ``rot=G``
times attention_with_rotary_kvcache instead (one raw key cache, halves layout, k1 rotated at
n, k2 at n // G; ``rot=1`` is ReRoPE's raw k2, ``rot=8`` SelfExtend with G = 8), and
``wp=P`` sets w to P% of N (default 25); ``rsu=0|1`` the rotary decode's staged-table form
where it does not split (capability.KV90_ROT_STAGE_UNSPLIT); ``base`` is the package's defaults. Configs with the same macros share one
worker process (a fresh process per macro set and round, so each build is compiled once and
cached by CuPy); within a worker the configs are timed back to back per shape, in an order
rotated every round, after SDPA cuDNN on the same shape. Rounds interleave the workers, and the table gives each cell's
median over the rounds and its spread, so that a difference smaller than the spread is not
read as one.

Shapes: bench/kvcache_decode.py's decode table (M = 1, w = N / 4, every sequence full), or
``--shapes "B,H,Hkv,N;..."``,
contiguous caches; timing as there (a CUDA graph of 20 calls, median of 15 replays);
effective bytes as there. Every config's output is checked against a float32 PyTorch
reference of the piecewise decode (max |err| / max |ref| < 2e-2; this is a sanity check of
the build under test, the test suite is the real one).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: host-side knobs a config may set (everything else is a -D macro of the kernel)
TOGGLES = ("pdl", "pdld", "l2", "s", "c", "m", "rot", "wp", "rsu")
SHAPES = [(1, 32, 32, 4096), (1, 32, 32, 32768), (1, 32, 32, 131072), (8, 32, 32, 4096),
          (8, 32, 32, 32768), (4, 32, 8, 32768)]


def parse_shapes(text):
    """``"B,H,Hkv,N;..."`` -> [(B, H, Hkv, N), ...] (``--shapes``; "" or None: SHAPES).

    Raises ValueError for an entry that is not four positive integers with H a multiple of
    Hkv."""
    if not text:
        return list(SHAPES)
    out = []
    for entry in text.split(";"):
        if not entry.strip():
            continue
        try:
            dims = tuple(int(x) for x in entry.split(","))
        except ValueError:
            raise ValueError(f"--shapes entry {entry!r}: expected B,H,Hkv,N integers") from None
        if len(dims) != 4 or min(dims) < 1 or dims[1] % dims[2]:
            raise ValueError(f"--shapes entry {entry!r}: expected four positive integers "
                             "B,H,Hkv,N with H a multiple of Hkv")
        out.append(dims)
    return out


def parse_config(text):
    """-> (sorted -D macros, {knob: int or None} for every knob of TOGGLES)"""
    macros, toggles = [], {k: None for k in TOGGLES}
    for tok in text.split():
        if tok == "base":
            continue
        name, _, value = tok.partition("=")
        if name in toggles:
            toggles[name] = int(value)
        else:
            macros.append(tok)
    return tuple(sorted(macros)), toggles


def reference(q1, q2, k1, k2, v, w, scale):
    """float32 piecewise decode of one new token per sequence at position N - 1."""
    import torch

    B, H, _, D = q1.shape
    Hkv, N = k1.shape[1], k1.shape[2]
    g = H // Hkv
    f = lambda t: t.float().repeat_interleave(g, dim=1) if g > 1 else t.float()  # noqa: E731
    s1 = torch.einsum("bhmd,bhnd->bhmn", q1.float(), f(k1))
    s2 = torch.einsum("bhmd,bhnd->bhmn", q2.float(), f(k2))
    far = (N - 1 - torch.arange(N, device=q1.device)) >= w
    s = torch.where(far, s2, s1) * scale
    return torch.einsum("bhmn,bhnd->bhmd", torch.softmax(s, dim=-1), f(v))


def rope_tables(N, D):
    """(N, D / 2) float32 cos and sin tables of the usual rotary frequencies (base 10000)."""
    import torch

    ang = torch.arange(N, device="cuda", dtype=torch.float32)[:, None] * 10000.0 ** (
        -torch.arange(D // 2, device="cuda", dtype=torch.float32) / (D // 2))
    return ang.cos(), ang.sin()


def rotate_halves(k, cos, sin, group):
    """Keys (B, Hkv, N, D) rotated (rotate_half layout) at positions n // group, in float32."""
    import torch

    pos = torch.arange(k.shape[2], device=k.device) // group
    c, s = cos[pos], sin[pos]
    x = k.float()
    a, b = x[..., : k.shape[-1] // 2], x[..., k.shape[-1] // 2:]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


def settings(toggles, head_dim):
    """bench/kvcache_decode.kernel_choice with the knobs of ``toggles`` (parse_config's dict;
    None = the package's default) for ``head_dim``: a context that sets them for the body,
    restores them after and drops the KV-cache plans built meanwhile."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from kvcache_decode import kernel_choice

    t = toggles
    return kernel_choice(stages=t["s"], head_dim=head_dim, min_tiles=t["m"], max_cluster=t["c"],
                         pdl=t["pdl"], pdl_decode=t["pdld"], l2=t["l2"],
                         rot_stage_unsplit=t["rsu"])


def worker(macros, configs, dims, dtypes, seed, shapes=SHAPES):
    import torch
    import torch.nn.attention
    import torch.nn.functional as F

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import cupy_piecewise
    from common import decode_bytes
    from cupy_piecewise import compile as C, kvcache_launch
    from kvcache_decode import graph_ms

    # the configs take turns going first, round by round: within a worker the order alone
    # moved identical launches by up to 2% (bench/results/2026-12-03-h200-kvdecode-pdl)
    configs = configs[seed % len(configs):] + configs[:seed % len(configs)]
    if macros:  # the decode kernel's builds carry the macros, and its split merge's
        orig = C.Variant.options.fget
        extra = tuple(f"-D{m}" for m in macros)
        C.Variant.options = property(lambda self: orig(self) + (
            extra if self.phase in ("kvdecode_sm90", "fwd_combine") else ()))
        # and the launch sizes shared memory as those builds carve it (KV90_ROT_STAGE)
        cupy_piecewise.capability.apply_kernel_macros(macros)
    out = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for D in dims:
            for B, H, Hkv, N in shapes:
                gen = torch.Generator(device="cuda").manual_seed(seed + N + H + D + B)
                q1, q2 = (torch.randn(B, H, 1, D, device="cuda", dtype=dtype, generator=gen)
                          for _ in range(2))
                k1, k2, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=dtype, generator=gen)
                             for _ in range(3))
                seq = torch.full((B,), N, dtype=torch.int32, device="cuda")
                refs = {}
                nbytes = decode_bytes(B, H, Hkv, 1, N, D, q1.element_size(), 2)
                gqa = dict(enable_gqa=True) if H != Hkv else {}

                def cudnn():
                    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                        return F.scaled_dot_product_attention(q1, k1, v, **gqa)
                ms_c = graph_ms(cudnn)
                cb = decode_bytes(B, H, Hkv, 1, N, D, q1.element_size(), 1) / (ms_c * 1e-3) / 1e9
                for text in configs:
                    knobs = parse_config(text)[1]
                    w = N * (25 if knobs["wp"] is None else knobs["wp"]) // 100
                    rot = knobs["rot"]
                    if (rot, w) not in refs:
                        refs.clear()  # one reference alive at a time
                        if rot:
                            cos, sin = rope_tables(N, D)
                            r1 = rotate_halves(k1, cos, sin, 1)
                            r2 = rotate_halves(k1, cos, sin, rot) if rot > 1 else k1
                            refs[rot, w] = reference(q1, q2, r1, r2, v, w, D ** -0.5)
                            r1 = r2 = None
                        else:
                            refs[rot, w] = reference(q1, q2, k1, k2, v, w, D ** -0.5)
                    ref = refs[rot, w]
                    with settings(knobs, D):
                        if rot:
                            def ours():
                                return cupy_piecewise.attention_with_rotary_kvcache(
                                    q1, q2, k1, v, w, cos=cos, sin=sin, cache_seqlens=seq,
                                    k2_group_size=rot if rot > 1 else None)
                        else:
                            def ours():
                                return cupy_piecewise.attention_with_kvcache(
                                    q1, q2, k1, k2, v, w, cache_seqlens=seq)
                        o = ours()
                        torch.cuda.synchronize()
                        err = float((o.float() - ref).abs().max() / ref.abs().max())
                        ms = graph_ms(ours)
                        plan = next(iter(kvcache_launch._plans._data.values()))
                    out.append(dict(config=text, dtype=dtype_name, D=D, B=B, H=H, Hkv=Hkv, N=N,
                                    ms=ms, gbps=nbytes / (ms * 1e-3) / 1e9, cudnn_gbps=cb,
                                    err=err, ok=err < 2e-2, nsplit=plan.nsplit,
                                    cluster=plan.cluster, programmatic=list(plan.programmatic)))
                q1 = q2 = k1 = k2 = v = ref = refs = None  # free the caches before the next shape
                torch.cuda.empty_cache()
    print("RESULT " + json.dumps(out), flush=True)


def table(rows, configs, rounds) -> list[str]:
    """The report of the workers' ``rows``: the reference checks, then per shape and config
    the median GB/s over the rounds, its spread ((max - min) / median), the median ratio to
    SDPA cuDNN of the same worker, and the split count and cluster size."""
    out = []
    bad = [x for x in rows if not x["ok"]]
    out.append(f"reference checks: {len(rows) - len(bad)}/{len(rows)} passed" +
               "".join(f"\n  FAILED {x['config']} {x['dtype']} D{x['D']} B{x['B']} "
                       f"H{x['H']}/{x['Hkv']} N{x['N']} err {x['err']:.3g}" for x in bad))
    out.append(f"GB/s medians over {rounds} rounds (spread = (max - min) / median); x cuDNN = "
               "ours / SDPA cuDNN of the same worker, median; splits (cluster) per config")
    shape = lambda x: (x["dtype"], x["D"], x["B"], x["H"], x["Hkv"], x["N"])  # noqa: E731
    head = "| dtype | D | B | H/Hkv | N | " + " | ".join(configs) + " | cuDNN |"
    out += [head, "|" + "---|" * (head.count("|") - 1)]
    for k in sorted({shape(x) for x in rows}):
        cells = []
        for c in configs:
            xs = [x for x in rows if x["config"] == c and shape(x) == k]
            if not xs:
                cells.append("-")
                continue
            g = [x["gbps"] for x in xs]
            med = statistics.median(g)
            vs = statistics.median(x["gbps"] / x["cudnn_gbps"] for x in xs)
            cells.append(f"{med:.0f} ({(max(g) - min(g)) / med * 100:.1f}%) x{vs:.3f} "
                         f"s{xs[0]['nsplit']}c{xs[0]['cluster']}")
        cud = statistics.median(x["cudnn_gbps"] for x in rows if shape(x) == k)
        out.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]}/{k[4]} | {k[5]} | " + " | ".join(cells)
                   + f" | {cud:.0f} |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="base;pdl=0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--shapes", default="",
                    help='"B,H,Hkv,N;..." instead of the decode table\'s shapes (SHAPES)')
    ap.add_argument("--out", help="also write the table here (and the raw rows as .json)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(";") if c.strip()]
    dims = [int(d) for d in args.dims.split(",")]
    dtypes = args.dtypes.split(",")
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as e:
        ap.error(str(e))
    if args.worker is not None:
        macros = tuple(m for m in args.worker.split() if m)
        mine = [c for c in configs if parse_config(c)[0] == macros]
        worker(macros, mine, dims, dtypes, seed=int(os.environ.get("PROBE_SEED", "0")),
               shapes=shapes)
        return 0

    groups = sorted({parse_config(c)[0] for c in configs})
    rows, lines = [], []

    def say(s):
        print(s, flush=True)
        lines.append(s)
    t0 = time.time()
    for r in range(args.rounds):
        order = groups[r % len(groups):] + groups[:r % len(groups)]
        for macros in order:
            cmd = [sys.executable, __file__, "--worker", " ".join(macros), "--configs",
                   args.configs, "--dims", args.dims, "--dtypes", args.dtypes,
                   "--shapes", args.shapes]
            env = dict(os.environ, PROBE_SEED=str(r))
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
            got = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if p.returncode or not got:
                say(f"worker {macros} round {r} failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
                continue
            for row in json.loads(got[0][7:]):
                row["round"] = r
                rows.append(row)
            say(f"round {r} macros {' '.join(macros) or '(none)'}: done at {time.time() - t0:.0f} s")
    for line in table(rows, configs, args.rounds):
        say(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(x["ok"] for x in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
