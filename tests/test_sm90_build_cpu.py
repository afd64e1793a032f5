"""CPU build check of the Hopper forward (kernels_cu/sm90/forward.cu).

Compiles every instantiation (bf16/fp16 x D 64/128 x causal) for sm_90a with NVRTC, no GPU
needed, and checks ptxas's report (no spills, no local-memory stack, no wgmma serialisation
warning) and that the PTX holds the Hopper instructions the design relies on. Also checks the
argument validation of cupy_piecewise/tma.py, which needs no driver.
"""
from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import sm90_build  # noqa: E402

ELEM = {"bfloat16": "pw90::bf16", "float16": "pw90::f16"}
NAMES = [f"pw90_forward<{ELEM[t]}, {d}, {'true' if c else 'false'}>"
         for t in ("bfloat16", "float16") for d in (64, 128) for c in (False, True)]


#: compile-time variants of the consumer loop (kernels_cu/sm90/forward.cu), A/B-tested on a GPU
#: by scripts/hopper_probe.py --variants; each must build without spills or serialised wgmma
# The default build: D = 64 runs three consumer warpgroups (BM = 192, 512 threads, 160
# registers) with the serial loop (PW90_FWD_SERIAL64, each tile's P·V waited for in its tile);
# D = 128 two (BM = 128) with the pipelined loop. PW90_BM64=128 is the D = 64 build before
# that (two consumer warpgroups, pipelined loop), kept for A/B runs; the variants that need two
# consumer warpgroups at D = 64 (ping-pong, 192-key tiles at 240 registers) carry it.
# PW90_OVERLAP is on by default (the pipelined loop); =0 waits for P·V before the softmax.
# PW90_PERSIST is on by default too (dense batches); =0 gives one CTA per work tile, which
# ping-pong needs. PW90_BN128=96 PW90_KSLOTS128=4: the D = 128 tile and memory of the layout
# the rings replaced. PW90_BN64=192 PW90_CONSUMER_REGS=240: 192-key tiles at D = 64, which fit
# only in FlashAttention-3's 240/24 register split (at 232/40 they spill and serialise).
# PW90_KSLOTS64=2: the K-ring depth at D = 64 of the layout the rings replaced.
# PW90_PAIRS64=1 PW90_PAIRS128=0: the causal persistent walk over pairs of query tiles at D = 64
# and one CTA per query tile at D = 128 (the defaults the other way round).
# PW90_BN64=96 PW90_FWD_SERIAL64=0: three consumer warpgroups in the pipelined loop, which
# spill with 128-key tiles and fit with 96. PW90_FWD_SERIAL=1: the serial loop at every head
# dim (with BM 128 or 192 at D = 64).
VARIANTS = ["PW90_BM64=128", "PW90_FWD_SERIAL=1", "PW90_BM64=128 PW90_FWD_SERIAL=1",
            "PW90_OVERLAP=0 PW90_PERSIST=0", "PW90_PERSIST=0",
            "PW90_PINGPONG=1 PW90_OVERLAP=0 PW90_PERSIST=0 PW90_BM64=128",
            "PW90_PINGPONG=1 PW90_OVERLAP=1 PW90_PERSIST=0 PW90_BM64=128", "PW90_OVERLAP=0",
            "PW90_BN128=96 PW90_KSLOTS128=4", "PW90_CONSUMER_REGS=240",
            "PW90_BN64=192 PW90_CONSUMER_REGS=240 PW90_BM64=128", "PW90_KSLOTS64=2",
            "PW90_PAIRS64=1 PW90_PAIRS128=0", "PW90_BN64=96 PW90_FWD_SERIAL64=0"]


def _compile(defines=()):
    return sm90_build.build("sm90/forward.cu", NAMES, defines)


@pytest.fixture(scope="module")
def build():
    return _compile()


@pytest.fixture(scope="module", params=VARIANTS)
def variant_build(request):
    return request.param, _compile(request.param.split())


