"""Speculative decoding's step against decoding one token a step, at one rank's share of GLM-5.3 (TP 8).

For each k of `--drafts` (draft tokens a step; 0 always) and each batch size B, the step's wall time (steps back to back)
and its GPU time (torch.profiler), at two depths (4 and 8 layers, with the MTP layer on top), so the
per-layer time and the fixed part (sampling, the MTP layer's drafting, outputs) separate, as in
bench/step.py whose shapes and contexts this reuses. Two draft sources whose acceptance is known:
`mtp`, the MTP layer itself (random weights: nearly no draft accepted, the worst case), and `replay`,
the output of the same engine's `mtp` run of the same prompts fed back as drafts (`LLMEngine.replay_drafts`:
every draft the target agrees with is accepted, the best case). Tokens a step yields per request are
measured (1 + accepted / verifying requests, from the engine's `spec_decode_*` counters), the share of
the timed steps that continued the step before them unread (`cont`, engine/llm_engine.py), and the rows a step
copied from host into hot buffers (`miss/st`: under `--policy hybrid` with a pool smaller than the batch's
contexts, the pressured step this product exists for).

The 78-layer step is built from GPU time (torch.profiler), which separates cleanly by depth: fixed +
78 x per layer + tensor parallelism's communication, which one rank does not run: two all-reduces a layer
(`--allreduce-us`), the verified logits' gather, and for each of the k drafting passes the MTP layer's two
all-reduces and the gather of each rank's best (value, token) pairs. With PDL a kernel's GPU time includes its wait, so for graphs launched
that way (one-token steps of up to 8 requests) the wall time's difference between the depths is the measure
of a layer. The host's share is measured instead, as the wall time the deeper step adds to
its GPU time. Steps are scheduled asynchronously, a verify-and-draft step too (launched before the step it
continues is read, engine/llm_engine.py), so the host's work overlaps the GPU and the 78-layer step takes
the longer of the two; with asynchronous scheduling off a verifying step waits for the host in full.
A deep enough run (`--depths 8 76`: one rank's 76 layers fit an H200) also times the step itself:
`timed78` is the 76-layer step's wall time with the two missing layers (by wall time) and the communication
added, gaps between kernels and the host's share included. Each engine is built in a fresh process; `--pdl`
as in bench/step.py.
TPOT divides the 78-layer step by the tokens a step yields: at the measured acceptance, and at
`--acceptance` tokens a step (GLM-5's published 3.5 for 4 drafts; capped at k + 1), with and without the
host's share. The last column divides the GPU-time TPOT at the stated acceptance by k = 0's, measured in
the same run. `--modes`: `graph` (steps replayed as CUDA graphs, engine/rank/spec_graphs.py) and `eager`.
`--profile DIR` writes, for each profiled batch size of the deeper model and each draft source, the kernels'
GPU time and the host's busiest operations.

    python bench/spec_step.py [--drafts 1 2 3 4] [--batches 1 8 32 64] [--contexts 8100] [--modes graph eager]
                              [--depths 4 8] [--profile DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.step import (  # noqa: E402
    TP, VOCAB, build_contexts, device_ms_per_step, profile_steps, rank_config, wall_ms_per_step,
)
from bench.timing import hbm_copy_gbs, in_fresh_process  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.kv_layout import KVLayout  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402
from engine.request import SamplingParams  # noqa: E402
from residency.config import HiSparseConfig  # noqa: E402
from kernels import pdl  # noqa: E402

logger = logging.getLogger("bench.spec_step")


@dataclass
class Measured:
    step_ms: float  # wall time of a step, steps back to back
    device_ms: float  # GPU kernel time of a step
    tokens_per_step: float  # tokens a step yields per verifying request (1 without drafts)
    continued: float  # share of the timed steps launched before the step they continue was read
    misses: float  # rows a timed step copied from host into hot buffers (`--policy hybrid`: pages demoted)


def _engine(model_dir: str, k: int, mode: str, pages: int, args: argparse.Namespace) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=model_dir, dtype="bfloat16", kv_dtype="fp8", device="cuda", num_gpu_pages=pages, random_weights=True,
        quantization="fp8", max_num_seqs=max(args.batches), max_num_batched_tokens=args.chunk,
        max_model_len=max(args.contexts) + 64 + args.tokens, enable_prefix_cache=True,
        enforce_eager=mode == "eager", num_speculative_tokens=k,
        hisparse=HiSparseConfig(policy=args.policy, host_pool_gib=args.host_pool_gib)))


def measure(engine: LLMEngine, prompts: list[list[int]], tokens: int, replay: list[list[int]] | None,
            warmup: int = 3, steps: int = 10) -> tuple[Measured, list[list[int]]]:
    """The batch's step times after its prefill and a warm-up; returns them and every request's output."""
    ids = [f"spec-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for i, (rid, prompt) in enumerate(zip(ids, prompts)):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
        if replay is not None:
            engine.replay_drafts(rid, replay[i])
    while any(not r.output_token_ids for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill of each prompt's uncached tail
    for _ in range(warmup):
        engine.step()
    before, continued_before = dict(engine.spec_stats.as_dict()), engine.num_continued_steps
    misses_before = engine.stats().get("hot_misses", 0)
    step_ms = wall_ms_per_step(engine, steps)
    after, continued = engine.spec_stats.as_dict(), engine.num_continued_steps - continued_before
    misses = engine.stats().get("hot_misses", 0) - misses_before
    drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    device = device_ms_per_step(engine)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
    return (Measured(step_ms, device, 1.0 + accepted / drafts if drafts else 1.0, continued / steps, misses / steps),
            [outputs[r] for r in ids])


def run(args: argparse.Namespace, k: int, mode: str, layers: int, pages: int, with_pdl: bool
        ) -> dict[tuple[str, int, int], Measured]:
    """(source, context, B) -> measured, for one engine of `layers` layers drafting `k` tokens a step."""
    pdl.configure(with_pdl)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps({**rank_config(layers, True), "num_nextn_predict_layers": 1}))
        engine = _engine(tmp, k, mode, pages, args)
        results = {}
        for ctx in args.contexts:
            prompts = build_contexts(engine, ctx, max(args.batches), seed=ctx)
            replays: dict[int, list[list[int]]] = {}  # each batch's MTP run's outputs, replayed as drafts
            for batch in args.batches:
                measured, outputs = measure(engine, prompts[:batch], args.tokens, None)
                results[("mtp", ctx, batch)] = measured
                replays[batch] = outputs
                if k:
                    results[("replay", ctx, batch)], _ = measure(engine, prompts[:batch], args.tokens, outputs)
                logger.info("k %d %s %d layers ctx %d B %d: %s", k, mode, layers, ctx, batch,
                            {s: round(m.step_ms, 2) for (s, c, b), m in results.items() if (c, b) == (ctx, batch)})
            if args.profile is not None and layers == args.depths[1]:
                args.profile.mkdir(parents=True, exist_ok=True)
                for batch in args.profile_batches:
                    for source, replay in (("mtp", None), ("replay", replays.get(batch)))[: 2 if k else 1]:
                        name = f"k{k}-{source}-{mode}-pdl{int(with_pdl)}-ctx{ctx}-B{batch}.txt"
                        profile_steps(engine, prompts[:batch], args.profile / name, replay=replay)
        engine.shutdown()  # its process ends with the run: the next engine is built in a fresh one
        return results


def derive(args: argparse.Namespace, k: int, batch: int, shallow_m: Measured, deep_m: Measured) -> dict:
    """The 78-layer step and TPOTs of one (k, B, source) from its two depths' measurements. One rank runs
    here, so tensor parallelism's communication is added: two all-reduces a layer, the verified logits'
    gather, and for each of the k drafting passes of the MTP layer its two all-reduces and the gather of
    the ranks' (value, token) pairs."""
    shallow, deep = args.depths
    layer = (deep_m.device_ms - shallow_m.device_ms) / (deep - shallow)
    wall_layer = (deep_m.step_ms - shallow_m.step_ms) / (deep - shallow)  # both depths GPU-bound, PDL waits out
    fixed = shallow_m.device_ms - shallow * layer
    allreduce = args.allreduce_us / 1e3

    def gather(rows: int, row_bytes: int) -> float:
        return allreduce + rows * row_bytes * (TP - 1) / TP / (args.gather_gbs * 1e6)

    # the verified rows' float32 logits; a drafting pass's best (value, token) pair a row from each rank
    comm = gather(batch * (k + 1), VOCAB * 4) + k * (2 * allreduce + gather(batch, TP * 8)) + 78 * 2 * allreduce
    device78 = fixed + 78 * layer + comm
    host = max(0.0, deep_m.step_ms - deep_m.device_ms)
    wall78 = max(device78, deep_m.step_ms)
    # a deep enough run times the step itself: its wall time, with the layers it lacks and the communication added
    timed78 = deep_m.step_ms + (78 - deep) * wall_layer + comm
    stated = min(args.acceptance, k + 1.0)
    return dict(wall_shallow_ms=shallow_m.step_ms, wall_deep_ms=deep_m.step_ms, device_shallow_ms=shallow_m.device_ms,
                device_deep_ms=deep_m.device_ms, device_layer_ms=layer, device_fixed_ms=fixed, host_ms=host,
                device_step78_ms=device78, wall_step78_ms=wall78, timed_step78_ms=timed78,
                tpot78_ms=device78 / deep_m.tokens_per_step, tpot78_stated_ms=device78 / stated,
                wall_tpot78_stated_ms=wall78 / stated, timed_tpot78_stated_ms=timed78 / stated)


