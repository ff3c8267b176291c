"""Shared test helpers: building model directories, running the reference, watching logits."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams

ROOT = Path(__file__).resolve().parent.parent

# Random small GLM-MoE-DSA shapes for the reference comparison: IndexShare and MoE present,
# index_topk far below the sequence, at least 8 indexer heads (fewer heads tie at ReLU's zero).
REFERENCE_CONFIGS: dict[str, dict[str, Any]] = {
    "wide-latent": dict(
        vocab_size=320, hidden_size=96, intermediate_size=192, moe_intermediate_size=48, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=128, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=24, index_n_heads=8, index_head_dim=32, index_topk=16,
        indexer_types=["full", "shared", "full", "shared", "shared"], n_routed_experts=6, num_experts_per_tok=2,
        first_k_dense_replace=2, n_group=1, topk_group=1, initializer_range=0.1,
    ),
    "grouped-router": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=64, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, index_n_heads=12, index_head_dim=16, index_topk=24,
        indexer_types=["full", "full", "shared", "shared"], n_routed_experts=8, num_experts_per_tok=3,
        first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=False, routed_scaling_factor=1.5,
        initializer_range=0.1,
    ),
}


def save_hf_model(cfg_kwargs: dict[str, Any], out: Path, seed: int) -> Path:
    """A random model saved by transformers itself: the checkpoint format users bring."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**cfg_kwargs, eos_token_id=None))
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    model.save_pretrained(out)
    return out


def hf_greedy(model_dir: Path, prompt: list[int], num_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and their logits from transformers, one decode step at a time."""
    from transformers import DynamicCache, GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt])
    tokens, logits = [], []
    with torch.no_grad():
        for _ in range(num_tokens):
            step = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1].float()
            logits.append(step)
            tokens.append(int(step.argmax()))
            ids = torch.tensor([[tokens[-1]]])
    return tokens, torch.stack(logits)


def hf_logits_of(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits at every position of one full sequence."""
    from transformers import GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([token_ids])).logits[0].float()


class LogitsRecorder:
    """Keeps every logits row the engine samples from, per request, in order (a single-rank engine whose
    steps are not replayed from captured graphs: any engine on a CPU)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.rows: dict[str, list[torch.Tensor]] = {}
        runner, worker = engine.runner, engine.executor.worker
        launch, sample_logits = runner.launch, worker.sample_logits
        step_ids: list[str] = []

        def recording_launch(scheduled, sampling):  # noqa: ANN001, ANN202
            step_ids[:] = [s.request.request_id for s in scheduled if s.completes]
            return launch(scheduled, sampling)

        def recording_sample(logits, sampling):  # noqa: ANN001, ANN202
            for rid, row in zip(step_ids, logits):
                self.rows.setdefault(rid, []).append(row.clone())
            return sample_logits(logits, sampling)

        runner.launch, worker.sample_logits = recording_launch, recording_sample

    def of(self, request_id: str) -> torch.Tensor:
        return torch.stack(self.rows[request_id])


def record_device_inputs(engine: LLMEngine) -> list[bool]:
    """For each step the engine launches from now on: whether some input was taken from the device (a token
    the previous step sampled and the host had not read: the steps overlapped)."""
    launched: list[bool] = []
    launch = engine.executor.launch_model

    def recording(step):  # noqa: ANN001, ANN202
        launched.append(step.prev_rows is not None)
        return launch(step)

    engine.executor.launch_model = recording
    return launched


def make_engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), **overrides))


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def assert_pages_released(engine: LLMEngine) -> None:
    """After every request: each page is free or owned by the prefix cache, none held."""
    engine.check_integrity()
    assert not engine.has_unfinished()
    assert engine.kv.num_pages_in_use() == 0
    assert engine.kv.pool.num_free + engine.kv.cache.num_cached == engine.kv.pool.num_pages


def rewrite_checkpoint(src: Path, dst: Path,
                       transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> Path:
    """A copy of checkpoint `src` in `dst` whose shards' tensors `transform` changed (its index follows)."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    weight_map: dict[str, str] = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors = transform(load_file(str(dst / file)))
        save_file(tensors, str(dst / file))
        weight_map.update({k: file for k in tensors})
    index["weight_map"] = weight_map
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def run_checked(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams],
                replay: list[list[int]] | None = None) -> list[list[int]]:
    """Runs `prompts` to the end step by step, checking the accounting after every step and that every page
    is released at the end; returns each request's tokens. `replay`: each request's drafts are read from that
    output (`LLMEngine.replay_drafts`)."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for i, (rid, prompt, p) in enumerate(zip(ids, prompts, params)):
        engine.add_request(rid, prompt, p)
        if replay is not None:
            engine.replay_drafts(rid, replay[i])
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
        engine.check_integrity()
    assert_pages_released(engine)
    if engine.residency is not None:
        assert engine.residency.host.num_in_use() == 0
        assert engine.stats()["hot_unresolved"] == 0, "selected host-only rows read without a hot slot"
    return [tokens[rid] for rid in ids]


def tokens_within(engine: LLMEngine, steps: int) -> list[int] | None:
    """Steps the engine until nothing is unfinished, at most `steps` times: the tokens of the request that
    finished last, None if none did (a request that never finishes fails a bounded test, not the suite)."""
    tokens = None
    for _ in range(steps):
        tokens = next((o.token_ids for o in engine.step() if o.finished), tokens)
        if not engine.has_unfinished():
            break
    return tokens


def sm90_ptx(kernel: str, types: dict[str, str], constexprs: dict[str, object], num_warps: int = 4) -> str:
    """PTX of `kernel` ("module:name" in kernels/) for an H200 (sm_90), compiled here without a GPU: `types` of its
    runtime arguments (integers default to i32). Compiled in a fresh process: a test module's kernels may be the
    interpreter's (TRITON_INTERPRET=1), which do not compile."""
    script = f"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, name = {kernel!r}.split(":")
kernel = getattr(importlib.import_module("kernels." + module), name)
types, constexprs = json.loads(sys.argv[1]), json.loads(sys.argv[2])
signature = {{a: "constexpr" if a in constexprs else types.get(a, "i32") for a in kernel.arg_names}}
source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
print(triton.compile(source, target=GPUTarget("cuda", 90, 32), options={{"num_warps": {num_warps}}}).asm["ptx"])
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script, json.dumps(types), json.dumps(constexprs)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout
