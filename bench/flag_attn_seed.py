"""The original Triton design (FlagAttention's ``piecewise.py``) as the ``flag_attn`` provider when
the ``flag_attn`` package is not installed: issue 15 measures the mma.sync path against it
"with its A100 table".

Where the source comes from, first found wins:

1. ``PW_FLAG_ATTN_SOURCE``: a path to FlagAttention's ``src/flag_attn/piecewise.py``;
2. ``.baselines/flag_attn/piecewise.py`` in the repository (git-ignored: the file is
   FlagAttention's code, used here only as a baseline to time, never shipped);
3. the design seed the project started from, ``../shared/seeds/*`` beside the checkout (a
   text file whose first line names ``src/flag_attn/piecewise.py``; that line is dropped).

The lent GPU machines see only the working tree, so copy the file to
``.baselines/flag_attn/piecewise.py`` and pass ``.baselines`` in the device call's ``carry``.

The file picks its tile sizes from ``torch.cuda.get_device_capability()``: (8, 0) gets its A100
table, (8, 6) its RTX 3090 one, anything else (the H100/H200 included) a 32x32 fallback of one
stage. :func:`load` with ``table="a100"`` (the default) makes the module see (8, 0) so that the
A100 table is what runs, on any GPU; ``table="native"`` leaves the capability alone. The table
sets tile sizes only: on an H100/H200 Triton compiles the file's ``tl.dot`` to Hopper's wgmma
unless ``DISABLE_MMA_V3=1`` is in the environment (Triton 3.6 still reads it), which makes it
emit ``mma.sync`` as on an A100: the mma.sync-for-mma.sync comparison with the forced mma.sync
path. :func:`mma_flavour` names which one a run gets (checked in Triton's cached PTX on the
H200, bench/results/2026-12-04-h200-mma-vs-flag-attn).
Its distance threshold is a ``tl.constexpr``: each new ``w`` compiles new kernels (the bench's
warm-up absorbs that; w = L/4 is one per length).
"""
from __future__ import annotations

import glob
import importlib.util
import os
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
SOURCE_ENV = "PW_FLAG_ATTN_SOURCE"
LOCAL_SOURCE = os.path.join(_ROOT, ".baselines", "flag_attn", "piecewise.py")
SEED_GLOB = os.path.join(os.path.dirname(_ROOT), "shared", "seeds", "*")
HEADER = "flag_attn/piecewise.py"
#: capability the module is shown for each table name (None: the real one)
TABLES = {"a100": (8, 0), "rtx3090": (8, 6), "native": None}


def find_source(env=None) -> str | None:
    """The path of the first available source (module docstring's order), or None."""
    env = os.environ if env is None else env
    if env.get(SOURCE_ENV):
        return env[SOURCE_ENV]
    if os.path.isfile(LOCAL_SOURCE):
        return LOCAL_SOURCE
    for path in sorted(glob.glob(SEED_GLOB)):
        try:
            with open(path, encoding="utf-8") as f:
                if f.readline().strip().endswith(HEADER):
                    return path
        except (OSError, UnicodeDecodeError):
            continue
    return None


def python_source(text: str) -> str:
    """The file's Python: a first line that is a bare path (the seed's header) is dropped."""
    first, _, rest = text.partition("\n")
    if first.strip().endswith(".py") and " " not in first.strip():
        return rest
    return text


def mma_flavour(env=None) -> str:
    """What Triton compiles ``tl.dot`` to on a Hopper GPU under ``env`` (default
    ``os.environ``): "mma.sync (DISABLE_MMA_V3=1)" when that switch is on, else "Triton's
    default (wgmma on sm_90)". Triton reads the switch as a boolean: "1", "true" or "on"
    (any case) turn it on."""
    env = os.environ if env is None else env
    on = env.get("DISABLE_MMA_V3", "").lower() in ("1", "true", "on")
    return "mma.sync (DISABLE_MMA_V3=1)" if on else "Triton's default (wgmma on sm_90)"


class _CudaView:
    """``torch.cuda`` with ``get_device_capability`` answering a fixed value."""

    def __init__(self, cuda, capability):
        self._cuda, self._cap = cuda, tuple(capability)

    def get_device_capability(self, *args, **kwargs):
        return self._cap

    def __getattr__(self, name):
        return getattr(self._cuda, name)


class _TorchView:
    """``torch`` whose ``cuda`` is a :class:`_CudaView`; everything else is torch's own."""

    def __init__(self, torch, capability):
        self._torch, self.cuda = torch, _CudaView(torch.cuda, capability)

    def __getattr__(self, name):
        return getattr(self._torch, name)


def load(path: str, table: str = "a100"):
    """Imports the FlagAttention source at ``path`` as a module and returns it (its
    ``attention(q1, k1, q2, k2, v, dist_threshold, causal=False, sm_scale=None)`` takes torch
    tensors (B, H, M, D) of one dtype, D in {16, 32, 64, 128}, and has a backward).

    The text goes through :func:`python_source` and is written to a file of its own before
    import, since Triton's ``@triton.jit`` reads each kernel's source from its file. With
    ``table`` other than "native" the module's ``torch`` global is a view whose
    ``cuda.get_device_capability()`` answers :data:`TABLES`\\[table], so its tile table is that
    GPU's. Raises ValueError naming ``table`` for an unknown table, OSError when the file
    cannot be read, and whatever the import raises (ImportError without triton)."""
    if table not in TABLES:
        raise ValueError(f"table={table!r} (PW_FLAG_ATTN_TABLE): choose from {', '.join(TABLES)}")
    cap = TABLES[table]
    with open(path, encoding="utf-8") as f:
        text = python_source(f.read())
    folder = tempfile.mkdtemp(prefix="flag_attn_seed_")
    file = os.path.join(folder, "flag_attn_piecewise.py")
    with open(file, "w", encoding="utf-8") as f:
        f.write(text)
    name = f"flag_attn_seed_{table}"
    spec = importlib.util.spec_from_file_location(name, file)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses/inspect look modules up by name
    spec.loader.exec_module(mod)
    if cap is not None:
        mod.torch = _TorchView(mod.torch, cap)
    mod.source_path, mod.table = path, table
    return mod
