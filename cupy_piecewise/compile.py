"""Kernel sources, instantiation names and the compile cache: the one place kernels are built.

Kernels are CUDA C++ templates in ``kernels_cu/`` compiled at run time by NVRTC through
``cupy.RawModule``. NVRTC has no include path of ours and CuPy's disk cache hashes only the
source string and options, so :func:`source` splices every ``#include "..."`` of ours into
the text: editing a header changes the hash and forces a rebuild.

The same sources compile without a GPU (:func:`compile_offline`), which the build check
(``python -m cupy_piecewise build``) uses to compile every variant the capability table can
select for every listed architecture and to read ptxas's register and spill report.
"""
from __future__ import annotations

import functools
import os
import re
import threading
from dataclasses import dataclass

from .capability import VARLEN_PHASES, TileConfig, hopper_compute_dim, hopper_fwd_threads
from .kernel_sources import kernel_dir

#: kernel file per phase; the delta pre-pass lives with the backward kernels.
SOURCE_FILE = {"fwd": "forward.cu", "fwd_decode": "forward.cu", "fwd_combine": "forward.cu",
               "bwd_dq": "backward.cu", "bwd_dkv": "backward.cu", "bwd_delta": "backward.cu",
               "bwd_fused": "backward.cu", "bwd_grid": "backward.cu",
               "bwd_dq_convert": "backward.cu",
               "fwd_sm90": "sm90/forward.cu", "bwd_sm90": "sm90/backward.cu",
               "bwd_sm90_det": "sm90/backward.cu", "bwd_sm90_prep": "sm90/backward.cu",
               "bwd_sm90_dq": "sm90/backward.cu", "kvcache": "kvcache.cu",
               "kvdecode": "kvcache.cu", "kv_append": "kvcache.cu",
               "kvdecode_sm90": "sm90/kvdecode.cu"}
_TEMPLATE = {"fwd": "pw_forward", "fwd_decode": "pw_forward", "fwd_combine": "pw_forward_combine",
             "bwd_dq": "pw_backward_dq", "bwd_dkv": "pw_backward_dkv",
             "bwd_fused": "pw_backward_dkv", "bwd_grid": "pw_backward_grid",
             "bwd_delta": "pw_backward_delta", "bwd_dq_convert": "pw_backward_dq_convert",
             "fwd_sm90": "pw90_forward",
             "bwd_sm90": "pw90_bwd", "bwd_sm90_det": "pw90_bwd", "bwd_sm90_prep": "pw90_bwd_prep",
             "bwd_sm90_dq": "pw90_bwd_dq_convert", "kvcache": "pw_kvcache",
             "kvdecode": "pw_kvcache", "kv_append": "pw_kvcache_append",
             "kvdecode_sm90": "pw90_kvdecode"}
#: helper kernels without tiles, 256 threads: a warp per row (bwd_delta, fwd_combine,
#: bwd_dq_convert: the fused backward's float32 dQ sums to dq1, dq2), a thread per 16-byte
#: chunk (kv_append: the KV-cache append)
ROW_KERNELS = ("bwd_delta", "fwd_combine", "kv_append", "bwd_dq_convert")
#: rotary-inside KV-cache kernels (pw_kvcache's ROT): rotary layout name -> template value
ROTARY_LAYOUTS = {"half": 1, "interleaved": 2}
#: kernels with their tiles fixed inside (wgmma + TMA; kernels_cu/sm90/): sm_90a only.
#: bwd_sm90 computes all five gradients (dQ by float32 atomics), bwd_sm90_det only dK1, dK2,
#: dV (deterministic mode: dQ from the mma.sync dq kernel); bwd_sm90_prep (delta, lse in
#: base 2, zeroed dQ accumulator) runs before and bwd_sm90_dq (accumulator -> dQ) after.
#: kvdecode_sm90 is the KV-cache decode (M = 1) with TMA loads (kernels_cu/sm90/kvdecode.cu).
HOPPER_KERNELS = ("fwd_sm90", "bwd_sm90", "bwd_sm90_det", "bwd_sm90_prep", "bwd_sm90_dq",
                  "kvdecode_sm90")
