"""Device probe: plan kernel variants in a CUDA graph at B=100 (not part of the project)."""
import os, statistics, sys, importlib
sys.path.insert(0, "bench")
import torch
import kernels_residency as kr
from kernels import resolve, resolve_head, resolve_e

layout = kr.glm53_layout()
host_pool = torch.empty((1 << 30) // layout.page_bytes, layout.page_bytes, dtype=torch.uint8, pin_memory=True)
gpu_pool = torch.zeros((128 * (kr.HOT_ROWS // kr.PAGE + 1) + 64, layout.page_bytes), dtype=torch.uint8, device="cuda")
gen = torch.Generator().manual_seed(2)
batch = kr.make_batch([kr.CTX] * 100, kr.HOT_ROWS, kr.CTX, 0.0, host_pool.shape[0], 1000, gen, torch.device("cuda"))
step = torch.full((1,), 1000, dtype=torch.int32, device="cuda")
variants = [("head", resolve_head, {}, 8), ("E hot pages", resolve_e, {}, 8), ("head again", resolve_head, {}, 8),
            ("E hot pages again", resolve_e, {}, 8)]
res = {}
for rate in (0.0, 0.01, 0.05):
    topk, counts = kr.draw_topk(batch, kr.TOP_K, rate, gen)
    pristine = [t.clone() for t in batch.state()]
    reset = (lambda: [t.copy_(p) for t, p in zip(batch.state(), pristine)]) if rate else None
    args = kr.resolve_args(batch, topk, counts, step, layout, gpu_pool, host_pool)
    topk_pos, counts_, gpu_pages, host_pages, hot, held, stamp, rmap, step_t = args[:9]
    table, step_s = resolve._stacked_lease_table(hot, held, stamp, rmap), step_t.to(stamp.dtype)
    hot_pages = (hot[:, ::kr.PAGE] // kr.PAGE).contiguous()
    assert torch.equal((hot_pages[:, :, None] * kr.PAGE + torch.arange(kr.PAGE, device="cuda")).view_as(hot), hot)
    table_e = table.clone()
    table_e[:, 0] = hot_pages.data_ptr() + torch.arange(len(hot_pages), device="cuda") * hot_pages.stride(0) * 4
    tables = {resolve_head: table, resolve_e: table_e}
    outs = {}
    for name, mod, knobs, warps in variants:  # equality of the variants' effects
        for k, v in knobs.items(): setattr(mod, k, v)
        reset() if reset else None
        p = mod._launch_plan(topk_pos, counts_, gpu_pages, host_pages, tables[mod], stamp.dtype, rmap.dtype, step_s,
                             gpu_pool, None, mod.PAGE_SIZE, warps, kr.HOT_ROWS)
        n = p.num_copied.clone()
        src = torch.stack([p.copy_src[i, :n[i]].sum() for i in range(len(n))])
        dst = torch.stack([p.copy_dst[i, :n[i]].sum() for i in range(len(n))])
        outs[name] = (p.kv_slots.clone(), n, src, dst, *[t.clone() for t in batch.state()])
    for name in outs:
        same = all(torch.equal(a, b) for a, b in zip(outs[name], outs["head"]))
        print(f"rate {rate:.0%} {name}: equal to head {same}; misses {int(outs[name][1].sum())}", flush=True)
    for rnd in range(5):
        for name, mod, knobs, warps in variants:
            for k, v in knobs.items(): setattr(mod, k, v)
            us = kr.graph_ms(lambda: mod._launch_plan(topk_pos, counts_, gpu_pages, host_pages, tables[mod], stamp.dtype,
                                                  rmap.dtype, step_s, gpu_pool, None, mod.PAGE_SIZE, warps,
                                                  kr.HOT_ROWS), 20, setup=reset) * 1e3
            res.setdefault((rate, name), []).append(us)
    reset() if reset else None
print("| miss | variant | us (3 rounds) | median |")
for (rate, name), v in res.items():
    print(f"| {rate:.0%} | {name} | {' '.join(f'{x:.2f}' for x in v)} | {statistics.median(v):.2f} |")
