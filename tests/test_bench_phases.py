"""`bench/phases.py` times the engine's phases by wrapping methods it names; a name the engine no longer has
stops the bench before it measures anything (as it did once the swap moved out of the residency manager)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import phases  # noqa: E402


@pytest.mark.parametrize("owner, names", phases.TIMED, ids=[owner.__name__ for owner, _ in phases.TIMED])
def test_every_timed_phase_exists(owner: type, names: tuple[str, ...]) -> None:
    assert [name for name in names if not callable(getattr(owner, name, None))] == []


def test_the_step_hooks_exist() -> None:
    assert callable(getattr(phases.ModelRunner, "prepare", None))
    assert callable(getattr(phases.llm_engine.LLMEngine, "step", None))
