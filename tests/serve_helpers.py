"""Helpers of the tests that run the real Serve application: ports, app args, replica stats, waiting.

Shared by tests/test_app_serve.py and tests/test_app_hardening.py, each of which starts its own cluster.
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from ray import serve

from tests.helpers import ROOT


def free_port() -> int:
    """A loopback port nothing listens on, so runs beside other Serve instances do not collide. Drawn between Ray's
    worker ports (10002-19999) and the kernel's ephemeral range (32768 up), where Ray's own servers take theirs: a
    port the kernel hands out could be taken by one of them before the Serve proxy binds it."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 32768)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def tiny_args(model_dir: Path) -> dict[str, Any]:
    """configs/tiny.yaml's application args with the test's model, a short prefill timeout and fast metrics."""
    args = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())["applications"][0]["args"]
    args["model"]["path"] = str(model_dir)
    args["disagg"]["prefill_timeout_s"] = 20
    args["metrics_interval_s"] = 0.5
    return args


def replica_stats(deployment: str, app: str) -> dict[str, Any]:
    return serve.get_deployment_handle(deployment, app).stats.remote().result()


def replica_idle(deployment: str, app: str) -> bool:
    """No request running or waiting, no GPU or host page held by one."""
    stats = replica_stats(deployment, app)
    return stats["running"] == stats["waiting"] == stats["pages_in_use"] == 0 and stats.get("host_pages_in_use", 0) == 0


def wait_for(check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)
