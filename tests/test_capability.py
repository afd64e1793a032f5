"""The tile table (cupy_piecewise.capability): every entry obeys the constraints
on every listed architecture; lookups, fallback and overrides behave. CPU only."""

from __future__ import annotations

import os

import pytest

from cupy_piecewise import capability as cap
from cupy_piecewise.capability import (
    LISTED_ARCHS,
    PHASES,
    SHARED_LIMIT,
    TABLE,
    TileConfig,
    lookup,
    selectable_configs,
    shared_bytes,
)

HEAD_DIMS = (16, 32, 64, 128)
DTYPES = ("float16", "bfloat16")
#: phases with an entry for every head dim and variant (bwd_fused has entries only where the
#: one-kernel backward won, some refined to None: test_fused_backward_tiles_follow_the_table)
DENSE_PHASES = tuple(p for p in PHASES if p not in ("bwd_fused", "bwd_grid"))


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv(cap.ENV_VAR, raising=False)
    cap.refresh_env_override()
    for name, value in cap._MIRROR_DEFAULTS.items():  # the default kernels, whatever
        monkeypatch.setattr(cap, name, value)         # PW_TEST_MACROS set for the run


def _all_entries():
    for cc in LISTED_ARCHS:
        for phase in PHASES:
            for head_dim, entry in TABLE[cc][phase].items():
                configs = [entry] if isinstance(entry, TileConfig) else list(entry.values())
                for cfg in configs:
                    if cfg is None:  # bwd_fused refined to None: the two-kernel scheme
                        continue
                    yield cc, phase, head_dim, cfg


def test_table_covers_every_listed_arch_phase_and_head_dim():
    assert set(TABLE) == set(LISTED_ARCHS)
    for cc in LISTED_ARCHS:
        assert set(TABLE[cc]) == set(PHASES)
        for phase in PHASES:
            if phase in ("bwd_fused", "bwd_grid"):  # only where they beat the two kernels
                assert set(TABLE[cc][phase]) <= set(TABLE[cc]["bwd_dkv"]), cc
                continue
            assert set(HEAD_DIMS) <= set(TABLE[cc][phase]), (cc, phase)


@pytest.mark.parametrize("cc,phase,head_dim,cfg", list(_all_entries()), ids=lambda x: str(x))
def test_entry_satisfies_constraints(cc, phase, head_dim, cfg):
    assert cfg.block_m in (16, 32, 64, 128)
    assert cfg.block_n in (16, 32, 64, 128)
    if phase in ("fwd", "fwd_decode", "bwd_dq"):
        assert cfg.block_m in (16 * cfg.num_warps, 32 * cfg.num_warps)
    else:
        assert cfg.block_n in (16 * cfg.num_warps, 32 * cfg.num_warps)
    assert shared_bytes(phase, head_dim, cfg) <= SHARED_LIMIT[cc]
    assert cap.check_config(phase, head_dim, cfg, cc) == []


def test_shared_bytes_formula():
    cfg = TileConfig(128, 64, 8)  # 16 rows per warp: two key slots and v per stage
    assert shared_bytes("fwd", 128, cfg) == 2 * (2 * 128 + 3 * 2 * 64) * 136
    # sm_90 fwd D128: 32 rows per warp at D >= 128 keeps one key slot (fwd_one_key_slot),
    # 104 KB, so two blocks share an SM's 228 KB (1 KB reserved per block)
    cfg = TileConfig(128, 32, 4)
    assert cap.fwd_one_key_slot(128, cfg)
    assert shared_bytes("fwd", 128, cfg) == 2 * (2 * 128 + 2 * 2 * 32) * 136
    assert 2 * (shared_bytes("fwd", 128, cfg) + 1024) <= 233472
    assert shared_bytes("fwd_decode", 128, cfg) == shared_bytes("fwd", 128, cfg)
    # not for float32, smaller head dims or 16 rows per warp
    assert not cap.fwd_one_key_slot(128, cfg, elem_bytes=4)
    assert not cap.fwd_one_key_slot(96, cfg)
    assert not cap.fwd_one_key_slot(128, TileConfig(128, 32, 8))
    assert shared_bytes("fwd", 128, cfg, elem_bytes=4) == (2 * 128 + 3 * 2 * 32) * (4 * 128 + 16)
    cfg = TileConfig(64, 64, 4)
    assert shared_bytes("bwd_dq", 128, cfg) == 2 * (3 * 64 + 3 * 2 * 64) * 136 + 8 * 64
    assert shared_bytes("bwd_dkv", 128, cfg) == 2 * (3 * 64 + 3 * 2 * 64) * 136 + 8 * 2 * 64
    # float32: 4-byte elements, rows still padded by 16 bytes (Pitch<2 * D> of common.cuh)
    assert shared_bytes("fwd", 64, cfg, elem_bytes=4) == (2 * 64 + 3 * 2 * 64) * (4 * 64 + 16)
    with pytest.raises(ValueError, match="phase"):
        shared_bytes("bwd", 64, cfg)


