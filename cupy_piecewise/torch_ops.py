"""Piecewise attention for torch tensors: CUDA kernels and a CPU implementation.

Two operators are registered with :func:`torch.library.custom_op`:

``cupy_piecewise::fwd(q1, k1, q2, k2, v, w, causal, sm_scale) -> (o, lse)``
``cupy_piecewise::bwd(do, q1, k1, q2, k2, v, o, lse, w, causal, sm_scale) -> (dq1, dk1, dq2, dk2, dv)``

with fake (meta) implementations for ``torch.compile`` and an autograd formula
(``fwd``'s backward calls ``bwd``), so ``torch.compile(fullgraph=True)``,
``torch.autograd`` and CUDA-graph capture all see one opaque operator.
``w`` is an ``int``, ``causal`` a ``bool`` and ``sm_scale`` a ``float`` (already
resolved from ``None``) -- non-tensor arguments, never differentiated.

CUDA tensors (float16, bfloat16; head dim 16, 32, 64 or 128) go to the CUDA kernels
through :mod:`cupy_piecewise.launch`. The kernels read the inputs in place from their
``data_ptr()`` and element strides (zero copy, no DLPack, no CuPy array in the hot
path); an input the kernels cannot read in place (last dimension not unit-stride, a
stride that is not a multiple of 8 elements, or a data pointer not 16-byte aligned)
is copied once into a contiguous buffer. Outputs are fresh contiguous tensors from
torch's caching allocator. Work is launched on torch's current stream of the
tensors' device, read at every call; nothing synchronises the host with the device,
so the operators can be captured into CUDA graphs.

CPU tensors (float16, bfloat16, float32, float64) use a torch implementation of the
formulas in SPEC.md, computed in float32 for float16/bfloat16/float32 inputs and in
float64 for float64 inputs, processing query rows in chunks so that the score
matrices stay below a fixed memory budget.

``lse`` is float32, except for float64 CPU inputs where it is float64 (the CPU path
keeps full precision so that ``torch.autograd.gradcheck`` holds). ``lse`` is an
auxiliary output: it is marked non-differentiable (a gradient flowing into it is
not propagated). Double backward is not supported (``bwd`` has no autograd formula).

Per-call cost: the argument checks (:func:`cupy_piecewise.validate.check_inputs`) and
the launch planning (tile lookup, grid, the packed kernel parameters:
:class:`cupy_piecewise.launch.Launches`) are memoised per signature (shapes, strides,
dtypes, devices, scalar values and types, tile override), so a repeated eager call
builds a key, allocates its outputs, writes seven pointers and calls
``cuLaunchKernel``. Eager calls skip torch's dispatcher (:data:`DIRECT_EAGER_CALLS`):
one that records no gradient calls the operator's implementation directly, and one
that does records a :class:`torch.autograd.Function` with the operator's autograd
formula; under ``torch.compile``, ``vmap``/``grad``, fake tensors, dispatch or function
modes, or with tensor subclasses, the registered operator is used. A direct call that
does not ask for ``lse`` neither allocates nor stores it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from . import validate

__all__ = ["attention", "attention_backward", "fwd_op", "bwd_op"]

Tensor = torch.Tensor

# ---------------------------------------------------------------------------
# Per-signature memo: validation and the prepared CUDA launches.
#
# check_inputs is pure Python over metadata and costs tens of microseconds, and planning
# a launch (tile lookup, grid, parameter block) a few more; both depend only on the
# metadata in the key below, so the results are kept in a dict and a repeated call pays
# for the key and one lookup. The types of the scalars are part of the key so that,
# e.g., ``w=3.0`` (rejected) never hits the entry made by ``w=3``; the tile override
# (CUPY_PIECEWISE_TILES) is part of it so that a tuning run sees its change.


class _Call:
    """What one call signature needs: the checked problem and, for CUDA inputs the
    kernels can read in place, the prepared forward launches (``None``: general path)."""

    __slots__ = ("problem", "launches", "o_shape", "lse_shape")

    def __init__(self, problem, launches):
        self.problem = problem
        self.launches = launches
        self.o_shape = (problem.B, problem.H, problem.M, problem.D)
        self.lse_shape = (problem.B, problem.H, problem.M)


_CALLS: dict = {}
_CALLS_MAX = 4096
_env_override = None  # capability.env_override, bound on first use (see _call)


def _key(q1, k1, q2, k2, v, w, causal, sm_scale):
    return (
        q1.shape, k1.shape, q2.shape, k2.shape, v.shape,
        q1.stride(), k1.stride(), q2.stride(), k2.stride(), v.stride(),
        q1.dtype, k1.dtype, q2.dtype, k2.dtype, v.dtype,
        q1.device, k1.device, q2.device, k2.device, v.device,
        type(w), w, type(causal), causal, type(sm_scale), sm_scale, _env_override(),
    )


def _call(q1, k1, q2, k2, v, w, causal, sm_scale) -> _Call:
    """validate.check_inputs (plus check_gpu_support and launch planning for CUDA
    tensors), memoised per signature. Raises what check_inputs raises."""
    global _env_override
    if _env_override is None:
        from .capability import env_override

        _env_override = env_override
    try:
        key = _key(q1, k1, q2, k2, v, w, causal, sm_scale)
        hit = _CALLS.get(key)
    except (AttributeError, TypeError):  # not tensors, or an unhashable scalar
        key = hit = None
    if hit is not None:
        return hit
    problem = validate.check_inputs(q1, k1, q2, k2, v, w, causal, sm_scale)
    if problem.library != "torch":
        raise TypeError(
            f"q1 is a {problem.library} array; cupy_piecewise.torch_ops takes torch.Tensor inputs"
        )
    launches = None
    if problem.device is not None:
        validate.check_gpu_support(problem)
        launches = _fwd_launches(problem, q1, k1, q2, k2, v)
    hit = _Call(problem, launches)
    if key is not None:
        if len(_CALLS) >= _CALLS_MAX:
            _CALLS.clear()
        _CALLS[key] = hit
    return hit


def _problem(q1, k1, q2, k2, v, w, causal, sm_scale) -> validate.Problem:
    """The checked :class:`~cupy_piecewise.validate.Problem` of a call (memoised)."""
    return _call(q1, k1, q2, k2, v, w, causal, sm_scale).problem


def _lse_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    return torch.float64 if (dtype == torch.float64 and device.type == "cpu") else torch.float32


# ---------------------------------------------------------------------------
# CUDA path.

_launch = None
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _launch_module():
    global _launch
    if _launch is None:
        from . import launch  # imports CuPy; only needed for CUDA tensors

        _launch = launch
    return _launch


def _current_stream(index: int) -> int:
    """cudaStream_t (as int) of torch's current stream on device ``index``.

    Same value as ``torch.cuda.current_stream(index).cuda_stream``, without building
    a ``torch.cuda.Stream`` object (this is what Inductor's generated code uses).
    """
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


#: Allocator of the CUDA outputs (and of the backward's delta workspace). Tests swap in
#: a NaN-filling version to show that the kernels write every element.
_empty = torch.empty


def _kernel_array(t: Tensor, launch) -> Tensor:
    """``t`` itself if the kernels can read it in place, else a contiguous copy.

    ``Tensor.contiguous()`` returns ``t`` unchanged when torch already calls it
    contiguous even though the kernels cannot use it (a storage offset that breaks
    16-byte alignment, odd strides on size-1 dims); a fresh allocation is used then.
    The copy runs on the current stream, and freeing it after the call is safe
    because the caching allocator only reuses it for later work on that stream.
    """
    if launch.kernel_ready(t.shape, t.stride(), t.data_ptr(), t.element_size()):
        return t
    c = t.contiguous()
    if c is t or not launch.kernel_ready(c.shape, c.stride(), c.data_ptr(), c.element_size()):
        c = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        c.copy_(t)
    return c


def _ref(t: Tensor, launch):
    return launch.ArrayRef(t.data_ptr(), t.stride())


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _fwd_launches(problem, q1, k1, q2, k2, v):
    """Prepared forward launches for inputs with these shapes and strides, or ``None``
    when calls of this signature take the general path (an input to copy, no work).

    Data pointers are not part of the signature: :func:`_fwd_cuda` still checks their
    16-byte alignment at every call.
    """
    if problem.M == 0 or problem.N == 0 or problem.B * problem.H == 0:
        return None
    launch = _launch or _launch_module()
    ins = (q1, k1, q2, k2, v)
    if not all(launch.kernel_ready(t.shape, t.stride(), 0, t.element_size()) for t in ins):
        return None
    strides = tuple(t.stride() for t in ins) + (_contiguous_strides(q1.shape),)
    return launch.forward_launches(problem, strides, split=True)


def _fwd_cuda(problem, q1, k1, q2, k2, v, launches=None, need_lse=True):
    """Forward of CUDA tensors -> (o, lse); ``launches`` from :func:`_fwd_launches`.

    With ``need_lse=False`` a call that takes the prepared launches neither allocates
    nor stores ``lse`` and returns ``(o, None)`` (the kernels skip a null lse).
    """
    dev = q1.device
    B, H, M, D = problem.B, problem.H, problem.M, problem.D
    o = _empty((B, H, M, D), dtype=q1.dtype, device=dev)
    if launches is not None:
        # The fast path: strides were checked when the signature was first seen.
        p = (q1.data_ptr(), k1.data_ptr(), q2.data_ptr(), k2.data_ptr(), v.data_ptr())
        if not (p[0] | p[1] | p[2] | p[3] | p[4]) & 15:
            if need_lse:
                lse = _empty((B, H, M), dtype=torch.float32, device=dev)
                ptrs = p + (o.data_ptr(), lse.data_ptr())
            else:
                lse, ptrs = None, p + (o.data_ptr(), 0)
            stream = _current_stream(problem.device)
            if launches.workspace_bytes:
                ws = torch.empty(launches.workspace_bytes, dtype=torch.uint8, device=dev)
                launches.run(ptrs, stream, ws.data_ptr())
                # freeing ws now is safe: the caching allocator reuses it only for work
                # queued on this stream after the kernels
            else:
                launches.run(ptrs, stream)
            return o, lse
    lse = _empty((B, H, M), dtype=torch.float32, device=dev)
    if o.numel() == 0:
        return o, lse
    if problem.N == 0:  # no keys: every row is empty
        o.zero_()
        lse.fill_(-math.inf)
        return o, lse
    launch = _launch or _launch_module()
    # (the list keeps any copies alive until the launch is enqueued)
    ins = [_kernel_array(t, launch) for t in (q1, k1, q2, k2, v)]
    # lse (contiguous float32) travels as a bare pointer, as launch.forward expects.
    launch.forward(
        problem,
        *[_ref(t, launch) for t in ins],
        _ref(o, launch),
        lse.data_ptr(),
        stream=_current_stream(problem.device),
        workspace=lambda n: _workspace(n, dev),
    )
    return o, lse


def _workspace(nbytes: int, dev):
    """Split-KV scratch from torch's caching allocator (stream-ordered, graph-capture safe)."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    return buf, buf.data_ptr()


def _bwd_cuda(problem, do, q1, k1, q2, k2, v, o, lse):
    B, H, Hkv, M, N, D = problem.B, problem.H, problem.Hkv, problem.M, problem.N, problem.D
    dev, dt = q1.device, q1.dtype
    dq1 = _empty((B, H, M, D), dtype=dt, device=dev)
    dq2 = _empty((B, H, M, D), dtype=dt, device=dev)
    dk1 = _empty((B, Hkv, N, D), dtype=dt, device=dev)
    dk2 = _empty((B, Hkv, N, D), dtype=dt, device=dev)
    dv = _empty((B, Hkv, N, D), dtype=dt, device=dev)
    if B * Hkv == 0:
        return dq1, dk1, dq2, dk2, dv
    if M == 0 or N == 0:  # nothing attends: all gradients are zero
        for g in (dq1, dk1, dq2, dk2, dv):
            g.zero_()
        return dq1, dk1, dq2, dk2, dv
    launch = _launch or _launch_module()
    delta = _empty((B, H, M), dtype=torch.float32, device=dev)
    # Copies made by _kernel_array must stay referenced until the launch is enqueued:
    # a block freed earlier could be handed to the next copy and overwritten first.
    ins = [_kernel_array(t, launch) for t in (q1, k1, q2, k2, v, o, do)]
    # lse and delta (contiguous float32) travel as bare pointers, as launch.backward expects.
    if not (lse.dtype == torch.float32 and lse.is_contiguous()):
        lse = lse.to(torch.float32, memory_format=torch.contiguous_format)
    refs = [_ref(t, launch) for t in ins]
    launch.backward(
        problem,
        *refs[:6],
        lse.data_ptr(),
        refs[6],
        *[_ref(g, launch) for g in (dq1, dk1, dq2, dk2, dv)],
        delta.data_ptr(),
        stream=_current_stream(problem.device),
    )
    return dq1, dk1, dq2, dk2, dv


# ---------------------------------------------------------------------------
# CPU path.

#: Upper bound on the elements of one (B, H, rows, N) score matrix per chunk.
_CPU_CHUNK_ELEMENTS = 1 << 22


def _chunk_rows(B: int, H: int, N: int) -> int:
    return max(1, _CPU_CHUNK_ELEMENTS // max(1, B * H * N))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scores(q1c, q2c, k1, k2, r0, r1, P, N, w, causal, sm_scale, G):
    """Scaled, masked scores of query rows [r0, r1) against all keys.

    q1c, q2c: (B, Hkv, G*rows, D); k1, k2: (B, Hkv, N, D), compute dtype.
    -> s (B, Hkv, G*rows, N) with -inf at excluded keys, and use2 (rows, N), True
    where d(i, j) >= w (the second projection).
    """
    dev = q1c.device
    i = torch.arange(r0, r1, device=dev).unsqueeze(1)
    j = torch.arange(N, device=dev).unsqueeze(0)
    d = i + P - j  # signed distance, (rows, N)
    use2 = d >= w
    s1 = torch.matmul(q1c, k1.transpose(-1, -2))
    s2 = torch.matmul(q2c, k2.transpose(-1, -2))
    B, Hkv, GR, _ = s1.shape
    s = torch.where(use2, s2.view(B, Hkv, G, r1 - r0, N), s1.view(B, Hkv, G, r1 - r0, N))
    s = s * sm_scale
    if causal:
        s = s.masked_fill(d < 0, -math.inf)
    return s.view(B, Hkv, GR, N), use2


def _rows(x, r0, r1, Hkv, G, ct):
    """Rows [r0, r1) of a (B, H, M, D) tensor as (B, Hkv, G*rows, D) in dtype ct."""
    B, H, _, D = x.shape
    return x[:, :, r0:r1].to(ct).reshape(B, Hkv, G * (r1 - r0), D)


def _unrows(x, B, H, rows, D):
    return x.reshape(B, H, rows, D)


def _fwd_cpu(q1, k1, q2, k2, v, w, causal, sm_scale):
    B, H, M, D = q1.shape
    _, Hkv, N, _ = k1.shape
    ct = _compute_dtype(q1.dtype)
    o = torch.empty((B, H, M, D), dtype=q1.dtype)
    lse = torch.empty((B, H, M), dtype=_lse_dtype(q1.dtype, q1.device))
    if o.numel() == 0:
        return o, lse
    G = H // Hkv
    P = N - M
    k1c, k2c, vc = k1.to(ct), k2.to(ct), v.to(ct)
    step = _chunk_rows(B, H, N)
    for r0 in range(0, M, step):
        r1 = min(M, r0 + step)
        rows = r1 - r0
        s, _ = _scores(
            _rows(q1, r0, r1, Hkv, G, ct), _rows(q2, r0, r1, Hkv, G, ct),
            k1c, k2c, r0, r1, P, N, w, causal, sm_scale, G,
        )
        m = torch.logsumexp(s, dim=-1, keepdim=True)  # -inf for rows without keys
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m_safe)  # exactly 0 at excluded keys and on empty rows
        oc = torch.matmul(p, vc)
        o[:, :, r0:r1] = _unrows(oc, B, H, rows, D)
        lse[:, :, r0:r1] = m.reshape(B, H, rows)
    return o, lse


def _bwd_cpu(do, q1, k1, q2, k2, v, o, lse, w, causal, sm_scale):
    B, H, M, D = q1.shape
    _, Hkv, N, _ = k1.shape
    ct = _compute_dtype(q1.dtype)
    dt = q1.dtype
    if B * Hkv == 0 or M == 0 or N == 0:
        return (
            torch.zeros((B, H, M, D), dtype=dt), torch.zeros((B, Hkv, N, D), dtype=dt),
            torch.zeros((B, H, M, D), dtype=dt), torch.zeros((B, Hkv, N, D), dtype=dt),
            torch.zeros((B, Hkv, N, D), dtype=dt),
        )
    G = H // Hkv
    P = N - M
    k1c, k2c, vc = k1.to(ct), k2.to(ct), v.to(ct)
    dq1 = torch.empty((B, H, M, D), dtype=dt)
    dq2 = torch.empty((B, H, M, D), dtype=dt)
    dk1 = torch.zeros((B, Hkv, N, D), dtype=ct)
    dk2 = torch.zeros((B, Hkv, N, D), dtype=ct)
    dv = torch.zeros((B, Hkv, N, D), dtype=ct)
    step = _chunk_rows(B, H, N)
    for r0 in range(0, M, step):
        r1 = min(M, r0 + step)
        rows = r1 - r0
        q1c, q2c = _rows(q1, r0, r1, Hkv, G, ct), _rows(q2, r0, r1, Hkv, G, ct)
        doc, oc = _rows(do, r0, r1, Hkv, G, ct), _rows(o, r0, r1, Hkv, G, ct)
        s, use2 = _scores(q1c, q2c, k1c, k2c, r0, r1, P, N, w, causal, sm_scale, G)
        m = lse[:, :, r0:r1].to(ct).reshape(B, Hkv, G * rows, 1)
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m_safe)
        delta = (doc * oc).sum(-1, keepdim=True)
        dp = torch.matmul(doc, vc.transpose(-1, -2))
        ds = (p * (dp - delta)).view(B, Hkv, G, rows, N)
        zero = torch.zeros((), dtype=ct)
        ds1 = torch.where(use2, zero, ds).view(B, Hkv, G * rows, N)
        ds2 = torch.where(use2, ds, zero).view(B, Hkv, G * rows, N)
        dv += torch.matmul(p.transpose(-1, -2), doc)
        dk1 += torch.matmul(ds1.transpose(-1, -2), q1c) * sm_scale
        dk2 += torch.matmul(ds2.transpose(-1, -2), q2c) * sm_scale
        dq1[:, :, r0:r1] = _unrows(torch.matmul(ds1, k1c) * sm_scale, B, H, rows, D)
        dq2[:, :, r0:r1] = _unrows(torch.matmul(ds2, k2c) * sm_scale, B, H, rows, D)
    return dq1, dk1.to(dt), dq2, dk2.to(dt), dv.to(dt)


