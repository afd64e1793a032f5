"""ptxmd5_normalised.py ROOT FILE [-D...]: bench/results/2026-12-03-offline-score-mask-split/ptxmd5.py,
with each entry's md5 taken after dropping mangled names (_Z...) and branch-label numbers
($L__BB<n>_), which change when other entries join or leave the same NVRTC program."""
import hashlib
import re
import runpy
import sys
from pathlib import Path

_md5 = hashlib.md5


def _normalised_md5(data=b"", *args, **kw):
    text = re.sub(r"\$L__BB\d+_", "L_", re.sub(r"_Z\w+", "", data.decode()))
    return _md5(text.encode(), *args, **kw)


hashlib.md5 = _normalised_md5
here = Path(__file__).resolve().parent
runpy.run_path(str(here.parent / "2026-12-03-offline-score-mask-split" / "ptxmd5.py"), run_name="__main__")
