"""Argument checks for piecewise attention, done on metadata only.

Nothing here touches array data or launches GPU work: shapes, dtypes, ranks,
devices and scalar arguments are read from the array objects. The checks work
for NumPy arrays, CuPy arrays and torch tensors, and import neither CuPy nor
torch: the library of an array is told by the module its type comes from.

Every failure is a ``TypeError`` (wrong kind of thing) or ``ValueError``
(right kind, wrong value) whose message names the offending argument
(``q1``, ``k1``, ``q2``, ``k2``, ``v``, ``dist_threshold``, ``causal``,
``sm_scale``, ``o``, ``lse``, ``do``) and says what was expected.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from .capability import HALF_DTYPES

__all__ = [
    "Problem",
    "check_inputs",
    "check_backward_inputs",
    "check_gpu_support",
    "check_deterministic",
    "check_offsets",
    "library_of",
    "dtype_name",
    "GPU_DTYPES",
    "KV_DTYPES",
    "GPU_HEAD_DIMS",
    "CPU_DTYPES",
]

#: dtypes the CUDA kernels take (tensor cores, float32 accumulation). float32 inputs run the
#: mma.sync kernels with TF32 products (docs/semantics.md, float32 on the GPU); the Hopper
#: kernels and the KV-cache kernels take 16-bit inputs only (:data:`KV_DTYPES`).
GPU_DTYPES = ("float16", "bfloat16", "float32")
#: dtypes of the KV-cache entry point's caches and queries on the GPU (the capability
#: table's 16-bit dtypes).
KV_DTYPES = HALF_DTYPES
#: head dims the CUDA kernels are instantiated for.
GPU_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
#: The kernels keep row indices and distances in 32-bit integers (i + N - M - j, tile
#: starts plus tile sizes): lengths must stay below this.
GPU_MAX_LENGTH = 1 << 30

#: dtypes each library's array may have when entering :func:`check_inputs`.
#: NumPy has no bfloat16 of its own; CuPy 14 arrays may have ml_dtypes' bfloat16. GPU
#: limits are applied by :func:`check_gpu_support`, not here.
CPU_DTYPES = {
    "numpy": ("float16", "float32", "float64"),
    "cupy": ("float16", "bfloat16", "float32", "float64"),
    "torch": ("float16", "bfloat16", "float32", "float64"),
}

_INPUT_NAMES = ("q1", "k1", "q2", "k2", "v")
_LIB_DESCRIPTION = "a numpy.ndarray, cupy.ndarray or torch.Tensor"


@dataclass(frozen=True)
class Problem:
    """Everything the back ends need to know about one call, checked.

    Sizes: ``q1``/``q2`` are ``(B, H, M, D)``; ``k1``/``k2``/``v`` are
    ``(B, Hkv, N, D)``. ``w`` is the distance threshold (a Python ``int``),
    ``sm_scale`` the score scale with ``None`` already resolved to
    ``1/sqrt(D)``. ``device`` is the CUDA device index, ``None`` for CPU arrays.
    ``shift`` is ``P`` of the signed distance ``d(i, j) = i + P - j`` between query row
    ``i`` and key ``j``: ``q_offset - k_offset`` when the call gave a ``q_offset``, and
    ``None`` for the default alignment ``P = N - M`` (see :attr:`P`).
    """

    library: str  # 'numpy' | 'cupy' | 'torch'
    B: int
    H: int
    Hkv: int
    M: int
    N: int
    D: int
    dtype: str  # 'float16' | 'bfloat16' | 'float32' | 'float64'
    w: int
    causal: bool
    sm_scale: float
    device: int | None
    shift: int | None = None

    @property
    def P(self) -> int:
        """``P`` of ``d(i, j) = i + P - j``: :attr:`shift`, or ``N - M`` when it is None."""
        return self.N - self.M if self.shift is None else self.shift

    @property
    def group(self) -> int:
        """Query heads per key/value head (1 without grouped-query attention)."""
        return self.H // self.Hkv


# ----------------------------------------------------------------------------
# Array metadata, without importing cupy or torch.


def library_of(x, name: str = "array") -> str:
    """Return ``'numpy'``, ``'cupy'`` or ``'torch'`` for an array, else raise TypeError."""
    module = type(x).__module__.split(".")[0]
    if module == "numpy" and isinstance(x, np.ndarray):
        return "numpy"
    if module == "cupy" and hasattr(x, "device") and hasattr(x, "dtype"):
        return "cupy"
    if module == "torch" and hasattr(x, "device") and hasattr(x, "dtype"):
        return "torch"
    # Subclasses defined elsewhere (torch.nn.Parameter lives in torch, but user
    # subclasses of torch.Tensor or np.ndarray do not): look along the MRO.
    for base in type(x).__mro__[1:]:
        top = base.__module__.split(".")[0]
        if top in ("numpy", "cupy", "torch") and base.__name__ in ("ndarray", "Tensor"):
            return top
    raise TypeError(f"{name} must be {_LIB_DESCRIPTION}, got {type(x).__module__}.{type(x).__qualname__}")


def dtype_name(x) -> str:
    """dtype of an array as a plain name: 'float16', 'bfloat16', 'float32', ..."""
    dt = x.dtype
    name = getattr(dt, "name", None)
    if isinstance(name, str):  # numpy / cupy dtype objects
        return name
    text = str(dt)  # torch.float16 -> 'torch.float16'
    return text.split(".", 1)[1] if text.startswith("torch.") else text


def _device_key(x, library: str) -> tuple[str, int | None]:
    """(device type, index) of an array: ('cpu', None) or ('cuda', 0), ..."""
    if library == "numpy":
        return ("cpu", None)
    if library == "cupy":
        return ("cuda", int(x.device.id))
    dev = x.device  # torch.device
    if dev.type == "cuda":
        return ("cuda", 0 if dev.index is None else int(dev.index))
    return (dev.type, dev.index)


def _describe_device(key: tuple[str, int | None]) -> str:
    kind, index = key
    return kind if index is None else f"{kind}:{index}"


def _shape(x) -> tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


# ----------------------------------------------------------------------------
# Scalars.


def _check_w(dist_threshold) -> int:
    # bool is an int subclass but True/False as a distance is a bug, not an intent.
    if isinstance(dist_threshold, (bool, np.bool_)):
        raise TypeError(f"dist_threshold must be an integer (int or numpy integer), got bool {dist_threshold!r}")
    if isinstance(dist_threshold, (int, np.integer)):
        return int(dist_threshold)
    raise TypeError(
        "dist_threshold must be an integer (int or numpy integer), got "
        f"{type(dist_threshold).__qualname__} {dist_threshold!r}"
    )


#: Position offsets must lie in [-OFFSET_LIMIT, OFFSET_LIMIT] (their difference then fits
#: the int64 of kernel parameters and of torch.library schemas).
OFFSET_LIMIT = 1 << 62


def _check_offset(value, name: str, optional: bool):
    if value is None and optional:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        kind = "an integer or None" if optional else "an integer"
        raise TypeError(f"{name} must be {kind} (int or numpy integer), got "
                        f"{type(value).__qualname__} {value!r}")
    value = int(value)
    if not -OFFSET_LIMIT <= value <= OFFSET_LIMIT:
        raise ValueError(f"{name} must lie in [-2**62, 2**62], got {value}")
    return value


def check_offsets(q_offset, k_offset) -> int | None:
    """``shift`` (``q_offset - k_offset``, or None for the default alignment) from the
    position offsets of a call: query row ``i`` sits at position ``q_offset + i``, key ``j``
    at ``k_offset + j``; ``q_offset=None`` means ``k_offset + N - M`` (queries aligned to
    the end of the keys, where ``k_offset`` cancels out).

    Raises:
        TypeError: ``q_offset`` not an integer or None, ``k_offset`` not an integer (bool
            refused).
        ValueError: an offset outside ``[-2**62, 2**62]``.
    """
    q0 = _check_offset(q_offset, "q_offset", True)
    k0 = _check_offset(k_offset, "k_offset", False)
    return None if q0 is None else q0 - k0


def _check_causal(causal) -> bool:
    if isinstance(causal, (bool, np.bool_)):
        return bool(causal)
    raise TypeError(f"causal must be a bool, got {type(causal).__qualname__} {causal!r}")


def check_deterministic(deterministic) -> bool:
    """``deterministic`` as a bool; TypeError (naming it) for anything but a bool."""
    if isinstance(deterministic, (bool, np.bool_)):
        return bool(deterministic)
    raise TypeError(f"deterministic must be a bool, got {type(deterministic).__qualname__} "
                    f"{deterministic!r}")


def _check_sm_scale(sm_scale, D: int) -> float:
    if sm_scale is None:
        if D < 1:  # (callers that check shapes first never get here with D = 0)
            raise ValueError("q1 has head_dim 0; head_dim (last dimension) must be at least 1")
        return 1.0 / math.sqrt(D)
    if isinstance(sm_scale, (bool, np.bool_)) or not isinstance(sm_scale, numbers.Real):
        raise TypeError(
            f"sm_scale must be a finite positive real number or None, got {type(sm_scale).__qualname__} {sm_scale!r}"
        )
    value = float(sm_scale)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"sm_scale must be a finite positive real number or None, got {sm_scale!r}")
    return value


# ----------------------------------------------------------------------------
# Public checks.


def check_inputs(q1, k1, q2, k2, v, dist_threshold, causal=False, sm_scale=None, q_offset=None,
                 k_offset=0) -> Problem:
    """Check the forward arguments and return the :class:`Problem` they describe.

    Expected: ``q1``, ``q2`` of shape ``(B, H, M, D)``; ``k1``, ``k2``, ``v`` of
    shape ``(B, Hkv, N, D)``, all five from one array library, on one device,
    with one dtype; ``H`` a multiple of ``Hkv``; ``D >= 1``;
    ``dist_threshold`` an integer; ``causal`` a bool; ``sm_scale`` a finite
    positive real or ``None`` (meaning ``1/sqrt(D)``); ``q_offset`` an integer or
    ``None`` and ``k_offset`` an integer (see :func:`check_offsets`).

    Raises:
        TypeError: an argument of the wrong kind (not an array, mixed array
            libraries, mixed or unsupported dtypes, non-integer
            ``dist_threshold``, non-bool ``causal``, non-real ``sm_scale``).
        ValueError: right kind, wrong value (rank, shapes that disagree,
            mixed devices, head counts, ``D == 0``, ``sm_scale <= 0``).
    """
    arrays = dict(zip(_INPUT_NAMES, (q1, k1, q2, k2, v)))

    # 1. One array library.
    libs = {name: library_of(x, name) for name, x in arrays.items()}
    library = libs["q1"]
    for name, lib in libs.items():
        if lib != library:
            raise TypeError(
                f"{name} is a {lib} array but q1 is a {library} array; "
                "q1, k1, q2, k2 and v must all come from one array library"
            )

    # 2. One device.
    devices = {name: _device_key(x, library) for name, x in arrays.items()}
    for name, dev in devices.items():
        if dev != devices["q1"]:
            raise ValueError(
                f"{name} is on device {_describe_device(dev)} but q1 is on device "
                f"{_describe_device(devices['q1'])}; all inputs must be on one device"
            )
    kind, index = devices["q1"]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"q1 is on device {_describe_device(devices['q1'])}; expected a CPU or CUDA device")

    # 3. Rank 4.
    for name, x in arrays.items():
        if len(x.shape) != 4:
            raise ValueError(
                f"{name} must have 4 dimensions (batch, heads, length, head_dim), got shape {_shape(x)}"
            )

    # 4. One supported dtype.
    dtypes = {name: dtype_name(x) for name, x in arrays.items()}
    dtype = dtypes["q1"]
    for name, dt in dtypes.items():
        if dt != dtype:
            raise TypeError(f"{name} has dtype {dt} but q1 has dtype {dtype}; all inputs must share one dtype")
    allowed = CPU_DTYPES[library]
    if dtype not in allowed:
        raise TypeError(f"q1 has dtype {dtype}; {library} inputs must be one of {', '.join(allowed)}")

    # 5. Shapes agree.
    B, H, M, D = _shape(q1)
    _, Hkv, N, _ = _shape(k1)
    if D == 0:
        raise ValueError("q1 has head_dim 0; head_dim (last dimension) must be at least 1")
    dims = ("batch size", "heads", "length", "head_dim")
    for name, x in arrays.items():
        shape = _shape(x)
        if shape[0] != B:
            raise ValueError(f"{name} has batch size {shape[0]} but q1 has batch size {B}")
        if shape[3] != D:
            raise ValueError(f"{name} has head_dim {shape[3]} but q1 has head_dim {D}")
    for name in ("q2",):
        shape = _shape(arrays[name])
        for axis in (1, 2):
            if shape[axis] != (H, M)[axis - 1]:
                raise ValueError(
                    f"{name} has {dims[axis]} {shape[axis]} but q1 has {dims[axis]} {(H, M)[axis - 1]}; "
                    f"q2 must have the shape of q1 {(B, H, M, D)}"
                )
    for name in ("k2", "v"):
        shape = _shape(arrays[name])
        for axis in (1, 2):
            if shape[axis] != (Hkv, N)[axis - 1]:
                raise ValueError(
                    f"{name} has {dims[axis]} {shape[axis]} but k1 has {dims[axis]} {(Hkv, N)[axis - 1]}; "
                    f"{name} must have the shape of k1 {(B, Hkv, N, D)}"
                )
    if Hkv == 0:
        raise ValueError("k1 has 0 heads; k1, k2 and v need at least one key/value head")
    if H % Hkv != 0:
        raise ValueError(
            f"q1 has {H} heads, which is not a multiple of the {Hkv} key/value heads of k1 "
            "(grouped-query attention needs H % Hkv == 0)"
        )

    # 6. Scalars.
    w = _check_w(dist_threshold)
    causal_ = _check_causal(causal)
    scale = _check_sm_scale(sm_scale, D)
    shift = check_offsets(q_offset, k_offset)

    return Problem(
        library=library,
        B=B,
        H=H,
        Hkv=Hkv,
        M=M,
        N=N,
        D=D,
        dtype=dtype,
        w=w,
        causal=causal_,
        sm_scale=scale,
        device=index if kind == "cuda" else None,
        shift=shift,
    )


def check_backward_inputs(problem: Problem, o, lse, do, dlse=None) -> None:
    """Check ``o``, ``lse``, ``do`` (and ``dlse`` when given) against the forward
    :class:`Problem`.

    Expected: same array library and device as the forward inputs; ``o`` and
    ``do`` of shape ``(B, H, M, D)`` with the input dtype; ``lse`` and ``dlse`` of
    shape ``(B, H, M)`` in float32 (float64 is accepted too for CPU arrays, which
    the float64 reference produces before the cast).

    Raises:
        TypeError: wrong library or dtype.
        ValueError: wrong device, rank or shape.
    """
    expected_dev = ("cpu", None) if problem.device is None else ("cuda", problem.device)
    lse_dtypes = ("float32",) if problem.device is not None else ("float32", "float64")
    checks = [
        ("o", o, (problem.B, problem.H, problem.M, problem.D), (problem.dtype,)),
        ("lse", lse, (problem.B, problem.H, problem.M), lse_dtypes),
        ("do", do, (problem.B, problem.H, problem.M, problem.D), (problem.dtype,)),
    ]
    if dlse is not None:
        checks.append(("dlse", dlse, (problem.B, problem.H, problem.M), lse_dtypes))
    for name, x, shape, dtypes in checks:
        lib = library_of(x, name)
        if lib != problem.library:
            raise TypeError(f"{name} is a {lib} array but the inputs are {problem.library} arrays")
        dev = _device_key(x, lib)
        if dev != expected_dev:
            raise ValueError(
                f"{name} is on device {_describe_device(dev)} but the inputs are on device "
                f"{_describe_device(expected_dev)}"
            )
        got = _shape(x)
        if len(got) != len(shape):
            raise ValueError(f"{name} must have {len(shape)} dimensions, shape {shape}; got shape {got}")
        if got != shape:
            raise ValueError(f"{name} must have shape {shape} (from q1), got {got}")
        dt = dtype_name(x)
        if dt not in dtypes:
            raise TypeError(f"{name} has dtype {dt}; expected {' or '.join(dtypes)}")


def check_gpu_support(problem: Problem) -> None:
    """Raise when the CUDA kernels cannot run ``problem``.

    Raises:
        ValueError: CPU arrays (``device`` is None), a head_dim outside
            :data:`GPU_HEAD_DIMS`, or a length of :data:`GPU_MAX_LENGTH` or more.
        TypeError: a dtype outside :data:`GPU_DTYPES`.
    """
    if problem.device is None:
        raise ValueError("q1 is on the CPU; the CUDA kernels need arrays on a CUDA device")
    if problem.dtype not in GPU_DTYPES:
        extra = " (float64 inputs: cast to float32 or a 16-bit type first)" if problem.dtype == "float64" else ""
        raise TypeError(
            f"dtype {problem.dtype} is not supported by the CUDA kernels; expected one of "
            f"{', '.join(GPU_DTYPES)}{extra}"
        )
    if problem.D not in GPU_HEAD_DIMS:
        raise ValueError(
            f"head_dim {problem.D} is not supported by the CUDA kernels; expected one of "
            f"{', '.join(str(d) for d in GPU_HEAD_DIMS)}"
        )
    for name, n in (("q1", problem.M), ("k1", problem.N)):
        if n >= GPU_MAX_LENGTH:
            raise ValueError(
                f"{name} has length {n}; the CUDA kernels index lengths below 2**30 "
                f"({GPU_MAX_LENGTH}) with 32-bit integers")
