"""Timing helpers shared by the GPU benchmarks: medians, CUDA-graph timing, the HBM ceiling, run logs.

Every benchmark divides by a ceiling measured in its own run; `hbm_copy_gbs` is that
ceiling for HBM (a 2 GiB device-to-device copy, bytes read plus written per second).
Logs go to stdout and, as they are written, to `$OUT/<name>.log` (default bench/out),
so a run cut short still leaves its log.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import triton.testing

OUT_DIR = Path(os.environ.get("OUT") or Path(__file__).parent / "out")


def run_log(name: str, out: Path | None = None) -> Callable[[str], None]:
    """A `log(msg)` that prints and appends to `<out>/<name>.log`: `out` made if given, else `OUT_DIR` when
    that folder exists."""
    folder = OUT_DIR if out is None else out
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)
        if folder.is_dir():
            with open(folder / f"{name}.log", "a") as f:
                f.write(msg + "\n")

    return log


def _configured(fn: Callable[..., object], *args: object) -> object:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return fn(*args)


def in_fresh_process(fn: Callable[..., object], *args: object) -> object:
    """fn(*args) in a new process (spawned: CUDA is not forked), its result pickled back. Benchmarks that
    build engine after engine run each in its own: an engine built after another in one process found the
    first one's GPU memory still held (a 76-layer model did not fit after a 40-layer one) and its host
    side slower (an 8-layer step 1.0 ms as the first engine, 1.5-1.9 ms as the third)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_configured, (fn, *args))


def bench(fn: Callable[[], object], rep: int = 100) -> float:
    """Median milliseconds of fn, L2 flushed between runs."""
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def event_median_ms(fn: Callable[[], object], repeats: int = 20) -> float:
    """Median milliseconds of fn between two CUDA events (no L2 flush: for calls that own their data)."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_graph(fns: list[Callable[[], object]], iters: int = 10) -> float:
    """Median milliseconds per call of the calls in `fns`, captured in one CUDA graph (no launch gaps)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    ms = event_median_ms(graph.replay, iters)
    del graph
    return ms / len(fns)


def dense_tflops() -> float:
    """bf16 dense matmul TFLOP/s (8192^3): the tensor cores' ceiling for the flop floors."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    a @ a  # noqa: B018 - warm-up
    return 2 * 8192**3 / event_median_ms(lambda: a @ a) / 1e9


def hbm_copy_gbs() -> float:
    """HBM copy bandwidth in GB/s (bytes read + written), its buffers freed afterwards."""
    src = torch.empty(1 << 31, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    gbs = 2 * src.numel() / bench(lambda: dst.copy_(src)) / 1e6
    del src, dst
    torch.cuda.empty_cache()
    return gbs


def pick(label: str, configs: list, time_of: Callable[[object], float], name_of: Callable[[object], str],
         log: Callable[[str], None]) -> tuple[object, float] | None:
    """The fastest of `configs` by `time_of` (ms), each timing logged; configs that fail are skipped."""
    timings = []
    for cfg in configs:
        try:
            timings.append((time_of(cfg), cfg))
            log(f"  {label} {name_of(cfg)}: {timings[-1][0] * 1e3:.1f} us")
        except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit is skipped
            log(f"  {label} {name_of(cfg)}: failed {type(exc).__name__}: {str(exc)[:200]}")
            torch.cuda.synchronize()
    if not timings:
        return None
    ms, cfg = min(timings, key=lambda t: t[0])
    return cfg, ms
