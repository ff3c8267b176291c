"""Equality of the residency kernels and their PyTorch twins at GLM-5.3 shapes on the GPU.

Prints one PASS/FAIL line per check and exits non-zero on any FAIL:
- resolve (eager, three decode steps with overlapping top-K, short rows,
  misses up to 60%): kv slots, rows copied, LRU state, reverse map and every
  byte of the GPU pool equal the twin's; every selected non-resident row reads
  the bytes of its host page (lossless);
- resolve captured in a CUDA graph and replayed equals the eager twin;
- page mirror (Triton launch) equals the copy-engine twin;
- FP8 MLA and indexer packing equal `fp8_rows` run on the CPU, byte for byte
  (the CUDA run of `fp8_rows` is reported too: torch divides by a Python
  scalar on CUDA through a reciprocal, so its scales can differ by one ulp).

Run: `python bench/gpu_check_residency.py`; `--cpu` runs a small version under
the Triton interpreter (a dry run of this script, not a measurement).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CPU = "--cpu" in sys.argv
if CPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.kv_layout import KVLayout  # noqa: E402
from kernels import fp8_pack, fp8_rows, page_mirror, resolve  # noqa: E402
from kernels_residency import GROUP, PAGE, Batch, draw_topk, glm53_layout, make_batch, resolve_args  # noqa: E402

FAILED: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILED.append(name)


def small_layout() -> KVLayout:
    return KVLayout("fp8", 128, 16, 32, (1, 1, 2), (0, 1, 2, 2), (0, 0, 0, 1), 3)


def random_pools(layout: KVLayout, num_gpu: int, num_host: int, dev: torch.device, seed: int):
    gen = torch.Generator(device=dev).manual_seed(seed)
    gpu_pool = torch.randint(0, 256, (num_gpu, layout.page_bytes), dtype=torch.uint8, device=dev, generator=gen)
    host_src = torch.randint(0, 256, (num_host, layout.page_bytes), dtype=torch.uint8, device=dev, generator=gen)
    host_pool = torch.empty(host_src.shape, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    host_pool.copy_(host_src)
    return gpu_pool, host_pool


def group_runs(pool: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    off, run = layout.group_offset(GROUP), layout.group_run_bytes[GROUP]
    return pool[:, off : off + PAGE * run].unflatten(1, (PAGE, run))


def seed_hot_rows(batch: Batch, layout: KVLayout, gpu_pool: torch.Tensor, host_pool: torch.Tensor) -> None:
    """Put the host bytes of every held position into its hot slot (what earlier misses left)."""
    bi, ri = (batch.slot_pos >= 0).nonzero(as_tuple=True)
    pos = batch.slot_pos[bi, ri].long()
    rows = group_runs(host_pool, layout)[batch.host_page[bi, pos // PAGE].cpu(), (pos % PAGE).cpu()]
    slots = batch.hot_slots[bi, ri].long()
    group_runs(gpu_pool, layout)[slots // PAGE, slots % PAGE] = rows.to(gpu_pool.device)


def lossless(batch: Batch, layout: KVLayout, topk, counts, kv, gpu_pool, host_pool) -> bool:
    valid = torch.arange(topk.shape[1], device=topk.device)[None, :] < counts[:, None]
    pos = torch.where(valid, topk, 0).long()
    cold = valid & (batch.gpu_page.gather(1, pos // PAGE) < 0)
    bi, ki = cold.nonzero(as_tuple=True)
    if (kv[bi, ki] < 0).any():
        return False
    p, slot = pos[bi, ki], kv[bi, ki].long()
    want = group_runs(host_pool, layout)[batch.host_page[bi, p // PAGE].cpu(), (p % PAGE).cpu()]
    return torch.equal(group_runs(gpu_pool, layout)[slot // PAGE, slot % PAGE].cpu(), want)


def check_resolve(layout: KVLayout, dev: torch.device, ctx: list[int], k: int, num_hot: int, max_ctx: int) -> None:
    gen = torch.Generator().manual_seed(0)
    batch = make_batch(ctx, num_hot, max_ctx, 0.2, 96, 50, gen, dev)
    gpu_pool, host_pool = random_pools(layout, batch.num_gpu_pages, 96, dev, 1)
    seed_hot_rows(batch, layout, gpu_pool, host_pool)
    twin_state, twin_pool = [t.clone() for t in batch.state()], gpu_pool.clone()
    for step, rate, short in ((51, 0.3, 2), (52, 0.05, 0), (53, 0.6, 3)):
        topk, counts = draw_topk(batch, k, rate, gen, short_rows=short)
        got = resolve.resolve_group(*resolve_args(batch, topk, counts, step, layout, gpu_pool, host_pool))
        want = resolve.resolve_group_reference(
            *resolve_args(batch, topk, counts, step, layout, twin_pool, host_pool, state=twin_state))
        same = (torch.equal(got.kv_slots, want.kv_slots) and torch.equal(got.num_copied, want.num_copied)
                and all(torch.equal(a, b) for a, b in zip(batch.state(), twin_state)))
        check(f"resolve step {step} (miss {rate:.0%}) equals twin", same and torch.equal(gpu_pool, twin_pool),
              f"{int(got.num_copied.sum())} runs copied, counts {counts.tolist()}")
        check(f"resolve step {step} lossless", lossless(batch, layout, topk, counts, got.kv_slots, gpu_pool, host_pool))
    if dev.type == "cuda":
        check_resolve_graph(batch, layout, gen, k, gpu_pool, host_pool)


def check_resolve_graph(batch: Batch, layout: KVLayout, gen, k, gpu_pool, host_pool) -> None:
    topk, counts = draw_topk(batch, k, 0.2, gen, short_rows=1)
    step = torch.full((1,), 54, dtype=torch.int32, device="cuda")
    scratch = [t.clone() for t in batch.state()]
    resolve.resolve_group(*resolve_args(batch, topk, counts, step, layout, gpu_pool.clone(), host_pool, state=scratch))
    graph_state, graph_pool = [t.clone() for t in batch.state()], gpu_pool.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = resolve.resolve_group(*resolve_args(batch, topk, counts, step, layout, graph_pool, host_pool,
                                                  state=graph_state))
    graph.replay()
    twin_state, twin_pool = [t.clone() for t in batch.state()], gpu_pool.clone()
    want = resolve.resolve_group_reference(*resolve_args(batch, topk, counts, 54, layout, twin_pool, host_pool,
                                                         state=twin_state))
    torch.cuda.synchronize()
    same = (torch.equal(got.kv_slots, want.kv_slots) and torch.equal(got.num_copied, want.num_copied)
            and all(torch.equal(a, b) for a, b in zip(graph_state, twin_state)) and torch.equal(graph_pool, twin_pool))
    check("resolve in a CUDA graph equals twin", same, f"{int(want.num_copied.sum())} runs copied")


def check_mirror(layout: KVLayout, dev: torch.device) -> None:
    gpu_pool, host_pool = random_pools(layout, 40, 24, dev, 2)
    gen = torch.Generator().manual_seed(3)
    gpu_ids = torch.randperm(40, generator=gen)[:12]
    host_ids = torch.cat([torch.arange(5, 9), torch.randperm(5, generator=gen), 9 + torch.randperm(15, generator=gen)[:3]])
    gpu_ids[:4] = torch.arange(20, 24)  # one run of consecutive pairs
    got, want = host_pool.clone(), host_pool.clone()
    if dev.type == "cuda":
        got, want = got.pin_memory(), want.pin_memory()
    for fn, dst in ((page_mirror.mirror_pages_triton, got), (page_mirror.mirror_pages_reference, want)):
        event = fn(gpu_pool, dst, gpu_ids, host_ids, torch.cuda.Stream() if dev.type == "cuda" else None)
        if event is not None:
            event.synchronize()
    ok = torch.equal(got, want) and torch.equal(got[host_ids], gpu_pool[gpu_ids].cpu())
    check("page mirror (Triton) equals twin", ok, f"{len(gpu_ids)} pages of {layout.page_bytes} bytes")


def tricky_rows(n: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    """Random rows over many magnitudes plus rows holding every e4m3 rounding tie (amax 448: scale 1)."""
    x = torch.randn(n, dim, generator=gen) * torch.logspace(-20, 4, n)[:, None]
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite() & (grid >= 0)].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    tricky = torch.cat([mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9)), grid])
    tricky = torch.cat([tricky, -tricky])
    for i, vals in enumerate(tricky.split(dim - 1)):
        x[i] = 0.0
        x[i, 0] = 448.0
        x[i, 1 : 1 + len(vals)] = vals
    x[-1] = 0.0
    return x


def check_pack(layout: KVLayout, dev: torch.device, n: int) -> None:
    gen = torch.Generator().manual_seed(4)
    num_pages = n // PAGE + 16
    pool = torch.full((num_pages, layout.page_bytes), 0xA5, dtype=torch.uint8)
    slots = torch.randperm(num_pages * PAGE, generator=gen)[:n]
    layer = 7 if layout.num_layers > 7 else layout.num_layers - 1
    g, j = layout.layer_group[layer], layout.layer_pos[layer]
    mla = fp8_pack.RowPlacement(PAGE, layout.group_offset(g) + j * layout.mla_row_bytes, layout.group_run_bytes[g])
    tokens = layout.indexer_tokens_per_page
    idx = layout.indexer_placement(layout.num_full_layers - 1)
    idx_slots = torch.randperm(num_pages * tokens, generator=gen)[:n]
    for dtype in (torch.bfloat16, torch.float32):
        latent = tricky_rows(n, layout.latent_dim, gen).to(dtype)
        rope = (torch.randn(n, layout.rope_dim, generator=gen) * 5).to(dtype)
        keys = tricky_rows(n, layout.index_dim, gen).to(dtype)
        cases = (
            ("MLA", lambda p, d: fp8_pack.pack_mla_rows_into(latent.to(d), rope.to(d), p, slots.to(d), mla),
             lambda p: fp8_pack.pack_mla_rows_into_reference(latent, rope, p, slots, mla),
             lambda rows: fp8_rows.unpack_mla_rows(rows, layout.latent_dim, layout.rope_dim), mla, slots,
             layout.mla_row_bytes),
            ("indexer", lambda p, d: fp8_pack.pack_indexer_rows_into(keys.to(d), p, idx_slots.to(d), idx),
             lambda p: fp8_pack.pack_indexer_rows_into_reference(keys, p, idx_slots, idx),
             lambda rows: fp8_rows.unpack_indexer_rows(rows, layout.index_dim), idx, idx_slots,
             layout.indexer_key_bytes),
        )
        for name, kernel, twin, decode, place, where, row_bytes in cases:
            got = pool.to(dev)
            kernel(got, dev)
            got = got.cpu()
            want = pool.clone()
            twin(want)
            detail = f"{n} rows, {dtype}"
            if not torch.equal(got, want):
                rows_got, rows_want = pick_rows(got, where, place, row_bytes), pick_rows(want, where, place, row_bytes)
                diff = (decode(rows_got) - decode(rows_want)).abs().max().item()
                detail += f", {(got != want).sum().item()} bytes differ, dequantised max diff {diff:.3g}"
            if dev.type == "cuda":
                twin_cuda = pool.to(dev)
                (fp8_pack.pack_mla_rows_into_reference(latent.to(dev), rope.to(dev), twin_cuda, slots.to(dev), mla)
                 if name == "MLA" else
                 fp8_pack.pack_indexer_rows_into_reference(keys.to(dev), twin_cuda, idx_slots.to(dev), idx))
                detail += f"; fp8_rows on CUDA differs from CPU in {(twin_cuda.cpu() != want).sum().item()} bytes"
            check(f"fp8 pack {name} equals fp8_rows (CPU) byte for byte", torch.equal(got, want), detail)


def pick_rows(pool: torch.Tensor, slots: torch.Tensor, place: fp8_pack.RowPlacement | fp8_pack.KeyPlacement,
              row_bytes: int) -> torch.Tensor:
    """The packed rows at `slots` (an indexer key: its values, then its scale from the page's scale area)."""
    slots = slots.long()
    page = (slots // place.tokens_per_page) * pool.shape[1]
    tok = slots % place.tokens_per_page
    flat = pool.view(-1)
    if isinstance(place, fp8_pack.KeyPlacement):
        values = page + place.value_offset + tok * place.value_stride
        scales = page + place.scale_offset + tok * place.scale_stride
        return torch.cat([flat[values[:, None] + torch.arange(row_bytes - 4)], flat[scales[:, None] + torch.arange(4)]], 1)
    base = page + place.row_offset + tok * place.token_stride
    return flat[base[:, None] + torch.arange(row_bytes)]


def main() -> None:
    if CPU:
        layout, dev = small_layout(), torch.device("cpu")
        check_resolve(layout, dev, [1, 40, 100, 129, 700], 64, 128, 768)
        check_mirror(layout, dev)
        check_pack(layout, dev, 300)
    else:
        layout, dev = glm53_layout(), torch.device("cuda")
        print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
        check_resolve(layout, dev, [1, 40, 2047, 2048, 2049, 5000, 30000, 70001], 2048, 4096, 70016)
        check_mirror(layout, dev)
        check_pack(layout, dev, 4096)
    print(f"{'FAIL' if FAILED else 'PASS'} all ({len(FAILED)} failed)", flush=True)
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
