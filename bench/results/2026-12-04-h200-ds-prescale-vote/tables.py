"""Regenerates tables.md from this folder's call-4 A/B (call4_bwd_ab_prescale0.json): the
prescaled dS (default) against PW_BWD_DS_PRESCALE=0, and float16 against bfloat16 in both."""
import json
import statistics

recs = json.load(open("call4_bwd_ab_prescale0.json"))
med = {(r["L"], r["D"], r["dtype"], r["causal"], r["build"]): statistics.median(r["ms"]) for r in recs}
print("## Deterministic backward ms (median of 3 rounds, one process), H200, mma.sync path\n")
print("| L | D | causal | fp16 default | fp16 PRESCALE=0 | old / default | bf16 default | bf16 PRESCALE=0 "
      "| bf16 old / default (noise) | fp16/bf16 default | fp16/bf16 PRESCALE=0 |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for L, D, dt, c, b in sorted(k for k in med if k[2] == "fp16" and k[4] == "default"):
    f, fo = med[(L, D, "fp16", c, "default")], med[(L, D, "fp16", c, "PW_BWD_DS_PRESCALE=0")]
    h, ho = med[(L, D, "bf16", c, "default")], med[(L, D, "bf16", c, "PW_BWD_DS_PRESCALE=0")]
    print(f"| {L} | {D} | {int(c)} | {f:.3f} | {fo:.3f} | {fo / f:.3f} | {h:.3f} | {ho:.3f} | "
          f"{ho / h:.3f} | {f / h:.3f} | {fo / ho:.3f} |")
