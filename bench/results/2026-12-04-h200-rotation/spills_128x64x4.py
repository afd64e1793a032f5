"""spills.py ROOT [-D...]: ptxas spill line of the 128x64x4 D=128 forward (bf16), dense/varlen x causal."""
import sys, re
from concurrent.futures import ProcessPoolExecutor
root = sys.argv[1]; defs = sys.argv[2:]
sys.path.insert(0, root)
def one(args):
    causal, varlen = args
    from cuda.bindings import nvrtc
    from cupy_piecewise import compile as C, capability
    v = C.Variant("fwd", "bfloat16", 128, capability.TileConfig(128, 64, 4, 2), causal, varlen)
    err, prog = nvrtc.nvrtcCreateProgram(C.source(v.filename).encode(), v.filename.encode(), 0, [], [])
    nvrtc.nvrtcAddNameExpression(prog, v.name_expression.encode())
    opts = [o.encode() for o in ["-std=c++17", "-arch=sm_90", "-Xptxas=-v"] + defs]
    nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    err, n = nvrtc.nvrtcGetProgramLogSize(prog); log = b" " * n; nvrtc.nvrtcGetProgramLog(prog, log)
    log = log.decode()
    sp = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)[-1]
    rg = re.findall(r"Used (\d+) registers", log)[-1]
    errs = [l for l in log.splitlines() if "error" in l]
    return f"causal={int(causal)} varlen={int(varlen)}: {rg} regs, spill st/ld {sp[0]}/{sp[1]} {errs[:2]}"
with ProcessPoolExecutor(2) as ex:
    for r in ex.map(one, [(c, v) for v in (False, True) for c in (False, True)]): print(r)
