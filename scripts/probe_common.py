"""What the GPU probe scripts share (hopper_probe.py, hopper_bwd_probe.py; mma_fwd_probe.py
takes its timer and source stamp): kernel source splicing, an NVRTC cubin build through
cuda.bindings, finding the CUDA tools, CUDA-event timing, the sources a run came from, and
running a phase in a worker process with a deadline and hang detection.

Imported by the probes as ``probe_common`` (scripts/ is on sys.path when they run).
"""
from __future__ import annotations

import os
import queue
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL_DIR = ROOT / "kernels_cu"


def splice(name: str) -> str:
    """kernels_cu/<name> with our own #include "..." lines inlined (the package's splicer,
    so the probes compile exactly what the package compiles)."""
    sys.path.insert(0, str(ROOT))
    from cupy_piecewise.compile import source

    return source(name)


def source_stamp() -> str:
    """The sources a probe ran (bench/provenance.py): commit, "+modified" where tracked files
    differ from it, and the kernels' digest."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    from provenance import source_stamp as stamp

    return stamp(ROOT)


def say(*args):
    print(*args, flush=True)


def find_tool(name):
    """Path of a CUDA tool (cuobjdump, nvdisasm): PATH, $CUDA_HOME/bin, or the pip wheels
    nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm; None when absent."""
    for cand in (shutil.which(name),
                 os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", name)):
        if cand and os.path.exists(cand):
            return cand
    try:
        import nvidia

        for base in nvidia.__path__:
            for p in Path(base).rglob(name):
                return str(p)
    except Exception:
        pass
    return None


def nvrtc_cubin(source_name, names, options):
    """Compile kernels_cu/<source_name> with cuda.bindings' NVRTC; -> (cubin bytes,
    {name: lowered}, log). (CuPy's nvrtc.getCUBIN drops the last byte: this one does not.)"""
    from cuda.bindings import nvrtc as N

    err, prog = N.nvrtcCreateProgram(splice(source_name).encode(),
                                     os.path.basename(source_name).encode(), 0, [], [])
    for n in names:
        N.nvrtcAddNameExpression(prog, n.encode())
    opts = [o.encode() for o in options]
    (rc,) = N.nvrtcCompileProgram(prog, len(opts), opts)
    err, size = N.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    N.nvrtcGetProgramLog(prog, log)
    log = log.decode(errors="replace").rstrip("\x00")
    if int(rc) != 0:
        raise RuntimeError(f"NVRTC failed: {rc}\n{log}")
    lowered = {}
    for n in names:
        err, low = N.nvrtcGetLoweredName(prog, n.encode())
        lowered[n] = low.decode() if isinstance(low, bytes) else low
    err, size = N.nvrtcGetCUBINSize(prog)
    cubin = b" " * size
    N.nvrtcGetCUBIN(prog, cubin)
    N.nvrtcDestroyProgram(prog)
    return cubin, lowered, log


def w_fracs(text):
    """'0.25,1' -> [0.25, 1.0]: thresholds as fractions of L (mma_fwd_probe.py, mma_bwd_ab.py
    --w-fracs)."""
    out = [float(x) for x in text.split(",") if x.strip()]
    if not out or any(not 0.0 <= f for f in out):
        raise ValueError(f"--w-fracs wants non-negative fractions of L, got {text!r}")
    return out


def w_of(L, frac):
    """The threshold w for length L at fraction frac, rounded down (0.25: the bench's L // 4,
    as profile_case.py --w-frac)."""
    return int(L * frac)


def cuda_time(torch, fn, warmup=3, reps=20):
    """Median of ``reps`` CUDA-event timings (ms) of ``fn()`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def run_worker(script, phase, extra, deadline_s, idle_s, log):
    """Run ``script --worker phase *extra`` in a fresh process; -> (returncode, or 'hang'
    when it printed nothing for ``idle_s`` seconds, or 'deadline' past ``deadline_s``;
    its output lines, each also passed to ``log``)."""
    cmd = [sys.executable, os.path.abspath(script), "--worker", phase] + extra
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         cwd=str(ROOT))
    q: queue.Queue = queue.Queue()

    def pump():
        for line in p.stdout:
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    t0 = last = time.time()
    lines, status = [], None
    while True:
        try:
            line = q.get(timeout=1.0)
        except queue.Empty:
            now = time.time()
            if now - last > idle_s:
                status = "hang"
            elif now - t0 > deadline_s:
                status = "deadline"
            if status:
                p.kill()
                p.wait()
                break
            continue
        if line is None:
            status = p.wait()
            break
        last = time.time()
        lines.append(line.rstrip("\n"))
        log(line.rstrip("\n"))
        if time.time() - t0 > deadline_s:
            p.kill()
            p.wait()
            status = "deadline"
            break
    return status, lines
