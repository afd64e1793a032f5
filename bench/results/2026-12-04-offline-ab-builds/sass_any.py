"""sass_any.py ROOT PHASE DTYPE D BM BN WARPS CAUSAL OUT [-D...]: one mma.sync variant compiled by
NVRTC for sm_90 (ptxas -v line printed), its cubin and cuobjdump SASS written to OUT.cubin / OUT.sass.
cuobjdump: pip package nvidia-cuda-cuobjdump (CUOBJDUMP overrides the path)."""
import sys, subprocess, os, shutil
root, phase, dt, D, bm, bn, wp, causal, out = sys.argv[1:10]
defs = [a for a in sys.argv[10:] if a.startswith("-D")]
sys.path.insert(0, root)
from cuda.bindings import nvrtc
from cupy_piecewise import compile as C, capability
v = C.Variant(phase, dt, int(D), capability.TileConfig(int(bm), int(bn), int(wp), 2), causal == "1")
err, prog = nvrtc.nvrtcCreateProgram(C.source(v.filename).encode(), v.filename.encode(), 0, [], [])
nvrtc.nvrtcAddNameExpression(prog, v.name_expression.encode())
opts = [o.encode() for o in ["-std=c++17", "-arch=sm_90", "-Xptxas=-v"] + defs]
r = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
err, n = nvrtc.nvrtcGetProgramLogSize(prog); log = b" " * n; nvrtc.nvrtcGetProgramLog(prog, log)
print([l for l in log.decode().splitlines() if "registers" in l or "spill" in l][-2:])
err, n = nvrtc.nvrtcGetCUBINSize(prog); cub = b" " * n; nvrtc.nvrtcGetCUBIN(prog, cub)
open(out + ".cubin", "wb").write(cub)
tool = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump") or os.path.join(
    os.path.dirname(nvrtc.__file__), "..", "..", "nvidia", "cu13", "bin", "cuobjdump")
sass = subprocess.run([tool, "-sass", out + ".cubin"], capture_output=True, text=True, check=True).stdout
open(out + ".sass", "w").write(sass)
