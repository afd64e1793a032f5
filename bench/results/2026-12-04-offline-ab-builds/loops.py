"""loops.py FILE.sass: the four longest loops (a backward branch to an earlier address) that hold
HMMA instructions, with their static instruction counts and most common opcodes."""
import re, sys, collections
lines = open(sys.argv[1]).read().splitlines()
ins = []
for l in lines:
    m = re.match(r'\s+/\*([0-9a-f]{4,})\*/\s+(.*?);', l)
    if m: ins.append((int(m.group(1), 16), m.group(2)))
addr_idx = {a: i for i, (a, _) in enumerate(ins)}
loops = []
for i, (a, t) in enumerate(ins):
    m = re.search(r'BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))', t)
    m2 = re.search(r'BRA .*?0x([0-9a-f]+)', t)
    tgt = None
    if m2: tgt = int(m2.group(1), 16)
    if tgt is not None and tgt < a and tgt in addr_idx:
        j = addr_idx[tgt]
        body = ins[j:i + 1]
        h = sum('HMMA' in x for _, x in body)
        if h: loops.append((len(body), h, j, i, body))
loops.sort(key=lambda x: -x[0])
for n, h, j, i, body in loops[:4]:
    c = collections.Counter(re.sub(r'^@!?U?P\w+ ', '', x).split()[0].split('.')[0] for _, x in body)
    print(f"loop {ins[j][0]:#x}-{ins[i][0]:#x}: {n} instr, HMMA {h}; " + " ".join(f"{k}:{v}" for k, v in c.most_common(14)))
