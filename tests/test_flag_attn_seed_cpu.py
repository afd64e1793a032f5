"""CPU checks of bench/flag_attn_seed.py, which runs FlagAttention's piecewise.py (the original
Triton design) as the bench's ``flag_attn`` provider: where the source is found, the seed's
header line, the import through a real file (Triton's ``@triton.jit`` reads kernel source from
it), and the capability view that makes the file pick its A100 tile table on any GPU."""
from __future__ import annotations

import inspect
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
torch = pytest.importorskip("torch")
import flag_attn_seed as fas  # noqa: E402

# A stand-in for piecewise.py: the same header line as the seed, and a table keyed by
# torch.cuda.get_device_capability() as the real file's get_fwd_config is.
FAKE = '''src/flag_attn/piecewise.py

"""stand-in"""
import torch


def get_fwd_config(B, H, M, N, D, causal):
    if torch.cuda.get_device_capability() == (8, 0):
        return 128, 64, 3, 8
    elif torch.cuda.get_device_capability() == (8, 6):
        return 64, 32, 3, 4
    return 32, 32, 1, 4


def attention(q1, k1, q2, k2, v, dist_threshold, causal=False, sm_scale=None):
    return get_fwd_config(*q1.shape, k1.shape[2], causal)
'''


def test_python_source_drops_only_a_path_header():
    assert fas.python_source("src/flag_attn/piecewise.py\n\nimport torch\n") == "\nimport torch\n"
    text = '"""doc"""\nimport torch\n'
    assert fas.python_source(text) == text
    assert fas.python_source("x = 1  # piecewise.py\n") == "x = 1  # piecewise.py\n"


def test_find_source_order(tmp_path, monkeypatch):
    seeds = tmp_path / "shared" / "seeds"
    seeds.mkdir(parents=True)
    (seeds / "000_other.txt").write_text("src/other/thing.py\n\nx = 1\n")
    seed = seeds / "001_seed.txt"
    seed.write_text(FAKE)
    local = tmp_path / "local" / "piecewise.py"
    monkeypatch.setattr(fas, "SEED_GLOB", str(seeds / "*"))
    monkeypatch.setattr(fas, "LOCAL_SOURCE", str(local))
    assert fas.find_source({}) == str(seed)  # the seed whose header names the file
    local.parent.mkdir()
    local.write_text(FAKE)
    assert fas.find_source({}) == str(local)  # .baselines before the seed
    assert fas.find_source({fas.SOURCE_ENV: "/x/piecewise.py"}) == "/x/piecewise.py"
    monkeypatch.setattr(fas, "SEED_GLOB", str(tmp_path / "none" / "*"))
    local.unlink()
    assert fas.find_source({}) is None


@pytest.mark.parametrize("table, config", [("a100", (128, 64, 3, 8)), ("rtx3090", (64, 32, 3, 4))])
def test_load_shows_the_table_capability(tmp_path, table, config):
    path = tmp_path / "seed.txt"
    path.write_text(FAKE)
    mod = fas.load(str(path), table)
    q = torch.zeros(1, 2, 16, 8)
    assert mod.attention(q, q, q, q, q, 4) == config
    assert mod.torch.float16 is torch.float16  # everything else is torch's own
    assert mod.torch.cuda.is_available is torch.cuda.is_available
    # the kernels' source must be readable from a file, as @triton.jit reads it
    assert "get_device_capability" in inspect.getsource(mod.get_fwd_config)
    assert mod.source_path == str(path) and mod.table == table


def test_load_native_keeps_torch_and_unknown_table_raises(tmp_path):
    path = tmp_path / "seed.txt"
    path.write_text(FAKE)
    assert fas.load(str(path), "native").torch is torch
    with pytest.raises(ValueError, match=r"table='h100'.*a100, rtx3090, native"):
        fas.load(str(path), "h100")


def test_the_found_source_parses_when_present():
    """Where a source is found (.baselines/flag_attn/piecewise.py or the design seed beside the
    checkout, ../shared/seeds), its Python compiles under this interpreter once the header is
    dropped, and it has the functions the provider and the A100 table rely on (it is imported
    only where triton and a GPU are)."""
    path = fas.find_source({})
    if path is None:
        pytest.skip("no FlagAttention source here (.baselines/flag_attn or ../shared/seeds)")
    with open(path, encoding="utf-8") as f:
        text = fas.python_source(f.read())
    code = compile(text, path, "exec")
    names = set(code.co_names)
    assert {"attention", "get_fwd_config", "get_bwd_config"} <= names
    assert "get_device_capability() == (8, 0)" in text


@pytest.mark.parametrize("value,mma_sync", [("1", True), ("ON", True), ("true", True),
                                            ("0", False), ("", False), ("no", False)])
def test_mma_flavour_follows_tritons_switch(value, mma_sync):
    # the results header says which MMA the Triton design ran: wgmma on Hopper by default,
    # mma.sync with DISABLE_MMA_V3 on (Triton's own boolean parse: 1/true/on, any case)
    got = fas.mma_flavour({"DISABLE_MMA_V3": value})
    assert got.startswith("mma.sync") is mma_sync
    assert fas.mma_flavour({}).startswith("Triton's default")
