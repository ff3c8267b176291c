"""Benchmark of the indexer's top-K kernel (`kernels/topk.py`) on one GPU.

K = 2048 of each row of float32 scores shaped like the indexer's (ReLU-weighted
sums: exact zeros and repeats, -inf past each row's length), at the widths the
engine scores (an 8K context's 12K bucket, 16K, 64K, 128K, 256K and 1M) and B = 1
to 64 rows. For each case: the median time per call in a CUDA graph of
`topk_positions` (the CUDA cluster select where it runs), the Triton kernels it
replaced ("triton": the one-program kernel up to `MAX_KERNEL_WIDTH` at its
default warps and others; the chunked radix select at its default chunk,
`wide_chunk`'s, and other chunk sizes), the cluster select's variants, the
stable sort it replaced (`scores.sort(descending=True, stable=True)`, the engine's
former selection) and `torch.topk` (ties broken arbitrarily: not usable as is,
shown for scale), each checked or timed side by side in one run; and the
floor: the row bytes read once at the HBM copy bandwidth measured in the same
run. Prints a table last and writes it, with the full log, under $OUT (or
bench/out).

    python bench/topk.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.timing import OUT_DIR, bench_graph, hbm_copy_gbs, run_log  # noqa: E402
from kernels import topk_cuda  # noqa: E402
from kernels.topk import (  # noqa: E402
    MAX_KERNEL_WIDTH, one_program_warps, radix_topk_positions, topk_positions, topk_positions_ref,
)

K = 2048
CASES = ((1, 8192), (1, 12288), (8, 12288), (64, 12288), (1, 16384), (64, 16384), (1, 65536), (8, 65536),
         (64, 65536), (1, 131072), (2, 131072), (8, 131072), (16, 131072), (32, 131072), (64, 131072),
         (1, 262144), (8, 262144), (1, 1 << 20), (8, 1 << 20))
WARPS = (8, 16, 32)  # the one-program kernel's warps besides the launcher's default
CHUNKS = (1024, 2048, 4096, 8192)  # the radix select's chunks (scores a program), the default's among them
CLUSTER_VARIANTS = tuple(topk_cuda.Variant(cluster=c) for c in topk_cuda.CLUSTERS) + (topk_cuda.Variant(512, 8),)

log = run_log("topk")


def indexer_like(rows: int, width: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    s = torch.relu(torch.randn(rows, width, generator=gen, device="cuda")).mul(64).round().div(64)
    visible = torch.randint(width // 2, width + 1, (rows,), generator=gen, device="cuda")
    s[torch.arange(width, device="cuda")[None, :] >= visible[:, None]] = float("-inf")
    return s


def candidates(width: int) -> dict[str, Callable[[torch.Tensor, torch.Tensor], object]]:
    """The forms timed at `width`, by label (scores, out): the launcher's default; the Triton kernels (the
    one-program kernel at other warp counts, or the radix select at each chunk size, "triton" its default
    chunk); the CUDA cluster select in each variant (at every width, to see where it wins)."""
    forms = {"default": lambda s, out: topk_positions(s, K, out)}
    if width <= MAX_KERNEL_WIDTH:
        forms["triton"] = lambda s, out: topk_positions(s, K, out, num_warps=one_program_warps(width))
        forms |= {f"{w} warps": lambda s, out, w=w: topk_positions(s, K, out, num_warps=w) for w in WARPS}
    else:
        forms["triton"] = lambda s, out: radix_topk_positions(s, K, out)
        forms |= {f"chunk {c}": lambda s, out, c=c: radix_topk_positions(s, K, out, chunk=c) for c in CHUNKS}
    for v in [v for v in CLUSTER_VARIANTS if topk_cuda.available(torch.device("cuda"), v)]:
        forms[f"cluster {v.threads}x{v.cluster}"] = lambda s, out, v=v: topk_cuda.launch(s, K, out, v)
    return forms


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 0
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    hbm = hbm_copy_gbs()
    rows_out = []
    for b, width in CASES:
        scores = [indexer_like(b, width, seed) for seed in range(4)]
        out = torch.empty(b, K, dtype=torch.int64, device="cuda")
        times = {}
        for label, select in candidates(width).items():
            select(scores[0], out)
            if not torch.equal(out, topk_positions_ref(scores[0], K)):
                raise AssertionError(f"{label} differs from the stable sort at B={b} W={width}")
            times[label] = bench_graph([lambda s=s, f=select: f(s, out) for s in scores]) * 1e3
            log(f"B={b} W={width} {label}: {times[label]:.1f} us")
        sort_us = bench_graph([lambda s=s: s.sort(dim=-1, descending=True, stable=True).indices[:, :K]
                               for s in scores]) * 1e3
        topk_us = bench_graph([lambda s=s: torch.topk(s, K, dim=-1) for s in scores]) * 1e3
        best = min(times, key=times.get)
        triton_us = times["triton"]
        floor_us = b * width * 4 / hbm / 1e3
        rows_out.append([b, width, f"{times['default']:.1f}", f"{triton_us:.1f}", best, f"{times[best]:.1f}",
                         f"{sort_us:.1f}", f"{topk_us:.1f}", f"{triton_us / times['default']:.2f}x",
                         f"{floor_us:.2f}", f"{times['default'] / floor_us:.0f}x"])
    header = ["B", "width", "default us", "Triton us", "best form", "best us", "stable sort us", "torch.topk us",
              "Triton / default", "floor us", "default x floor"]
    table = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    table += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows_out]
    table.append(f"K = {K}; HBM copy bandwidth in this run: {hbm:.0f} GB/s")
    text = "\n".join(table)
    (OUT_DIR / "topk.md").write_text(text + "\n")
    log("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
