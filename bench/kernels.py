"""All kernel benchmarks in one run on the GPU: equality checks first, then the timing tables.

Runs `gpu_check_attention`, `gpu_check_residency` (PASS/FAIL at GLM-5.3 shapes), then
`kernels_attention` (sparse MLA and indexer: time, GB/s, ratio to the twin and to the HBM copy
measured in the same run) and `kernels_residency` (resolve, miss copy, plan in a CUDA graph,
mirror, FP8 packing: ratios to the pinned H2D, UVA gather and HBM ceilings of the same run).
Logs and tables go under $OUT (default bench/out). Usage: python bench/kernels.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gpu_check_attention  # noqa: E402
import gpu_check_residency  # noqa: E402
import kernels_attention  # noqa: E402
import kernels_residency  # noqa: E402


def main() -> int:
    failed = gpu_check_attention.main()
    try:
        gpu_check_residency.main()
    except SystemExit as done:  # it reports through its exit status
        failed = failed or int(done.code or 0)
    kernels_attention.main()
    kernels_residency.main()
    return failed


if __name__ == "__main__":
    sys.exit(main())
