"""Byte layout of KV pages: row formats and where each row lives inside a page.

One page pool serves every use, so every page has the same size. An MLA page
holds `page_size` tokens of every MLA layer ordered `[group, token,
layer-in-group, row]`: the rows of one token for all layers of one IndexShare
group are one contiguous run (one miss = one copy). An indexer page holds as
many tokens T of every full-indexer layer as fit, a multiple of `page_size`,
one block per full layer so one layer's keys of a page are contiguous for
scoring. Inside a block, bf16 / float32 keys are rows `[token, key]`; FP8 keys
keep their values and scales apart, all the tokens' e4m3 values `[token, Di]`
first, then their float32 scales `[token]`, so that the scoring kernel loads
each key's values as aligned 16-byte vectors. Full layer f, token t:

    block  = f * T * indexer_key_bytes      (indexer_key_bytes = Di + 4 for fp8)
    values = block + t * Di
    scale  = block + T * Di + 4 * t

With 64-token pages, T and page_bytes are multiples of 64, so every block,
every key's values (Di a multiple of 16) and every scales area start 16-byte
aligned in the pool. A hot page has the MLA page layout; its token positions
are hot slots.

Row formats: `float32` (reference mode, no FP8 anywhere), `bf16`, `fp8`
(656-byte MLA rows and 132-byte indexer keys at GLM shape).
"""

from __future__ import annotations

import functools

from dataclasses import dataclass
from typing import Literal

import torch

from engine.model_config import ModelConfig
from kernels import fp8_rows
from kernels.fp8_pack import KeyPlacement, RowPlacement
from kernels.indexer import IndexerKeys

KVFormat = Literal["float32", "bf16", "fp8"]
PAGE_SIZE = 64

_ELEMENT_BYTES = {"float32": 4, "bf16": 2}


