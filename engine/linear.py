"""Linear layers in the checkpoint's format: plain weights, or FP8 e4m3 weights with 128x128 block scales.

GLM-5.3 ships FP8 block-quantised weights and only FP8 fits one 8x H200 node,
so a layer whose checkpoint weight is block-quantised keeps it that way on the
device (`Fp8Linear`: `weight` float8_e4m3fn [N, K] and `weight_scale_inv`
float32 [ceil(N/128), ceil(K/128)], the published names) and multiplies through
the block-scaled GEMM (kernels/fp8_gemm.py) on GPUs, its PyTorch twin
elsewhere. `WeightFormat` says which layers are FP8; `make_linear` builds
either kind.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from kernels.fp8_gemm import (
    FP8_BLOCK,
    Fp8Activations,
    fp8_block_linear,
    fp8_block_linear_pair,
    fp8_block_linear_ref,
    quantize_weight_blocks,
)

# Projections that stay plain even in an FP8 model: kv_b_proj is used in its absorbed form (its key and
# value halves multiply queries and outputs per head), the indexer's head weights and the router are
# float32 as published, and the embedding and lm_head are bf16 in the published checkpoints.
_PLAIN = re.compile(r"(kv_b_proj|weights_proj|\.gate|embed_tokens|lm_head|eh_proj)$")


@dataclass(frozen=True)
class WeightFormat:
    """How the model holds its linear weights: `dense` (the compute dtype) or `fp8` (block-scaled e4m3)."""

    kind: Literal["dense", "fp8"] = "dense"

    def is_fp8(self, module_name: str) -> bool:
        """Whether the linear layer `module_name` (e.g. `self_attn.q_a_proj`) keeps FP8 weights."""
        return self.kind == "fp8" and _PLAIN.search(module_name) is None


def _blocks(n: int) -> int:
    return -(-n // FP8_BLOCK)


class Fp8Linear(nn.Module):
    """y = x W^T with W held as e4m3 values and one float32 scale per 128x128 block."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.ones(_blocks(out_features), _blocks(in_features), dtype=torch.float32), requires_grad=False)

    @classmethod
    def quantized(cls, weight: torch.Tensor, rows_at_once: int = 64 * FP8_BLOCK) -> Fp8Linear:
        """An FP8 copy of a plain weight [N, K], on its device, quantised `rows_at_once` rows at a time so the
        float32 temporaries stay small beside a loaded model."""
        n, k = weight.shape
        with torch.device(weight.device):
            linear = cls(k, n)
        for start in range(0, n, rows_at_once):
            q, scale = quantize_weight_blocks(weight[start : start + rows_at_once])
            linear.weight.data[start : start + rows_at_once] = q
            linear.weight_scale_inv.data[start // FP8_BLOCK : start // FP8_BLOCK + scale.shape[0]] = scale
        return linear

    def forward(self, x: torch.Tensor, x_fp8: Fp8Activations | None = None) -> torch.Tensor:
        """`x_fp8`: x already quantised by its producer (an RMSNorm), so the GEMM skips that launch."""
        gemm = fp8_block_linear if x.is_cuda else fp8_block_linear_ref
        return gemm(x, self.weight, self.weight_scale_inv, x_fp8=x_fp8)


class PlainLinear(nn.Linear):
    """A bias-free linear layer in the compute dtype, called like `Fp8Linear` (a quantised x is not needed)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor, x_fp8: Fp8Activations | None = None) -> torch.Tensor:
        return super().forward(x)


def make_linear(in_features: int, out_features: int, fp8: bool) -> Fp8Linear | PlainLinear:
    """A bias-free linear layer, FP8 block-scaled when `fp8`."""
    return Fp8Linear(in_features, out_features) if fp8 else PlainLinear(in_features, out_features)


def linear_pair(first: Fp8Linear | PlainLinear, second: Fp8Linear | PlainLinear, x: torch.Tensor,
                x_fp8: Fp8Activations | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(first(x), second(x)) for two layers of one input; FP8 ones on a GPU in one launch
    (`kernels.fp8_gemm.fp8_block_linear_pair`: at decode sizes a launch costs microseconds beyond its bytes),
    their outputs then views of one [..., N1 + N2] tensor."""
    if isinstance(first, Fp8Linear) and isinstance(second, Fp8Linear) and x.is_cuda:
        both = fp8_block_linear_pair(x, (first.weight, first.weight_scale_inv), (second.weight, second.weight_scale_inv),
                                     x_fp8=x_fp8)
        return both[..., : first.out_features], both[..., first.out_features :]
    return first(x, x_fp8), second(x, x_fp8)
