"""NumPy arrays: the float64 reference (:mod:`cupy_piecewise.reference`) on the CPU.

Results are cast back to the input dtype (``lse`` to float32), so a NumPy caller sees
the same dtypes a GPU caller does.
"""
from __future__ import annotations

import numpy as np

from .. import reference, validate
from ..core import clamp_w

__all__ = ["attention", "attention_backward"]


def attention(q1, k1, q2, k2, v, dist_threshold, *, causal=False, sm_scale=None, return_lse=False,
              deterministic=False):
    """Forward of NumPy arrays; arguments, results and errors as :func:`cupy_piecewise.attention`
    (the reference is deterministic: ``deterministic`` is only checked)."""
    validate.check_deterministic(deterministic)
    p = clamp_w(validate.check_inputs(q1, k1, q2, k2, v, dist_threshold, causal, sm_scale))
    o, lse = reference.forward(q1, k1, q2, k2, v, p.w, p.causal, p.sm_scale)
    o = np.asarray(o).astype(p.dtype, copy=False)
    lse = np.asarray(lse).astype(np.float32, copy=False)
    return (o, lse) if return_lse else o


def attention_backward(do, q1, k1, q2, k2, v, o, lse, dist_threshold, *, causal=False, sm_scale=None,
                       deterministic=False):
    """Backward of NumPy arrays; arguments, results and errors as
    :func:`cupy_piecewise.attention_backward` (the reference is deterministic)."""
    validate.check_deterministic(deterministic)
    p = clamp_w(validate.check_inputs(q1, k1, q2, k2, v, dist_threshold, causal, sm_scale))
    validate.check_backward_inputs(p, o, lse, do)
    grads = reference.backward(q1, k1, q2, k2, v, o, lse, do, p.w, p.causal, p.sm_scale)
    return tuple(np.asarray(g).astype(p.dtype, copy=False) for g in grads)
