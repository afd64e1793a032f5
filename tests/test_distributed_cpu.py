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
    distributed_cases.run_and_check(world, tmp_path, "gloo", 12, "float64", 1, 4, 2, 16, 2)


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


def test_ring_pieces_and_schedule():
    """The ring's packets cover every rank's keys once, have the same lengths on every rank,
    and the schedule has each rank process every packet of the sequence exactly once, one
    per slot, with packet p of rank r - k at slot p * W + k."""
    from cupy_piecewise.distributed import _pieces, chunks

    for world, local, layout, piece in ((2, 12, "zigzag", 4), (3, 12, "contiguous", 5),
                                        (4, 8, "zigzag", None), (2, 256, "zigzag", 40)):
        per_rank = [_pieces(chunks(r, world, local, layout), piece) for r in range(world)]
        assert len({tuple(c.length for c in ps) for ps in per_rank}) == 1
        for r, ps in enumerate(per_rank):
            cover = [(c.local + i, c.start + i) for c in ps for i in range(c.length)]
            want = [(c.local + i, c.start + i) for c in chunks(r, world, local, layout)
                    for i in range(c.length)]
            assert sorted(cover) == sorted(want)
            assert all(c.length <= (piece or local) for c in ps)
        n = len(per_rank[0])
        for rank in range(world):
            seen = []
            for t in range(n * world):
                p, k = divmod(t, world)
                seen.append(per_rank[(rank - k) % world][p].start)
            assert sorted(seen) == sorted(c.start for ps in per_rank for c in ps)
    assert [c.length for c in _pieces(chunks(0, 2, 256, "zigzag"), 40)] == [40, 40, 40, 8] * 2


def test_ring_piece_is_checked_and_one_rank_matches(tmp_path):
    """ring_piece is validated; with one rank the ring, cut into one-key pieces, is the
    single-device call (forward and every gradient, float64)."""
    from cupy_piecewise import distributed as cpd

    if dist.is_initialized():  # pragma: no cover
        pytest.skip("a process group is initialised in this process")
    x = torch.zeros(1, 2, 4, 8)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        for bad in (0, -3, 2.5, True):
            with pytest.raises(ValueError, match="ring_piece"):
                cpd.attention(x, x, x, x, x, 1, ring_piece=bad)
        import cupy_piecewise

        g = torch.Generator().manual_seed(0)
        ins = [torch.randn(1, 2, 12, 8, dtype=torch.float64, generator=g) for _ in range(5)]
        do = torch.randn(1, 2, 12, 8, dtype=torch.float64, generator=g)
        results = []
        for run in (lambda *a: cupy_piecewise.attention(*a, 3, causal=True),
                    lambda *a: cpd.attention(*a, 3, causal=True, ring_piece=1)):
            leaves = [t.clone().requires_grad_() for t in ins]
            o = run(*leaves)
            o.backward(do)
            results.append([o.detach()] + [t.grad for t in leaves])
        for want, got in zip(*results):
            assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    finally:
        dist.destroy_process_group()
