"""The array-library-agnostic core: one path from checked metadata to kernel launches.

Adapters (:mod:`cupy_piecewise.adapters`) translate an array library's objects into
pointers, element strides, allocations and a stream; everything else lives here once:

- :mod:`.memo`: the lock-protected, bounded memo of call signatures;
- :mod:`.plan`: :func:`~.plan.prepare` (validate + plan + prepared launches, memoised)
  and :func:`~.plan.run_forward` / :func:`~.plan.run_backward`, which own the per-call
  pointer checks, copies of inputs the kernels cannot read, workspaces, the empty-problem
  fill (``o = 0``, ``lse = -inf``, zero gradients) and the clamping of ``w``.
"""
from .memo import Memo
from .plan import (MEMO, ArrayOps, Call, SharedRows, clamp_w, finish_dq, prepare, run_backward,
                   run_forward, shared_rows, signature)

__all__ = ["MEMO", "Memo", "ArrayOps", "Call", "clamp_w", "prepare", "run_forward", "run_backward",
           "signature", "SharedRows", "shared_rows", "finish_dq"]
