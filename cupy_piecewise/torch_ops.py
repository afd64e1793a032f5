"""Piecewise attention for torch tensors: CUDA kernels and a CPU implementation.

Two operators are registered with :func:`torch.library.custom_op`:

``cupy_piecewise::fwd(q1, k1, q2, k2, v, w, causal, sm_scale) -> (o, lse)``
``cupy_piecewise::bwd(do, q1, k1, q2, k2, v, o, lse, w, causal, sm_scale) -> (dq1, dk1, dq2, dk2, dv)``

with fake (meta) implementations for ``torch.compile`` and an autograd formula
(``fwd``'s backward calls ``bwd``), so ``torch.compile(fullgraph=True)``,
``torch.autograd`` and CUDA-graph capture all see one opaque operator.
``w`` is an ``int``, ``causal`` a ``bool`` and ``sm_scale`` a ``float`` (already
resolved from ``None``) -- non-tensor arguments, never differentiated.

CUDA tensors (float16, bfloat16; head dim 16, 32, 64, 80, 96, 128 or 256) go to the CUDA kernels
through the core (:mod:`cupy_piecewise.core`) and the torch adapter
(:mod:`cupy_piecewise.adapters.torch`). The kernels read the inputs in place from their
``data_ptr()`` and element strides (zero copy, no DLPack, no CuPy array in the hot
path); an input the kernels cannot read in place (last dimension not unit-stride, a
stride that is not a multiple of 8 elements, or a data pointer not 16-byte aligned)
is copied once into a contiguous buffer. Outputs are fresh contiguous tensors from
torch's caching allocator. Work is launched on torch's current stream of the
tensors' device, read at every call; nothing synchronises the host with the device,
so the operators can be captured into CUDA graphs.

CPU tensors (float16, bfloat16, float32, float64) use a torch implementation
(:mod:`cupy_piecewise.torch_cpu`) of the formulas in docs/semantics.md, computed in float32 for float16/bfloat16/float32 inputs and in
float64 for float64 inputs, processing query rows in chunks so that the score
matrices stay below a fixed memory budget.

``lse`` is float32, except for float64 CPU inputs where it is float64 (the CPU path
keeps full precision so that ``torch.autograd.gradcheck`` holds). ``lse`` carries
gradients (``ds = p * (dp - delta + dlse)``; :func:`attention`'s Returns). Double
backward is not supported (``bwd`` has no autograd formula).

Per-call cost: the argument checks (:func:`cupy_piecewise.validate.check_inputs`) and
the launch planning (tile lookup, grid, the packed kernel parameters:
:class:`cupy_piecewise.launch.Launches`) are memoised per signature by
:func:`cupy_piecewise.core.prepare` (shapes, strides,
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

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from . import core, torch_cpu, validate
from .adapters import torch as _adapter
from .capability import plan_switches as _plan_switches

__all__ = ["attention", "attention_backward", "fwd_op", "bwd_op"]

Tensor = torch.Tensor
_memo_get = core.MEMO.get
_run_forward = core.run_forward
_OPS = _adapter.OPS


def _call(q1, k1, q2, k2, v, w, causal, sm_scale, q_offset=None, k_offset=0) -> core.Call:
    """:func:`cupy_piecewise.core.prepare` for torch tensors (memoised per signature; a hit
    is looked up here, saving the call). Raises what
    :func:`~cupy_piecewise.validate.check_inputs` raises."""
    try:
        key = _adapter.key(q1, k1, q2, k2, v, w, causal, sm_scale, q_offset, k_offset)
        hit = _memo_get((key, _plan_switches()))
    except (AttributeError, TypeError):  # not tensors, or an unhashable scalar
        key = hit = None
    if hit is not None:
        return hit
    return core.prepare(_adapter.OPS, key, q1, k1, q2, k2, v, w, causal, sm_scale, q_offset,
                        k_offset)


def _problem(q1, k1, q2, k2, v, w, causal, sm_scale, q_offset=None, k_offset=0) -> validate.Problem:
    """The checked :class:`~cupy_piecewise.validate.Problem` of a call (memoised)."""
    return _call(q1, k1, q2, k2, v, w, causal, sm_scale, q_offset, k_offset).problem


# ---------------------------------------------------------------------------
# The operators.


def _fwd_impl(q1, k1, q2, k2, v, w, causal, sm_scale, call=None, need_lse=True, q_offset=None,
              k_offset=0):
    """Body of ``cupy_piecewise::fwd``; ``call`` (a :class:`cupy_piecewise.core.Call`) when
    the caller already checked the arguments. ``need_lse=False`` lets CUDA calls skip
    ``lse`` (then possibly ``None``)."""
    if call is None:
        call = _call(q1, k1, q2, k2, v, w, causal, sm_scale, q_offset, k_offset)
    p = call.problem
    if p.device is not None:
        return _adapter.forward(call, q1, k1, q2, k2, v, need_lse)
    if torch.is_autocast_enabled("cpu"):  # the CPU path picks its own precision
        with torch.autocast("cpu", enabled=False):
            return torch_cpu.forward(q1, k1, q2, k2, v, p.w, p.causal, p.sm_scale, p.shift)
    return torch_cpu.forward(q1, k1, q2, k2, v, p.w, p.causal, p.sm_scale, p.shift)


def _bwd_impl(do, q1, k1, q2, k2, v, o, lse, w, causal, sm_scale, call=None, deterministic=False,
              q_offset=None, k_offset=0, dlse=None):
    """Body of ``cupy_piecewise::bwd``; ``call`` when the caller already checked.
    ``deterministic`` or ``torch.use_deterministic_algorithms(True)``: bitwise-reproducible
    gradients. ``dlse``: gradient of the loss with respect to ``lse`` (None: zero)."""
    if call is None:
        call = _call(q1, k1, q2, k2, v, w, causal, sm_scale, q_offset, k_offset)
    p = call.problem
    if p.device is not None:
        det = deterministic or torch.are_deterministic_algorithms_enabled()
        return _adapter.backward(call, do, q1, k1, q2, k2, v, o, lse, det, dlse)
    args = (do, q1, k1, q2, k2, v, o, lse, p.w, p.causal, p.sm_scale, p.shift, dlse)
    if torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return torch_cpu.backward(*args)
    return torch_cpu.backward(*args)


@torch.library.custom_op("cupy_piecewise::fwd", mutates_args=())
def fwd_op(
    q1: Tensor, k1: Tensor, q2: Tensor, k2: Tensor, v: Tensor, w: int, causal: bool, sm_scale: float,
    deterministic: bool = False, q_offset: Optional[int] = None, k_offset: int = 0,
) -> tuple[Tensor, Tensor]:
    """Piecewise attention forward -> (o (B, H, M, D), lse (B, H, M)); see :func:`attention`.
    ``deterministic`` is for the backward its autograd formula runs."""
    return _fwd_impl(q1, k1, q2, k2, v, w, causal, sm_scale, q_offset=q_offset, k_offset=k_offset)


@fwd_op.register_fake
def _fwd_fake(q1, k1, q2, k2, v, w, causal, sm_scale, deterministic=False, q_offset=None, k_offset=0):
    B, H, M, D = q1.shape
    o = q1.new_empty((B, H, M, D))
    lse = q1.new_empty((B, H, M), dtype=torch_cpu.lse_dtype(q1.dtype, q1.device))
    return o, lse


@torch.library.custom_op("cupy_piecewise::bwd", mutates_args=())
def bwd_op(
    do: Tensor, q1: Tensor, k1: Tensor, q2: Tensor, k2: Tensor, v: Tensor, o: Tensor, lse: Tensor,
    w: int, causal: bool, sm_scale: float, deterministic: bool = False,
    q_offset: Optional[int] = None, k_offset: int = 0, dlse: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Piecewise attention backward -> (dq1, dk1, dq2, dk2, dv); see :func:`attention_backward`."""
    return _bwd_impl(do, q1, k1, q2, k2, v, o, lse, w, causal, sm_scale,
                     deterministic=deterministic, q_offset=q_offset, k_offset=k_offset, dlse=dlse)


