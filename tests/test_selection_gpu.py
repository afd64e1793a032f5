"""Exact selection (tests/selection.py) on the CUDA kernels: every tile position of the
d = w boundary, both pairs, causal and not, on the mma.sync kernels and on the Hopper
forward (CUPY_PIECEWISE_PATH). Marked ``gpu``."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import selection  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(params=["mma", "hopper"])
def kernel_path(request, monkeypatch):
    from cupy_piecewise import capability

    monkeypatch.setenv(capability.PATH_VAR, request.param)
    capability.refresh_env_override()
    return request.param


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("D", [64, 128])
def test_exact_selection_every_boundary_position(kernel_path, D, dtype):
    import cupy

    import cupy_piecewise
    from cupy_piecewise.gpu_arrays import to_device

    M, N = 300, 290  # three Hopper query tiles, several key tiles of every size we use
    ws = range(-2, 140) if dtype == "bfloat16" else range(-2, 140, 7)
    for pair in (1, 2):
        ins = [to_device(x, dtype) for x in selection.inputs(1, 2, M, N, D, pair)]
        for causal in (False, True):
            for w in list(ws) + [N - 1, N, N + 1, -M + 1, -M]:
                o = cupy_piecewise.attention(*ins, w, causal=causal, sm_scale=0.5)
                selection.check(cupy.asnumpy(o).astype(np.float64), M, N, D, w, causal, pair,
                                f"{kernel_path} {dtype} D={D}")
