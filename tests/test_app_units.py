"""The Serve application's parts without a cluster: config schema, GLM tool-call parsing, routing, response bodies,
request validation, the ingress's view of engine liveness, the API key's digest, the body limit and the replica
logs."""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import math
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from pydantic import BaseModel, ValidationError
from ray.exceptions import TaskCancelledError
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from app import heartbeats
from app.body_limit import BodyLimitMiddleware
from app.config import AppConfig, ConfigError, EngineArgs, HiSparseArgs
from app.decode import DecodeServer
from app.errors import APIError, error_body, invalid_request
from app.heartbeats import with_heartbeats
from app.ingress import DecodeStream, EngineLiveness, refusal_error
from app.logs import log_cancellations_briefly
from app.main import build_app
from app.messages import GenerateChunk, GenerateRequest
from app.openai_models import INT32_MAX, ChatCompletionRequest, CompletionRequest, TokenizeRequest
from app.responses import ResponseMeta, collect_chat, stream_chat
from app.router import AffinityRouter, affinity_rank
from app.tool_parser import ToolCall, ToolCallStreamParser, parse_tool_calls
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.kv_layout import KVLayout
from engine.linear import WeightFormat
from engine.llm_engine import LLMEngine
from engine.memory_plan import GIB, MemoryBudget, num_gpu_pages, weight_bytes
from engine.model_config import ModelConfig
from engine.request import InvalidRequestError, SamplingParams
from engine.tiny import shaped_config
from engine.tokenizer import Tokenizer
from engine.tp.sharding import check_shardable

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _args(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())["applications"][0]["args"]


# --- config -------------------------------------------------------------------------------


SHIPPED = sorted(p.name for p in CONFIGS.glob("*.yaml"))
CHECKPOINT_CONFIGS = ["glm53.yaml", "glm53-pd.yaml"]
# The GPU configs: layers of GLM-5.3 each serves, and the tensor-parallel size that splits them.
GPU_CONFIGS = {"h200.yaml": (14, 1), "h200-pd.yaml": (14, 1), "h200-tp2.yaml": (24, 2)}
H200_HBM_BYTES = int(150.1e9)  # what torch.cuda.mem_get_info reports on an H200
GLM53_ARCHITECTURE = CONFIGS / "models" / "glm-5.3" / "config.json"


def test_every_config_is_covered() -> None:
    assert {"tiny.yaml", *CHECKPOINT_CONFIGS, *GPU_CONFIGS} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_validate(name: str) -> None:
    config = AppConfig.from_args(_args(name))
    assert config.decode.num_replicas >= 1
    assert (config.model.path is None) == (config.model.architecture is not None)
    assert config.engine.random_weights == (config.model.architecture is not None)


