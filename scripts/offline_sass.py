"""SASS of one kernel variant without a GPU: NVRTC to PTX, ptxas to a cubin, cuobjdump -sass.

For reading what a kernel change does to the instruction stream before spending device time
(bench/NOTES.md: at D = 64 the mma.sync backward's time follows its instruction count). It
prints ptxas's registers and spills, the instruction count of the whole kernel and, for the
largest loops (a backward branch and its target), their static instruction counts by opcode.
Static counts weigh both sides of every branch alike (masked and unmasked tiles, the score
product's two pairs); ncu's source counters (scripts/gpu_run.sh ncu_grid) give the executed
ones.

    python scripts/offline_sass.py --phase bwd_grid --head-dim 64 --tiles 64x64x4
    python scripts/offline_sass.py --phase bwd_grid --head-dim 64 --tiles 64x64x4 \\
        -D PW_GRID_GROUP1=0 --compare            # the macro's build against the default's
    python scripts/offline_sass.py --phase fwd --head-dim 128 --tiles 128x64x4 --dump f.sass

Why not NVRTC's own cubin: cuobjdump 13.5 reads the cubin of ptxas but reported NVRTC
13.5's as holding no device code (2026-12-06). The PTX is NVRTC's, so the kernel source is
the package's exactly (cupy_piecewise.compile.source, with the macros given); ptxas comes
from PATH or $CUDA_HOME/bin (the toolkit here is 13.0: the PTX's version line is lowered to
what that ptxas reads, which is safe while the kernels use no newer PTX feature; ptxas
refuses the file otherwise). The GPU machine compiles with its own NVRTC, so register counts
can differ from this build by a few; cupy_piecewise.build_check is the spill gate CI runs.

Exit status 2 when a tool (ptxas, cuobjdump, nvdisasm) is missing, 1 on a compile error.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from cupy_piecewise import capability  # noqa: E402
from cupy_piecewise.compile import Variant, source  # noqa: E402
from probe_common import find_tool  # noqa: E402

_ADDR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
_PTX_VERSION = re.compile(rb"^\.version (\d+)\.(\d+)", re.M)


def ptxas_version(ptxas: str) -> tuple[int, int]:
    """The highest PTX ISA version ``ptxas`` reads, from its CUDA release (13.x reads 9.x)."""
    out = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise RuntimeError(f"cannot read the CUDA release of {ptxas}: {out!r}")
    major, minor = int(m.group(1)), int(m.group(2))
    return major - 4, minor  # CUDA 12.x -> PTX 8.x, 13.x -> 9.x


def build_ptx(variant: Variant, arch: str, macros: list[str]) -> tuple[bytes, str]:
    """NVRTC's PTX of ``variant`` for ``arch`` (sm_80 .. sm_90a) and its lowered name."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source(variant.filename), variant.filename, [], [])
    try:
        nvrtc.addNameExpression(prog, variant.name_expression)
        opts = ["-std=c++17", f"-arch=compute_{arch[3:]}"] + [f"-D{m}" for m in macros]
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(nvrtc.getProgramLog(prog)) from e
        ptx = nvrtc.getPTX(prog)
        name = nvrtc.getLoweredName(prog, variant.name_expression)
    finally:
        nvrtc.destroyProgram(prog)
    return (ptx if isinstance(ptx, bytes) else ptx.encode()), name


def assemble(ptx: bytes, arch: str, ptxas: str, workdir: Path) -> tuple[Path, str]:
    """ptxas -v of ``ptx``; the PTX version line is lowered to what this ptxas reads."""
    have = ptxas_version(ptxas)
    m = _PTX_VERSION.search(ptx)
    if m and (int(m.group(1)), int(m.group(2))) > have:
        ptx = _PTX_VERSION.sub(f".version {have[0]}.{have[1]}".encode(), ptx, count=1)
    src, cubin = workdir / "k.ptx", workdir / "k.cubin"
    src.write_bytes(ptx)
    r = subprocess.run([ptxas, f"-arch={arch}", "-v", "-o", str(cubin), str(src)],
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"ptxas failed:\n{r.stderr}")
    return cubin, r.stderr


def disassemble(cubin: Path, cuobjdump: str, nvdisasm: str) -> list[tuple[int, str]]:
    """(address, instruction) of every SASS instruction in ``cubin`` (cuobjdump -sass runs
    nvdisasm, found through NVDISASM_PATH: the pip wheels install them in the same folder,
    but neither is on PATH)."""
    env = dict(os.environ, NVDISASM_PATH=str(Path(nvdisasm).parent))
    out = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True,
                         env=env)
    if out.returncode:
        raise RuntimeError(f"cuobjdump failed:\n{out.stderr}")
    return [(int(m.group(1), 16), m.group(2)) for m in map(_ADDR.match, out.stdout.splitlines())
            if m]


