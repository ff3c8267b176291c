"""Where each published checkpoint tensor lives in the model.

Checkpoints name every routed expert's projections apart
(`model.layers.N.mlp.experts.E.gate_proj.weight`, FP8 ones with a
`..._scale_inv` beside each weight); the model stacks them per layer
(`mlp.experts.w13` [E, 2I, H] gate rows then up rows, `mlp.experts.w2`
[E, H, I]) so one fused MoE launch serves every expert, and folds the shared
expert in as expert E when its width equals a routed expert's. The latent
projections `self_attn.q_a_proj` and `self_attn.kv_a_proj_with_mqa` read the
same input, so the model may hold them as the rows of one
`self_attn.q_kv_a_proj` (engine/attention.py says when). Every other tensor
keeps its published name. `published_slots` lists, for one model
instance, each published name with the place its (tensor-parallel slice of
the) tensor goes; loading, the seeded random init and the tiny checkpoint
writer all go through it, so the three agree by construction.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from kernels.fp8_gemm import FP8_BLOCK

SCALE_SUFFIX = "_scale_inv"
_STACKED = re.compile(r"^(?P<prefix>.+\.mlp)\.experts\.(?P<slot>w13|w2)(?P<scale>_scale_inv)?$")
_PROJECTIONS = {"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)}
_JOINT_LATENT = re.compile(r"^(?P<prefix>.+\.self_attn)\.q_kv_a_proj\.weight(?P<scale>_scale_inv)?$")


@dataclass(frozen=True)
class Slot:
    """The destination of one published tensor: `param`, or expert `index` of it, or one half of its rows,
    or a range of its rows."""

    param: str
    index: int | None = None  # expert slot of a stacked parameter
    half: int | None = None  # 0 = gate rows, 1 = up rows of `w13`; None = the whole (expert) tensor
    rows: tuple[int, int] | None = None  # [start, end) rows of a joint parameter

    def view(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """The part of the model's tensor this slot writes (a view: writes land in the model)."""
        target = params[self.param]
        if self.index is not None:
            target = target[self.index]
        if self.half is not None:
            rows = target.shape[0] // 2
            target = target[self.half * rows : (self.half + 1) * rows]
        if self.rows is not None:
            target = target[self.rows[0] : self.rows[1]]
        return target


def _expert_names(prefix: str, slot: str, scale: str, num_routed: int, num_slots: int) -> dict[str, Slot]:
    param = f"{prefix}.experts.{slot}{scale}"
    names: dict[str, Slot] = {}
    for e in range(num_slots):
        owner = f"{prefix}.experts.{e}" if e < num_routed else f"{prefix}.shared_experts"
        for half, proj in enumerate(_PROJECTIONS[slot]):
            names[f"{owner}.{proj}.weight{scale}"] = Slot(param, e, half if slot == "w13" else None)
    return names


def published_slots(model: nn.Module) -> dict[str, Slot]:
    """Every published tensor name of `model`'s weights (FP8 scales included) with its slot."""
    num_routed = model.cfg.n_routed_experts  # type: ignore[attr-defined]
    slots: dict[str, Slot] = {}
    named = dict(model.named_parameters())
    named.update(model.named_buffers())
    for name, tensor in named.items():
        if name.endswith("inv_freq"):
            continue
        joint = _JOINT_LATENT.match(name)
        if joint is not None:
            scale = joint.group("scale") or ""
            q_rows = model.cfg.q_lora_rank // (FP8_BLOCK if scale else 1)  # type: ignore[attr-defined]
            prefix = joint.group("prefix")
            slots[f"{prefix}.q_a_proj.weight{scale}"] = Slot(name, rows=(0, q_rows))
            slots[f"{prefix}.kv_a_proj_with_mqa.weight{scale}"] = Slot(name, rows=(q_rows, tensor.shape[0]))
            continue
        stacked = _STACKED.match(name)
        if stacked is None:
            slots[name] = Slot(name)
            continue
        scale = stacked.group("scale") or ""
        slots.update(_expert_names(stacked.group("prefix"), stacked.group("slot"), scale, num_routed,
                                   tensor.shape[0]))
    return slots


def is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype == torch.float8_e4m3fn
