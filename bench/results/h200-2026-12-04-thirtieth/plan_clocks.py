"""Per-phase SM clocks of the resolve plan (one CTA a request), B=100, in a CUDA graph, 0 / 1 / 5 % misses."""
import importlib.util, sys, torch
sys.path.insert(0, ".")
from bench import kernels_residency as kr
spec = importlib.util.spec_from_file_location("vclk", ".probe/vclk_resolve.py")
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
layout = kr.glm53_layout()
host_pool = torch.empty((2 * kr.GIB // layout.page_bytes, layout.page_bytes), dtype=torch.uint8, pin_memory=True)
gpu_pool = torch.zeros((128 * (kr.HOT_ROWS // kr.PAGE + 1) + 64, layout.page_bytes), dtype=torch.uint8, device="cuda")
gen = torch.Generator().manual_seed(2)
batch = kr.make_batch([kr.CTX] * 100, kr.HOT_ROWS, kr.CTX, 0.0, host_pool.shape[0], 1000, gen, torch.device("cuda"))
step = torch.full((1,), 1000, dtype=torch.int32, device="cuda")
mod.DBG = torch.zeros((100, 8), dtype=torch.int64, device="cuda")
names = ["start", "num_miss", "miss_rank", "lo(min)", "first_round", "pick", "served", "end"]
for rate in (0.0, 0.01, 0.05):
    topk, counts = kr.draw_topk(batch, kr.TOP_K, rate, gen)
    pristine = [t.clone() for t in batch.state()]
    args = kr.resolve_args(batch, topk, counts, step, layout, gpu_pool, host_pool)
    topk_pos, counts, gpu_pages, host_pages, hot, held, stamp, rmap, step_t = args[:9]
    table = mod._stacked_lease_table(hot, held, stamp, rmap)
    reset = (lambda: (held.copy_(pristine[0]), stamp.copy_(pristine[1]), rmap.copy_(pristine[2]))) if rate else None
    us = kr.graph_ms(lambda: mod._launch_plan(topk_pos, counts, gpu_pages, host_pages, table, stamp.dtype, rmap.dtype,
                                              step_t, gpu_pool, None, mod.PAGE_SIZE, 8), 20, setup=reset) * 1e3
    d = mod.DBG.clone()  # the last call's clocks
    t = d - d[:, :1]
    cols = [i for i in range(8) if (d[:, i] != 0).all()]
    print(f"miss {rate:.0%}: {us:.2f} us a call; cycles since start (median over CTAs; max):")
    for i in cols:
        print(f"  {names[i]:>12} {int(t[:, i].median()):7d} {int(t[:, i].max()):7d}")
    st = d[:, 0]
    print(f"  CTA start spread {int(st.max() - st.min())} cycles (per-SM clocks, indicative)")
    for x, p in zip(batch.state(), pristine):
        x.copy_(p)
    mod.DBG.zero_()
