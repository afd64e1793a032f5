"""cupy-piecewise: piecewise attention for CuPy, PyTorch and NumPy.

The score of query ``i`` and key ``j`` comes from ``q1·k1`` when the key lies
less than ``dist_threshold`` positions behind the query and from ``q2·k2``
otherwise (ReRoPE / NLPE style length extrapolation). See :func:`attention`
and :func:`attention_backward`; ``python -m cupy_piecewise info`` reports the
environment.

Importing the package needs only NumPy; CuPy and torch are imported when an
array of theirs is passed.
"""

__version__ = "0.1.0"

from .api import attention, attention_backward  # noqa: E402
from .kvcache import attention_with_kvcache  # noqa: E402
from .kvcache_rotary import apply_rotary, attention_with_rotary_kvcache  # noqa: E402
from .varlen import attention_varlen, attention_varlen_backward  # noqa: E402
from .validate import GPU_DTYPES, GPU_HEAD_DIMS, Problem, check_inputs  # noqa: E402

__all__ = [
    "__version__",
    "attention",
    "attention_backward",
    "attention_varlen",
    "attention_varlen_backward",
    "attention_with_kvcache",
    "attention_with_rotary_kvcache",
    "apply_rotary",
    "Problem",
    "check_inputs",
    "GPU_DTYPES",
    "GPU_HEAD_DIMS",
]
