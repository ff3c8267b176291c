"""The one-launch alignment's experts a program and warps, and the former one-program sort, at GLM-5.3's routing
(E = 257 with the shared expert, k = 9), 16 routings replayed in one CUDA graph; every form checked against the twin."""
import sys, importlib.util, torch, triton
sys.path.insert(0, ".")
from bench.timing import bench_graph
from kernels import moe_align as ma, pdl

spec = importlib.util.spec_from_file_location("old_align", ".probe/old_moe_align.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
E, K, BM = 257, 9, 16
torch.manual_seed(0)

def routing(t):
    ids = torch.stack([torch.randperm(256, device="cuda")[:8] for _ in range(t)]).int()
    return torch.cat([ids, torch.full((t, 1), 256, dtype=torch.int32, device="cuda")], 1)

def launch(ids, experts, warps):
    n = ids.numel()
    max_padded, max_blocks = ma.moe_align_sizes(n, E, BM)
    s = torch.empty(max_padded, dtype=torch.int32, device="cuda")
    b = torch.empty(max_blocks, dtype=torch.int32, device="cuda")
    p = torch.empty(1, dtype=torch.int32, device="cuda")
    def f():
        ma._align_experts_kernel[(triton.cdiv(E, experts),)](
            ids, s, b, p, n, E, max_padded, max_blocks, K, ids.stride(0), ids.stride(1),
            BLOCK_N=max(16, triton.next_power_of_2(n)), BLOCK_E=triton.next_power_of_2(E + 1), BLOCK_M=BM,
            EXPERTS=experts, TAIL=512, num_warps=warps, **pdl.launch_options(ids.device))
    return f, (s, b, p)

print(f"{'T':>4} {'former sort':>11} " + " ".join(f"{f'e{e}w{w}':>7}" for e in (4, 8, 16, 32) for w in (2, 4, 8)))
for t in (8, 16, 32, 64):
    rs = [routing(t) for _ in range(16)]
    t_old = bench_graph([(lambda r=r: old.moe_align(r, E, BM)) for r in rs]) * 1e3
    cells = []
    for e in (4, 8, 16, 32):
        for w in (2, 4, 8):
            fs = [launch(r, e, w) for r in rs]
            ok = True
            for (f, outs), r in zip(fs[:3], rs[:3]):
                f(); torch.cuda.synchronize()
                ok &= all(torch.equal(a, b) for a, b in zip(outs, ma.moe_align_ref(r, E, BM)))
            us = bench_graph([f for f, _ in fs]) * 1e3
            cells.append(f"{us:7.2f}" + ("" if ok else "!"))
    print(f"{t:4d} {t_old:11.2f} " + " ".join(cells), flush=True)
