"""Conventions and small helpers shared by the benchmark modules (bench/bench.py is the entry point).

Phase names, provider and section names, dtypes, the FLOP and byte counts of
docs/semantics.md (FLOP convention), error-text helpers, number formatting and the
progress bar.
"""
from __future__ import annotations

import math
import os
import sys

import torch

try:
    from tqdm import tqdm as _tqdm
except Exception:  # pragma: no cover - tqdm is optional
    _tqdm = None

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)

PHASES = ("fwd", "bwd", "fwd_bwd")
PHASE_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
PHASE_LABEL = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward+backward"}
#: Every provider, in the column order of the tables. ``piecewise``: the package's default path on
#: the GPU (on an H100/H200 the Hopper wgmma + TMA forward and backward); ``piecewise_det``: the
#: same with ``deterministic=True``; ``piecewise_mma``: the mma.sync path forced
#: (CUPY_PIECEWISE_PATH=mma); ``piecewise_mma_det``: that with ``deterministic=True`` (the
#: two-kernel backward where piecewise_mma runs the one-kernel one); ``flex_composite``: two compiled FlexAttention calls (d < w,
#: d >= w) merged by log-sum-exp, what a PyTorch user writes without this package;
#: ``sdpa_efficient``: SDPA's memory-efficient backend, the one that takes float32 (the peer
#: of float32 rows, where flash and cuDNN refuse the dtype).
PROVIDERS = ("piecewise", "piecewise_det", "piecewise_mma", "piecewise_mma_det", "flex_composite",
             "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "torch_plain", "flag_attn")
SECTIONS = ("main", "wsweep", "decode", "memory")
DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32,
}
DTYPE_NAME = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
REF_PROVIDERS = ("sdpa_flash", "sdpa_cudnn")
#: Every main row also gets ratio_vs_<p> for these (time of p / time of the row; > 1: the row is faster).
RATIO_PROVIDERS = REF_PROVIDERS + ("flex_composite", "piecewise_mma", "sdpa_efficient", "flag_attn")


# ----------------------------------------------------------------------------- FLOPs / bytes
def attn_flops(B, H, M, N, D, causal, phase="fwd"):
    """FLOPs by the convention of docs/semantics.md (FlashAttention's count)."""
    f = 4.0 * B * H * M * N * D
    if causal and M == N:
        f /= 2.0
    return f * PHASE_FACTOR[phase]


def tflops_from_ms(flops, ms):
    if ms is None or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12


def decode_bytes(B, H, Hkv, M, N, D, elt_bytes, n_queries=2):
    """Fewest bytes a decode step must move: per key one of k1/k2 plus v, the queries, o."""
    return elt_bytes * (B * Hkv * N * D * 2 + B * H * M * D * (n_queries + 1))


def plain_mem_estimate(B, H, M, N):
    """Rough bytes plain PyTorch needs: B*H*M*N fp32 score-sized buffers, ~4 of them."""
    return B * H * M * N * 4 * 4


# ----------------------------------------------------------------------------- errors and text
def _err_text(e):
    msg = f"{type(e).__name__}: {e}"
    msg = " ".join(msg.split())
    return msg[:600]


def _status_of(msg):
    if msg.startswith("not installed"):
        return "not installed"
    if msg.startswith("skipped"):
        return "skipped"
    return "error"


def _f(x, nd=1):
    if x is None:
        return "-"
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return str(x)
    return f"{x:.{nd}f}"


# ----------------------------------------------------------------------------- utilities
def _version_of(mod):
    try:
        m = __import__(mod)
        return getattr(m, "__version__", "?")
    except Exception as e:
        return f"not importable ({type(e).__name__})"


def _git_commit():
    """The sources a run came from (bench/provenance.py): commit, "+modified" where tracked
    files differ from it, and the kernels' digest."""
    from provenance import source_stamp  # bench/ is on sys.path (the entry scripts' folder)

    try:
        return source_stamp(_ROOT)
    except FileNotFoundError:  # no kernels_cu beside bench/: not a checkout
        return None


def _write(msg):
    if _tqdm is not None:
        _tqdm.write(msg, file=sys.stderr)
    else:
        print(msg, file=sys.stderr)


class _NoBar:
    def __init__(self, total, desc):
        self.total, self.n, self.desc = total, 0, desc

    def update(self, k=1):
        self.n += k

    def set_postfix_str(self, s):
        pass

    def close(self):
        print(f"[{self.desc}] {self.n}/{self.total} done", file=sys.stderr)


def _progress(total, desc):
    if _tqdm is None:
        return _NoBar(total, desc)
    return _tqdm(total=total, desc=desc, file=sys.stderr, mininterval=2.0, dynamic_ncols=True)

