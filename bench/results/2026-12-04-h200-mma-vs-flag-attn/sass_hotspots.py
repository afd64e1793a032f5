"""sass_hotspots.py NCU_SOURCE.csv: summarises ncu's per-SASS-line export (ncu -i REP --page source
--print-source sass --csv): samples and executed instructions by opcode, the hottest lines, and
the lines with excess shared wavefronts or global sectors."""
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
hdr = rows[1]; data = rows[2:]
ix = {h: i for i, h in enumerate(hdr)}
def num(r, k):
    try: return float(r[ix[k]].replace(",", ""))
    except: return 0.0
tot_s = sum(num(r, "Warp Stall Sampling (All Samples)") for r in data)
tot_i = sum(num(r, "Instructions Executed") for r in data)
print(f"lines {len(data)}, samples {tot_s:.0f}, warp instructions {tot_i:.3e}")
byop = collections.defaultdict(lambda: [0, 0, collections.Counter()])
stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
for r in data:
    op = r[ix["Source"]].split()[0] if r[ix["Source"]].split() else "?"
    if op.startswith("@"): op = r[ix["Source"]].split()[1]
    op = op.split(".")[0]
    b = byop[op]; b[0] += num(r, "Warp Stall Sampling (All Samples)"); b[1] += num(r, "Instructions Executed")
    for s in stalls: b[2][s] += num(r, s)
print("| opcode | samples % | executed % | top stalls |\n|---|---|---|---|")
for op, (s, i, c) in sorted(byop.items(), key=lambda kv: -kv[1][0])[:22]:
    top = ", ".join(f"{k[6:]} {v / max(s, 1) * 100:.0f}%" for k, v in c.most_common(3) if v)
    print(f"| {op} | {s / tot_s * 100:.1f} | {i / tot_i * 100:.1f} | {top} |")
print("\nhottest lines (samples): addr-offset, source, samples, executed, top stalls")
base = int(data[0][0], 16)
for r in sorted(data, key=lambda r: -num(r, "Warp Stall Sampling (All Samples)"))[:30]:
    c = sorted(((num(r, s), s[6:]) for s in stalls), reverse=True)[:2]
    print(f"{int(r[0], 16) - base:6x} {r[ix['Source']].strip()[:60]:60s} {num(r, 'Warp Stall Sampling (All Samples)'):7.0f} {num(r, 'Instructions Executed'):10.0f} {c}")
print("\nexcess: shared wavefronts, global sectors")
for k in ("L1 Wavefronts Shared Excessive", "L2 Theoretical Sectors Global Excessive"):
    for r in sorted(data, key=lambda r: -num(r, k))[:6]:
        if num(r, k): print(f"  {k[:22]} {int(r[0], 16) - base:6x} {r[ix['Source']].strip()[:70]:70s} {num(r, k):.3e} of {num(r, k.replace(' Excessive', '')):.3e}")
