"""The CUDA driver entry points the package calls through ctypes, loaded in one place:
``cuTensorMapEncodeTiled`` (:mod:`.tma`, when cuda-bindings is absent) and
``cuLaunchKernelEx`` (:func:`launch_programmatic`: a launch that may overlap the kernel
before it on the stream, programmatic dependent launch, compute capability 9.0 and later).

Nothing here runs at import; ``libcuda.so.1`` is opened on first use.
"""
from __future__ import annotations

import ctypes
import threading

__all__ = ["libcuda", "launch_programmatic", "programmatic_available", "LaunchAttribute",
           "LaunchConfig", "ATTR_PROGRAMMATIC_STREAM_SERIALIZATION"]

#: CUlaunchAttributeID of cuda.h: the launch may begin before the previous kernel on the
#: stream completes, once that kernel's blocks have all triggered (griddepcontrol)
ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id, 4 bytes of padding, a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_ubyte * 64)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` of cuda.h (CUDA 12.0 and later)."""

    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_lib = None
_lock = threading.Lock()


def libcuda() -> ctypes.CDLL:
    """The CUDA driver library (``libcuda.so.1``), opened once, with the argument types of
    the entry points this package calls set (``cuLaunchKernelEx`` where the driver has it:
    :func:`programmatic_available`). Raises OSError where there is no driver."""
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                lib = ctypes.CDLL("libcuda.so.1")
                f = lib.cuTensorMapEncodeTiled
                f.restype = ctypes.c_int
                f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                              ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                              ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                              ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
                f = getattr(lib, "cuLaunchKernelEx", None)  # CUDA 12.0 and later
                if f is not None:
                    f.restype = ctypes.c_int
                    f.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                  ctypes.c_void_p, ctypes.c_void_p]
                _lib = lib
    return _lib


def programmatic_available() -> bool:
    """True when the driver has ``cuLaunchKernelEx`` (CUDA 12.0 and later): launches asked
    to be programmatic are plain launches otherwise (the kernels' waits then return at
    once)."""
    try:
        return getattr(libcuda(), "cuLaunchKernelEx", None) is not None
    except OSError:
        return False


def programmatic_config(grid, threads: int, smem: int, stream: int) -> LaunchConfig:
    """A ``CUlaunchConfig`` of ``grid`` (x, y, z), ``threads`` per block, ``smem`` dynamic
    shared bytes and ``stream`` carrying the programmatic-stream-serialization attribute. The
    attribute array lives on the returned object (``_attr``)."""
    attr = LaunchAttribute()
    attr.id = ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value[0] = 1  # programmaticStreamSerializationAllowed (an int, little-endian)
    cfg = LaunchConfig(*grid, threads, 1, 1, smem, stream or None, ctypes.pointer(attr), 1)
    cfg._attr = attr  # keep it alive with the config
    return cfg


def launch_programmatic(fn: int, grid, threads: int, smem: int, stream: int, args: int) -> None:
    """``cuLaunchKernelEx`` of the CUfunction ``fn`` on ``grid`` (x, y, z) blocks of
    ``threads`` with ``smem`` dynamic shared bytes on ``stream``, kernel arguments at the
    address ``args`` (a ``void*`` array), allowed to start before the kernel ahead of it on
    the stream completes (the kernel must call grid_dependency_wait before reading that
    one's output; kernels_cu/common.cuh). The config is built per call, so concurrent
    launches from several threads share nothing. The calling thread must have the
    function's context current. Raises RuntimeError with the CUresult on failure."""
    cfg = programmatic_config(grid, threads, smem, stream)
    rc = libcuda().cuLaunchKernelEx(ctypes.byref(cfg), fn, args, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed: CUresult {rc}")
