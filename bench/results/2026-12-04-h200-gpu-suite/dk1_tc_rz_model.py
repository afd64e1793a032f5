"""Tensor-core-like dP (exact products, chunked sums added to a float32 accumulator with
round-toward-zero) against float32 RN delta: the one-key dk1 noise vs the SPEC yardstick.

Run from the repository root. A rough model of tensor-core accumulation, not a bit-exact one: on
the failing seed it gives 1.20x (chunks of 16) to 3.47x (chunks of 4) the bound where the H200 gave
1.003x, so it over-predicts (the hardware keeps more bits than plain truncation). What it shows is
only the direction: accumulation that truncates makes this noise larger than the yardstick's
round-to-nearest float32 sums.
"""
import sys, numpy as np
sys.path.insert(0, "tests"); sys.path.insert(0, ".")
from cupy_piecewise import reference
from cupy_piecewise.gpu_arrays import round_to
D, M, N, w, group, dtype = 128, 4096, 1, -5, 4, "float16"
def inputs(seed):
    rng = np.random.default_rng(seed)
    shapes = [(1, group, M, D), (1, 1, N, D), (1, group, M, D), (1, 1, N, D), (1, 1, N, D)]
    host = [round_to(rng.standard_normal(s).astype(np.float32) * 1.5, dtype) for s in shapes]
    do_h = round_to(rng.standard_normal((1, group, M, D)).astype(np.float32), dtype)
    return host, do_h
def rz32(x):
    f = x.astype(np.float32)
    over = np.abs(f.astype(np.float64)) > np.abs(x)
    f[over] = np.nextafter(f[over], np.float32(0))
    return f
def dp_tc(do, v, chunk):  # do (..., D), v (D,)
    prod = do.astype(np.float64) * v.astype(np.float64)
    c = np.zeros(do.shape[:-1], np.float32)
    for k0 in range(0, D, chunk):
        c = rz32(c.astype(np.float64) + prod[..., k0:k0 + chunk].sum(-1))
    return c
def delta_rn(do, o):  # per-thread sequential FMA over 8 columns, then a tree over 16 lanes
    part = np.zeros(do.shape[:-1] + (16,), np.float32)
    for j in range(8):
        part = (part.astype(np.float64) + do[..., j::8][..., :16].astype(np.float64) * o[..., j::8][..., :16]).astype(np.float32)
    while part.shape[-1] > 1:
        h = part.shape[-1] // 2
        part = (part[..., :h] + part[..., h:]).astype(np.float32)
    return part[..., 0]
sm = np.float32(1 / np.sqrt(D))
pos = np.arange(M) - (M - N)
near = pos < w
rows = []
for sd in [8874206483810085438] + list(range(1, 41)):
    host, do_h = inputs(sd)
    q1, k1, q2, k2, v = host
    o, lse = reference.forward(*host, w, False, float(sm))
    o_used = round_to(o.astype(np.float32), dtype)
    lw = reference.lowp_backward(*host, o_used, lse.astype(np.float32), do_h, w, False, float(sm), dtype=dtype)
    bound = 2 * np.abs(lw[1]).max() + 1e-5
    res = []
    for chunk in (4, 8, 16):
        dp = dp_tc(do_h[0], v[0, 0, 0], chunk)          # (group, M)
        dl = delta_rn(do_h[0], o_used[0])
        ds = (dp - dl).astype(np.float32)
        ds1 = np.where(near[None], ds, 0)
        dk1 = round_to((np.einsum("hm,hmd->d", ds1, q1[0]) * sm).astype(np.float32), dtype)
        res.append(np.abs(dk1).max())
    rows.append((sd, np.abs(lw[1]).max(), bound, *res))
    print(f"seed {sd}: lowp {rows[-1][1]:.3e} bound {bound:.3e} | tc-like chunk4 {res[0]:.3e} ({res[0]/bound:.2f}x) chunk8 {res[1]:.3e} ({res[1]/bound:.2f}x) chunk16 {res[2]:.3e} ({res[2]/bound:.2f}x)", flush=True)
r = np.array([x[3:] for x in rows]) / np.array([x[2] for x in rows])[:, None]
print("fraction over the bound (chunk 4/8/16):", (r > 1).mean(0), " median ratio:", np.median(r, 0))
