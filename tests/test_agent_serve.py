"""bench/agent_serve.py end to end on the CPU: a Ray cluster of its own, `serve run configs/tiny.yaml` once per
policy with the policy written into the config, the harness against each, both policies' rows in one folder."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import yaml

from bench.agent_results import LEVELS_FILE, TURNS_FILE
from bench.agent_serve import main, policy_config
from bench.ray_workers import worker_pythonpath
from tests.serve_helpers import ROOT, free_port


def test_policy_config_writes_the_policy_and_overrides(tmp_path: Path) -> None:
    path = policy_config(ROOT / "configs" / "tiny.yaml", "offload", ["engine.num_gpu_pages=48", "model.path=/m"],
                         1234, tmp_path)
    doc = yaml.safe_load(path.read_text())
    args = doc["applications"][0]["args"]
    assert args["engine"]["attention_config"]["hisparse_config"]["policy"] == "offload"
    assert args["engine"]["num_gpu_pages"] == 48 and args["model"]["path"] == "/m"
    assert doc["http_options"]["port"] == 1234


def test_workers_keep_the_callers_pythonpath() -> None:
    """Ray's workers import Ray from wherever the driver did (a site folder on PYTHONPATH on the GPU machines)."""
    assert worker_pythonpath("") == str(ROOT)
    assert worker_pythonpath(f"/tmp/site:{ROOT}") == f"{ROOT}:/tmp/site"


def test_every_policy_is_served_and_measured(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "results"
    code = main(["--config", str(ROOT / "configs" / "tiny.yaml"), "--policies", "hybrid", "offload",
                 "--scale", "0.005", "--port", str(free_port()), "--out", str(out), "--ready-timeout", "240",
                 "--set", f"model.path={tiny_dir}", "--set", "metrics_interval_s=0.2",
                 "--", "--turns", "6", "--conversations", "2", "--concurrency", "2", "--seed", "3",
                 "--metrics-interval", "0.25", "--timeout", "120"])
    assert code == 0, (out / "agent_serve.log").read_text()
    levels = pq.read_table(out / LEVELS_FILE).to_pylist()
    assert sorted(r["label"] for r in levels) == ["hybrid", "offload"]
    assert all(r["errors"] == 0 and r["requests"] == 12 for r in levels)
    turns = pq.read_table(out / TURNS_FILE).to_pylist()
    assert {t["label"] for t in turns} == {"hybrid", "offload"} and all(t["output_tokens"] > 0 for t in turns)
    served = yaml.safe_load((out / "serve-offload.yaml").read_text())["applications"][0]["args"]
    assert served["engine"]["attention_config"]["hisparse_config"]["policy"] == "offload"
