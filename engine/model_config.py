"""Architecture of a `glm_moe_dsa` model, read from its Hugging Face `config.json`.

Owns the derived facts every other part needs: which layers run a full indexer,
the IndexShare groups (a full layer and the shared layers that reuse its top-K),
which layers are dense. Frozen once built; nothing mutates it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")


def _default_indexer_types(num_layers: int, freq: int, offset: int) -> list[str]:
    """The pattern transformers derives when a config lists no `indexer_types`."""
    freq = max(freq, 1)
    return ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(num_layers)]


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyper-parameters of one GLM-MoE-DSA checkpoint."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]  # "dense" or "sparse" (MoE) per layer
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    rope_interleave: bool
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    torch_dtype: str = "bfloat16"
    num_nextn_predict_layers: int = 0  # MTP layers past num_hidden_layers (engine/mtp.py)
    quantization: dict[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
        if len(self.indexer_types) != self.num_hidden_layers:
            raise ValueError("indexer_types must list one entry per layer")
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ValueError("mlp_layer_types must list one entry per layer")
        if self.indexer_types[0] != "full":
            raise ValueError("layer 0 must run a full indexer: shared layers reuse an earlier full layer")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError("index_head_dim must be at least qk_rope_head_dim")
        if self.n_routed_experts % self.n_group:
            raise ValueError("n_routed_experts must divide into n_group groups")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.indexer_types) if t == "full")

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """IndexShare groups: each full layer with the shared layers after it."""
        groups: list[list[int]] = []
        for i, t in enumerate(self.indexer_types):
            if t == "full":
                groups.append([i])
            else:
                groups[-1].append(i)
        return tuple(tuple(g) for g in groups)

    @property
    def fp8_block_checkpoint(self) -> bool:
        """Whether the checkpoint's linear weights are FP8 e4m3 with 128x128 block scales."""
        q = self.quantization or {}
        return q.get("quant_method") == "fp8" and list(q.get("weight_block_size") or []) == [128, 128]

    def is_moe_layer(self, layer: int) -> bool:
        """Layers past `num_hidden_layers` are the MTP layers, MoE blocks as in the published checkpoints."""
        return layer >= self.num_hidden_layers or self.mlp_layer_types[layer] == "sparse"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        num_layers = raw["num_hidden_layers"]
        indexer_types = raw.get("indexer_types") or _default_indexer_types(
            num_layers, raw.get("index_topk_freq", 1), raw.get("index_skip_topk_offset", 2)
        )
        first_dense = min(raw.get("first_k_dense_replace", 0), num_layers)
        mlp_types = raw.get("mlp_layer_types") or ["dense"] * first_dense + ["sparse"] * (num_layers - first_dense)
        rope = raw.get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope.get('rope_type')!r} is not supported")
        eos = raw.get("eos_token_id", 1)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=raw.get("model_type", "glm_moe_dsa"),
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            moe_intermediate_size=raw["moe_intermediate_size"],
            num_hidden_layers=num_layers,
            num_attention_heads=raw["num_attention_heads"],
            q_lora_rank=raw["q_lora_rank"],
            kv_lora_rank=raw["kv_lora_rank"],
            qk_nope_head_dim=raw["qk_nope_head_dim"],
            qk_rope_head_dim=raw["qk_rope_head_dim"],
            v_head_dim=raw["v_head_dim"],
            index_n_heads=raw["index_n_heads"],
            index_head_dim=raw["index_head_dim"],
            index_topk=raw["index_topk"],
            indexer_types=tuple(indexer_types),
            mlp_layer_types=tuple(mlp_types),
            n_routed_experts=raw["n_routed_experts"],
            num_experts_per_tok=raw["num_experts_per_tok"],
            n_shared_experts=raw.get("n_shared_experts", 1),
            first_k_dense_replace=first_dense,
            n_group=raw.get("n_group", 1),
            topk_group=raw.get("topk_group", 1),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope_theta),
            rope_interleave=bool(raw.get("rope_interleave", True)),
            max_position_embeddings=raw.get("max_position_embeddings", 202752),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype") or "bfloat16",
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
            quantization=raw.get("quantization_config"),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        return cls.from_dict(json.loads(path.read_text()))
