"""Where the CUDA C++ sources (``*.cu``, ``*.cuh``) are.

In an installed wheel they ship as ``cupy_piecewise/kernels_cu/`` (pyproject.toml
maps the repository's top-level ``kernels_cu/`` there). In a checkout used
without installing (``PYTHONPATH=$PWD``) they are the repository's top-level
``kernels_cu/``, next to this package's folder.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["kernel_dir", "kernel_files"]

_PACKAGE = Path(__file__).resolve().parent
_SUFFIXES = (".cu", ".cuh")


def kernel_dir() -> Path:
    """Folder holding the kernel sources: the installed copy if there is one,
    else the checkout's ``kernels_cu/``.

    Raises:
        FileNotFoundError: neither folder exists (a broken install).
    """
    installed = _PACKAGE / "kernels_cu"
    if installed.is_dir():
        return installed
    checkout = _PACKAGE.parent / "kernels_cu"
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(
        f"CUDA kernel sources not found: neither {installed} nor {checkout} exists; "
        "reinstall cupy-piecewise (the wheel ships cupy_piecewise/kernels_cu/)"
    )


def kernel_files() -> list[Path]:
    """The ``*.cu`` and ``*.cuh`` files of :func:`kernel_dir` and its subfolders (``sm90/``),
    sorted by path."""
    root = kernel_dir()
    return sorted((p for p in root.rglob("*") if p.suffix in _SUFFIXES and p.is_file()),
                  key=lambda p: p.relative_to(root).as_posix())
