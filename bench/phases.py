"""Where a policy run's time goes: `bench/policies.py` with its engine phases timed.

Wraps the scheduler, the step builder, the worker's forward, the attention ops, the
resolves, the mirrors and the residency manager's moves in timers that synchronise
the GPU before and after each call, so a phase's time includes the GPU work it queued
(the run is slower than an untimed one; compare phases, not totals, with the plain
bench). Calls made while a CUDA graph is captured are not timed, and a replayed decode
graph calls no Python: under graphs the forward's phases count the eager steps only.
After each policy it prints seconds per phase and the mean step time by the step's kind
(decode only, prefill, extends of requests with host-only pages), and writes every
step's record to `$OUT/steps-<policy>-<trace>.json`. A step far above its kind's mean
is a stall (a kernel compile shows up this way).

Usage: python bench/phases.py [policies.py arguments], e.g.
`python bench/phases.py --scale 0.0625 --turns 13 --trace model --policies hybrid offload`
"""

from __future__ import annotations

import collections
import functools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import policies  # noqa: E402
from engine import llm_engine, triton_ops  # noqa: E402
from engine.attention import Indexer  # noqa: E402
from engine.attention_ops import TorchAttentionOps  # noqa: E402
from engine.forward_batch import ForwardBatch  # noqa: E402
from engine.layers import MoE  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from residency.rank import RankResidency  # noqa: E402
from engine.rank.worker import Worker  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402
from residency.hot_leases import HotLeases  # noqa: E402
from residency.manager import ResidencyManager  # noqa: E402
from residency.mirroring import Mirroring  # noqa: E402
from residency.swapping import Swapping  # noqa: E402

TIMED: list[tuple[type, tuple[str, ...]]] = [
    (Scheduler, ("schedule", "after_step")),
    (Worker, ("launch_model",)),
    (ForwardBatch, ("from_step",)),
    (MoE, ("forward",)),
    (Indexer, ("forward",)),
    (triton_ops.TritonAttentionOps, ("indexer_topk", "sparse_mla")),
    (TorchAttentionOps, ("indexer_topk", "sparse_mla")),
    (RankResidency, ("resolve_rows", "resolve_decode", "load", "mirror", "counts_into")),
    (ResidencyManager, ("demote", "promote")),
    (Swapping, ("swap_in", "swap_out")),
    (Mirroring, ("mirror_step", "poll")),
    (HotLeases, ("size_for", "lease", "release")),
]


class PhaseTimer:
    """Seconds and calls per phase, and one record per engine step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()
        self.steps: list[dict[str, Any]] = []
        self._step: dict[str, Any] = {}

    @staticmethod
    def _capturing() -> bool:
        """Whether the current stream is capturing a graph, where a synchronisation would end the capture."""
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

    @staticmethod
    def _sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def wrap(self, owner: type, name: str, label: str, record: Callable[[Any, float], None] | None = None) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._capturing():  # a CUDA graph being captured records work, runs none: nothing to time
                return fn(*args, **kwargs)
            self._sync()
            start = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
            finally:
                self._sync()
                seconds = time.perf_counter() - start
                self.seconds[label] += seconds
                self.calls[label] += 1
            if record is not None:
                record(result, seconds)
            return result

        setattr(owner, name, timed)

    def install(self) -> None:
        for owner, names in TIMED:
            for name in names:
                self.wrap(owner, name, f"{owner.__name__}.{name}")
        self.wrap(ModelRunner, "prepare", "ModelRunner.prepare", self._describe)
        self.wrap(llm_engine.LLMEngine, "step", "LLMEngine.step", self._close_step)

    def _describe(self, step: Any, _: float) -> None:
        extends = sum(1 for b in step.nonresident_tokens if step.row_ranges[b][1] - step.row_ranges[b][0] > 1)
        self._step = dict(rows=int(step.input_ids.shape[0]), requests=len(step.request_ids),
                          host_only=len(step.nonresident_tokens), host_only_extends=extends)

    def _close_step(self, _: Any, seconds: float) -> None:
        if self._step:  # a step that scheduled nothing ran no forward
            self.steps.append(dict(self._step, ms=1e3 * seconds))
        self._step = {}

    def report(self, row: dict, out: Path) -> None:
        print(f"--- phases: {row['policy']} / {row['trace']}, wall {row['wall_s']:.1f} s, {len(self.steps)} steps")
        for label, seconds in sorted(self.seconds.items(), key=lambda item: -item[1]):
            calls = self.calls[label]
            print(f"{label:<42} {seconds:8.2f} s {calls:7d} calls {1e3 * seconds / max(calls, 1):8.3f} ms")
        kinds = {
            "decode only": lambda s: s["rows"] == s["requests"],
            "with prefill, no host-only extend": lambda s: s["rows"] > s["requests"] and not s["host_only_extends"],
            "with a host-only extend": lambda s: s["host_only_extends"] > 0,
        }
        for kind, keep in kinds.items():
            steps = [s for s in self.steps if keep(s)]
            if steps:
                mean = {k: sum(s[k] for s in steps) / len(steps) for k in ("ms", "requests", "rows", "host_only")}
                print(f"{kind:<34} {len(steps):5d} steps {mean['ms']:7.1f} ms {mean['requests']:5.1f} requests "
                      f"{mean['rows']:7.1f} rows {mean['host_only']:5.1f} with host-only pages")
        (out / f"steps-{row['policy']}-{row['trace']}.json").write_text(json.dumps(self.steps))
        self.seconds.clear()
        self.calls.clear()
        self.steps.clear()


def main() -> int:
    timer = PhaseTimer()
    timer.install()
    out = Path(os.environ.get("OUT", tempfile.mkdtemp()))
    run_policy = policies.run_policy

    def timed_run(*args: Any, **kwargs: Any) -> dict:
        row = run_policy(*args, **kwargs)
        timer.report(row, out)
        return row

    policies.run_policy = timed_run
    return policies.main()


if __name__ == "__main__":
    sys.exit(main())
