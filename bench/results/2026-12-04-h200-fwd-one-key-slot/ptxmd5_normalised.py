"""ptxmd5_normalised.py ROOT FILE [-D...]: as bench/results/2026-12-03-offline-score-mask-split/ptxmd5.py,
but the md5 of each entry ignores mangled names (_Z...) and branch-label numbers ($L__BB<n>_)."""
import hashlib, re, sys
root, fname = sys.argv[1], sys.argv[2]
defs = [a for a in sys.argv[3:] if a.startswith("-D")]
sys.path.insert(0, root)
from cuda.bindings import nvrtc
from cupy_piecewise import capability, compile as C
vs = []
for varlen in (False, True):
    for phase, d, dt, c, t in sorted(capability.selectable_configs((9, 0), varlen=varlen), key=str):
        v = C.Variant(phase, dt, d, t, c, varlen=varlen)
        if v.filename == fname:
            vs.append(v)
vs = list(dict.fromkeys(vs))
err, prog = nvrtc.nvrtcCreateProgram(C.source(fname).encode(), fname.encode(), 0, [], [])
for v in vs:
    nvrtc.nvrtcAddNameExpression(prog, v.name_expression.encode())
opts = [o.encode() for o in ["-std=c++17", "-arch=sm_90", "-Xptxas=-v"] + defs]
r = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
err, n = nvrtc.nvrtcGetProgramLogSize(prog); log = b" " * n; nvrtc.nvrtcGetProgramLog(prog, log); log = log.decode()
if r[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
    print(log[-3000:]); sys.exit(1)
err, n = nvrtc.nvrtcGetPTXSize(prog); ptx = b" " * n; nvrtc.nvrtcGetPTX(prog, ptx); ptx = ptx.decode()
low = {v: nvrtc.nvrtcGetLoweredName(prog, v.name_expression.encode())[1].decode() for v in vs}
# split ptx per entry
entries = {}
for m in re.finditer(r"\.(?:visible|weak) \.entry (\S+)\(", ptx):
    start = m.start(); end = ptx.find("\n}\n", start)
    entries[m.group(1)] = ptx[start:end]
blocks = {}; cur = None
for line in log.splitlines():
    mm = re.search(r"Compiling entry function '([^']+)'", line)
    if mm: cur = mm.group(1); blocks[cur] = ""
    elif cur: blocks[cur] += line + "\n"
for v in vs:
    ln = low[v]
    h = hashlib.md5(re.sub(r"\$L__BB\d+_", "L_", re.sub(r"_Z\w+", "", entries[ln])).encode()).hexdigest()[:10]
    regs = re.search(r"Used (\d+) registers", blocks.get(ln, "")); sp = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", blocks.get(ln, ""))
    print(f"{v.phase:10} {v.dtype:9} D{v.head_dim:<4} {str(v.tiles):12} c={int(v.causal)} vl={int(v.varlen)} {h} regs={regs.group(1) if regs else '?'} spill={sp.group(1) if sp else '?'}/{sp.group(2) if sp else '?'}")
