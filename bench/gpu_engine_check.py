"""End-to-end engine checks on a GPU: the tiny model on CUDA against its CPU run, and residency.

Prints PASS/FAIL lines and a short table; exits non-zero on any failure.
Run on the GPU machine from the repository root: `python bench/gpu_engine_check.py`.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.request import SamplingParams  # noqa: E402
from engine.tiny import make_tiny  # noqa: E402
from residency.config import HiSparseConfig  # noqa: E402

logger = logging.getLogger("gpu_engine_check")


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 380, (n,), generator=gen).tolist() for n in (250, 240, 230)]


def run(model: Path, device: str, **kw) -> tuple[list[list[int]], dict, float]:
    kw.setdefault("num_gpu_pages", 256)  # ample for three 330-token requests
    engine = LLMEngine(EngineConfig(model=str(model), device=device, enable_prefix_cache=False, **kw))
    params = [SamplingParams(max_tokens=80, ignore_eos=True)] * 3
    start = time.perf_counter()
    outs = engine.generate(prompts(), params)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    engine.check_integrity()
    return [o.token_ids for o in outs], engine.stats(), elapsed


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    out_dir = Path(os.environ.get("OUT", tempfile.mkdtemp()))
    model = make_tiny(out_dir / "tiny")
    failures = 0
    rows = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        nonlocal failures
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)

    cpu_tokens, _, cpu_s = run(model, "cpu")
    gpu_tokens, _, gpu_s = run(model, "cuda")
    agree = sum(a == b for x, y in zip(cpu_tokens, gpu_tokens) for a, b in zip(x, y)) / sum(map(len, cpu_tokens))
    check("float32 cuda tokens equal cpu", agree == 1.0, f"agreement {agree:.3f}")
    rows.append(("float32 ample", "cuda", gpu_s, 0, 0, 0))
    for dtype, kv in (("bfloat16", "bf16"), ("bfloat16", "fp8")):
        toks, stats, secs = run(model, "cuda", dtype=dtype, kv_dtype=kv)
        check(f"{dtype}/{kv} runs on cuda", all(len(t) == 80 for t in toks))
        rows.append((f"{dtype}/{kv} ample", "cuda", secs, 0, 0, 0))
    for policy in ("hybrid", "offload", "preempt"):
        host = 0.05 if policy != "preempt" else 0.0
        hs = HiSparseConfig(policy=policy, host_pool_gib=host)
        toks, stats, secs = run(model, "cuda", num_gpu_pages=16, hisparse=hs)
        check(f"{policy} under pressure equals ample run on cuda", toks == gpu_tokens)
        rows.append((policy, "cuda", secs, stats.get("pages_demoted", 0), stats.get("hot_misses", 0),
                     stats["preemptions"] + stats["swaps"]))
    if any(r[0] == "hybrid" and r[3] == 0 for r in rows):
        check("hybrid demoted pages", False)
    print(f"\n{'run':<22} {'device':<6} {'seconds':>8} {'demoted':>8} {'misses':>8} {'preempt+swap':>12}")
    for name, dev, secs, demoted, misses, pre in rows:
        print(f"{name:<22} {dev:<6} {secs:>8.2f} {demoted:>8} {misses:>8} {pre:>12}")
    print(f"cpu float32 reference: {cpu_s:.2f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