@dataclass(frozen=True)
class KVLayout:
    """Sizes and offsets of rows inside pages for one model and row format."""

    kv_format: KVFormat
    latent_dim: int
    rope_dim: int
    index_dim: int
    group_sizes: tuple[int, ...]
    layer_group: tuple[int, ...]
    layer_pos: tuple[int, ...]
    num_full_layers: int
    page_size: int = PAGE_SIZE

    @classmethod
    def for_model(cls, cfg: ModelConfig, kv_format: KVFormat, page_size: int = PAGE_SIZE,
                  draft_layers: int = 0) -> "KVLayout":
        """`draft_layers`: MTP layers (engine/mtp.py) whose rows the pages hold too, as members of the last
        IndexShare group (they attend over its selection, so a miss brings their rows with the group's)."""
        num_layers = cfg.num_hidden_layers + draft_layers
        groups = [list(g) for g in cfg.groups]
        groups[-1] += range(cfg.num_hidden_layers, num_layers)
        layer_group, layer_pos = [0] * num_layers, [0] * num_layers
        for g, members in enumerate(groups):
            for j, layer in enumerate(members):
                layer_group[layer], layer_pos[layer] = g, j
        return cls(
            kv_format=kv_format,
            latent_dim=cfg.kv_lora_rank,
            rope_dim=cfg.qk_rope_head_dim,
            index_dim=cfg.index_head_dim,
            group_sizes=tuple(len(g) for g in groups),
            layer_group=tuple(layer_group),
            layer_pos=tuple(layer_pos),
            num_full_layers=len(cfg.groups),
            page_size=page_size,
        )

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    @property
    def mla_row_bytes(self) -> int:
        if self.kv_format == "fp8":
            return fp8_rows.mla_row_bytes(self.latent_dim, self.rope_dim)
        return (self.latent_dim + self.rope_dim) * _ELEMENT_BYTES[self.kv_format]

    @property
    def indexer_key_bytes(self) -> int:
        """Bytes of one token's key in one full layer (fp8: its values and its scale, stored apart)."""
        if self.kv_format == "fp8":
            return fp8_rows.indexer_key_bytes(self.index_dim)
        return self.index_dim * _ELEMENT_BYTES[self.kv_format]

    @property
    def indexer_block_order(self) -> str:
        """How a full layer's block of an indexer page orders its keys' bytes: "values_then_scales" (fp8: every
        token's values, then every token's scale) or "rows" (one whole key per token)."""
        return "values_then_scales" if self.kv_format == "fp8" else "rows"

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.num_layers * self.mla_row_bytes

    @property
    def group_run_bytes(self) -> tuple[int, ...]:
        """Bytes of one token's rows for all layers of each group (one miss)."""
        return tuple(n * self.mla_row_bytes for n in self.group_sizes)

    @property
    def group_offsets(self) -> tuple[int, ...]:
        """Byte offset of each group's block inside a page."""
        return tuple(self.group_offset(g) for g in range(len(self.group_sizes)))

    def group_offset(self, group: int) -> int:
        """Byte offset of a group's block inside a page."""
        return self.page_size * self.mla_row_bytes * sum(self.group_sizes[:group])

    @functools.cached_property
    def indexer_tokens_per_page(self) -> int:
        per_token = self.num_full_layers * self.indexer_key_bytes
        tokens = (self.page_bytes // per_token) // self.page_size * self.page_size
        if tokens == 0:
            raise ValueError("an indexer page must hold at least one page of tokens")
        return tokens

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token holds over every layer (the capacity tables of notebooks/concurrency.ipynb)."""
        return self.num_layers * self.mla_row_bytes + self.num_full_layers * self.indexer_key_bytes

    # --- views into a pool of pages -------------------------------------------------

    def mla_layer_view(self, pool: torch.Tensor, layer: int) -> torch.Tensor:
        """[num_pages, page_size, mla_row_bytes] uint8 view of one layer's rows."""
        g, j = self.layer_group[layer], self.layer_pos[layer]
        size, rb = self.group_sizes[g], self.mla_row_bytes
        start = self.group_offset(g)
        block = pool[:, start : start + self.page_size * size * rb]
        return block.view(pool.shape[0], self.page_size, size, rb)[:, :, j, :]

    def mla_placement(self, layer: int) -> RowPlacement:
        """Where one layer's MLA rows sit in a page, for kernels that write rows by slot."""
        g, j = self.layer_group[layer], self.layer_pos[layer]
        return RowPlacement(self.page_size, self.group_offset(g) + j * self.mla_row_bytes, self.group_run_bytes[g])

    def indexer_block_offset(self, full_index: int) -> int:
        """Byte offset of a full layer's block (its keys of the page) inside an indexer page."""
        return full_index * self.indexer_tokens_per_page * self.indexer_key_bytes

    def indexer_placement(self, full_index: int) -> KeyPlacement:
        """Where one full layer's FP8 keys sit in an indexer page (values, then scales), for kernels that write
        keys by slot."""
        if self.kv_format != "fp8":
            raise ValueError(f"{self.kv_format} indexer keys are whole rows, not placed as values and scales")
        tokens, start, dim = self.indexer_tokens_per_page, self.indexer_block_offset(full_index), self.index_dim
        return KeyPlacement(tokens, start, dim, start + tokens * dim, 4)

    def indexer_layer_view(self, pool: torch.Tensor, full_index: int) -> IndexerKeys:
        """One full layer's keys in every page of `pool`: values [num_pages, indexer_tokens_per_page, Di or
        indexer_key_bytes] and, for fp8, scales [num_pages, indexer_tokens_per_page, 4] (uint8 views)."""
        tokens = self.indexer_tokens_per_page
        if self.kv_format != "fp8":
            return IndexerKeys(_runs(pool, self.indexer_block_offset(full_index), tokens, self.indexer_key_bytes),
                               None)
        place = self.indexer_placement(full_index)
        return IndexerKeys(_runs(pool, place.value_offset, tokens, place.value_stride),
                           _runs(pool, place.scale_offset, tokens, place.scale_stride))

    # --- row encoding ---------------------------------------------------------------

    def encode_mla(self, latent: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """[N, Dl], [N, Dr] -> [N, mla_row_bytes] uint8."""
        if self.kv_format == "fp8":
            return fp8_rows.pack_mla_rows(latent, rope)
        dtype = torch.float32 if self.kv_format == "float32" else torch.bfloat16
        row = torch.cat([latent, rope], dim=-1).to(dtype).contiguous()
        return row.view(torch.uint8).reshape(row.shape[0], -1)

    def decode_mla(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[N, mla_row_bytes] uint8 -> [N, Dl + Dr] in `dtype`."""
        if self.kv_format == "fp8":
            return fp8_rows.unpack_mla_rows(rows, self.latent_dim, self.rope_dim).to(dtype)
        src = torch.float32 if self.kv_format == "float32" else torch.bfloat16
        return rows.contiguous().view(src).to(dtype)

    def encode_indexer(self, keys: torch.Tensor) -> torch.Tensor:
        """[N, Di] -> [N, indexer_key_bytes] uint8 (fp8: values, then the scale), as `IndexerKeys.store` takes."""
        if self.kv_format == "fp8":
            return fp8_rows.pack_indexer_rows(keys)
        dtype = torch.float32 if self.kv_format == "float32" else torch.bfloat16
        return keys.to(dtype).contiguous().view(torch.uint8).reshape(keys.shape[0], -1)

    def decode_indexer(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[N, indexer_key_bytes] uint8, as `IndexerKeys.rows` gives them -> [N, Di] in `dtype`."""
        if self.kv_format == "fp8":
            return fp8_rows.unpack_indexer_rows(rows, self.index_dim).to(dtype)
        src = torch.float32 if self.kv_format == "float32" else torch.bfloat16
        return rows.contiguous().view(src).to(dtype)


def _runs(pool: torch.Tensor, offset: int, tokens: int, width: int) -> torch.Tensor:
    """[num_pages, tokens, width] uint8 view of `tokens` back-to-back runs of `width` bytes from `offset`."""
    return pool[:, offset : offset + tokens * width].view(pool.shape[0], tokens, width)
