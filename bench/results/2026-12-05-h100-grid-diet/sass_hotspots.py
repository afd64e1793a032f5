#!/usr/bin/env python3
"""Where a kernel's time goes, from Nsight Compute's per-instruction SASS export.

    python3 sass_hotspots.py ncu_grid128_sass.csv [--listing out.txt]

Input: `ncu -i REPORT --page source --csv --print-source sass` of a report taken with
--section SourceCounters (scripts/gpu_run.sh ncu_grid). Prints the warp-stall reasons over all
samples, then per opcode (first word, predicate stripped) its share of the samples and of the
executed instructions with its three main stall reasons, then the instructions with the most
excess shared-memory wavefronts and excess L2 sectors. --listing writes one line per SASS
instruction: index, times executed (warp-level), stall samples, text; loop bodies show up as
runs of equal execution counts.
"""
import argparse
import collections
import csv
import re


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--listing", default=None)
    a = ap.parse_args()
    rows = list(csv.reader(open(a.csv)))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr, data = rows[start], rows[start + 1:]
    ix = {h: i for i, h in enumerate(hdr)}

    def num(r, k):
        try:
            return float(r[ix[k]].replace(",", ""))
        except (ValueError, KeyError):
            return 0.0

    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    tot = collections.Counter()
    for r in data:
        for s in stalls:
            tot[s] += num(r, s)
    samples = sum(tot.values()) or 1
    print(f"stall samples: {samples:.0f}")
    for s, v in tot.most_common():
        if v:
            print(f"  {s:25s} {100 * v / samples:5.1f}%")
    by_op, execs, op_stall = collections.Counter(), collections.Counter(), {}
    for r in data:
        m = re.match(r"(@!?U?P\w+\s+)?([A-Z0-9_]+)", r[ix["Source"]].strip())
        op = m.group(2) if m else "?"
        by_op[op] += num(r, "Warp Stall Sampling (All Samples)")
        execs[op] += num(r, "Instructions Executed")
        c = op_stall.setdefault(op, collections.Counter())
        for s in stalls:
            c[s] += num(r, s)
    total_exec = sum(execs.values()) or 1
    op_samples = sum(by_op.values()) or 1
    print(f"executed instructions (warp-level): {total_exec:.0f}")
    for op, v in by_op.most_common(25):
        top = ", ".join(f"{k[6:]} {100 * c / v:.0f}%" for k, c in op_stall[op].most_common(3) if c)
        print(f"  {op:10s} samples {100 * v / op_samples:5.1f}%  executed "
              f"{100 * execs[op] / total_exec:5.1f}%  ({top})")
    for key in ("L1 Wavefronts Shared Excessive", "L2 Theoretical Sectors Global Excessive"):
        print(f"{key}: {sum(num(r, key) for r in data):.0f}")
        worst = sorted(data, key=lambda r: -num(r, key))[:6]
        for r in worst:
            print(f"  {num(r, key):12.0f}  {r[ix['Source']].strip()}")
    if a.listing:
        with open(a.listing, "w") as f:
            for i, r in enumerate(data):
                f.write(f"{i:5d} {int(num(r, 'Instructions Executed')):10d} "
                        f"{int(num(r, 'Warp Stall Sampling (All Samples)')):7d}  "
                        f"{r[ix['Source']].strip()}\n")


if __name__ == "__main__":
    main()
