"""plr.py FILE.plr: live-register profile of nvdisasm -plr output: max live count, and where
it is >= the threshold (instruction opcodes summarised)."""
import re, sys, collections
thr = int(sys.argv[2]) if len(sys.argv) > 2 else 250
rows = []
for l in open(sys.argv[1]):
    m = re.match(r'\s+/\*([0-9a-f]{4,})\*/\s+(.*?);.*//\s*\|\s*(\d+)', l)
    if m: rows.append((int(m.group(1), 16), m.group(2).strip(), int(m.group(3))))
print("instructions", len(rows), "max live", max(r[2] for r in rows))
hist = collections.Counter(r[2] // 5 * 5 for r in rows)
print("live histogram (>=230):", sorted((k, v) for k, v in hist.items() if k >= 230))
run = []
for a, t, n in rows:
    if n >= thr: run.append((a, t, n))
# group consecutive
groups = []; prev = None
for a, t, n in run:
    if prev is not None and a - prev <= 0x40: groups[-1].append((a, t, n))
    else: groups.append([(a, t, n)])
    prev = a
for g in groups[:40]:
    ops = collections.Counter(re.sub(r'^@!?U?P\w+ ', '', t).split()[0].split('.')[0] for _, t, _ in g)
    print(f"{g[0][0]:#x}-{g[-1][0]:#x} n={len(g)} max={max(x[2] for x in g)} " + " ".join(f"{k}:{v}" for k, v in ops.most_common(6)))
