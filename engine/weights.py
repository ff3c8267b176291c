"""Weights: load a local Hugging Face checkpoint, or fill a seeded random init.

Reads safetensors shards (through their index when there is one) with published
parameter names; FP8 block-quantised tensors (`weight_scale_inv`, 128x128
blocks) are dequantised to the compute dtype. Experts stored fused
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) are split
into the per-expert modules. Layers past `num_hidden_layers` (MTP) are skipped.
Nothing here touches the network.

A tensor-parallel rank reads only its slice of each split tensor
(engine/parallel/sharding.py) through safetensors slices, so eight ranks read
the checkpoint about once between them, not eight times; FP8 slices are read
on whole 128-blocks and trimmed after dequantisation. The random init draws
the full tensors and keeps the rank's slice, so a random model is the same
model at every tensor-parallel size.
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
from engine.parallel.sharding import shard_dim
from engine.parallel.tensor_parallel import TensorParallel

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


def iter_checkpoint(
    model_dir: Path, cfg: ModelConfig, dtype: torch.dtype, tp: TensorParallel | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) in the model's naming, dequantised, split per expert and cut to `tp`'s slice."""
    tp = tp or TensorParallel()
    for path in _shard_files(model_dir):
        with safe_open(str(path), framework="pt") as shard:
            keys = set(shard.keys())
            for name in sorted(keys):
                m = _LAYER_RE.match(name)
                if (m and int(m.group(1)) >= cfg.num_hidden_layers) or name.endswith("weight_scale_inv"):
                    continue
                fused = _FUSED_RE.match(name.removesuffix(".weight"))
                if fused:  # small transformers-saved checkpoints: read whole, then split
                    for expert_name, t in _split_fused_experts(fused.group(1), fused.group(2), shard.get_tensor(name)):
                        dim = shard_dim(expert_name)
                        yield expert_name, t if dim is None else tp.shard(t, dim)
                    continue
                dim = shard_dim(name)
                if dim is not None and tp.size > 1:
                    yield name, _read_slice(shard, name, keys, dim, tp, dtype)
                    continue
                tensor = shard.get_tensor(name)
                scale_name = name + "_scale_inv"
                if scale_name in keys:
                    tensor = dequantize_fp8_block(tensor, shard.get_tensor(scale_name), dtype)
                yield name, tensor


def _read_slice(
    shard, name: str, keys: set[str], dim: int, tp: TensorParallel, dtype: torch.dtype  # noqa: ANN001
) -> torch.Tensor:
    """Reads rank `tp.rank`'s block of a 2-D tensor along `dim` from an open safetensors `shard`,
    without reading the rest."""
    sliced = shard.get_slice(name)
    size = sliced.get_shape()[dim]
    n = tp.local(size, name)
    lo, hi = tp.rank * n, (tp.rank + 1) * n
    scale_name = name + "_scale_inv"
    if scale_name not in keys:
        return sliced[lo:hi] if dim == 0 else sliced[:, lo:hi]
    first, last = lo // FP8_BLOCK, -(-hi // FP8_BLOCK)  # the scale blocks covering the slice
    start, stop = first * FP8_BLOCK, min(last * FP8_BLOCK, size)
    weight = sliced[start:stop] if dim == 0 else sliced[:, start:stop]
    scales = shard.get_slice(scale_name)
    scale = scales[first:last] if dim == 0 else scales[:, first:last]
    return dequantize_fp8_block(weight, scale, dtype).narrow(dim, lo - start, n)


def _split_fused_experts(prefix: str, kind: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    for e in range(tensor.shape[0]):
        if kind == "gate_up_proj":
            gate, up = tensor[e].chunk(2, dim=0)
            yield f"{prefix}.{e}.gate_proj.weight", gate
            yield f"{prefix}.{e}.up_proj.weight", up
        else:
            yield f"{prefix}.{e}.down_proj.weight", tensor[e]


def load_weights(model: nn.Module, model_dir: str | Path, dtype: torch.dtype) -> None:
    """Copies every checkpoint tensor (the rank's slice of split ones) into `model`; fails on
    missing or unexpected names."""
    cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    seen: set[str] = set()
    for name, tensor in iter_checkpoint(Path(model_dir), cfg, dtype, model.tp):
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
    """Seeded shapes-only init: normal weights, unit norms, zero biases; a split parameter gets
    its slice of the full tensor, so every tensor-parallel size builds the same model.

    Numbers are drawn on the parameters' device (a CPU draw of a GLM-sized model takes tens of
    seconds), so one seed gives one model per device type, not the same model on CPU and CUDA."""
    tp: TensorParallel = model.tp  # type: ignore[assignment]
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                dim = shard_dim(name)
                shape = list(p.shape)
                if dim is not None:
                    shape[dim] *= tp.size
                full = torch.randn(shape, generator=gen, device=device) * std
                p.copy_(full if dim is None else tp.shard(full, dim))
