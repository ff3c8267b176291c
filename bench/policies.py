"""Residency policies side by side on a multi-turn agent workload.

Model: GLM-5.3's attention shapes (64 heads, q_lora 2048, latent 512 + rope 64,
32 indexer heads x 128, IndexShare pattern full/full/full/shared...), fewer
layers and experts, random weights, FP8 KV. Workload: vLLM's published GLM-5.3
agent benchmark (OpenHands traces: 13 turns, first turn 74,160 tokens, later
turns 753, 220 output tokens), every length scaled by `--scale`, with the GPU
page pool (GLM-5.3 on 8x H200: 9,269 pages of 64 tokens) and host pool (384 GiB)
scaled by the same factor so memory pressure matches; `index_topk` is scaled too
so context / top-K stays GLM's. Conversations run closed-loop: a turn starts
when the previous one finishes. The check without pressure (`--no-pressure-check`,
`hybrid` against `off` on an 8x pool) keeps GLM's 220 output tokens a turn at any
scale: it compares decode TPOT, and scaled outputs would make nearly every step
carry a new turn's prefill rows.

Top-K source: the model's own indexer (`--trace model`), or a synthetic decode
trace (`--trace synthetic`, `bench/topk_trace.py`) whose reuse distances reproduce published
miss rates (about 30 / 13.4 / 6.7 % for an LRU of 1x / 2x / 4x top-K), drawn for every decode row
of a step at once on the GPU. Decode steps run as captured CUDA graphs with the model's indexer
and eagerly with the synthetic trace (its draws are Python calls a replay would skip).

Prints one table per run: mean running requests, output tokens/s, TPOT p50/p90,
TTFT p50, hot hit rate, host-to-device GB/s and its share of the pinned H2D copy
bandwidth measured in the same run; ratios against `offload` and `off`; the mean step time
(with mean running requests it shows how a step's cost grows with its batch).
Usage (GPU): python bench/policies.py --trace model --trace synthetic
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.attention_ops import AttentionOps, TopK  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.forward_batch import ForwardBatch  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.request import SamplingParams  # noqa: E402
from engine.tiny import TINY_CONFIG  # noqa: E402
from engine.tiny_tokenizer import write_tiny_tokenizer  # noqa: E402
from residency.config import HiSparseConfig  # noqa: E402
from agent_trace import FIRST_TURN, LATER_TURN, OUTPUT, TURNS  # noqa: E402
from topk_trace import ReuseDistanceTrace  # noqa: E402

logger = logging.getLogger("bench.policies")

# GLM-5.3's GPU pool (FP8 KV, 8x H200 at 0.92 utilisation) as engine.memory_plan gave it when these runs began,
# held fixed so every recorded run has the same pressure; the plan of today's weights is in
# notebooks/concurrency.ipynb (7,578 pages: the engine's FP8 weights as it holds them are larger, and the
# MTP layer glm53.yaml drafts with adds its weights and a 79th row to every token).
GLM53_GPU_PAGES = 9269
GLM53_HOST_PAGES = 125907  # 384 GiB of GLM-5.3 pages


def glm53_shaped_config(layers: int, experts: int, topk: int) -> dict:
    pattern = ["full", "full", "full"] + ["shared"] * 3 + (["full"] + ["shared"] * 3) * 20
    return dict(
        TINY_CONFIG, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
        num_hidden_layers=layers, num_attention_heads=64, num_key_value_heads=64, q_lora_rank=2048,
        kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32,
        index_head_dim=128, index_topk=topk, indexer_types=pattern[:layers], n_routed_experts=experts,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        max_position_embeddings=1 << 20, torch_dtype="bfloat16",
    )


class SyntheticTopK:
    """Decode rows of requests longer than top-K take their top-K from a `ReuseDistanceTrace` (all such
    rows of a step in one draw on the device); every other row keeps the model indexer's choice. Wraps
    the engine's own ops, so sparse attention and the model indexer stay on their kernels."""

    def __init__(self, ops: AttentionOps, seed: int = 0) -> None:
        self.ops = ops
        self.seed = seed
        self._trace: ReuseDistanceTrace | None = None  # made at the first call: top-K and device known then

    def __getattr__(self, name: str):  # noqa: ANN204 - every other op is the engine's own
        if name == "ops":
            raise AttributeError(name)
        return getattr(self.ops, name)

    def indexer_topk(
        self, q: torch.Tensor, weights: torch.Tensor, view: torch.Tensor, batch: ForwardBatch, topk: int,
        scale: float, full_index: int, derived: dict[str, object] | None = None,
    ) -> TopK:
        """The model's choice for the whole batch, then the synthetic one over its decode rows."""
        chosen = self.ops.indexer_topk(q, weights, view, batch, topk, scale, full_index, derived)
        decode = [(start, req) for req, (start, end) in enumerate(batch.row_ranges)
                  if end - start == 1 and batch.context_lens_host[req] > topk]
        if not decode:
            return chosen
        if self._trace is None:
            self._trace = ReuseDistanceTrace(topk, q.device, self.seed)
        # A context longer than K somewhere in the batch: the model's choice is K wide.
        rows = torch.tensor([row for row, _ in decode]).to(q.device, non_blocking=True)
        picks = self._trace.sample([(batch.request_ids[req], full_index) for _, req in decode],
                                   [batch.context_lens_host[req] for _, req in decode])
        positions, counts = chosen.positions.clone(), chosen.counts.clone()
        positions[rows] = picks
        counts[rows] = topk
        return TopK(positions, counts)


