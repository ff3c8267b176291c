"""Weights: load a local Hugging Face checkpoint, or fill a seeded random init.

Reads safetensors shards (through their index when there is one) with published
parameter names and puts each tensor where `engine.weight_map` says (the routed
experts into their stacked per-layer tensors). FP8 block-quantised tensors
(`weight_scale_inv`, 128x128 blocks) are copied as they are into layers that
keep FP8 weights (`engine.linear`), and dequantised to the compute dtype for
the others (kv_b_proj in its absorbed form, the float32 reference mode).
Experts stored fused (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`
[E, H, I], as transformers saves them) are split by expert first. Nothing here
touches the network.

The layers past `num_hidden_layers` are the MTP layers (engine/mtp.py): those the
model built are loaded, the others skipped. Of a built one, the checkpoint's
copies of the target's embedding and lm_head (`embed_tokens`, `shared_head.head`)
are skipped, since the engine uses the target's, and so is its indexer, which
published checkpoints store although the MTP layer attends over the target's
selection and has none.

A tensor-parallel rank reads only its slice of each split tensor
(engine/tp/sharding.py) through safetensors slices, so eight ranks read
the checkpoint about once between them, not eight times; FP8 slices are read
on whole 128-blocks (and must lie on them when they stay FP8). The random
init draws the full tensors and keeps the rank's slice, so a random model is
the same model at every tensor-parallel size, in either weight format, and
draws the MTP layers' tensors after the target's, so building them does not
change the target.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.model_config import ModelConfig
from engine.tp.sharding import shard_dim
from engine.tp.tensor_parallel import TensorParallel
from engine.weight_map import SCALE_SUFFIX, published_slots
from kernels.fp8_gemm import FP8_BLOCK, dequantize_weight_blocks, quantize_weight_blocks

logger = logging.getLogger(__name__)

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_FUSED_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
# What an MTP layer's checkpoint entry holds that the engine does not build (see the module docstring).
_MTP_UNUSED_RE = re.compile(r"^model\.layers\.\d+\.(embed_tokens|shared_head\.head|self_attn\.indexer)\.")


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W = fp8 weight x per-(128x128 block) scale in `dtype`; edge blocks may be partial."""
    return dequantize_weight_blocks(weight, scale_inv).to(dtype)


