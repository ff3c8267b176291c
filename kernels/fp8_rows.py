"""FP8 KV row formats: packing at KV write, unpacking inside readers.

MLA row (656 bytes at GLM shape): the latent as fp8 e4m3 in blocks of 128
values, one fp32 scale per block, then the roped key in bf16. Indexer key
(132 bytes at GLM shape): the key as fp8 e4m3 values with one fp32 scale;
`pack_indexer_rows` returns each key as one [D + 4] run (values, then scale),
while an indexer page stores a layer's values and scales in two separate areas
(`engine/kv_layout.py`). Scales are amax / 448 so every block uses the full
e4m3 range; an all-zero block gets scale 1.

This module holds the plain PyTorch twins; every reader and writer in the
engine goes through these byte formats.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
SCALE_BLOCK = 128


def num_scale_blocks(dim: int) -> int:
    """Scale blocks for a latent of `dim` values (one per 128, or one for short rows)."""
    if dim <= SCALE_BLOCK:
        return 1
    if dim % SCALE_BLOCK:
        raise ValueError(f"latent dim {dim} must be a multiple of {SCALE_BLOCK}")
    return dim // SCALE_BLOCK


def mla_row_bytes(latent_dim: int, rope_dim: int) -> int:
    return latent_dim + 4 * num_scale_blocks(latent_dim) + 2 * rope_dim


def indexer_key_bytes(dim: int) -> int:
    """Bytes of one FP8 indexer key: `dim` e4m3 values and one fp32 scale."""
    return dim + 4


def _quantize_blocks(x: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise [N, D] to fp8 with one scale per block; returns (fp8 bytes [N, D], scales [N, blocks])."""
    n, d = x.shape
    blocks = x.float().reshape(n, num_blocks, d // num_blocks)
    amax = blocks.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(n, d).view(torch.uint8), scales


def pack_mla_rows(latent: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """[N, Dl] latent and [N, Dr] rope -> [N, mla_row_bytes] uint8."""
    n, dl = latent.shape
    blocks = num_scale_blocks(dl)
    q, scales = _quantize_blocks(latent, blocks)
    rope_bytes = rope.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(n, -1)
    scale_bytes = scales.contiguous().view(torch.uint8).reshape(n, -1)
    return torch.cat([q, scale_bytes, rope_bytes], dim=1)


def unpack_mla_rows(rows: torch.Tensor, latent_dim: int, rope_dim: int) -> torch.Tensor:
    """[N, mla_row_bytes] uint8 -> [N, Dl + Dr] float32 (latent then rope)."""
    n = rows.shape[0]
    blocks = num_scale_blocks(latent_dim)
    q = rows[:, :latent_dim].contiguous().view(torch.float8_e4m3fn).float()
    scale_end = latent_dim + 4 * blocks
    scales = rows[:, latent_dim:scale_end].contiguous().view(torch.float32)
    latent = (q.reshape(n, blocks, -1) * scales[..., None]).reshape(n, latent_dim)
    rope = rows[:, scale_end : scale_end + 2 * rope_dim].contiguous().view(torch.bfloat16).float()
    return torch.cat([latent, rope], dim=1)


def pack_indexer_rows(keys: torch.Tensor) -> torch.Tensor:
    """[N, D] indexer keys -> [N, D + 4] uint8 (fp8 values, then the fp32 scale's 4 bytes)."""
    n = keys.shape[0]
    q, scales = _quantize_blocks(keys, 1)
    return torch.cat([q, scales.contiguous().view(torch.uint8).reshape(n, 4)], dim=1)


def split_indexer_rows(rows: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, D + 4] uint8 -> (e4m3 values decoded to float32 [N, D], scales [N, 1] float32), unscaled: what an
    FP8 dot multiplies before the scale is applied."""
    q = rows[:, :dim].contiguous().view(torch.float8_e4m3fn).float()
    return q, rows[:, dim : dim + 4].contiguous().view(torch.float32)


def unpack_indexer_rows(rows: torch.Tensor, dim: int) -> torch.Tensor:
    """[N, D + 4] uint8 (fp8 values, then the fp32 scale's 4 bytes) -> [N, D] float32."""
    q, scales = split_indexer_rows(rows, dim)
    return q * scales


def quantize_query_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, D] -> (e4m3 values decoded to float32 [N, D], scales [N] float32), one scale a row: the indexer's FP8
    queries (a row per head), so FP8 keys meet FP8 queries on the tensor cores. The values are x times
    448 / amax (one IEEE division a row, then products) rather than x / scale as keys are: a kernel that
    quantises a query in every program would otherwise pay a division per value (2 us of 15 at B = 1, 128K)."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    some = amax > 0
    one = torch.ones_like(amax)
    inv = torch.where(some, torch.div(torch.full_like(amax, FP8_MAX), torch.where(some, amax, one)), one)
    scales = torch.where(some, torch.div(amax, torch.full_like(amax, FP8_MAX)), one)
    q = (x * inv[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.float(), scales