def print_table(rows: list[dict]) -> None:
    k0 = {(r["pdl"], r["ctx"], r["B"]): r for r in rows if r["k"] == 0 and r["mode"] == "graph"}
    print(f"\n{'k':>2} {'mode':6} {'pdl':3} {'source':7} {'ctx':>6} {'B':>4} {'tok/st':>6} {'cont':>4} {'miss/st':>7} {'dev/l':>7} "
          f"{'fixed':>6} "
          f"{'host':>6} {'step78':>7} {'timed78':>7} {'TPOT':>7} {'TPOT@a':>7} {'+host@a':>7} {'timed@a':>7} "
          f"{'x k0':>5} {'timed x k0':>10}")
    for r in rows:
        base = k0[(r["pdl"], r["ctx"], r["B"])]
        print(f"{r['k']:>2} {r['mode']:6} {r['pdl']:3} {r['source']:7} {r['ctx']:>6} {r['B']:>4} "
              f"{r['tokens_per_step']:6.2f} {r['continued']:4.2f} {r['misses']:7.0f} "
              f"{r['device_layer_ms']:7.3f} {r['device_fixed_ms']:6.2f} {r['host_ms']:6.2f} "
              f"{r['device_step78_ms']:7.2f} {r['timed_step78_ms']:7.2f} {r['tpot78_ms']:7.2f} "
              f"{r['tpot78_stated_ms']:7.2f} {r['wall_tpot78_stated_ms']:7.2f} {r['timed_tpot78_stated_ms']:7.2f} "
              f"{r['tpot78_stated_ms'] / base['tpot78_stated_ms']:5.2f} "
              f"{r['timed_tpot78_stated_ms'] / base['timed_tpot78_stated_ms']:10.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--drafts", type=int, nargs="+", default=[1, 2, 3, 4],
                        help="the k measured beside k = 0 (GLM-5's published 3.5 tokens a step are for 4)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[8100])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--depths", type=int, nargs=2, default=[4, 8])
    parser.add_argument("--tokens", type=int, default=96, help="output tokens of each request")
    parser.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens of the prefill")
    parser.add_argument("--pool-gib", type=float, default=60.0, help="KV pool of the engine")
    parser.add_argument("--policy", default="off", choices=["off", "hybrid"],
                        help="residency under pressure: with `hybrid` and a pool smaller than the batch's contexts, "
                             "admissions demote pages and steps resolve host-only rows through hot buffers")
    parser.add_argument("--host-pool-gib", type=float, default=0.0, help="pinned host pool (`--policy hybrid`)")
    parser.add_argument("--allreduce-us", type=float, default=10.0, help="one TP8 all-reduce of a step's rows")
    parser.add_argument("--gather-gbs", type=float, default=300.0, help="NVLink bandwidth of the logits' gather")
    parser.add_argument("--acceptance", type=float, default=3.5,
                        help="tokens a step yields at the stated acceptance (capped at k + 1)")
    parser.add_argument("--modes", nargs="+", default=["graph"], choices=["graph", "eager"])
    parser.add_argument("--pdl", nargs="+", default=["on"], choices=["on", "off"],
                        help="kernels launched with programmatic dependent launch (kernels/pdl.py), or plainly")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON lines here")
    parser.add_argument("--profile", type=Path, default=None, help="folder for a kernel table per profiled batch size")
    parser.add_argument("--profile-batches", type=int, nargs="+", default=[1])
    args = parser.parse_args()
    # the warm-up, timed and profiled steps (3 + 10 + 3) must not finish a request: their outputs are not kept
    if args.tokens <= 16 * (max(args.drafts) + 1):
        parser.error(f"--tokens must exceed {16 * (max(args.drafts) + 1)}: requests that accept every draft "
                     "would finish inside the timed steps")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"HBM copy {hbm_copy_gbs():.0f} GB/s", flush=True)
    shallow, deep = args.depths
    layout = KVLayout.for_model(ModelConfig.from_dict(rank_config(deep, True)), "fp8", draft_layers=1)
    pages = int(args.pool_gib * 2**30 // layout.page_bytes)
    rows = []
    runs = [(k, mode, launch) for launch in args.pdl for mode in dict.fromkeys(["graph", *args.modes])
            for k in sorted({0, *args.drafts})]
    for k, mode, launch in runs:
        with_pdl = launch == "on"
        t_shallow, t_deep = (in_fresh_process(run, args, k, mode, shallow, pages, with_pdl),
                             in_fresh_process(run, args, k, mode, deep, pages, with_pdl))
        for (source, ctx, batch), deep_m in t_deep.items():
            row = dict(k=k, mode=mode, pdl=launch, source=source, ctx=ctx, B=batch,
                       tokens_per_step=deep_m.tokens_per_step, continued=deep_m.continued, misses=deep_m.misses,
                       **derive(args, k, batch, t_shallow[(source, ctx, batch)], deep_m))
            rows.append(row)
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
    print_table(rows)


if __name__ == "__main__":
    main()
