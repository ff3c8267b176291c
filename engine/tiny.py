"""The tiny model: a small random-weight `glm_moe_dsa` checkpoint in Hugging Face format.

Same architecture as GLM-5.x at toy sizes: several layers, dense then MoE
layers, IndexShare with full and shared layers, and `index_topk` far below the
contexts it serves so attention really is sparse. Written as sharded
safetensors with an index, published parameter names, a byte-level tokenizer
and a GLM-style chat template, so every loading path of a real checkpoint runs.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.model import GlmMoeDsaForCausalLM
from engine.model_config import ModelConfig
from engine.tiny_tokenizer import write_tiny_tokenizer
from engine.weights import random_init

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
}

# Weight scale of the tiny model: large enough that logits are well separated.
TINY_INIT_STD = 0.08


def save_checkpoint(model: torch.nn.Module, out: Path, num_shards: int = 2) -> None:
    """Writes the state dict as `num_shards` safetensors files plus the index."""
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not k.endswith("inv_freq")}
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


def make_tiny(out: str | Path, seed: int = 0, overrides: dict[str, Any] | None = None) -> Path:
    """Creates the tiny checkpoint in `out`; `overrides` replace config fields (tests use it)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_size = write_tiny_tokenizer(out)
    raw = dict(TINY_CONFIG, **(overrides or {}))
    raw.setdefault("vocab_size", -(-tokenizer_size // 64) * 64)
    tokenizer_cfg = json.loads((out / "tokenizer_config.json").read_text())
    gen_path = out / "generation_config.json"
    eos = json.loads(gen_path.read_text())["eos_token_id"] if gen_path.is_file() else None
    raw["eos_token_id"] = eos
    raw["pad_token_id"] = tokenizer_cfg.get("pad_token_id")
    cfg = ModelConfig.from_dict(raw)
    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(cfg)
    random_init(model, seed, std=TINY_INIT_STD)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(cfg.n_routed_experts, generator=gen) * 0.1)
    save_checkpoint(model, out)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    logger.info("wrote tiny glm_moe_dsa checkpoint to %s", out)
    return out
