"""CPU build check of the Hopper backward prototype (kernels_cu/sm90/backward.cu).

Compiles every instantiation (bf16/fp16 x D 64/128 x causal x fused dQ or not, plus the prep
and dQ-convert kernels) for sm_90a with NVRTC, no GPU needed, and checks ptxas's report (no
spills, no wgmma serialisation) and that the PTX holds the Hopper instructions the design
relies on. The host-side mirrors in scripts/hopper_bwd_probe.py (shared-memory size, packed
parameter sizes) are checked against the C++ definitions by static_asserts compiled here.

Known gaps (xfail, not strict): at D = 128 the consumers' live set (dV and dK accumulators,
128 registers, plus the Sᵀ/dPᵀ chunks and, with fused dQ, a 32-register dQ tile) does not yet
fit ptxas's allocation: wgmma is serialised (C7512) and most of those builds spill.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "kernels_cu"
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)
ELEM = {"bfloat16": "pw90::bf16", "float16": "pw90::f16"}


def _main(t, d, c, q):
    return f"pw90_bwd<{ELEM[t]}, {d}, {'true' if c else 'false'}, {'true' if q else 'false'}>"


MAIN = [(t, d, c, q) for t in ELEM for d in (64, 128) for c in (False, True) for q in (True, False)]
HELPERS = ([f"pw90_bwd_prep<{ELEM[t]}, {d}>" for t in ELEM for d in (64, 128)]
           + [f"pw90_bwd_dq_convert<{ELEM[t]}, {d}>" for t in ELEM for d in (64, 128)])
NAMES = [_main(*k) for k in MAIN] + HELPERS


def _known_gap(t, d, c, q):
    """Instantiations that still spill or serialise wgmma (see the module docstring)."""
    return d == 128


def _splice(name, seen):
    if name in seen:
        return ""
    seen.add(name)
    return _INCLUDE.sub(lambda m: _splice(m.group(1), seen), (KERNELS / name).read_text())


def _probe():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import hopper_bwd_probe
    finally:
        sys.path.pop(0)
    return hopper_bwd_probe


@pytest.fixture(scope="module")
def build():
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
    except Exception as e:  # pragma: no cover - depends on the machine
        pytest.skip(f"NVRTC unavailable: {e!r}")
    probe = _probe()
    src = _splice("sm90/backward.cu", set())
    # the probe's host-side mirrors must match the C++ layout
    src += ("\nstatic_assert(pw90::bwd::Smem<64>::BYTES == %d, \"probe smem_bytes(64)\");"
            "\nstatic_assert(pw90::bwd::Smem<128>::BYTES == %d, \"probe smem_bytes(128)\");"
            "\nstatic_assert(sizeof(pw90::bwd::BwdParams) == %d, \"probe _BWD_PARAMS\");"
            "\nstatic_assert(sizeof(pw90::bwd::PrepParams) == %d, \"probe _PREP_PARAMS\");"
            "\nstatic_assert(sizeof(pw90::bwd::ConvertParams) == %d, \"probe _CONV_PARAMS\");\n"
            % (probe.smem_bytes(64), probe.smem_bytes(128), probe._BWD_PARAMS.size,
               probe._PREP_PARAMS.size, probe._CONV_PARAMS.size))
    prog = nvrtc.createProgram(src, "backward.cu", [], [])
    try:
        for n in NAMES:
            nvrtc.addNameExpression(prog, n)
        try:
            nvrtc.compileProgram(prog, ["-std=c++17", "-arch=sm_90a", "-Xptxas=-v"])
        except nvrtc.NVRTCError:
            pytest.fail("NVRTC failed:\n" + nvrtc.getProgramLog(prog))
        log = nvrtc.getProgramLog(prog)
        ptx = nvrtc.getPTX(prog)
        ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
        lowered = {n: nvrtc.getLoweredName(prog, n) for n in NAMES}
    finally:
        nvrtc.destroyProgram(prog)
    blocks, cur = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            cur = m.group(1)
            blocks[cur] = ""
        elif cur is not None:
            blocks[cur] += line + "\n"
    return log, ptx, lowered, blocks


def _check_clean(build, name):
    log, _, lowered, blocks = build
    text = blocks.get(lowered[name])
    assert text is not None, f"no ptxas report for {name}"
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    assert m and re.search(r"Used \d+ registers", text), text
    assert m.groups() == ("0", "0", "0"), f"{name}: stack/spills {m.groups()}\n{text}"
    serial = [ln for ln in log.splitlines()
              if ("serialized" in ln or "C751" in ln) and lowered[name] in ln]
    assert not serial, "\n".join(serial)


@pytest.mark.parametrize("key", MAIN, ids=[_main(*k) for k in MAIN])
def test_main_kernel_no_spills_no_serialisation(build, key, request):
    if _known_gap(*key):
        request.applymarker(pytest.mark.xfail(
            reason="D = 128: register pressure (spills / wgmma serialised), see module docstring",
            strict=False))
    _check_clean(build, _main(*key))


@pytest.mark.parametrize("name", HELPERS)
def test_helper_kernels_no_spills(build, name):
    _check_clean(build, name)


def test_ptx_uses_hopper_instructions(build):
    ptx = build[1]
    assert ".target sm_90a" in ptx
    for needle in ("wgmma.mma_async.sync.aligned.m64n", "wgmma.fence.sync.aligned",
                   "cp.async.bulk.tensor.4d", "cp.async.bulk.shared::cluster.global.mbarrier",
                   "mbarrier.try_wait.parity", "setmaxnreg.inc", "setmaxnreg.dec",
                   "red.global.add.v2.f32", "fence.proxy.async", ".tensormap"):
        assert needle in ptx, needle
    # dV += Pᵀ·dO and dK += dSᵀ·Q: A from registers, B MN-major (imm-trans-b = 1)
    assert re.search(r"wgmma\.mma_async[^;]*\{%r\d+, ?%r\d+, ?%r\d+, ?%r\d+\}, %rd\d+, p, 1, 1, 1;", ptx)
    # dQ = dS·K: both operands from shared memory, both MN-major (imm-trans-a = imm-trans-b = 1)
    assert re.search(r"wgmma\.mma_async[^;]*\}, %rd\d+, %rd\d+, p, 1, 1, 1, 1;", ptx)


def test_every_instantiation_has_a_report(build):
    _, _, lowered, blocks = build
    missing = [n for n in NAMES if lowered[n] not in blocks]
    assert not missing, missing
