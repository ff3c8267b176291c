"""Fixtures: model directories built once per session."""

from __future__ import annotations

import os

import torch

# Triton kernels run under the interpreter on machines without a GPU. Triton decides this
# when a kernel is defined, so it must be set before anything imports `kernels`.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from engine.tiny import make_tiny  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny"), seed=0)
