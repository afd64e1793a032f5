"""hmma_chains.py SASS LO HI: for the HMMA instructions at addresses [LO, HI) (hex) of a
cuobjdump -sass listing (e.g. from ../2026-12-04-offline-ab-builds/sass_any.py), how far back
each one's accumulator (its last operand) was written by an earlier HMMA of the same range, in
instructions and in HMMAs, as histograms; and the lengths of runs of back-to-back HMMAs.
bench/NOTES.md, twenty-sixth section, quotes it for the D = 128 forward (loop 0x33e0-0x8210 of
fwd bfloat16 128x32x4 non-causal)."""
import re, sys
lines = open(sys.argv[1]).read().splitlines()
lo, hi = int(sys.argv[2], 16), int(sys.argv[3], 16)
ins = []
for l in lines:
    m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", l)
    if m and lo <= int(m.group(1), 16) < hi:
        ins.append((int(m.group(1), 16), m.group(2)))
last = {}
gaps = []; hgaps = []
hcount = 0
seq = []
for i, (a, t) in enumerate(ins):
    if "HMMA" in t:
        ops = [o.strip() for o in t.split(None, 1)[1].split(",")]
        d, c = ops[0], ops[-1]
        if c in last:
            gaps.append(i - last[c][0]); hgaps.append(hcount - last[c][1])
        last[d] = (i, hcount)
        hcount += 1
        seq.append((i, d, c))
import collections
print("HMMA", hcount, "dependent pairs", len(gaps))
print("instr gap hist", sorted(collections.Counter(gaps).items())[:30])
print("hmma gap hist", sorted(collections.Counter(hgaps).items())[:30])
# runs of consecutive HMMAs
runs = []; run = 0; prev = None
for i, d, c in seq:
    if prev is not None and i == prev + 1: run += 1
    else:
        if run: runs.append(run)
        run = 1
    prev = i
runs.append(run)
print("consecutive-HMMA run lengths", sorted(collections.Counter(runs).items()))
