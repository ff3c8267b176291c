"""Indexer key write on the H200 at GLM-5.3's shape: LayerNorm + rotation + FP8 packing as three launches (the
former path) against one (KeyPrep), codes compared and times in a CUDA graph."""
import sys, torch
sys.path.insert(0, ".")
import torch.nn.functional as F
from bench.timing import bench_graph
from engine.layers import rotate
from kernels import fp8_pack

torch.manual_seed(0)
d, r, tokens = 128, 64, 128
pool_a = torch.zeros((4096, tokens * 132), dtype=torch.uint8, device="cuda")
pool_b = pool_a.clone()
place = fp8_pack.KeyPlacement(tokens, 0, d, tokens * d, 4)
w = (torch.rand(d, device="cuda") + 0.5).bfloat16()
b = (torch.randn(d, device="cuda") * 0.1).bfloat16()
print(f"{'T':>4} {'codes equal':>12} {'scales equal':>12} {'3 launches us':>14} {'1 launch us':>12}")
for t in (1, 8, 32, 64, 512):
    wide = (torch.randn(t, 2048 + 576 + 128, device="cuda") * 2).bfloat16()
    raw = wide[:, -128:]
    ang = torch.rand(t, r // 2, device="cuda") * 6
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    slots = torch.randperm(4096 * tokens, device="cuda")[:t].int()
    prep = fp8_pack.KeyPrep(w, b, 1e-6, cos, sin, r, True)
    old = lambda: fp8_pack.pack_indexer_rows_into(rotate(F.layer_norm(raw, (d,), w, b, 1e-6), cos, sin, r, True), pool_a, slots, place)
    new = lambda: fp8_pack.pack_indexer_rows_into(raw, pool_b, slots, place, prep)
    old(); new(); torch.cuda.synchronize()
    pages, at = (slots // tokens).long(), (slots % tokens).long()
    va = pool_a[:, : tokens * d].view(-1, tokens, d)[pages, at]
    vb = pool_b[:, : tokens * d].view(-1, tokens, d)[pages, at]
    sa = pool_a[:, tokens * d :].contiguous().view(torch.float32)[pages, at]
    sb = pool_b[:, tokens * d :].contiguous().view(torch.float32)[pages, at]
    t_old, t_new = bench_graph([old] * 20) * 1e3, bench_graph([new] * 20) * 1e3
    print(f"{t:4d} {(va == vb).float().mean().item():12.4f} {(sa == sb).float().mean().item():12.4f} {t_old:14.2f} {t_new:12.2f}")
