"""NumPy arrays: the float64 reference (:mod:`cupy_piecewise.reference`) on the CPU.

Results are cast back to the input dtype (``lse`` to float32), so a NumPy caller sees
the same dtypes a GPU caller does.
"""
from __future__ import annotations

import numpy as np

from .. import reference, validate
from ..core import clamp_w

__all__ = ["attention", "attention_backward"]


def _opt_int(x):
    return None if x is None else int(x)


def attention(q1, k1, q2, k2, v, dist_threshold, *, causal=False, sm_scale=None, return_lse=False,
              deterministic=False, q_offset=None, k_offset=0):
    """Forward of NumPy arrays; arguments, results and errors as :func:`cupy_piecewise.attention`
    (the reference is deterministic: ``deterministic`` is only checked)."""
    validate.check_deterministic(deterministic)
    p = clamp_w(validate.check_inputs(q1, k1, q2, k2, v, dist_threshold, causal, sm_scale,
                                      q_offset, k_offset))
    # the reference takes the caller's own w and offsets (it clamps in its own way)
    o, lse = reference.forward(q1, k1, q2, k2, v, int(dist_threshold), p.causal, p.sm_scale,
                               q_offset=_opt_int(q_offset), k_offset=int(k_offset))
    o = np.asarray(o).astype(p.dtype, copy=False)
    lse = np.asarray(lse).astype(np.float32, copy=False)
    return (o, lse) if return_lse else o


def attention_backward(do, q1, k1, q2, k2, v, o, lse, dist_threshold, *, causal=False, sm_scale=None,
                       deterministic=False, q_offset=None, k_offset=0, dlse=None):
    """Backward of NumPy arrays; arguments, results and errors as
    :func:`cupy_piecewise.attention_backward` (the reference is deterministic)."""
    validate.check_deterministic(deterministic)
    p = clamp_w(validate.check_inputs(q1, k1, q2, k2, v, dist_threshold, causal, sm_scale,
                                      q_offset, k_offset))
    validate.check_backward_inputs(p, o, lse, do, dlse)
    grads = reference.backward(q1, k1, q2, k2, v, o, lse, do, int(dist_threshold), p.causal,
                               p.sm_scale, q_offset=_opt_int(q_offset), k_offset=int(k_offset),
                               dlse=dlse)
    return tuple(np.asarray(g).astype(p.dtype, copy=False) for g in grads)
