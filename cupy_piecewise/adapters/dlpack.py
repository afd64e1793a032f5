"""Any array with ``__dlpack__`` / ``__dlpack_device__`` (JAX, TensorFlow, PaddlePaddle,
MXNet, your own...): moved zero-copy to CuPy (CUDA memory) or NumPy (CPU memory), run
there, and the results handed back through DLPack as the caller's array type.

The caller's type is rebuilt with, in order: a ``from_dlpack`` attribute of the type
itself, else a ``from_dlpack`` function of the module that defines the type or of a
package above it (``jax.numpy``-style libraries expose one). When none exists the
results stay CuPy (GPU) or NumPy (CPU) arrays, which any DLPack consumer can take.
"""
from __future__ import annotations

import sys

import numpy as np

__all__ = ["attention", "attention_backward", "to_native", "returner"]

#: DLPack device types (dlpack.h).
_CPU, _CUDA, _CUDA_HOST, _CUDA_MANAGED = 1, 2, 3, 13


def to_native(x, name: str):
    """``x`` as a CuPy array (CUDA memory, on its device) or a NumPy array (CPU memory),
    sharing its memory. Raises TypeError for other devices, naming the argument."""
    try:
        kind, index = x.__dlpack_device__()
    except AttributeError:
        raise TypeError(f"{name} must be an array (NumPy, CuPy, torch, or one with "
                        f"__dlpack__/__dlpack_device__), got {type(x).__qualname__}") from None
    kind = int(kind)
    if kind in (_CPU, _CUDA_HOST):
        return np.from_dlpack(x)
    if kind in (_CUDA, _CUDA_MANAGED):
        import cupy

        with cupy.cuda.Device(int(index)):
            return cupy.from_dlpack(x)
    raise TypeError(f"{name} lives on DLPack device type {kind}; expected CPU ({_CPU}) or "
                    f"CUDA ({_CUDA}) memory")


_returners: dict = {}


def returner(t: type):
    """The function that turns a DLPack producer into an array of type ``t`` (see the
    module doc), or ``None``."""
    if t in _returners:
        return _returners[t]
    f = getattr(t, "from_dlpack", None)
    if not callable(f):
        f = None
        parts = t.__module__.split(".")
        for i in range(len(parts), 0, -1):
            mod = sys.modules.get(".".join(parts[:i]))
            g = getattr(mod, "from_dlpack", None)
            if callable(g):
                f = g
                break
    _returners[t] = f
    return f


def _back(t, results):
    f = returner(t)
    if f is None:
        return results
    return tuple(None if r is None else f(r) for r in results)


_NAMES = ("q1", "k1", "q2", "k2", "v")


def attention(q1, k1, q2, k2, v, dist_threshold, *, causal=False, sm_scale=None, return_lse=False,
              deterministic=False, q_offset=None, k_offset=0):
    """Forward of DLPack producers; arguments and errors as :func:`cupy_piecewise.attention`,
    results as the type of ``q1`` (see the module doc)."""
    from .. import api

    ins = [to_native(x, n) for x, n in zip((q1, k1, q2, k2, v), _NAMES)]
    out = api.attention(*ins, dist_threshold, causal=causal, sm_scale=sm_scale,
                        return_lse=return_lse, deterministic=deterministic, q_offset=q_offset,
                        k_offset=k_offset)
    if return_lse:
        return _back(type(q1), out)
    return _back(type(q1), (out,))[0]


def attention_backward(do, q1, k1, q2, k2, v, o, lse, dist_threshold, *, causal=False, sm_scale=None,
                       deterministic=False, q_offset=None, k_offset=0, dlse=None):
    """Backward of DLPack producers; arguments and errors as
    :func:`cupy_piecewise.attention_backward`, results as the type of ``q1``."""
    from .. import api

    names = ("do",) + _NAMES + ("o", "lse")
    ins = [to_native(x, n) for x, n in zip((do, q1, k1, q2, k2, v, o, lse), names)]
    if dlse is not None:
        dlse = to_native(dlse, "dlse")
    grads = api.attention_backward(*ins, dist_threshold, causal=causal, sm_scale=sm_scale,
                                   deterministic=deterministic, q_offset=q_offset,
                                   k_offset=k_offset, dlse=dlse)
    return _back(type(q1), grads)
