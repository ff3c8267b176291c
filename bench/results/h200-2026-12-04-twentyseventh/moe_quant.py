"""fused_moe at GLM-5.3 TP8 shapes, fp8: default tiles (block_n 64, the intermediate quantised by its own launch)
against block_n 128 (quantised in the gate/up tile), interleaved, three rounds, graph of 16 routings x 4 layers."""
import dataclasses, statistics, sys, torch
sys.path.insert(0, ".")
from bench import fused_moe as fb
from bench.timing import bench_graph
from kernels.fused_moe import FusedMoEConfig, fused_moe

layers = [fb.make_layer("fp8", s) for s in range(fb.LAYERS)]
res = {}
for t in (8, 16, 32, 64, 128):
    x = torch.randn(t, fb.H, device="cuda").to(torch.bfloat16)
    out = torch.empty_like(x)
    routs = [fb.routing(t, 100 + r) for r in range(fb.ROUTINGS)]
    default = FusedMoEConfig.for_problem(t, fb.K, fb.E, weight_dtype=torch.float8_e4m3fn, hidden=fb.H, inter=fb.I)
    forms = {"default": default}
    for stages in (3, 4):
        forms[f"n128 s{stages}"] = dataclasses.replace(default, block_n=128, num_stages=stages)
    def calls(cfg):
        return [lambda w=layers[r % fb.LAYERS], wi=wi: fused_moe(x, **w, topk_weights=wi[0], topk_ids=wi[1], out=out,
                                                                 config=cfg) for r, wi in enumerate(routs)]
    for rnd in range(3):
        for name, cfg in forms.items():
            res.setdefault((t, name, str(default) if name == "default" else ""), []).append(bench_graph(calls(cfg)) * 1e3)
print(f"{'T':>4} {'form':>10} {'median us':>10}  runs")
for (t, name, _), v in res.items():
    print(f"{t:4d} {name:>10} {statistics.median(v):10.1f}  " + " ".join(f"{u:.1f}" for u in v))
