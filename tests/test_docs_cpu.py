"""The examples of docs/semantics.md, run as doctests on NumPy arrays (the float64
reference path: no GPU, well under a second)."""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest

SEMANTICS = Path(__file__).resolve().parents[1] / "docs" / "semantics.md"


def test_semantics_examples_pass():
    pytest.importorskip("numpy")
    result = doctest.testfile(
        str(SEMANTICS),
        module_relative=False,
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
        verbose=False,
        report=True,
    )
    assert result.attempted > 20, f"too few examples found in {SEMANTICS}: {result}"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {SEMANTICS.name} failed (see the output above)"


def test_semantics_sections_cited_in_code_exist():
    """Comments cite docs/semantics.md by section name; each named section must exist."""
    text = SEMANTICS.read_text()
    headings = {line.lstrip("#").strip() for line in text.splitlines() if line.startswith("## ")}
    for name in ("The function", "Alignment: P = N - M", "Which projection scores a pair",
                 "Causal masking", "Empty rows and empty inputs", "Grouped-query attention",
                 "Backward", "Types, shapes and strides", "Tolerance", "Bad input",
                 "FLOP convention", "Extended semantics (planned)"):
        assert name in headings, f"section {name!r} missing from {SEMANTICS.name}"


def test_kvcache_examples_pass():
    """docs/kvcache.md's NumPy decode loop runs and prints what it says."""
    path = SEMANTICS.parent / "kvcache.md"
    result = doctest.testfile(str(path), module_relative=False,
                              optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
                              verbose=False, report=True)
    assert result.attempted >= 10, f"too few examples found in {path}: {result}"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {path.name} failed"


def test_rerope_example_runs_its_checks_on_the_cpu():
    """examples/rerope_attention.py asserts its own results (plain rotary attention for
    w > L, the clipped definition, a raw-key rotary decode equal to the layer); its CPU
    half runs here in a few seconds."""
    pytest.importorskip("torch")
    import runpy

    path = SEMANTICS.parents[1] / "examples" / "rerope_attention.py"
    example = runpy.run_path(str(path))  # defines, does not run main()
    torch = pytest.importorskip("torch")
    example["check"]("cpu", torch.float64, 1e-10)
    example["check"]("cpu", torch.float32, 1e-5)


def test_readme_numpy_api_block_prints_its_comment():
    """README's first code block (## API, NumPy arrays) runs as written and prints what
    its trailing comment says."""
    import contextlib
    import io
    import re

    readme = SEMANTICS.parents[1] / "README.md"
    text = readme.read_text()
    api = text[text.index("\n## API\n"):]
    block = re.search(r"```python\n(.*?)```", api, re.S).group(1)
    expected = re.search(r"print\(.*\)\s+#\s*(.+)", block).group(1).strip()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "README.md (## API)", "exec"), {})
    assert out.getvalue().strip() == expected
