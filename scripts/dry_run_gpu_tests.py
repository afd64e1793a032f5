"""Dry-run GPU tests on a machine without a GPU: NumPy stands in for CuPy.

    python3 scripts/dry_run_gpu_tests.py tests/test_kvcache_rotary_gpu.py -k "matches_reference"

A module named ``cupy`` built on NumPy (asarray, asnumpy, full, zeros, the dtypes, a no-op
``cuda.Device`` and a device count of one) is installed before pytest starts, so the
``gpu``-marked tests are collected instead of skipped, and every array they build is a
NumPy array. The package's calls then take the NumPy path: the float64 reference. So a
dry run checks the tests' own code (shapes, paging, yardsticks, tolerance calls, the
arguments they pass), never a kernel: the results equal the reference by construction.
Tests that need CuPy itself (raw pointers, views of device memory, NaN-poisoned CuPy
outputs, torch CUDA tensors, the NotImplementedError of a gated GPU path) fail or error
here; pass ``-k`` to leave them out. Used to check GPU tests written in a session that had
no device before the next device call runs them.
"""
import contextlib
import sys
import types

import numpy as np


def install_numpy_cupy() -> types.ModuleType:
    """Register the NumPy stand-in as ``cupy`` in ``sys.modules`` and return it."""
    shim = types.ModuleType("cupy")
    shim.asarray = lambda x, dtype=None: np.array(x, dtype=dtype)
    shim.asnumpy = np.asarray
    shim.float16, shim.float32, shim.int32, shim.uint16 = np.float16, np.float32, np.int32, np.uint16
    shim.full, shim.zeros, shim.ones = np.full, np.zeros, np.ones
    shim.cuda = types.SimpleNamespace(
        Device=lambda index=0: contextlib.nullcontext(),
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1))
    sys.modules["cupy"] = shim
    return shim


def main(argv=None) -> int:
    install_numpy_cupy()
    import pytest

    args = list(sys.argv[1:] if argv is None else argv)
    return pytest.main(["-q", "-p", "no:cacheprovider", "-m", "gpu"] + args)


if __name__ == "__main__":
    sys.exit(main())
