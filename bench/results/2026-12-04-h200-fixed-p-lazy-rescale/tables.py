"""Regenerates tables.md from this folder's logs: the float16 P-scale A/B and the
bf16/fp16 backward gap (call 2), and piecewise_mma's ratios from results.json."""
import json
import re


def rows(path):
    out = {}
    for line in open(path):
        c = [x.strip() for x in line.strip().strip("|").split("|")]
        if len(c) == 9 and c[0].isdigit():
            out[(int(c[0]), int(c[1]), c[2], int(c[3]), c[4])] = (float(c[5].split()[0]), float(c[8]))
    return out


new, old = rows("call2_bwd_default_bf16_fp16.txt"), rows("call2_bwd_rowscale_fp16.txt")
print("## float16 P scale, same call (call 2): f+b TFLOP/s, fixed 2^14 (default) / per-row (PW_BWD_P_FIXED=0)\n")
print("| L | D | causal | run | fixed | per-row | fixed / per-row | flash (fixed run / per-row run) |")
print("|---|---|---|---|---|---|---|---|")
for k in sorted(old):
    L, D, dt, c, run = k
    if run == "sdpa_flash" or k not in new:
        continue
    f = new[(L, D, dt, c, "sdpa_flash")][0], old[(L, D, dt, c, "sdpa_flash")][0]
    print(f"| {L} | {D} | {c} | {run} | {new[k][0]} | {old[k][0]} | {new[k][0] / old[k][0]:.3f} | {f[0]} / {f[1]} |")
print("\n## float16 against bfloat16, same call (call 2): backward-only ms (f+b - fwd), default builds\n")
print("| L | D | causal | run | bf16 bwd ms | fp16 bwd ms | fp16 / bf16 |")
print("|---|---|---|---|---|---|---|")
for k in sorted(new):
    L, D, dt, c, run = k
    if dt != "bf16" or run == "sdpa_flash":
        continue
    h = new[(L, D, "fp16", c, run)][1]
    print(f"| {L} | {D} | {c} | {run} | {new[k][1]:.3f} | {h:.3f} | {h / new[k][1]:.3f} |")

res = json.load(open("results.json"))["main"]
t = {(r["dtype"], r["D"], r["causal"], r["L"], r["provider"], r["phase"]): r for r in res}
print("\n## piecewise_mma against the peers, same run (bench.py, results.json): time of peer / time of ours\n")
print("| dtype | D | causal | L | mma fwd | mma f+b | fwd x flash | fwd x cuDNN | fwd x flex | f+b x flash | f+b x cuDNN | f+b x flex |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for (dt, D, c, L, p, ph), r in sorted(t.items()):
    if p != "piecewise_mma" or ph != "fwd":
        continue
    fb = t.get((dt, D, c, L, p, "fwd_bwd"))
    def ratio(peer, phase):
        o, q = t.get((dt, D, c, L, p, phase)), t.get((dt, D, c, L, peer, phase))
        return f"{q['ms'] / o['ms']:.2f}" if o and q and o.get("ms") and q.get("ms") else "-"
    print(f"| {dt} | {D} | {'yes' if c else 'no'} | {L} | {r['tflops']:.1f} | "
          f"{fb['tflops']:.1f} | " + " | ".join(ratio(pp, ph2) for ph2 in ("fwd", "fwd_bwd")
                                               for pp in ("sdpa_flash", "sdpa_cudnn", "flex_composite")) + " |")
