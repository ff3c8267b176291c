"""Benchmark of the residency kernels on one GPU: fused resolve, page mirror, FP8 packing.

Shapes are GLM-5.3's: pages of 64 tokens x 78 layers x 656-byte FP8 rows, the
resolve works on IndexShare group 2 (layers 2..5: 2624-byte runs), top-K 2048,
4096 hot rows per request, 32K-token contexts whose older pages live only in an
8 GiB pinned host pool. Ceilings are measured in the same run: pinned H2D / D2H
memcpy, a Triton UVA gather of random 2624-byte runs from the host pool (best
of a few tile shapes), and the HBM device-to-device copy.

Run: `python bench/kernels_residency.py` (needs CUDA). Prints a markdown table
and writes it, with the raw numbers as JSON, under $OUT (or bench/out/).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from engine.kv_layout import KVLayout  # noqa: E402
from kernels import fp8_pack, page_mirror, resolve  # noqa: E402

PAGE = 64
GROUP = 2  # IndexShare group of layers 2..5
TOP_K = 2048
HOT_ROWS = 4096
CTX = 32768
GIB = 1 << 30
# the resolve plan's victim search forms timed side by side: (probes a round, bins of a first histogram round)
SEARCH_FORMS = [(1, 0), (3, 0), (1, 32), (3, 64), (3, 32)]
SLEEP_CYCLES = 4_000_000  # about 2 ms at 1.98 GHz: longer than any eager enqueue below


def host_us(fn, calls: int = 50) -> float:
    """Host microseconds per eager call (launch overhead), GPU work left to drain after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def glm53_layout() -> KVLayout:
    """GLM-5.3's FP8 page layout: groups {0}, {1}, {2..5}, ..., {74..77}."""
    sizes = (1, 1) + (4,) * 19
    group_of, pos_in = [], []
    for g, n in enumerate(sizes):
        group_of += [g] * n
        pos_in += list(range(n))
    return KVLayout("fp8", 512, 64, 128, sizes, tuple(group_of), tuple(pos_in), len(sizes))


# --- scenarios ---------------------------------------------------------------------------


@dataclass
class Batch:
    """Page tables and hot-buffer LRU state of a decode batch for one group."""

    ctx: list[int]
    gpu_page: torch.Tensor
    host_page: torch.Tensor
    hot_slots: torch.Tensor
    slot_pos: torch.Tensor
    slot_stamp: torch.Tensor
    pos_to_hot: torch.Tensor
    num_gpu_pages: int  # pool pages the batch uses (hot pages, then resident pages)

    def state(self) -> list[torch.Tensor]:
        return [self.slot_pos, self.slot_stamp, self.pos_to_hot]


