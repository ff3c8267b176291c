"""Weights: load a local Hugging Face checkpoint, or fill a seeded random init.

Reads safetensors shards (through their index when there is one) with published
parameter names; FP8 block-quantised tensors (`weight_scale_inv`, 128x128
blocks) are dequantised to the compute dtype. Experts stored fused
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) are split
into the per-expert modules. Layers past `num_hidden_layers` (MTP) are skipped.
Nothing here touches the network.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.model_config import ModelConfig

logger = logging.getLogger(__name__)

FP8_BLOCK = 128
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_FUSED_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W = fp8 weight x per-(128x128 block) scale; edge blocks may be partial."""
    out_dim, in_dim = weight.shape
    scale = scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:out_dim].repeat_interleave(FP8_BLOCK, 1)[:, :in_dim]
    return (weight.float() * scale).to(dtype)


def _shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    return files


def iter_checkpoint(model_dir: Path, cfg: ModelConfig, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) in the model's naming, dequantised and split as needed."""
    for path in _shard_files(model_dir):
        with safe_open(str(path), framework="pt") as shard:
            keys = set(shard.keys())
            for name in sorted(keys):
                m = _LAYER_RE.match(name)
                if (m and int(m.group(1)) >= cfg.num_hidden_layers) or name.endswith("weight_scale_inv"):
                    continue
                tensor = shard.get_tensor(name)
                scale_name = name + "_scale_inv"
                if scale_name in keys:
                    tensor = dequantize_fp8_block(tensor, shard.get_tensor(scale_name), dtype)
                fused = _FUSED_RE.match(name.removesuffix(".weight"))
                if fused:
                    yield from _split_fused_experts(fused.group(1), fused.group(2), tensor)
                else:
                    yield name, tensor


def _split_fused_experts(prefix: str, kind: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    for e in range(tensor.shape[0]):
        if kind == "gate_up_proj":
            gate, up = tensor[e].chunk(2, dim=0)
            yield f"{prefix}.{e}.gate_proj.weight", gate
            yield f"{prefix}.{e}.up_proj.weight", up
        else:
            yield f"{prefix}.{e}.down_proj.weight", tensor[e]


def load_weights(model: nn.Module, model_dir: str | Path, dtype: torch.dtype) -> None:
    """Copies every checkpoint tensor into `model`; fails on missing or unexpected names."""
    cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    seen: set[str] = set()
    for name, tensor in iter_checkpoint(Path(model_dir), cfg, dtype):
        if name not in params:
            raise KeyError(f"checkpoint tensor {name} has no place in the model")
        target = params[name]
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor.to(target.dtype))
        seen.add(name)
    if cfg.tie_word_embeddings and "lm_head.weight" not in seen:
        with torch.no_grad():
            params["lm_head.weight"].copy_(params["model.embed_tokens.weight"])
        seen.add("lm_head.weight")
    missing = [n for n in params if n not in seen and not n.endswith("inv_freq")]
    if missing:
        raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    logger.info("loaded %d tensors from %s", len(seen), model_dir)


def random_init(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Seeded shapes-only init: normal weights, unit norms, zero biases."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
