"""Tensor maps (``CUtensorMap``) for the Hopper kernels' TMA loads (``cp.async.bulk.tensor``).

A tensor map is a 128-byte opaque descriptor that the driver encodes on the host
(``cuTensorMapEncodeTiled``) and the kernel receives by value as a
``const __grid_constant__`` parameter (``pw90::TmaDesc`` in ``kernels_cu/sm90/hopper.cuh``:
128 bytes, 64-byte aligned). Encoding needs the CUDA driver (``libcuda``) but no context,
no device memory access and no GPU work; the address is only recorded.

Two ways to reach the driver, tried in order:

1. ``cuda.bindings.driver.cuTensorMapEncodeTiled`` (package ``cuda-bindings``);
2. ``ctypes`` on ``libcuda.so.1``'s ``cuTensorMapEncodeTiled`` (output buffer 64-byte aligned).

The attention tensors are ``(B, heads, rows, D)`` views with unit stride along ``D`` and any
other strides (e.g. ``(B, L, H, D)`` memory read as ``(B, H, L, D)``). Each is described as a
4-D map ``{D, rows, heads, B}`` (innermost first) with byte strides ``{row, head, batch}``
and a box of ``{64, box_rows, 1, 1}``: with the 128-byte swizzle the box's inner extent is
at most 128 bytes (64 16-bit elements), so a kernel loads a ``D = 128`` tile as two boxes
(coordinates 0 and 64 along ``D``). Rows past the end of the tensor read as zeros.
"""
from __future__ import annotations

import ctypes
import struct

__all__ = ["TMA_BYTES", "TensorMap", "encode_tiled", "tensor_map_bhld", "driver_backend"]

#: size of a CUtensorMap in bytes
TMA_BYTES = 128

# CUtensorMapDataType values (cuda.h)
_DTYPE = {"float16": 6, "bfloat16": 9, "float32": 7}
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
# CUtensorMapSwizzle values by swizzle span in bytes (0 = none)
_SWIZZLE = {0: 0, 32: 1, 64: 2, 128: 3}
_L2_PROMOTION_128B = 2
_INTERLEAVE_NONE = 0
_OOB_FILL_NONE = 0  # out-of-bounds elements read as zero


class TensorMap:
    """An encoded ``CUtensorMap``: ``data`` holds its 128 bytes.

    ``address()`` gives the address of a 64-byte aligned host copy (kept alive by this
    object), suitable as one entry of ``cuLaunchKernel``'s ``kernelParams`` array: the driver
    copies the 128 bytes into the parameter at the kernel's own offset and alignment.
    ``as_numpy()`` gives a NumPy structured scalar of the same bytes (itemsize 128) for
    launchers that take NumPy scalars as by-value arguments.
    """

    __slots__ = ("data", "_buf")

    def __init__(self, data: bytes):
        if len(data) != TMA_BYTES:
            raise ValueError(f"data: expected {TMA_BYTES} bytes, got {len(data)}")
        self.data = bytes(data)
        self._buf = None

    def address(self) -> int:
        if self._buf is None:
            raw = ctypes.create_string_buffer(TMA_BYTES + 64)
            addr = (ctypes.addressof(raw) + 63) & ~63
            ctypes.memmove(addr, self.data, TMA_BYTES)
            self._buf = (raw, addr)
        return self._buf[1]

    def as_numpy(self):
        import numpy as np

        dt = np.dtype({"names": ["opaque"], "formats": [("<u8", (16,))], "itemsize": TMA_BYTES})
        return np.frombuffer(self.data, dtype=dt)[0]

    def __repr__(self) -> str:
        return f"TensorMap({self.data[:16].hex()}...)"


