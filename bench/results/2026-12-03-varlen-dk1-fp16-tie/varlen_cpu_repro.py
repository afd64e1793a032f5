"""CPU part of the varlen dk1 failure (seed 7164795616750225254, mma-float16-32-True-case3).

Regenerates the test's inputs from the seed exactly (NumPy draws, as run_packed does) and,
since o / lse come from the GPU forward in the test, stands in for them two ways: the
float64 forward rounded as the kernel stores it (o -> float16, lse -> float32), and the
float16 yardstick forward. For each: loss scale, the reference and yardstick gradients,
where dk1's bound comes from, the largest |dk1| and the yardstick's *unrounded* dk1 there
(how close it sits to a float16 rounding midpoint), and how the bound moves with o / lse.
Run: .venv/bin/python bench/results/2026-12-03-varlen-dk1-fp16-tie/varlen_cpu_repro.py   (writes varlen_cpu_repro.npz to the temp dir)
"""
import os, sys, tempfile
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))  # bench/results/<this dir>
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), HERE]

from cupy_piecewise import reference, tolerance
from cupy_piecewise.gpu_arrays import round_to
import test_varlen_gpu as T
import varlen_diag as V

SEED = V.SEED
lq, lk, H, Hkv, D, dtype, causal, w = V.LQ, V.LK, V.H, V.HKV, V.D, V.DTYPE, V.CAUSAL, V.W


def unrounded_lowp_dk1(host, cu, o, lse, do, dlse, sm_scale):
    """The yardstick's dk1 before its final float16 rounding (float32), packed."""
    rnd = lambda a: np.asarray(a, np.float32).astype(np.float16).astype(np.float32)
    (cq, ck) = cu
    parts = []
    for b in range(len(cq) - 1):
        qs, ks = (cq[b], cq[b + 1]), (ck[b], ck[b + 1])
        seq = [rnd(T._seq(x, *s)) for x, s in zip(host, (qs, ks, qs, ks, ks))]
        g = reference._backward_impl(*seq, rnd(T._seq(o, *qs)),
                                     np.asarray(lse[:, qs[0]:qs[1]][None], np.float32),
                                     rnd(T._seq(do, *qs)), w, causal, sm_scale, None,
                                     np.float32, rnd,
                                     dlse=np.asarray(dlse[:, qs[0]:qs[1]][None], np.float32),
                                     round_out=False)
        parts.append(g[1][0].transpose(1, 0, 2))
    return np.concatenate(parts, axis=0)


def ulp16(x):
    x = np.abs(np.asarray(x, np.float64))
    e = np.floor(np.log2(np.maximum(x, 2.0**-14)))
    return 2.0 ** (e - 10)


rng = np.random.default_rng(SEED)
host, cu = T._packed_host(lq, lk, H, Hkv, D, dtype, rng)
state_after_inputs = rng.bit_generator.state
sm_scale = 1.0 / np.sqrt(D)
(o_ref, lse_ref), (o_low, lse_low) = T._reference(host, cu, w, causal, sm_scale, dtype)
print(f"seed {SEED}: inputs drawn with NumPy on the host (default_rng(seed)): q1 {host[0].shape}, "
      f"k1 {host[1].shape}, ... x{T.INPUT_SCALE[dtype]} rounded to {dtype}; cu_q {cu[0]}, cu_k {cu[1]}")
print(f"w {w}, sm_scale {sm_scale:.6f}; per sequence P = N - M: {[b - a for a, b in zip(lq, lk)]}")
for x, n in zip(host, ("q1", "k1", "q2", "k2", "v")):
    print(f"  {n}: max|x| {np.abs(x).max():.3f}, min|x| {np.abs(x).min():.2e}, zeros {np.count_nonzero(x == 0)}")

