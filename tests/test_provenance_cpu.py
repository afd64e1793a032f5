"""bench/provenance.py: what a result's header says about the sources it came from. A device
copy of the tree once carried git metadata older than its files (2026-12-07), so the header
flags tracked files that differ from the commit and digests the kernels from the files."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import provenance  # noqa: E402


@pytest.fixture
def repo(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    (tmp_path / "kernels_cu" / "sm90").mkdir(parents=True)
    (tmp_path / "kernels_cu" / "a.cu").write_text("// a\n")
    (tmp_path / "kernels_cu" / "sm90" / "b.cuh").write_text("// b\n")
    (tmp_path / "kernels_cu" / "notes.txt").write_text("not a kernel source\n")

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    return tmp_path


def test_commit_is_flagged_once_tracked_files_differ(repo):
    clean = provenance.git_commit(repo)
    assert clean and "+" not in clean and len(clean) >= 7
    (repo / "kernels_cu" / "a.cu").write_text("// a, edited\n")
    assert provenance.git_commit(repo) == clean + "+modified"


def test_kernels_digest_follows_the_kernel_sources_only(repo, tmp_path_factory):
    d0 = provenance.kernels_digest(repo)
    assert len(d0) == 12 and int(d0, 16) >= 0
    (repo / "kernels_cu" / "notes.txt").write_text("edited\n")  # not a .cu/.cuh file
    assert provenance.kernels_digest(repo) == d0
    (repo / "kernels_cu" / "sm90" / "b.cuh").write_text("// b, edited\n")
    d1 = provenance.kernels_digest(repo)
    assert d1 != d0
    # the same files elsewhere, without git, give the same digest: it comes from the files
    other = tmp_path_factory.mktemp("copy")
    shutil.copytree(repo / "kernels_cu", other / "kernels_cu")
    assert provenance.kernels_digest(other) == d1
    assert provenance.git_commit(other) is None  # pytest's temporary tree is no git work tree
    assert provenance.source_stamp(other) == f"no git, kernels {d1}"


def test_a_file_moved_between_directories_changes_the_digest(repo):
    d0 = provenance.kernels_digest(repo)
    (repo / "kernels_cu" / "sm90" / "b.cuh").rename(repo / "kernels_cu" / "b.cuh")
    assert provenance.kernels_digest(repo) != d0


def test_no_kernels_directory_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="kernels_cu"):
        provenance.kernels_digest(tmp_path)


def test_this_checkout_has_a_stamp():
    stamp = provenance.source_stamp()
    assert stamp.split(", kernels ")[1] == provenance.kernels_digest()


def test_probes_and_bench_headers_use_the_stamp():
    """scripts/probe_common.source_stamp (the probes' headers) and bench/common._git_commit
    (bench's JSON header) give this checkout's stamp."""
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "scripts"))
    import probe_common
    assert probe_common.source_stamp() == provenance.source_stamp()
    pytest.importorskip("torch")  # bench/common imports it
    import common
    assert common._git_commit() == provenance.source_stamp()