# ---------------------------------------------------------------------------
# The operators.


def _fwd_impl(q1, k1, q2, k2, v, w, causal, sm_scale, call=None, need_lse=True):
    """Body of ``cupy_piecewise::fwd``; ``call`` (a :class:`_Call`) when the caller
    already checked the arguments. ``need_lse=False`` lets CUDA calls skip ``lse``
    (then possibly ``None``)."""
    if call is None:
        call = _call(q1, k1, q2, k2, v, w, causal, sm_scale)
    problem = call.problem
    if problem.device is not None:
        return _fwd_cuda(problem, q1, k1, q2, k2, v, call.launches, need_lse)
    if torch.is_autocast_enabled("cpu"):  # the CPU path picks its own precision
        with torch.autocast("cpu", enabled=False):
            return _fwd_cpu(q1, k1, q2, k2, v, problem.w, problem.causal, problem.sm_scale)
    return _fwd_cpu(q1, k1, q2, k2, v, problem.w, problem.causal, problem.sm_scale)


def _bwd_impl(do, q1, k1, q2, k2, v, o, lse, w, causal, sm_scale, problem=None):
    """Body of ``cupy_piecewise::bwd``; ``problem`` when the caller already checked."""
    if problem is None:
        problem = _problem(q1, k1, q2, k2, v, w, causal, sm_scale)
    if problem.device is not None:
        return _bwd_cuda(problem, do, q1, k1, q2, k2, v, o, lse)
    if torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return _bwd_cpu(do, q1, k1, q2, k2, v, o, lse, problem.w, problem.causal, problem.sm_scale)
    return _bwd_cpu(do, q1, k1, q2, k2, v, o, lse, problem.w, problem.causal, problem.sm_scale)


