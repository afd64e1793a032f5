"""Context parallelism on two GPUs: cupy_piecewise.distributed over NCCL (one process per
GPU), both methods and layouts, causal and not, w inside, on and across shard boundaries;
o and all five gradients (bfloat16) against the float64 reference by the tolerance rule.
Needs two CUDA devices (the device tool's nvidia-h200-x2 machine)."""
from __future__ import annotations

import json
import socket

import pytest

torch = pytest.importorskip("torch")

import distributed_cases  # noqa: E402  (tests/ is on sys.path)

pytestmark = pytest.mark.gpu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nccl_two_gpus_match_the_reference(tmp_path):
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, torch sees {torch.cuda.device_count()}")
    if not dist.is_nccl_available():
        pytest.skip("NCCL is not available in this torch")
    world, local_len = 2, 256
    init = f"tcp://127.0.0.1:{_free_port()}"
    mp.spawn(distributed_cases.worker,
             args=(world, init, str(tmp_path), "nccl", local_len, "bfloat16", 1, 4, 2, 64),
             nprocs=world, join=True)
    report = json.loads((tmp_path / f"report_{world}.json").read_text())
    assert len(report) == len(distributed_cases.cases(world, local_len))
    bad = [r for r in report if "error" in r or not r["passed"]]
    assert not bad, json.dumps(bad[:3], indent=1)
