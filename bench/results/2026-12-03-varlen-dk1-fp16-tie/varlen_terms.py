"""Where dk1[row 204 = seq 1 key 76, kv head 0, col 27]'s float16 error comes from (CPU).
Uses varlen_cpu_repro.npz (temp dir, from varlen_cpu_repro.py) (stand-in B: the yardstick forward's o / lse, which
reproduces the test's dk1 bound 4.533e-3). Run after varlen_cpu_repro.py."""
import os, sys, tempfile
import numpy as np
HERE = os.path.dirname(os.path.abspath(__file__))
z = np.load(os.path.join(tempfile.gettempdir(), "varlen_cpu_repro.npz"))
f16 = lambda a: np.asarray(a, np.float32).astype(np.float16).astype(np.float32)
which = sys.argv[1] if len(sys.argv) > 1 else "B"
q1, k1, v = z["in_q1"], z["in_k1"], z["in_v"]
o, lse, do, dlse = z[f"{which}_o"], z[f"{which}_lse"], z[f"{which}_do"], z[f"{which}_dlse"]
cq, ck = z["cu_q"], z["cu_k"]
s, key, g, col = 1, 76, 0, 27
sc = 1 / np.sqrt(32); w = 100
M, N = cq[s + 1] - cq[s], ck[s + 1] - ck[s]; P = N - M
tot64 = tot32 = tot16 = 0.0
rows = []
for h in (2 * g, 2 * g + 1):
    Q1 = q1[cq[s]:cq[s + 1], h].astype(np.float64); K1 = k1[ck[s]:ck[s + 1], g].astype(np.float64)
    V = v[ck[s]:ck[s + 1], g].astype(np.float64)
    dO = do[cq[s]:cq[s + 1], h].astype(np.float64); O = o[cq[s]:cq[s + 1], h].astype(np.float64)
    L = lse[h, cq[s]:cq[s + 1]].astype(np.float64); dl = dlse[h, cq[s]:cq[s + 1]].astype(np.float64)
    delta = (dO * O).sum(1) - dl
    i = np.arange(M); d = i + P - key
    ok = (d >= 0) & (d < w)
    sc_ = (Q1 @ K1[key]) * sc                  # all d < w for this key: projection 1
    p = np.exp(sc_ - L); dp = dO @ V[key]
    ds64 = p * (dp - delta)
    ds32 = (np.float32(p) * (np.float32(dp) - np.float32(delta))).astype(np.float32)
    ds16 = f16(ds32)
    t64 = sc * ds64 * Q1[:, col]; t16 = sc * ds16.astype(np.float64) * Q1[:, col]
    tot64 += t64[ok].sum(); tot16 += t16[ok].sum()
    for ii in np.nonzero(ok)[0]:
        rows.append((h, ii, p[ii], ds64[ii], ds16[ii], t64[ii], t16[ii] - t64[ii]))
print(f"stand-in {which}: dk1 ref (this recomputation) {tot64:+.6f}; with dS rounded to fp16 "
      f"(all else exact) {tot16:+.6f}: error {tot16 - tot64:+.3e}")
mid = -7.919921875
print(f"fp16 neighbours -7.917969 / -7.921875, midpoint {mid}; the fp16-dS sum is "
      f"{(tot16 - mid) / 2**-8:+.4f} ulp from the midpoint")
rows.sort(key=lambda r: -abs(r[6]))
print(f"{len(rows)} terms (2 heads x queries with 0 <= d < w). Largest dS-rounding errors:")
print("  head query      p          dS(f64)      dS(fp16)     term        term err")
for r in rows[:8]:
    print(f"  {r[0]}  {r[1]:4d}  {r[2]:.4e}  {r[3]:+.5e}  {r[4]:+.5e}  {r[5]:+.4e}  {r[6]:+.3e}")
ps = np.array([r[2] for r in rows]); dss = np.array([abs(r[3]) for r in rows])
print(f"  max p {ps.max():.3f}, max|dS| {dss.max():.3f}; sum of term errors {sum(r[6] for r in rows):+.3e}, "
      f"rms-expected {np.sqrt(sum(r[6]**2 for r in rows)):.3e}")