def opcode(instr: str) -> str:
    """The opcode with its modifiers, the predicate guard dropped."""
    return re.sub(r"^@!?U?P[T\d]+\s+", "", instr).split()[0]


def loops(instrs: list[tuple[int, str]], most: int) -> list[tuple[int, int, collections.Counter]]:
    """The ``most`` largest address ranges closed by a backward branch: (first, last, counts)."""
    found = {}
    for addr, text in instrs:
        m = _BRANCH.search(text)
        if m and int(m.group(1), 16) < addr:
            lo = int(m.group(1), 16)
            found[(lo, addr)] = addr - lo
    out = []
    for lo, hi in sorted(found, key=found.get, reverse=True)[:most]:
        out.append((lo, hi, collections.Counter(opcode(t) for a, t in instrs if lo <= a <= hi)))
    return out


def report(label: str, log: str, instrs, most: int, width: int) -> dict:
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    print(f"== {label}: {regs.group(1) if regs else '?'} registers, "
          f"spills {spill.group(1) + '/' + spill.group(2) if spill else '?'} (store/load bytes), "
          f"{len(instrs)} instructions")
    summary = {"registers": int(regs.group(1)) if regs else None, "total": len(instrs), "loops": []}
    for lo, hi, counts in loops(instrs, most):
        n = sum(counts.values())
        print(f"  loop {lo:#07x}-{hi:#07x}: {n} instructions; "
              + ", ".join(f"{k} {c}" for k, c in counts.most_common(width)))
        summary["loops"].append(n)
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase", required=True, help="a Variant phase: fwd, bwd_grid, bwd_dkv, ...")
    ap.add_argument("--dtype", default="bfloat16", choices=("float16", "bfloat16", "float32"))
    ap.add_argument("--head-dim", type=int, required=True)
    ap.add_argument("--tiles", help="BMxBNxWARPS[xSTAGES] (not for the row kernels)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--varlen", action="store_true")
    ap.add_argument("--arch", default="sm_90", help="sm_80, sm_86, sm_89, sm_90 or sm_90a")
    ap.add_argument("-D", dest="macros", action="append", default=[], metavar="NAME=VALUE",
                    help="kernel macro for this build (repeatable)")
    ap.add_argument("--compare", action="store_true",
                    help="also build without the -D macros and print both")
    ap.add_argument("--loops", type=int, default=3, help="how many loops to list")
    ap.add_argument("--width", type=int, default=24, help="opcodes listed per loop")
    ap.add_argument("--dump", type=Path, help="write the SASS of the -D build here")
    args = ap.parse_args(argv)
    try:
        tiles = capability.parse_tiles(args.tiles, "--tiles") if args.tiles else None
    except ValueError as e:
        ap.error(str(e))
    try:
        variant = Variant(args.phase, args.dtype, args.head_dim, tiles, args.causal, args.varlen)
        variant.name_expression  # noqa: B018  (raises ValueError for a phase/flag mismatch)
    except (KeyError, ValueError, AttributeError) as e:
        ap.error(f"no such variant: {e!r}")

    tools = {name: find_tool(name) for name in ("ptxas", "cuobjdump", "nvdisasm")}
    missing = [n for n, p in tools.items() if not p]
    if missing:
        print(f"offline_sass: not found: {', '.join(missing)} (PATH, $CUDA_HOME/bin or the "
              "nvidia-cuda-* wheels)", file=sys.stderr)
        return 2
    builds = [("with " + " ".join(args.macros) if args.macros else "default", args.macros)]
    if args.compare and args.macros:
        builds.insert(0, ("default", []))
    with tempfile.TemporaryDirectory() as tmp:
        for label, macros in builds:
            try:
                ptx, _ = build_ptx(variant, args.arch, macros)
                cubin, log = assemble(ptx, args.arch, tools["ptxas"], Path(tmp))
                instrs = disassemble(cubin, tools["cuobjdump"], tools["nvdisasm"])
            except RuntimeError as e:
                print(f"offline_sass: {label}: {e}", file=sys.stderr)
                return 1
            report(f"{variant.name_expression} {args.arch} {label}", log, instrs, args.loops,
                   args.width)
            if args.dump and macros is args.macros:
                args.dump.write_text("\n".join(f"/*{a:04x}*/ {t};" for a, t in instrs) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