def test_table_lookups_and_refinement():
    # sm_90 entries come from bench/tiles.py measurements; others from ptxas budgets.
    assert lookup((9, 0), "fwd", 128, "bfloat16", False) == TileConfig(128, 64, 4)
    assert lookup((9, 0), "fwd", 64, "float16", True) == TileConfig(128, 128, 4)
    # refinement by causal
    assert lookup((9, 0), "bwd_dkv", 64, "float16", True) == TileConfig(32, 128, 4)
    assert lookup((9, 0), "bwd_dkv", 64, "float16", False) == TileConfig(64, 64, 4)
    assert lookup((8, 0), "fwd", 128, "float16", False) == TileConfig(64, 64, 4)
    for cc in ((8, 6), (8, 9)):
        assert lookup(cc, "fwd", 128, "bfloat16", True) == TileConfig(64, 32, 4)


def test_macro_table_entries_follow_their_mirror(monkeypatch):
    """The sm_90 D = 128 forward entry is 128x64x4 in three rotating slots (fwd_q_rotate:
    104448 bytes, two blocks per SM) while the mirror FWD_Q_ROTATE is on, its default since
    PW_FWD_Q_ROTATE became the kernels' default (2026-12-05); turned off (an A/B build with
    -DPW_FWD_Q_ROTATE=0) the same entry keeps four slots, 139264 bytes, which still fits.
    capability.MACRO_TABLE (whatever it stages: test_macro_table_is_well_formed): a staged
    macro's entries replace TABLE's for dense 16-bit variants only while its mirror is on
    (PW_TEST_MACROS runs the GPU suite that way); checked here on an entry put in for the
    test."""
    assert cap.FWD_Q_ROTATE and cap._MIRROR_DEFAULTS == {"FWD_Q_ROTATE": True,
                                                         "FWD_ONE_K_D64": True,
                                                         "KV90_ROT_STAGE": False,
                                                         "KV90_TILE_BOX": False,
                                                         "GRID_TWO_DS_D64": False,
                                                         "KV90_ROW_BOX": 2,
                                                         "KV90_PAGE_BOX": True}
    for dtype in DTYPES:
        got = lookup((9, 0), "fwd", 128, dtype, False)
        assert got == TileConfig(128, 64, 4) == TABLE[(9, 0)]["fwd"][128]
        assert cap.fwd_q_rotate(128, got)
        assert shared_bytes("fwd", 128, got) == 104448
        assert 2 * (shared_bytes("fwd", 128, got) + 1024) <= 233472  # two blocks per SM
        assert lookup((9, 0), "fwd", 128, dtype, True) == got
        # packed batches keep VARLEN_TABLE's entry
        assert lookup((9, 0), "fwd", 128, dtype, False, varlen=True) == TileConfig(128, 64, 8)
    assert ("fwd", 128, "bfloat16", False, TileConfig(128, 64, 4)) in selectable_configs((9, 0))
    # float32 takes TF32_TABLE's entry, which does not rotate (4-byte elements)
    got = lookup((9, 0), "fwd", 128, "float32", False)
    assert got == cap.TF32_TABLE[(9, 0)]["fwd"][128] and not cap.fwd_q_rotate(128, got, 4)
    # the mirror off: the same entry, four slots (one block per SM), within sm_90's limit
    monkeypatch.setattr(cap, "FWD_Q_ROTATE", False)
    got = lookup((9, 0), "fwd", 128, "bfloat16", False)
    assert got == TileConfig(128, 64, 4) and not cap.fwd_q_rotate(128, got)
    assert shared_bytes("fwd", 128, got) == 139264 == (2 * 128 + 2 * 2 * 64) * 272
    assert cap.check_config("fwd", 128, got, (9, 0)) == []
    assert 139264 + 1024 <= 233472 < 2 * (139264 + 1024)
    # the mechanism: a staged entry applies while its mirror is on, for dense 16-bit variants
    # only (not float32, also where TF32_TABLE has none: D = 32 takes TABLE's)
    monkeypatch.setitem(cap.MACRO_TABLE, "FWD_Q_ROTATE", {(9, 0): {"fwd": {32: TileConfig(64, 64, 4)}}})
    assert lookup((9, 0), "fwd", 32, "bfloat16", False) == TABLE[(9, 0)]["fwd"][32]  # mirror off
    monkeypatch.setattr(cap, "FWD_Q_ROTATE", True)
    assert lookup((9, 0), "fwd", 32, "bfloat16", False) == TileConfig(64, 64, 4)
    assert lookup((9, 0), "fwd", 32, "bfloat16", False, varlen=True) == TABLE[(9, 0)]["fwd"][32]
    assert lookup((9, 0), "fwd", 32, "float32", False) == TABLE[(9, 0)]["fwd"][32]
    assert lookup((9, 0), "fwd", 64, "bfloat16", False) == TABLE[(9, 0)]["fwd"][64]
    assert lookup((8, 0), "fwd", 32, "bfloat16", False) == TABLE[(8, 0)]["fwd"][32]
    assert ("fwd", 32, "bfloat16", False, TileConfig(64, 64, 4)) in selectable_configs((9, 0))