@bwd_op.register_fake
def _bwd_fake(do, q1, k1, q2, k2, v, o, lse, w, causal, sm_scale, deterministic=False,
              q_offset=None, k_offset=0, dlse=None):
    return (
        q1.new_empty(q1.shape), k1.new_empty(k1.shape), q2.new_empty(q2.shape),
        k2.new_empty(k2.shape), v.new_empty(v.shape),
    )


#: The operator's non-tensor inputs after v and their defaults.
_FWD_SCALARS = ("w", "causal", "sm_scale", "deterministic", "q_offset", "k_offset")
_FWD_DEFAULTS = (False, None, 0)


def _setup_context(ctx, inputs, output):
    q1, k1, q2, k2, v = inputs[:5]
    scalars = tuple(inputs[5:]) + _FWD_DEFAULTS[len(inputs) - 8:]
    o, lse = output
    ctx.save_for_backward(q1, k1, q2, k2, v, o, lse)
    ctx.w, ctx.causal, ctx.sm_scale, ctx.deterministic, ctx.q_offset, ctx.k_offset = scalars
    ctx.n_inputs = len(inputs)


def _backward(ctx, do, dlse):
    """Gradients of the five tensors; ``lse`` is differentiable (its gradient ``dlse``
    enters the backward kernels through delta)."""
    q1, k1, q2, k2, v, o, lse = ctx.saved_tensors
    need = ctx.needs_input_grad[:5]
    tail = (None,) * (getattr(ctx, "n_inputs", 11) - 5)
    if not any(need):
        return (None,) * 5 + tail
    if do is None:  # only lse reached the loss
        do = torch.zeros_like(o)
    grads = bwd_op(do, q1, k1, q2, k2, v, o, lse, ctx.w, ctx.causal, ctx.sm_scale,
                   bool(ctx.deterministic), ctx.q_offset, ctx.k_offset, dlse)
    return tuple(g if n else None for g, n in zip(grads, need)) + tail


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


