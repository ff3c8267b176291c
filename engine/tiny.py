"""The tiny model: a small random-weight `glm_moe_dsa` checkpoint in Hugging Face format.

Same architecture as GLM-5.x at toy sizes: several layers, dense then MoE
layers, IndexShare with full and shared layers, `index_topk` far below the
contexts it serves so attention really is sparse, and one MTP layer past them
(engine/mtp.py) stored as published checkpoints store it, with its copies of the
target's embedding and lm_head. Written as sharded
safetensors with an index, published parameter names, a byte-level tokenizer
and a GLM-style chat template, so every loading path of a real checkpoint runs.
With `fp8=True` the linear weights are written as published FP8 checkpoints hold
them (e4m3 with 128x128 block scales in `weight_scale_inv`, bf16 elsewhere, a
`quantization_config` in config.json); `overrides` give any shape, GLM-5.3's too.

`write_architecture` writes the weightless form: any architecture's config.json
beside the same tokenizer, for engines that fill their own seeded random weights
(`random_weights`), so a GLM-5.3-shaped model serves without a checkpoint.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.linear import WeightFormat
from engine.model import build_model
from engine.model_config import ModelConfig
from engine.tiny_tokenizer import write_tiny_tokenizer
from engine.tp.tensor_parallel import TensorParallel
from engine.weight_map import published_slots
from engine.weights import random_init
from kernels.fp8_gemm import quantize_weight_blocks

logger = logging.getLogger(__name__)

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "index_n_heads": 8,
    "index_head_dim": 32,
    "index_topk": 32,
    "indexer_types": ["full", "full", "shared", "shared", "full", "shared"],
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "rope_interleave": True,
    "indexer_rope_interleave": True,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "float32",
    "num_nextn_predict_layers": 1,
}

# Weight scale of the tiny model: large enough that logits are well separated.
TINY_INIT_STD = 0.08
# What published FP8 checkpoints declare; FP8 experts need 128-multiple widths (one scale block per 128 rows).
FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}
FP8_TINY_OVERRIDES = {"moe_intermediate_size": 128, "torch_dtype": "bfloat16"}
# config.json fields with one entry per layer.
PER_LAYER_FIELDS = ("indexer_types", "mlp_layer_types")


def save_checkpoint(model: torch.nn.Module, out: Path, num_shards: int = 2) -> None:
    """Writes the model's tensors under their published names as `num_shards` safetensors files plus the index;
    each MTP layer also gets the copies of the target's embedding and lm_head that published checkpoints hold
    (`model.layers.L.embed_tokens.weight`, `model.layers.L.shared_head.head.weight`), which loading skips."""
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    state = {name: slot.view(tensors).detach().contiguous().clone() for name, slot in published_slots(model).items()}
    for layer in range(model.cfg.num_hidden_layers, len(model.model.layers)):
        state[f"model.layers.{layer}.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
        state[f"model.layers.{layer}.shared_head.head.weight"] = state["lm_head.weight"].clone()
    if model.weight_format.kind == "fp8":  # published FP8 checkpoints also quantise what the engine dequantises
        for name in [n for n in state if n.endswith("kv_b_proj.weight")]:
            state[name], state[name + "_scale_inv"] = quantize_weight_blocks(state[name].float())
    names = sorted(state)
    weight_map: dict[str, str] = {}
    per_shard = -(-len(names) // num_shards)
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        chunk = names[i * per_shard : (i + 1) * per_shard]
        save_file({n: state[n] for n in chunk}, str(out / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in chunk})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def shaped_config(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`raw` with `overrides` replacing its fields; a smaller `num_hidden_layers` keeps the first layers of the
    per-layer lists it does not override (GLM-5.3's `indexer_types` at 8 layers is its first 8 entries)."""
    unknown = sorted(set(overrides) - set(raw) - {"quantization_config"})
    if unknown:
        raise ValueError(f"overrides name fields the architecture does not have: {unknown}")
    shaped = {**raw, **overrides}
    layers = shaped.get("num_hidden_layers")
    for key in PER_LAYER_FIELDS:
        if key in raw and key not in overrides and isinstance(layers, int) and len(raw[key]) >= layers:
            shaped[key] = raw[key][:layers]
    return shaped


def _with_tokenizer(out: Path, raw: dict[str, Any], cover_vocab: bool = False) -> dict[str, Any]:
    """Writes the tiny tokenizer to `out`; returns `raw` with a vocabulary that covers it (the tokenizer's
    size rounded up to 64 unless `raw` has one) and the tokenizer's end and pad ids. `cover_vocab`: the
    tokenizer gets an added token for every id of `raw`'s vocabulary (`write_tiny_tokenizer`)."""
    tokenizer_size = write_tiny_tokenizer(out, raw.get("vocab_size") if cover_vocab else None)
    raw = {"vocab_size": -(-tokenizer_size // 64) * 64, **raw}
    if raw["vocab_size"] < tokenizer_size:
        raise ValueError(f"vocab_size {raw['vocab_size']} is below the tokenizer's {tokenizer_size} ids")
    tokenizer_cfg = json.loads((out / "tokenizer_config.json").read_text())
    raw["eos_token_id"] = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    raw["pad_token_id"] = tokenizer_cfg.get("pad_token_id")
    return raw


def write_architecture(out: str | Path, raw: dict[str, Any]) -> Path:
    """Writes a model directory without weights: `raw` as config.json (end ids from the tokenizer) and the
    tiny tokenizer covering `raw`'s whole vocabulary (so every sampled id has text), for an engine with
    `random_weights`. Raises `ValueError` for a config the engine refuses."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = _with_tokenizer(out, raw, cover_vocab=True)
    try:
        ModelConfig.from_dict(raw)
    except KeyError as exc:
        raise ValueError(f"config.json lacks {exc.args[0]!r}") from None
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out


def make_tiny(out: str | Path, seed: int = 0, overrides: dict[str, Any] | None = None, fp8: bool = False) -> Path:
    """Creates the tiny checkpoint in `out`, with its `num_nextn_predict_layers` MTP layers; `overrides` replace
    config fields (tests and other shapes use it); `fp8` writes FP8 block-quantised linear weights. The MTP
    layers' numbers are drawn after the target's, so the target's weights do not depend on them."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = {**TINY_CONFIG, **(FP8_TINY_OVERRIDES if fp8 else {}), **(overrides or {})}
    if fp8:
        raw["quantization_config"] = FP8_QUANTIZATION
    raw = _with_tokenizer(out, raw)
    cfg = ModelConfig.from_dict(raw)
    torch.manual_seed(seed)
    fmt, dtype = (WeightFormat("fp8"), torch.bfloat16) if fp8 else (WeightFormat(), torch.float32)
    model = build_model(cfg, TensorParallel(), fmt, dtype, torch.device("cpu"), cfg.num_nextn_predict_layers)
    random_init(model, seed, std=TINY_INIT_STD)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for layer in model.model.layers:  # the target's, then the MTP layers'
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(cfg.n_routed_experts, generator=gen) * 0.1)
    save_checkpoint(model, out)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    logger.info("wrote tiny glm_moe_dsa checkpoint to %s", out)
    return out
