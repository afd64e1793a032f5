"""Which sources a result came from: the git commit, whether tracked files differ from it,
and a digest of the kernel sources read from the files themselves.

A device machine's copy of the tree can carry git metadata older than its files: on
2026-12-07 the probes' headers named commit 127403d for a cb77ba2 tree (bench/results/
2026-12-07-h100-straddle-parts). "+modified" flags such a copy (or a local edit), and the
kernels digest pins the kernels that ran whatever git says: compare it with
``python3 bench/provenance.py`` in a checkout.
"""
from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def kernels_digest(root: Path | str = ROOT) -> str:
    """First 12 hex digits of a SHA-256 over kernels_cu's .cu and .cuh files (relative path
    and bytes of each, in path order). Raises FileNotFoundError without kernels_cu/."""
    kdir = Path(root) / "kernels_cu"
    if not kdir.is_dir():
        raise FileNotFoundError(f"no kernels_cu directory under {root}")
    h = hashlib.sha256()
    for f in sorted(p for p in kdir.rglob("*") if p.is_file() and p.suffix in (".cu", ".cuh")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0")
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def git_commit(root: Path | str = ROOT) -> str | None:
    """The short HEAD commit, with "+modified" when tracked files differ from it; None
    outside a git work tree or without git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    try:
        rev = git("rev-parse", "--short", "HEAD")
        if not rev:
            return None
        return rev + ("+modified" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def source_stamp(root: Path | str = ROOT) -> str:
    """One line for a result's header: "<commit>[+modified], kernels <digest>"."""
    return f"{git_commit(root) or 'no git'}, kernels {kernels_digest(root)}"


if __name__ == "__main__":
    print(source_stamp())
