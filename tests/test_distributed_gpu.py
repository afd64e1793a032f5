"""Context parallelism on two GPUs: cupy_piecewise.distributed over NCCL (one process per
GPU), both methods and layouts, causal and not, w inside, on and across shard boundaries;
o and all five gradients (bfloat16) against the float64 reference by the tolerance rule.
Needs two CUDA devices (the device tool's nvidia-h200-x2 machine)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import distributed_cases  # noqa: E402  (tests/ is on sys.path)

pytestmark = pytest.mark.gpu


def test_nccl_two_gpus_match_the_reference(tmp_path):
    import torch.distributed as dist

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, torch sees {torch.cuda.device_count()}")
    if not dist.is_nccl_available():
        pytest.skip("NCCL is not available in this torch")
    distributed_cases.run_and_check(2, tmp_path, "nccl", 256, "bfloat16", 1, 4, 2, 64, 40)


def test_nccl_two_gpus_32k_within_the_single_gpu_error(tmp_path):
    """The issue's target: at L = 32768 (causal, zigzag, w = L/4 + 3 so that d = w crosses
    chunk boundaries, GQA 2:1, D = 128, both methods with their default pieces), o and every
    gradient are within twice the single-GPU call's error of the float64 reference."""
    import torch.distributed as dist

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, torch sees {torch.cuda.device_count()}")
    if not dist.is_nccl_available():
        pytest.skip("NCCL is not available in this torch")
    L = 32768
    distributed_cases.run_and_check_long(2, tmp_path, L, 1, 2, 1, 128, "bfloat16", L // 4 + 3)
