"""The launch layer's host-side logic, without a GPU: parameter layout and split-KV planning."""
from __future__ import annotations

import ctypes
import dataclasses
import math
import struct

import pytest

from cupy_piecewise import capability, launch
from cupy_piecewise.compile import source
from cupy_piecewise.validate import Problem


def _problem(M, N, B=1, H=32, D=128):
    return Problem("cupy", B, H, H, M, N, D, "bfloat16", N // 4, False, 0.1, 0)


def test_param_layout_matches_the_kernel_struct(nvrtc):
    """PARAM_FIELDS must mirror kernels_cu/params.cuh slot for slot: NVRTC checks the size."""
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
    block = struct.unpack(f"<{len(launch.PARAM_FIELDS)}q",
                          launch._pack(p, {"k1": (5, 6, 7, 1)}, (3, 7, 1000, 2000)))
    fields = dict(zip(launch.PARAM_FIELDS, block))
    # split, then shift = N - M, and the pointers dlse, cu_q, cu_k (written per call)
    assert block[-8:] == (3, 7, 1000, 2000, 10, 0, 0, 0)
    shifted = launch._pack(dataclasses.replace(p, shift=-4, w=7), {})
    fields2 = dict(zip(launch.PARAM_FIELDS, struct.unpack(f"<{len(launch.PARAM_FIELDS)}q", shifted)))
    assert (fields2["shift"], fields2["w"]) == (-4, 6)  # w - P clamped to [-N, M] = [-20, 10]
    assert (fields["k1.ptr"], fields["k1.sb"], fields["k1.sh"], fields["k1.sr"]) == (0, 5, 6, 7)
    assert fields["M"] == 10 and fields["N"] == 20 and fields["H"] == 32 and fields["group"] == 1


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


# ---------------------------------------------------------------------------
# Launches.run against a stand-in driver: the parameter block each kernel would receive.


class _FakeDriver:
    """Driver stand-in: records launches and the context current on the calling thread
    (0: none, 100 + d: device d's primary context)."""

    def __init__(self):
        self.launches = []
        self.ctx = 0

    def ctxGetCurrent(self):
        return self.ctx

    def ctxSetCurrent(self, ctx):
        self.ctx = ctx

    def launchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, args, extra):
        if fn.phase == "fwd_sm90":  # tensor maps + its own parameter struct: read by the test
            self.launches.append(dict(ctx=self.ctx, fn=fn, grid=(gx, gy, gz), block=(bx, by, bz),
                                      smem=smem, stream=stream,
                                      args=list((ctypes.c_void_p * 6).from_address(args)),
                                      params=None))
            p = self.launches[-1]["args"][5]
            self.launches[-1]["params"] = ctypes.string_at(p, launch._HOPPER_PARAMS.size)
            return
        if fn.phase.startswith("bwd_sm90"):  # Hopper backward: its own structs (+ maps)
            size = {"bwd_sm90_prep": launch._BWD_PREP, "bwd_sm90_dq": launch._BWD_CONV}.get(
                fn.phase, launch._BWD_MAIN).size
            n = 1 if fn.phase in ("bwd_sm90_prep", "bwd_sm90_dq") else 7
            arr = list((ctypes.c_void_p * n).from_address(args))
            self.launches.append(dict(ctx=self.ctx, fn=fn, grid=(gx, gy, gz), block=(bx, by, bz),
                                      smem=smem, stream=stream, args=arr,
                                      params=ctypes.string_at(arr[-1], size)))
            return
        block_addr = ctypes.c_void_p.from_address(args).value
        block = list((ctypes.c_int64 * len(launch.PARAM_FIELDS)).from_address(block_addr))
        self.launches.append(dict(ctx=self.ctx, fn=fn, grid=(gx, gy, gz), block=(bx, by, bz), smem=smem,
                                  stream=stream, params=dict(zip(launch.PARAM_FIELDS, block))))


class _FakeRuntime:
    """cudaSetDevice makes the device's primary context current (CUDA 12 and later)."""

    def __init__(self, driver):
        self.driver, self.sets = driver, []

    def setDevice(self, device):
        self.sets.append(device)
        self.driver.ctx = 100 + device


@pytest.fixture
def fake_gpu(monkeypatch):
    drv = _FakeDriver()
    rt = _FakeRuntime(drv)
    monkeypatch.setattr(launch, "_driver_mod", drv)
    monkeypatch.setattr(launch, "_runtime_mod", rt)
    monkeypatch.setattr(launch, "_compute_capability", lambda device: (9, 0))
    monkeypatch.setattr(launch, "_multiprocessors", lambda device: 132)
    monkeypatch.setattr(launch, "_kernel", lambda device, variant: (variant, 1000 + device))
    monkeypatch.setattr(launch, "_primary", {})
    monkeypatch.delenv(capability.ENV_VAR, raising=False)
    monkeypatch.setenv(capability.PATH_VAR, "mma")  # the Hopper kernel has its own test
    capability.refresh_env_override()
    capability.refresh_env_override()
    launch._launches.clear()
    return drv, rt


@pytest.fixture
def fake_maps(monkeypatch):
    """tma.tensor_map_bhld replaced by a recorder: returns the list of (ptr, shape, strides,
    dtype, box) encoded, box being the rows, or (rows, panels) for a map of whole rows; a
    map's address is its pointer + 1."""
    from cupy_piecewise import tma

    encoded = []

    class FakeMap:
        def __init__(self, ptr, shape, strides, dtype, box):
            self.info = (ptr, tuple(shape), tuple(strides), dtype, box)
            encoded.append(self.info)

        def address(self):
            return self.info[0] + 1

    monkeypatch.setattr(tma, "tensor_map_bhld",
                        lambda ptr, shape, strides, dtype, box, panels=1: FakeMap(
                            ptr, shape, strides, dtype, box if panels == 1 else (box, panels)))
    return encoded