def test_variants_no_spills_no_serialisation(variant_build):
    spec, (log, ptx, lowered, blocks) = variant_build
    for name in NAMES:
        text = blocks.get(lowered[name])
        assert text is not None, f"{spec}: no ptxas report for {name}"
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
        assert m and m.groups() == ("0", "0", "0"), f"{spec} {name}: stack/spills\n{text}"
    bad = [ln for ln in log.splitlines() if "serialized" in ln or "C7508" in ln]
    assert not bad, f"{spec}:\n" + "\n".join(bad)
    # the variant really took its path
    if "PW90_PINGPONG=1" in spec:
        assert re.search(r"bar\.arrive", ptx) and re.search(r"bar\.sync\s+%r", ptx), spec
    if "PW90_BM64=128" not in spec:  # the D = 64 kernels: 4 warpgroups, consumers raised to 160
        assert ".maxntid 512" in ptx and "setmaxnreg.inc.sync.aligned.u32 160;" in ptx, spec
    else:
        assert ".maxntid 512" not in ptx, spec
    if "PW90_OVERLAP=0" not in spec and "PW90_FWD_SERIAL=1" not in spec:  # on by default (D = 128)
        assert "wgmma.wait_group.sync.aligned 1;" in ptx, spec
    else:
        assert "wgmma.wait_group.sync.aligned 1;" not in ptx, spec


@pytest.mark.parametrize("name", NAMES)
def test_no_spills(build, name):
    _, _, lowered, blocks = build
    text = blocks.get(lowered[name])
    assert text is not None, f"no ptxas report for {name}"
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    assert m, text
    assert m.groups() == ("0", "0", "0"), f"{name}: stack/spills {m.groups()}\n{text}"
    assert re.search(r"Used \d+ registers", text), text


def test_no_wgmma_serialisation(build):
    log = build[0]
    # C7510-C7520: "wgmma.mma_async instructions are serialized due to ..."
    bad = [ln for ln in log.splitlines() if "serialized" in ln or "C7508" in ln]
    assert not bad, "\n".join(bad)


def test_ptx_uses_hopper_instructions(build):
    ptx = build[1]
    assert ".target sm_90a" in ptx
    for needle in ("wgmma.mma_async.sync.aligned.m64n", "wgmma.fence.sync.aligned",
                   "cp.async.bulk.tensor.4d", "mbarrier.try_wait.parity", "setmaxnreg.inc",
                   "setmaxnreg.dec", ".tensormap"):
        assert needle in ptx, needle
    # P·V reads V MN-major (imm-trans-b = 1) with P from registers
    assert re.search(r"wgmma\.mma_async[^;]*\{%r\d+, ?%r\d+, ?%r\d+, ?%r\d+\}, %rd\d+, p, 1, 1, 1;", ptx)
    # D = 64: three consumer warpgroups at 160 registers (512 threads); D = 128: two at 232
    # (384 threads) with the pipelined loop (wait_group 1: S_t done, P_{t-1}·V still running)
    for needle in (".maxntid 512", ".maxntid 384", "setmaxnreg.inc.sync.aligned.u32 160;",
                   "setmaxnreg.inc.sync.aligned.u32 232;", "wgmma.wait_group.sync.aligned 1;"):
        assert needle in ptx, needle


def test_tma_argument_checks():
    from cupy_piecewise import tma

    shape = (2, 4, 1000, 128)
    with pytest.raises(ValueError, match="unit-stride"):
        tma.tensor_map_bhld(0x10000, shape, (1, 1, 128, 4), "bfloat16", 128)
    with pytest.raises(ValueError, match="row stride"):
        tma.tensor_map_bhld(0x10000, shape, (512000, 128000, 100, 1), "bfloat16", 128)
    with pytest.raises(ValueError, match="address"):
        tma.tensor_map_bhld(0x10008, shape, (512000, 128000, 128, 1), "bfloat16", 128)
    with pytest.raises(ValueError, match="box"):
        tma.tensor_map_bhld(0x10000, shape, (512000, 128000, 128, 1), "bfloat16", 128, box_cols=128)
    with pytest.raises(ValueError, match="dtype"):
        tma.tensor_map_bhld(0x10000, shape, (512000, 128000, 128, 1), "float32", 128)
    with pytest.raises(ValueError, match="extent"):
        tma.tensor_map_bhld(0x10000, (2, 4, 0, 128), (0, 0, 128, 1), "bfloat16", 128)
    t = tma.TensorMap(bytes(range(128)))
    assert t.address() % 64 == 0
    assert t.as_numpy().tobytes() == bytes(range(128))
