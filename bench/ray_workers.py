"""What the benchmarks' Ray workers need to import this repository and Ray itself.

On the GPU machines Ray, Serve and the app's dependencies come from a site folder on the caller's PYTHONPATH
(the GPU kit), so a worker's PYTHONPATH must keep the caller's entries behind the repository's: a runtime
environment naming the repository alone starts workers that cannot import Ray, and the driver then waits on
them for ever.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def worker_pythonpath(inherited: str) -> str:
    """The Ray workers' PYTHONPATH: the repository (the app's modules) before the caller's own entries."""
    return os.pathsep.join([str(ROOT), *(p for p in inherited.split(os.pathsep) if p and p != str(ROOT))])


def runtime_env() -> dict[str, Any]:
    """`ray.init`'s runtime environment for workers that import this repository as the caller does."""
    return {"env_vars": {"PYTHONPATH": worker_pythonpath(os.environ.get("PYTHONPATH", ""))}}
