"""Fixtures: model directories built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.tiny import make_tiny


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny"), seed=0)
