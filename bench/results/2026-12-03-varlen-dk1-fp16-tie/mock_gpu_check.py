"""CPU smoke test of varlen_diag.gpu_main's control flow: a NumPy-backed stand-in for the
few cupy calls it makes, so cupy_piecewise takes its CPU (NumPy) path. Checks the script
runs end to end and prints its reports; the numbers are the CPU path's, not a kernel's.
Run: .venv/bin/python bench/results/2026-12-03-varlen-dk1-fp16-tie/mock_gpu_check.py"""
import os, sys, tempfile, types
import numpy as np

fake = types.ModuleType("cupy")
fake.asarray = np.asarray
fake.asnumpy = np.asarray
fake.float32, fake.uint16, fake.float16 = np.float32, np.uint16, np.float16
fake.full = np.full
fake.empty = np.empty
class _NotAnArray:  # no array is a (fake) cupy array: cupy_piecewise takes the NumPy path
    pass
fake.ndarray = _NotAnArray
class _Stream:
    def synchronize(self):
        pass
class _Dev:
    id = 0
fake.cuda = types.SimpleNamespace(
    Device=_Dev, get_current_stream=lambda: _Stream(),
    runtime=types.SimpleNamespace(getDeviceProperties=lambda i: {"name": b"MOCK (numpy)"}))
sys.modules["cupy"] = fake

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import varlen_diag as V  # noqa: E402
from cupy_piecewise import launch  # noqa: E402
launch._compute_capability = lambda dev: (9, 0)
os.environ["OUT"] = tempfile.mkdtemp()
os.environ.setdefault("PW_TEST_SEED", str(V.SEED))
V.gpu_main(V.SEED, variants=True)
print("saved:", os.listdir(os.environ["OUT"]))
