"""One NVRTC build of a Hopper (sm_90a) kernel file for the CPU build tests: the package's
own splicer (cupy_piecewise.compile.source), ptxas's verbose report split per entry."""
from __future__ import annotations

import re

import pytest

from cupy_piecewise.compile import source

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")


def require_nvrtc():
    """CuPy's NVRTC bindings, loaded and answering, or ``pytest.skip`` with the reason (the
    one place the CPU build tests decide that NVRTC is missing; CI installs it)."""
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # ImportError, or the library itself missing
        pytest.skip(f"NVRTC cannot be loaded ({type(exc).__name__}: {exc})")
    return nvrtc


def build(filename, names, defines=(), extra_source=""):
    """-> (log, ptx, {name: lowered}, {lowered: ptxas report}) for kernels_cu/<filename>
    (+ ``extra_source``) built for sm_90a with ``-D`` ``defines``. Skips without NVRTC;
    fails the test with NVRTC's log on a compile error."""
    nvrtc = require_nvrtc()
    prog = nvrtc.createProgram(source(filename) + extra_source, filename.split("/")[-1], [], [])
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        try:
            nvrtc.compileProgram(prog, ["-std=c++17", "-arch=sm_90a", "-Xptxas=-v"]
                                 + [f"-D{d}" for d in defines])
        except nvrtc.NVRTCError:
            pytest.fail("NVRTC failed:\n" + nvrtc.getProgramLog(prog))
        log = nvrtc.getProgramLog(prog)
        ptx = nvrtc.getPTX(prog)
        ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
        lowered = {n: nvrtc.getLoweredName(prog, n) for n in names}
    finally:
        nvrtc.destroyProgram(prog)
    blocks, cur = {}, None
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            cur = m.group(1)
            blocks[cur] = ""
        elif cur is not None:
            blocks[cur] += line + "\n"
    return log, ptx, lowered, blocks
