"""The GPU suite's case grid covers every axis value issue 3 lists (checked without a GPU)."""
from __future__ import annotations

from test_kernels_gpu import CASES


def test_case_list_covers_every_axis():
    seen = {k: {c[k] for c in CASES} for k in CASES[0]}
    assert seen["D"] == {16, 32, 64, 128}
    assert seen["dtype"] == {"float16", "bfloat16"} and seen["causal"] == {False, True}
    assert seen["group"] == {1, 4} and seen["transposed"] == {False, True}
    combos = {(c["D"], c["dtype"], c["causal"]) for c in CASES}
    assert len(combos) == 16  # every head dim x dtype x causal combination
    assert {(c["M"], c["N"]) for c in CASES} == {
        (1, 1), (17, 17), (128, 128), (100, 300), (300, 100), (1000, 1000), (2048, 2048),
        (1, 4096), (4096, 1)}
    # w in {-5, 0, 1, 63, 64, N/2, N+5}
    assert {-5, 0, 1, 63, 64} <= seen["w"]
    assert any(c["w"] == c["N"] // 2 and c["N"] > 128 for c in CASES)
    assert any(c["w"] == c["N"] + 5 for c in CASES)


def test_float32_case_list_covers_every_head_dim_both_ways():
    from test_float32_gpu import CASES as F32

    assert {c["dtype"] for c in F32} == {"float32"}
    assert {(c["D"], c["causal"]) for c in F32} == {
        (d, c) for d in (16, 32, 64, 80, 96, 128) for c in (False, True)}
    for d in (16, 32, 64, 80, 96, 128):  # w is not tied to the head dim
        assert len({c["w"] for c in F32 if c["D"] == d}) >= 3, d
    assert any(c["w"] > c["N"] for c in F32)  # first projection only
    assert any(c["D"] == 96 and c["M"] <= 16 for c in F32)  # the D = 96 decode tiles
    assert {c["group"] for c in F32} == {1, 4} and {c["transposed"] for c in F32} == {False, True}
    assert any(c["N"] == 1 for c in F32) and any(c["M"] == 1 for c in F32)


def test_gpu_tests_seeds_are_fresh_or_replayed(monkeypatch):
    """tests/seeds.py: a new seed per draw, or PW_TEST_SEED's on every draw (the replay a
    failure message's seed asks for)."""
    import seeds

    monkeypatch.delenv(seeds.ENV, raising=False)
    draws = {seeds.fresh_seed() for _ in range(4)}
    assert len(draws) == 4 and all(0 <= d < 2**63 for d in draws)
    monkeypatch.setenv(seeds.ENV, "7164795616750225254")
    assert seeds.fresh_seed() == seeds.fresh_seed() == 7164795616750225254
