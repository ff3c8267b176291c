"""The agent benchmark against each residency policy in one command: serve, measure, shut down, next policy.

For every `--policies` entry the Serve config is written again with that policy (and the `--set` overrides,
e.g. KV and host pools scaled with the trace) and its application is built (the config's `import_path`
with its `args`, as `serve run` does) and run on a Ray instance this process starts (with a one-second
metrics report interval, so a level's running-requests mean has samples); bench/agent_http.py runs against
it with the policy as its label, and the application is deleted before the next policy starts. Every
policy's rows land in one results folder (Parquet, plots, table), which bench/agent_results.py and
notebooks/agent_benchmark.ipynb read. Ray is shut down at the end, also after a failure.

    python bench/agent_serve.py --config configs/h200.yaml --policies hybrid offload --scale 0.25 \\
        --set engine.attention_config.hisparse_config.host_pool_gib=24 -- --concurrency 1,8,16,24,32

Arguments after `--` go to bench/agent_http.py (run as a subprocess of this interpreter) after the ones set
here (`--label`, `--config`, `--scale`, `--base-url`, `--metrics-url`, `--out`, `--metrics-lag` of two
report intervals), so they may override them.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import ray
import yaml
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ray_workers import runtime_env  # noqa: E402
from bench.timing import run_log  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
POLICY_KEY = "engine.attention_config.hisparse_config.policy"
REPORT_INTERVAL_MS = 1000  # Ray's metrics report interval for the cluster (its default is 10 s)


def _set(args: dict[str, Any], dotted: str, value: Any) -> None:
    """args[a][b][c] = value for "a.b.c"; every section on the way must exist (a typo is an error, not a
    new field the app would refuse later with a less direct message)."""
    *path, last = dotted.split(".")
    node = args
    for key in path:
        if not isinstance(node.get(key), dict):
            raise SystemExit(f"--set {dotted}: the config has no section {key!r} there")
        node = node[key]
    node[last] = value


def policy_config(config: Path, policy: str, overrides: Sequence[str], port: int | None, out: Path) -> Path:
    """`config` with `policy` and the `KEY=VALUE` overrides (values read as YAML) applied to its first
    application's args (and its HTTP port replaced when `port` is given), written to `out/serve-<policy>.yaml`."""
    doc = yaml.safe_load(config.read_text())
    if port is not None:
        doc.setdefault("http_options", {})["port"] = port
    args = doc["applications"][0]["args"]
    _set(args, POLICY_KEY, policy)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
        _set(args, key, yaml.safe_load(value))
    path = out / f"serve-{policy}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _wait_ready(base_url: str, timeout_s: float) -> None:
    """Until the app lists its model (its deployments answer) or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"the app was not ready within {timeout_s:.0f} s")


def _build(app: dict[str, Any]) -> Any:
    """The application a config entry names: its `import_path` builder called with its `args`."""
    module, _, attr = app["import_path"].partition(":")
    return getattr(importlib.import_module(module), attr)(app.get("args", {}))


def serve_and_measure(config: Path, policy: str, base_url: str, metrics_url: str, args: argparse.Namespace,
                      log: Any) -> int:
    """Runs `config`'s application under `policy`, the harness against it, then deletes it; the harness's
    exit code."""
    cfg = policy_config(config, policy, args.set, args.port, args.out)
    app = yaml.safe_load(cfg.read_text())["applications"][0]
    log(f"policy {policy}: {cfg}")
    serve.run(_build(app), name=app.get("name", "default"), route_prefix=app.get("route_prefix", "/"),
              blocking=False)
    try:
        _wait_ready(base_url, args.ready_timeout)
        harness = [sys.executable, str(ROOT / "bench" / "agent_http.py"), "--label", policy, "--config",
                   str(cfg), "--scale", str(args.scale), "--base-url", base_url, "--metrics-url", metrics_url,
                   "--out", str(args.out), "--metrics-lag", str(2 * REPORT_INTERVAL_MS / 1000), *args.harness]
        log("$ " + " ".join(harness))
        return subprocess.run(harness, cwd=ROOT).returncode
    finally:
        serve.delete(app.get("name", "default"))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    harness = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True, help="the Serve config to serve")
    parser.add_argument("--policies", nargs="+", default=["hybrid", "offload"])
    parser.add_argument("--scale", type=float, default=1.0, help="factor on the trace's token counts")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override in the app's args, dotted (engine.num_gpu_pages=4096); repeatable")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "bench" / "out"))
    parser.add_argument("--port", type=int, default=None, help="the app's HTTP port (default: the config's)")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds an app may take to start")
    parsed = parser.parse_args(own)
    parsed.harness = harness
    return parsed


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log = run_log("agent_serve", args.out)
    http = yaml.safe_load(args.config.read_text()).get("http_options", {})
    host, port = http.get("host", "127.0.0.1"), args.port or http.get("port", 8000)
    ray.init(include_dashboard=False, _system_config={"metrics_report_interval_ms": REPORT_INTERVAL_MS},
             runtime_env=runtime_env())
    codes = {}
    try:
        serve.start(http_options={"host": host, "port": port})
        metrics_url = f"http://127.0.0.1:{ray.nodes()[0]['MetricsExportPort']}/metrics"
        for policy in args.policies:
            codes[policy] = serve_and_measure(args.config, policy, f"http://{host}:{port}/v1", metrics_url, args,
                                              log)
    finally:
        serve.shutdown()
        ray.shutdown()
    log(f"harness exit codes: {codes}")
    return max(codes.values(), default=1)


if __name__ == "__main__":
    sys.exit(main())