def test_each_mirror_default_is_its_kernel_macro_default():
    """Every kernel macro with a host mirror (capability._MACRO_MIRRORS) has one
    ``#ifndef NAME / #define NAME <int>`` default in kernels_cu, and the mirror's default
    equals it: flipping a staged build into the default takes both sides (e.g. KV90_ROW_BOX's
    mode 2, bench/NOTES.md thirty-ninth section)."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1] / "kernels_cu"
    text = {f: f.read_text() for f in root.rglob("*.cu*")}
    for macro, mirror in cap._MACRO_MIRRORS.items():
        found = [(f.name, m.group(1)) for f, t in text.items() for m in re.finditer(
            rf"#ifndef {macro}\n#define {macro} (\S+)\n", t)]
        assert len(found) == 1, (macro, found)
        assert int(found[0][1]) == int(cap._MIRROR_DEFAULTS[mirror]), (macro, found, mirror)


def test_macro_table_is_well_formed(monkeypatch):
    """Every entry capability.MACRO_TABLE stages (none today: PW_FWD_Q_ROTATE's and
    PW_FWD_ONE_K_D64's entries moved into TABLE as they became the default) is keyed by a
    host mirror of a kernel macro, for listed architectures and phases, and is a valid tile
    configuration there with its mirror on."""
    for mirror, rows in cap.MACRO_TABLE.items():
        assert hasattr(cap, mirror) and mirror in cap._MACRO_MIRRORS.values(), mirror
        assert set(rows) <= set(LISTED_ARCHS), (mirror, sorted(rows))
        monkeypatch.setattr(cap, mirror, True)  # its entries are sized with the mirror on
        for cc, phases in rows.items():
            assert set(phases) <= set(PHASES), (mirror, cc, sorted(phases))
            for phase, dims in phases.items():
                for d, cfg in dims.items():
                    assert isinstance(cfg, TileConfig), (mirror, cc, phase, d, cfg)
                    assert cap.check_config(phase, d, cfg, cc) == [], (mirror, cc, phase, d)


@pytest.mark.parametrize("cc", LISTED_ARCHS)
def test_lookup_returns_table_entry(cc):
    for phase in DENSE_PHASES:
        for d in HEAD_DIMS:
            entry = TABLE[cc][phase][d]
            for dtype in DTYPES:
                for causal in (False, True):
                    got = lookup(cc, phase, d, dtype, causal)
                    assert got == entry if isinstance(entry, TileConfig) else got in entry.values()


@pytest.mark.parametrize("cc", LISTED_ARCHS)
def test_selectable_configs_cover_lookup(cc):
    configs = selectable_configs(cc)
    arch = cap.resolve_arch(cc)
    expected = set()
    for phase in PHASES:
        # float32 (TF32) runs the mma.sync attention phases, not the KV-cache ones nor the
        # fused backward (float32 takes the deterministic one)
        dtypes = cap.HALF_DTYPES if phase in cap.HALF_ONLY_PHASES else cap.TABLE_DTYPES
        for d in TABLE[arch][phase]:
            for dtype in dtypes:
                if dtype == "float32" and cap.TF32_TABLE.get(arch, {}).get(phase, {}).get(d, 0) is None:
                    with pytest.raises(ValueError, match="float32"):
                        lookup(cc, phase, d, dtype, False)
                    continue
                for causal in (False, True):
                    if phase == "bwd_fused" and cap.fused_backward_tiles(cc, d, dtype, causal) is None:
                        continue  # refined to None: no fused kernel to select
                    expected.add((phase, d, dtype, causal, lookup(cc, phase, d, dtype, causal)))
    assert configs == expected
    assert any(c[2] == "float32" for c in configs)


@pytest.mark.parametrize("cc", LISTED_ARCHS)
def test_float32_tiles_fit_in_four_byte_elements(cc):
    """Every float32 variant the table can select fits the architecture's shared memory with
    4-byte elements (TF32_TABLE replaces the 16-bit entries that would not), and where
    TF32_TABLE says none fits (sm_86/89 at head dim 256) the smallest tile indeed does not."""
    for phase, d, dtype, causal, tiles in selectable_configs(cc) | selectable_configs(cc, varlen=True):
        eb = cap.elem_bytes(dtype)
        assert eb == (4 if dtype == "float32" else 2)
        assert cap.check_config(phase, d, tiles, cc, elem_bytes=eb) == [], (phase, d, dtype, tiles)
    for phase, by_dim in cap.TF32_TABLE[cc].items():
        for d, entry in by_dim.items():
            if entry is None:  # only head dim 256 lacks float32 kernels
                assert d == 256, (phase, d)
                if SHARED_LIMIT[cc] < 128 * 1024:  # sm_86/89: not even the smallest tile fits
                    assert shared_bytes(phase, d, TileConfig(16, 16, 1), 4) > SHARED_LIMIT[cc]
    with pytest.raises(ValueError, match="head_dim 256 with float32"):
        lookup(cc, "fwd", 256, "float32", False)
    with pytest.raises(ValueError, match="head_dim 256 with float32"):  # overrides too
        lookup(cc, "fwd_decode", 256, "float32", False, {"fwd_decode": TileConfig(16, 16, 1)})
    # an unlisted GPU takes sm_90's row only if all of its tiles fit (the largest is the
    # warp-grid backward's 228352 bytes, above every float32 tile of the row), else sm_89's
    assert cap.resolve_arch((9, 9), max_shared=228352) == (9, 0)
    assert cap.resolve_arch((9, 9), max_shared=228351) == (8, 9)
    # one whose limit fits the 16-bit tiles of the row it falls back to (sm_89's: 93184
    # bytes at most) but not its float32 ones (bwd_dq at 80: 97280)
    assert cap.resolve_arch((9, 9), max_shared=95000) == (8, 9)
    with pytest.raises(ValueError, match="float32 tiles"):
        lookup((9, 9), "bwd_dq", 80, "float32", False, max_shared=95000)
    # a float32 row is 4 * D + 16 bytes: Pitch<2 * D> of common.cuh
    assert shared_bytes("fwd", 128, TileConfig(64, 32, 4), 4) == (2 * 64 + 3 * 2 * 32) * 528
    with pytest.raises(ValueError, match="dtype 'float32' has no tile table for kvcache"):
        lookup((9, 0), "kvcache", 64, "float32", False)


def test_selectable_configs_ignore_env(monkeypatch):
    before = selectable_configs((9, 0))
    monkeypatch.setenv(cap.ENV_VAR, "fwd=64x64x4")
    cap.refresh_env_override()
    assert selectable_configs((9, 0)) == before


# --------------------------------------------------------------------- fallback


@pytest.mark.parametrize(
    "cc,arch",
    [
        ((8, 7), (8, 6)),  # Orin: nearest lower listed
        ((9, 5), (8, 9)),  # unknown limit: conservative 99 KiB, sm_90 tiles do not fit
        ((12, 0), (8, 9)),  # consumer Blackwell: 99 KiB, sm_90 tiles do not fit
        ((10, 0), (9, 0)),  # B200: 227 KiB, sm_90 tiles fit
    ],
)
def test_fallback_for_unlisted_gpu(cc, arch):
    assert cap.resolve_arch(cc) == arch
    for phase in DENSE_PHASES:
        for d in HEAD_DIMS:
            assert lookup(cc, phase, d, "float16", False) == lookup(arch, phase, d, "float16", False)


def test_fallback_uses_device_shared_limit():
    assert cap.resolve_arch((9, 5), max_shared=232448) == (9, 0)
    assert cap.resolve_arch((9, 5), max_shared=166912) == (8, 9)  # sm_90 D128 fwd needs 174080
    # Whatever is picked fits the stated limit.
    for cfg in (lookup((11, 0), p, d, "float16", False, max_shared=120000) for p in DENSE_PHASES
                for d in HEAD_DIMS):
        assert isinstance(cfg, TileConfig)


@pytest.mark.parametrize("cc", [(7, 5), (7, 0), (6, 1)])
def test_old_gpu_refused(cc):
    with pytest.raises(ValueError, match=f"sm_{cc[0]}{cc[1]}"):
        lookup(cc, "fwd", 64, "float16", False)


def test_unknown_phase_head_dim_dtype():
    with pytest.raises(ValueError, match="phase"):
        lookup((9, 0), "bwd", 64, "float16", False)
    with pytest.raises(ValueError, match="head_dim"):
        lookup((9, 0), "fwd", 48, "float16", False)
    with pytest.raises(ValueError, match="dtype"):
        lookup((9, 0), "fwd", 64, "float64", False)


def test_dtype_causal_refinement(monkeypatch):
    refined = {
        (None, None): TileConfig(64, 64, 4),
        ("bfloat16", None): TileConfig(64, 32, 4),
        (None, True): TileConfig(32, 64, 2),
        ("bfloat16", True): TileConfig(16, 16, 1),
    }
    table = {cc: {ph: dict(row) for ph, row in TABLE[cc].items()} for cc in TABLE}
    table[(8, 0)]["fwd"][64] = refined
    monkeypatch.setattr(cap, "TABLE", table)
    assert lookup((8, 0), "fwd", 64, "float16", False) == TileConfig(64, 64, 4)
    assert lookup((8, 0), "fwd", 64, "bfloat16", False) == TileConfig(64, 32, 4)
    assert lookup((8, 0), "fwd", 64, "float16", True) == TileConfig(32, 64, 2)
    assert lookup((8, 0), "fwd", 64, "bfloat16", True) == TileConfig(16, 16, 1)
    assert {c[4] for c in selectable_configs((8, 0)) if c[:2] == ("fwd", 64)} == set(refined.values())


# --------------------------------------------------------------------- overrides


def test_env_override(monkeypatch):
    stages = cap.STAGES[-1]
    monkeypatch.setenv(cap.ENV_VAR, f"fwd=64x64x4, bwd_dq=32x64x2x{stages}")
    cap.refresh_env_override()
    assert lookup((9, 0), "fwd", 128, "float16", False) == TileConfig(64, 64, 4)
    assert lookup((9, 0), "bwd_dq", 64, "float16", False) == TileConfig(32, 64, 2, stages)
    # phases the variable does not name keep the table
    assert lookup((9, 0), "bwd_dkv", 128, "float16", False) == cap._refine(
        TABLE[(9, 0)]["bwd_dkv"][128], "float16", False)


def test_env_override_is_read_once_and_refreshed(monkeypatch):
    """env_override() costs a global read: the environment is read at import and again on
    refresh_env_override(); set_tile_override() sets both the value and os.environ."""
    assert cap.env_override() is None
    monkeypatch.setenv(cap.ENV_VAR, "fwd=64x64x4")
    assert cap.env_override() is None  # not seen until refreshed
    assert cap.refresh_env_override() == "fwd=64x64x4" == cap.env_override()
    assert lookup((9, 0), "fwd", 64, "float16", False) == TileConfig(64, 64, 4)
    assert cap.set_tile_override("fwd=32x64x2") == "fwd=64x64x4"
    assert os.environ[cap.ENV_VAR] == "fwd=32x64x2" == cap.env_override()
    assert lookup((9, 0), "fwd", 64, "float16", False) == TileConfig(32, 64, 2)
    with pytest.raises(ValueError, match=cap.ENV_VAR):
        cap.set_tile_override("fwd=oops")
    assert cap.env_override() == "fwd=32x64x2"
    cap.set_tile_override(None)
    assert cap.ENV_VAR not in os.environ and cap.env_override() is None


def test_argument_override_wins_over_env(monkeypatch):
    monkeypatch.setenv(cap.ENV_VAR, "fwd=64x64x4")
    cap.refresh_env_override()
    got = lookup((9, 0), "fwd", 64, "float16", False, override={"fwd": TileConfig(32, 32, 2)})
    assert got == TileConfig(32, 32, 2)


@pytest.mark.parametrize(
    "value",
    [
        "fwd=64x64",  # too few fields
        "fwd=axbxc",  # not numbers
        "fwd:64x64x4",  # no '='
        "bwd=64x64x4",  # unknown phase
        "fwd=48x64x3",  # block_m not a tile size
        "fwd=64x64x8",  # block_m != 16 * warps
        "fwd=128x128x8x4",  # shared memory: 2*(256+1536)*136 = 487424 > sm_90's limit
        "bwd_dkv=64x64x8",  # block_n is neither 16 nor 32 * warps
        "fwd=64x64x4x9",  # stages
    ],
)
def test_bad_env_override(monkeypatch, value):
    monkeypatch.setenv(cap.ENV_VAR, value)
    cap.refresh_env_override()
    with pytest.raises(ValueError, match=cap.ENV_VAR):
        for phase in PHASES:
            lookup((9, 0), phase, 128, "float16", False)


def test_bad_argument_override():
    with pytest.raises(ValueError, match=cap.ENV_VAR):
        lookup((8, 6), "fwd", 128, "float16", False, override={"fwd": TileConfig(128, 128, 8)})
    with pytest.raises(ValueError, match=cap.ENV_VAR):
        lookup((8, 6), "fwd", 128, "float16", False, override={"fwd": (64, 64, 4)})


def test_override_fits_only_where_memory_allows():
    big = {"fwd": TileConfig(128, 64, 8)}  # 174080 bytes at D128
    assert lookup((9, 0), "fwd", 128, "float16", False, override=big) == big["fwd"]
    with pytest.raises(ValueError, match="shared memory"):
        lookup((8, 0), "fwd", 128, "float16", False, override=big)


def test_parse_override_round_trip():
    cfg = TileConfig(64, 32, 4, 3)
    assert cap.parse_override(f"bwd_dq={cfg}") == {"bwd_dq": cfg}
    assert cap.parse_override("") == {}


def test_info_names_the_forward_path(monkeypatch):
    from cupy_piecewise import info

    assert info._forward_path((9, 0)).startswith("Hopper wgmma + TMA")
    # the tile of each compute head dim, from capability (D = 128: 128 x 128, 3 + 2 slots)
    assert "D128=128x128 3+2 slots" in info._forward_path((9, 0))
    assert info._forward_path((8, 0)) == "mma.sync kernels"
    assert info._backward_path((9, 0)).startswith("Hopper wgmma + TMA")
    assert info._backward_path((8, 6)) == "mma.sync kernels"
    assert info._decode_path((9, 0)).startswith("Hopper TMA kernel")
    assert "D128=16x64x4x3" in info._decode_path((9, 0))
    assert info._decode_path((8, 9)) == "cp.async kernel"
    monkeypatch.setenv(cap.PATH_VAR, "mma")
    cap.refresh_env_override()
    assert info._forward_path((9, 0)) == "mma.sync kernels (CUPY_PIECEWISE_PATH=mma)"
    assert info._backward_path((9, 0)) == "mma.sync kernels (CUPY_PIECEWISE_PATH=mma)"
    assert info._decode_path((9, 0)) == "cp.async kernel (CUPY_PIECEWISE_PATH=mma)"
    monkeypatch.setenv(cap.PATH_VAR, "warp-speed")
    cap.refresh_env_override()
    assert "CUPY_PIECEWISE_PATH" in info._forward_path((9, 0))


def test_persist_ctas_knob(monkeypatch):
    """CUPY_PIECEWISE_PERSIST_CTAS: unset or blank is None, a positive integer caps the
    persistent grid, anything else is a ValueError naming the variable; plan caches key on
    it (plan_switches)."""
    try:
        for text, want in ((None, None), ("", None), ("5", 5), (" 12 ", 12)):
            if text is None:
                monkeypatch.delenv(cap.PERSIST_VAR, raising=False)
            else:
                monkeypatch.setenv(cap.PERSIST_VAR, text)
            cap.refresh_env_override()
            assert cap.persist_ctas() == want
            assert cap.plan_switches()[-1] == text
        for bad in ("0", "-3", "many", "2.5"):
            monkeypatch.setenv(cap.PERSIST_VAR, bad)
            cap.refresh_env_override()
            with pytest.raises(ValueError, match="CUPY_PIECEWISE_PERSIST_CTAS"):
                cap.persist_ctas()
    finally:
        monkeypatch.delenv(cap.PERSIST_VAR, raising=False)
        cap.refresh_env_override()


#: Head dims of the attention kernels (issue 12 added 80, 96, 256); the KV-cache phases
#: keep the first four.
ATTENTION_PHASES = ("fwd", "fwd_decode", "bwd_dq", "bwd_dkv")


@pytest.mark.parametrize("cc", LISTED_ARCHS)
def test_attention_phases_cover_the_new_head_dims(cc):
    for phase in ATTENTION_PHASES:
        assert {16, 32, 64, 80, 96, 128, 256} == set(TABLE[cc][phase]), (cc, phase)
    assert cap.head_dims(cc) == (16, 32, 64, 80, 96, 128, 256)


@pytest.mark.parametrize("cc", LISTED_ARCHS)
def test_varlen_lookup_and_selectable_configs(cc):
    configs = selectable_configs(cc, varlen=True)
    assert {c[0] for c in configs} == set(cap.VARLEN_PHASES)
    for phase, d, dtype, causal, tiles in configs:
        assert tiles == lookup(cc, phase, d, dtype, causal, varlen=True)
        assert not cap.check_config(phase, d, tiles, cc, elem_bytes=cap.elem_bytes(dtype)), (
            phase, d, tiles)
    # entries of VARLEN_TABLE win; elsewhere the packed kernels take the dense tiles
    for phase, by_dim in cap.VARLEN_TABLE.get(cc, {}).items():
        for d in by_dim:
            want = cap._refine(by_dim[d], "bfloat16", True)
            if want is None:  # bwd_fused refined to None: the two-kernel scheme
                with pytest.raises(ValueError, match="has no tiles"):
                    lookup(cc, phase, d, "bfloat16", True, varlen=True)
            else:
                assert lookup(cc, phase, d, "bfloat16", True, varlen=True) == want
    assert lookup(cc, "bwd_dq", 32, "float16", False, varlen=True) == lookup(
        cc, "bwd_dq", 32, "float16", False)
    with pytest.raises(ValueError, match="packed-batch"):
        lookup(cc, "fwd_decode", 64, "float16", False, varlen=True)


def test_info_tile_tables_list_each_phase_with_its_own_head_dims():
    """info's per-architecture tables: no error, every phase present, and each phase lists
    exactly the head dims its table row has (the KV-cache phases have fewer than the
    forward; asking them for D = 80 used to turn the whole table into an error)."""
    from cupy_piecewise import info

    for cc in cap.LISTED_ARCHS:
        entry = info._tiles(cc)
        assert "error" not in entry, entry
        arch = cap.resolve_arch(cc)
        assert set(entry["tiles"]) == set(cap.PHASES)
        for phase, row in entry["tiles"].items():
            assert set(row) == set(cap.TABLE[arch][phase]) & set(cap.head_dims(cc)), phase
        assert entry["decode_path"]
        # float32: the attention phases only, 256 without a kernel, the rest the TF32 lookup
        assert set(entry["tiles_float32"]) == set(cap.PHASES) - set(cap.HALF_ONLY_PHASES)
        for phase, row in entry["tiles_float32"].items():
            assert row[256] == "none" and row[64] == str(cap.lookup(cc, phase, 64, "float32", False))


def test_hopper_decode_clusters_are_built_for_every_size_the_plan_picks():
    """KVPlan merges up to KV90_MAX_CLUSTER splits in a cluster (cluster = split count), so
    every size from 1 to that bound must be a built variant (build_check, KV90_CLUSTERS)."""
    assert set(range(1, cap.KV90_MAX_CLUSTER + 1)) <= set(cap.KV90_CLUSTERS)


def test_has_float32_kernels():
    from cupy_piecewise.capability import LISTED_ARCHS, has_float32_kernels

    for cc in LISTED_ARCHS:
        assert not has_float32_kernels(cc, 256)  # TF32_TABLE: no kernel at 256 anywhere
        assert has_float32_kernels(cc, 64) and has_float32_kernels(cc, 128)


@pytest.mark.parametrize("cc", LISTED_ARCHS)
def test_fused_backward_tiles_follow_the_table(cc, monkeypatch):
    """fused_backward_tiles: None for float32, for head dims without a bwd_fused entry and
    where an entry is refined to None (the two-kernel scheme runs there); otherwise
    lookup's tiles, which fit the architecture; dense and packed batches (VARLEN_TABLE keeps
    the packed entries the dense rows gave to bwd_grid). A bwd_fused override forces the
    kernel."""
    monkeypatch.delenv(cap.ENV_VAR, raising=False)
    cap.refresh_env_override()
    arch = cap.resolve_arch(cc)
    some = False
    for varlen in (False, True):
        for d in cap.head_dims(cc):
            entry = cap._table_entry(arch, "bwd_fused", d, varlen)
            for dtype in cap.TABLE_DTYPES:
                for causal in (False, True):
                    got = cap.fused_backward_tiles(cc, d, dtype, causal, varlen=varlen)
                    want = (None if dtype == "float32" or entry is None
                            else cap._refine(entry, dtype, causal))
                    assert got == want, (d, dtype, causal, varlen)
                    if got is not None:
                        some = True
                        assert got == lookup(cc, "bwd_fused", d, dtype, causal, varlen=varlen)
                        assert not cap.check_config("bwd_fused", d, got, cc)
                    elif dtype != "float32" and entry is not None:
                        with pytest.raises(ValueError, match="fused_backward_tiles"):
                            lookup(cc, "bwd_fused", d, dtype, causal, varlen=varlen)
    assert some
    monkeypatch.setenv(cap.ENV_VAR, "bwd_fused=16x64x4")
    cap.refresh_env_override()
    try:
        assert cap.fused_backward_tiles(cc, 96, "bfloat16", False) == TileConfig(16, 64, 4)
        assert cap.fused_backward_tiles(cc, 96, "float32", False) is None
    finally:
        monkeypatch.delenv(cap.ENV_VAR)
        cap.refresh_env_override()


@pytest.mark.parametrize("cc", LISTED_ARCHS)
def test_grid_backward_tiles_follow_the_table(cc, monkeypatch):
    """grid_backward_tiles: the bwd_grid entry's tiles for 16-bit dense batches (every dtype
    and causal flag), None for float32, packed batches and head dims without an entry; a
    bwd_grid override forces the kernel and a bwd_fused one (alone) turns it off."""
    monkeypatch.delenv(cap.ENV_VAR, raising=False)
    cap.refresh_env_override()
    arch = cap.resolve_arch(cc)
    entries = TABLE[arch]["bwd_grid"]
    assert 64 in entries  # the H100's D = 64 shape fits every listed architecture
    for d in cap.head_dims(cc):
        for dtype in cap.TABLE_DTYPES:
            for causal in (False, True):
                got = cap.grid_backward_tiles(cc, d, dtype, causal)
                want = None if dtype == "float32" or d not in entries else entries[d]
                assert got == want, (d, dtype, causal)
                if got is not None:
                    assert got == lookup(cc, "bwd_grid", d, dtype, causal)
                    assert not cap.check_config("bwd_grid", d, got, cc)
                assert cap.grid_backward_tiles(cc, d, dtype, causal, varlen=True) is None
    # 8 warps at D = 64 (two Pᵀ/dSᵀ buffers, 148480 bytes) fit sm_80 and sm_90 only
    big = cap.SHARED_LIMIT[arch] >= cap.shared_bytes("bwd_grid", 64, TileConfig(64, 128, 8))
    assert big == (arch in ((8, 0), (9, 0)))
    for env, want in (("bwd_grid=64x128x8" if big else "bwd_grid=64x64x4",
                       TileConfig(64, 128, 8) if big else TileConfig(64, 64, 4)),
                      ("bwd_fused=16x64x4", None),
                      ("bwd_fused=16x64x4,bwd_grid=64x64x4", TileConfig(64, 64, 4))):
        monkeypatch.setenv(cap.ENV_VAR, env)
        cap.refresh_env_override()
        assert cap.grid_backward_tiles(cc, 64, "bfloat16", True) == want, env
    monkeypatch.setenv(cap.ENV_VAR, "bwd_grid=64x128x4")
    cap.refresh_env_override()
    with pytest.raises(ValueError, match="block_n == 16 \\* num_warps"):
        cap.grid_backward_tiles(cc, 64, "bfloat16", True)
    if not big:  # refused by name where it does not fit
        monkeypatch.setenv(cap.ENV_VAR, "bwd_grid=64x128x8")
        cap.refresh_env_override()
        with pytest.raises(ValueError, match="148480 bytes of shared memory"):
            cap.grid_backward_tiles(cc, 64, "bfloat16", True)
    monkeypatch.delenv(cap.ENV_VAR)
    cap.refresh_env_override()


def test_mode_mirrors_keep_their_type(monkeypatch):
    """apply_kernel_macros keeps each mirror's type: a switch stays a bool
    (PW_FWD_Q_ROTATE=0 -> False), a mode an int (KV90_TILE_BOX=2 -> 2, the kernel's
    D = 128 / paged-only form; a bare name means 1)."""
    for name in ("FWD_Q_ROTATE", "KV90_TILE_BOX"):
        monkeypatch.setattr(cap, name, getattr(cap, name))  # restored after the test
    cap.apply_kernel_macros(["PW_FWD_Q_ROTATE=0", "KV90_TILE_BOX=2"])
    assert cap.FWD_Q_ROTATE is False and cap.KV90_TILE_BOX == 2
    assert type(cap.KV90_TILE_BOX) is int
    cap.apply_kernel_macros(["KV90_TILE_BOX"])
    assert cap.KV90_TILE_BOX == 1
    with pytest.raises(ValueError, match="KV90_TILE_BOX=x"):
        cap.apply_kernel_macros(["KV90_TILE_BOX=x"])
