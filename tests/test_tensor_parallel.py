"""Tensor parallelism on CPU (gloo, float32): the same greedy tokens as one rank, with both executors,
under residency pressure too; sharded loading; a killed rank makes the replica unhealthy."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.config import EngineConfig
from engine.executors.executor import WorkerError
from engine.executors.placement import placement_group_bundles
from engine.llm_engine import LLMEngine
from engine.model import GlmMoeDsaForCausalLM
from engine.model_config import ModelConfig
from engine.request import SamplingParams
from engine.tp.tensor_parallel import TensorParallel
from engine.weights import FP8_BLOCK, _read_slice, dequantize_fp8_block, load_weights, random_init
from residency.config import HiSparseConfig
from residency.page_pool import PageUse
from tests.helpers import assert_pages_released, greedy, make_engine, record_device_inputs

# Three requests that fit at admission but not once they grow (as in test_residency.py).
PROMPT_LENS = (250, 240, 230)
NEW_TOKENS = 40
TIGHT_PAGES = 16


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 380, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def single_rank(tiny_dir: Path) -> list[list[int]]:
    """Tokens of one rank with an ample pool: the reference for every split (the ranks sample where the
    logits are, in their own processes, so the split's tokens are what is compared)."""
    engine = make_engine(tiny_dir, enable_prefix_cache=False)
    outs = engine.generate(_prompts(), [greedy(NEW_TOKENS)] * len(PROMPT_LENS))
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def ray_cluster():  # noqa: ANN201 - yields nothing
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        root = str(Path(__file__).resolve().parents[1])
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": root}})
    yield
    if started:
        ray.shutdown()


def _run_under_pressure(tiny_dir: Path, policy: str, **config) -> tuple[LLMEngine, list, int]:  # noqa: ANN003
    """Generates the reference prompts step by step, checking accounting and the ranks' lease tables; also
    returns how many steps were launched before the previous step's tokens were read."""
    hs = HiSparseConfig(policy=policy, host_pool_gib=0.05)
    engine = make_engine(tiny_dir, num_gpu_pages=TIGHT_PAGES, enable_prefix_cache=False, hisparse=hs, **config)
    overlapped = record_device_inputs(engine)
    ids = [f"r{i}" for i in range(len(PROMPT_LENS))]
    for rid, prompt in zip(ids, _prompts()):
        engine.add_request(rid, prompt, greedy(NEW_TOKENS))
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_integrity()  # includes: every rank holds the driver's leases, with identical LRU tables
    return engine, [final[r].token_ids for r in ids], sum(overlapped)


@pytest.mark.parametrize(
    ("executor", "size", "policy"),
    [("mp", 2, "hybrid"), ("ray", 2, "hybrid"), ("mp", 4, "hybrid"), ("mp", 2, "offload")],
)
def test_split_model_matches_single_rank_under_pressure(
    tiny_dir: Path, single_rank, request: pytest.FixtureRequest, executor: str, size: int, policy: str
) -> None:
    if executor == "ray":
        request.getfixturevalue("ray_cluster")
    engine, got, overlapped = _run_under_pressure(tiny_dir, policy, tensor_parallel_size=size, executor=executor)
    try:
        assert overlapped >= NEW_TOKENS // 2  # steps overlap: every rank takes unread inputs from its own device
        assert got == single_rank
        stats = engine.stats()
        if policy == "hybrid":  # pages left the GPU and rows came back through every rank's hot buffer
            assert stats["pages_demoted"] > 0 and stats["pages_mirrored"] > 0 and stats["hot_misses"] > 0
        else:
            assert stats["swaps"] > 0 and stats["pages_swapped_in"] == stats["pages_swapped_out"]
        assert_pages_released(engine)
        assert engine.residency.host.num_in_use() == 0
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def split_hybrid(tiny_dir: Path):  # noqa: ANN201 - yields the engine
    """Two ranks (mp) with a host tier and a roomy pool."""
    hs = HiSparseConfig(policy="hybrid", host_pool_gib=0.05)
    engine = make_engine(tiny_dir, num_gpu_pages=40, hisparse=hs, tensor_parallel_size=2)
    yield engine
    engine.shutdown()


def test_next_turn_loads_its_host_prefix_on_every_rank(tiny_dir: Path, split_hybrid: LLMEngine) -> None:
    """Turn 2 starts with its prefix host-only: every rank loads the indexer pages and resolves from host."""
    engine = split_hybrid
    per_page = engine.kv.indexer_page_tokens
    turn1 = _prompts()[0][:100] * (per_page // 100 + 1)
    [first] = engine.generate([turn1], [greedy(6)])
    engine.kv.cache.clear()  # the GPU prefix cache is gone; host copies remain
    turn2 = turn1 + first.token_ids + _prompts()[1][:30]
    [second] = engine.generate([turn2], [greedy(8)])
    engine.check_integrity()
    assert second.num_cached_tokens == per_page and engine.stats()["hot_misses"] > 0
    [ref] = make_engine(tiny_dir).generate([turn2], [greedy(8)])
    assert second.token_ids == ref.token_ids


def test_steps_that_sample_no_row_run_on_split_ranks(tiny_dir: Path) -> None:
    """A prompt longer than a step's token budget takes steps whose rows all continue its prefill: none samples.
    The ranks' gather of the vocabulary split's logits could not reshape zero rows, and every rank died."""
    prompt = _prompts()[0][:100]
    params = [greedy(3), SamplingParams(max_tokens=3, temperature=1.0, seed=5, ignore_eos=True)]
    split = make_engine(tiny_dir, tensor_parallel_size=2, executor="mp", max_num_batched_tokens=64)
    try:
        got = [o.token_ids for o in split.generate([prompt, prompt], params)]
    finally:
        split.shutdown()
    assert got == [o.token_ids for o in make_engine(tiny_dir, max_num_batched_tokens=64).generate([prompt] * 2, params)]


def test_shared_host_pool_and_page_copies(split_hybrid: LLMEngine) -> None:
    """The driver writes a host page, every rank loads it, rank 0 mirrors it back (after a fence)."""
    engine, host = split_hybrid, split_hybrid.residency.host
    [gpu] = engine.kv.cache.allocate(1, PageUse.MLA)
    src, dst = host.cache.allocate(2, PageUse.MLA)
    pattern = torch.randint(0, 256, host.data.shape[1:], dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    host.data[src] = pattern
    engine.executor.load_pages([src], [gpu])
    engine.executor.mirror_pages([gpu], [dst]).wait()
    assert torch.equal(host.data[dst], pattern)
    engine.kv.cache.release(gpu)
    host.cache.release(src)
    host.cache.release(dst)
    assert_pages_released(engine)


@pytest.mark.parametrize("executor", ["mp", "ray"])
def test_killed_rank_makes_the_replica_unhealthy(tiny_dir: Path, request: pytest.FixtureRequest,
                                                 executor: str) -> None:
    if executor == "ray":
        request.getfixturevalue("ray_cluster")
    engine = AsyncEngine(EngineConfig(model=str(tiny_dir), tensor_parallel_size=2, executor=executor))

    async def generate(n: int) -> list:
        return [o async for o in engine.generate([5, 6, 7, 8], greedy(n))]

    try:
        assert len(asyncio.run(generate(3))) == 3
        os.kill(engine.engine.executor.pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and engine.is_healthy():  # the idle loop notices by itself
            time.sleep(0.1)
        assert not engine.is_healthy(), "the idle engine loop did not notice the killed rank"
        with pytest.raises(WorkerError):
            engine.engine.check_health()
        with pytest.raises((EngineDeadError, WorkerError)):
            asyncio.run(generate(3))
        assert not engine.is_healthy()
        assert isinstance(engine.error, WorkerError)
    finally:
        engine.shutdown()
        engine.engine.shutdown()


def test_cli_splits_the_model(tiny_dir: Path, single_rank) -> None:
    tokens = single_rank
    ids = ",".join(map(str, _prompts()[0]))
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "generate", "--model", str(tiny_dir), "--prompt-token-ids", ids,
         "--max-tokens", str(NEW_TOKENS), "--ignore-eos", "--no-prefix-cache", "--json",
         "--tensor-parallel-size", "2", "--executor", "mp"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[0])["token_ids"] == tokens[0]


def test_unsplittable_shapes_are_refused_before_any_process_starts(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        make_engine(tiny_dir, tensor_parallel_size=3)


def test_ranks_load_their_slices_of_the_checkpoint(tiny_dir: Path) -> None:
    cfg = ModelConfig.from_dir(tiny_dir)
    full = GlmMoeDsaForCausalLM(cfg)
    load_weights(full, tiny_dir, torch.float32)
    whole = dict(full.named_parameters())
    for rank in range(2):
        shard = GlmMoeDsaForCausalLM(cfg, TensorParallel(rank, 2))
        load_weights(shard, tiny_dir, torch.float32)
        params = dict(shard.named_parameters())
        q_b = whole["model.layers.1.self_attn.q_b_proj.weight"].chunk(2, dim=0)[rank]
        o = whole["model.layers.1.self_attn.o_proj.weight"].chunk(2, dim=1)[rank]
        down = whole["model.layers.2.mlp.experts.w2"][3].chunk(2, dim=1)[rank]
        up = whole["model.layers.2.mlp.experts.w13"][3].chunk(2, dim=0)[1].chunk(2, dim=0)[rank]
        assert torch.equal(params["model.layers.1.self_attn.q_b_proj.weight"], q_b)
        assert torch.equal(params["model.layers.1.self_attn.o_proj.weight"], o)
        assert torch.equal(params["model.layers.2.mlp.experts.w2"][3], down)  # expert 3 of the stack
        assert torch.equal(params["model.layers.2.mlp.experts.w13"][3].chunk(2, dim=0)[1], up)  # its up rows
        for name in ("model.layers.1.self_attn.indexer.wq_b.weight", "model.layers.2.mlp.gate.weight"):
            assert torch.equal(params[name], whole[name])  # replicated


def test_fp8_slices_are_read_on_block_boundaries(tmp_path: Path) -> None:
    weight = torch.randn(300, 260)
    blocks = (-(-300 // FP8_BLOCK), -(-260 // FP8_BLOCK))
    scale = torch.rand(blocks) + 0.5
    fp8 = (weight / 4).to(torch.float8_e4m3fn)
    save_file({"w": fp8, "w_scale_inv": scale}, str(tmp_path / "w.safetensors"))
    want = dequantize_fp8_block(fp8, scale, torch.float32)
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        for dim in (0, 1):
            for rank in range(2):
                got = _read_slice(f, "w", "w_scale_inv", dim, TensorParallel(rank, 2)).dense(torch.float32)
                assert torch.equal(got, want.chunk(2, dim=dim)[rank])


def test_random_weights_are_one_model_at_every_split(tiny_dir: Path) -> None:
    cfg = ModelConfig.from_dir(tiny_dir)
    full = GlmMoeDsaForCausalLM(cfg)
    random_init(full, seed=3)
    shard = GlmMoeDsaForCausalLM(cfg, TensorParallel(1, 4))
    random_init(shard, seed=3)
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(dict(shard.named_parameters())[name], dict(full.named_parameters())[name].chunk(4)[1])


def _argmax_on_rank(rank: int, size: int, store: str, logits: torch.Tensor, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    try:
        tp = TensorParallel(rank, size)
        torch.save(tp.argmax_columns(tp.shard(logits, 1)), f"{out}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


def test_argmax_over_vocabulary_shards_is_the_whole_rows(tmp_path: Path) -> None:
    """Drafts are each rank's best (value, column) pair, gathered: every rank gets the whole row's argmax,
    the first of equal maxima, within a shard and across shards."""
    logits = torch.randn(6, 12, generator=torch.Generator().manual_seed(0))
    logits[1, [2, 9]] = logits[1].max() + 1  # equal maxima on ranks 0 and 1
    logits[2, [7, 8]] = logits[2].max() + 1  # on rank 1 only
    logits[3, 11] = logits[3].max() + 1  # the last column
    out = str(tmp_path / "argmax")
    torch.multiprocessing.spawn(_argmax_on_rank, args=(2, str(tmp_path / "store"), logits, out), nprocs=2)
    for rank in range(2):
        assert torch.equal(torch.load(f"{out}.{rank}"), logits.argmax(dim=-1))
    assert logits.argmax(dim=-1)[:4].tolist()[1:] == [2, 7, 11]


def test_placement_group_bundles() -> None:
    assert placement_group_bundles(1, "cuda") == [{"CPU": 1.0, "GPU": 1.0}]
    bundles = placement_group_bundles(8, "cuda")
    assert bundles[0] == {"CPU": 1.0} and bundles[1:] == [{"CPU": 1.0, "GPU": 1.0}] * 8
    assert placement_group_bundles(2, "cpu") == [{"CPU": 1.0}] * 3


def test_prefix_moves_between_split_replicas(tiny_dir: Path) -> None:
    """P/D with tensor parallel: a prefix computed by a 2-rank replica lands in another 2-rank replica
    (pages read from rank 0, written on every rank) and is reused there unchanged."""
    from engine.prefix_transfer import install_prefix, snapshot_prefix

    prefill = make_engine(tiny_dir, tensor_parallel_size=2, executor="mp")
    decode = make_engine(tiny_dir, tensor_parallel_size=2, executor="mp")
    try:
        per_page = prefill.kv.indexer_page_tokens
        prompt = torch.randint(0, 380, (per_page + 90,), generator=torch.Generator().manual_seed(5)).tolist()
        prefill.generate([prompt], [greedy(1)])
        snap = snapshot_prefix(prefill.kv, prefill.runner.executor, prompt)
        assert install_prefix(decode.kv, decode.runner.executor, prompt, snap) == per_page
        [moved] = decode.generate([prompt], [greedy(8)])
        assert moved.num_cached_tokens == per_page
        [local] = make_engine(tiny_dir).generate([prompt], [greedy(8)])
        assert moved.token_ids == local.token_ids
        assert_pages_released(decode)
    finally:
        prefill.shutdown()
        decode.shutdown()