@dataclass
class Timeline:
    submitted: float
    first: float | None = None
    finished: float | None = None
    tokens: int = 0


@dataclass
class Conversation:
    history: list[int]
    turns_left: int
    rng: torch.Generator
    timelines: list[Timeline] = field(default_factory=list)


def measure_h2d_gbps(device: str) -> float:
    if device != "cuda":
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * src.numel() / (time.perf_counter() - start) / 1e9


def drive(engine: LLMEngine, convs: list[Conversation], turns: int, out_len: int, scale: float) -> float:
    """Runs every conversation closed-loop (a turn starts when the previous one finishes); returns wall seconds."""
    live: dict[str, Conversation] = {}

    def submit(i: int, conv: Conversation, now: float) -> None:
        n = round((FIRST_TURN if not conv.history else LATER_TURN) * scale)
        conv.history += torch.randint(0, 380, (n,), generator=conv.rng).tolist()
        rid = f"c{i}-t{turns - conv.turns_left}"
        engine.add_request(rid, list(conv.history), SamplingParams(max_tokens=out_len, ignore_eos=True))
        conv.turns_left -= 1
        conv.timelines.append(Timeline(now))
        live[rid] = conv

    start = time.perf_counter()
    for i, conv in enumerate(convs):
        submit(i, conv, start)
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for o in outputs:
            conv = live[o.request_id]
            tl = conv.timelines[-1]
            tl.first = tl.first or now
            tl.tokens = len(o.token_ids)
            if o.finished:
                tl.finished = now
                conv.history += o.token_ids
                del live[o.request_id]
                if conv.turns_left:
                    submit(convs.index(conv), conv, now)
    return time.perf_counter() - start


def run_policy(args: argparse.Namespace, model_dir: Path, policy: str, trace: str, pages: int, host_gib: float,
               conversations: int, turns: int, out_len: int | None = None) -> dict:
    """One policy's run; `out_len`: output tokens a turn (default GLM's 220 scaled, at least 16)."""
    s = args.scale
    hs = HiSparseConfig(policy=policy, host_pool_gib=host_gib if policy in ("hybrid", "offload") else 0.0)
    engine = LLMEngine(EngineConfig(
        model=str(model_dir), dtype="bfloat16" if args.device == "cuda" else "float32",
        kv_dtype="fp8" if args.device == "cuda" else "auto", device=args.device, num_gpu_pages=pages,
        max_num_batched_tokens=max(256, int(32768 * s)), max_num_seqs=256, random_weights=True,
        max_model_len=1 << 20, hisparse=hs, enable_prefix_cache=True,
        enforce_eager=trace == "synthetic",  # the synthetic trace draws in Python each step: no graph replays it
    ))
    if trace == "synthetic":
        engine.executor.worker.ops = SyntheticTopK(engine.executor.worker.ops)  # the ops the forward uses
    convs = [Conversation([], turns, torch.Generator().manual_seed(i)) for i in range(conversations)]
    wall = drive(engine, convs, turns, out_len or max(16, round(OUTPUT * s)), s)
    stats = engine.stats()
    tls = [t for c in convs for t in c.timelines]
    tpot = sorted((t.finished - t.first) / max(t.tokens - 1, 1) for t in tls)
    ttft = sorted(t.first - t.submitted for t in tls)
    by_state = stats["requests_by_state"]
    running = sum(by_state.get(k, {}).get("mean", 0.0) for k in ("full", "mixed", "none"))
    hits, misses = stats.get("hot_hits", 0), stats.get("hot_misses", 0)
    graphs = engine.executor.worker.graphs
    buffered = sum(graphs.steps_run.values()) if graphs is not None else 0  # decode-only steps, graph or buffers
    del engine
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return dict(
        policy=policy, trace=trace, wall_s=wall, mean_running=running, step_ms=1e3 * wall / max(stats["steps"], 1),
        out_tok_s=sum(t.tokens for t in tls) / wall,
        tpot_p50_ms=1e3 * statistics.median(tpot), tpot_p90_ms=1e3 * tpot[int(0.9 * (len(tpot) - 1))],
        ttft_p50_s=statistics.median(ttft), hot_hit_rate=hits / (hits + misses) if hits + misses else float("nan"),
        h2d_gbps=stats.get("bytes_h2d", 0) / wall / 1e9, preemptions=stats["preemptions"], swaps=stats["swaps"],
        demoted=stats.get("pages_demoted", 0), promoted=stats.get("pages_promoted", 0),
        decode_only_share=buffered / max(stats["steps"], 1),
    )