saved = {}
for label, (o_use, l_use) in (
        ("A: float64 forward (o->fp16, lse->fp32)", (round_to(o_ref.astype(np.float32), dtype),
                                                    lse_ref.astype(np.float32).astype(np.float64))),
        ("B: yardstick forward (fp16 o, fp32 lse)", (o_low, lse_low.astype(np.float64)))):
    rng.bit_generator.state = state_after_inputs
    o_used = round_to(np.asarray(o_use, np.float32), dtype)
    do_h = round_to(rng.standard_normal(o_used.shape).astype(np.float32), dtype)
    dlse_h = rng.standard_normal(l_use.shape).astype(np.float32)
    grads_ref, grads_low = T._reference(host, cu, w, causal, sm_scale, dtype, do_h, o_used, l_use, dlse_h)
    s = tolerance.float16_loss_scale([g[None] for g in grads_ref], do_h[None])
    if s != 1.0:
        do_h, dlse_h = do_h * np.float32(s), dlse_h * np.float32(s)
        grads_ref, grads_low = T._reference(host, cu, w, causal, sm_scale, dtype, do_h, o_used,
                                            l_use, dlse_h)
    print(f"\n===== stand-in {label}; loss scale {s}; max|do| {np.abs(do_h).max():.3f}, "
          f"max|dlse| {np.abs(dlse_h).max():.3f}")
    ref, low = grads_ref[1], grads_low[1]
    raw = unrounded_lowp_dk1(host, cu, o_used, l_use, do_h, dlse_h, sm_scale)
    v = tolerance.compare("dk1", low, ref, low, dtype)
    lerr = np.abs(low - ref)
    print(f"dk1: max|ref| {np.abs(ref).max():.4f}; yardstick max err {lerr.max():.3e} -> bound "
          f"{v.bound:.3e}; float16 ulp at max|ref|: {ulp16(np.abs(ref).max()):.3e}")
    print(f"  unrounded yardstick (before its final float16 rounding) max error "
          f"{np.abs(raw - ref).max():.3e}")
    print("  top-8 |dk1| elements: row seq pos head col, ref, yardstick, unrounded yardstick, "
          "|low-ref|, unrounded err, distance of unrounded to the nearest fp16 midpoint (ulps)")
    for flat in np.argsort(np.abs(ref), axis=None)[::-1][:8]:
        r, h, c = np.unravel_index(flat, ref.shape)
        sq, pos = V._locate(r, cu[1])
        u = ulp16(ref[r, h, c])
        frac = raw[r, h, c] / u
        mid = abs((frac - np.floor(frac)) - 0.5)
        print(f"   {r:4d} {sq} {pos:4d} {h} {c:3d} {ref[r, h, c]:+.6f} {low[r, h, c]:+.6f} "
              f"{raw[r, h, c]:+.6f} {lerr[r, h, c]:.3e} {abs(raw[r, h, c] - ref[r, h, c]):.3e} "
              f"{mid:.3f}  users {V._key_users(sq, pos, lq, lk, w, causal)}")
    # how many dk1 elements could fail a 1-output-ulp miss: err > bound if rounded 1 ulp off
    worst_if_flip = ulp16(ref) + np.abs(raw - ref)  # rounding one ulp the wrong way
    print(f"  elements where an impl equal to the unrounded yardstick but rounded one ulp the "
          f"other way would exceed the bound: {int(np.count_nonzero(worst_if_flip - 0.5 * ulp16(ref) > v.bound))}"
          f" (|ref| >= 4: {int(np.count_nonzero(np.abs(ref) >= 4))} elements)")
    # seq 3: one query against 300 keys
    a, b = cu[1][3], cu[1][4]
    print(f"  seq 3 (1 query, 300 keys, P=299): dk1 nonzero for key pos >= {299 - w + 1} "
          f"(d = 299 - j < {w}); max|dk1| there {np.abs(ref[a:b]).max():.4f}, "
          f"rows with all-zero ref dk1: {int(np.count_nonzero(np.all(ref[a:b] == 0, axis=(1, 2))))}")
    for sname, cc in (("dk1 all-zero key rows (ref) per seq", None),):
        zs = []
        for sq in range(4):
            a, b = cu[1][sq], cu[1][sq + 1]
            zs.append(int(np.count_nonzero(np.all(ref[a:b] == 0, axis=(1, 2)))))
        print(f"  {sname}: {zs}")
    V.report(grads_low, grads_ref, grads_low, cu, lq, lk, w, causal, dtype,
             label=f"{label}: yardstick reported as impl", top=5, brief_top=0)
    saved[label[0]] = dict(o=o_used, lse=l_use, do=do_h, dlse=dlse_h, ref=grads_ref, low=grads_low,
                           raw_dk1=raw)
A = saved["A"]
B = saved["B"]
print("\nsensitivity to the forward stand-in (A vs B): max|ref dk1 A - B| "
      f"{np.abs(A['ref'][1] - B['ref'][1]).max():.3e}, max|low dk1 A - B| "
      f"{np.abs(A['low'][1] - B['low'][1]).max():.3e}")
np.savez_compressed(os.path.join(tempfile.gettempdir(), "varlen_cpu_repro.npz"),
                    **{f"in_{n}": x for n, x in zip(("q1", "k1", "q2", "k2", "v"), host)},
                    cu_q=cu[0], cu_k=cu[1],
                    **{f"{k}_{n}": x for k in "AB" for n, x in
                       (("o", saved[k]["o"]), ("lse", saved[k]["lse"]), ("do", saved[k]["do"]),
                        ("dlse", saved[k]["dlse"]), ("raw_dk1", saved[k]["raw_dk1"]))},
                    **{f"{k}_ref_{n}": g for k in "AB" for n, g in zip(V.NAMES, saved[k]["ref"])},
                    **{f"{k}_low_{n}": g for k in "AB" for n, g in zip(V.NAMES, saved[k]["low"])})
