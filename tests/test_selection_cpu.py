"""Exact selection (tests/selection.py) through the CPU paths, and proof that the check
catches a boundary moved by one."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import cupy_piecewise

sys.path.insert(0, os.path.dirname(__file__))
import selection  # noqa: E402


@pytest.mark.parametrize("pair", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("M,N", [(37, 53), (53, 37), (40, 40)])
def test_reference_selects_exactly(M, N, causal, pair):
    D = 64
    ins = [x.astype(np.float64) for x in selection.inputs(1, 2, M, N, D, pair)]
    for w in range(-M - 1, N + 2):
        o = cupy_piecewise.attention(*ins, w, causal=causal, sm_scale=0.5)
        selection.check(o, M, N, D, w, causal, pair, "numpy")


def test_torch_cpu_selects_exactly():
    torch = pytest.importorskip("torch")
    M, N, D = 45, 61, 64
    for pair in (1, 2):
        ins = [torch.from_numpy(x).to(torch.bfloat16) for x in selection.inputs(1, 2, M, N, D, pair)]
        for w in (-3, 0, 1, 17, 44, 60, 61):
            o = cupy_piecewise.attention(*ins, w, causal=True, sm_scale=0.5)
            selection.check(o.float().numpy(), M, N, D, w, True, pair, "torch cpu")


@pytest.mark.parametrize("shift", [-1, 1])
def test_check_catches_a_boundary_off_by_one(shift):
    """The mutation test, on the reference: an implementation that moves the boundary by
    one (computing with w + shift) must fail the check for some w."""
    M, N, D = 40, 50, 64
    ins = [x.astype(np.float64) for x in selection.inputs(1, 1, M, N, D, 2)]
    failures = 0
    for w in range(-5, 55):
        o = cupy_piecewise.attention(*ins, w + shift, sm_scale=0.5)
        try:
            selection.check(o, M, N, D, w, False, 2)
        except AssertionError:
            failures += 1
    assert failures >= 50  # every w whose boundary falls inside the matrix
