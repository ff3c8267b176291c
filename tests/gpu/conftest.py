"""GPU-only tests: every test in this folder is skipped where CUDA is not available.

Deliberately imports neither triton nor `kernels`: on a CPU machine the kernel
tests elsewhere must be the first to import triton (under TRITON_INTERPRET=1).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)