#: Hopper kernels with a packed variable-length variant (template flag VARLEN)
HOPPER_VARLEN_PHASES = HOPPER_KERNELS[:5]
#: Hopper kernels with a warp per row (no causal flag, 256 threads)
HOPPER_ROW_KERNELS = ("bwd_sm90_prep", "bwd_sm90_dq")
#: Hopper kernels without a causal flag: the row kernels, and the decode (one new token
#: attends every cached key either way)
HOPPER_UNCAUSAL = HOPPER_ROW_KERNELS + ("kvdecode_sm90",)
#: threads of a Hopper backward block: a producer warpgroup and two consumer warpgroups
#: (the forward's depend on the head dim: capability.hopper_fwd_threads)
HOPPER_THREADS = 384
#: element tags of common.cuh: float32 inputs run the mma.sync kernels in TF32
_ELEM = {"float16": "half_t", "bfloat16": "bf16_t", "float32": "tf32_t"}
#: the Hopper kernels' own element tags (kernels_cu/sm90/hopper.cuh)
_ELEM90 = {"float16": "pw90::f16", "bfloat16": "pw90::bf16"}
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)

BASE_OPTIONS = ("-std=c++17",)
#: space-separated NAME=VALUE kernel macros for an A/B run (tests/conftest.py,
#: scripts/sanitize_cases.py: :func:`apply_test_macros`)
TEST_MACROS_ENV = "PW_TEST_MACROS"


def apply_test_macros() -> tuple[str, ...]:
    """Builds every kernel this process compiles with the -D options named in
    ``PW_TEST_MACROS`` (space-separated ``NAME=VALUE``) and sets their host mirrors
    (:func:`cupy_piecewise.capability.apply_kernel_macros`, which also makes
    ``capability.MACRO_TABLE``'s staged tiles selectable, if any), so an A/B build of kernels_cu/
    can run the GPU suite and the sanitizers before it becomes the default. Returns the -D
    options added (empty when the variable is unset). For test runs; the package never calls
    it. Raises ValueError for a mirrored macro whose value is not an integer."""
    global BASE_OPTIONS
    from . import capability

    macros = tuple(m for m in os.environ.get(TEST_MACROS_ENV, "").split() if m)
    capability.apply_kernel_macros(macros)
    options = tuple(f"-D{m}" for m in macros if f"-D{m}" not in BASE_OPTIONS)
    BASE_OPTIONS = BASE_OPTIONS + options
    return tuple(f"-D{m}" for m in macros)


@functools.lru_cache(maxsize=None)
def source(filename: str) -> str:
    """Text of ``kernels_cu/<filename>`` with our own ``#include "..."`` lines spliced in."""
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:  # every header is #pragma once
            return ""
        seen.add(name)
        text = (kernel_dir() / name).read_text()
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(filename)


