"""Attention ops on the GPU: the Triton sparse MLA kernel behind the `AttentionOps` interface.

Sparse attention reads the selected rows straight from the page pool (FP8 rows
dequantised in the kernel). Indexer scoring still goes through the PyTorch path
here: the engine hands it decoded keys per request, while the Triton indexer
reads the pages itself (wiring it in means passing page tables instead).
"""

from __future__ import annotations

import torch

from engine.attention_ops import TorchAttentionOps
from kernels.sparse_mla import sparse_mla


class TritonAttentionOps(TorchAttentionOps):
    def sparse_mla(
        self, q: torch.Tensor, kv_view: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, scale: float
    ) -> torch.Tensor:
        layout = self.layout
        return sparse_mla(
            q.contiguous(), kv_view, slots.to(torch.int32).contiguous(), lens.to(torch.int32).contiguous(),
            kv_format=layout.kv_format, latent_dim=layout.latent_dim, rope_dim=layout.rope_dim, scale=scale,
        )