def _encode_bindings(dtype_code, rank, addr, dims, strides, box, estr, swizzle):
    from cuda.bindings import driver as cu

    err, tmap = cu.cuTensorMapEncodeTiled(
        cu.CUtensorMapDataType(dtype_code), rank, addr,
        [cu.cuuint64_t(d) for d in dims], [cu.cuuint64_t(s) for s in strides],
        [cu.cuuint32_t(b) for b in box], [cu.cuuint32_t(e) for e in estr],
        cu.CUtensorMapInterleave(_INTERLEAVE_NONE), cu.CUtensorMapSwizzle(swizzle),
        cu.CUtensorMapL2promotion(_L2_PROMOTION_128B), cu.CUtensorMapFloatOOBfill(_OOB_FILL_NONE))
    if int(err) != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed: {err!r} (dims {dims}, byte strides "
                           f"{strides}, box {box}, address {addr:#x})")
    return struct.pack("<16Q", *[int(x) for x in tmap.opaque])


def _encode_ctypes(dtype_code, rank, addr, dims, strides, box, estr, swizzle):
    from .cuda_driver import libcuda

    raw = ctypes.create_string_buffer(TMA_BYTES + 64)
    out = (ctypes.addressof(raw) + 63) & ~63
    u64 = ctypes.c_uint64 * rank
    u32 = ctypes.c_uint32 * rank
    rc = libcuda().cuTensorMapEncodeTiled(
        out, dtype_code, rank, addr, u64(*dims), (ctypes.c_uint64 * max(1, rank - 1))(*strides),
        u32(*box), u32(*estr), _INTERLEAVE_NONE, swizzle, _L2_PROMOTION_128B, _OOB_FILL_NONE)
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed: CUresult {rc} (dims {dims}, byte "
                           f"strides {strides}, box {box}, address {addr:#x})")
    return ctypes.string_at(out, TMA_BYTES)


def driver_backend() -> str:
    """'cuda-bindings' or 'ctypes': which route :func:`encode_tiled` takes on this machine."""
    try:
        from cuda.bindings import driver  # noqa: F401

        return "cuda-bindings"
    except ImportError:
        return "ctypes"


def encode_tiled(address: int, dtype: str, dims, byte_strides, box, *, swizzle: int = 128) -> TensorMap:
    """Encode a tiled tensor map.

    Args:
        address: device address of element 0, 16-byte aligned.
        dtype: 'float16', 'bfloat16' or 'float32'.
        dims: extents, innermost first (rank 1..5), each in [1, 2**32].
        byte_strides: strides in bytes of dims[1:], each a multiple of 16 below 2**40.
        box: box extents, each in [1, 256]; box[0] * itemsize a multiple of 16 and at most
            ``swizzle`` bytes when swizzled.
        swizzle: 0, 32, 64 or 128 (bytes).

    Returns a :class:`TensorMap`. Raises ValueError for arguments that break these rules
    (checked here, so the message names the argument) and RuntimeError when the driver
    refuses the encoding or cannot be loaded.
    """
    if dtype not in _DTYPE:
        raise ValueError(f"dtype: expected one of {sorted(_DTYPE)}, got {dtype!r}")
    if swizzle not in _SWIZZLE:
        raise ValueError(f"swizzle: expected 0, 32, 64 or 128, got {swizzle!r}")
    dims, byte_strides, box = [int(d) for d in dims], [int(s) for s in byte_strides], [int(b) for b in box]
    rank = len(dims)
    if not 1 <= rank <= 5 or len(box) != rank or len(byte_strides) != rank - 1:
        raise ValueError(f"dims/box/byte_strides: rank 1..5 with len(byte_strides) = rank - 1, got "
                         f"dims {dims}, box {box}, byte_strides {byte_strides}")
    if address % 16:
        raise ValueError(f"address: must be 16-byte aligned, got {address:#x}")
    for d in dims:
        if not 1 <= d <= 2**32:
            raise ValueError(f"dims: each in [1, 2**32], got {dims}")
    for s in byte_strides:
        if s % 16 or not 0 < s < 2**40:
            raise ValueError(f"byte_strides: each a positive multiple of 16 below 2**40, got {byte_strides}")
    item = _ITEMSIZE[dtype]
    for b in box:
        if not 1 <= b <= 256:
            raise ValueError(f"box: each in [1, 256], got {box}")
    if (box[0] * item) % 16 or (swizzle and box[0] * item > swizzle):
        raise ValueError(f"box[0]: {box[0]} elements of {item} bytes must be a multiple of 16 bytes"
                         f" and at most the swizzle span ({swizzle} bytes)")
    estr = [1] * rank
    args = (_DTYPE[dtype], rank, int(address), dims, byte_strides, box, estr, _SWIZZLE[swizzle])
    try:
        data = _encode_bindings(*args)
    except ImportError:
        data = _encode_ctypes(*args)
    return TensorMap(data)


