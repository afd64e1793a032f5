"""Regenerates tables.md: the forced mma.sync path (piecewise_mma) against SDPA flash and the
original Triton design (flag_attn, FlagAttention's piecewise.py with its A100 tile table), from
two runs of the same bench command on one H200: triton_default/ (call 1: Triton compiles the
design's tl.dot to wgmma on sm_90) and triton_mma_sync/ (call 3: DISABLE_MMA_V3=1, so Triton
emits mma.sync as on an A100). Ratios: time of the peer / time of piecewise_mma in the same
run (> 1: piecewise_mma faster)."""
import json


def rows(path):
    return {(r["dtype"], r["D"], r["causal"], r["L"], r["provider"], r["phase"]): r
            for r in json.load(open(path))["main"]}


a, b = rows("triton_default/results.json"), rows("triton_mma_sync/results.json")


def tf(t, k, p, ph):
    r = t.get(k + (p, ph))
    return f"{r['tflops']:.1f}" if r and r["status"] == "ok" else ("err" if r else "")


def ratio(t, k, p, ph):
    r = t.get(k + ("piecewise_mma", ph)) or {}
    v = r.get(f"ratio_vs_{p}")
    return f"{v:.2f}" if v else "-"


print("## flag_attn (Triton design, A100 table) and SDPA flash against piecewise_mma, TFLOP/s\n")
print("| dtype | D | causal | L | phase | mma (1) | flash (1) | flag wgmma (1) | mma (3) | flash (3) "
      "| flag mma.sync (3) | mma/flash (1) | mma/flash (3) | mma/flag wgmma (1) | mma/flag mma.sync (3) |")
print("|" + "---|" * 15)
keys = sorted({k[:4] for k in b}, key=lambda k: (k[0], k[1], k[2], k[3]))
for k in keys:
    for ph in ("fwd", "fwd_bwd"):
        print(f"| {k[0]} | {k[1]} | {'yes' if k[2] else 'no'} | {k[3]} | {ph} | "
              + " | ".join([tf(a, k, "piecewise_mma", ph), tf(a, k, "sdpa_flash", ph), tf(a, k, "flag_attn", ph),
                            tf(b, k, "piecewise_mma", ph), tf(b, k, "sdpa_flash", ph), tf(b, k, "flag_attn", ph),
                            ratio(a, k, "sdpa_flash", ph), ratio(b, k, "sdpa_flash", ph),
                            ratio(a, k, "flag_attn", ph), ratio(b, k, "flag_attn", ph)]) + " |")


def span(t, ph, p, pick=lambda k: True):
    v = [r[f"ratio_vs_{p}"] for k, r in t.items()
         if k[4] == "piecewise_mma" and k[5] == ph and pick(k) and r.get(f"ratio_vs_{p}")]
    return f"{min(v):.2f}-{max(v):.2f} ({len(v)} rows)" if v else "none"


print("\n## Ranges of piecewise_mma / peer (time of peer / time of ours)\n")
for ph in ("fwd", "fwd_bwd"):
    print(f"- {ph}: vs flash {span(a, ph, 'sdpa_flash')} in run 1, {span(b, ph, 'sdpa_flash')} in run 3; "
          f"vs flag mma.sync {span(b, ph, 'flag_attn')}; vs flag wgmma D64 "
          f"{span(a, ph, 'flag_attn', lambda k: k[1] == 64)}, D128 {span(a, ph, 'flag_attn', lambda k: k[1] == 128)}")
