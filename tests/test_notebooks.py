"""Notebooks run top to bottom against the current code (their asserts included).

A notebook that reads a benchmark's results runs in the test that produces them:
agent_benchmark.ipynb in tests/test_agent_http.py, after the harness ran against the served app.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
# What each notebook prints once its asserts held; None: executed by the test that makes its input.
PRINTS = {"concurrency.ipynb": "a 1M-token request fits", "agent_benchmark.ipynb": None}


def execute_notebook(path: Path) -> None:
    """Runs the code cells of `path` in one namespace, in the notebook's folder, as Jupyter would."""
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


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if PRINTS.get(p.name)], ids=lambda p: p.name)
def test_notebook_executes(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    execute_notebook(path)
    assert PRINTS[path.name] in capsys.readouterr().out


def test_every_notebook_is_executed_by_a_test() -> None:
    assert {p.name for p in NOTEBOOKS} == set(PRINTS)