def make_batch(ctx: list[int], num_hot: int, max_ctx: int, resident_frac: float, num_host_pages: int,
               step: int, gen: torch.Generator, device: torch.device) -> Batch:
    """Hot pages first in the pool, then resident pages; the hot buffer is filled with cold positions."""
    b, max_pages, hot_pages = len(ctx), max_ctx // PAGE, num_hot // PAGE
    hot_slots = torch.arange(b * num_hot, dtype=torch.int32, device=device).view(b, num_hot)
    gpu_page = torch.full((b, max_pages), -1, dtype=torch.int32)
    next_page = b * hot_pages
    for i, n in enumerate(ctx):
        pages = (n - 1) // PAGE + 1
        resident = torch.rand(pages, generator=gen) < resident_frac
        resident[-1] = True  # the newest token's page
        ids = torch.arange(next_page, next_page + int(resident.sum()), dtype=torch.int32)
        gpu_page[i, :pages][resident] = ids
        next_page += len(ids)
    host_page = torch.randint(0, num_host_pages, (b, max_pages), generator=gen, dtype=torch.int32)
    slot_pos = torch.full((b, num_hot), -1, dtype=torch.int32)
    pos_to_hot = torch.full((b, max_ctx), -1, dtype=torch.int16)
    for i, n in enumerate(ctx):
        pos = torch.arange(n)
        cold = pos[gpu_page[i, pos // PAGE] < 0]
        held = cold[torch.randperm(len(cold), generator=gen)[:num_hot]]
        slot_pos[i, : len(held)] = held.int()
        pos_to_hot[i, held] = torch.arange(len(held), dtype=torch.int16)
    stamp = torch.randint(0, step, (b, num_hot), generator=gen, dtype=torch.int32)
    to = dict(device=device)
    return Batch(ctx, gpu_page.to(**to), host_page.to(**to), hot_slots, slot_pos.to(**to), stamp.to(**to),
                 pos_to_hot.to(**to), next_page)


def draw_topk(batch: Batch, k: int, miss_rate: float, gen: torch.Generator,
              short_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The newest token, about miss_rate*count positions not on GPU nor hot, the rest resident or hot."""
    b = len(batch.ctx)
    topk = torch.full((b, k), 1 << 30, dtype=torch.int32)
    counts = torch.zeros(b, dtype=torch.int32)
    gpu_page, pos_to_hot = batch.gpu_page.cpu(), batch.pos_to_hot.cpu()
    for i, n in enumerate(batch.ctx):
        count = min(n, k)
        if i < short_rows:
            count = int(torch.randint(0, count + 1, (1,), generator=gen))
        if count == 0:
            continue
        pos = torch.arange(n - 1)
        known_mask = (gpu_page[i, pos // PAGE] >= 0) | (pos_to_hot[i, pos] >= 0)
        known, unknown = pos[known_mask], pos[~known_mask]
        m = min(round(miss_rate * count), count - 1, len(unknown))
        take = min(count - 1 - m, len(known))
        m = count - 1 - take
        picks = torch.cat([torch.tensor([n - 1]), known[torch.randperm(len(known), generator=gen)[:take]],
                           unknown[torch.randperm(len(unknown), generator=gen)[:m]]])
        topk[i, :count] = picks[torch.randperm(count, generator=gen)].int()
        counts[i] = count
    dev = batch.gpu_page.device
    return topk.to(dev), counts.to(dev)


def resolve_args(batch: Batch, topk, counts, step, layout: KVLayout, gpu_pool, host_pool, state=None):
    state = batch.state() if state is None else state
    return (topk, counts, batch.gpu_page, batch.host_page, batch.hot_slots, *state, step,
            layout.group_offset(GROUP), layout.group_run_bytes[GROUP], gpu_pool, host_pool)


# --- timing and ceilings -----------------------------------------------------------------


def time_ms(fn, reps: int, setup=None, sleep: bool = True) -> float:
    """Median device milliseconds of `fn` over reps: CUDA events around fn only (setup untimed).

    A GPU sleep queued before the start event lets the host enqueue fn's launches
    while the GPU is busy, so Python launch overhead stays out of the device time
    (it is reported apart, see `host_us`). The resolve twin synchronises inside, so
    it runs without the sleep and its time includes its host work.
    """
    events = []
    for _ in range(reps):
        if setup is not None:
            setup()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if sleep:
            torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def graph_ms(fn, calls: int, reps: int = 10, setup=None) -> float:
    """Milliseconds per call of `fn` captured `calls` times in one CUDA graph (minus a graph of setups)."""
    def capture(body):
        fn_out = []
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            body()  # warm-up outside the graph
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn_out.append(body())
        return graph

    def both():
        if setup is not None:
            setup()
        return fn()

    total = time_ms(capture(both).replay, reps)
    base = time_ms(capture(setup).replay, reps) if setup is not None else 0.0
    return (total - base) / calls


@triton.jit
def _gather_runs_kernel(src_ptr, dst_ptr, idx_ptr, n, run_words, RUNS: tl.constexpr, RUN_BLOCK: tl.constexpr):
    r = tl.program_id(0) * RUNS + tl.arange(0, RUNS)
    live = r < n
    src = tl.load(idx_ptr + r, mask=live, other=0).to(tl.int64) * run_words
    offs = tl.arange(0, RUN_BLOCK)
    mask = live[:, None] & (offs[None, :] < run_words)
    words = tl.load(src_ptr + src[:, None] + offs[None, :], mask=mask)
    tl.store(dst_ptr + r.to(tl.int64)[:, None] * run_words + offs[None, :], words, mask=mask)


def memcpy_ceilings(host_flat: torch.Tensor, dst: torch.Tensor) -> dict[str, float]:
    """Plain copies of 1 GiB: pinned host to device, device to pinned host, device to device."""
    src = torch.empty_like(dst)
    return {
        "h2d_memcpy_GBps": GIB / time_ms(lambda: dst.copy_(host_flat[:GIB], non_blocking=True), 5) / 1e6,
        "d2h_memcpy_GBps": GIB / time_ms(lambda: host_flat[GIB : 2 * GIB].copy_(src, non_blocking=True), 5) / 1e6,
        "hbm_copy_GBps": 2 * GIB / time_ms(lambda: dst.copy_(src), 10) / 1e6,
    }


def measure_ceilings(host_pool: torch.Tensor, run_bytes: int, log) -> dict[str, float]:
    dev = torch.device("cuda")
    host_flat = host_pool.view(-1)
    dst = torch.empty(GIB, dtype=torch.uint8, device=dev)
    out = memcpy_ceilings(host_flat, dst)
    words = run_bytes // 4
    num_runs = 1 << 16
    idx = torch.randint(0, host_flat.numel() // run_bytes, (num_runs,), device=dev, dtype=torch.int64)
    host_words, dst_words = host_pool.view(torch.int32).view(-1), dst.view(torch.int32)
    best = 0.0
    for runs, warps in ((1, 4), (2, 4), (4, 4), (4, 8), (8, 8)):
        def gather():
            _gather_runs_kernel[(triton.cdiv(num_runs, runs),)](
                host_words, dst_words, idx, num_runs, words, RUNS=runs,
                RUN_BLOCK=triton.next_power_of_2(words), num_warps=warps)
        gather()
        gbps = num_runs * run_bytes / time_ms(gather, 10) / 1e6
        log(f"  uva gather runs/program={runs} warps={warps}: {gbps:.1f} GB/s")
        best = max(best, gbps)
    out["uva_gather_GBps"] = best
    return out


# --- benchmarks --------------------------------------------------------------------------


def bench_resolve(layout, gpu_pool, host_pool, ceil, log) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    step = torch.full((1,), 1000, dtype=torch.int32, device="cuda")
    for b in (1, 8, 32, 64, 128):
        batch = make_batch([CTX] * b, HOT_ROWS, CTX, 0.0, host_pool.shape[0], 1000, gen, torch.device("cuda"))
        for rate in (0.0, 0.01, 0.05, 0.20):
            topk, counts = draw_topk(batch, TOP_K, rate, gen)
            pristine = [t.clone() for t in batch.state()]
            reset = lambda: [t.copy_(p) for t, p in zip(batch.state(), pristine)]  # noqa: E731
            args = resolve_args(batch, topk, counts, step, layout, gpu_pool, host_pool)
            reset()
            resolve.resolve_group(*args)  # compile / warm
            t_all = time_ms(lambda: resolve.resolve_group(*args), 10, setup=reset)
            t_plan = time_ms(lambda: resolve.plan_group(*args), 10, setup=reset)
            reset()
            plan = resolve.plan_group(*args)
            off, run = layout.group_offset(GROUP), layout.group_run_bytes[GROUP]
            t_copy = time_ms(lambda: resolve.copy_misses(plan, off, run, gpu_pool, host_pool), 10)
            misses = int(plan.num_copied.sum())
            reset()
            t_twin = time_ms(lambda: resolve.resolve_group_reference(*args), 1, sleep=False)
            reset()
            gbps = misses * run / t_copy / 1e6 if misses else float("nan")
            row = dict(B=b, miss_rate=rate, misses=misses, resolve_us=t_all * 1e3, plan_us=t_plan * 1e3,
                       copy_us=t_copy * 1e3, copy_GBps=gbps, copy_vs_uva=gbps / ceil["uva_gather_GBps"],
                       copy_vs_memcpy=gbps / ceil["h2d_memcpy_GBps"], twin_us=t_twin * 1e3,
                       speedup_vs_twin=t_twin / t_all)
            log(f"  resolve B={b} miss={rate:.0%}: {row['resolve_us']:.1f} us (plan {row['plan_us']:.1f}, "
                f"copy {row['copy_us']:.1f}, {gbps:.1f} GB/s), twin {row['twin_us']:.0f} us")
            rows.append(row)
    return rows


def bench_host_overhead(layout, gpu_pool, host_pool, log) -> dict:
    """Eager host cost of one call of each launcher (graphs remove it in the decode step)."""
    gen = torch.Generator().manual_seed(5)
    batch = make_batch([CTX] * 8, HOT_ROWS, CTX, 0.0, host_pool.shape[0], 1000, gen, torch.device("cuda"))
    topk, counts = draw_topk(batch, TOP_K, 0.0, gen)
    args = resolve_args(batch, topk, counts, torch.full((1,), 1000, dtype=torch.int32, device="cuda"),
                        layout, gpu_pool, host_pool)
    plan = resolve.plan_group(*args)
    off, run = layout.group_offset(GROUP), layout.group_run_bytes[GROUP]
    out = dict(resolve_group=host_us(lambda: resolve.resolve_group(*args)),
               plan_group=host_us(lambda: resolve.plan_group(*args)),
               copy_misses=host_us(lambda: resolve.copy_misses(plan, off, run, gpu_pool, host_pool)))
    log("  host us per eager call: " + ", ".join(f"{k} {v:.0f}" for k, v in out.items()))
    return out


def bench_copy_tuning(layout, gpu_pool, host_pool, ceil, log) -> list[dict]:
    """Copy-launch shapes on the largest miss volume (B=128, 20%)."""
    gen = torch.Generator().manual_seed(1)
    batch = make_batch([CTX] * 128, HOT_ROWS, CTX, 0.0, host_pool.shape[0], 1000, gen, torch.device("cuda"))
    topk, counts = draw_topk(batch, TOP_K, 0.20, gen)
    plan = resolve.plan_group(*resolve_args(batch, topk, counts, 1000, layout, gpu_pool, host_pool))
    off, run = layout.group_offset(GROUP), layout.group_run_bytes[GROUP]
    misses = int(plan.num_copied.sum())
    rows = []
    saved = resolve._COPY_RUNS_PER_PROGRAM, resolve._COPY_PROGRAMS_PER_SM
    for runs, per_sm, warps in ((4, 8, 4), (2, 16, 4), (4, 16, 4), (8, 8, 8), (1, 32, 4)):
        resolve._COPY_RUNS_PER_PROGRAM, resolve._COPY_PROGRAMS_PER_SM = runs, per_sm
        fn = lambda: resolve.copy_misses(plan, off, run, gpu_pool, host_pool, num_warps=warps)  # noqa: E731
        fn()
        gbps = misses * run / time_ms(fn, 10) / 1e6
        rows.append(dict(runs=runs, programs_per_sm=per_sm, warps=warps, GBps=gbps,
                         vs_uva=gbps / ceil["uva_gather_GBps"]))
        log(f"  copy runs/program={runs} programs/SM={per_sm} warps={warps}: {gbps:.1f} GB/s")
    resolve._COPY_RUNS_PER_PROGRAM, resolve._COPY_PROGRAMS_PER_SM = saved
    return rows


def bench_plan_graph(layout, gpu_pool, host_pool, log) -> list[dict]:
    """Plan alone (and plan + copy) inside a CUDA graph at B=100."""
    gen = torch.Generator().manual_seed(2)
    batch = make_batch([CTX] * 100, HOT_ROWS, CTX, 0.0, host_pool.shape[0], 1000, gen, torch.device("cuda"))
    step = torch.full((1,), 1000, dtype=torch.int32, device="cuda")
    rows = []
    for rate in (0.0, 0.01):
        topk, counts = draw_topk(batch, TOP_K, rate, gen)
        pristine = [t.clone() for t in batch.state()]
        reset = (lambda: [t.copy_(p) for t, p in zip(batch.state(), pristine)]) if rate else None
        args = resolve_args(batch, topk, counts, step, layout, gpu_pool, host_pool)
        for warps in (4, 8, 16):
            us = graph_ms(lambda: resolve.plan_group(*args, num_warps=warps), 20, setup=reset) * 1e3
            rows.append(dict(what="plan", miss_rate=rate, warps=warps, us=us))
            log(f"  graph plan B=100 miss={rate:.0%} warps={warps}: {us:.2f} us")
        # The plan kernel alone: `plan_group` also builds the stacked lease table (a few small torch
        # kernels) every call; the engine builds its table on the host and moves it in one copy.
        topk_pos, counts, gpu_pages, host_pages, hot, held, stamp, rmap, step_t = args[:9]
        table, step_s = resolve._stacked_lease_table(hot, held, stamp, rmap), step_t.to(stamp.dtype)
        # the victim search's forms side by side (probes a round, a first round of histogram bins above the
        # smallest key or none), the default last
        default = (resolve._SEARCH_WAYS, resolve._SEARCH_BINS)
        for ways, bins in [f for f in SEARCH_FORMS if f != default] + [default]:
            resolve._SEARCH_WAYS, resolve._SEARCH_BINS = ways, bins
            us = graph_ms(lambda: resolve._launch_plan(topk_pos, counts, gpu_pages, host_pages, table, stamp.dtype,
                                                       rmap.dtype, step_s, gpu_pool, None, resolve.PAGE_SIZE, 8,
                                                       HOT_ROWS), 20, setup=reset) * 1e3
            form = f"{ways} probe{'s' if ways > 1 else ''} a round{f', first {bins} bins' if bins else ''}"
            rows.append(dict(what=f"plan kernel (table built once; {form})", miss_rate=rate, warps=8, us=us))
            log(f"  graph plan kernel B=100 miss={rate:.0%} ({form}): {us:.2f} us")
        # other table dtypes, the default form: the engine's (int64 stamps, int32 reverse map:
        # residency/hot_buffer.py) and each of its two halves beside the bench's int32 / int16; and each with
        # the plan that also serves leases past one chunk of slots (what a launch without a bound compiles)
        for stamp_dtype, map_dtype in ((torch.int64, torch.int32), (torch.int64, torch.int16),
                                       (torch.int32, torch.int32), (torch.int32, torch.int16)):
            stamp_x, rmap_x = stamp.to(stamp_dtype), rmap.to(map_dtype)
            table_x, step_x = resolve._stacked_lease_table(hot, held, stamp_x, rmap_x), step_t.to(stamp_dtype)
            reset_x = (lambda: (reset(), stamp_x.copy_(pristine[1]), rmap_x.copy_(pristine[2]))) if rate else None
            for bound in (HOT_ROWS, None):
                us = graph_ms(lambda: resolve._launch_plan(topk_pos, counts, gpu_pages, host_pages, table_x,
                                                           stamp_dtype, map_dtype, step_x, gpu_pool, None,
                                                           resolve.PAGE_SIZE, 8, bound), 20, setup=reset_x) * 1e3
                dtypes = f"{str(stamp_dtype)[6:]} stamps, {str(map_dtype)[6:]} map"
                plan = "one-chunk plan" if resolve.one_chunk(bound) else "any-size plan"
                rows.append(dict(what=f"plan kernel (table built once; {form}; {dtypes}; {plan})", miss_rate=rate,
                                 warps=8, us=us))
                log(f"  graph plan kernel B=100 miss={rate:.0%} ({form}, {dtypes}, {plan}): {us:.2f} us")
        for warps in (4, 16):  # the default form at other widths
            us = graph_ms(lambda: resolve._launch_plan(topk_pos, counts, gpu_pages, host_pages, table, stamp.dtype,
                                                       rmap.dtype, step_s, gpu_pool, None, resolve.PAGE_SIZE, warps,
                                                       HOT_ROWS), 20, setup=reset) * 1e3
            rows.append(dict(what=f"plan kernel (table built once; {form})", miss_rate=rate, warps=warps, us=us))
            log(f"  graph plan kernel B=100 miss={rate:.0%} ({form}, {warps} warps): {us:.2f} us")
        us = graph_ms(lambda: resolve.resolve_group(*args), 20, setup=reset) * 1e3
        rows.append(dict(what="plan+copy", miss_rate=rate, warps=8, us=us))
        log(f"  graph plan+copy B=100 miss={rate:.0%}: {us:.2f} us")
        for t, p in zip(batch.state(), pristine):
            t.copy_(p)
    return rows


def bench_mirror(gpu_pool, host_pool, ceil, log) -> list[dict]:
    gen = torch.Generator().manual_seed(3)
    rows = []
    page_bytes = gpu_pool.shape[1]
    for n in (1, 8, 64):
        gpu_ids = torch.randperm(gpu_pool.shape[0], generator=gen)[:n]
        host_ids = torch.randperm(host_pool.shape[0], generator=gen)[:n]
        row = dict(pages=n)
        for name, fn in (("triton", page_mirror.mirror_pages_triton), ("copy_engine", page_mirror.mirror_pages_reference)):
            fn(gpu_pool, host_pool, gpu_ids, host_ids)
            ms = time_ms(lambda: fn(gpu_pool, host_pool, gpu_ids, host_ids), 10)
            row[f"{name}_us"] = ms * 1e3
            row[f"{name}_GBps"] = n * page_bytes / ms / 1e6
        row["triton_vs_d2h"] = row["triton_GBps"] / ceil["d2h_memcpy_GBps"]
        row["copy_engine_vs_d2h"] = row["copy_engine_GBps"] / ceil["d2h_memcpy_GBps"]
        log(f"  mirror {n} pages: triton {row['triton_GBps']:.1f} GB/s, copy engine {row['copy_engine_GBps']:.1f} GB/s")
        rows.append(row)
    return rows


def bench_pack(layout, gpu_pool, log) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(4)
    rows = []
    for n in (64, 4096):
        latent = torch.randn(n, 512, device="cuda", generator=gen).bfloat16()
        rope = torch.randn(n, 64, device="cuda", generator=gen).bfloat16()
        slots = torch.randperm(gpu_pool.shape[0] * PAGE, device="cuda", generator=gen)[:n]
        place = fp8_pack.RowPlacement(PAGE, layout.group_offset(3) + layout.mla_row_bytes, layout.group_run_bytes[3])
        k = time_ms(lambda: fp8_pack.pack_mla_rows_into(latent, rope, gpu_pool, slots, place), 20)
        t = time_ms(lambda: fp8_pack.pack_mla_rows_into_reference(latent, rope, gpu_pool, slots, place), 5)
        rows.append(dict(rows=n, kernel_us=k * 1e3, twin_us=t * 1e3, speedup_vs_twin=t / k))
        log(f"  pack MLA {n} rows: {k * 1e3:.1f} us, twin {t * 1e3:.1f} us")
    return rows


def table(ceil, res, tuning, graph, mirror, pack) -> str:
    lines = ["Ceilings (same run): " + ", ".join(f"{k} {v:.1f}" for k, v in ceil.items()), "",
             "| B | miss | misses | resolve us | plan us | copy us | copy GB/s | vs UVA | vs memcpy | twin us | x twin |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res:
        lines.append(f"| {r['B']} | {r['miss_rate']:.0%} | {r['misses']} | {r['resolve_us']:.1f} | {r['plan_us']:.1f} | "
                     f"{r['copy_us']:.1f} | {r['copy_GBps']:.1f} | {r['copy_vs_uva']:.0%} | {r['copy_vs_memcpy']:.0%} | "
                     f"{r['twin_us']:.0f} | {r['speedup_vs_twin']:.0f} |")
    lines += ["", "| copy shape (runs/program, programs/SM, warps) | GB/s | vs UVA |", "| --- | --- | --- |"]
    lines += [f"| {r['runs']}, {r['programs_per_sm']}, {r['warps']} | {r['GBps']:.1f} | {r['vs_uva']:.0%} |" for r in tuning]
    lines += ["", "| in CUDA graph, B=100 | miss | warps | us per call |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['what']} | {r['miss_rate']:.0%} | {r['warps']} | {r['us']:.2f} |" for r in graph]
    lines += ["", "| mirror pages | triton us | triton GB/s | copy engine us | copy engine GB/s | triton vs D2H | copy engine vs D2H |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['pages']} | {r['triton_us']:.1f} | {r['triton_GBps']:.1f} | {r['copy_engine_us']:.1f} | "
              f"{r['copy_engine_GBps']:.1f} | {r['triton_vs_d2h']:.0%} | {r['copy_engine_vs_d2h']:.0%} |" for r in mirror]
    lines += ["", "| FP8 MLA pack rows | kernel us | twin us | x twin |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['rows']} | {r['kernel_us']:.1f} | {r['twin_us']:.1f} | {r['speedup_vs_twin']:.1f} |" for r in pack]
    return "\n".join(lines)


def main() -> None:
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "out")
    out_dir.mkdir(parents=True, exist_ok=True)
    log_file = open(out_dir / "kernels_residency.log", "w")

    def log(msg: str) -> None:
        print(msg, flush=True)
        log_file.write(msg + "\n")

    started = time.time()
    layout = glm53_layout()
    log(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    host_pool = torch.empty((8 * GIB // layout.page_bytes, layout.page_bytes), dtype=torch.uint8, pin_memory=True)
    gpu_pool = torch.zeros((128 * (HOT_ROWS // PAGE + 1) + 64, layout.page_bytes), dtype=torch.uint8, device="cuda")
    log(f"pools ready in {time.time() - started:.1f} s: host {host_pool.shape[0]} pages, GPU {gpu_pool.shape[0]} pages")
    ceil = measure_ceilings(host_pool, layout.group_run_bytes[GROUP], log)
    log("ceilings: " + ", ".join(f"{k} {v:.1f}" for k, v in ceil.items()))
    res = bench_resolve(layout, gpu_pool, host_pool, ceil, log)
    host = bench_host_overhead(layout, gpu_pool, host_pool, log)
    tuning = bench_copy_tuning(layout, gpu_pool, host_pool, ceil, log)
    graph = bench_plan_graph(layout, gpu_pool, host_pool, log)
    mirror = bench_mirror(gpu_pool, host_pool, ceil, log)
    pack = bench_pack(layout, gpu_pool, log)
    text = table(ceil, res, tuning, graph, mirror, pack)
    text += "\n\nHost us per eager call (Python + launch): " + ", ".join(f"{k} {v:.0f}" for k, v in host.items())
    log("\n" + text)
    (out_dir / "kernels_residency.md").write_text(text + "\n")
    (out_dir / "kernels_residency.json").write_text(json.dumps(
        dict(ceilings=ceil, resolve=res, copy_tuning=tuning, graph=graph, mirror=mirror, pack=pack, host_us=host),
        indent=1))
    log(f"total {time.time() - started:.1f} s")


if __name__ == "__main__":
    main()
