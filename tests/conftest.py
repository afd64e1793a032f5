"""Shared pytest set-up.

Tests marked ``gpu`` need a CUDA GPU visible to CuPy; where there is none they
are skipped with the reason "no CUDA GPU visible to CuPy", never passed silently.

``PW_TEST_MACROS`` (space-separated ``NAME=VALUE``) compiles every kernel of the run with
those -D options, so an A/B build of kernels_cu/ (bench/NOTES.md) can go through the whole
suite before it becomes the default, e.g.::

    PW_TEST_MACROS="PW_FIT_HEADROOM=0" python3 -m pytest -m gpu tests/test_kernels_gpu.py

The macros are named in the run's header line.
"""

from __future__ import annotations

import functools

import pytest

from sm90_build import require_nvrtc


@pytest.fixture(scope="session")
def nvrtc():
    """CuPy's NVRTC bindings (skips the test when NVRTC cannot be loaded)."""
    return require_nvrtc()

NO_GPU_REASON = "no CUDA GPU visible to CuPy"
_applied: tuple[str, ...] = ()


def pytest_configure(config):
    # NVRTC options are read at each compile (compile.Variant.options, arch_options), so
    # extending the base set here reaches every kernel the run builds; the host mirrors
    # (e.g. PW_FWD_Q_ROTATE=0's shared-memory size) and MACRO_TABLE's staged tiles
    # follow the macros.
    global _applied
    from cupy_piecewise import compile as comp

    _applied = comp.apply_test_macros()


def pytest_report_header(config):
    return f"PW_TEST_MACROS: {' '.join(_applied) or '(none: the default kernels)'}"


@functools.lru_cache(maxsize=None)
def gpu_count() -> int:
    """Number of CUDA devices CuPy sees (0 when CuPy or the driver is missing)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and gpu_count() == 0:
        skip = pytest.mark.skip(reason=NO_GPU_REASON)
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _tile_override_follows_the_environment():
    """capability reads CUPY_PIECEWISE_TILES once; re-read it after each test so that a
    monkeypatched environment, restored at teardown, leaves no override behind."""
    yield
    from cupy_piecewise import capability

    capability.refresh_env_override()