def print_table(rows: list[dict], h2d_ceiling: float) -> None:
    print(f"\n{'trace':<9} {'policy':<8} {'running':>8} {'tok/s':>8} {'TPOT50':>8} {'TPOT90':>8} {'TTFT50':>8} "
          f"{'hit%':>6} {'H2D GB/s':>9} {'%PCIe':>6} {'x offl':>7} {'x off':>6} {'pre+swap':>8} {'step ms':>8}")
    for r in rows:
        peers = {p["policy"]: p for p in rows if p["trace"] == r["trace"]}
        vs_offload = r["out_tok_s"] / peers["offload"]["out_tok_s"] if "offload" in peers else float("nan")
        vs_off = r["out_tok_s"] / peers["off"]["out_tok_s"] if "off" in peers else float("nan")
        print(f"{r['trace']:<9} {r['policy']:<8} {r['mean_running']:>8.2f} {r['out_tok_s']:>8.1f} "
              f"{r['tpot_p50_ms']:>8.1f} {r['tpot_p90_ms']:>8.1f} {r['ttft_p50_s']:>8.2f} "
              f"{100 * r['hot_hit_rate']:>6.1f} {r['h2d_gbps']:>9.3f} {100 * r['h2d_gbps'] / h2d_ceiling:>6.2f} "
              f"{vs_offload:>7.2f} {vs_off:>6.2f} {r['preemptions'] + r['swaps']:>8} {r['step_ms']:>8.1f}")


def interleaved(policies: tuple[str, str], repeats: int) -> list[str]:
    """A, B, B, A, A, B, ...: each policy runs as often first as second in a pair, so a drift of the
    machine over the check (clocks, another tenant) weighs on both alike."""
    a, b = policies
    return [p for i in range(repeats) for p in ((a, b) if i % 2 == 0 else (b, a))]


