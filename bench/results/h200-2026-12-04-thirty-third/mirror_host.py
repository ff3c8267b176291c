"""Host time of Mirroring.mirror_step a step in one no-pressure hybrid run of bench/policies.py (220-token turns)."""
import argparse, json, os, sys, time
from pathlib import Path
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
import policies
from engine.llm_engine import LLMEngine
from engine.config import EngineConfig
from residency.mirroring import Mirroring

out = Path(os.environ["OUT"]); model_dir = out / "policies-model"; model_dir.mkdir(parents=True, exist_ok=True)
policies.write_tiny_tokenizer(model_dir)
scale = 0.0625
args = argparse.Namespace(scale=scale, device="cuda", small=False, layers=6, experts=8)
raw = policies.glm53_shaped_config(6, 8, max(64, round(2048 * scale)))
(model_dir / "config.json").write_text(json.dumps(dict(raw, vocab_size=raw.get("vocab_size", 448))))
pages = round(policies.GLM53_GPU_PAGES * scale)
probe = LLMEngine(EngineConfig(model=str(model_dir), num_gpu_pages=1, random_weights=True, device="cpu", kv_dtype="fp8"))
host_gib = round(policies.GLM53_HOST_PAGES * scale) * probe.layout.page_bytes / 2**30
del probe
timer = {"s": 0.0, "n": 0}
orig = Mirroring.mirror_step
def timed(self, steps):
    t = time.perf_counter(); orig(self, steps); timer["s"] += time.perf_counter() - t; timer["n"] += 1
Mirroring.mirror_step = timed
for _ in range(2):
    timer.update(s=0.0, n=0)
    row = policies.run_policy(args, model_dir, "hybrid", "model", pages * 8, host_gib, 32, 13, 220)
    print(f"hybrid step {row['step_ms']:.2f} ms, TPOT p50 {row['tpot_p50_ms']:.2f} ms, "
          f"mirror_step {1e3 * timer['s'] / max(timer['n'], 1):.3f} ms a call over {timer['n']}", flush=True)
