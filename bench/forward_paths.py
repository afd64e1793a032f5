"""Forward speed of the kernel paths against PyTorch's attention, one run, one GPU.

    PYTHONPATH=$PWD python3 bench/forward_paths.py --out bench/results/<date>-h200-forward-paths

Providers (names as in docs/semantics.md's results format): ``piecewise`` (the package's
default path on this GPU: the Hopper wgmma + TMA forward on an H100/H200), ``piecewise_mma``
(``CUPY_PIECEWISE_PATH=mma``), ``sdpa_flash`` and ``sdpa_cudnn`` (standard attention,
``F.scaled_dot_product_attention``). Batch = 16384 / L, heads = 2048 / D, w = L / 4; FLOPs
4·B·H·L²·D, halved when causal. Median of CUDA-event timings after warm-up. Writes
``results.json`` (header + main rows) and prints a table with the ratios per case.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cupy_piecewise
from cupy_piecewise import capability
from timing import event_median_ms as cuda_ms  # bench/ is on sys.path: run as a script


def with_path(path, fn):
    def run():
        return fn()

    def timed():
        import os

        old = os.environ.get(capability.PATH_VAR)
        os.environ[capability.PATH_VAR] = path
        capability.refresh_env_override()
        try:
            return cuda_ms(run)
        finally:
            if old is None:
                os.environ.pop(capability.PATH_VAR, None)
            else:
                os.environ[capability.PATH_VAR] = old
            capability.refresh_env_override()
    return timed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for results.json")
    ap.add_argument("--lengths", default="2048,8192,16384")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    rows = []
    print(f"{'dtype':8} {'D':>3} {'L':>5} {'causal':6} {'piecewise':>9} {'mma':>6} {'flash':>6} "
          f"{'cudnn':>6}  TFLOP/s   pw/cudnn pw/flash pw/mma")
    for dt_name in args.dtypes.split(","):
        dt = getattr(torch, dt_name)
        for D in map(int, args.dims.split(",")):
            for L in map(int, args.lengths.split(",")):
                for causal in (False, True):
                    B, H = max(1, 16384 // L), 2048 // D
                    w = L // 4
                    g = torch.Generator(device="cuda").manual_seed(L + D)
                    q1, k1, q2, k2, v = (torch.randn(B, H, L, D, device="cuda", dtype=dt,
                                                     generator=g) for _ in range(5))
                    flops = 4 * B * H * L * L * D / (2 if causal else 1)
                    pw = lambda: cupy_piecewise.attention(q1, k1, q2, k2, v, w, causal=causal)  # noqa: E731

                    def sdpa(backend):
                        def f():
                            with sdpa_kernel(backend):
                                return F.scaled_dot_product_attention(q1, k1, v, is_causal=causal)
                        return f

                    ms = {"piecewise": with_path("auto", pw)(), "piecewise_mma": with_path("mma", pw)(),
                          "sdpa_flash": cuda_ms(sdpa(SDPBackend.FLASH_ATTENTION)),
                          "sdpa_cudnn": cuda_ms(sdpa(SDPBackend.CUDNN_ATTENTION))}
                    tf = {k: flops / v / 1e9 for k, v in ms.items()}
                    for prov, t in ms.items():
                        rows.append(dict(dtype=dt_name, B=B, H=H, Hkv=H, M=L, N=L, D=D, L=L,
                                         causal=causal, w=w, provider=prov, phase="fwd",
                                         ms=t, tflops=tf[prov], status="ok"))
                    print(f"{dt_name:8} {D:3d} {L:5d} {str(causal):6} {tf['piecewise']:9.0f} "
                          f"{tf['piecewise_mma']:6.0f} {tf['sdpa_flash']:6.0f} {tf['sdpa_cudnn']:6.0f}"
                          f"           {tf['piecewise'] / tf['sdpa_cudnn']:6.2f}x "
                          f"{tf['piecewise'] / tf['sdpa_flash']:6.2f}x {tf['piecewise'] / tf['piecewise_mma']:6.2f}x",
                          flush=True)
    header = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  cupy_piecewise=cupy_piecewise.__version__,
                  command="python3 bench/forward_paths.py " + " ".join(argv or sys.argv[1:]),
                  statistic="median of 20 CUDA-event timings after 5 warm-up calls",
                  flops="4*B*H*L*L*D, halved when causal")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(dict(header=header, main=rows), indent=1) + "\n")
    print(f"wrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