def print_no_pressure(runs: list[dict]) -> None:
    """Each run's TPOT, the ratio of the policies' medians and the median of the pairs' ratios: one run
    per policy is within the machine's run-to-run spread (10-40 % on a shared host, which can change
    state within a check), a median of interleaved runs less so, and a pair's two runs, back to back,
    share the host's state, so the median of their ratios cancels a change between pairs."""
    share = statistics.median(r["decode_only_share"] for r in runs)
    print(f"\nno pressure (8x pool): decode-only steps {100 * share:.0f} % of steps (median of runs)")
    print(f"{'':<21} {'policy':<8} {'TPOT50 ms per run':<30} {'median':>7} {'tok/s median':>12}")
    medians = {}
    for policy in dict.fromkeys(r["policy"] for r in runs):
        mine = [r for r in runs if r["policy"] == policy]
        medians[policy] = statistics.median(r["tpot_p50_ms"] for r in mine)
        per_run = " ".join(f"{r['tpot_p50_ms']:.1f}" for r in mine)
        print(f"{'':<21} {policy:<8} {per_run:<30} {medians[policy]:>7.1f} "
              f"{statistics.median(r['out_tok_s'] for r in mine):>12.1f}")
    if {"hybrid", "off"} <= medians.keys():
        print(f"TPOT p50 hybrid / off (medians): {medians['hybrid'] / medians['off']:.3f}")
        pairs = [runs[i : i + 2] for i in range(0, len(runs) - 1, 2)]
        ratios = [next(r["tpot_p50_ms"] for r in pair if r["policy"] == "hybrid")
                  / next(r["tpot_p50_ms"] for r in pair if r["policy"] == "off")
                  for pair in pairs if {r["policy"] for r in pair} == {"hybrid", "off"}]
        if ratios:
            print(f"TPOT p50 hybrid / off per pair: {' '.join(f'{x:.3f}' for x in ratios)} "
                  f"(median {statistics.median(ratios):.3f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--scale", type=float, default=0.125, help="factor on every token count and pool size")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=TURNS)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--trace", action="append", choices=["model", "synthetic"])
    parser.add_argument("--policies", nargs="*", default=["hybrid", "offload", "off"],
                        help="policies run under pressure (none: only the no-pressure check)")
    parser.add_argument("--no-pressure-check", action="store_true",
                        help="also compare hybrid and off on the same workload with an 8x pool (no pressure)")
    parser.add_argument("--no-pressure-repeats", type=int, default=3,
                        help="runs of each policy in the no-pressure check, interleaved off/hybrid/hybrid/off...")
    parser.add_argument("--no-pressure-output", type=int, default=OUTPUT,
                        help="output tokens a turn in the no-pressure check (default GLM's 220 at any scale)")
    parser.add_argument("--small", action="store_true", help="tiny-model shapes (CPU smoke run)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    traces = args.trace or ["model"]
    out = Path(os.environ.get("OUT", tempfile.mkdtemp()))
    model_dir = out / "policies-model"
    model_dir.mkdir(parents=True, exist_ok=True)
    write_tiny_tokenizer(model_dir)
    topk = max(64, round(2048 * args.scale))
    raw = dict(TINY_CONFIG, index_topk=topk) if args.small else glm53_shaped_config(args.layers, args.experts, topk)
    (model_dir / "config.json").write_text(json.dumps(dict(raw, vocab_size=raw.get("vocab_size", 448))))
    pages = round(GLM53_GPU_PAGES * args.scale)
    probe = LLMEngine(EngineConfig(model=str(model_dir), num_gpu_pages=1, random_weights=True, device="cpu",
                                   kv_dtype="fp8" if args.device == "cuda" else "auto"))
    host_gib = round(GLM53_HOST_PAGES * args.scale) * probe.layout.page_bytes / 2**30
    del probe
    h2d = measure_h2d_gbps(args.device)
    print(f"scale {args.scale}: top-K {topk}, GPU pages {pages}, host pool {host_gib:.2f} GiB, "
          f"pinned H2D ceiling {h2d:.1f} GB/s", flush=True)
    # Untimed first turn of every conversation under pressure: Triton compiles each kernel shape once per
    # machine, so without it the first policy measured would pay every compile and the others none.
    run_policy(args, model_dir, "hybrid", traces[0], pages, host_gib, args.conversations, 1)
    rows = []
    for trace in traces:
        for policy in args.policies:
            rows.append(run_policy(args, model_dir, policy, trace, pages, host_gib, args.conversations, args.turns))
            print(json.dumps(rows[-1]), flush=True)
    ample = []
    if args.no_pressure_check:
        # The check compares decode TPOT, so its turns keep GLM's output length: scaled to 16 tokens, a turn ends
        # every half step with 32 conversations, nearly every step carries a new turn's prefill rows and runs
        # eagerly, and TPOT measures the host's dispatch of those steps; at 220 tokens a turn ends about every
        # seventh step, as in the unscaled workload, and most steps replay a decode graph.
        for policy in interleaved(("off", "hybrid"), args.no_pressure_repeats):
            row = run_policy(args, model_dir, policy, "model", pages * 8, host_gib, args.conversations, args.turns,
                             args.no_pressure_output)
            ample.append(dict(row, trace="ample"))
            print(json.dumps(ample[-1]), flush=True)
    (out / "policies.json").write_text(json.dumps(rows + ample, indent=1))
    if rows:
        print_table(rows, h2d)
    if ample:
        print_no_pressure(ample)
    return 0


if __name__ == "__main__":
    sys.exit(main())
