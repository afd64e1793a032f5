"""Diagnose the varlen dk1 failure of
``PW_TEST_SEED=7164795616750225254 pytest tests/test_varlen_gpu.py -k
"test_packed_batches_match_reference and mma-float16-32-True-case3"``.

On a GPU:  PYTHONPATH=$PWD python3 bench/results/2026-12-03-varlen-dk1-fp16-tie/varlen_diag.py [--seed N] [--no-variants]
On a CPU:  python bench/results/2026-12-03-varlen-dk1-fp16-tie/varlen_diag.py --cpu [--standin A|B]   (the same inputs; the
           kernel's o / lse replaced by the yardstick forward's (B, default: reproduces the
           test's dk1 bound 4.533e-3 to 3 digits) or the float64 forward's (A); the
           yardstick is reported as "impl", and the dS-tie outcomes of the worst element are
           put through the rule)
bench/results/2026-12-03-varlen-dk1-fp16-tie/mock_gpu_check.py runs gpu_main on the CPU with a NumPy stand-in for cupy (control
flow only; the numbers are the NumPy path's).

Recreates the test exactly (tests/test_varlen_gpu.py::run_packed: same seed path through
tests/seeds.fresh_seed, same draws in the same order, same calls, CUPY_PIECEWISE_PATH=mma as
the kernel_path fixture sets), then for each backward variant prints: the plan (tiles),
the verdicts of all five gradients with where the yardstick's max error sits, the top-10
elements of dk1 (top-3/5 of the others) by |impl-ref| (packed row, sequence, position,
head, column, impl, ref, lowp, errors, err/bound, which queries use the key), per-sequence
errors, impl against the yardstick itself (bitwise / in float16 ulps), and for the worst
dk1 elements the outputs reachable by float16 dS ties (tie_outcomes: is the kernel's value
one of them?). Variants (each a fresh plan; the tile override is in the plan keys):

  default        deterministic=False, as the test calls it (on sm_90, D = 32 float16 has
                 no bwd_fused entry: the two-kernel delta + bwd_dq 64x64x4 + bwd_dkv 64x64x4)
  default-again  the same call again (bitwise equal?)
  det            deterministic=True (the same kernels on this path: expect equal bits)
  fused          the one-kernel backward forced: CUPY_PIECEWISE_TILES=bwd_fused=64x64x4, 32x64x2
  dkv=...        the two-kernel backward with other bwd_dkv tiles (16x64x4, 128x64x4, 64x32x2)

Variants after the first are skipped once 40 s have passed (NVRTC compiles each new tile
shape on first use). With $OUT set, the default run's gradients, o, lse, do, dlse are saved
to $OUT/varlen_diag_case.npz.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))  # bench/results/<this dir>
for path in (os.path.join(ROOT, "tests"), ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)

SEED = 7164795616750225254
LQ, LK = [64, 65, 63, 1], [128, 129, 127, 300]
H, HKV, D, DTYPE, CAUSAL = 4, 2, 32, "float16", True
W = max(1, max(LK) // 3)  # as test_packed_batches_match_reference
NAMES = ("dq1", "dk1", "dq2", "dk2", "dv")
#: (packed key row, kv head, column) of the largest |dk1|: seq 1, key 76 (the CPU analysis)
WATCH = (204, 0, 27)
T0 = time.time()


# ------------------------------------------------------------------ reporting (CPU only)

def _locate(row, cu):
    seq = int(np.searchsorted(cu, row, side="right") - 1)
    return seq, int(row - cu[seq])


def _key_users(seq, j, lq, lk, w, causal):
    """For key j of sequence seq: (queries attending it with d < w, with d >= w), queries
    aligned to the end of the keys (P = N - M), d = i + P - j."""
    M, N = lq[seq], lk[seq]
    P = N - M
    i = np.arange(M)
    d = i + P - j
    ok = d >= 0 if causal else np.ones(M, bool)
    return int(np.count_nonzero(ok & (d < w))), int(np.count_nonzero(ok & (d >= w)))


def _query_keys(seq, i, lq, lk, w, causal):
    """For query i of sequence seq: (keys with d < w, keys with d >= w) it attends."""
    M, N = lq[seq], lk[seq]
    P = N - M
    j = np.arange(N)
    d = i + P - j
    ok = d >= 0 if causal else np.ones(N, bool)
    return int(np.count_nonzero(ok & (d < w))), int(np.count_nonzero(ok & (d >= w)))


def report(grads, grads_ref, grads_low, cu, lq, lk, w, causal, dtype, label="", top=10,
           detail=("dk1",), brief_top=3, out=print):
    """Verdicts, top elements by |impl-ref| and per-sequence errors of the five gradients.
    ``grads``: host arrays (float64 or float32), packed (total, heads, D)."""
    from cupy_piecewise import tolerance

    kind = "tf32" if dtype == "float32" else dtype
    out(f"--- {label}")
    verdicts = {}
    for name, got, ref, low in zip(NAMES, grads, grads_ref, grads_low):
        got = np.asarray(got, np.float64)
        ref = np.asarray(ref, np.float64)
        low = np.asarray(low, np.float64)
        v = tolerance.compare(name, got, ref, low, kind)
        verdicts[name] = v
        lerr = np.abs(low - ref)
        li = np.unravel_index(int(np.argmax(lerr)), lerr.shape) if lerr.size else None
        extra = ""
        if li is not None:
            s, pos = _locate(li[0], cu[0] if name.startswith("dq") else cu[1])
            extra = (f"  yardstick max err {lerr[li]:.3e} at row {li[0]} (seq {s} pos {pos}) "
                     f"head {li[1]} col {li[2]}, ref {ref[li]:+.5e}; max|ref| "
                     f"{np.abs(ref).max():.4e}; err/bound {v.max_err / v.bound:.3f}")
        out(f"{v}\n{extra}")
    for name, got, ref, low in zip(NAMES, grads, grads_ref, grads_low):
        n = top if name in detail else brief_top
        if not n:
            continue
        got = np.asarray(got, np.float64)
        ref = np.asarray(ref, np.float64)
        low = np.asarray(low, np.float64)
        is_q = name.startswith("dq")
        c = cu[0] if is_q else cu[1]
        bound = verdicts[name].bound
        err = np.abs(got - ref)
        if not err.size:
            continue
        order = np.argsort(err, axis=None)[::-1][:n]
        out(f"  {name}: top {n} by |impl-ref| (bound {bound:.3e}); "
            f"{'query' if is_q else 'key'} position within its sequence; users = "
            f"{'keys (d<w, d>=w) the query attends' if is_q else 'queries (d<w, d>=w) attending the key'}")
        out(f"  {'row':>5} {'seq':>3} {'pos':>4} {'head':>4} {'col':>3} {'impl':>13} "
            f"{'ref':>13} {'lowp':>13} {'|impl-ref|':>10} {'|low-ref|':>10} {'err/bnd':>7} users")
        for flat in order:
            r, hd, col = np.unravel_index(int(flat), err.shape)
            s, pos = _locate(r, c)
            users = (_query_keys if is_q else _key_users)(s, pos, lq, lk, w, causal)
            out(f"  {r:5d} {s:3d} {pos:4d} {hd:4d} {col:3d} {got[r, hd, col]:+13.6e} "
                f"{ref[r, hd, col]:+13.6e} {low[r, hd, col]:+13.6e} {err[r, hd, col]:10.3e} "
                f"{abs(low[r, hd, col] - ref[r, hd, col]):10.3e} {err[r, hd, col] / bound:7.3f} "
                f"{users}")
        out(f"  {name}: per sequence  (max|impl-ref|, /bound, yardstick max|low-ref|, "
            f"max|ref|, rel L2 of the sequence)")
        for s in range(len(c) - 1):
            a, b = int(c[s]), int(c[s + 1])
            if a == b:
                out(f"    seq {s}: empty")
                continue
            e, le = err[a:b], np.abs(low[a:b] - ref[a:b])
            rn = np.linalg.norm(ref[a:b])
            rel = np.linalg.norm(got[a:b] - ref[a:b]) / rn if rn > 0 else float("nan")
            r, hd, col = np.unravel_index(int(np.argmax(e)), e.shape)
            out(f"    seq {s} (lq {lq[s]}, lk {lk[s]}): {e.max():.3e} ({e.max() / bound:.3f}) "
                f"at pos {r} head {hd} col {col}; yardstick {le.max():.3e}; max|ref| "
                f"{np.abs(ref[a:b]).max():.4e}; rel {rel:.3e}")
    return verdicts


def _f16(a):
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def _ulp16(x):
    """float16 spacing at |x| (normal range; 2^-24 below it)."""
    x = np.abs(np.asarray(x, np.float64))
    e = np.floor(np.log2(np.maximum(x, 2.0**-14)))
    return 2.0 ** (e - 10)


def impl_vs_lowp(grads, grads_low, grads_ref, out=print):
    """How far the kernel is from the yardstick itself. A kernel doing the yardstick's
    arithmetic (dS and P rounded to float16 before the products, float32 sums, output
    rounded) agrees bit for bit in most elements and by one float16 ulp where a rounding
    lands on the other side of a midpoint (two or more only where a dominant dS term sits on
    a tie). Ulps are counted only on elements with |ref| >= max|ref| / 4 (near zero the
    absolute difference is what the rule sees, given separately)."""
    out("  impl vs yardstick: bitwise equal; large elements (|ref| >= max/4) off by 0 / 1 / 2 / >2 "
        "float16 ulps; max|impl-lowp| overall")
    for name, got, low, ref in zip(NAMES, grads, grads_low, grads_ref):
        got = np.asarray(got, np.float64)
        low = np.asarray(low, np.float64)
        ref = np.asarray(ref, np.float64)
        if not got.size:
            continue
        big = np.abs(ref) >= np.abs(ref).max() / 4
        k = np.rint(np.abs(got - low)[big] / _ulp16(ref[big]))
        diff = np.abs(got - low)
        i = np.unravel_index(int(np.argmax(diff)), diff.shape)
        out(f"    {name}: equal {np.count_nonzero(got == low)} of {got.size}; large "
            f"{np.count_nonzero(k == 0)} / {np.count_nonzero(k == 1)} / {np.count_nonzero(k == 2)} / "
            f"{np.count_nonzero(k > 2)} of {k.size}; max|impl-lowp| {diff[i]:.3e} at row {i[0]} "
            f"head {i[1]} col {i[2]} (impl {got[i]:+.6f}, lowp {low[i]:+.6f}, ref {ref[i]:+.6f})")


def dk_terms(case, name, row, kvh, col, lq=None, lk=None, w=None, causal=None):
    """The terms sm_scale * dS(h, i) * q(h, i, col) of one dk1 / dk2 element, dS as the
    float64 reference has it (from the o / lse / do / dlse the check used), and how near each
    dS lies to a float16 rounding midpoint. -> (terms list, ref sum)."""
    lq, lk = lq or LQ, lk or LK
    w = W if w is None else w
    causal = CAUSAL if causal is None else causal
    q1, k1, q2, k2, v = case["host"]
    cq, ck = case["cu"]
    o, lse, do, dlse = case["o_used"], case["lse_k"], case["do"], case["dlse"]
    pair = 1 if name == "dk1" else 2
    q, k = (q1, k1) if pair == 1 else (q2, k2)
    s, j = _locate(row, ck)
    M, N = lq[s], lk[s]
    P = N - M
    sc = float(case["sm_scale"])
    group = q1.shape[1] // k1.shape[1]
    terms = []
    for h in range(kvh * group, (kvh + 1) * group):
        for i in range(M):
            d = i + P - j
            if (causal and d < 0) or ((d >= w) != (pair == 2)):
                continue
            r = cq[s] + i
            sc_ = float(q[r, h].astype(np.float64) @ k[ck[s] + j, kvh]) * sc
            pr = np.exp(sc_ - float(lse[h, r]))
            dp = float(do[r, h].astype(np.float64) @ v[ck[s] + j, kvh])
            delta = float(do[r, h].astype(np.float64) @ o[r, h]) - float(dlse[h, r])
            ds = pr * (dp - delta)
            u = float(_ulp16(ds))
            frac = abs(ds) / u - np.floor(abs(ds) / u)
            terms.append(dict(h=h, i=i, p=pr, ds=ds, q=float(q[r, h, col]),
                              margin=abs(frac - 0.5), flip=sc * u * abs(float(q[r, h, col]))))
    ref = sum(sc * t["ds"] * t["q"] for t in terms)
    return terms, ref


def tie_outcomes(case, name, row, kvh, col, impl=None, low=None, ref=None, tie=0.02, k=6,
                 out=print):
    """One dk1 / dk2 element: every dS rounded to float16 from its float64 value (what the
    yardstick and the kernel round, up to float32 noise), then every output reachable when
    the dS values lying within ``tie`` float16 ulps of a rounding midpoint (float32 noise,
    ~1e-5 relative, can push them either way) round the other way, and, where a sum lands
    within ``tie`` output ulps of a midpoint, both output neighbours. The kernel's value among
    them reads as float16 rounding; outside them, as arithmetic the yardstick does not model
    (or a bug)."""
    terms, ref_sum = dk_terms(case, name, row, kvh, col)
    sc = float(case["sm_scale"])
    base = [float(_f16(t["ds"])) for t in terms]
    cand = sorted((n for n, t in enumerate(terms) if t["margin"] < tie and t["flip"] > 1e-7),
                  key=lambda n: -terms[n]["flip"])[:k]
    outs = {}
    for mask in range(1 << len(cand)):
        ds = list(base)
        for b, n in enumerate(cand):
            if mask >> b & 1:  # the other float16 neighbour of dS
                t = terms[n]
                u = float(_ulp16(t["ds"]))
                lo = np.floor(t["ds"] / u) * u
                ds[n] = lo + u if ds[n] == lo else lo
        raw = sum(sc * x * t["q"] for x, t in zip(ds, terms))
        u = float(_ulp16(raw))
        frac = abs(raw) / u - np.floor(abs(raw) / u)
        vals = {float(_f16(raw))}
        if abs(frac - 0.5) < tie:  # the sum itself on an output midpoint
            lo = np.floor(raw / u) * u
            vals |= {float(lo), float(lo + u)}
        for val in vals:
            outs.setdefault(val, []).append((mask, raw))
    r0 = ref if ref is not None else ref_sum
    out(f"    {name}[row {row}, kv head {kvh}, col {col}]: {len(terms)} terms, ref {r0:+.6f} "
        f"(recomputed {ref_sum:+.6f}); largest term |{max(abs(sc * t['ds'] * t['q']) for t in terms):.3f}|, "
        f"largest dS |{max(abs(t['ds']) for t in terms):.3f}|")
    if not cand:
        out(f"      no dS within {tie} ulp of a float16 midpoint")
    for n in cand:
        t = terms[n]
        out(f"      tie dS: head {t['h']} query {t['i']}: p {t['p']:.4f} dS {t['ds']:+.7f} "
            f"({t['margin']:.1e} ulp from a midpoint); rounding it the other way moves the sum "
            f"by {t['flip']:.2e}")
    for val, how in sorted(outs.items()):
        tag = []
        if impl is not None and val == float(impl):
            tag.append("= impl")
        if low is not None and val == float(low):
            tag.append("= lowp")
        masks = ",".join(f"{m:0{max(1, len(cand))}b}" for m, _ in how[:4])
        out(f"      reachable {val:+.6f} (err {abs(val - r0):.3e}) via tie flips {masks}; "
            f"unrounded {how[0][1]:+.6f} {' '.join(tag)}")
    if impl is not None and float(impl) not in outs:
        out(f"      impl {float(impl):+.6f} (err {abs(float(impl) - r0):.3e}) NOT reachable by ties "
            f"(reading: arithmetic the yardstick does not model, or a bug)")
    return outs


# ------------------------------------------------------------------ the test's steps

def draw_inputs(seed, forward):
    """The test's draws in the test's order. ``forward(host, cu, sm_scale)`` -> (o, lse) as
    float64 host arrays (the kernel's, or a stand-in). Returns a dict of everything."""
    import test_varlen_gpu as T
    from cupy_piecewise import tolerance
    from cupy_piecewise.gpu_arrays import round_to

    rng = np.random.default_rng(seed)
    host, cu = T._packed_host(LQ, LK, H, HKV, D, DTYPE, rng)
    sm_scale = 1.0 / np.sqrt(D)
    fwd_ref, fwd_low = T._reference(host, cu, W, CAUSAL, sm_scale, DTYPE)
    o_k, lse_k, extra = forward(host, cu, sm_scale)
    o_used = round_to(o_k.astype(np.float32), DTYPE)
    do_h = round_to(rng.standard_normal(o_used.shape).astype(np.float32), DTYPE)
    dlse_h = rng.standard_normal(lse_k.shape).astype(np.float32)
    grads_ref, grads_low = T._reference(host, cu, W, CAUSAL, sm_scale, DTYPE, do_h, o_used,
                                        lse_k, dlse_h)
    scale = 1.0
    if DTYPE == "float16" and sum(LQ):
        scale = tolerance.float16_loss_scale([g[None] for g in grads_ref], do_h[None])
        do_h, dlse_h = do_h * np.float32(scale), dlse_h * np.float32(scale)
        grads_ref, grads_low = T._reference(host, cu, W, CAUSAL, sm_scale, DTYPE, do_h, o_used,
                                            lse_k, dlse_h)
    return dict(host=host, cu=cu, sm_scale=sm_scale, fwd_ref=fwd_ref, fwd_low=fwd_low,
                o_k=o_k, lse_k=lse_k, o_used=o_used, do=do_h, dlse=dlse_h, loss_scale=scale,
                grads_ref=grads_ref, grads_low=grads_low, **extra)


def _fwd_verdicts(case):
    from cupy_piecewise import tolerance

    (o_ref, lse_ref), (o_low, lse_low) = case["fwd_ref"], case["fwd_low"]
    for name, got, ref, low in (("o", case["o_k"], o_ref, o_low),
                                ("lse", case["lse_k"], lse_ref, lse_low)):
        print("  forward", tolerance.compare(name, got, ref, low, DTYPE))


def analyse(case, grads, top=3, out=print):
    """impl vs the yardstick, and the dS-tie outcomes of the worst dk1 (and dk2) elements."""
    impl_vs_lowp(grads, case["grads_low"], case["grads_ref"], out=out)
    for name, n in (("dk1", top), ("dk2", 1)):
        gi = NAMES.index(name)
        got = np.asarray(grads[gi], np.float64)
        ref = np.asarray(case["grads_ref"][gi], np.float64)
        low = np.asarray(case["grads_low"][gi], np.float64)
        err = np.abs(got - ref)
        for flat in np.argsort(err, axis=None)[::-1][:n]:
            r, hk, c = np.unravel_index(int(flat), err.shape)
            tie_outcomes(case, name, int(r), int(hk), int(c), impl=got[r, hk, c],
                         low=low[r, hk, c], ref=ref[r, hk, c], out=out)


def cpu_main(seed, standin="B"):
    """No GPU: the same inputs; the kernel's o / lse replaced by the yardstick forward's (B,
    which reproduces the test's dk1 bound to 3 digits: the kernel's forward rounds P to
    float16 as the yardstick does) or the float64 forward's rounded (A)."""
    from cupy_piecewise import tolerance
    from cupy_piecewise.gpu_arrays import round_to

    def stand_in(host, cu, sm_scale):
        import test_varlen_gpu as T
        (o_ref, lse_ref), (o_low, lse_low) = T._reference(host, cu, W, CAUSAL, sm_scale, DTYPE)
        if standin == "A":
            o = round_to(o_ref.astype(np.float32), DTYPE).astype(np.float64)
            return o, lse_ref.astype(np.float32).astype(np.float64), {}
        return o_low.astype(np.float64), lse_low.astype(np.float64), {}

    case = draw_inputs(seed, stand_in)
    print(f"seed {seed}, lengths {LQ} / {LK}, H {H} Hkv {HKV} D {D} {DTYPE} causal {CAUSAL} "
          f"w {W}; loss scale {case['loss_scale']}; forward stand-in {standin}")
    _fwd_verdicts(case)
    report(case["grads_low"], case["grads_ref"], case["grads_low"], case["cu"], LQ, LK, W,
           CAUSAL, DTYPE, label="CPU: yardstick reported as impl (must pass, err/bound ~0.5)")
    print("\n--- dS ties of the largest |dk1| element (row 204 = seq 1 key 76, kv head 0, col 27)")
    outs = tie_outcomes(case, "dk1", 204, 0, 27, low=case["grads_low"][1][204, 0, 27],
                        ref=case["grads_ref"][1][204, 0, 27])
    # a kernel that differs from the yardstick only in those near-tie dS roundings
    for val in sorted(outs):
        sim = [np.array(g, np.float64) for g in case["grads_low"]]
        sim[1][204, 0, 27] = val
        print(f"  yardstick with dk1[204, 0, 27] = {val:+.6f}: "
              f"{tolerance.compare('dk1', sim[1], case['grads_ref'][1], case['grads_low'][1], DTYPE)}")


def gpu_main(seed, variants):
    os.environ.setdefault("CUPY_PIECEWISE_PATH", "mma")  # the kernel_path fixture's "mma"
    import cupy

    import cupy_piecewise
    from cupy_piecewise import capability, launch, tolerance, varlen_gpu
    from cupy_piecewise.gpu_arrays import _np_dtype, poisoned_outputs, to_host

    os.environ["CUPY_PIECEWISE_PATH"] = "mma"
    os.environ.pop(capability.ENV_VAR, None)
    capability.refresh_env_override()
    dev_ = cupy.cuda.Device()
    print(f"device {cupy.cuda.runtime.getDeviceProperties(dev_.id)['name'].decode()} "
          f"cc {launch._compute_capability(dev_.id)}; PATH=mma")
    state = {}

    def kernel_forward(host, cu, sm_scale):
        dev = [cupy.asarray(x.astype(_np_dtype(DTYPE))) for x in host]
        cu_d = [cupy.asarray(c) for c in cu]
        kw = dict(max_seqlen_q=max(LQ), max_seqlen_k=max(LK))
        with poisoned_outputs():
            o, lse = cupy_piecewise.attention_varlen(*dev, *cu_d, W, causal=CAUSAL,
                                                     sm_scale=float(sm_scale), return_lse=True,
                                                     **kw)
        state.update(dev=dev, cu_d=cu_d, kw=kw, o=o, lse=lse)
        return to_host(o), cupy.asnumpy(lse).astype(np.float64), {}

    case = draw_inputs(seed, kernel_forward)
    print(f"seed {seed}, lengths {LQ} / {LK}, H {H} Hkv {HKV} D {D} {DTYPE} causal {CAUSAL} "
          f"w {W}; loss scale {case['loss_scale']}")
    _fwd_verdicts(case)
    do_d = cupy.asarray(case["do"].astype(_np_dtype(DTYPE)))
    dlse_d = cupy.asarray(case["dlse"])
    dev, cu_d, kw = state["dev"], state["cu_d"], state["kw"]

    def backward(deterministic):
        with poisoned_outputs():
            g = cupy_piecewise.attention_varlen_backward(
                do_d, *dev, state["o"], state["lse"], *cu_d, W, causal=CAUSAL,
                sm_scale=float(case["sm_scale"]), dlse=dlse_d, deterministic=deterministic,
                **kw)
        cupy.cuda.get_current_stream().synchronize()
        return g

    def which_kernels(deterministic):
        """The plan this call takes: the table's tiles (launch.plan) and the launch steps."""
        try:
            from cupy_piecewise.adapters import cupy as ad
            pk = varlen_gpu.prepare(ad.OPS, *dev, *cu_d, W, kw["max_seqlen_q"],
                                    kw["max_seqlen_k"], CAUSAL, float(case["sm_scale"]))
            pr = pk.problem
            if launch.use_hopper_backward(pr):
                desc = "Hopper backward"
            elif launch.use_fused_backward(pr, deterministic, varlen=True):
                desc = f"fused one-kernel bwd_fused {launch.plan(pr, 'bwd_fused', varlen=True).tiles}"
            else:
                desc = (f"two-kernel: delta + bwd_dq {launch.plan(pr, 'bwd_dq', varlen=True).tiles}"
                        f" + bwd_dkv {launch.plan(pr, 'bwd_dkv', varlen=True).tiles}")
            hits = [v for k, v in varlen_gpu._launch_memo._data.items()
                    if k[0] == "bwd" and k[3] == deterministic
                    and k[4] == capability.plan_switches()]
            if hits:
                steps = getattr(hits[-1], "_steps", ())
                desc += "; steps (grid, threads, smem): " + ", ".join(
                    f"({st[1]},{st[2]},{st[3]}) {st[4]} {st[5]}" for st in steps)
                desc += f"; workspace {getattr(hits[-1], 'workspace_bytes', 0)}"
            return desc
        except Exception as exc:  # diagnostics only
            return f"? ({exc!r})"

    runs = [("default (deterministic=False, as the test)", None, False)]
    if variants:
        runs += [("default-again", None, False),
                 ("deterministic=True", None, True),
                 ("fused one-kernel (bwd_fused=64x64x4 forced)", "bwd_fused=64x64x4", False),
                 ("fused one-kernel (bwd_fused=32x64x2 forced)", "bwd_fused=32x64x2", False),
                 ("two-kernel, bwd_dkv=16x64x4", "bwd_dkv=16x64x4", True),
                 ("two-kernel, bwd_dkv=128x64x4", "bwd_dkv=128x64x4", True),
                 ("two-kernel, bwd_dkv=64x32x2", "bwd_dkv=64x32x2", True)]
    first = None
    summary = []
    for i, (label, override, det) in enumerate(runs):
        if i and time.time() - T0 > 40:
            print(f"--- {label}: skipped (time)")
            continue
        if override:
            os.environ[capability.ENV_VAR] = override
        else:
            os.environ.pop(capability.ENV_VAR, None)
        capability.refresh_env_override()
        t = time.time()
        try:
            g = backward(det)
        except Exception as exc:
            print(f"--- {label}: raised {type(exc).__name__}: {exc}")
            continue
        host_g = [to_host(x) for x in g]
        print(f"\n[{time.time() - t:.1f} s] plan: {which_kernels(det)}")
        report(host_g, case["grads_ref"], case["grads_low"], case["cu"], LQ, LK, W, CAUSAL,
               DTYPE, label=label, top=10 if i in (0, 2, 3) else 5)
        try:
            analyse(case, host_g, top=3 if i in (0, 2, 3) else 1)
        except Exception as exc:  # diagnostics only
            print(f"  analyse failed: {exc!r}")
        v = {n: tolerance.compare(n, g_, r_, l_, DTYPE) for n, g_, r_, l_ in
             zip(NAMES, host_g, case["grads_ref"], case["grads_low"])}
        el = host_g[1][WATCH]
        reach = tie_outcomes(case, "dk1", *WATCH, out=lambda *a: None)
        summary.append((label, which_kernels(det), v, el, float(el) in reach,
                        None if first is None else all(
                            np.array_equal(a, b, equal_nan=True) for a, b in zip(first, host_g))))
        if first is None:
            first = host_g
        else:
            same = [bool(np.array_equal(a, b, equal_nan=True)) for a, b in zip(first, host_g)]
            dmax = [float(np.nanmax(np.abs(a - b))) if a.size else 0.0
                    for a, b in zip(first, host_g)]
            print("  vs default: bitwise equal " + ", ".join(f"{n}={s}" for n, s in zip(NAMES, same))
                  + "; max|diff| " + ", ".join(f"{n}={d:.2e}" for n, d in zip(NAMES, dmax)))
    os.environ.pop(capability.ENV_VAR, None)
    capability.refresh_env_override()
    for a, b in zip(dev, [cupy.asarray(x.astype(_np_dtype(DTYPE))) for x in case["host"]]):
        assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all()), "an input was written"
    # Save the arrays for offline work (small: well under 1 MB).
    out = os.environ.get("OUT")
    if out and first is not None:
        np.savez_compressed(os.path.join(out, "varlen_diag_case.npz"),
                            o=case["o_k"], lse=case["lse_k"], do=case["do"], dlse=case["dlse"],
                            **{f"impl_{n}": g for n, g in zip(NAMES, first)})
    print("\n===== summary (dk1[row 204 = seq 1 key 76, kv head 0, col 27]: the largest |dk1|; "
          f"ref {case['grads_ref'][1][WATCH]:+.6f}, lowp {case['grads_low'][1][WATCH]:+.6f}; "
          "CPU prediction (stand-in B) if its one dS tie rounds down: -7.910156, err 5.710e-03)")
    for label, plan, v, el, reach, same in summary:
        print(f"  {label}\n    plan: {plan}\n    dk1[204,0,27] impl {el:+.6f} "
              f"(reachable by dS ties: {reach}); bitwise equal to default: {same}")
        print("    " + "; ".join(f"{n} {'PASS' if x.passed else 'FAIL'} {x.max_err:.2e}/{x.bound:.2e} "
                                  f"rel {x.rel_err:.2e}" for n, x in v.items()))
    print(f"\ntotal {time.time() - T0:.1f} s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--cpu", action="store_true", help="no GPU: stand-in forward, yardstick as impl")
    ap.add_argument("--no-variants", action="store_true")
    ap.add_argument("--standin", choices="AB", default="B",
                    help="--cpu: o / lse from the yardstick forward (B) or the float64 one (A)")
    a = ap.parse_args()
    # the test's seed path: tests/seeds.fresh_seed reads PW_TEST_SEED
    os.environ.setdefault("PW_TEST_SEED", str(a.seed if a.seed is not None else SEED))
    from seeds import fresh_seed

    seed = fresh_seed()
    if a.cpu:
        cpu_main(seed, a.standin)
    else:
        gpu_main(seed, not a.no_variants)
