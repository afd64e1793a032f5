"""Fresh random seeds for the GPU tests, and a way to replay one.

Each test that draws inputs calls :func:`fresh_seed` and prints the seed in its failure
message. ``PW_TEST_SEED=N`` in the environment makes every draw return N, so a failure seen
once replays, e.g.::

    PW_TEST_SEED=7164795616750225254 python3 -m pytest -m gpu tests/test_varlen_gpu.py \\
        -k "test_packed_batches_match_reference and mma-float16-32-True-case3"
"""
from __future__ import annotations

import os

import numpy as np

ENV = "PW_TEST_SEED"


def fresh_seed() -> int:
    """A new 63-bit seed from the OS's entropy, or ``PW_TEST_SEED`` when that is set."""
    forced = os.environ.get(ENV, "").strip()
    if forced:
        return int(forced)
    return int(np.random.SeedSequence().entropy % 2**63)
