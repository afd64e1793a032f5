#!/usr/bin/env python3
"""One attention shape, forward and backward a few times: the process to put under ncu.

    PYTHONPATH=$PWD python3 scripts/profile_case.py --L 8192 --D 128 [--causal] [--deterministic]

B = 16384 / L, H = 2048 / D (the bench's shapes), bfloat16 by default, w = L / 4; torch
autograd through cupy_piecewise.attention (so the default path of the GPU: on an H200 the
Hopper forward and backward). scripts/gpu_run.sh's ncu step profiles the pw90_bwd and
pw90_forward launches of this process.

``--peer flash`` (or ``cudnn``) runs torch SDPA with that backend on the same shape instead,
to profile the standard-attention peer beside ours.

``--decode`` instead runs attention_with_kvcache a few times: one new token against L
cached keys per head (B = --batch, default 1; H = --heads query heads, default 32, over
--kv-heads key heads, default 32), what the ncu step profiles for pw_kvcache;
with ``--peer cudnn`` (or ``flash``) it runs SDPA's decode on that shape instead (one query
row, is_causal=False: every cached key), the peer of scripts/gpu_run.sh's ncu_decode step.

``PW_TEST_MACROS`` (space-separated ``NAME=VALUE``) builds every kernel of the process with
those -D options (compile.apply_test_macros), to profile an A/B build.
"""
from __future__ import annotations

import argparse

import torch

import cupy_piecewise
from cupy_piecewise import compile as _compile


def main() -> None:
    _compile.apply_test_macros()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--L", type=int, default=8192)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--decode", action="store_true", help="KV-cache decode instead")
    ap.add_argument("--peer", choices=("flash", "cudnn"), default=None,
                    help="standard attention through torch SDPA with this backend instead "
                         "(one q, k, v; the same B, H, L, D): the peer to profile beside ours")
    ap.add_argument("--batch", type=int, default=1, help="--decode: sequences (B)")
    ap.add_argument("--heads", type=int, default=32,
                    help="--decode: query heads (H), a multiple of --kv-heads")
    ap.add_argument("--kv-heads", type=int, default=32,
                    help="--decode: key heads (Hkv) under the --heads query heads: GQA below H "
                         "(bench/kvcache_decode.py's grouped row is --batch 4 --kv-heads 8)")
    ap.add_argument("--rotary", type=int, default=None, metavar="G2",
                    help="--decode: attention_with_rotary_kvcache instead, keys rotated at n "
                         "(k1) and at n // G2 (k2; 0: ReRoPE's raw k2), halves layout")
    ap.add_argument("--w-frac", type=float, default=0.25,
                    help="w = L * this (1: every key near, one product per tile)")
    a = ap.parse_args()
    if a.decode:
        if a.heads < 1 or a.kv_heads < 1 or a.heads % a.kv_heads:
            ap.error(f"--heads ({a.heads}) must be a positive multiple of --kv-heads "
                     f"({a.kv_heads})")
        dt = getattr(torch, a.dtype)
        B, H, Hkv = a.batch, a.heads, a.kv_heads
        q1, q2 = (torch.randn(B, H, 1, a.D, device="cuda", dtype=dt) for _ in range(2))
        caches = [torch.randn(B, Hkv, a.L, a.D, device="cuda", dtype=dt) for _ in range(3)]
        seq = torch.full((B,), a.L, dtype=torch.int32, device="cuda")
        w = int(a.L * a.w_frac)
        if a.peer is not None:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            backend = {"flash": SDPBackend.FLASH_ATTENTION,
                       "cudnn": SDPBackend.CUDNN_ATTENTION}[a.peer]
            with sdpa_kernel(backend):
                for _ in range(a.iters):
                    torch.nn.functional.scaled_dot_product_attention(
                        q1, caches[0], caches[2], enable_gqa=Hkv != H)
            torch.cuda.synchronize()
            print(f"done: SDPA {a.peer} decode B={B} H={H} Hkv={Hkv} L={a.L} D={a.D} {a.dtype}")
            return
        if a.rotary is None:
            def step():
                cupy_piecewise.attention_with_kvcache(q1, q2, *caches, w, cache_seqlens=seq)
        else:  # the first cache holds the raw keys
            ang = torch.arange(a.L, device="cuda")[:, None] * 10000.0 ** (
                -torch.arange(a.D // 2, device="cuda") / (a.D // 2))
            cos, sin = ang.cos().float(), ang.sin().float()

            def step():
                cupy_piecewise.attention_with_rotary_kvcache(
                    q1, q2, caches[0], caches[2], w, cos=cos, sin=sin, cache_seqlens=seq,
                    k2_group_size=a.rotary or None)
        for _ in range(a.iters):
            step()
        torch.cuda.synchronize()
        print(f"done: decode B={B} H={H} Hkv={Hkv} L={a.L} D={a.D} {a.dtype} w={w} "
              f"rotary={a.rotary}")
        return
    B, H, dt = max(1, 16384 // a.L), max(1, 2048 // a.D), getattr(torch, a.dtype)
    ins = [torch.randn(B, H, a.L, a.D, device="cuda", dtype=dt).requires_grad_() for _ in range(5)]
    do = torch.randn(B, H, a.L, a.D, device="cuda", dtype=dt)
    if a.peer is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[a.peer]
        with sdpa_kernel(backend):
            for _ in range(a.iters):
                o = torch.nn.functional.scaled_dot_product_attention(
                    ins[0], ins[2], ins[4], is_causal=a.causal)
                o.backward(do)
        torch.cuda.synchronize()
        print(f"done: SDPA {a.peer} B={B} H={H} L={a.L} D={a.D} {a.dtype} causal={a.causal}")
        return
    for _ in range(a.iters):
        o = cupy_piecewise.attention(*ins, int(a.L * a.w_frac), causal=a.causal,
                                     deterministic=a.deterministic)
        o.backward(do)
    torch.cuda.synchronize()
    print(f"done: B={B} H={H} L={a.L} D={a.D} {a.dtype} causal={a.causal} "
          f"w={int(a.L * a.w_frac)} deterministic={a.deterministic}")


if __name__ == "__main__":
    main()