def _contiguous(shape):
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def test_forward_launch_parameters(fake_gpu):
    drv, _ = fake_gpu
    B, H, M, N, D = 2, 16, 4000, 3000, 128
    p = Problem("torch", B, H, H // 4, M, N, D, "bfloat16", 700, True, 0.125, 0)
    q = (H * D, D, H * D * B, 1)  # some (B, H, M, D) layout with odd axis order
    k = _contiguous((B, H // 4, N, D))
    o = _contiguous((B, H, M, D))
    run = launch.forward_launches(p, (q, k, q, k, k, o), split=True)
    assert run.workspace_bytes == 0  # 32 x 16 x 2 blocks fill 132 SMs: no split
    ptrs = tuple(16 * (i + 1) for i in range(7))
    run.run(ptrs, stream=77)
    (call,) = drv.launches
    variant = call["fn"]
    assert variant.phase == "fwd" and variant.causal and variant.head_dim == D
    tiles = variant.tiles
    assert call["grid"] == (math.ceil(M / tiles.block_m), H, B)
    assert call["block"] == (32 * tiles.num_warps, 1, 1) and call["smem"] == 1000
    assert call["stream"] == 77
    f = call["params"]
    for name, ptr, strides in zip(("q1", "k1", "q2", "k2", "v", "o"), ptrs, (q, k, q, k, k, o)):
        assert (f[f"{name}.ptr"], f[f"{name}.sb"], f[f"{name}.sh"], f[f"{name}.sr"]) == (ptr, *strides[:3])
    assert f["lse"] == ptrs[6] and f["delta"] == 0 and f["dq1.ptr"] == 0
    assert (f["H"], f["group"], f["M"], f["N"], f["w"]) == (H, 4, M, N, 700)
    assert struct.unpack("<ff", struct.pack("<q", f["scale_log2|sm_scale"])) == (
        pytest.approx(0.125 * 1.4426950408889634), 0.125)
    assert f["nsplit"] == 1 and f["split_tiles"] >= math.ceil(N / tiles.block_n)


def test_decode_launches_split_and_merge(fake_gpu):
    drv, _ = fake_gpu
    B, H, M, N, D = 1, 8, 1, 50000, 64
    p = Problem("torch", B, H, 1, M, N, D, "float16", -3, False, 0.5, 0)
    c = _contiguous((B, H, M, D))
    kv = _contiguous((B, 1, N, D))
    run = launch.forward_launches(p, (c, kv, c, kv, kv, c), split=True)
    tiles = launch.plan(p, "fwd_decode").tiles
    nsplit, per = launch.split_plan(p, tiles, 132)
    rows = nsplit * B * H * M
    assert run.workspace_bytes == 4 * rows * (D + 1)
    run.run(tuple(range(16, 16 * 8, 16)), stream=5, workspace=1 << 20)
    main, combine = drv.launches
    assert main["fn"].phase == "fwd_decode" and combine["fn"].phase == "fwd_combine"
    assert main["grid"] == (nsplit, H, B)
    for call in (main, combine):
        f = call["params"]
        assert (f["nsplit"], f["split_tiles"]) == (nsplit, per)
        assert f["o_part"] == 1 << 20 and f["lse_part"] == (1 << 20) + 4 * rows * D
        # w = -3 lies below every distance: passed as P - N, which compares the same
        assert f["w"] == max(-3, f["shift"] - f["N"]) and f["o.ptr"] == 96 and f["lse"] == 112
    # without a workspace the same problem runs unsplit
    assert launch.forward_launches(p, (c, kv, c, kv, kv, c), split=False).workspace_bytes == 0


@pytest.mark.parametrize("dtype,D,causal,deterministic,fused,override", [
    ("float16", 64, False, True, None, None),   # deterministic: the two-kernel scheme
    ("float32", 64, False, False, None, None),  # float32 has no one-kernel backward
    ("float16", 64, False, False, "bwd_grid", None),  # the sm_90 row's bwd_grid entries
    ("bfloat16", 128, True, False, "bwd_grid", None),
    ("bfloat16", 128, False, False, "bwd_grid", None),
    ("float16", 32, False, False, None, None),  # no one-kernel entry at this head dim
    # a bwd_fused override forces the earlier one-kernel backward over the bwd_grid entry
    ("bfloat16", 128, True, False, "bwd_fused", "bwd_fused=32x64x4"),
    ("float16", 64, False, False, "bwd_fused", "bwd_fused=64x64x4"),
    # and a bwd_grid override its other shape
    ("bfloat16", 64, True, False, "bwd_grid", "bwd_grid=64x128x8"),
    ("float16", 32, False, True, None, "bwd_grid=64x64x4"),  # deterministic wins
])
def test_backward_launches(fake_gpu, monkeypatch, dtype, D, causal, deterministic, fused,
                           override):
    """The mma.sync backward: delta, dq, dk/dv (deterministic, float32, and where the table
    has no one-kernel tiles), or the one-kernel scheme: delta (zeroing the float32 dQ
    accumulators), the warp-grid (bwd_grid) or earlier (bwd_fused) dk/dv/dQ kernel, the
    conversion; the accumulators are the workspace's two halves."""
    from cupy_piecewise import capability

    if override:
        monkeypatch.setenv(capability.ENV_VAR, override)
    capability.refresh_env_override()
    drv, _ = fake_gpu
    B, H, M, N = 3, 4, 70, 90
    p = Problem("cupy", B, H, 2, M, N, D, dtype, 10, causal, 0.3, 0)
    q, k = _contiguous((B, H, M, D)), _contiguous((B, 2, N, D))
    run = launch.backward_launches(p, (q, k, q, k, k, q, q, q, k, q, k, k),
                                   deterministic=deterministic)
    ptrs = tuple(16 * (i + 1) for i in range(len(launch.BACKWARD_ARRAYS)))
    assert launch.use_fused_backward(p, deterministic) == bool(fused)
    acc = B * H * M * D * 4  # bytes of one float32 accumulator
    assert run.workspace_bytes == (2 * acc if fused else 0)
    ws = 1 << 24
    run.run(ptrs, stream=3, workspace=ws)
    phases = [c["fn"].phase for c in drv.launches]
    main = drv.launches[1 if fused else 2]
    assert main["grid"] == (math.ceil(N / main["fn"].tiles.block_n), 2, B)
    if fused == "bwd_fused":
        assert phases == ["bwd_delta", "bwd_fused", "bwd_dq_convert"]
        # CAUSAL, VARLEN, FUSED
        assert main["fn"].name_expression.endswith(f", {str(causal).lower()}, false, true>")
    elif fused == "bwd_grid":
        t = main["fn"].tiles
        assert phases == ["bwd_delta", "bwd_grid", "bwd_dq_convert"]
        assert main["fn"].name_expression.startswith("pw_backward_grid<")
        assert main["fn"].name_expression.endswith(
            f"{D}, {t.block_m}, {t.block_n}, {t.num_warps}, {str(causal).lower()}>")
        assert main["block"] == (32 * t.num_warps, 1, 1)
        expect = override.split("=")[1] if override else {128: "64x128x8", 64: "64x64x4"}[D]
        assert f"{t.block_m}x{t.block_n}x{t.num_warps}" == expect
    if fused:
        for c in (drv.launches[0], drv.launches[2]):  # a warp per row, as the pre-pass
            assert c["grid"] == (math.ceil(H * M / 8), B, 1)
    else:
        assert phases == ["bwd_delta", "bwd_dq", "bwd_dkv"]
    for call in drv.launches:  # one parameter block for all three kernels
        f = call["params"]
        for name, ptr in zip(launch.BACKWARD_ARRAYS, ptrs):
            assert f[name if name in ("lse", "delta", "dlse") else f"{name}.ptr"] == ptr
        # dq_acc1, dq_acc2 share the split-KV slots (params.cuh); 0 without a workspace
        assert (f["o_part"], f["lse_part"]) == ((ws, ws + acc) if fused else (0, 0))


@pytest.mark.parametrize("deterministic", [False, True])
def test_hopper_backward_launches(fake_gpu, fake_maps, monkeypatch, deterministic):
    """On sm_90 (D 64/128) the backward is prep -> pw90_bwd -> dq convert (fused dQ) or the
    mma.sync delta + dq kernels, prep and pw90_bwd without dQ (deterministic); tensor maps
    in kernel order q1, q2, dout, k1, k2, v; the workspace split into lse2, delta and the
    float32 dQ accumulator; every parameter struct filled from the problem and pointers."""
    drv, _ = fake_gpu
    monkeypatch.delenv(capability.PATH_VAR)
    capability.refresh_env_override()
    encoded = fake_maps
    B, H, Hkv, M, N, D = 2, 8, 2, 100, 300, 64
    p = Problem("torch", B, H, Hkv, M, N, D, "float16", 50, True, 0.125, 0)
    q, k = _contiguous((B, H, M, D)), _contiguous((B, Hkv, N, D))
    strides = (q, k, q, k, k, q, q, q, k, q, k, k)
    run = launch.backward_launches(p, strides, deterministic=deterministic)
    assert isinstance(run, launch.HopperBackward)
    mpad = 128  # M rounded up to 64-row tiles
    rows = B * H * mpad
    assert run.workspace_bytes == 8 * rows + (0 if deterministic else 2 * 4 * rows * D)
    ptrs = tuple(0x10000 * (i + 1) for i in range(len(launch.BACKWARD_ARRAYS)))
    named = dict(zip(launch.BACKWARD_ARRAYS, ptrs))
    ws = 0x900000
    run.run(ptrs, stream=5, workspace=ws)
    run.run(ptrs, stream=5, workspace=ws)
    assert len(encoded) == 6  # maps reused by the second call
    assert [e[0] for e in encoded] == [named[n] for n in ("q1", "q2", "dout", "k1", "k2", "v")]
    assert [e[4] for e in encoded] == [64, 64, 64, 128, 128, 128]
    calls = drv.launches[len(drv.launches) // 2:]  # the second run
    phases = [c["fn"].phase for c in calls]
    if deterministic:
        assert phases == ["bwd_delta", "bwd_dq", "bwd_sm90_prep", "bwd_sm90_det"]
        assert calls[1]["params"]["dq1.ptr"] == named["dq1"] and calls[1]["params"]["delta"] == named["delta"]
        calls = calls[2:]
    else:
        assert phases == ["bwd_sm90_prep", "bwd_sm90", "bwd_sm90_dq"]
    prep, main = calls[0], calls[1]
    # 16 rows (8 row pairs) a block
    assert prep["grid"] == (H * math.ceil(mpad / 16), B, 1) and prep["block"] == (256, 1, 1)
    assert main["grid"] == (math.ceil(N / 128), Hkv, B) and main["block"] == (384, 1, 1)
    assert main["fn"].causal and main["stream"] == 5
    acc = 0 if deterministic else ws + 8 * rows
    f = launch._BWD_PREP.unpack(prep["params"])
    assert f[0] == named["o"] and f[4] == named["dout"] and f[1:4] == q[:3]
    assert f[8:12] == (named["lse"], ws, ws + 4 * rows, acc) and f[12:16] == (B, H, M, mpad)
    assert f[16] == named["dlse"] and f[17] == mpad  # rows: what row_pair splits, as the grid
    f = launch._BWD_MAIN.unpack(main["params"])
    assert (f[0], f[4], f[8]) == (named["dk1"], named["dk2"], named["dv"]) and f[1:4] == k[:3]
    assert f[12:15] == (acc, ws, ws + 4 * rows)
    assert f[15:23] == (B, H, H // Hkv, M, N, mpad, 50, N - M)  # ..., w, shift
    assert f[23] == pytest.approx(0.125 * 1.4426950408889634) and f[24] == 0.125
    assert main["args"][:6] == [named[n] + 1 for n in ("q1", "q2", "dout", "k1", "k2", "v")]
    if not deterministic:
        conv = calls[2]
        assert conv["grid"] == (H * math.ceil(M / 16), B, 1)
        f = launch._BWD_CONV.unpack(conv["params"])
        assert (f[0], f[4], f[8]) == (named["dq1"], named["dq2"], acc) and f[1:4] == q[:3]
        assert f[9:13] == (B, H, M, mpad) and f[13] == 0.125
        assert f[14] == M  # rows: what pw90::bwd::row_pair splits, as the grid above
    # what stays on the mma.sync kernels: other head dims, CUPY_PIECEWISE_PATH=mma, a
    # broadcast (stride 0) dout
    assert isinstance(launch.backward_launches(dataclasses.replace(p, D=32), strides), launch.Launches)
    dob = (0, q[1], q[2], 1)
    assert isinstance(launch.backward_launches(p, strides[:6] + (dob,) + strides[7:]), launch.Launches)
    monkeypatch.setenv(capability.PATH_VAR, "mma")
    capability.refresh_env_override()
    assert isinstance(launch.backward_launches(p, strides), launch.Launches)


def test_launch_switches_context_and_restores_it(fake_gpu):
    drv, rt = fake_gpu
    p = Problem("cupy", 1, 2, 2, 64, 64, 64, "float16", 10, False, 0.3, 1)
    c = _contiguous((1, 2, 64, 64))
    run = launch.forward_launches(p, (c,) * 6, split=False)
    drv.ctx = 100  # the caller works on device 0
    run.run((0,) * 7, stream=0)
    assert rt.sets == [1] and drv.launches[-1]["ctx"] == 101 and drv.ctx == 100
    rt.sets.clear()
    drv.ctx = 101  # already on device 1: no switch
    run.run((0,) * 7, stream=0)
    assert rt.sets == [] and drv.launches[-1]["ctx"] == 101


def test_launch_on_a_thread_without_context(fake_gpu):
    """A thread that never touched CUDA has no current context even though
    cudaGetDevice answers 0: the launch must make device 0's context current."""
    drv, rt = fake_gpu
    p = Problem("torch", 1, 2, 2, 64, 64, 64, "float16", 10, False, 0.3, 0)
    c = _contiguous((1, 2, 64, 64))
    run = launch.forward_launches(p, (c,) * 6, split=False)
    drv.ctx = 0
    run.run((0,) * 7, stream=0)
    assert rt.sets == [0] and drv.launches[-1]["ctx"] == 100
    assert drv.ctx == 100  # left current: the thread had none to restore


def test_cached_launches_follow_the_tile_override(fake_gpu, monkeypatch):
    drv, _ = fake_gpu
    p = Problem("cupy", 1, 64, 64, 512, 512, 64, "float16", 10, False, 0.3, 0)
    ref = launch.ArrayRef(0, _contiguous((1, 64, 512, 64)))
    args = (p, ref, ref, ref, ref, ref, ref, 0)
    launch.forward(*args, stream=0)
    monkeypatch.setenv(capability.ENV_VAR, "fwd=64x32x2")
    capability.refresh_env_override()
    launch.forward(*args, stream=0)
    monkeypatch.delenv(capability.ENV_VAR)
    capability.refresh_env_override()
    launch.forward(*args, stream=0)
    tiles = [str(c["fn"].tiles) for c in drv.launches]
    assert tiles[1].startswith("64x32x2") and tiles[0] == tiles[2] != tiles[1]


def test_cached_launches_follow_the_persist_cap(fake_gpu, fake_maps, monkeypatch):
    """launch.forward's plan cache keys on CUPY_PIECEWISE_PERSIST_CTAS: the persistent
    Hopper forward's grid follows the variable through the cache, both ways."""
    drv, _ = fake_gpu
    monkeypatch.delenv(capability.PATH_VAR, raising=False)
    monkeypatch.delenv(capability.PERSIST_VAR, raising=False)
    capability.refresh_env_override()
    B, H, M, D = 4, 8, 1000, 128  # 8 x 8 x 4 = 256 work tiles
    p = Problem("torch", B, H, H, M, M, D, "bfloat16", 300, False, 0.125, 0)
    ref = launch.ArrayRef(0x10000, _contiguous((B, H, M, D)))
    args = (p, ref, ref, ref, ref, ref, ref, 0x20000)
    grids = []
    for cap in (None, "5", None):
        if cap is None:
            monkeypatch.delenv(capability.PERSIST_VAR, raising=False)
        else:
            monkeypatch.setenv(capability.PERSIST_VAR, cap)
        capability.refresh_env_override()
        launch.forward(*args, stream=0)
        grids.append(drv.launches[-1]["grid"])
    capability.refresh_env_override()
    assert grids == [(132, 1, 1), (5, 1, 1), (132, 1, 1)]


def test_hopper_launch(fake_gpu, fake_maps, monkeypatch):
    """On sm_90 with enough query tiles the forward is the wgmma + TMA kernel: five tensor
    maps (q1, q2, k1, k2, v order), FwdParams, 384 threads (512 at D = 64, whose query tiles
    have 192 rows), cached maps per pointer tuple."""
    drv, _ = fake_gpu
    monkeypatch.delenv(capability.PATH_VAR)
    capability.refresh_env_override()
    encoded = fake_maps
    B, H, Hkv, M, N, D = 4, 8, 2, 1000, 1200, 128  # 8 x 8 x 4 = 256 blocks
    p = Problem("torch", B, H, Hkv, M, N, D, "bfloat16", 300, True, 0.125, 0)
    q, k, o = _contiguous((B, H, M, D)), _contiguous((B, Hkv, N, D)), _contiguous((B, H, M, D))
    assert launch.use_hopper(p) and not launch.use_hopper(dataclasses.replace(p, D=32))
    assert not launch.use_hopper(dataclasses.replace(p, M=8))           # decoding: split-KV
    assert not launch.use_hopper(dataclasses.replace(p, B=1, H=1, M=300))  # 3 blocks: split-KV
    monkeypatch.setenv(capability.PATH_VAR, "hopper")
    capability.refresh_env_override()
    assert launch.use_hopper(dataclasses.replace(p, B=1, H=1, M=300))  # forced
    assert not launch.use_hopper(dataclasses.replace(p, M=8))  # M <= 16: never
    monkeypatch.delenv(capability.PATH_VAR)
    capability.refresh_env_override()
    run = launch.forward_launches(p, (q, k, q, k, k, o), split=True)
    assert isinstance(run, launch.HopperLaunches) and run.workspace_bytes == 0
    ptrs = (0x10000, 0x20000, 0x30000, 0x40000, 0x50000, 0x60000, 0x70000)
    run.run(ptrs, stream=9)
    run.run(ptrs, stream=9)
    assert len(encoded) == 5  # the second call reused the maps
    bn = capability.HOPPER_BLOCK_N[D]
    assert [e[0] for e in encoded] == list(ptrs[:5])
    assert [e[4] for e in encoded] == [128, bn, 128, bn, bn]
    assert encoded[1][1] == (B, Hkv, N, D) and encoded[0][2] == q
    call = drv.launches[-1]
    assert call["fn"].phase == "fwd_sm90" and call["fn"].causal and call["block"] == (384, 1, 1)
    # causal at D = 128: the persistent grid over pairs of query tiles of one head (8 tiles:
    # 4 units per head, 128 units), at most one CTA per SM
    assert capability.HOPPER_CAUSAL_PAIRS[D]
    assert call["grid"] == (min(4 * H * B, 132), 1, 1) and call["stream"] == 9
    assert call["smem"] == 1000  # the fake _kernel's answer
    maps = call["args"][:5]
    # kernel order: q1, q2, k1, k2, v
    assert maps == [ptrs[0] + 1, ptrs[2] + 1, ptrs[1] + 1, ptrs[3] + 1, ptrs[4] + 1]
    fields = launch._HOPPER_PARAMS.unpack(call["params"])
    assert fields[:5] == (ptrs[5], o[0], o[1], o[2], ptrs[6])
    assert fields[5:11] == (H, H // Hkv, M, N, 300, N - M)  # ..., w, shift
    assert fields[11] == pytest.approx(0.125 * 1.4426950408889634) and fields[12] == 0.125
    assert fields[13:] == (B, 0, 0)  # the batch the persistent grid walks; no packed totals
    # not causal: the persistent grid, one CTA per SM (132 here), at most one per work tile;
    # CUPY_PIECEWISE_PERSIST_CTAS caps it (a new plan: caches key on it)
    pn = dataclasses.replace(p, causal=False)
    launch.forward_launches(pn, (q, k, q, k, k, o), split=True).run(ptrs, stream=9)
    assert drv.launches[-1]["grid"] == (min(math.ceil(M / 128) * H * B, 132), 1, 1)
    assert launch._HOPPER_PARAMS.unpack(drv.launches[-1]["params"])[13] == B
    monkeypatch.setenv(capability.PERSIST_VAR, "5")
    capability.refresh_env_override()
    try:
        launch.forward_launches(pn, (q, k, q, k, k, o), split=True).run(ptrs, stream=9)
        assert drv.launches[-1]["grid"] == (5, 1, 1)
        launch.forward_launches(p, (q, k, q, k, k, o), split=True).run(ptrs, stream=9)
        assert drv.launches[-1]["grid"] == (5, 1, 1)  # causal pairs: capped too
        # D = 64 (HOPPER_CAUSAL_PAIRS false): causal batches take one CTA per query tile, as
        # the hardware balances unequal tiles; the cap does not apply
        p64 = dataclasses.replace(p, D=64)
        assert not capability.HOPPER_CAUSAL_PAIRS[64]
        q64, k64 = _contiguous((B, H, M, 64)), _contiguous((B, Hkv, N, 64))
        n = len(encoded)
        launch.forward_launches(p64, (q64, k64, q64, k64, k64, q64), split=True).run(ptrs, stream=9)
        # three consumer warpgroups at D = 64: 192-row query tiles (grid, Q boxes), 512 threads
        assert capability.HOPPER_BLOCK_M[64] == 192
        assert drv.launches[-1]["grid"] == (math.ceil(M / 192), H, B)
        assert drv.launches[-1]["block"] == (512, 1, 1)
        assert [e[4] for e in encoded[n:]] == [192, 128, 192, 128, 128]
    finally:
        monkeypatch.delenv(capability.PERSIST_VAR)
        capability.refresh_env_override()
    # a broadcast (stride 0) head axis cannot be a tensor map: the mma.sync kernels take it
    kb = (k[0], 0, k[2], 1)
    assert isinstance(launch.forward_launches(p, (q, kb, q, k, k, o), split=True), launch.Launches)
    # CUPY_PIECEWISE_PATH=mma forces the mma.sync kernels
    monkeypatch.setenv(capability.PATH_VAR, "mma")
    capability.refresh_env_override()
    assert not launch.use_hopper(p)
    monkeypatch.setenv(capability.PATH_VAR, "fast")
    capability.refresh_env_override()
    with pytest.raises(ValueError, match="CUPY_PIECEWISE_PATH"):
        launch.use_hopper(p)


def test_packed_batch_launch_parameters(fake_gpu):
    """attention_varlen's launches: the VARLEN kernels over (tile of the longest sequence,
    head, sequence); packed (total, heads, D) arrays as views with batch stride 0; M and N
    holding the packed totals; the running totals as per-call pointers; the backward's
    delta pre-pass over all H * total_q rows as one batch."""
    from cupy_piecewise import varlen_launch

    drv, _ = fake_gpu
    S, H, Hkv, D = 3, 8, 2, 64
    max_q, max_k, total_q, total_k = 300, 500, 420, 900
    p = Problem("cupy", S, H, Hkv, max_q, max_k, D, "float16", 77, True, 0.125, 0)
    shape = varlen_launch.VarlenShape(total_q, total_k)
    q, k = (H * D, D, 1), (Hkv * D, D, 1)
    run = varlen_launch.forward_launches(p, shape, (q, k, q, k, k, q))
    ptrs = tuple(16 * (i + 1) for i in range(len(varlen_launch.FORWARD_ARRAYS)))
    run.run(ptrs, stream=5)
    (call,) = drv.launches
    v = call["fn"]
    assert (v.phase, v.varlen, v.causal) == ("fwd", True, True)
    assert "true>" in v.name_expression  # pw_forward<..., CAUSAL, VARLEN=true>
    assert v.tiles == capability.lookup((9, 0), "fwd", D, "float16", True, varlen=True)
    assert call["grid"] == (math.ceil(max_q / v.tiles.block_m), H, S)
    f = call["params"]
    assert (f["M"], f["N"], f["H"], f["group"]) == (total_q, total_k, H, H // Hkv)
    assert (f["q1.sb"], f["q1.sh"], f["q1.sr"]) == (0, D, H * D)
    assert (f["k2.sb"], f["k2.sh"], f["k2.sr"]) == (0, D, Hkv * D)
    assert (f["cu_q"], f["cu_k"]) == ptrs[-2:] and f["lse"] == ptrs[6]
    # one split covering every key tile (split_tiles 0 would give each row no keys)
    assert (f["nsplit"], f["split_tiles"]) == (1, launch.UNSPLIT_TILES)
    assert f["w"] == 77
    drv.launches.clear()

    names = ("q1", "k1", "q2", "k2", "v", "o", "dout", "dq1", "dk1", "dq2", "dk2", "dv")
    strides = tuple(k if n in ("k1", "k2", "v", "dk1", "dk2", "dv") else q for n in names)
    back = varlen_launch.backward_launches(p, shape, strides, deterministic=True)
    ptrs = tuple(16 * (i + 1) for i in range(len(varlen_launch.BACKWARD_ARRAYS)))
    back.run(ptrs, stream=5)
    delta, dq, dkv = drv.launches
    assert delta["fn"].phase == "bwd_delta" and delta["grid"] == (math.ceil(H * total_q / 8), 1, 1)
    assert (dq["fn"].phase, dq["fn"].varlen) == ("bwd_dq", True)
    assert dq["grid"] == (math.ceil(max_q / dq["fn"].tiles.block_m), H, S)
    assert (dkv["fn"].phase, dkv["fn"].varlen) == ("bwd_dkv", True)
    assert dkv["grid"] == (math.ceil(max_k / dkv["fn"].tiles.block_n), Hkv, S)
    f = dkv["params"]
    assert (f["cu_q"], f["cu_k"], f["delta"], f["dlse"]) == (ptrs[15], ptrs[16], ptrs[13], ptrs[14])
    assert (f["dv.sb"], f["dv.sh"], f["dv.sr"]) == (0, D, Hkv * D)
    drv.launches.clear()

    # the default for 16-bit inputs: the one-kernel backward over the H * total_q rows
    back = varlen_launch.backward_launches(p, shape, strides)
    acc = H * total_q * D * 4
    assert back.workspace_bytes == 2 * acc
    back.run(ptrs, stream=5, workspace=1 << 24)
    delta, main, conv = drv.launches
    assert [c["fn"].phase for c in drv.launches] == ["bwd_delta", "bwd_fused", "bwd_dq_convert"]
    assert delta["grid"] == conv["grid"] == (math.ceil(H * total_q / 8), 1, 1)
    assert main["fn"].varlen and main["fn"].name_expression.endswith(", true, true>")
    assert main["grid"] == (math.ceil(max_k / main["fn"].tiles.block_n), Hkv, S)
    for c in drv.launches:
        assert (c["params"]["o_part"], c["params"]["lse_part"]) == (1 << 24, (1 << 24) + acc)
        assert (c["params"]["cu_q"], c["params"]["M"]) == (ptrs[15], total_q)


@pytest.mark.parametrize("deterministic", [False, True])
def test_hopper_packed_backward_launches(fake_gpu, fake_maps, monkeypatch, deterministic):
    """A packed batch's backward on sm_90 (head dim 96: the D = 128 kernels storing 96
    columns): HopperBackward with the VARLEN builds, tensor maps over the packed arrays as
    one batch, statistics of total_q + 64 B rows rounded up to 64 per head, grids over
    (tile of the longest sequence, head, sequence), and cu_q / cu_k in every parameter
    struct that reads them; deterministic: the packed mma.sync delta + dq kernels first."""
    from cupy_piecewise import varlen_launch

    drv, _ = fake_gpu
    monkeypatch.delenv(capability.PATH_VAR)
    capability.refresh_env_override()
    encoded = fake_maps
    B, H, Hkv, D = 3, 4, 2, 96
    total_q, total_k, max_q, max_k = 500, 700, 300, 400
    p = Problem("torch", B, H, Hkv, max_q, max_k, D, "bfloat16", 50, True, 0.125, 0)
    shape = varlen_launch.VarlenShape(total_q, total_k)
    q3, k3 = (H * D, D, 1), (Hkv * D, D, 1)  # packed (total, heads, D), contiguous
    strides = (q3, k3, q3, k3, k3, q3, q3, q3, k3, q3, k3, k3)
    run = varlen_launch.backward_launches(p, shape, strides, deterministic=deterministic)
    assert isinstance(run, launch.HopperBackward) and run.arrays == varlen_launch.BACKWARD_ARRAYS
    mpad = math.ceil((total_q + 64 * B) / 64) * 64
    rows = H * mpad
    # the dQ accumulator has the compute head dim's columns (96 -> 128)
    assert run.workspace_bytes == 8 * rows + (0 if deterministic else 2 * 4 * rows * 128)
    ptrs = tuple(0x10000 * (i + 1) for i in range(len(run.arrays)))
    named = dict(zip(run.arrays, ptrs))
    ws = 0x9000000
    run.run(ptrs, stream=5, workspace=ws)
    assert [e[0] for e in encoded] == [named[n] for n in ("q1", "q2", "dout", "k1", "k2", "v")]
    assert [e[1] for e in encoded] == [(1, H, total_q, D)] * 3 + [(1, Hkv, total_k, D)] * 3
    assert encoded[0][2] == (0, D, H * D, 1) and [e[4] for e in encoded] == [64] * 3 + [128] * 3
    calls = drv.launches
    phases = [c["fn"].phase for c in calls]
    if deterministic:
        assert phases == ["bwd_delta", "bwd_dq", "bwd_sm90_prep", "bwd_sm90_det"]
        assert calls[1]["fn"].varlen and calls[1]["grid"][1:] == (H, B)
        assert calls[1]["params"]["cu_q"] == named["cu_q"]
        calls = calls[2:]
    else:
        assert phases == ["bwd_sm90_prep", "bwd_sm90", "bwd_sm90_dq"]
    assert all(c["fn"].varlen and c["fn"].head_dim == D for c in calls)
    prep, main = calls[0], calls[1]
    rows_q = math.ceil(max_q / 64) * 64
    assert prep["grid"] == (H * math.ceil(rows_q / 16), B, 1)
    assert main["grid"] == (math.ceil(max_k / 128), Hkv, B)
    acc = 0 if deterministic else ws + 8 * rows
    f = launch._BWD_PREP.unpack(prep["params"])
    assert f[1:4] == (0, D, H * D) and f[8:12] == (named["lse"], ws, ws + 4 * rows, acc)
    assert f[12:16] == (1, H, total_q, mpad) and f[17:] == (rows_q, named["cu_q"])
    f = launch._BWD_MAIN.unpack(main["params"])
    assert f[1:4] == (0, D, Hkv * D) and f[12:15] == (acc, ws, ws + 4 * rows)
    assert f[15:21] == (1, H, H // Hkv, total_q, total_k, mpad)
    assert f[25:] == (named["cu_q"], named["cu_k"])
    if not deterministic:
        conv = calls[2]
        assert conv["grid"] == (H * math.ceil(max_q / 16), B, 1)
        f = launch._BWD_CONV.unpack(conv["params"])
        assert f[8:13] == (acc, 1, H, total_q, mpad) and f[14:] == (max_q, named["cu_q"])


def test_launch_config_layout_is_cudas():
    """cuda_driver's ctypes mirrors of CUlaunchConfig / CUlaunchAttribute (cuda.h, CUDA 12+):
    sizes, offsets, and the programmatic-stream-serialization attribute it sets."""
    from cupy_piecewise import cuda_driver as cd

    assert ctypes.sizeof(cd.LaunchAttribute) == 72 and cd.LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(cd.LaunchConfig) == 56
    assert (cd.LaunchConfig.sharedMemBytes.offset, cd.LaunchConfig.hStream.offset,
            cd.LaunchConfig.attrs.offset, cd.LaunchConfig.numAttrs.offset) == (24, 32, 40, 48)
    cfg = cd.programmatic_config((5, 6, 7), 160, 4096, 0x1234)
    assert (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.blockDimX, cfg.blockDimY,
            cfg.blockDimZ, cfg.sharedMemBytes, cfg.hStream, cfg.numAttrs) == (
                5, 6, 7, 160, 1, 1, 4096, 0x1234, 1)
    assert cfg.attrs[0].id == cd.ATTR_PROGRAMMATIC_STREAM_SERIALIZATION == 6
    assert int.from_bytes(bytes(cfg.attrs[0].value[:4]), "little") == 1
    assert cd.programmatic_config((1, 1, 1), 32, 0, 0).hStream is None  # the legacy stream


@pytest.mark.parametrize("B,pdl,driver_has_it", [(1, True, True), (1, False, True),
                                                  (8, True, True), (1, True, False)])
def test_hopper_decode_launches_programmatically(fake_gpu, fake_maps, monkeypatch, B, pdl,
                                                 driver_has_it):
    """The Hopper decode and its split merge go through cuLaunchKernelEx with the
    programmatic attribute when capability.KV90_PDL* say so and the driver has that entry
    point, and through cuLaunchKernel otherwise; B = 1 at 4096 keys splits 8 ways (merged by
    pw_forward_combine), B = 8 does not split."""
    from cupy_piecewise import cuda_driver, kvcache_launch as kl

    drv, _ = fake_gpu
    monkeypatch.delenv(capability.PATH_VAR, raising=False)
    capability.refresh_env_override()
    monkeypatch.setattr(capability, "KV90_PDL", pdl)
    monkeypatch.setattr(capability, "KV90_PDL_DECODE", pdl)
    monkeypatch.setattr(cuda_driver, "programmatic_available", lambda: driver_has_it)
    calls = []
    monkeypatch.setattr(drv, "launchKernel", lambda fn, gx, gy, gz, bx, by, bz, smem, stream,
                        args, extra: calls.append(("plain", fn.phase, (gx, gy, gz), bx, stream)))
    monkeypatch.setattr(cuda_driver, "launch_programmatic", lambda fn, grid, threads, smem,
                        stream, args: calls.append(("programmatic", fn.phase, grid, threads, stream)))
    H, N, D = 32, 4096, 64
    q = _contiguous((B, H, 1, D))
    kv = _contiguous((B, H, N, D))
    strides = tuple((name, st[:3]) for name, st in (("q1", q), ("q2", q), ("o", q), ("k1", kv),
                                                    ("k2", kv), ("v", kv)))
    shape = kl.KVShape(0, "bfloat16", B, H, H, 1, D, N, B, 0, 0, False, True, N // 4, 0.125,
                       strides)
    plan = kl.KVPlan(shape)
    plan.run({"q1": 16, "q2": 32, "o": 48, "k1": 64, "k2": 80, "v": 96, "seqlens": 112},
             stream=9, workspace=1 << 20 if plan.workspace_bytes else 0)
    kind = "programmatic" if pdl and driver_has_it else "plain"
    if B == 1:
        assert (plan.nsplit, plan.cluster) == (8, 1)
        assert calls == [(kind, "kvdecode_sm90", (H, 8, 1), 160, 9),
                         (kind, "fwd_combine", (H // 8, 1, 1), 256, 9)]
    else:
        assert plan.nsplit == 1 and calls == [(kind, "kvdecode_sm90", (H, 1, B), 160, 9)]
    assert len(fake_maps) == 3  # k1, k2, v


@pytest.mark.parametrize("M,interleaved,path", [(1, False, None), (1, True, "mma"),
                                                 (5, True, None)])
def test_rotary_kvcache_plan_carries_its_tables(fake_gpu, fake_maps, monkeypatch, M,
                                                interleaved, path):
    """A rotary-inside call on an H200 runs the kernel a two-cache call of its shape runs
    (the TMA decode for one token, the cp.async kernel with CUPY_PIECEWISE_PATH=mma or for
    more tokens), built with ROT; the parameter block of every launch carries the cos/sin
    pointers and the two position divisors, and k1 and k2 name the one raw cache. The append
    (which skips K2 when rot_cos is set) gets the same block."""
    from cupy_piecewise import kvcache_launch as kl
    from cupy_piecewise.compile import ROTARY_LAYOUTS

    drv, _ = fake_gpu
    if path is None:
        monkeypatch.delenv(capability.PATH_VAR, raising=False)
    else:
        monkeypatch.setenv(capability.PATH_VAR, path)
    capability.refresh_env_override()
    calls = []

    def launch_kernel(fn, gx, gy, gz, bx, by, bz, smem, stream, args, extra):
        if fn.phase == "fwd_combine":  # the merge's own Params, not KVParams
            calls.append((fn, None))
            return
        nmaps = 3 if fn.phase == "kvdecode_sm90" else 0  # tensor maps of k1, k2, v first
        addr = (ctypes.c_void_p * (nmaps + 1)).from_address(args)[nmaps]
        block = (ctypes.c_int64 * len(kl.KV_FIELDS)).from_address(addr)
        calls.append((fn, dict(zip(kl.KV_FIELDS, block))))

    monkeypatch.setattr(drv, "launchKernel", launch_kernel)
    B, H, Hkv, N, D = 2, 8, 2, 4096, 128
    q, kv, new = _contiguous((B, H, M, D)), _contiguous((B, Hkv, N, D)), _contiguous((B, Hkv, M, D))
    names = (("q1", q), ("q2", q), ("o", q), ("k1", kv), ("k2", kv), ("v", kv), ("k1n", new),
             ("k2n", new), ("vn", new))
    layout = ROTARY_LAYOUTS["interleaved" if interleaved else "half"]
    shape = kl.KVShape(0, "bfloat16", B, H, Hkv, M, D, N, B, 0, 0, True, True, 64, 0.125,
                       tuple((n, st[:3]) for n, st in names), layout, (1, 4))
    hopper = kl.use_hopper_decode(shape, (9, 0))
    assert hopper == (M == 1 and path is None)
    assert kl.use_hopper_decode(shape._replace(rotary=0, rot_groups=(0, 0)), (9, 0)) == hopper
    plan = kl.KVPlan(shape)
    ptrs = {"q1": 16, "q2": 32, "o": 48, "k1": 64, "k2": 64, "v": 96, "k1n": 112, "k2n": 112,
            "vn": 128, "seqlens": 144, "rot_cos": 0x1000, "rot_sin": 0x2000}
    plan.run(ptrs, stream=5, workspace=1 << 20 if plan.workspace_bytes else 0)
    main = "kvdecode_sm90" if hopper else ("kvdecode" if M == 1 else "kvcache")
    assert [fn.phase for fn, _ in calls][:2] == ["kv_append", main]
    assert calls[1][0].rotary == layout
    assert calls[1][0].name_expression.endswith(f", {layout}>")
    for fn, p in calls:
        if fn.phase == "fwd_combine":
            continue
        assert (p["rot_cos"], p["rot_sin"], p["rot_group1"], p["rot_group2"]) == (
            0x1000, 0x2000, 1, 4)
        assert p["k1.ptr"] == p["k2.ptr"] == 64 and p["k1n.ptr"] == p["k2n.ptr"] == 112


@pytest.mark.parametrize("B,switch,staged", [(8, True, True), (1, True, False), (8, False, False)])
def test_rotary_decode_takes_staged_tables_only_where_it_does_not_split(
        fake_gpu, fake_maps, monkeypatch, B, switch, staged):
    """capability.KV90_ROT_STAGE_UNSPLIT: the Hopper rotary decode asks for its staged-table
    form by name (Variant.rot_stage, `, true>`) only where the default form's plan runs one
    key split (B·Hkv = 256 at D = 128 fills an H200's 132 SMs two blocks each); at B = 1 the
    decode splits 8 ways and keeps the default form (the staged ring would halve the splits,
    bench/results/2026-12-06-h100-mma-d64-decode-ncu), and with the switch off nothing
    changes. A two-cache decode is never staged."""
    from cupy_piecewise import kvcache_launch as kl
    from cupy_piecewise.compile import ROTARY_LAYOUTS

    drv, _ = fake_gpu
    monkeypatch.delenv(capability.PATH_VAR, raising=False)
    capability.refresh_env_override()
    monkeypatch.setattr(capability, "KV90_ROT_STAGE_UNSPLIT", switch)
    monkeypatch.setattr(capability, "KV90_ROT_STAGE", False)
    H, N, D = 32, 32768, 128
    q, kv = _contiguous((B, H, 1, D)), _contiguous((B, H, N, D))
    names = (("q1", q), ("q2", q), ("o", q), ("k1", kv), ("k2", kv), ("v", kv))
    shape = kl.KVShape(0, "bfloat16", B, H, H, 1, D, N, B, 0, 0, False, True, N // 4, 0.125,
                       tuple((n, st[:3]) for n, st in names), ROTARY_LAYOUTS["half"], (1, 0))
    plan = kl.KVPlan(shape)
    main = plan._steps[0][0]
    assert main.phase == "kvdecode_sm90" and main.rot_stage == staged
    assert main.name_expression.endswith(", 1, true>" if staged else ", 1>")
    assert plan.nsplit == (1 if B == 8 else 8)
    assert kl.staged_tables(shape, plan.nsplit) == staged
    assert not kl.staged_tables(shape._replace(rotary=0, rot_groups=(0, 0)), 1)
    monkeypatch.setattr(capability, "KV90_ROT_STAGE", True)  # every rotary form staged already
    assert not kl.staged_tables(shape, 1)


def _decode_shape(D, capacity, block_size, rotary, B=2, H=8):
    """A one-token KVShape of B sequences, H heads (no GQA), contiguous or of pages of
    ``block_size`` rows, plain or rotary (halves, ReRoPE's groups)."""
    from cupy_piecewise import kvcache_launch as kl
    from cupy_piecewise.compile import ROTARY_LAYOUTS

    pages = B * capacity // block_size if block_size else B
    rows = block_size or capacity
    q, kv = _contiguous((B, H, 1, D)), _contiguous((pages, H, rows, D))
    names = (("q1", q), ("q2", q), ("o", q), ("k1", kv), ("k2", kv), ("v", kv))
    return kl.KVShape(0, "bfloat16", B, H, H, 1, D, capacity, pages, block_size,
                      capacity // block_size if block_size else 0, False, True, capacity // 4,
                      0.125, tuple((n, st[:3]) for n, st in names),
                      ROTARY_LAYOUTS["half"] if rotary else 0, (1, 0) if rotary else (0, 0))


@pytest.mark.parametrize("D,capacity,block_size,rotary,wide,wide2", [
    (64, 4096, 0, 0, True, False), (128, 4096, 0, 0, True, True), (64, 32, 0, 0, False, False),
    (64, 4096, 64, 0, True, True), (64, 4096, 128, 0, True, True),
    (64, 4096, 16, 0, False, False), (128, 4096, 48, 0, False, False),
    (128, 4096, 64, 0, True, True), (64, 4096, 64, 1, None, None), (64, 4096, 0, 1, None, None)])
def test_tile_box_decode_passes_six_maps(fake_gpu, fake_maps, monkeypatch, D, capacity,
                                         block_size, rotary, wide, wide2):
    """capability.KV90_TILE_BOX (the host mirror of -DKV90_TILE_BOX=1 or 2): the plain Hopper
    decode takes k1, k2, v's maps of 16-row boxes, then the same three of 64-row boxes where
    every 64-key tile lies in one page (kvcache_launch.kv90_tile_box: a contiguous cache of
    at least 64 rows, pages of a multiple of 64 rows; mode 2: and the head dim is 128 or the
    cache paged), else of 16-row boxes again (the kernel, deciding by the same rule, never
    reads them); the rotary forms keep three maps. Without the mirror, three maps, but for the
    plain D = 64 decode of a cache paged in multiples of 64 rows: the paged entry
    (kvcache_launch.page_box, Variant.page_box) with six, the last three of 64-row boxes."""
    from cupy_piecewise import kvcache_launch as kl

    monkeypatch.delenv(capability.PATH_VAR, raising=False)
    capability.refresh_env_override()
    shape = _decode_shape(D, capacity, block_size, rotary)
    if wide is not None:
        assert kl.kv90_tile_box(shape) == wide and kl.kv90_tile_box(shape, 2) == wide2
    # the default build sends paged D = 64 caches to the paged entry (page_box), six maps
    pages = D == 64 and not rotary and bool(block_size) and block_size % 64 == 0
    for mirror in (0, 1, 2):
        monkeypatch.setattr(capability, "KV90_TILE_BOX", mirror)
        plan = kl.KVPlan(shape)
        assert plan._maps is not None
        fake_maps.clear()
        six = not rotary and bool(mirror or pages)
        assert plan._map_sets == (2 if six else 1)
        assert plan._steps[0][0].page_box == (pages and not mirror)
        maps, _ = plan._maps.addresses((0x1000, 0x2000, 0x3000) * plan._map_sets)
        boxes = [info[4] for info in fake_maps]
        if six:
            assert maps == (0x1001, 0x2001, 0x3001) * 2
            wide_m = (pages, wide, wide2)[mirror]  # mode 0: the paged entry
            assert boxes == [16] * 3 + [64 if wide_m else 16] * 3
        else:
            assert maps == (0x1001, 0x2001, 0x3001) and boxes == [16] * 3


def test_page_box_switch(fake_gpu, fake_maps, monkeypatch):
    """capability.KV90_PAGE_BOX (default on) is what sends the paged D = 64 decode to its
    entry; off, the plain kernel with three 16-row maps runs it."""
    from cupy_piecewise import kvcache_launch as kl

    monkeypatch.delenv(capability.PATH_VAR, raising=False)
    capability.refresh_env_override()
    shape = _decode_shape(64, 4096, 64, 0)
    assert capability.KV90_PAGE_BOX and kl.page_box(shape)
    assert "pw90_kvdecode_pages<" in kl.KVPlan(shape)._steps[0][0].name_expression
    monkeypatch.setattr(capability, "KV90_PAGE_BOX", False)
    plan = kl.KVPlan(shape)
    assert not kl.page_box(shape) and plan._map_sets == 1
    assert not plan._steps[0][0].page_box


@pytest.mark.parametrize("D,capacity,block_size,rotary,cluster", [
    (128, 4096, 0, 0, 4), (128, 4096, 64, 0, 4), (128, 65536, 0, 0, 1),
    (128, 65536, 64, 0, 1), (64, 65536, 0, 0, 1), (128, 65536, 0, 1, 1)])
def test_row_box_decode_maps_take_whole_rows(fake_gpu, fake_maps, monkeypatch, D, capacity,
                                             block_size, rotary, cluster):
    """capability.KV90_ROW_BOX (the host mirror of -DKV90_ROW_BOX): the plain Hopper decode's
    k1, k2 and v maps at head dim 128 take boxes of 16 whole rows of two panels (5-d maps,
    tma.tensor_map_bhld's panels), contiguous or paged: under mode 1 always, under mode 2
    only where the plan's key splits do not merge in a cluster (mode 2, the default: 4 splits
    of a 4096-row cache do; 8 of a 65536-row one are merged apart); at head dim 64 (one
    panel), for the rotary forms, under mode 0 and in a tile-box build the maps stay 16-row
    boxes. Three maps either way."""
    from cupy_piecewise import kvcache_launch as kl

    monkeypatch.delenv(capability.PATH_VAR, raising=False)
    capability.refresh_env_override()
    shape = _decode_shape(D, capacity, block_size, rotary)
    whole = D == 128 and not rotary
    assert capability.KV90_ROW_BOX == 2  # the default
    for mirror, tile_box in ((0, 0), (1, 0), (2, 0), (2, 1), (2, 2)):
        monkeypatch.setattr(capability, "KV90_ROW_BOX", mirror)
        monkeypatch.setattr(capability, "KV90_TILE_BOX", tile_box)
        plan = kl.KVPlan(shape)
        # the kernel decides by its own CLUSTER: the variant launched is built for the
        # plan's cluster, the one the maps follow
        assert plan.cluster == cluster and plan._steps[0][0].cluster == cluster
        rows = whole and not tile_box and (mirror == 1 or (mirror == 2 and cluster == 1))
        want = (16, 2) if rows else 16
        assert kl.kv90_row_box(shape, plan.cluster) == want
        fake_maps.clear()
        maps, _ = plan._maps.addresses((0x1000, 0x2000, 0x3000) * plan._map_sets)
        assert maps[:3] == (0x1001, 0x2001, 0x3001)
        assert [info[4] for info in fake_maps][:3] == [want] * 3


def test_tensor_map_of_whole_rows_is_5d(monkeypatch):
    """tma.tensor_map_bhld(..., panels=2): dims {64, 2, rows, heads, B}, byte strides
    {128, row, head, batch}, box {64, 2, rows, 1, 1} (the TMA writes each row's two panels in
    turn); panels that do not make up D are refused."""
    from cupy_piecewise import tma

    seen = []
    monkeypatch.setattr(tma, "encode_tiled", lambda *a, **k: seen.append((a, k)) or "map")
    B, H, L, D = 3, 4, 1000, 128
    strides = (H * L * D, D, H * D, 1)  # a (B, L, H, D) cache read as (B, H, L, D)
    assert tma.tensor_map_bhld(0x10000, (B, H, L, D), strides, "bfloat16", 16, panels=2) == "map"
    (args, kw), = seen
    assert args[2] == [64, 2, L, H, B]
    assert args[3] == [128, H * D * 2, D * 2, H * L * D * 2]
    assert args[4] == [64, 2, 16, 1, 1] and kw == {"swizzle": 128}
    with pytest.raises(ValueError, match="panels"):
        tma.tensor_map_bhld(0x10000, (B, H, L, 192), (H * L * 192, 192, H * 192, 1),
                            "bfloat16", 16, panels=2)


def test_rot_stage_names_only_rotary_forms():
    """Variant.rot_stage adds the kernel's TAB = true to a rotary form's name; a two-cache
    form has no tables to stage."""
    from cupy_piecewise.compile import Variant

    tiles = capability.kv90_tiles(64)
    v = Variant("kvdecode_sm90", "float16", 64, tiles, False, cluster=1, rotary=2, rot_stage=True)
    assert v.name_expression == f"pw90_kvdecode_rot<half_t, 64, {tiles.stages}, 1, 4, 2, true>"
    with pytest.raises(ValueError, match="rot_stage"):
        Variant("kvdecode_sm90", "float16", 64, tiles, False, rot_stage=True).name_expression