@pytest.mark.parametrize("name", CHECKPOINT_CONFIGS)
def test_checkpoint_configs_need_a_real_checkpoint(name: str, tiny_dir: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    config = AppConfig.from_args(_args(name))
    assert config.model.path == "${GLM53_MODEL_DIR}" and not config.engine.random_weights
    monkeypatch.delenv("GLM53_MODEL_DIR", raising=False)
    with pytest.raises(ConfigError, match=r"model.path .*GLM53_MODEL_DIR"):
        config.resolved()
    monkeypatch.setenv("GLM53_MODEL_DIR", str(tmp_path))  # a directory, but no checkpoint in it
    with pytest.raises(ConfigError, match="model.path .* has no config.json"):
        config.resolved()
    monkeypatch.setenv("GLM53_MODEL_DIR", str(tiny_dir))
    assert config.resolved().model.path == str(tiny_dir.resolve())


@pytest.mark.parametrize("name", CHECKPOINT_CONFIGS)
def test_checkpoint_configs_refuse_the_random_weight_form(name: str) -> None:
    args = _args(name)
    args["model"] = {"architecture": str(GLM53_ARCHITECTURE), "overrides": {"num_hidden_layers": 8}}
    with pytest.raises(ConfigError, match=r"model.architecture has no weights: set engine.random_weights: true"):
        AppConfig.from_args(args)
    args["model"]["path"] = "${GLM53_MODEL_DIR}"  # both forms at once
    with pytest.raises(ConfigError, match=r"args.model: .*give path .* or architecture .*exactly one"):
        AppConfig.from_args(args)
    del args["model"]["architecture"], args["model"]["overrides"]
    args["engine"]["random_weights"] = True  # random weights alone never drop the checkpoint requirement
    config = AppConfig.from_args(args)
    assert config.model.path == "${GLM53_MODEL_DIR}"


def test_the_session_header_is_a_header_name_in_any_case() -> None:
    """Chat read headers lower-cased, so `X-Session-Id` in a config matched no chat request and every conversation
    was routed by its opening; an empty name matched none at all."""
    routing = AppConfig.from_args({**_args("tiny.yaml"), "routing": {"session_header": "X-Session-Id"}}).routing
    assert routing.session_header == "x-session-id"
    for name in ("", "x session", "x-session:"):
        with pytest.raises(ConfigError, match="session_header"):
            AppConfig.from_args({**_args("tiny.yaml"), "routing": {"session_header": name}})


def test_a_body_limit_below_the_admission_limit_is_refused() -> None:
    """Bodies of max_body_bytes could not carry prompts the admission limit admits: those got 413, not served."""
    api = {"max_prompt_tokens": 1900, "max_body_bytes": 1800}
    with pytest.raises(ConfigError, match="max_body_bytes 1800 cannot hold a prompt of max_prompt_tokens 1900"):
        AppConfig.from_args({**_args("tiny.yaml"), "api": api})
    assert AppConfig.from_args({**_args("tiny.yaml"), "api": {**api, "max_body_bytes": 65536}}).api.body_limit(2048)


def test_model_forms_are_checked() -> None:
    with pytest.raises(ConfigError, match="exactly one"):
        AppConfig.from_args({"model": {}})
    with pytest.raises(ConfigError, match="overrides change an architecture"):
        AppConfig.from_args({"model": {"path": "x", "overrides": {"num_hidden_layers": 2}}})
    with pytest.raises(ConfigError, match="create_tiny writes a checkpoint"):
        AppConfig.from_args({"model": {"architecture": "x", "create_tiny": True}, "engine": {"random_weights": True}})
    args = _args("h200-pd.yaml")
    args["prefill_engine"]["random_weights"] = False
    with pytest.raises(ConfigError, match="set prefill_engine.random_weights: true"):
        AppConfig.from_args(args)
    args["prefill_engine"].update(random_weights=True, seed=1)
    with pytest.raises(ConfigError, match="prefill_engine.seed must equal engine.seed"):
        AppConfig.from_args(args)
    pd = _args("glm53-pd.yaml")
    assert AppConfig.from_args(pd).prefill_engine.num_speculative_tokens == 1
    pd["prefill_engine"]["num_speculative_tokens"] = 0  # its pages would lack the MTP layer's rows
    with pytest.raises(ConfigError, match="must both draft"):
        AppConfig.from_args(pd)
    with pytest.raises(ConfigError, match=r"call resolved\(\) first"):
        AppConfig.from_args(_args("h200.yaml")).engine_config()


def test_glm53_settings() -> None:
    config = AppConfig.from_args(_args("glm53.yaml"))
    engine, hs = config.engine, config.engine.attention_config.hisparse_config
    assert (engine.kv_dtype, engine.max_num_batched_tokens, engine.max_num_seqs) == ("fp8", 32768, 256)
    assert engine.gpu_memory_utilization == 0.92 and engine.tensor_parallel_size == 8
    assert (hs.policy, hs.host_pool_gib, hs.offload_pool_gib) == ("hybrid", 384, 128)
    assert config.api.max_prompt_tokens == 142_000 and config.prefill.num_replicas == 0
    assert AppConfig.from_args(_args("glm53-pd.yaml")).prefill.num_replicas >= 1


def _pool_tokens(raw: dict, layers: int, tp: int, engine: EngineArgs) -> int:
    """KV tokens one GPU of the replica holds at `layers` layers, by the engine's own memory plan."""
    cfg = ModelConfig.from_dict(shaped_config(raw, {"num_hidden_layers": layers}))
    layout = KVLayout.for_model(cfg, "fp8")
    weights = weight_bytes(cfg, tp, WeightFormat("fp8"), torch.bfloat16)
    reserve = int(engine.activation_reserve_gib * GIB)
    budget = MemoryBudget(H200_HBM_BYTES, engine.gpu_memory_utilization, weights, reserve)
    return num_gpu_pages(budget, layout) * layout.page_size


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_gpu_configs_serve_glm53_shapes_at_the_most_layers_that_fit(
        name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the model directory is written
    monkeypatch.chdir(CONFIGS.parent)  # the architecture path is relative to the repository root
    layers, tp = GPU_CONFIGS[name]
    config = AppConfig.from_args(_args(name)).resolved()
    engine = config.engine_config()
    assert Path(engine.model).parent == tmp_path / "hisparse-models"
    assert not list(Path(engine.model).glob("*.safetensors"))
    assert engine.random_weights and engine.device == "cuda" and engine.kv_dtype == "fp8"
    assert (engine.dtype, engine.quantization, engine.tensor_parallel_size) == ("bfloat16", "fp8", tp)
    assert engine.max_num_seqs == 64 and engine.hisparse.policy == "hybrid" and engine.hisparse.host_pool_gib >= 64
    cfg = ModelConfig.from_dir(engine.model)
    glm53 = ModelConfig.from_dir(GLM53_ARCHITECTURE.parent)
    assert cfg.num_hidden_layers == layers and cfg.indexer_types == glm53.indexer_types[:layers]
    kept = ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_rope_head_dim", "n_routed_experts",
            "num_experts_per_tok", "moe_intermediate_size", "index_topk", "vocab_size", "first_k_dense_replace")
    assert [getattr(cfg, k) for k in kept] == [getattr(glm53, k) for k in kept]
    shape = (cfg.hidden_size, cfg.num_attention_heads, cfg.n_routed_experts, cfg.num_experts_per_tok)
    assert shape == (6144, 64, 256, 8)
    assert engine.weight_format(cfg.fp8_block_checkpoint).kind == "fp8"
    check_shardable(cfg, tp, fp8=True)
    tokenizer = Tokenizer.from_dir(engine.model)
    assert tokenizer.vocab_size <= cfg.vocab_size and set(cfg.eos_token_ids) <= set(tokenizer.eos_token_ids)
    # The layer count is the largest whose KV pool holds 16 conversations of 80K tokens.
    raw = json.loads(GLM53_ARCHITECTURE.read_text())
    assert _pool_tokens(raw, layers, tp, config.engine) >= 16 * 81920 > _pool_tokens(raw, layers + 1, tp, config.engine)
    if config.prefill.num_replicas:
        prefill = config.engine_config("prefill")
        assert prefill.random_weights and prefill.seed == engine.seed and prefill.model == engine.model
    assert build_app(_args(name)) is not None  # Serve accepts the deployments (placement groups included)


def test_ray_ranks_need_one_bundle_each() -> None:
    args = _args("h200-tp2.yaml")
    assert len(args["decode"]["placement_group_bundles"]) == 3
    args["decode"]["placement_group_bundles"] = args["decode"]["placement_group_bundles"][:2]
    with pytest.raises(ConfigError, match="decode.placement_group_bundles needs 3 bundles"):
        AppConfig.from_args(args)
    del args["decode"]["placement_group_bundles"]
    with pytest.raises(ConfigError, match="decode.placement_group_bundles needs 3 bundles"):
        AppConfig.from_args(args)
    args["engine"]["executor"] = "mp"  # spawned processes need no placement group
    assert AppConfig.from_args(args).engine.tensor_parallel_size == 2


def test_architecture_overrides_are_checked(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def resolve(model: dict) -> AppConfig:
        return AppConfig.from_args({"model": model, "engine": {"random_weights": True}}).resolved()

    with pytest.raises(ConfigError, match=r"model.overrides: .*\['num_hidden_layer'\]"):
        resolve({"architecture": str(tiny_dir), "overrides": {"num_hidden_layer": 2}})
    with pytest.raises(ConfigError, match="model.architecture with model.overrides: indexer_types must list one"):
        resolve({"architecture": str(tiny_dir), "overrides": {"num_hidden_layers": 7}})  # tiny lists 6 layers
    with pytest.raises(ConfigError, match="model.architecture .* is not a config.json file"):
        resolve({"architecture": str(tmp_path / "missing.json")})
    with pytest.raises(ConfigError, match="vocab_size 64 is below the tokenizer's"):
        resolve({"architecture": str(tiny_dir), "overrides": {"vocab_size": 64}})
    first = resolve({"architecture": str(tiny_dir / "config.json"), "overrides": {"num_hidden_layers": 4}}).model.path
    again = resolve({"architecture": str(tiny_dir), "overrides": {"num_hidden_layers": 4}}).model.path
    other = resolve({"architecture": str(tiny_dir), "overrides": {"num_hidden_layers": 5}}).model.path
    assert first == again != other  # one directory per content
    written = sorted(p.name for p in (tmp_path / "hisparse-models").iterdir())
    assert written == sorted({Path(first).name, Path(other).name})  # no half-written copies left behind


def test_tiny_architecture_serves_random_weights_on_cpu(tiny_dir: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    args = {"model": {"architecture": str(tiny_dir), "overrides": {"num_hidden_layers": 3, "index_topk": 16}},
            "engine": {"random_weights": True, "seed": 3, "num_gpu_pages": 16, "max_model_len": 256, "max_num_seqs": 2}}
    config = AppConfig.from_args(args).resolved()
    tiny = ModelConfig.from_dir(tiny_dir)
    engine = LLMEngine(config.engine_config())
    try:
        cfg = engine.model_config
        assert (cfg.num_hidden_layers, cfg.index_topk, cfg.indexer_types) == (3, 16, tiny.indexer_types[:3])
        assert cfg.hidden_size == tiny.hidden_size and cfg.vocab_size == tiny.vocab_size
        prompt = engine.tokenizer.encode("random weights at the tiny shape, sparse past sixteen tokens of context")
        assert len(prompt) > 16
        [out] = engine.generate([prompt], [SamplingParams(max_tokens=4, ignore_eos=True)])
        assert len(out.token_ids) == 4 and all(0 <= t < cfg.vocab_size for t in out.token_ids)
        assert out.text  # every id of the vocabulary has text (padded ids too), so a stream shows its tokens
        padded = list(range(cfg.vocab_size - 3, cfg.vocab_size))
        assert engine.tokenizer.encode(engine.tokenizer.decode(padded)) == padded
        # Random, not the checkpoint beside the architecture: the tiny checkpoint's own weights answer otherwise.
        embedding = engine.executor.worker.model.model.embed_tokens.weight  # the checkpoint's std is 0.08
        assert embedding.std().item() == pytest.approx(0.02, rel=0.05)
    finally:
        engine.shutdown()


def test_unknown_fields_are_refused_with_their_path() -> None:
    args = {"model": {"path": "x"}, "engine": {"max_num_seq": 3}, "decod": {}}
    with pytest.raises(ConfigError) as info:
        AppConfig.from_args(args)
    message = str(info.value)
    assert "args.engine.max_num_seq: unknown field" in message and "max_num_seqs" in message
    assert "args.decod: unknown field" in message


def test_bad_values_and_policy_without_host_pool() -> None:
    with pytest.raises(ConfigError, match="max_num_seqs"):
        AppConfig.from_args({"model": {"path": "x"}, "engine": {"max_num_seqs": 0}})
    hybrid_without_pool = {"attention_config": {"hisparse_config": {"policy": "hybrid"}}}
    with pytest.raises(ConfigError, match="host_pool_gib"):
        AppConfig.from_args({"model": {"path": "x"}, "engine": hybrid_without_pool})
    with pytest.raises(ConfigError, match="decode.num_replicas"):
        AppConfig.from_args({"model": {"path": "x"}, "decode": {"num_replicas": 0}})
    with pytest.raises(ConfigError, match="engine.device.*cpu, cuda or cuda:N, got 'gpu'"):
        AppConfig.from_args({"model": {"path": "x"}, "engine": {"device": "gpu"}})


def test_model_path_from_environment(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINY_DIR_FOR_TEST", str(tiny_dir))
    config = AppConfig.from_args({"model": {"path": "${TINY_DIR_FOR_TEST}"}}).resolved()
    assert config.model.path == str(tiny_dir.resolve())
    with pytest.raises(ConfigError, match="UNSET_DIR_FOR_TEST"):
        AppConfig.from_args({"model": {"path": "$UNSET_DIR_FOR_TEST/x"}}).resolved()


def test_engine_config_takes_the_fields_the_engine_has(tiny_dir: Path) -> None:
    args = _args("tiny.yaml")
    args["model"]["path"] = str(tiny_dir)
    args["engine"]["num_speculative_tokens"] = 3  # applied once the engine has it, logged until then
    args["engine"].update(enforce_eager=True, async_scheduling=False)
    engine = AppConfig.from_args(args).resolved().engine_config()
    assert engine.num_gpu_pages == 96 and engine.max_model_len == 2048
    assert engine.enforce_eager and not engine.async_scheduling
    assert engine.hisparse.policy == "hybrid" and engine.hisparse.hot_rows == 64
    assert getattr(engine, "num_speculative_tokens", 3) == 3


def test_build_app_binds_colocated_and_disaggregated(tiny_dir: Path) -> None:
    args = _args("tiny.yaml")
    args["model"]["path"] = str(tiny_dir)
    assert build_app(args) is not None
    args["prefill"]["num_replicas"] = 0
    assert build_app(args) is not None



def test_configs_that_would_fail_on_the_replicas_are_refused_at_build(tiny_dir: Path) -> None:
    """Each was accepted, then failed or wasted work on the replicas: a hot buffer below the model's top-K (the
    decode constructor failed over and over), a prefill engine with a shorter context (every long prompt
    failed there), the prefix cache off beside prefill replicas (every long prompt computed twice)."""
    def build(change: Callable[[dict], None]) -> str:
        args = _args("tiny.yaml")
        args["model"]["path"] = str(tiny_dir)
        change(args)
        with pytest.raises(ConfigError) as info:
            build_app(args)
        return str(info.value)

    hisparse = lambda a: a["engine"]["attention_config"]["hisparse_config"]  # noqa: E731
    assert "hot_rows (8) must be at least index_topk (32)" in build(lambda a: hisparse(a).update(hot_rows=8))
    assert "prefill_engine.max_model_len" in build(
        lambda a: a.update(prefill_engine={**a["engine"], "max_model_len": 1024}))
    assert "enable_prefix_cache" in build(lambda a: a["engine"].update(enable_prefix_cache=False))
    args = _args("tiny.yaml")
    args["model"]["path"] = str(tiny_dir)
    args["prefill"]["num_replicas"] = 0
    args["engine"]["enable_prefix_cache"] = False
    assert build_app(args) is not None  # colocated, the cache may be off


def test_an_unquoted_yaml_off_is_the_policy_off() -> None:
    """YAML reads `policy: off` as false; it was refused, listing 'off' as allowed."""
    section = yaml.safe_load("policy: off")
    assert section == {"policy": False} and HiSparseArgs(**section).policy == "off"

# --- tool calls -----------------------------------------------------------------------------

CALLS = [
    {"type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}},
    {"type": "function", "function": {"name": "search", "arguments": json.dumps({"q": "a <b> c", "filters": {"x": [1]}})}},
]


def _assistant_text(tiny_dir: Path, content: str) -> str:
    """What the model would write for these calls: the tiny template's own rendering of the turn."""
    tokenizer = Tokenizer.from_dir(tiny_dir)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content, "tool_calls": CALLS}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    return rendered.split("<|assistant|>\n", 1)[1]


def test_parse_calls_from_template_rendering(tiny_dir: Path) -> None:
    content, calls = parse_tool_calls(_assistant_text(tiny_dir, "Let me check."))
    assert content == "Let me check."
    assert calls == [ToolCall("get_weather", {"city": "Paris", "days": 3}),
                     ToolCall("search", {"q": "a <b> c", "filters": {"x": [1]}})]


@pytest.mark.parametrize("step", [1, 3, 7])
def test_stream_parser_holds_calls_back_until_they_close(tiny_dir: Path, step: int) -> None:
    text = _assistant_text(tiny_dir, "Checking") + "\ndone"
    parser, events = ToolCallStreamParser(), []
    for i in range(0, len(text), step):
        for event in parser.feed(text[i : i + step]):
            assert not (isinstance(event, str) and "<tool" in event), "call text leaked as content"
            events.append(event)
    events += parser.finish()
    assert [e.name for e in events if isinstance(e, ToolCall)] == ["get_weather", "search"]
    assert "".join(e for e in events if isinstance(e, str)).replace("\n", "") == "Checkingdone"


def test_unclosed_call_stays_text() -> None:
    content, calls = parse_tool_calls("ok <tool_call>get_weather\n<arg_key>city</arg_key>")
    assert calls == [] and content == "ok <tool_call>get_weather\n<arg_key>city</arg_key>"
    parser = ToolCallStreamParser()
    assert parser.feed("a <tool_") == ["a"]
    assert parser.finish() == [" <tool_"]


def _chunks(text: str) -> list[GenerateChunk]:
    return [GenerateChunk(text_delta=c, num_prompt_tokens=5, num_output_tokens=i + 1,
                          finished=i == len(text) - 1, finish_reason="stop" if i == len(text) - 1 else None)
            for i, c in enumerate(text)]


def test_chat_bodies_carry_tool_calls(tiny_dir: Path) -> None:
    meta = ResponseMeta("chatcmpl-1", "glm-tiny", 0, parse_tools=True, include_usage=True)
    text = _assistant_text(tiny_dir, "")
    body = collect_chat(meta, _chunks(text))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "days": 3}

    async def stream() -> list[dict]:
        async def source():
            for chunk in _chunks(text):
                yield chunk
        return [json.loads(line[6:]) for line in [s async for s in stream_chat(meta, source())] if line != "data: [DONE]\n\n"]

    events = asyncio.run(stream())
    calls = [c for e in events if e["choices"] for c in e["choices"][0]["delta"].get("tool_calls", [])]
    assert [c["index"] for c in calls] == [0, 1] and calls[1]["function"]["name"] == "search"
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls" and events[-1]["usage"]["total_tokens"] > 5


def _streamed_message(meta: ResponseMeta, text: str) -> dict[str, Any]:
    """The assistant message a client assembles from the chat stream of `text`, sent a character a chunk."""
    async def source():
        for chunk in _chunks(text):
            yield chunk

    async def events() -> list[dict]:
        lines = [s async for s in stream_chat(meta, source())]
        return [json.loads(line[6:]) for line in lines if line != "data: [DONE]\n\n"]

    deltas = [e["choices"][0]["delta"] for e in asyncio.run(events()) if e["choices"]]
    message: dict[str, Any] = {"role": "assistant", "content": "".join(d.get("content") or "" for d in deltas)}
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas if "reasoning_content" in d)
    if any("reasoning_content" in d for d in deltas):
        message["reasoning_content"] = reasoning
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    if calls:
        message["tool_calls"] = [c["function"] for c in calls]
    return message


@pytest.mark.parametrize("text", ["<think>", " \n<think>", "<think>plan</think>\nok", "<think></think>ok",
                                  "<think>plan</think>\nLet me check.\n", "Let me check.\n", "hi"])
def test_streamed_and_whole_chat_messages_agree(tiny_dir: Path, text: str) -> None:
    """What a client assembles from the stream is the whole reply's message: a bare `<think>` gave
    `reasoning_content: ""` only whole, and whitespace around tool calls was stripped only whole."""
    meta = ResponseMeta("chatcmpl-1", "glm-tiny", 0, parse_tools=True, include_usage=False)
    text = text + _assistant_text(tiny_dir, "") if text.endswith("check.\n") else text
    whole = collect_chat(meta, _chunks(text))["choices"][0]["message"]
    streamed = _streamed_message(meta, text)
    if "tool_calls" in whole:  # their ids are drawn for each response
        whole["tool_calls"] = [c["function"] for c in whole["tool_calls"]]
    assert {**whole, "content": whole["content"] or ""} == streamed
    assert "<tool" not in streamed["content"]


def test_parallel_tool_calls_off_keeps_the_first_call(tiny_dir: Path) -> None:
    """`parallel_tool_calls: false` asks for at most one call a reply; the model wrote two. Both forms of the reply
    carry the first only; by default both calls come back."""
    text = _assistant_text(tiny_dir, "")
    for limit, names in ((1, ["get_weather"]), (None, ["get_weather", "search"])):
        meta = ResponseMeta("chatcmpl-1", "glm-tiny", 0, parse_tools=True, max_tool_calls=limit)
        whole = collect_chat(meta, _chunks(text))["choices"][0]
        assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == names
        assert whole["finish_reason"] == "tool_calls"
        assert [c["name"] for c in _streamed_message(meta, text)["tool_calls"]] == names
    body = ChatCompletionRequest.model_validate_json(json.dumps({**_CHAT, "parallel_tool_calls": False}))
    assert body.parallel_tool_calls is False and body.unsupported() is None


# --- routing ------------------------------------------------------------------------------------


def _replica(name: str) -> ReplicaID:
    return ReplicaID(unique_id=name, deployment_id=DeploymentID(name="DecodeServer", app_name="hisparse"))


def test_affinity_rank_is_stable_and_moves_few_keys() -> None:
    replicas = [_replica(f"r{i}") for i in range(4)]
    first = {k: affinity_rank(k, replicas)[0] for k in (f"session:{i}" for i in range(200))}
    assert first == {k: affinity_rank(k, list(reversed(replicas)))[0] for k in first}
    assert len(set(first.values())) == 4
    fewer = {k: affinity_rank(k, replicas[:3])[0] for k in first}
    assert all(fewer[k] == first[k] for k in first if first[k] != replicas[3])


class _Running:
    def __init__(self, replica_id: ReplicaID) -> None:
        self.replica_id = replica_id


def test_router_prefers_the_key_replica_then_falls_back_to_load() -> None:
    async def choose(key: str) -> list[list[ReplicaID]]:
        router = AffinityRouter(DeploymentID(name="DecodeServer", app_name="hisparse"), DeploymentHandleSource.UNKNOWN)
        replicas = [_Running(_replica(f"r{i}")) for i in range(3)]
        request = PendingRequest(args=[], kwargs={}, metadata=RequestMetadata("r", "i", session_id=key))
        ranks = await router.choose_replicas(replicas, request)
        assert request.routing_context.should_backoff
        return [[r.replica_id for r in rank] for rank in ranks]

    ranks = asyncio.run(choose("session:abc"))
    assert ranks[0] == [affinity_rank("session:abc", [_replica(f"r{i}") for i in range(3)])[0]]
    assert len(ranks[1]) == 2 and ranks[0][0] not in ranks[1]
    unkeyed = asyncio.run(choose(""))
    assert len(unkeyed) == 1 and len(unkeyed[0]) == 2


# --- engine replica -----------------------------------------------------------------------------


def test_health_check_fails_once_the_engine_loop_died(tiny_dir: Path) -> None:
    async def run() -> list[GenerateChunk]:
        server = object.__new__(DecodeServer)  # the replica's state without Serve
        server.engine = AsyncEngine(EngineConfig(model=str(tiny_dir), num_gpu_pages=32))
        server.metrics = metrics
        server.counters = collections.Counter()
        await server.check_health()

        def boom() -> None:
            raise RuntimeError("device lost")

        server.engine.engine.step = boom
        request = GenerateRequest("r1", [5, 6, 7], SamplingParams(max_tokens=4))
        chunks = [c async for c in server._stream(request, time.monotonic())]
        with pytest.raises(RuntimeError, match="device lost"):
            await server.check_health()
        server.engine.shutdown()
        return chunks

    metrics = ReplicaMetricsStub()
    [refusal] = asyncio.run(run())
    assert refusal.error_status == 503 and "device lost" in refusal.error_message
    # recorded as an abort with no time to a first token
    assert metrics.calls == [(0, 0, None, "abort")]


class ReplicaMetricsStub:
    """What the replica reports of each finished request (its end-to-end time left out)."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def request_finished(self, prompt_tokens: int, output_tokens: int, ttft_s: float | None, e2e_s: float,
                         reason: str) -> None:
        self.calls.append((prompt_tokens, output_tokens, ttft_s, reason))


def test_partial_sections_keep_their_own_defaults() -> None:
    config = AppConfig.from_args({"model": {"path": "x"}, "ingress": {"num_replicas": 2}, "prefill": {"num_cpus": 2}})
    assert config.ingress.num_cpus == 0 and config.ingress.max_ongoing_requests == 256
    assert config.prefill.num_replicas == 0 and config.decode.num_replicas == 1


# --- API key, body limit, logs ----------------------------------------------------------------


def test_api_key_travels_as_its_digest(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    digest = hashlib.sha256(b"s3cret").hexdigest()
    monkeypatch.delenv("HISPARSE_API_KEY", raising=False)
    assert AppConfig.from_args({"model": {"path": str(tiny_dir)}}).resolved().api.api_key_sha256 is None
    monkeypatch.setenv("HISPARSE_API_KEY", "s3cret")  # set where the app is built
    built = AppConfig.from_args({"model": {"path": str(tiny_dir)}}).resolved()
    assert built.api.api_key_sha256 == digest and built.api.api_key is None
    inline = AppConfig.from_args({"model": {"path": str(tiny_dir)}, "api": {"api_key": "other"}}).resolved()
    assert inline.api.api_key is None and inline.api.api_key_sha256 == hashlib.sha256(b"other").hexdigest()
    pinned = {"model": {"path": str(tiny_dir)}, "api": {"api_key_sha256": "ab" * 32}}
    assert AppConfig.from_args(pinned).resolved().api.api_key_sha256 == "ab" * 32
    with pytest.raises(ConfigError, match="api_key_sha256"):
        AppConfig.from_args({"model": {"path": "x"}, "api": {"api_key_sha256": "not-hex"}})


def _asgi_post(app: BodyLimitMiddleware, chunks: list[bytes], headers: list[tuple[bytes, bytes]]) -> list[dict]:
    sent: list[dict] = []
    pending = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive() -> dict:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers}
    asyncio.run(app(scope, receive, send))
    return sent


def test_body_limit_refuses_declared_and_streamed_bodies() -> None:
    seen: list[bytes] = []

    async def echo(scope: dict, receive, send) -> None:  # noqa: ANN001 - an ASGI app
        seen.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})

    app = BodyLimitMiddleware(echo, max_bytes=1000, timeout_s=30)
    declared = _asgi_post(app, [b"x" * 10], [(b"content-length", b"5000")])
    assert declared[0]["status"] == 413 and json.loads(declared[1]["body"])["error"]["code"] == "request_too_large"
    streamed = _asgi_post(app, [b"x" * 600, b"x" * 600], [])
    assert streamed[0]["status"] == 413 and not seen
    assert _asgi_post(app, [b"a" * 500, b"b" * 500], [])[0]["status"] == 200
    assert seen == [b"a" * 500 + b"b" * 500]  # replayed whole to the route


def test_body_limit_hands_a_cancelled_relay_on_as_a_disconnect() -> None:
    """Serve cancels the task relaying a request's messages when its client goes away; the route then waits on
    `receive` for a disconnect (a stream listens for one) and must get the ASGI message, not the exception."""
    messages: list[dict] = []
    body = b'{"a": 1}'

    async def listener(scope: dict, receive, send) -> None:  # noqa: ANN001 - an ASGI app
        messages.append(await receive())
        messages.append(await receive())

    relayed = iter([{"type": "http.request", "body": body, "more_body": False}])

    async def relay() -> dict:  # the body once (read by the middleware), then the client is gone
        for message in relayed:
            return message
        raise TaskCancelledError()

    async def send(message: dict) -> None:
        pass

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    asyncio.run(BodyLimitMiddleware(listener, max_bytes=1000, timeout_s=30)(scope, relay, send))
    assert messages == [{"type": "http.request", "body": body, "more_body": False}, {"type": "http.disconnect"}]


def test_body_limit_ends_a_body_that_stops_arriving_or_whose_client_left() -> None:
    """A connection that sends a byte of body and then nothing held an ingress slot for as long as it stayed open;
    a few hundred of them held every slot. Its request is answered 408 once the deadline passes, and a client
    that leaves while sending ends its request quietly (it was logged as an unexpected error)."""
    routed: list[dict] = []

    async def route(scope: dict, receive, send) -> None:  # noqa: ANN001 - an ASGI app
        routed.append(await receive())

    def post(rest: Callable[[], Awaitable[dict]]) -> list[dict]:
        first = [{"type": "http.request", "body": b"{", "more_body": True}]
        sent: list[dict] = []

        async def receive() -> dict:
            return first.pop() if first else await rest()

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
                 "headers": [(b"content-length", b"1000")]}
        asyncio.run(BodyLimitMiddleware(route, max_bytes=10_000, timeout_s=0.2)(scope, receive, send))
        return sent

    async def silent() -> dict:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    timed_out = post(silent)
    assert timed_out[0]["status"] == 408 and (b"connection", b"close") in timed_out[0]["headers"]
    error = json.loads(timed_out[1]["body"])["error"]
    assert error["code"] == "request_timeout" and "0.2 s" in error["message"]

    async def cancelled() -> dict:
        raise TaskCancelledError()

    assert post(cancelled) == [] and routed == []


def test_vllm_sampling_extensions_pass_only_at_their_neutral_values() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    neutral = {"min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "use_beam_search": False}
    assert ChatCompletionRequest.model_validate({**base, **neutral}).unsupported() is None
    for field, value in (("min_p", 0.05), ("repetition_penalty", 1.1), ("min_tokens", 2), ("use_beam_search", True),
                         ("guided_regex", "a+"), ("guided_choice", ["a"])):
        refused = CompletionRequest.model_validate({"model": "m", "prompt": "x", field: value}).unsupported()
        assert refused is not None and refused[0] == field, (field, refused)


def test_stream_options_without_stream_are_refused() -> None:
    """As OpenAI answers: `stream_options` apply to a stream; with `stream` false they were ignored."""
    for model, base in ((ChatCompletionRequest, _CHAT), (CompletionRequest, _COMPLETION)):
        options = {"stream_options": {"include_usage": True}}
        assert model.model_validate({**base, **options}).unsupported()[0] == "stream_options"
        assert model.model_validate({**base, **options, "stream": True}).unsupported() is None
        assert model.model_validate({**base, "stream_options": None}).unsupported() is None


def test_completion_logprobs_zero_is_refused_not_ignored() -> None:
    """`logprobs: 0` asks for the sampled tokens' own logprobs: it was taken as unset and answered without them."""
    completion = {"model": "m", "prompt": "x"}
    assert CompletionRequest.model_validate({**completion, "logprobs": 0}).unsupported()[0] == "logprobs"
    assert CompletionRequest.model_validate({**completion, "logprobs": None, "suffix": ""}).unsupported() is None


def _refusal(model: type[BaseModel], body: dict) -> APIError:
    """The 400 the API answers for `body`, from the same JSON path a request takes."""
    with pytest.raises(ValidationError) as info:
        model.model_validate_json(json.dumps(body))
    return invalid_request(info.value.errors(include_url=False))


_CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
_COMPLETION = {"model": "m", "prompt": "x"}


@pytest.mark.parametrize(("model", "base", "field"), [
    (ChatCompletionRequest, _CHAT, "top_k"), (ChatCompletionRequest, _CHAT, "n"),
    (ChatCompletionRequest, _CHAT, "min_tokens"), (ChatCompletionRequest, _CHAT, "top_logprobs"),
    (ChatCompletionRequest, _CHAT, "max_tokens"), (ChatCompletionRequest, _CHAT, "max_completion_tokens"),
    (CompletionRequest, _COMPLETION, "best_of"), (CompletionRequest, _COMPLETION, "logprobs"),
    (CompletionRequest, _COMPLETION, "max_tokens"),
])
def test_integer_sampling_fields_fit_in_32_bits(model: type[BaseModel], base: dict, field: str) -> None:
    """A value an int64 tensor cannot hold would stop the engine loop: it is the request's 400, naming the field."""
    for value in (2**63, INT32_MAX + 1):
        error = _refusal(model, {**base, field: value})
        assert (error.status, error.param) == (400, field), error.message


def test_top_k_above_the_vocabulary_means_no_cut() -> None:
    for top_k in (-1, 0, 10**6, INT32_MAX):
        assert ChatCompletionRequest.model_validate_json(json.dumps({**_CHAT, "top_k": top_k})).top_k == top_k


def test_null_means_the_default() -> None:
    nulls = dict.fromkeys(("temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty", "top_k",
                           "ignore_eos", "min_p", "repetition_penalty", "min_tokens", "use_beam_search",
                           "skip_special_tokens", "parallel_tool_calls"))
    chat = ChatCompletionRequest.model_validate_json(json.dumps({**_CHAT, **nulls}))
    assert chat == ChatCompletionRequest.model_validate_json(json.dumps(_CHAT)) and chat.unsupported() is None
    completion = CompletionRequest.model_validate_json(json.dumps({**_COMPLETION, **nulls, "echo": None}))
    assert not completion.echo and completion.unsupported() is None
    assert _refusal(CompletionRequest, {**_COMPLETION, "temperature": "0.5"}).param == "temperature"  # still strict
    assert _refusal(CompletionRequest, {**_COMPLETION, "model": None}).param == "model"  # required stays required


def test_content_parts_other_than_text_are_refused_as_what_they_are() -> None:
    """An image sent to this text-only model is refused at its part, saying why; it read "Input should be a
    valid string" for the whole content, then a missing `text` of a part that never had one."""
    parts = [{"type": "text", "text": "what is in it?"}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]
    error = _refusal(ChatCompletionRequest, {**_CHAT, "messages": [{"role": "user", "content": parts}]})
    assert error.param == "messages.0.content.1" and "'image_url'" in error.message and "string" not in error.message
    wrong = _refusal(ChatCompletionRequest, {**_CHAT, "messages": [{"role": "user", "content": [{"type": "text"}]}]})
    assert (wrong.param, wrong.message) == ("messages.0.content.0.text", "messages.0.content.0.text: Field required")
    neither = _refusal(ChatCompletionRequest, {**_CHAT, "messages": [{"role": "user", "content": 5}]})
    assert neither.param == "messages.0.content" and "valid string" in neither.message


def test_a_lone_surrogate_is_named_in_the_refusal() -> None:
    """An escaped lone surrogate is refused by the JSON parser as an "unexpected end of hex escape", which reads as
    a body cut short; the message says what a \\u escape must be."""
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate_json(
            '{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}')
    error = invalid_request(info.value.errors(include_url=False))
    assert error.status == 400 and "a UTF-16 surrogate only in a pair" in error.message


def _with_arguments(arguments: str | dict) -> dict:
    call = {"type": "function", "function": {"name": "f", "arguments": arguments}}
    return {**_CHAT, "messages": [*_CHAT["messages"], {"role": "assistant", "content": None, "tool_calls": [call]}]}


@pytest.mark.parametrize(("arguments", "problem"), [
    ("{not json", "not valid JSON"), ("[" * 5000, "not valid JSON"), ("[1, 2]", "must be a JSON object"),
])
def test_tool_call_arguments_are_refused_at_their_location(arguments: str, problem: str) -> None:
    error = _refusal(ChatCompletionRequest, _with_arguments(arguments))
    assert error.param == "messages.1.tool_calls.0.function.arguments" and problem in error.message


@pytest.mark.parametrize("number", [math.nan, math.inf, -math.inf])
def test_non_json_numbers_in_tools_and_arguments_are_refused(number: float) -> None:
    """NaN and infinities (`NaN`, `Infinity`, 1e999 in the body) are not JSON: rendered into the prompt, a tool's
    schema or a call's arguments would read as invalid JSON to the model."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "x": [{"max": number}]}}}
    for model, base in ((ChatCompletionRequest, _CHAT), (TokenizeRequest, {"messages": _CHAT["messages"]})):
        error = _refusal(model, {**base, "tools": [tool]})
        assert error.param == "tools.0.function.parameters" and "not a JSON number" in error.message
    error = _refusal(ChatCompletionRequest, _with_arguments({"x": number}))
    assert error.param == "messages.1.tool_calls.0.function.arguments"
    if math.isinf(number):  # OpenAI's form, a JSON string: a number that overflows read as an infinity
        error = _refusal(ChatCompletionRequest, _with_arguments('{"x": [%s1e400]}' % ("-" if number < 0 else "")))
        assert error.param == "messages.1.tool_calls.0.function.arguments" and "not a JSON number" in error.message
    assert ChatCompletionRequest.model_validate_json(json.dumps({**_CHAT, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"x": [{"max": 1e300}]}}}]})).tools


def test_tool_call_arguments_reach_the_template_as_objects() -> None:
    for arguments, parsed in (('{"city": "Paris"}', {"city": "Paris"}), ({"city": "Paris"}, {"city": "Paris"}),
                              (" ", {})):
        body = ChatCompletionRequest.model_validate_json(json.dumps(_with_arguments(arguments)))
        assert body.messages[1].for_template()["tool_calls"][0]["function"]["arguments"] == parsed


def test_engine_liveness_counts_generated_text_and_heartbeats_only() -> None:
    liveness = EngineLiveness(window_s=60)
    assert not liveness.recent()
    liveness.saw(GenerateChunk.refusal(503, "the engine of this replica stopped"))
    assert not liveness.recent()
    liveness.saw(GenerateChunk(text_delta="a", num_output_tokens=1))
    assert liveness.recent()
    beating = EngineLiveness(window_s=60)
    beating.saw(GenerateChunk.alive())
    assert beating.recent()
    expired = EngineLiveness(window_s=0)
    expired.saw(GenerateChunk(text_delta="a", num_output_tokens=1))
    assert not expired.recent()


class _Source:
    """A decode stream's chunks: "a" after 0.3 s, "b" 0.3 s later, then silence; records being ended."""

    def __init__(self) -> None:
        self.ended = 0

    async def chunks(self) -> AsyncIterator[GenerateChunk]:
        try:
            await asyncio.sleep(0.3)
            yield GenerateChunk(text_delta="a")
            await asyncio.sleep(0.3)
            yield GenerateChunk(text_delta="b")
            await asyncio.sleep(60)
            yield GenerateChunk(text_delta="never")
        finally:
            self.ended += 1


def test_heartbeats_fill_the_wait_for_a_first_chunk_while_the_engine_lives(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode replica whose requests stream nothing yet (waiting for a prefill replica, in a long prefill) sends
    heartbeats so the ingress's `/health` need not queue a probe behind them; none once its engine loop is dead,
    and none once text flows (the text is the proof). Leaving the stream, closed or cancelled as Serve cancels a
    call, ends the request's own chunks (its abort), while it waits for the first chunk and after."""
    monkeypatch.setattr(heartbeats, "HEARTBEAT_S", 0.05)
    source = _Source()

    async def read(alive: bool) -> list[str]:
        seen = []
        stream = with_heartbeats(source.chunks(), lambda: alive)
        async for chunk in stream:
            seen.append("." if chunk.heartbeat else chunk.text_delta)
            if chunk.text_delta == "b":
                break
        await stream.aclose()
        return seen

    seen = asyncio.run(read(alive=True))
    assert seen[-2:] == ["a", "b"] and len(seen) >= 5 and set(seen[:-2]) == {"."}, seen
    assert source.ended == 1
    assert asyncio.run(read(alive=False)) == ["a", "b"] and source.ended == 2

    async def cancel_after(wait_s: float) -> None:
        async def consume() -> None:
            async for _ in with_heartbeats(source.chunks(), lambda: True):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(wait_s)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_after(0.15))  # waiting for "a"
    asyncio.run(cancel_after(1.0))  # after "b"
    assert source.ended == 4


def test_the_ingress_shows_heartbeats_to_liveness_only() -> None:
    class Response:  # a decode call's remaining chunks
        def __init__(self, chunks: list[GenerateChunk]) -> None:
            self.chunks = chunks

        async def __anext__(self) -> GenerateChunk:
            return self.chunks.pop(0)

        def cancel(self) -> None:
            raise AssertionError("a finished call is not cancelled")

    last = GenerateChunk(text_delta="b", finished=True, finish_reason="stop")
    liveness = EngineLiveness(window_s=60)
    stream = DecodeStream(Response([GenerateChunk.alive(), GenerateChunk.alive(), last]),
                          GenerateChunk(text_delta="a"), liveness)
    chunks = asyncio.run(stream.collect())
    assert [c.text_delta for c in chunks] == ["a", "b"] and liveness.recent()


def test_engine_refusals_name_the_field_at_fault(tiny_dir: Path) -> None:
    """A request the engine refuses reaches the client naming the field to change, with OpenAI's code for a request
    too long: an agent can trim its history on `context_length_exceeded` whether the ingress or the engine refused."""
    engine = LLMEngine(EngineConfig(model=str(tiny_dir), num_gpu_pages=4))
    refusals = []
    for prompt, max_tokens in (([7] * 300, 10), ([7] * 2 * engine.kv.page_size, 3 * engine.kv.page_size), ([], 4)):
        with pytest.raises(InvalidRequestError) as refused:
            engine.validate(prompt, SamplingParams(max_tokens=max_tokens))
        refusals.append(GenerateChunk.invalid(refused.value))
    too_long, too_many, empty = refusals
    for kind, prompt_param in (("chatcmpl", "messages"), ("cmpl", "prompt")):
        error = refusal_error(too_long, kind)
        body = error_body(error.status, error.message, error.param, error.code)["error"]
        assert (body["param"], body["code"], body["type"]) == (prompt_param, "context_length_exceeded",
                                                               "invalid_request_error")
        assert refusal_error(too_many, kind).param == "max_tokens"
        assert (refusal_error(empty, kind).param, refusal_error(empty, kind).code) == (prompt_param, None)


def test_cancelled_ray_tasks_are_logged_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.new_event_loop()
    try:
        log_cancellations_briefly(loop)
        with caplog.at_level(logging.INFO):
            loop.call_exception_handler({"message": "Task exception was never retrieved",
                                         "exception": TaskCancelledError()})
            loop.call_exception_handler({"message": "boom", "exception": RuntimeError("real failure")})
    finally:
        loop.close()
    cancelled = [r for r in caplog.records if "cancelled" in r.getMessage()]
    assert len(cancelled) == 1 and cancelled[0].exc_info is None and cancelled[0].levelno == logging.INFO
    assert any(r.levelno == logging.ERROR and r.exc_info for r in caplog.records)  # others keep their report
