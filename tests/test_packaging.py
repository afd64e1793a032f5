"""Packaging: the wheel carries the CUDA sources and a non-editable install finds
them from any folder. Builds a wheel, installs it into a fresh venv and imports
it from a temporary folder. Takes some seconds (marked ``slow``; runs in CI)."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNEL_SUFFIXES = (".cu", ".cuh")

pytestmark = pytest.mark.slow


def _kernel_names(root: Path = ROOT) -> list[str]:
    folder = root / "kernels_cu"
    if not folder.is_dir():
        return []
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and p.suffix in KERNEL_SUFFIXES)


def _run(cmd, **kwargs):
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise AssertionError(
            f"command failed ({result.returncode}): {' '.join(map(str, cmd))}\n"
            f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"
        )
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, list[str]]:
    """-> (the wheel, the kernel file names it was built from)."""
    names = _kernel_names()
    if not any(n.endswith(".cu") for n in names):
        print("kernels_cu/ holds no .cu files yet: nothing to check in the wheel")
        pytest.skip("kernels_cu/ holds no .cu files yet")
    # Build from a copy so the checkout gets no build/ or *.egg-info folders.
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("cupy_piecewise", "kernels_cu"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    out = tmp_path_factory.mktemp("wheelhouse")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(src)])
    wheels = list(out.glob("cupy_piecewise-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0], _kernel_names(src)


def test_wheel_contains_kernel_sources(wheel):
    wheel, names = wheel
    assert names
    with zipfile.ZipFile(wheel) as zf:
        members = set(zf.namelist())
    for name in names:
        assert f"cupy_piecewise/kernels_cu/{name}" in members, f"{name} missing from {wheel.name}"
    assert "cupy_piecewise/__init__.py" in members
    assert "cupy_piecewise/kernel_sources.py" in members
    assert not any(m.startswith(("tests/", "bench/", "kernels_cu/")) for m in members), sorted(members)


def test_installed_wheel_finds_kernels_from_another_folder(wheel, tmp_path):
    wheel, names = wheel
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)])
    py = venv / "bin" / "python"
    _run([str(py), "-m", "pip", "install", "--no-deps", "--force-reinstall", "--quiet", str(wheel)])
    # The new venv's "system" packages are the base interpreter's, not this venv's:
    # point it at this interpreter's site-packages for NumPy. Written after the
    # install (pip must not see an outer cupy_piecewise as "already satisfied");
    # .pth entries come after the venv's own site-packages on sys.path.
    purelib = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()}
    (Path(purelib) / "_outer_site.pth").write_text("\n".join(sorted(ours)) + "\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = (
        "import cupy_piecewise, json\n"
        "from cupy_piecewise.kernel_sources import kernel_dir, kernel_files\n"
        "print(json.dumps({'package': cupy_piecewise.__file__, 'dir': str(kernel_dir()),\n"
        "                  'files': [p.relative_to(kernel_dir()).as_posix() for p in kernel_files()]}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    out = _run([str(py), "-c", code], cwd=elsewhere, env=env).stdout
    import json

    found = json.loads(out.strip().splitlines()[-1])
    venv_root = str(venv.resolve())
    assert found["package"].startswith(venv_root), found
    assert found["dir"].startswith(venv_root) and found["dir"].endswith("cupy_piecewise/kernels_cu"), found
    assert found["files"] == names

    info = _run([str(py), "-m", "cupy_piecewise", "info"], cwd=elsewhere, env=env).stdout
    assert "kernels_cu" in info and "cupy-piecewise" in info


def _requirements_by_extra(wheel: Path) -> dict[str, list]:
    """Requires-Dist of the wheel's METADATA -> {extra name ('' for none): [Requirement]}."""
    from email.parser import Parser

    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as zf:
        (meta_name,) = [m for m in zf.namelist() if m.endswith(".dist-info/METADATA")]
        meta = Parser().parsestr(zf.read(meta_name).decode())
    extras = meta.get_all("Provides-Extra") or []
    out: dict[str, list] = {"": []}
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        for extra in ("", *extras):
            if req.marker is None and extra == "":
                out[""].append(req)
            elif req.marker is not None and extra and req.marker.evaluate({"extra": extra}):
                out.setdefault(extra, []).append(req)
    return out


def test_wheel_metadata_cuda_extras_need_no_local_toolkit(wheel):
    """The README promises that `pip install ".[cuda13,torch]"` runs the kernels on a machine with only the NVIDIA driver: each CUDA extra must bring CuPy
    (>= 14, which finds NVRTC in the pip wheel), an NVRTC wheel of the same CUDA major
    version, ml_dtypes (bfloat16 CuPy arrays) and cuda-bindings (driver API for the Hopper
    path); the torch extra must not pin a CUDA build of torch."""
    from packaging.version import Version

    wheel_path, names = wheel
    reqs = _requirements_by_extra(wheel_path)
    assert [r.name for r in reqs[""]] == ["numpy"], reqs[""]
    for extra, major, cupy, nvrtc in (("cuda12", 12, "cupy-cuda12x", "nvidia-cuda-nvrtc-cu12"),
                                      ("cuda13", 13, "cupy-cuda13x", "nvidia-cuda-nvrtc")):
        assert extra in reqs, f"extra {extra!r} missing; extras: {sorted(reqs)}"
        by_name = {r.name.lower().replace("_", "-"): r for r in reqs[extra]}
        assert set(by_name) >= {cupy, nvrtc, "ml-dtypes", "cuda-bindings"}, (extra, sorted(by_name))
        # CuPy 13 finds NVRTC only in a local toolkit; 14 loads the pip wheel.
        assert not by_name[cupy].specifier.contains("13.6.0"), by_name[cupy]
        assert by_name[cupy].specifier.contains("14.2.0"), by_name[cupy]
        # NVRTC and the driver bindings of the extra's CUDA major version, no other.
        for name in (nvrtc, "cuda-bindings"):
            spec = by_name[name].specifier
            assert spec.contains(f"{major}.9.0"), (name, spec)
            assert not spec.contains(f"{major + 1}.0.0") and not spec.contains(f"{major - 1}.9.0"), (name, spec)
        assert by_name["ml-dtypes"].specifier.contains("0.6.0"), by_name["ml-dtypes"]
    # torch: a floor only, so the CPU build CI installs first (or a user's CUDA build) is kept.
    (torch_req,) = reqs["torch"]
    assert torch_req.name == "torch" and not torch_req.url and not torch_req.extras, torch_req
    assert all(s.operator == ">=" for s in torch_req.specifier), torch_req
    assert "+" not in str(torch_req.specifier) and "cu1" not in str(torch_req), torch_req
    assert Version("2.13.0+cpu") in torch_req.specifier
    # every kernel source ships, subfolders (kernels_cu/sm90/) included
    with zipfile.ZipFile(wheel_path) as zf:
        shipped = {m.removeprefix("cupy_piecewise/kernels_cu/") for m in zf.namelist()
                   if m.startswith("cupy_piecewise/kernels_cu/")}
    sources = {p.relative_to(ROOT / "kernels_cu").as_posix() for p in (ROOT / "kernels_cu").rglob("*")
               if p.is_file() and p.suffix in KERNEL_SUFFIXES}
    assert set(names) <= sources
    assert sources <= shipped, f"missing from the wheel: {sorted(sources - shipped)}"
