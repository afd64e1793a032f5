"""Context parallelism on the CPU: cupy_piecewise.distributed over gloo with 2 and 3
processes, both methods (allgather, ring), both layouts (contiguous, zigzag), causal and
not, w inside a shard, on and across shard boundaries, negative and beyond the sequence;
o and all five gradients against one single-process call over the whole sequence (float64,
torch CPU). Plus the argument checks and the shard/unshard layouts.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import distributed_cases  # noqa: E402  (tests/ is on sys.path)


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_matches_one_call(world, tmp_path):
    distributed_cases.run_and_check(world, tmp_path, "gloo", 12, "float64", 1, 4, 2, 16)


def test_layout_chunks():
    """zigzag: rank r holds chunks r and 2W-1-r; contiguous: one run; together they cover
    every position once."""
    from cupy_piecewise.distributed import chunks

    for world in (1, 2, 3, 4):
        for layout in ("contiguous", "zigzag"):
            seen = []
            for r in range(world):
                cs = chunks(r, world, 8, layout)
                assert sum(c.length for c in cs) == 8 and cs[0].local == 0
                seen += [p for c in cs for p in range(c.start, c.start + c.length)]
            assert sorted(seen) == list(range(8 * world))
    assert [c.start for c in chunks(1, 3, 8, "zigzag")] == [4, 16]
    with pytest.raises(ValueError, match="even"):
        chunks(0, 2, 7, "zigzag")
    with pytest.raises(ValueError, match="layout"):
        chunks(0, 2, 8, "striped")


def test_errors_without_a_process_group():
    from cupy_piecewise import distributed as cpd

    if dist.is_initialized():  # pragma: no cover - the tests never leave one behind
        pytest.skip("a process group is initialised in this process")
    x = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="not initialised"):
        cpd.attention(x, x, x, x, x, 1)
