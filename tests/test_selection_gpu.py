"""Exact selection (tests/selection.py) on the CUDA kernels: every tile position of the
d = w boundary, both pairs, causal and not, on the mma.sync kernels and on the Hopper
forward (CUPY_PIECEWISE_PATH). Marked ``gpu``."""
from __future__ import annotations

import ast
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


#: The kernels' per-element choice of projection (d >= w takes pair 2), as written in each
#: path's source, and the mutation that moves the boundary by one key (d >= w + 1).
# path -> (file, [(text, replacement), ...]): every place the path's forward decides the pair.
# The mma.sync forward has two: score_tile's per-element test (merged straddling tiles) and
# pair_window's bounds (the causal forward's one-visit-per-pair body, forward.cu VisitPairs).
MUTATIONS = {"mma": ("common.cuh", [(">= g.w", ">= g.w + 1"),
                                    ("const int w = g.w;", "const int w = g.w + 1;")]),
             "hopper": ("sm90/forward.cu", [("- e >= w)", "- e >= w + 1)")])}

_MUTANT = r"""
import sys
import numpy as np
sys.path.insert(0, {tests!r})
import selection
import cupy
import cupy_piecewise
from cupy_piecewise import compile as kc
from cupy_piecewise.gpu_arrays import to_device

_, edits = {mutation!r}
original = kc.source
hits = [0] * len(edits)  # matches per edit, over every source built
def mutated(filename):
    text = original(filename)
    for i, (old, new) in enumerate(edits):
        hits[i] += text.count(old)
        text = text.replace(old, new)
    return text
kc.source = mutated  # before any kernel is built in this process

M, N, D = 300, 290, 64
passed = []
tried = 0
for pair in (1, 2):
    ins = [to_device(x, "bfloat16") for x in selection.inputs(1, 2, M, N, D, pair)]
    for causal in (False, True):
        for w in (-1, 0, 1, 37, 64, 100, 129):
            o = cupy_piecewise.attention(*ins, w, causal=causal, sm_scale=0.5)
            tried += 1
            try:
                selection.check(cupy.asnumpy(o).astype(np.float64), M, N, D, w, causal, pair)
                passed.append((pair, causal, w))
            except AssertionError:
                pass
print("MUTANT", min(hits), tried, passed)
"""


@pytest.mark.parametrize("path", sorted(MUTATIONS))
def test_exact_selection_catches_a_kernel_boundary_off_by_one(path):
    """Mutation test: rebuild the forward kernels of ``path`` with the boundary moved by one
    (``d >= w + 1``) in a fresh process (its own kernel caches) and run the exact-selection
    check: every case whose boundary falls inside the keys must fail it."""
    import subprocess

    env = dict(os.environ, CUPY_PIECEWISE_PATH=path,
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                           os.environ.get("PYTHONPATH", "")]))
    code = _MUTANT.format(tests=os.path.dirname(__file__), mutation=MUTATIONS[path])
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    hits, tried, passed = run.stdout.split("MUTANT ")[-1].split(" ", 2)
    assert int(hits) >= 1, f"an edit of the mutation {MUTATIONS[path]} matched nothing in the source"
    # d = i - 10 - j spans [-299, 289], so for every listed w some row has an admissible key
    # at d = w, which the mutant gives to the other pair; except under causal with w = -1
    # (d = -1 is masked), and, on the Hopper path, w = 0: with causal and w <= 0 every
    # admissible key has d >= w, so its tile classification sends every tile to pair 2
    # alone and the per-element choice the mutant changed never runs.
    allowed = {(pair, True, w) for pair in (1, 2) for w in ((-1, 0) if path == "hopper" else (-1,))}
    passed = set(ast.literal_eval(passed.strip()))
    assert passed <= allowed, (f"{path}: the off-by-one kernel passed the exact-selection check "
                               f"in {sorted(passed - allowed)} (pair, causal, w) of {tried} cases")
