"""The no-pressure workload of bench/policies.py under cProfile, off and hybrid interleaved; prints where hybrid's
host time exceeds off's (cumulative seconds per function, last pair of runs)."""
import argparse, cProfile, io, json, os, pstats, sys
from pathlib import Path
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
import policies
from engine.llm_engine import LLMEngine
from engine.config import EngineConfig

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
stats = {}
for i, policy in enumerate(["off", "hybrid", "hybrid", "off"]):
    pr = cProfile.Profile()
    pr.enable()
    row = policies.run_policy(args, model_dir, policy, "model", pages * 8, host_gib, 32, 13)
    pr.disable()
    print(policy, json.dumps({k: row[k] for k in ("wall_s", "step_ms", "tpot_p50_ms", "out_tok_s")}), flush=True)
    pr.dump_stats(out / f"prof-{i}-{policy}.out")
    st = pstats.Stats(pr)
    stats.setdefault(policy, []).append({f"{k[0].split('/work/')[-1].split('site-packages/')[-1]}:{k[1]}({k[2]})": (v[1], v[2], v[3])
                                         for k, v in st.stats.items()})
def cum(policy, key):
    return sum(s.get(key, (0, 0, 0))[2] for s in stats[policy]) / len(stats[policy])
def tot(policy, key):
    return sum(s.get(key, (0, 0, 0))[1] for s in stats[policy]) / len(stats[policy])
def calls(policy, key):
    return sum(s.get(key, (0, 0, 0))[0] for s in stats[policy]) / len(stats[policy])
keys = set().union(*[s.keys() for v in stats.values() for s in v])
print("\nby cumulative seconds, hybrid - off (mean of two runs each):")
for k in sorted(keys, key=lambda k: -(cum("hybrid", k) - cum("off", k)))[:45]:
    print(f"{cum('hybrid', k) - cum('off', k):8.3f} {cum('hybrid', k):8.3f} {cum('off', k):8.3f} {calls('hybrid', k):8.0f} {calls('off', k):8.0f}  {k[:110]}")
print("\nby own seconds, hybrid - off:")
for k in sorted(keys, key=lambda k: -(tot("hybrid", k) - tot("off", k)))[:30]:
    print(f"{tot('hybrid', k) - tot('off', k):8.3f} {tot('hybrid', k):8.3f} {tot('off', k):8.3f} {calls('hybrid', k):8.0f} {calls('off', k):8.0f}  {k[:110]}")