def tensor_map_bhld(address: int, shape, strides, dtype: str, box_rows: int, *,
                    box_cols: int = 64, swizzle: int = 128, panels: int = 1) -> TensorMap:
    """Tensor map of a ``(B, heads, rows, D)`` view for tiles of ``box_rows x box_cols``.

    Args:
        address: device address of element [0, 0, 0, 0], 16-byte aligned.
        shape: ``(B, heads, rows, D)``, every extent >= 1 (the caller skips empty launches).
        strides: element strides of the four axes; ``strides[3]`` must be 1 (a view whose last
            axis is not unit-stride must be copied first); the others, for axes longer than 1,
            must be positive with ``stride * itemsize`` a multiple of 16 bytes. Axes of
            length 1 may have any stride (a valid placeholder is substituted).
        dtype: 'float16' or 'bfloat16'.
        box_rows: rows per box (<= 256); box_cols: elements along D per box (64 with the
            128-byte swizzle; D = 128 tiles are loaded as two boxes).
        panels: with ``panels > 1`` (``D == panels * box_cols``) a 5-D map
            ``{box_cols, panels, rows, heads, B}`` whose box ``{box_cols, panels, box_rows,
            1, 1}`` takes whole rows, written to shared memory row by row, each row's panels
            in order (the Hopper decode's KV90_ROW_BOX); coordinates ``{0, 0, row, head,
            batch}``.

    Returns a 4-D :class:`TensorMap` with dims ``{D, rows, heads, B}`` (5-D with
    ``panels > 1``): the kernel's coordinates are ``{d0, row, head, batch}``. Raises
    ValueError for a shape or stride the TMA cannot describe.
    """
    B, Hh, L, D = (int(x) for x in shape)
    sb, sh, sr, sd = (int(x) for x in strides)
    if dtype not in ("float16", "bfloat16"):
        raise ValueError(f"dtype: expected 'float16' or 'bfloat16', got {dtype!r}")
    if min(B, Hh, L, D) < 1:
        raise ValueError(f"shape: every extent must be >= 1, got {tuple(shape)}")
    if D > 1 and sd != 1:
        raise ValueError(f"strides: the last axis must be unit-stride, got {tuple(strides)}")
    item = _ITEMSIZE[dtype]
    # byte strides of rows, heads, batch; length-1 axes get a harmless placeholder
    out = []
    prev = D * item
    for n, s, name in ((L, sr, "row"), (Hh, sh, "head"), (B, sb, "batch")):
        if n == 1:
            s_bytes = ((prev + 15) // 16) * 16
        else:
            s_bytes = s * item
            if s <= 0 or s_bytes % 16:
                raise ValueError(f"strides: {name} stride {s} elements ({s_bytes} bytes) must be "
                                 f"positive and a multiple of 16 bytes")
        out.append(s_bytes)
        prev = s_bytes * n
    if panels > 1:
        if D != panels * box_cols:
            raise ValueError(f"panels: {panels} panels of {box_cols} columns must make D = {D}")
        return encode_tiled(address, dtype, [box_cols, panels, L, Hh, B],
                            [box_cols * item] + out, [box_cols, panels, box_rows, 1, 1],
                            swizzle=swizzle)
    return encode_tiled(address, dtype, [D, L, Hh, B], out, [box_cols, box_rows, 1, 1],
                        swizzle=swizzle)
