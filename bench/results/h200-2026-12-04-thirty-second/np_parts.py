"""No-pressure parts of hybrid's cost (220-token turns): off, hybrid, and hybrid without the compute stream's
per-step wait for the mirror stream, rotated through rounds in one process; the host time of mirror_step a step."""
import argparse, json, os, statistics, sys, time
from pathlib import Path
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
import policies
from engine.llm_engine import LLMEngine
from engine.config import EngineConfig
from residency.mirroring import Mirroring
from residency.rank import RankResidency

out = Path(os.environ["OUT"]); model_dir = out / "policies-model"; model_dir.mkdir(parents=True, exist_ok=True)
policies.write_tiny_tokenizer(model_dir)
scale = 0.0625
args = argparse.Namespace(scale=scale, device="cuda", small=False, layers=6, experts=8)
topk = max(64, round(2048 * scale))
raw = policies.glm53_shaped_config(6, 8, topk)
(model_dir / "config.json").write_text(json.dumps(dict(raw, vocab_size=raw.get("vocab_size", 448))))
pages = round(policies.GLM53_GPU_PAGES * scale)
probe = LLMEngine(EngineConfig(model=str(model_dir), num_gpu_pages=1, random_weights=True, device="cpu", kv_dtype="fp8"))
host_gib = round(policies.GLM53_HOST_PAGES * scale) * probe.layout.page_bytes / 2**30
del probe
policies.run_policy(args, model_dir, "hybrid", "model", pages, host_gib, 32, 1)
timer = {"s": 0.0, "n": 0}
orig_step, orig_wait = Mirroring.mirror_step, RankResidency.order_after_mirrors
def timed_step(self, steps):
    t = time.perf_counter(); orig_step(self, steps); timer["s"] += time.perf_counter() - t; timer["n"] += 1
Mirroring.mirror_step = timed_step
configs = ["off", "hybrid", "hybrid-nowait"]
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
res = {c: [] for c in configs}; ratios = {c: [] for c in configs}; host = []
for r in range(rounds):
    order = configs[r % 3:] + configs[:r % 3]
    got = {}
    for c in order:
        RankResidency.order_after_mirrors = (lambda self: None) if c == "hybrid-nowait" else orig_wait
        timer.update(s=0.0, n=0)
        row = policies.run_policy(args, model_dir, "hybrid" if c.startswith("hybrid") else c, "model", pages * 8,
                                  host_gib, 32, 13, 220)
        if c == "hybrid":
            host.append(1e3 * timer["s"] / max(timer["n"], 1))
        got[c] = row["tpot_p50_ms"]; res[c].append(row["tpot_p50_ms"])
        print(c, json.dumps({k: row[k] for k in ("wall_s", "step_ms", "tpot_p50_ms", "out_tok_s", "decode_only_share")}),
              f"mirror_step {1e3 * timer['s'] / max(timer['n'], 1):.3f} ms/call over {timer['n']}", flush=True)
    for c in configs:
        ratios[c].append(got[c] / got["off"])
print(f"\nhybrid mirror_step host ms a step, per round: {' '.join(f'{x:.3f}' for x in host)}")
print(f"{'config':<16} {'TPOT p50 ms per round':<34} {'median':>7} {'x off per round':<30} {'median':>6}")
for c in configs:
    print(f"{c:<16} {' '.join(f'{x:5.2f}' for x in res[c]):<34} {statistics.median(res[c]):7.3f} "
          f"{' '.join(f'{x:5.3f}' for x in ratios[c]):<30} {statistics.median(ratios[c]):6.3f}")
