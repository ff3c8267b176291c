"""Where a fused MoE call's time goes at decode sizes: each kernel's own time (torch.profiler over CUDA-graph
replays of 16 routings x 4 layers' weights, no PDL), GLM-5.3's rank shapes, fp8."""
import sys, collections, torch
sys.path.insert(0, ".")
from bench.timing import bench_graph, hbm_copy_gbs
from bench.fused_moe import make_layer, routing, expert_bytes, H, E, K, LAYERS, ROUTINGS
from kernels.fused_moe import fused_moe

gbs = hbm_copy_gbs()
layers = [make_layer("fp8", 100 + i) for i in range(LAYERS)]
for t in (8, 32, 64):
    routs = [routing(t, 1000 * t + r) for r in range(ROUTINGS)]
    xs = [torch.randn(t, H, device="cuda").bfloat16() for _ in range(ROUTINGS)]
    calls = [(lambda r=r: fused_moe(
        xs[r], layers[r % LAYERS]["w13"], layers[r % LAYERS]["w2"], routs[r][0], routs[r][1],
        w13_scale_inv=layers[r % LAYERS]["w13_scale_inv"], w2_scale_inv=layers[r % LAYERS]["w2_scale_inv"]))
        for r in range(ROUTINGS)]
    per_call = bench_graph(calls) * 1e3
    distinct = sum(int(torch.unique(ids).numel()) for _, ids in routs) / ROUTINGS
    floor = distinct * expert_bytes("fp8") / (gbs * 1e3)
    for f in calls: f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in calls: f()
    g.replay(); torch.cuda.synchronize()
    reps = 5
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps): g.replay()
        torch.cuda.synchronize()
    agg = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            agg[ev.name[:40]] += ev.device_time if hasattr(ev, "device_time") else ev.cuda_time
    n = reps * ROUTINGS
    parts = sorted(((v / n, k) for k, v in agg.items()), reverse=True)
    own = sum(v for v, _ in parts)
    print(f"T={t}: {per_call:.1f} us a call (graph), bytes floor {floor:.1f} us ({floor / per_call:.0%}), kernels' own sum {own:.1f}")
    for v, k in parts:
        print(f"   {v:7.2f} us  {k}")
