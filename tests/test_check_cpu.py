"""``python -m cupy_piecewise check`` on the CPU path: it passes on correct results, prints
the summary line, and fails (non-zero exit) when the back end returns a wrong result."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from cupy_piecewise import check
from cupy_piecewise.adapters import numpy as numpy_adapter

SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed$", re.M)


@pytest.fixture
def cpu_only(monkeypatch):
    # The NumPy path, even on a machine with a GPU: these tests judge check.py itself.
    monkeypatch.setattr(check, "gpu_available", lambda: False)


def test_quick_passes_and_prints_summary(cpu_only, capsys):
    assert check.main(["--quick"]) == 0
    out = capsys.readouterr().out
    m = SUMMARY.search(out)
    assert m, out
    assert (int(m.group(1)), int(m.group(2))) == (3, 0)
    assert "backend numpy" in out
    assert out.rstrip().splitlines()[-1] == "3 passed, 0 failed"


def test_wrong_forward_result_fails(cpu_only, monkeypatch, capsys):
    real = numpy_adapter.attention

    def off_by_a_bit(*args, **kw):
        o, lse = real(*args, **kw)
        return o * np.float32(1.01), lse

    monkeypatch.setattr(numpy_adapter, "attention", off_by_a_bit)
    assert check.main(["--quick", "--seed", "7"]) != 0
    out = capsys.readouterr().out
    assert SUMMARY.search(out).group(2) != "0"
    assert "FAIL o:" in out


def test_wrong_gradient_fails(cpu_only, monkeypatch, capsys):
    real = numpy_adapter.attention_backward

    def swapped(*args, **kw):
        dq1, dk1, dq2, dk2, dv = real(*args, **kw)
        return dq1, dk1, dq2, dk2, -dv

    monkeypatch.setattr(numpy_adapter, "attention_backward", swapped)
    assert check.main(["--quick", "--seed", "7"]) == 1
    assert "FAIL dv:" in capsys.readouterr().out


def test_backend_crash_is_a_failed_case(cpu_only, monkeypatch, capsys):
    def boom(*a, **k):
        raise RuntimeError("kernel fell over")

    monkeypatch.setitem(check._BACKENDS, "numpy", boom)
    assert check.main(["--quick"]) == 1
    assert "RuntimeError: kernel fell over" in capsys.readouterr().out


def test_json_and_seed_reproducible(cpu_only, tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert check.main(["--quick", "--seed", "123", "--json", str(a)]) == 0
    assert check.main(["--quick", "--seed", "123", "--json", str(b)]) == 0
    ra, rb = json.loads(a.read_text()), json.loads(b.read_text())
    assert ra["seed"] == 123 and ra["backend"] == "numpy"
    assert (ra["passed"], ra["failed"]) == (3, 0)
    assert [c["case"] for c in ra["cases"]] == [c["case"] for c in rb["cases"]]
    assert [c["max_err"] for c in ra["cases"]] == [c["max_err"] for c in rb["cases"]]


@pytest.mark.parametrize("backend", ["numpy", "cuda"])
def test_cases_cover_the_axes(backend):
    cases = check.make_cases(np.random.default_rng(0), backend)
    assert len(cases) == 12
    assert {c.causal for c in cases} == {False, True}
    assert {c.H // c.Hkv for c in cases} == {1, 2, 4}
    assert {(c.M > c.N) - (c.M < c.N) for c in cases} == {-1, 0, 1}
    regimes = set()
    for c in cases:
        lo, hi = 1 - c.M, c.N - 1  # range of distances d = i + N - M - j
        regimes.add((c.causal, "below" if c.w <= lo else "beyond" if c.w > hi else "inside"))
        assert c.H % c.Hkv == 0
    # every w regime, with and without causal masking
    assert regimes == {(causal, r) for causal in (False, True) for r in ("below", "inside", "beyond")}
    if backend == "cuda":
        assert {c.D for c in cases} == {64, 128}
        assert {c.dtype for c in cases} == {"float16", "bfloat16", "float32"}  # float32: TF32
        assert all(c.N > 1 for c in cases if c.dtype == "float32")  # one-key rows: semantics.md
        assert {c.transposed for c in cases} == {False, True}
        quick = cases[:3]
        assert {c.dtype for c in quick} == {"float16", "bfloat16"} and {c.D for c in quick} == {64, 128}
    else:
        assert {c.dtype for c in cases} == {"float32"}
        assert max(max(c.M, c.N) for c in cases) <= 256


def test_main_module_dispatches_check(cpu_only, capsys):
    from cupy_piecewise.__main__ import main

    assert main(["check", "--quick", "--seed", "1"]) == 0
    assert SUMMARY.search(capsys.readouterr().out)