@torch.library.custom_op("cupy_piecewise::fwd", mutates_args=())
def fwd_op(
    q1: Tensor, k1: Tensor, q2: Tensor, k2: Tensor, v: Tensor, w: int, causal: bool, sm_scale: float
) -> tuple[Tensor, Tensor]:
    """Piecewise attention forward -> (o (B, H, M, D), lse (B, H, M)); see :func:`attention`."""
    return _fwd_impl(q1, k1, q2, k2, v, w, causal, sm_scale)


@fwd_op.register_fake
def _fwd_fake(q1, k1, q2, k2, v, w, causal, sm_scale):
    B, H, M, D = q1.shape
    o = q1.new_empty((B, H, M, D))
    lse = q1.new_empty((B, H, M), dtype=_lse_dtype(q1.dtype, q1.device))
    return o, lse


@torch.library.custom_op("cupy_piecewise::bwd", mutates_args=())
def bwd_op(
    do: Tensor, q1: Tensor, k1: Tensor, q2: Tensor, k2: Tensor, v: Tensor, o: Tensor, lse: Tensor,
    w: int, causal: bool, sm_scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Piecewise attention backward -> (dq1, dk1, dq2, dk2, dv); see :func:`attention_backward`."""
    return _bwd_impl(do, q1, k1, q2, k2, v, o, lse, w, causal, sm_scale)


@bwd_op.register_fake
def _bwd_fake(do, q1, k1, q2, k2, v, o, lse, w, causal, sm_scale):
    return (
        q1.new_empty(q1.shape), k1.new_empty(k1.shape), q2.new_empty(q2.shape),
        k2.new_empty(k2.shape), v.new_empty(v.shape),
    )


def _setup_context(ctx, inputs, output):
    q1, k1, q2, k2, v, w, causal, sm_scale = inputs
    o, lse = output
    ctx.save_for_backward(q1, k1, q2, k2, v, o, lse)
    ctx.w, ctx.causal, ctx.sm_scale = w, causal, sm_scale
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, dlse):
    q1, k1, q2, k2, v, o, lse = ctx.saved_tensors
    need = ctx.needs_input_grad[:5]
    if not any(need):
        return None, None, None, None, None, None, None, None
    grads = bwd_op(do, q1, k1, q2, k2, v, o, lse, ctx.w, ctx.causal, ctx.sm_scale)
    return tuple(g if n else None for g, n in zip(grads, need)) + (None, None, None)


fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------
# Public functions (called by cupy_piecewise.api for torch tensors).


#: Eager calls skip torch's dispatcher when nothing needs it: a call that records no
#: gradient runs the operator's implementation directly, and one that does records it
#: through a :class:`torch.autograd.Function` with the same formula as the operator's
#: registered autograd (the dispatcher and the custom-op autograd wrapper cost tens of
#: microseconds of Python per call). Under ``torch.compile``, dispatch or function
#: modes (FakeTensor, opcheck), functorch transforms (vmap, grad) or with tensor
#: subclasses (Parameter included) the registered operator is used. Set to False to
#: always go through ``torch.ops.cupy_piecewise``.
DIRECT_EAGER_CALLS = True

_peek_functorch = torch._C._functorch.peek_interpreter_stack
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)

#: How an eager call runs (see :func:`_route`).
_DIRECT, _FUNCTION, _OPERATOR = 0, 1, 2


def _route(*tensors) -> int:
    """_DIRECT (no gradient to record), _FUNCTION (record it with :class:`_Attention`) or
    _OPERATOR (go through ``torch.ops.cupy_piecewise``), per :data:`DIRECT_EAGER_CALLS`."""
    if not DIRECT_EAGER_CALLS or _dispatch_modes() or _function_modes() or \
            _peek_functorch() is not None:
        return _OPERATOR
    grad = torch.is_grad_enabled()
    route = _DIRECT
    for t in tensors:
        if type(t) is not Tensor:
            return _OPERATOR
        if grad and t.requires_grad:
            route = _FUNCTION
    return route


def _direct_ok(*tensors) -> bool:
    """True when calling the implementation directly is indistinguishable from the op.

    That is: plain ``torch.Tensor`` arguments (no subclass such as FakeTensor or
    Parameter), no gradient to record, no TorchDispatchMode / TorchFunctionMode
    active, no functorch transform (vmap, grad) in progress.
    """
    return _route(*tensors) == _DIRECT


class _Attention(torch.autograd.Function):
    """Eager autograd without the dispatcher: the forward and backward of the registered
    operator's autograd formula (:func:`_setup_context`, :func:`_backward`), with the
    memoised :class:`_Call` of the signature carried along. Double backward raises."""

    @staticmethod
    def forward(ctx, call, q1, k1, q2, k2, v):
        p = call.problem
        o, lse = _fwd_impl(q1, k1, q2, k2, v, p.w, p.causal, p.sm_scale, call)
        ctx.save_for_backward(q1, k1, q2, k2, v, o, lse)
        ctx.problem = p
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dlse):
        need = ctx.needs_input_grad[1:]
        if not any(need):
            return (None,) * 6
        q1, k1, q2, k2, v, o, lse = ctx.saved_tensors
        p = ctx.problem
        grads = _bwd_impl(do, q1, k1, q2, k2, v, o, lse, p.w, p.causal, p.sm_scale, p)
        return (None,) + tuple(g if n else None for g, n in zip(grads, need))


def _autocast(q1, k1, q2, k2, v):
    """Cast float32 inputs to the autocast dtype when autocast is on for their device."""
    dev = q1.device.type
    if dev not in ("cuda", "cpu") or not torch.is_autocast_enabled(dev):
        return q1, k1, q2, k2, v
    dt = torch.get_autocast_dtype(dev)
    return tuple(t.to(dt) if t.dtype == torch.float32 else t for t in (q1, k1, q2, k2, v))


def attention(
    q1: Tensor, k1: Tensor, q2: Tensor, k2: Tensor, v: Tensor, dist_threshold: int, *,
    causal: bool = False, sm_scale: Optional[float] = None, return_lse: bool = False,
):
    """Piecewise attention of torch tensors, differentiable.

    Score of query row ``i`` and key ``j``, with ``d = i + N - M - j``:
    ``sm_scale * q2[i]·k2[j]`` if ``d >= dist_threshold`` else ``sm_scale * q1[i]·k1[j]``;
    keys with ``d < 0`` are excluded when ``causal``; softmax over keys; ``o = p @ v``.

    Args:
        q1, q2: ``(B, H, M, D)`` queries.
        k1, k2, v: ``(B, Hkv, N, D)`` keys and values; ``H`` a multiple of ``Hkv``
            (grouped-query attention: query head ``h`` reads key head ``h // (H // Hkv)``).
            All five share one dtype and one device. Any strides.
        dist_threshold: ``int`` ``w``, any value (negative, beyond the sequence).
        causal: exclude keys after the query (``d < 0``).
        sm_scale: score scale; ``None`` means ``1/sqrt(D)``.
        return_lse: also return ``lse``.

    Devices and dtypes:
        CUDA: float16 or bfloat16, ``D`` in 16, 32, 64, 128 (float32 inputs are run in
        the autocast dtype under ``torch.autocast("cuda")``). Inputs are read in place;
        one whose last dimension is not unit-stride (or other strides not multiples of 8
        elements, or a data pointer not 16-byte aligned) is copied once. Launched on
        torch's current stream; no host-device synchronisation (CUDA-graph safe).
        CPU: float16, bfloat16, float32 (computed in float32) and float64 (computed in
        float64); under ``torch.autocast("cpu")`` float32 inputs run in the autocast dtype.

    Returns:
        ``o`` of shape ``(B, H, M, D)`` in the input dtype (contiguous), or ``(o, lse)``
        with ``lse`` of shape ``(B, H, M)``: natural-log sum of exp of the scores,
        float32 (float64 for float64 CPU inputs). Rows without any admissible key
        (causal with ``i + N - M < 0``, or ``N == 0``) give ``o = 0`` and ``lse = -inf``.
        ``lse`` does not carry gradients.

    Raises:
        TypeError: non-tensor inputs, mixed or unsupported dtypes, non-integer
            ``dist_threshold``, non-bool ``causal``, non-real ``sm_scale``.
        ValueError: wrong rank, shapes that disagree, ``H % Hkv != 0``, mixed devices,
            a head dim the CUDA kernels do not support, non-positive ``sm_scale``.
    """
    if _any_autocast() and isinstance(q1, Tensor):
        q1, k1, q2, k2, v = _autocast(q1, k1, q2, k2, v)
    if torch.compiler.is_compiling():
        # Traced by dynamo: the operator body checks the arguments when it runs
        # (memoised, so once per signature); the fake implementation gives shapes.
        scale = 1.0 / math.sqrt(q1.shape[-1]) if sm_scale is None else float(sm_scale)
        o, lse = fwd_op(q1, k1, q2, k2, v, dist_threshold, causal, scale)
    else:
        call = _call(q1, k1, q2, k2, v, dist_threshold, causal, sm_scale)
        route = _route(q1, k1, q2, k2, v)
        p = call.problem
        if route == _DIRECT:  # nothing to record: lse only if asked for
            o, lse = _fwd_impl(q1, k1, q2, k2, v, p.w, p.causal, p.sm_scale, call, return_lse)
        elif route == _FUNCTION:
            o, lse = _Attention.apply(call, q1, k1, q2, k2, v)
        else:
            o, lse = fwd_op(q1, k1, q2, k2, v, p.w, p.causal, p.sm_scale)
    return (o, lse) if return_lse else o


def attention_backward(
    do: Tensor, q1: Tensor, k1: Tensor, q2: Tensor, k2: Tensor, v: Tensor, o: Tensor, lse: Tensor,
    dist_threshold: int, *, causal: bool = False, sm_scale: Optional[float] = None,
):
    """Gradients of piecewise attention, without autograd.

    Args:
        do: ``(B, H, M, D)`` gradient of ``o``, input dtype.
        q1, k1, q2, k2, v, dist_threshold, causal, sm_scale: as given to :func:`attention`.
        o, lse: the forward outputs (``attention(..., return_lse=True)``); ``lse``
            float32 (float64 accepted for CPU tensors).

    Returns:
        ``(dq1, dk1, dq2, dk2, dv)`` in the input dtype, contiguous: ``dq*`` of shape
        ``(B, H, M, D)``, ``dk*``/``dv`` of shape ``(B, Hkv, N, D)`` (summed over the
        query heads of each group). Rows without admissible keys contribute nothing.

    Raises:
        TypeError / ValueError: as :func:`attention`, and for ``o``, ``lse``, ``do``
            of the wrong library, device, shape or dtype.
    """
    problem = _problem(q1, k1, q2, k2, v, dist_threshold, causal, sm_scale)
    validate.check_backward_inputs(problem, o, lse, do)
    args = (do, q1, k1, q2, k2, v, o, lse, problem.w, problem.causal, problem.sm_scale)
    if _direct_ok(do, q1, k1, q2, k2, v, o, lse):
        return _bwd_impl(*args, problem)
    return bwd_op(*args)
