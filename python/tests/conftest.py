import sys
from pathlib import Path

import pytest

# Use the source tree's package (and build/libmegamoe_c.so) when not installed.
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

cuda_only = pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="no CUDA device visible")
