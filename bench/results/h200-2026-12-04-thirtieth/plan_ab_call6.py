"""Old vs new resolve plan kernel at B=100 in a CUDA graph, interleaved, three rounds."""
import importlib.util, statistics, sys, torch
sys.path.insert(0, ".")
from bench import kernels_residency as kr
from kernels import resolve as new
spec = importlib.util.spec_from_file_location("old_resolve", ".probe/old/kernels/resolve.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)

layout = kr.glm53_layout()
host_pool = torch.empty((2 * kr.GIB // layout.page_bytes, layout.page_bytes), dtype=torch.uint8, pin_memory=True)
gpu_pool = torch.zeros((128 * (kr.HOT_ROWS // kr.PAGE + 1) + 64, layout.page_bytes), dtype=torch.uint8, device="cuda")
gen = torch.Generator().manual_seed(2)
batch = kr.make_batch([kr.CTX] * 100, kr.HOT_ROWS, kr.CTX, 0.0, host_pool.shape[0], 1000, gen, torch.device("cuda"))
step = torch.full((1,), 1000, dtype=torch.int32, device="cuda")
def load(name):
    spec = importlib.util.spec_from_file_location(name, f".probe/{name}_resolve.py")
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod
v7 = load("v7")
forms = [("new 8 warps", new, dict(_SEARCH_BINS=32), 8),
         ("v7 8 warps", v7, dict(_SEARCH_BINS=32), 8),
         ("new 16 warps", new, dict(_SEARCH_BINS=32), 16),
         ("v7 16 warps", v7, dict(_SEARCH_BINS=32), 16)]
res = {}
def run(batch, rates, label, forms, dtypes):
    for rate in rates:
        topk, counts = kr.draw_topk(batch, kr.TOP_K, rate, gen)
        pristine = [t.clone() for t in batch.state()]
        args = kr.resolve_args(batch, topk, counts, step, layout, gpu_pool, host_pool)
        topk_pos, counts, gpu_pages, host_pages, hot, held, stamp, rmap, step_t = args[:9]
        for rnd in range(3):
            for sd, md in dtypes:
                stamp_x, rmap_x = stamp.to(sd), rmap.to(md)
                table = new._stacked_lease_table(hot, held, stamp_x, rmap_x)
                step_x = step_t.to(sd)
                reset = (lambda: (held.copy_(pristine[0]), stamp_x.copy_(pristine[1]), rmap_x.copy_(pristine[2]))) if rate else None
                for name, mod, knobs, warps in forms:
                    for k, v in knobs.items():
                        setattr(mod, k, v)
                    us = kr.graph_ms(lambda: mod._launch_plan(topk_pos, counts, gpu_pages, host_pages, table, sd, md, step_x,
                                                              gpu_pool, None, mod.PAGE_SIZE, warps), 20, setup=reset) * 1e3
                    res.setdefault((rate, str(sd)[6:] + "/" + str(md)[6:] + label, name), []).append(us)
        for t, p in zip(batch.state(), pristine):
            t.copy_(p)
both = ((torch.int32, torch.int16), (torch.int64, torch.int32))
run(batch, (0.0, 0.01, 0.05), "", forms, both)
half = kr.make_batch([kr.CTX] * 100, kr.HOT_ROWS, kr.CTX, 0.5, host_pool.shape[0], 1000, gen, torch.device("cuda"))
run(half, (0.0, 0.01), " res50", forms, both[:1])
print(f"{'miss':>5} {'tables':>18} {'form':>18} {'median us':>10}  runs")
for (rate, tables, name), v in res.items():
    print(f"{rate:5.0%} {tables:>18} {name:>18} {statistics.median(v):10.2f}  " + " ".join(f"{x:.2f}" for x in v))
