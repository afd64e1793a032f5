"""Regenerates tables.md from this folder's files: the float16 rescale-headroom and fused-vote
A/Bs (call 1, scripts/mma_bwd_ab.py, one process, backward only) and piecewise_mma against
the peers (bench.py, results.json), set beside the same command's run on the previous
default (../2026-12-04-h200-fixed-p-lazy-rescale/results.json, before the dS prescale and the
headroom; a different run, so its flash column shows the drift between the two)."""
import json
import statistics


def ab(path):
    t = {}
    for r in json.load(open(path)):
        t[(r["L"], r["D"], r["dtype"], int(r["causal"]), r["mode"], r["build"])] = statistics.median(r["ms"])
    return t


for path, title in (("call1_ab_det_headroom.json", "deterministic backward, PW_FIT_HEADROOM"),
                    ("call1_ab_default_fused.json", "default backward, PW_BWD_FUSED_VOTE")):
    t = ab(path)
    builds = sorted({k[5] for k in t} - {"default"})
    print(f"## {title} (call 1): backward ms, median of 3 rounds; x = default time / build time\n")
    print("| L | D | dtype | causal | default ms | " + " | ".join(f"{b} ms | x" for b in builds)
          + " | fp16/bf16 default | " + " | ".join(f"fp16/bf16 {b}" for b in builds) + " |")
    print("|" + "---|" * (5 + 3 * len(builds) + 1))
    for k in sorted(t):
        L, D, dt, c, mode, b = k
        if b != "default":
            continue
        cells = [f"{t[k[:5] + (bb,)]:.3f} | {t[k] / t[k[:5] + (bb,)]:.3f}" for bb in builds]
        gap = ""
        if dt == "fp16":
            bf = lambda bb: t[(L, D, "bf16", c, mode, bb)]
            gap = " | ".join(f"{t[k[:5] + (bb,)] / bf(bb):.3f}" for bb in ["default"] + builds)
        else:
            gap = " | ".join("" for _ in ["default"] + builds)
        print(f"| {L} | {D} | {dt} | {c} | {t[k]:.3f} | " + " | ".join(cells) + f" | {gap} |")
    print()


def main_rows(path):
    res = json.load(open(path))["main"]
    return {(r["dtype"], r["D"], r["causal"], r["L"], r["provider"], r["phase"]): r for r in res}


t = main_rows("results.json")
prev = main_rows("../2026-12-04-h200-fixed-p-lazy-rescale/results.json")
print("## piecewise_mma against the peers, same run (bench.py, results.json): time of peer / time of ours\n")
print("| dtype | D | causal | L | mma fwd | mma f+b | fwd x flash | fwd x cuDNN | fwd x flex | "
      "f+b x flash | f+b x cuDNN | f+b x flex | previous default: mma f+b (flash f+b) |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for (dt, D, c, L, p, ph), r in sorted(t.items()):
    if p != "piecewise_mma" or ph != "fwd":
        continue
    fb = t[(dt, D, c, L, p, "fwd_bwd")]

    def ratio(peer, phase):
        o, q = t.get((dt, D, c, L, p, phase)), t.get((dt, D, c, L, peer, phase))
        return f"{q['ms'] / o['ms']:.2f}" if o and q and o.get("ms") and q.get("ms") else "-"

    pm, pf = prev.get((dt, D, c, L, p, "fwd_bwd")), prev.get((dt, D, c, L, "sdpa_flash", "fwd_bwd"))
    was = f"{pm['tflops']:.1f} ({pf['tflops']:.1f})" if pm and pf else "-"
    print(f"| {dt} | {D} | {'yes' if c else 'no'} | {L} | {r['tflops']:.1f} | {fb['tflops']:.1f} | "
          + " | ".join(ratio(pp, ph2) for ph2 in ("fwd", "fwd_bwd")
                       for pp in ("sdpa_flash", "sdpa_cudnn", "flex_composite"))
          + f" | {was} |")
