"""torch CUDA entry of :func:`cupy_piecewise.attention_varlen`: the operators
``cupy_piecewise::varlen_fwd`` and ``cupy_piecewise::varlen_bwd`` (CUDA kernels, fake
implementations for ``torch.compile``, an autograd formula through which ``o`` and ``lse``
are differentiable).

Tensors are read in place from ``data_ptr()`` and element strides; outputs come from
torch's caching allocator on torch's current stream. With ``max_seqlen_q`` and
``max_seqlen_k`` given nothing reads the running totals on the host, so the call and its
backward capture in a CUDA graph (warm up once outside the capture: the first call compiles
or loads the kernels) and trace with ``torch.compile(fullgraph=True)``.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import validate, varlen_gpu
from .adapters import torch as _adapter

Tensor = torch.Tensor

__all__ = ["attention_varlen", "attention_varlen_backward", "varlen_fwd_op", "varlen_bwd_op"]


def _prepare(q1, k1, q2, k2, v, cu_q, cu_k, w, max_q, max_k, causal, sm_scale):
    return varlen_gpu.prepare(_adapter.OPS, q1, k1, q2, k2, v, cu_q, cu_k, w, max_q, max_k,
                              causal, sm_scale)


@torch.library.custom_op("cupy_piecewise::varlen_fwd", mutates_args=())
def varlen_fwd_op(
    q1: Tensor, k1: Tensor, q2: Tensor, k2: Tensor, v: Tensor, cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor, w: int, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
    sm_scale: float, deterministic: bool = False,
) -> tuple[Tensor, Tensor]:
    """Packed forward -> (o (total_q, H, D), lse (H, total_q) float32); see
    :func:`cupy_piecewise.attention_varlen`. ``deterministic`` is for the backward its
    autograd formula runs."""
    pk = _prepare(q1, k1, q2, k2, v, cu_seqlens_q, cu_seqlens_k, w, max_seqlen_q, max_seqlen_k,
                  causal, sm_scale)
    return varlen_gpu.forward(pk, _adapter.OPS, q1, k1, q2, k2, v, cu_seqlens_q, cu_seqlens_k)


@varlen_fwd_op.register_fake
def _fwd_fake(q1, k1, q2, k2, v, cu_seqlens_q, cu_seqlens_k, w, max_seqlen_q, max_seqlen_k,
              causal, sm_scale, deterministic=False):
    total_q, H, D = q1.shape
    return q1.new_empty((total_q, H, D)), q1.new_empty((H, total_q), dtype=torch.float32)


@torch.library.custom_op("cupy_piecewise::varlen_bwd", mutates_args=())
def varlen_bwd_op(
    do: Tensor, q1: Tensor, k1: Tensor, q2: Tensor, k2: Tensor, v: Tensor, o: Tensor,
    lse: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, w: int, max_seqlen_q: int,
    max_seqlen_k: int, causal: bool, sm_scale: float, dlse: Optional[Tensor] = None,
    deterministic: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Packed backward -> (dq1, dk1, dq2, dk2, dv); see
    :func:`cupy_piecewise.attention_varlen_backward`. ``deterministic`` or
    ``torch.use_deterministic_algorithms(True)``: bitwise-reproducible gradients."""
    pk = _prepare(q1, k1, q2, k2, v, cu_seqlens_q, cu_seqlens_k, w, max_seqlen_q, max_seqlen_k,
                  causal, sm_scale)
    det = deterministic or torch.are_deterministic_algorithms_enabled()
    return varlen_gpu.backward(pk, _adapter.OPS, do, q1, k1, q2, k2, v, o, lse, cu_seqlens_q,
                               cu_seqlens_k, dlse, det)


@varlen_bwd_op.register_fake
def _bwd_fake(do, q1, k1, q2, k2, v, o, lse, cu_seqlens_q, cu_seqlens_k, w, max_seqlen_q,
              max_seqlen_k, causal, sm_scale, dlse=None, deterministic=False):
    return (q1.new_empty(q1.shape), k1.new_empty(k1.shape), q2.new_empty(q2.shape),
            k2.new_empty(k2.shape), v.new_empty(v.shape))


def _setup_context(ctx, inputs, output):
    q1, k1, q2, k2, v, cu_q, cu_k = inputs[:7]
    o, lse = output
    ctx.save_for_backward(q1, k1, q2, k2, v, o, lse, cu_q, cu_k)
    ctx.scalars = tuple(inputs[7:])


def _backward(ctx, do, dlse):
    q1, k1, q2, k2, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    need = ctx.needs_input_grad[:5]
    tail = (None,) * (2 + len(ctx.scalars))  # cu_seqlens and the scalars
    if not any(need):
        return (None,) * 5 + tail
    if do is None:  # only lse reached the loss
        do = torch.zeros_like(o)
    # ctx.scalars: w, max_seqlen_q, max_seqlen_k, causal, sm_scale, deterministic
    grads = varlen_bwd_op(do, q1, k1, q2, k2, v, o, lse, cu_q, cu_k, *ctx.scalars[:5], dlse,
                          ctx.scalars[5])
    return tuple(g if n else None for g, n in zip(grads, need)) + tail


varlen_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _scalars(q1, k1, q2, k2, v, cu_q, cu_k, w, max_q, max_k, causal, sm_scale):
    """The operator's scalar arguments, checked: ``max_seqlen`` found (a host read) when
    None, ``sm_scale`` resolved, ``w`` clamped to the longest sequences (an int64 for any
    integer; the same comparisons)."""
    pk = _prepare(q1, k1, q2, k2, v, cu_q, cu_k, w, max_q, max_k, causal, sm_scale)
    p = pk.problem
    return p.w, p.M, p.N, p.causal, p.sm_scale


def attention_varlen(q1, k1, q2, k2, v, cu_q, cu_k, w, max_q, max_k, causal, sm_scale,
                     return_lse, deterministic=False):
    """``attention_varlen`` for torch CUDA tensors (see
    :func:`cupy_piecewise.attention_varlen`): through ``cupy_piecewise::varlen_fwd``, with
    autograd. Under ``torch.compile`` pass ``max_seqlen_q`` and ``max_seqlen_k``."""
    if torch.compiler.is_compiling():
        if max_q is None or max_k is None:
            raise ValueError("attention_varlen under torch.compile needs max_seqlen_q and "
                             "max_seqlen_k (finding them reads the running totals on the host)")
        w_, scale = validate._check_w(w), validate._check_sm_scale(sm_scale, q1.shape[-1])
        bound = max_q + max_k + 1
        args = (max(-bound, min(bound, w_)), int(max_q), int(max_k),
                validate._check_causal(causal), scale)
    else:
        args = _scalars(q1, k1, q2, k2, v, cu_q, cu_k, w, max_q, max_k, causal, sm_scale)
    det = validate.check_deterministic(deterministic)
    o, lse = varlen_fwd_op(q1, k1, q2, k2, v, cu_q, cu_k, *args, det)
    return (o, lse) if return_lse else o


def attention_varlen_backward(do, q1, k1, q2, k2, v, o, lse, cu_q, cu_k, w, max_q, max_k,
                              causal, sm_scale, dlse, deterministic=False):
    """``attention_varlen_backward`` for torch CUDA tensors."""
    args = _scalars(q1, k1, q2, k2, v, cu_q, cu_k, w, max_q, max_k, causal, sm_scale)
    return varlen_bwd_op(do, q1, k1, q2, k2, v, o, lse, cu_q, cu_k, *args, dlse,
                         validate.check_deterministic(deterministic))
