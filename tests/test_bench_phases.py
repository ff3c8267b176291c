"""`bench/phases.py` times the engine's phases by wrapping methods it names; a name the engine no longer has
stops the bench before it measures anything (as it did once the swap moved out of the residency manager).
`bench/step.py` reads the host's own work a step by timing the runner's collects: each launched step's
tokens are collected exactly once, and the engine is left as it was."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import phases  # noqa: E402
import step  # noqa: E402

from engine.request import SamplingParams  # noqa: E402
from tests.helpers import make_engine  # noqa: E402


@pytest.mark.parametrize("owner, names", phases.TIMED, ids=[owner.__name__ for owner, _ in phases.TIMED])
def test_every_timed_phase_exists(owner: type, names: tuple[str, ...]) -> None:
    assert [name for name in names if not callable(getattr(owner, name, None))] == []


def test_the_step_hooks_exist() -> None:
    assert callable(getattr(phases.ModelRunner, "prepare", None))
    assert callable(getattr(phases.llm_engine.LLMEngine, "step", None))


def test_the_step_bench_times_each_collect_once(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir)
    engine.add_request("a", list(range(5, 25)), SamplingParams(max_tokens=4, ignore_eos=True))
    outputs = []
    with step.DeviceWaits(engine) as waits:
        while engine.has_unfinished():
            outputs += engine.step()
    assert len(outputs) == 4 and waits.calls == 4 and waits.seconds > 0  # a prefill step and three decodes
    assert "collect" not in vars(engine.runner)  # the runner's own method again
