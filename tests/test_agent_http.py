"""The agent benchmark harness (bench/agent_http.py) against the real application, and the notebook that reads it.

One cluster serves configs/tiny.yaml with the test's tiny model; the harness runs in-process at
scale 0.005 (first turns of about 370 tokens, then 4 new tokens and 16 output tokens per turn),
two conversations of the trace's 13 turns at concurrency 1 and 2, and writes its results to a
temporary folder that the notebook then reads. The 13 turns are there for the metric: Ray exports
a replica's gauges once a second at most, so a level must last seconds for its mean to be sampled.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import ray
from ray import serve

from app.main import build_app
from bench.agent_http import main
from bench.agent_results import LEVELS_FILE, PLOT_FILES, TURNS_FILE, merge_rows
from bench.agent_trace import TURNS
from tests.serve_helpers import ROOT, free_port, tiny_args
from tests.test_notebooks import execute_notebook

PORT = free_port()
LEVEL_COLUMNS = {"label", "concurrency", "requests", "errors", "ttft_p50_s", "ttft_p99_s", "tpot_mean_ms",
                 "interactivity_tok_s_user", "throughput_tok_s_gpu", "mean_running", "hisparse_series"}
TURN_COLUMNS = {"label", "concurrency", "conversation", "turn", "ttft_s", "tpot_s", "prompt_tokens",
                "cached_tokens", "output_tokens", "error"}


@pytest.fixture(scope="module")
def results(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The harness's output folder after one run against the served tiny model."""
    # Ray exports a replica's gauges once per report interval, at most once a second: a level of a few
    # seconds then gives the running-requests mean a few samples; the harness reads them 1 s late.
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
             _system_config={"metrics_report_interval_ms": 1000})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        args = tiny_args(tiny_dir)
        args["metrics_interval_s"] = 0.1
        serve.run(build_app(args), name="hisparse", route_prefix="/")
        out = tmp_path_factory.mktemp("agent_http")
        metrics = f"http://127.0.0.1:{ray.nodes()[0]['MetricsExportPort']}/metrics"
        code = main(["--base-url", f"http://127.0.0.1:{PORT}/v1", "--scale", "0.005", "--turns", str(TURNS),
                     "--conversations", "2", "--concurrency", "1,2", "--label", "hybrid", "--out", str(out),
                     "--metrics-url", metrics, "--metrics-interval", "0.25", "--metrics-lag", "1", "--seed", "7",
                     "--timeout", "120"])
        assert code == 0
        yield out
    finally:
        serve.shutdown()
        ray.shutdown()


def test_harness_measures_every_turn(results: Path) -> None:
    levels = pq.read_table(results / LEVELS_FILE)
    turns = pq.read_table(results / TURNS_FILE)
    assert LEVEL_COLUMNS <= set(levels.column_names) and TURN_COLUMNS <= set(turns.column_names)
    rows = levels.to_pylist()
    assert [(r["label"], r["concurrency"]) for r in rows] == [("hybrid", 1), ("hybrid", 2)]
    assert all(r["errors"] == 0 and r["requests"] == 2 * TURNS and r["throughput_tok_s_gpu"] > 0 for r in rows)
    assert all(r["interactivity_tok_s_user"] > 0 and r["ttft_p99_s"] >= r["ttft_p50_s"] > 0 for r in rows)
    assert all(0 < r["mean_running"] <= r["concurrency"] for r in rows), [r["mean_running"] for r in rows]
    series = [name for r in rows for name in json.loads(r["hisparse_series"])]
    assert series and all('role="' in name and "SessionName" not in name for name in series)
    per_turn = sorted(turns.to_pylist(), key=lambda t: (t["concurrency"], t["conversation"], t["turn"]))
    assert len(per_turn) == 2 * 2 * TURNS and all(t["error"] is None and t["output_tokens"] == 16 for t in per_turn)
    assert all(360 <= t["prompt_tokens"] <= 400 for t in per_turn if t["turn"] == 0)
    for before, after in zip(per_turn, per_turn[1:]):
        if after["turn"]:  # the next turn repeats this one and its reply, and finds them cached (whole pages)
            assert after["prompt_tokens"] > before["prompt_tokens"] + before["output_tokens"]
            assert after["cached_tokens"] >= (before["prompt_tokens"] // 64) * 64
    for png in PLOT_FILES:
        assert (results / png).stat().st_size > 1000


def test_agent_notebook_reads_the_results(results: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("AGENT_BENCH_RESULTS", str(results))
    execute_notebook(ROOT / "notebooks" / "agent_benchmark.ipynb")
    out = capsys.readouterr().out
    assert "agent benchmark: 2 levels, labels ['hybrid']" in out and "tok/s/GPU" in out


def test_a_label_replaces_only_its_own_levels() -> None:
    old = [{"label": "offload", "concurrency": 1, "x": 1}, {"label": "hybrid", "concurrency": 1, "x": 2},
           {"label": "hybrid", "concurrency": 8, "x": 3}]
    new = [{"label": "hybrid", "concurrency": 1, "x": 4}]
    assert merge_rows(old, new) == [old[0], old[2], new[0]]
