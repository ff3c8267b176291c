"""Where the host waits for the GPU: `bench/policies.py` under PyTorch's sync debug mode.

A host synchronisation inside a step's preparation (a blocking copy, `.item()`,
`.tolist()` of a device tensor) makes the host wait for the step in flight, and
under asynchronous scheduling that puts the rest of the preparation after it on
the timeline. `torch.cuda.set_sync_debug_mode("warn")` warns at each such call;
this run counts the warnings by their call site in the project (the innermost
four frames of engine/, residency/, kernels/, disagg/) and prints the sites,
most frequent first, after the policies' own table. The debug mode does not see
every synchronising operation (PyTorch calls it a prototype), so an empty list
is a good sign, not a proof. GPU only.

Usage: python bench/sync_watch.py [policies.py arguments], e.g.
`python bench/sync_watch.py --scale 0.0625 --turns 4 --trace model --policies hybrid`
"""

from __future__ import annotations

import collections
import os
import sys
import traceback
import warnings
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT / "bench"))
sys.path.insert(0, str(_ROOT))

import policies  # noqa: E402

_PACKAGES = ("engine", "residency", "kernels", "disagg")
_FRAMES = 4  # innermost project frames that name a site


def call_site() -> str:
    """The innermost project frames of the current stack, innermost first."""
    frames = [f for f in traceback.extract_stack()[:-2]
              if os.path.relpath(f.filename, _ROOT).split(os.sep)[0] in _PACKAGES]
    return " <- ".join(f"{os.path.relpath(f.filename, _ROOT)}:{f.lineno}" for f in frames[-_FRAMES:][::-1])


def main() -> int:
    if not torch.cuda.is_available():
        print("sync_watch needs a CUDA GPU", file=sys.stderr)
        return 1
    sites: collections.Counter[str] = collections.Counter()

    def count(message: Warning | str, category: type[Warning], filename: str, lineno: int,
              file: object = None, line: str | None = None) -> None:
        sites[call_site()] += 1

    warnings.showwarning = count
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        policies.main()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    print(f"\nhost synchronisations by call site ({sum(sites.values())} in all)")
    for site, n in sites.most_common(25):
        print(f"{n:8d}  {site or '(outside the project)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
