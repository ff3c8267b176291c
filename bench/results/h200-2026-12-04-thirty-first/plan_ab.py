"""Resolve plan variants (make_variants.py) at B=100 in a CUDA graph, interleaved, three rounds; the top-K rows in
the bench's random order and in ascending position order (the order the engine's top-K emits)."""
import importlib.util, statistics, sys, torch
sys.path.insert(0, ".")
from bench import kernels_residency as kr
from kernels import resolve as base

names = sys.argv[1:]
mods = [("0", base)]
for name in names:
    spec = importlib.util.spec_from_file_location(name, f".probe/v{name}_resolve.py")
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    mods.append((name, mod))
layout = kr.glm53_layout()
host_pool = torch.empty((2 * kr.GIB // layout.page_bytes, layout.page_bytes), dtype=torch.uint8, pin_memory=True)
gpu_pool = torch.zeros((128 * (kr.HOT_ROWS // kr.PAGE + 1) + 64, layout.page_bytes), dtype=torch.uint8, device="cuda")
gen = torch.Generator().manual_seed(2)
step = torch.full((1,), 1000, dtype=torch.int32, device="cuda")
res = {}


def run(batch, rates, label, dtypes, orders=("rand", "asc")):
    for rate in rates:
        topk0, counts = kr.draw_topk(batch, kr.TOP_K, rate, gen)
        pristine = [t.clone() for t in batch.state()]
        for order in orders:
            topk = topk0 if order == "rand" else topk0.sort(dim=1).values.contiguous()
            args = kr.resolve_args(batch, topk, counts, step, layout, gpu_pool, host_pool)
            topk_pos, counts, gpu_pages, host_pages, hot, held, stamp, rmap, step_t = args[:9]
            for rnd in range(3):
                for sd, md in dtypes:
                    stamp_x, rmap_x = stamp.to(sd), rmap.to(md)
                    step_x = step_t.to(sd)
                    reset = ((lambda: (held.copy_(pristine[0]), stamp_x.copy_(pristine[1]), rmap_x.copy_(pristine[2])))
                             if rate else None)
                    for name, mod in mods:
                        table = mod._stacked_lease_table(hot, held, stamp_x, rmap_x)
                        us = kr.graph_ms(lambda: mod._launch_plan(topk_pos, counts, gpu_pages, host_pages, table, sd, md,
                                                                  step_x, gpu_pool, None, mod.PAGE_SIZE, 8),
                                         20, setup=reset) * 1e3
                        key = (f"{rate:.0%}", f"{str(sd)[6:]}/{str(md)[6:]}{label}", order, name)
                        res.setdefault(key, []).append(us)
                for t, p in zip(batch.state(), pristine):
                    t.copy_(p)


both = ((torch.int32, torch.int16), (torch.int64, torch.int32))
batch = kr.make_batch([kr.CTX] * 100, kr.HOT_ROWS, kr.CTX, 0.0, host_pool.shape[0], 1000, gen, torch.device("cuda"))
run(batch, (0.0, 0.01, 0.05), "", both)
half = kr.make_batch([kr.CTX] * 100, kr.HOT_ROWS, kr.CTX, 0.5, host_pool.shape[0], 1000, gen, torch.device("cuda"))
run(half, (0.0, 0.01), " res50", both[:1])
groups = {}
for (rate, tables, order, name), v in res.items():
    groups.setdefault((rate, tables, order), {})[name] = statistics.median(v)
print(f"{'miss':>4} {'tables':>16} {'order':>5} " + " ".join(f"{n:>6}" for n, _ in mods) + "   (median us of 3 rounds)")
for (rate, tables, order), row in groups.items():
    print(f"{rate:>4} {tables:>16} {order:>5} " + " ".join(f"{row[n]:6.2f}" for n, _ in mods))