@dataclass
class StoredTensor:
    """One published tensor as a rank reads it: its values (FP8 ones with their block scales) and the cut
    still to make along `dim` (FP8 reads cover whole blocks; the rank's part starts `start` in, `length` long)."""

    name: str
    weight: torch.Tensor
    scale_inv: torch.Tensor | None = None
    dim: int = 0
    start: int = 0
    length: int | None = None

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The rank's part as `dtype` values (FP8 dequantised)."""
        w = self.weight if self.scale_inv is None else dequantize_fp8_block(self.weight, self.scale_inv, dtype)
        return w if self.length is None else w.narrow(self.dim, self.start, self.length)

    def fp8(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rank's part as e4m3 values and block scales (a plain tensor is quantised here)."""
        if self.scale_inv is None:
            return quantize_weight_blocks(self.dense(torch.float32))
        if self.length is None:
            return self.weight, self.scale_inv
        if self.start % FP8_BLOCK or self.length % FP8_BLOCK:
            raise ValueError(f"{self.name}: a tensor-parallel slice of an FP8 weight must lie on "
                             f"{FP8_BLOCK}-blocks (starts at {self.start}, {self.length} long)")
        blocks = slice(self.start // FP8_BLOCK, (self.start + self.length) // FP8_BLOCK)
        cut = (slice(None),) * self.dim
        return self.weight.narrow(self.dim, self.start, self.length), self.scale_inv[cut + (blocks,)]


def _shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    return files


def _layer_of(name: str) -> int | None:
    m = _LAYER_RE.match(name)
    return None if m is None else int(m.group(1))


def _is_mtp(name: str, cfg: ModelConfig) -> bool:
    """Whether published tensor `name` belongs to an MTP layer (one past `num_hidden_layers`)."""
    layer = _layer_of(name)
    return layer is not None and layer >= cfg.num_hidden_layers


def _is_read(name: str, cfg: ModelConfig, num_draft_layers: int) -> bool:
    """Whether a model with `num_draft_layers` MTP layers holds checkpoint tensor `name` (a weight; scales
    are read with theirs)."""
    layer = _layer_of(name)
    if layer is None or layer < cfg.num_hidden_layers:
        return True
    return layer < cfg.num_hidden_layers + num_draft_layers and _MTP_UNUSED_RE.match(name) is None


def iter_checkpoint(model_dir: Path, cfg: ModelConfig, tp: TensorParallel | None = None,
                    num_draft_layers: int = 0) -> Iterator[StoredTensor]:
    """Yields every published tensor of the checkpoint that a model with `num_draft_layers` MTP layers holds,
    as `tp`'s rank reads it, experts split apart."""
    tp = tp or TensorParallel()
    for path in _shard_files(model_dir):
        with safe_open(str(path), framework="pt") as shard:
            keys = set(shard.keys())
            for name in sorted(keys):
                if name.endswith(SCALE_SUFFIX) or not _is_read(name, cfg, num_draft_layers):
                    continue
                fused = _FUSED_RE.match(name.removesuffix(".weight"))
                if fused:  # small transformers-saved checkpoints: read whole, then split
                    for expert_name, t in _split_fused_experts(fused.group(1), fused.group(2), shard.get_tensor(name)):
                        dim = shard_dim(expert_name)
                        yield StoredTensor(expert_name, t if dim is None else tp.shard(t, dim))
                    continue
                dim = shard_dim(name)
                scale = name + SCALE_SUFFIX
                if dim is not None and tp.size > 1:
                    yield _read_slice(shard, name, scale if scale in keys else None, dim, tp)
                    continue
                yield StoredTensor(name, shard.get_tensor(name), shard.get_tensor(scale) if scale in keys else None)


def _read_slice(shard, name: str, scale_name: str | None, dim: int, tp: TensorParallel) -> StoredTensor:  # noqa: ANN001
    """Reads rank `tp.rank`'s block of a 2-D tensor along `dim` from an open safetensors `shard`,
    without reading the rest (FP8: the whole scale blocks around it)."""
    sliced = shard.get_slice(name)
    size = sliced.get_shape()[dim]
    n = tp.local(size, name)
    lo, hi = tp.rank * n, (tp.rank + 1) * n
    if scale_name is None:
        return StoredTensor(name, sliced[lo:hi] if dim == 0 else sliced[:, lo:hi])
    first, last = lo // FP8_BLOCK, -(-hi // FP8_BLOCK)  # the scale blocks covering the slice
    start, stop = first * FP8_BLOCK, min(last * FP8_BLOCK, size)
    weight = sliced[start:stop] if dim == 0 else sliced[:, start:stop]
    scales = shard.get_slice(scale_name)
    scale = scales[first:last] if dim == 0 else scales[:, first:last]
    return StoredTensor(name, weight, scale, dim, lo - start, n)


def _split_fused_experts(prefix: str, kind: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    for e in range(tensor.shape[0]):
        if kind == "gate_up_proj":
            gate, up = tensor[e].chunk(2, dim=0)
            yield f"{prefix}.{e}.gate_proj.weight", gate
            yield f"{prefix}.{e}.up_proj.weight", up
        else:
            yield f"{prefix}.{e}.down_proj.weight", tensor[e]


def _model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    return tensors


def _place(stored: StoredTensor, tensors: dict[str, torch.Tensor], slots: dict, dtype: torch.dtype) -> list[str]:
    """Writes one stored tensor into the model; returns the published names it filled."""
    if stored.name not in slots:
        raise KeyError(f"checkpoint tensor {stored.name} has no place in the model")
    target = slots[stored.name].view(tensors)
    if target.dtype != torch.float8_e4m3fn:
        values = stored.dense(dtype)
        _check_shape(stored.name, values, target)
        target.copy_(values.to(target.dtype))
        return [stored.name]
    weight, scale = stored.fp8()
    scale_name = stored.name + SCALE_SUFFIX
    scale_target = slots[scale_name].view(tensors)
    _check_shape(stored.name, weight, target)
    _check_shape(scale_name, scale, scale_target)
    target.copy_(weight)
    scale_target.copy_(scale)
    return [stored.name, scale_name]


def _check_shape(name: str, tensor: torch.Tensor, target: torch.Tensor) -> None:
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)}")


def load_weights(model: nn.Module, model_dir: str | Path, dtype: torch.dtype) -> None:
    """Copies every checkpoint tensor the model holds (the rank's slice of split ones, the MTP layers it
    built) into `model`; fails on missing or unexpected names."""
    cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    tensors, slots = _model_tensors(model), published_slots(model)
    seen: set[str] = set()
    with torch.no_grad():
        for stored in iter_checkpoint(Path(model_dir), cfg, model.tp, len(model.mtp_layers)):
            seen.update(_place(stored, tensors, slots, dtype))
        if cfg.tie_word_embeddings and "lm_head.weight" not in seen:
            tensors["lm_head.weight"].copy_(model.tp.shard(tensors["model.embed_tokens.weight"], 0))
            seen.add("lm_head.weight")
    missing = [n for n in slots if n not in seen]
    if missing:
        raise KeyError(_missing_message(model_dir, cfg, missing))
    logger.info("loaded %d tensors from %s", len(seen), model_dir)


def _missing_message(model_dir: str | Path, cfg: ModelConfig, missing: list[str]) -> str:
    """Names the tensors the model holds and the checkpoint lacks; when some are an MTP layer's, says so:
    the model was built with more draft layers than the checkpoint carries."""
    message = f"checkpoint {model_dir} lacks {len(missing)} tensors the model holds, e.g. {missing[:3]}"
    mtp = sorted({_layer_of(n) for n in missing if _is_mtp(n, cfg)})
    if mtp:
        message += (f"; {sum(_is_mtp(n, cfg) for n in missing)} of them are of MTP layers {mtp} "
                    f"(config.json's num_nextn_predict_layers is {cfg.num_nextn_predict_layers}): build fewer "
                    "draft layers, or use a checkpoint that carries them")
    return message


def random_init(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Seeded shapes-only init: normal weights, unit norms, zero biases; a split tensor gets its
    slice of the full tensor (FP8: quantised whole, then cut), so every tensor-parallel size builds
    the same model. Tensors are drawn in published-name order, one draw per published tensor, the
    target's first and the MTP layers' after them, so the target is the same with or without them.

    Numbers are drawn on the parameters' device (a CPU draw of a GLM-sized model takes tens of
    seconds), so one seed gives one model per device type, not the same model on CPU and CUDA.
    On a GPU the draws' workspace (a float32 copy of the largest tensor, the embedding) is handed
    back at the end: the KV pool is sized from the memory left free after the weights."""
    tp: TensorParallel = model.tp  # type: ignore[assignment]
    tensors, slots = _model_tensors(model), published_slots(model)
    parameters = {id(p) for p in model.parameters()}
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    with torch.no_grad():
        for name, slot in sorted(slots.items(), key=lambda item: (_is_mtp(item[0], cfg), item[0])):
            if name.endswith(SCALE_SUFFIX) or id(tensors[slot.param]) not in parameters:
                continue
            target = slot.view(tensors)
            if name.endswith("norm.weight") or "layernorm" in name:
                target.fill_(1.0)
            elif name.endswith(".bias"):
                target.zero_()
            else:
                _place(_random_tensor(name, tuple(target.shape), tp, gen, std), tensors, slots, target.dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _random_tensor(name: str, shape: tuple[int, ...], tp: TensorParallel, gen: torch.Generator,
                   std: float) -> StoredTensor:
    """The full tensor drawn for `name` (the rank's part of which has `shape`), cut as a rank reads it."""
    dim = shard_dim(name)
    full_shape = list(shape)
    if dim is not None:
        full_shape[dim] *= tp.size
    full = torch.randn(full_shape, generator=gen, device=gen.device).mul_(std)  # in place: one float32 copy
    if dim is None or tp.size == 1:
        return StoredTensor(name, full)
    return StoredTensor(name, full, None, dim, tp.rank * shape[dim], shape[dim])