def _private(obj, name, fallback):
    """``obj.name`` when this torch has it, else ``fallback``: a private API renamed in a
    later torch must not break ``import``; the fallbacks send every call through the
    registered operator (always correct, a little slower)."""
    return getattr(obj, name, None) or fallback


_functorch = getattr(torch._C, "_functorch", None)
_peek_functorch = _private(_functorch, "peek_interpreter_stack", lambda: "unknown")
_dispatch_modes = _private(torch._C, "_len_torch_dispatch_stack", lambda: 1)
_function_modes = _private(torch._C, "_is_torch_function_mode_enabled", lambda: True)
_any_autocast = _private(torch._C, "_is_any_autocast_enabled", lambda: True)
_is_compiling = torch.compiler.is_compiling

#: How an eager call runs (see :func:`_route`).
_DIRECT, _FUNCTION, _OPERATOR = 0, 1, 2


def _route(*tensors) -> int:
    """_DIRECT (no gradient to record), _FUNCTION (record it with :class:`_Attention`) or
    _OPERATOR (go through ``torch.ops.cupy_piecewise``), per :data:`DIRECT_EAGER_CALLS`."""
    if not DIRECT_EAGER_CALLS or _dispatch_modes() or _function_modes() or \
            _peek_functorch() is not None:
        return _OPERATOR
    for t in tensors:
        if type(t) is not Tensor:
            return _OPERATOR
    if torch.is_grad_enabled():
        for t in tensors:
            if t.requires_grad:
                return _FUNCTION
    return _DIRECT


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
    memoised :class:`cupy_piecewise.core.Call` of the signature carried along. Double
    backward raises."""

    @staticmethod
    def forward(ctx, call, deterministic, q1, k1, q2, k2, v):
        p = call.problem
        o, lse = _fwd_impl(q1, k1, q2, k2, v, p.w, p.causal, p.sm_scale, call)
        ctx.save_for_backward(q1, k1, q2, k2, v, o, lse)
        ctx.call, ctx.deterministic = call, deterministic
        ctx.set_materialize_grads(False)  # an unused o or lse arrives as None
        return o, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dlse):
        need = ctx.needs_input_grad[2:]
        if not any(need):
            return (None,) * 7
        q1, k1, q2, k2, v, o, lse = ctx.saved_tensors
        p = ctx.call.problem
        if do is None:  # only lse reached the loss
            do = torch.zeros_like(o)
        grads = _bwd_impl(do, q1, k1, q2, k2, v, o, lse, p.w, p.causal, p.sm_scale, ctx.call,
                          ctx.deterministic, dlse=dlse)
        return (None, None) + tuple(g if n else None for g, n in zip(grads, need))


def _autocast(q1, k1, q2, k2, v):
    """Cast float32 inputs to the autocast dtype when autocast is on for their device."""
    dev = q1.device.type
    if dev not in ("cuda", "cpu") or not torch.is_autocast_enabled(dev):
        return q1, k1, q2, k2, v
    dt = torch.get_autocast_dtype(dev)
    return tuple(t.to(dt) if t.dtype == torch.float32 else t for t in (q1, k1, q2, k2, v))


#: ``w`` as the operators' ``int`` (int64) schema takes it under ``torch.compile``, where
#: shapes may be symbolic: any clamp beyond every possible length keeps the meaning.
_W_LIMIT = 1 << 62


def attention(
    q1: Tensor, k1: Tensor, q2: Tensor, k2: Tensor, v: Tensor, dist_threshold: int, *,
    causal: bool = False, sm_scale: Optional[float] = None, return_lse: bool = False,
    deterministic: bool = False, q_offset: Optional[int] = None, k_offset: int = 0,
):
    """Piecewise attention of torch tensors, differentiable (``o`` and ``lse``).

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
        deterministic: make the gradients autograd computes for this call bitwise
            reproducible (see :func:`attention_backward`); so does
            ``torch.use_deterministic_algorithms(True)``.
        q_offset, k_offset: positions of query row 0 and key 0 (``int``; ``q_offset=None``
            means ``k_offset + N - M``): ``d = (q_offset + i) - (k_offset + j)``.

    Devices and dtypes:
        CUDA: float16 or bfloat16, ``D`` in 16, 32, 64, 80, 96, 128, 256; float32 with TF32
        products and float32 outputs and gradients, ``D`` up to 128 (under
        ``torch.autocast("cuda")`` float32 inputs run in the autocast dtype instead).
        Inputs are read in place; one whose last dimension is not unit-stride (or other
        strides not multiples of 16 bytes, or a data pointer not 16-byte aligned) is
        copied once. Launched on
        torch's current stream; no host-device synchronisation (CUDA-graph safe).
        CPU: float16, bfloat16, float32 (computed in float32) and float64 (computed in
        float64); under ``torch.autocast("cpu")`` float32 inputs run in the autocast dtype.

    Returns:
        ``o`` of shape ``(B, H, M, D)`` in the input dtype (contiguous), or ``(o, lse)``
        with ``lse`` of shape ``(B, H, M)``: natural-log sum of exp of the scores,
        float32 (float64 for float64 CPU inputs). Rows without any admissible key
        (causal with ``d < 0`` for every key, or ``N == 0``) give ``o = 0`` and
        ``lse = -inf``. ``lse`` carries gradients: a loss that uses it (merging partial
        attentions by their lse, say) gets the exact gradient (``ds = p * (dp - delta +
        dlse)``); rows with ``lse = -inf`` contribute none.

    Raises:
        TypeError: non-tensor inputs, mixed or unsupported dtypes, non-integer
            ``dist_threshold``, non-bool ``causal``, non-real ``sm_scale``.
        ValueError: wrong rank, shapes that disagree, ``H % Hkv != 0``, mixed devices,
            a head dim the CUDA kernels do not support, non-positive ``sm_scale``.
    """
    det = validate.check_deterministic(deterministic)
    if _any_autocast() and isinstance(q1, Tensor):
        q1, k1, q2, k2, v = _autocast(q1, k1, q2, k2, v)
    if _is_compiling():
        # Traced by dynamo: the operator body checks the arguments when it runs
        # (memoised, so once per signature); the fake implementation gives shapes.
        # Offsets are checked here, before the operator's int64 schema sees them (eager
        # calls check them in _call, once per signature).
        # The scalars are checked here too: the schema would turn w=True into 1 and
        # causal=1 into True before the body could refuse them (a symbolic w or scale,
        # under dynamic shapes, passes through to the body's checks).
        validate.check_offsets(q_offset, k_offset)
        w, scale = dist_threshold, sm_scale
        if not isinstance(w, torch.SymInt):
            w = max(-_W_LIMIT, min(_W_LIMIT, validate._check_w(w)))
        causal = validate._check_causal(causal)
        if not isinstance(scale, torch.SymFloat):
            scale = validate._check_sm_scale(scale, q1.shape[-1])
        o, lse = fwd_op(q1, k1, q2, k2, v, w, causal, scale, det, q_offset, k_offset)
    else:
        call = _call(q1, k1, q2, k2, v, dist_threshold, causal, sm_scale, q_offset, k_offset)
        route = _route(q1, k1, q2, k2, v)
        p = call.problem  # w clamped to the sequences: fits the operators' int64
        if route == _DIRECT and p.device is not None:  # the hot path: straight to the core
            o, lse = _run_forward(call, _OPS, q1, k1, q2, k2, v, need_lse=return_lse)
        elif route == _DIRECT:  # nothing to record: lse only if asked for
            o, lse = _fwd_impl(q1, k1, q2, k2, v, p.w, p.causal, p.sm_scale, call, return_lse)
        elif route == _FUNCTION:
            o, lse = _Attention.apply(call, det, q1, k1, q2, k2, v)
        else:
            o, lse = fwd_op(q1, k1, q2, k2, v, p.w, p.causal, p.sm_scale, det,
                            *_offsets_of(p))
    return (o, lse) if return_lse else o


def attention_backward(
    do: Tensor, q1: Tensor, k1: Tensor, q2: Tensor, k2: Tensor, v: Tensor, o: Tensor, lse: Tensor,
    dist_threshold: int, *, causal: bool = False, sm_scale: Optional[float] = None,
    deterministic: bool = False, q_offset: Optional[int] = None, k_offset: int = 0,
    dlse: Optional[Tensor] = None,
):
    """Gradients of piecewise attention, without autograd.

    Args:
        do: ``(B, H, M, D)`` gradient of ``o``, input dtype.
        q1, k1, q2, k2, v, dist_threshold, causal, sm_scale: as given to :func:`attention`.
        o, lse: the forward outputs (``attention(..., return_lse=True)``); ``lse``
            float32 (float64 accepted for CPU tensors).
        deterministic: bitwise-identical gradients run to run (the Hopper backward then
            computes dQ without float32 atomics); also on with
            ``torch.use_deterministic_algorithms(True)``. Other paths always are.
        q_offset, k_offset: as given to :func:`attention`.
        dlse: ``(B, H, M)`` gradient of the loss with respect to ``lse`` (float32; float64
            accepted on the CPU), or None: ``ds = p * (dp - delta + dlse)``.

    Returns:
        ``(dq1, dk1, dq2, dk2, dv)`` in the input dtype, contiguous: ``dq*`` of shape
        ``(B, H, M, D)``, ``dk*``/``dv`` of shape ``(B, Hkv, N, D)`` (summed over the
        query heads of each group). Rows without admissible keys contribute nothing.

    Raises:
        TypeError / ValueError: as :func:`attention`, and for ``o``, ``lse``, ``do``
            of the wrong library, device, shape or dtype.
    """
    det = validate.check_deterministic(deterministic)
    call = _call(q1, k1, q2, k2, v, dist_threshold, causal, sm_scale, q_offset, k_offset)
    p = call.problem
    validate.check_backward_inputs(p, o, lse, do, dlse)
    args = (do, q1, k1, q2, k2, v, o, lse, p.w, p.causal, p.sm_scale)
    extra = (do, q1, k1, q2, k2, v, o, lse) + (() if dlse is None else (dlse,))
    if _direct_ok(*extra):
        return _bwd_impl(*args, call, det, dlse=dlse)
    return bwd_op(*args, det, *_offsets_of(p), dlse)


def _offsets_of(p: validate.Problem) -> tuple:
    """``(q_offset, k_offset)`` of a checked problem for the operators' schemas: its
    clamped shift as ``q_offset`` with ``k_offset = 0`` (``w`` is clamped to match)."""
    return (p.shift, 0)
