"""The launch layer's host-side logic, without a GPU: parameter layout and split-KV planning."""
from __future__ import annotations

import math

import pytest

from cupy_piecewise import capability, launch
from cupy_piecewise.compile import source
from cupy_piecewise.validate import Problem


def _problem(M, N, B=1, H=32, D=128):
    return Problem("cupy", B, H, H, M, N, D, "bfloat16", N // 4, False, 0.1, 0)


def test_param_layout_matches_the_kernel_struct():
    """PARAM_FIELDS must mirror kernels_cu/params.cuh slot for slot: NVRTC checks the size."""
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    try:
        nvrtc.getVersion()
    except Exception as e:  # pragma: no cover - CI installs NVRTC
        pytest.skip(f"NVRTC cannot be loaded: {e}")
    src = source("params.cuh") + (
        f"\nstatic_assert(sizeof(Params) == {8 * len(launch.PARAM_FIELDS)}, \"layout\");\n"
        "static_assert(alignof(Params) == 8, \"alignment\");\n")
    prog = nvrtc.createProgram(src, "layout.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["-std=c++17", "-arch=sm_90"])
    finally:
        nvrtc.destroyProgram(prog)


def test_pack_fills_every_slot():
    p = _problem(10, 20)
    slots = launch._pack(p, {}, (3, 7, 1000, 2000))
    assert len(slots) == len(launch.PARAM_FIELDS)
    assert list(slots)[-4:] == [3, 7, 1000, 2000]


@pytest.mark.parametrize("M,N,B,H", [(1, 4096, 1, 32), (16, 131072, 1, 32), (1, 131072, 1, 256)])
def test_decode_shapes_split_the_keys(M, N, B, H):
    p = _problem(M, N, B, H)
    tiles = capability.lookup((9, 0), "fwd_decode", 128, "bfloat16", False)
    nsplit, per = launch.split_plan(p, tiles, 132)
    key_tiles = math.ceil(N / tiles.block_n)
    assert nsplit > 1 and per >= 2
    assert (nsplit - 1) * per < key_tiles <= nsplit * per  # every tile in exactly one split


def test_large_grids_are_not_split():
    p = _problem(8192, 8192, 2, 16)
    tiles = capability.lookup((9, 0), "fwd", 128, "bfloat16", False)
    assert launch.split_plan(p, tiles, 132) == (1, math.ceil(8192 / tiles.block_n))


def test_kernel_ready_rules():
    assert launch.kernel_ready((2, 4, 8, 64), (2048, 512, 64, 1), 4096, 2)
    assert not launch.kernel_ready((2, 4, 8, 64), (2048, 512, 64, 1), 4098, 2)   # misaligned
    assert not launch.kernel_ready((2, 4, 8, 64), (2048, 1, 256, 4), 4096, 2)    # last axis strided
    assert not launch.kernel_ready((2, 4, 8, 64), (2048, 512, 68, 1), 4096, 2)   # row not 16 B
    assert launch.kernel_ready((1, 1, 8, 64), (7, 3, 64, 1), 4096, 2)            # size-1 axes free


def test_parameter_block_outlives_the_call():
    """The argument array handed to cuLaunchKernel must stay alive (it is read by address)."""
    import ctypes
    import gc

    slots, args_addr, args = launch._buffers()
    gc.collect()
    assert ctypes.c_void_p.from_address(args_addr).value == ctypes.addressof(slots)
    assert launch._buffers()[2] is args
