"""Decode step time against its HBM floor, at one rank's share of GLM-5.3 (tensor parallel 8).

One rank's shapes: 8 of 64 heads, dense and expert columns cut by 8 (expert width 256), lm_head's
vocabulary rows cut by 8 (the ranks' gather of the logits is added to the 78-layer step: an
all-reduce's latency plus B x 154880 x 4 bytes at `--gather-gbs`; a token is sampled from the rank's
19,360 logits), 256 routed experts top-8 plus the
shared one, q_lora, the latent path and the indexer replicated, FP8 KV rows,
one full indexer layer per four (GLM-5.3: 21 of 78), every layer MoE. Random weights, bf16 or FP8.
For each weight format, two depths (`--depths`, default 4 and 8 layers; 8 and 76 on an H200) separate the
per-layer time from the per-step fixed cost (scheduling, sampling, output): per layer = (t_deep - t_shallow) /
(deep - shallow). That holds while both depths are GPU-bound: the host's own work a step (its wall time less
its waits for the device, `host4`) is printed for the shallow one and marked where it reaches the step, as
at B = 64 on a slower host; the device's fixed cost (`fixdev`, from the kernel sums) is printed beside. Each
engine is built in a fresh process. `--pdl on off`
measures the kernels launched with programmatic dependent launch (kernels/pdl.py, decode graphs of up to 8
requests) and plainly, side by side; with PDL a kernel's GPU time includes its wait for the one before, so
only the wall-time columns compare.

Contexts are built without computing them B times: one prompt is prefilled, its cached pages are
copied (device to device) under every other request's prefix hashes, so each of the B requests owns
distinct pages of valid KV, read from HBM like any other; decode steps then run through the engine
(`LLMEngine.step`: schedule, forward, sample, outputs), timed back to back after a warm-up (the mean
of 12 steps; with asynchronous scheduling the host's work for a step overlaps the step before), in two
modes side by
side: `graph` (decode steps replayed as captured CUDA graphs, engine/rank/decode_graphs.py) and
`eager` (`enforce_eager`: every kernel launched from Python). Each step is also measured by the GPU
time of its kernels (torch.profiler, three more steps). The graphs' page tables are padded to a
width bucket (engine/rank/decode_graphs.py), and the indexer scores the bucket's width: the default
contexts sit just under a bucket edge (8192, 65536), as a context just past one pays up to 1.5x the
indexer's scoring.

The floor of one layer of one step is the bytes it must read from HBM: the weights the batch touches
(attention, the indexer's on full layers, the router, and every distinct expert the batch routes to,
counted from the router's choices in an untimed step), the selected MLA rows (B x min(K, ctx) x 656 B)
and, on full layers, every cached indexer key (B x ctx x 132 B); divided by the HBM copy bandwidth
measured in the same run. The 78-layer step adds two all-reduces per layer (`--allreduce-us`) and the
logits' gather.
A flop floor (2 x weights touched per token, attention products) at the dense peak measured in the
same run is printed beside it. Usage: python bench/step.py [--contexts 8192 65536] [--batches 1 8 ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.timing import dense_tflops, hbm_copy_gbs, in_fresh_process  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.kv_layout import KVLayout  # noqa: E402
from engine.layers import MoE  # noqa: E402
from engine.linear import WeightFormat  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.memory_plan import attention_weight_bytes, indexer_weight_bytes, linear_weight_bytes  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402
from engine.prefix_transfer import PrefixSnapshot, install_prefix, snapshot_prefix  # noqa: E402
from engine.request import SamplingParams  # noqa: E402
from engine.tiny import FP8_QUANTIZATION, TINY_CONFIG  # noqa: E402
from kernels import pdl  # noqa: E402

logger = logging.getLogger("bench.step")
HOST_BOUND = 0.9  # a run whose host work a step is at least this share of its step time is host-bound
TP = 8
VOCAB = 154880  # GLM-5.3's, split TP ways by lm_head
MLA_ROW_BYTES, INDEXER_ROW_BYTES = 656, 132


def rank_config(layers: int, fp8: bool) -> dict:
    """config.json of one rank's share of GLM-5.3 at `layers` layers (one full indexer layer per four)."""
    pattern = (["full"] + ["shared"] * 3) * (layers // 4)
    raw = dict(
        TINY_CONFIG, hidden_size=6144, intermediate_size=12288 // TP, moe_intermediate_size=2048 // TP,
        num_hidden_layers=layers, num_attention_heads=64 // TP, num_key_value_heads=64 // TP, q_lora_rank=2048,
        kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32,
        index_head_dim=128, index_topk=2048, indexer_types=pattern, n_routed_experts=256, num_experts_per_tok=8,
        n_group=1, topk_group=1, first_k_dense_replace=0, max_position_embeddings=1 << 20, vocab_size=VOCAB // TP,
        torch_dtype="bfloat16", eos_token_id=[],
    )
    if fp8:
        raw["quantization_config"] = FP8_QUANTIZATION
    return raw


class ExpertCounter:
    """Counts the distinct experts the router picks per MoE layer during one untimed step."""

    def __init__(self, engine: LLMEngine) -> None:
        self.counts: list[int] = []
        self._worker = engine.executor.worker  # one rank: the engine's own process
        self._model = self._worker.model
        self._graphs = self._worker.graphs
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> ExpertCounter:
        self._worker.graphs = None  # hooks see eager steps only
        for module in self._model.modules():
            if isinstance(module, MoE):
                self._hooks.append(module.gate.register_forward_hook(self._count))
        return self

    def _count(self, module, _inputs, output) -> None:  # noqa: ANN001
        routed = output[1][:, : module.cfg.num_experts_per_tok]  # the shared expert, when appended, is counted apart
        self.counts.append(int(routed.unique().numel()))

    def __exit__(self, *exc: object) -> None:
        self._worker.graphs = self._graphs
        for hook in self._hooks:
            hook.remove()


class DeviceWaits:
    """Times the host's waits for the device while it is entered. A step blocks where the runner collects a
    launched step's tokens (`ModelRunner.collect`), so a step's wall time less these waits is the host's own
    work: when that reaches the step's time the run is host-bound, and its time says nothing of the GPU's."""

    def __init__(self, engine: LLMEngine) -> None:
        self._runner = engine.runner
        self.seconds = 0.0
        self.calls = 0

    def __enter__(self) -> DeviceWaits:
        collect = self._runner.collect

        def timed(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return collect(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        self._runner.collect = timed  # an instance attribute over the class's method, removed on exit
        return self

    def __exit__(self, *exc: object) -> None:
        del self._runner.collect


@dataclass
class Measured:
    step_ms: float  # wall time of a decode step, steps back to back (host work included)
    host_ms: float  # the host's own work a step: the wall time less its waits for the device
    device_ms: float  # GPU kernel time of a decode step (what the step costs once launches are free)
    experts_per_layer: float


def wall_ms_per_step(engine: LLMEngine, steps: int) -> tuple[float, float]:
    """(wall, host) ms a step: the mean wall time of `steps` steps back to back, as a server runs them (with
    asynchronous scheduling the host prepares each step while the device runs the one before), and the part
    of it the host spent on its own work (`DeviceWaits`)."""
    torch.cuda.synchronize()
    with DeviceWaits(engine) as waits:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    return wall * 1e3 / steps, (wall - waits.seconds) * 1e3 / steps


def device_ms_per_step(engine: LLMEngine, steps: int = 3) -> float:
    """Sum of the GPU kernels' own time over `steps` decode steps (torch.profiler), per step."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in kernels) / 1e3 / steps


def build_contexts(engine: LLMEngine, ctx: int, count: int, seed: int) -> list[list[int]]:
    """`count` prompts of `ctx + 1` tokens, each on its own pages, cached as a run of the prompt leaves them (so
    every measured run of a prompt starts from the same cached prefix)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    prompts = [torch.randint(10, vocab, (ctx + 1,), generator=gen).tolist() for _ in range(count)]
    engine.generate([prompts[0]], [SamplingParams(max_tokens=1, ignore_eos=True)])
    snap = snapshot_prefix(engine.kv, engine.executor, prompts[0])
    device = engine.executor.kv_pool.device  # copies stay on the device: no host round trip per request
    mla, idx = snap.mla.to(device), snap.indexer.to(device)
    for prompt in prompts[1:]:
        hashes = engine.kv.lookup_prefix(prompt)[0][: mla.shape[0]]
        install_prefix(engine.kv, engine.executor, prompt, PrefixSnapshot(snap.num_tokens, hashes, mla, idx))
    # A snapshot holds whole indexer pages only (`indexer_tokens_per_page` tokens each): the prompts' tails
    # past them are prefilled once here, so every measured run starts from the same cached prefix (a first
    # run that prefills more rows than a later one rounds differently, and its greedy tokens differ).
    slots = engine.config.max_num_seqs
    for start in range(1, count, slots):
        engine.generate(prompts[start:start + slots], [SamplingParams(max_tokens=1, ignore_eos=True)] * len(
            prompts[start:start + slots]))
    return prompts


def measure(engine: LLMEngine, prompts: list[list[int]], warmup: int = 4, steps: int = 12) -> Measured:
    """Mean decode step time of the batch, steps back to back after its prefill, the experts counted and a warm-up."""
    params = SamplingParams(max_tokens=warmup + steps + 8, ignore_eos=True)
    ids = [f"step-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    while any(not r.output_token_ids for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill of each prompt's uncached tail
    with ExpertCounter(engine) as counter:  # an eager step: before the warm-up, so the timed steps overlap
        engine.step()
    for _ in range(warmup):
        engine.step()
    step_ms, host_ms = wall_ms_per_step(engine, steps)
    device = device_ms_per_step(engine)
    while engine.has_unfinished():
        engine.step()
    return Measured(step_ms, host_ms, device, statistics.mean(counter.counts))


def profile_steps(engine: LLMEngine, prompts: list[list[int]], path: Path, steps: int = 3,
                  replay: list[list[int]] | None = None) -> None:
    """Writes every GPU kernel's launches and time per decode step, then the host's busiest ops, then the
    ops with the most GPU time grouped by the Python lines that issued them, over `steps` decode steps
    (torch.profiler) to `path`: the kernel list is what a layer's device time is made of, and in eager mode
    the stacks name where each element-wise copy or gather comes from (a replayed graph has no stacks). With
    `replay` (a speculative engine), each request drafts its earlier output (`LLMEngine.replay_drafts`)."""
    # a speculative step may yield k + 1 tokens: enough for every profiled step to decode
    params = SamplingParams(max_tokens=(6 + steps + 4) * (1 + engine.num_speculative_tokens), ignore_eos=True)
    for i, prompt in enumerate(prompts):
        rid = f"profile-{time.monotonic_ns()}-{i}"
        engine.add_request(rid, prompt, params)
        if replay is not None:
            engine.replay_drafts(rid, replay[i])
    for _ in range(6):
        engine.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA], with_stack=True) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished():
        engine.step()
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(e.name[:90], []).append(e.device_time)
    lines = [f"{'us/step':>9} {'calls/step':>10}  kernel"]
    for name, times in sorted(kernels.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"{sum(times) / steps:9.1f} {len(times) / steps:10.1f}  {name}")
    total = sum(sum(t) for t in kernels.values()) / steps
    lines.append(f"{total:9.1f} {sum(len(t) for t in kernels.values()) / steps:10.1f}  total")
    host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
    stacks = prof.key_averages(group_by_stack_n=6).table(sort_by="self_device_time_total", row_limit=40,
                                                         max_name_column_width=40)
    path.write_text("\n".join(lines) + "\n\n" + host + "\n\n" + stacks)


def layer_floor(cfg: ModelConfig, fmt: WeightFormat, batch: int, ctx: int, experts: float, gbs: float,
                tflops: float) -> tuple[float, float]:
    """(bytes floor ms, flop floor ms) of one average layer of the step (one full indexer layer per four)."""
    d = 2
    expert = cfg.moe_intermediate_size
    fp8 = fmt.is_fp8("experts")
    per_expert = linear_weight_bytes(2 * expert, cfg.hidden_size, fp8, d) + linear_weight_bytes(cfg.hidden_size, expert, fp8, d)
    weights = (attention_weight_bytes(cfg, cfg.num_attention_heads, fmt, d) + indexer_weight_bytes(cfg, fmt, d) / 4
               + (experts + 1) * per_expert + cfg.n_routed_experts * cfg.hidden_size * d)
    kv = batch * min(cfg.index_topk, ctx) * MLA_ROW_BYTES + batch * ctx * INDEXER_ROW_BYTES / 4
    bytes_ms = (weights + kv) / gbs / 1e6
    active = (attention_weight_bytes(cfg, cfg.num_attention_heads, WeightFormat(), 1)
              + (cfg.num_experts_per_tok + 1) * 3 * cfg.hidden_size * expert)
    attention = 2 * cfg.num_attention_heads * min(cfg.index_topk, ctx) * (cfg.kv_lora_rank * 2 + cfg.qk_rope_head_dim)
    indexer = 2 * cfg.index_n_heads * ctx * cfg.index_head_dim / 4
    flops_ms = batch * (2 * active + attention + indexer) / tflops / 1e9
    return bytes_ms, flops_ms


def run(args: argparse.Namespace, fp8: bool, mode: str, layers: int, pages: int, with_pdl: bool
        ) -> dict[tuple[int, int], Measured]:
    pdl.configure(with_pdl)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(rank_config(layers, fp8)))
        engine = LLMEngine(EngineConfig(
            model=tmp, dtype="bfloat16", kv_dtype="fp8", device="cuda", num_gpu_pages=pages, random_weights=True,
            quantization="fp8" if fp8 else "none", max_num_seqs=max(args.batches),
            max_num_batched_tokens=args.chunk, max_model_len=max(args.contexts) + 64, enable_prefix_cache=True,
            enforce_eager=mode == "eager", async_scheduling=mode != "graph-sync"))
        results = {}
        for ctx in args.contexts:
            prompts = build_contexts(engine, ctx, max(args.batches), seed=ctx)
            for batch in args.profile_batches if args.profile is not None else []:
                profile_steps(engine, prompts[:batch], args.profile / f"profile-{layers}l-{ctx}-B{batch}.txt")
            for batch in args.batches:
                results[(ctx, batch)] = measure(engine, prompts[:batch])
                logger.info("%s %s %d layers ctx %d B %d: %.2f ms", "fp8" if fp8 else "bf16", mode, layers, ctx,
                            batch, results[(ctx, batch)].step_ms)
        engine.shutdown()  # its process ends with the run: the next engine is built in a fresh one
        return results


def print_table(rows: list[dict]) -> None:
    """The run's rows as one table, host-bound shallow runs marked."""
    print(f"\n{'w':4} {'mode':10} {'pdl':3} {'ctx':>6} {'B':>4} {'t4':>7} {'t8':>7} {'host4':>6} {'layer':>7} {'fixed':>7} "
          f"{'fixdev':>6} {'dev/l':>7} {'exp':>5} {'floorB':>7} {'floorF':>7} {'x-fl':>6} {'x-dev':>6} {'step78':>8} "
          f"{'fl78':>7} {'x78':>6}")
    for r in rows:
        # the shallow run's host work near its whole step: host-bound, so its wall time (and the fixed cost and
        # per-layer slope read from it) is the host's, not the GPU's
        bound = "*" if r["host_shallow_ms"] >= HOST_BOUND * r["t_shallow_ms"] else " "
        print(f"{r['weights']:4} {r['mode']:10} {r['pdl']:3} {r['ctx']:>6} {r['B']:>4} {r['t_shallow_ms']:7.2f} {r['t_deep_ms']:7.2f} "
              f"{r['host_shallow_ms']:5.2f}{bound} {r['per_layer_ms']:7.3f} {r['fixed_ms']:7.2f} {r['fixed_device_ms']:6.2f} "
              f"{r['device_layer_ms']:7.3f} {r['experts']:5.0f} {r['floor_bytes_ms']:7.3f} {r['floor_flops_ms']:7.3f} "
              f"{r['x_floor']:6.1f} {r['x_floor_device']:6.1f} {r['step78_ms']:8.1f} {r['floor78_ms']:7.2f} {r['x_floor78']:6.1f}")
    if any(r["host_shallow_ms"] >= HOST_BOUND * r["t_shallow_ms"] for r in rows):
        print(f"* the shallow run was host-bound (its host work at least {HOST_BOUND:.0%} of its step): its fixed "
              "cost and the wall-time slope are the host's; fixdev and dev/l are the device's (reliable where the "
              "kernel sums do not overlap: without PDL, or B >= 32)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", type=int, nargs="+", default=[8100, 65400])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--formats", nargs="+", default=["fp8", "bf16"])
    parser.add_argument("--modes", nargs="+", default=["graph", "graph-sync", "eager"],
                        choices=["graph", "graph-sync", "eager"])
    parser.add_argument("--depths", type=int, nargs=2, default=[4, 8],
                        help="the two depths whose difference is the per-layer time (one rank's 76 fit an H200)")
    parser.add_argument("--pdl", nargs="+", default=["on"], choices=["on", "off"],
                        help="kernels launched with programmatic dependent launch (kernels/pdl.py), or plainly")
    parser.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens of the prefill")
    parser.add_argument("--pool-gib", type=float, default=60.0, help="KV pool of the engine")
    parser.add_argument("--allreduce-us", type=float, default=10.0,
                        help="one TP8 all-reduce of a decode batch's hidden states, for the 78-layer estimate")
    parser.add_argument("--gather-gbs", type=float, default=300.0,
                        help="NVLink bandwidth of the TP8 gather of a decode batch's logits (B x 154880 float32), "
                             "for the 78-layer estimate")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON lines here")
    parser.add_argument("--profile", type=Path, default=None,
                        help="folder for a torch.profiler table per depth, context and profiled batch size")
    parser.add_argument("--profile-batches", type=int, nargs="+", default=[8])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    gbs, tflops = hbm_copy_gbs(), dense_tflops()
    print(f"HBM copy {gbs:.0f} GB/s, bf16 dense matmul {tflops:.0f} TFLOP/s", flush=True)
    rows = []
    for name, mode, launch in [(n, m, p) for n in args.formats for m in args.modes for p in args.pdl]:
        fp8 = name == "fp8"
        shallow, deep = args.depths
        layout = KVLayout.for_model(ModelConfig.from_dict(rank_config(deep, fp8)), "fp8")
        pages = int(args.pool_gib * 2**30 // layout.page_bytes)
        with_pdl = launch == "on"
        t_shallow, t_deep = (in_fresh_process(run, args, fp8, mode, shallow, pages, with_pdl),
                             in_fresh_process(run, args, fp8, mode, deep, pages, with_pdl))
        cfg = ModelConfig.from_dict(rank_config(deep, fp8))
        fmt = WeightFormat("fp8" if fp8 else "dense")
        for (ctx, batch), deep_m in t_deep.items():
            shallow_m = t_shallow[(ctx, batch)]
            per_layer = (deep_m.step_ms - shallow_m.step_ms) / (deep - shallow)
            fixed = shallow_m.step_ms - shallow * per_layer
            device_layer = (deep_m.device_ms - shallow_m.device_ms) / (deep - shallow)
            fixed_device = shallow_m.device_ms - shallow * device_layer
            bytes_ms, flops_ms = layer_floor(cfg, fmt, batch, ctx, deep_m.experts_per_layer, gbs, tflops)
            floor = max(bytes_ms, flops_ms)
            gather = args.allreduce_us / 1e3 + batch * VOCAB * 4 * (TP - 1) / TP / (args.gather_gbs * 1e6)
            full_step = fixed + gather + 78 * (per_layer + 2 * args.allreduce_us / 1e3)
            rows.append(dict(weights=name, mode=mode, pdl=launch, ctx=ctx, B=batch, t_shallow_ms=shallow_m.step_ms,
                             t_deep_ms=deep_m.step_ms, per_layer_ms=per_layer, fixed_ms=fixed,
                             host_shallow_ms=shallow_m.host_ms, fixed_device_ms=fixed_device,
                             device_layer_ms=device_layer, x_floor_device=device_layer / floor,
                             experts=deep_m.experts_per_layer, floor_bytes_ms=bytes_ms, floor_flops_ms=flops_ms,
                             x_floor=per_layer / floor, step78_ms=full_step, floor78_ms=78 * floor,
                             x_floor78=full_step / (78 * floor)))
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
    print_table(rows)


if __name__ == "__main__":
    main()