@dataclass(frozen=True)
class Variant:
    """One template instantiation: everything that is a compile-time constant."""

    # 'fwd' | 'fwd_decode' | 'bwd_dq' | 'bwd_dkv' | 'bwd_fused' (pw_backward_dkv with FUSED:
    # dQ by float32 atomics too) | 'kvcache' | 'kvdecode', or a row kernel (ROW_KERNELS)
    phase: str
    dtype: str  # 'float16' | 'bfloat16' | 'float32' (mma.sync phases and their row kernels)
    head_dim: int
    tiles: TileConfig | None  # None for the row kernels (kvdecode_sm90: capability.kv90_tiles)
    causal: bool = False
    varlen: bool = False  # packed variable-length batch (VARLEN_PHASES, HOPPER_VARLEN_PHASES)
    cluster: int = 1  # kvdecode_sm90: key splits merged inside one thread-block cluster
    #: kvcache/kvdecode: rotary embedding inside the kernel (ROTARY_LAYOUTS: 1 halves,
    #: 2 interleaved pairs; 0 none)
    rotary: int = 0
    #: kvdecode_sm90's rotary forms: the producer warp stages the table rows (the kernel's
    #: TAB = true, asked for by name); False leaves TAB at its default, -DKV90_ROT_STAGE's
    rot_stage: bool = False
    #: kvdecode_sm90's plain D = 64 form for caches paged in multiples of 64 rows: the entry
    #: pw90_kvdecode_pages, whole 64-row tiles per TMA box (kvcache_launch.page_box)
    page_box: bool = False

    @property
    def filename(self) -> str:
        return SOURCE_FILE[self.phase]

    @property
    def name_expression(self) -> str:
        elem = _ELEM[self.dtype]
        if self.phase == "kvdecode_sm90":  # common.cuh's element tags; ring depth, warps
            t = self.tiles
            # the rotary forms are a kernel of their own (their register cap, kvdecode.cu)
            name, rot = ((_TEMPLATE[self.phase] + "_rot", f", {self.rotary}") if self.rotary
                         else (_TEMPLATE[self.phase], ""))
            if self.rot_stage:
                if not self.rotary:
                    raise ValueError("rot_stage: only the rotary forms stage table rows")
                rot += ", true"
            if self.page_box:
                if self.rotary or self.head_dim != 64:
                    raise ValueError("page_box: the plain D = 64 decode only")
                name += "_pages"
            return (f"{name}<{_ELEM[self.dtype]}, {self.head_dim}, {t.stages}, "
                    f"{self.cluster}, {t.num_warps}{rot}>")
        if self.phase in HOPPER_KERNELS:
            elem = _ELEM90[self.dtype]
            if self.phase in HOPPER_ROW_KERNELS:
                flags = ""
            else:
                flags = ", true" if self.causal else ", false"
            if self.phase in ("bwd_sm90", "bwd_sm90_det"):  # fused dQ or not
                flags += ", true" if self.phase == "bwd_sm90" else ", false"
            if self.varlen:
                if self.phase not in HOPPER_VARLEN_PHASES:
                    raise ValueError(f"phase {self.phase!r} has no packed-batch kernel")
            dim = hopper_compute_dim(self.head_dim)
            if self.varlen or dim != self.head_dim:
                flags += ", true" if self.varlen else ", false"
            if dim != self.head_dim:  # DV: the tensors' columns, zero-padded to dim
                flags += f", {self.head_dim}"
            return f"{_TEMPLATE[self.phase]}<{elem}, {dim}{flags}>"
        if self.phase in ROW_KERNELS:
            return f"{_TEMPLATE[self.phase]}<{elem}, {self.head_dim}>"
        t = self.tiles
        causal = "true" if self.causal else "false"
        stages = ""  # the KV-cache kernel: a deeper ring, and one key slot when decoding
        if self.phase in ("kvcache", "kvdecode"):
            stages = f", {t.stages}, {'true' if self.phase == 'kvdecode' else 'false'}"
            if self.rotary:
                stages += f", {self.rotary}"
        elif self.rotary:
            raise ValueError(f"phase {self.phase!r} has no rotary-inside kernel")
        if self.varlen:
            if self.phase not in VARLEN_PHASES:
                raise ValueError(f"phase {self.phase!r} has no packed-batch kernel")
            stages = ", true"
        if self.phase == "bwd_fused":  # pw_backward_dkv's FUSED flag follows VARLEN
            stages = f", {'true' if self.varlen else 'false'}, true"
        return (f"{_TEMPLATE[self.phase]}<{elem}, {self.head_dim}, {t.block_m}, {t.block_n}, "
                f"{t.num_warps}, {causal}{stages}>")

    @property
    def threads(self) -> int:
        if self.phase in ROW_KERNELS or self.phase in HOPPER_ROW_KERNELS:
            return 256
        if self.phase == "kvdecode_sm90":  # consumer warps and a producer warp
            return 32 * (self.tiles.num_warps + 1)
        if self.phase == "fwd_sm90":
            return hopper_fwd_threads(self.head_dim)
        if self.phase in HOPPER_KERNELS:
            return HOPPER_THREADS
        return 32 * self.tiles.num_warps

    @property
    def options(self) -> tuple[str, ...]:
        """NVRTC options beyond the architecture CuPy picks: wgmma and setmaxnreg need the
        architecture-specific sm_90a target (CuPy's own -arch=sm_90 does not clash with it:
        NVRTC emits .target sm_90a)."""
        return BASE_OPTIONS + (("-arch=sm_90a",) if self.phase in HOPPER_KERNELS else ())


