"""Runs the Triton design (bench/flag_attn_seed.py, A100 table) forward+backward once per case, bf16,
L 2048, so that Triton's cache (TRITON_CACHE_DIR) holds its PTX; run from the repository root, then
grep -c 'wgmma.mma_async' / 'mma.sync.aligned' over the cache's .ptx files (isa_*.txt)."""
import sys, os
sys.path.insert(0, "bench")
import torch, flag_attn_seed as fas
mod = fas.load(fas.find_source(), "a100")
print("flavour:", fas.mma_flavour())
for D, causal in [(64, False), (128, True), (128, False)]:
    L, H = 2048, 16
    q1, k1, q2, k2, v = (torch.randn(1, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(5))
    try:
        o = mod.attention(q1, k1, q2, k2, v, L // 4, causal=causal)
        o.sum().backward()
        torch.cuda.synchronize()
        print(D, causal, "ok")
    except Exception as e:
        print(D, causal, type(e).__name__, str(e)[:150])
