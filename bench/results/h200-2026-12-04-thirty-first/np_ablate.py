"""No-pressure ablation: off, hybrid, hybrid without mirroring, offload (a host pool, no mirroring), rotated
through rounds in one process; TPOT p50 per run, and each run's ratio to its round's off."""
import argparse, json, os, statistics, sys
from pathlib import Path
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
import policies
from engine.llm_engine import LLMEngine
from engine.config import EngineConfig
from residency import config as rconfig

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
mirrored = rconfig.POLICY_TRAITS["hybrid"]
configs = ["off", "hybrid", "hybrid-nomirror", "offload"]
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
res = {c: [] for c in configs}
ratios = {c: [] for c in configs}
for r in range(rounds):
    order = configs[r % 4:] + configs[:r % 4]
    got = {}
    for c in order:
        policy = "hybrid" if c.startswith("hybrid") else c
        rconfig.POLICY_TRAITS["hybrid"] = (rconfig.PolicyTraits(runs_from_host=True, mirrors_ahead=False)
                                           if c == "hybrid-nomirror" else mirrored)
        row = policies.run_policy(args, model_dir, policy, "model", pages * 8, host_gib, 32, 13)
        got[c] = row["tpot_p50_ms"]
        res[c].append(row["tpot_p50_ms"])
        print(c, json.dumps({k: row[k] for k in ("wall_s", "step_ms", "tpot_p50_ms", "out_tok_s", "hot_hit_rate")}), flush=True)
    for c in configs:
        ratios[c].append(got[c] / got["off"])
rconfig.POLICY_TRAITS["hybrid"] = mirrored
print(f"\n{'config':<16} {'TPOT p50 ms per round':<34} {'median':>7} {'x off per round':<30} {'median':>6}")
for c in configs:
    print(f"{c:<16} {' '.join(f'{x:5.1f}' for x in res[c]):<34} {statistics.median(res[c]):7.2f} "
          f"{' '.join(f'{x:5.2f}' for x in ratios[c]):<30} {statistics.median(ratios[c]):6.3f}")