def arch_options(cc: tuple[int, int], hopper: bool = False) -> tuple[str, ...]:
    return BASE_OPTIONS + (f"-arch=sm_{cc[0]}{cc[1]}{'a' if hopper else ''}",)


_lock = threading.Lock()
_functions: dict[tuple[int, Variant], object] = {}
_modules: dict[tuple[int, Variant], object] = {}


def get_function(device_id: int, variant: Variant):
    """The ``cupy.RawKernel`` for ``variant``, loaded on ``device_id`` (compiled once).

    One RawModule per (device, variant): a call compiles only what it launches. CuPy's own
    disk cache (keyed on the spliced source and options) makes later processes fast.
    """
    key = (device_id, variant)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    import cupy

    with _lock:
        fn = _functions.get(key)
        if fn is None:
            with cupy.cuda.Device(device_id):
                mod = cupy.RawModule(code=source(variant.filename), options=variant.options,
                                     name_expressions=[variant.name_expression])
                fn = mod.get_function(variant.name_expression)
            _modules[key] = mod  # keep the module (and its CUmodule) alive
            _functions[key] = fn
    return fn


@dataclass
class BuildReport:
    variant: Variant
    arch: str
    registers: int | None
    spill_stores: int | None
    spill_loads: int | None
    stack_bytes: int | None
    ok: bool
    log: str


_PTXAS_FN = re.compile(r"ptxas info\s*: Compiling entry function '([^']+)'")
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_offline(cc: tuple[int, int], variants: list[Variant]) -> list[BuildReport]:
    """Compile ``variants`` (all from one source file) for ``cc`` with NVRTC, no GPU needed.

    Returns one report per variant with ptxas's registers, stack and spill bytes.
    Raises RuntimeError with the compiler log on a compile error.
    """
    from cupy_backends.cuda.libs import nvrtc

    files = {v.filename for v in variants}
    if len(files) != 1:
        raise ValueError(f"variants must share one source file, got {sorted(files)}")
    (filename,) = files
    hopper = any(v.phase in HOPPER_KERNELS for v in variants)
    arch = f"sm_{cc[0]}{cc[1]}{'a' if hopper else ''}"
    prog = nvrtc.createProgram(source(filename), filename, [], [])
    try:
        for v in variants:
            nvrtc.addNameExpression(prog, v.name_expression)
        opts = list(arch_options(cc, hopper)) + ["-Xptxas=-v"]
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed for {filename} on {arch}:\n"
                               f"{nvrtc.getProgramLog(prog)}") from e
        log = nvrtc.getProgramLog(prog)
        lowered = {v: nvrtc.getLoweredName(prog, v.name_expression) for v in variants}
    finally:
        nvrtc.destroyProgram(prog)

    # ptxas prints a block per entry function: split the log on those headers.
    blocks: dict[str, str] = {}
    cur = None
    for line in log.splitlines():
        m = _PTXAS_FN.search(line)
        if m:
            cur = m.group(1)
            blocks[cur] = ""
        elif cur is not None:
            blocks[cur] += line + "\n"
    reports = []
    for v in variants:
        text = blocks.get(lowered[v], "")
        used = _PTXAS_USED.search(text)
        spill = _PTXAS_SPILL.search(text)
        reports.append(BuildReport(
            variant=v, arch=arch,
            registers=int(used.group(1)) if used else None,
            stack_bytes=int(spill.group(1)) if spill else None,
            spill_stores=int(spill.group(2)) if spill else None,
            spill_loads=int(spill.group(3)) if spill else None,
            ok=bool(used), log=text))
    return reports
