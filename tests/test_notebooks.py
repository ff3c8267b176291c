"""Notebooks run top to bottom against the current code (their asserts included)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cells = json.loads(path.read_text())["cells"]
    namespace: dict = {"__name__": "__notebook__"}
    cwd = os.getcwd()
    os.chdir(path.parent)
    try:
        for cell in cells:
            if cell["cell_type"] == "code":
                exec(compile("".join(cell["source"]), f"{path.name}", "exec"), namespace)  # noqa: S102
    finally:
        os.chdir(cwd)
    assert "a 1M-token request fits" in capsys.readouterr().out
