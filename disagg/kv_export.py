"""The KV export format: the pages of one computed prefix as one versioned Arrow record batch.

A prefill replica builds the batch from a prefix snapshot (`export_snapshot`),
the Ray object store carries it, and a decode replica reads it (`KVExport`),
checks it (`KVExport.verify`) and lands its pages. Built once, never mutated:
on the decode side every page tensor is a view of the batch's page buffer, which
the object store maps read-only into the reader, so readers copy out of it and
nothing may write into it.

Schema, format version 3. One row per page sent: the MLA pages covering prompt
tokens `[start_tokens, num_tokens)` in prefix order, then the indexer pages of
the same tokens in order (each covers `indexer_tokens_per_page / page_size` of
those MLA pages, the unit of prefix reuse):

    use        dictionary<int8, string>       "mla" or "indexer"
    page_hash  fixed_size_binary(16)          the page's prefix-cache key: an MLA page's hash chained
                                              over every token up to its end; an indexer page's is the
                                              key of the last MLA page it covers
    token_ids  fixed_size_list<int64>[page]   an MLA page's tokens; null on indexer rows
    page       fixed_size_binary(page_bytes)  the page's bytes

Schema metadata (UTF-8 strings): `hisparse.format_version`, `hisparse.model_id`,
`hisparse.start_tokens` and `hisparse.layout.<field>` (JSON) for every field of
`layout_facts`, among them `indexer_block_order`: how an indexer page orders
each full layer's keys ("values_then_scales" for FP8 keys, "rows" otherwise;
version 2 held FP8 keys as interleaved 132-byte rows, so it is refused). No
checksum of the page bytes: it would read every byte of an export once more on
each side (about 0.4 s a GB on the decode path) for damage the object store
does not cause; the hashes tie the pages to the prompt.

Why this shape:
- Indexer pages are rows of their own rather than a nullable column on the last
  MLA page of each group: a null fixed-size binary still occupies its width in
  the data buffer, so that column would carry one zero page per MLA page but the
  last (17 of 18 at GLM-5.3's shape, nearly doubling every transfer). Nor are
  they a second batch (a second schema, and a container for the two): every page
  of the pool has one size, so one `page` column holds both uses in a single
  buffer, MLA first, that the receiver views as two tensors without a copy.
- Pages before `start_tokens` (the receiver holds them) are not rows, and their
  token ids and hashes are not needed: each page hash chains over every earlier
  token, so checking the sent hashes against the receiver's own hashing of its
  prompt checks the unsent head as well.
- Token ids are int64 lists, the width the page hashes are computed over, so any
  Arrow reader sees integers.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from engine.kv_layout import KVLayout
from engine.prefix_transfer import PrefixSnapshot
from residency.page_pool import PageUse
from residency.prefix_cache import chain_hashes

FORMAT_VERSION = 3
HASH_BYTES = 16  # digest size of `residency.prefix_cache.chain_hashes`
_KEY = "hisparse."
_LAYOUT_KEY = _KEY + "layout."
_USES = pa.array([PageUse.MLA.value, PageUse.INDEXER.value])  # the `use` column's dictionary: codes 0, 1


class ExportMismatch(ValueError):
    """The export does not belong to this replica's format, model, layout or prompt."""


def layout_facts(layout: KVLayout) -> dict[str, Any]:
    """The layout fields two replicas must agree on for their pages to be interchangeable."""
    facts = dataclasses.asdict(layout)
    facts.update(
        page_bytes=layout.page_bytes,
        mla_row_bytes=layout.mla_row_bytes,
        indexer_key_bytes=layout.indexer_key_bytes,
        indexer_block_order=layout.indexer_block_order,
        indexer_tokens_per_page=layout.indexer_tokens_per_page,
    )
    return {k: list(v) if isinstance(v, tuple) else v for k, v in facts.items()}


def export_schema(page_size: int, page_bytes: int) -> pa.Schema:
    """The columns of a format-version-3 export of `page_bytes`-byte pages of `page_size` tokens."""
    return pa.schema([
        pa.field("use", pa.dictionary(pa.int8(), pa.string()), nullable=False),
        pa.field("page_hash", pa.binary(HASH_BYTES), nullable=False),
        pa.field("token_ids", pa.list_(pa.int64(), page_size)),
        pa.field("page", pa.binary(page_bytes), nullable=False),
    ])


class KVExport:
    """One export batch with its metadata parsed and its pages as tensors over the batch's page buffer.

    Constructing it refuses a batch of another format version (before reading
    anything else, since other versions may lay out rows differently) or one
    whose rows do not match its own metadata; `verify` then checks it against
    the receiving replica. Besides `batch`: `model_id`, `layout` (the sender's
    `layout_facts`), `start_tokens`, `page_hashes` (keys of the MLA
    pages sent) and `mla` / `indexer` (uint8 [pages, page_bytes], read-only views).
    """

    def __init__(self, batch: pa.RecordBatch) -> None:
        meta = {k.decode(): v.decode() for k, v in (batch.schema.metadata or {}).items()}
        version = meta.get(_KEY + "format_version")
        if version != str(FORMAT_VERSION):
            raise ExportMismatch(f"export format version {version}, this replica reads version {FORMAT_VERSION}")
        try:
            self.model_id = meta[_KEY + "model_id"]
            self.start_tokens = int(meta[_KEY + "start_tokens"])
            self.layout = {k.removeprefix(_LAYOUT_KEY): json.loads(v) for k, v in meta.items()
                           if k.startswith(_LAYOUT_KEY)}
            self.page_size, page_bytes = self.layout["page_size"], self.layout["page_bytes"]
            self._pages_per_group = self.layout["indexer_tokens_per_page"] // self.page_size
        except (KeyError, TypeError, ValueError) as exc:
            raise ExportMismatch(f"export metadata is incomplete or unreadable: {exc!r}") from exc
        if not batch.schema.remove_metadata().equals(export_schema(self.page_size, page_bytes)):
            raise ExportMismatch(f"export columns do not match its own layout: {batch.schema.remove_metadata()}")
        num_indexer = batch.num_rows // (self._pages_per_group + 1)
        self.num_mla_pages = num_indexer * self._pages_per_group
        uses = [PageUse.MLA.value] * self.num_mla_pages + [PageUse.INDEXER.value] * num_indexer
        if batch.column("use").to_pylist() != uses:
            raise ExportMismatch("export rows are not whole groups of MLA pages followed by their indexer pages")
        self.batch = batch
        self.page_hashes: list[bytes] = batch.column("page_hash").to_pylist()[: self.num_mla_pages]
        pages = _page_tensor(batch.column("page"))
        self.mla, self.indexer = pages[: self.num_mla_pages], pages[self.num_mla_pages :]

    @property
    def num_tokens(self) -> int:
        """Prefix tokens the export completes: the receiver holds `[0, start_tokens)`, the rows the rest."""
        return self.start_tokens + self.num_mla_pages * self.page_size

    @property
    def num_pages(self) -> int:
        return self.batch.num_rows

    @property
    def num_bytes(self) -> int:
        return self.num_pages * self.layout["page_bytes"]

    @property
    def token_ids(self) -> np.ndarray:
        """int64 [num_tokens - start_tokens]: the tokens of the MLA pages, a view of the batch."""
        return self.batch.column("token_ids").slice(0, self.num_mla_pages).flatten().to_numpy()

    def verify(self, model_id: str, layout: KVLayout, prompt_token_ids: list[int]) -> None:
        """Raises `ExportMismatch`, naming what differs, unless the export fits this model, layout and prompt
        (its token ids, and page hashes chained over the tokens before it too)."""
        if self.model_id != model_id:
            raise ExportMismatch(f"export is for model {self.model_id!r}, this replica serves {model_id!r}")
        ours = layout_facts(layout)
        differs = [f"{k} {self.layout.get(k)!r} != {ours.get(k)!r}"
                   for k in sorted(ours.keys() | self.layout.keys()) if self.layout.get(k) != ours.get(k)]
        if differs:
            raise ExportMismatch("export page layout differs from this replica's (export != replica): "
                                 + ", ".join(differs))
        start, end = self.start_tokens, self.num_tokens
        if len(prompt_token_ids) < end or list(prompt_token_ids[start:end]) != self.token_ids.tolist():
            raise ExportMismatch(f"export token ids [{start}, {end}) are not this prompt's")
        hashes = chain_hashes(prompt_token_ids[:end], self.page_size)[start // self.page_size :]
        keys = hashes + hashes[self._pages_per_group - 1 :: self._pages_per_group]
        if self.batch.column("page_hash").to_pylist() != keys:
            raise ExportMismatch("export page hashes differ from this prompt's: the tokens before "
                                 f"{start} differ, or the two replicas hash pages differently")


def export_snapshot(
    snap: PrefixSnapshot, model_id: str, layout: KVLayout, token_ids: list[int], start_tokens: int
) -> KVExport:
    """Builds the export of `snap` without the pages covering the first `start_tokens` tokens.

    `start_tokens` is rounded down to whole indexer pages, the unit of prefix reuse.
    When the snapshot holds nothing past it, the export has no rows (and lands nothing).
    """
    size, per_idx = layout.page_size, layout.indexer_tokens_per_page
    per_group = per_idx // size
    start = min(start_tokens, snap.num_tokens) // per_idx * per_idx
    mla, indexer = snap.mla[start // size :], snap.indexer[start // per_idx :]
    num_mla, num_rows = mla.shape[0], mla.shape[0] + indexer.shape[0]
    hashes = list(snap.page_hashes[start // size :])  # an indexer page's key: its last MLA page's hash
    tokens = np.zeros(num_rows * size, dtype=np.int64)
    tokens[: num_mla * size] = token_ids[start : snap.num_tokens]
    pages = _pages_block(mla, indexer).numpy()
    page_column = pa.FixedSizeBinaryArray.from_buffers(pa.binary(layout.page_bytes), num_rows,
                                                       [None, pa.py_buffer(pages)])
    columns = [
        pa.DictionaryArray.from_arrays(pa.array(np.repeat(np.int8([0, 1]), [num_mla, indexer.shape[0]])), _USES),
        pa.array(hashes + hashes[per_group - 1 :: per_group], pa.binary(HASH_BYTES)),
        pa.FixedSizeListArray.from_arrays(pa.array(tokens), size, mask=pa.array(np.arange(num_rows) >= num_mla)),
        page_column,
    ]
    metadata = {_KEY + "format_version": str(FORMAT_VERSION), _KEY + "model_id": model_id,
                _KEY + "start_tokens": str(start)}
    metadata.update({_LAYOUT_KEY + k: json.dumps(v) for k, v in layout_facts(layout).items()})
    schema = export_schema(size, layout.page_bytes).with_metadata(metadata)
    return KVExport(pa.RecordBatch.from_arrays(columns, schema=schema))


def _pages_block(mla: torch.Tensor, indexer: torch.Tensor) -> torch.Tensor:
    """MLA then indexer pages as one contiguous [n, page_bytes] tensor.

    A snapshot reads both uses into one tensor, MLA pages first, so an export from
    token 0 is one block already and is used in place; an export that skips the
    head leaves a gap between the two and is concatenated (one host copy).
    """
    adjacent = (mla.is_contiguous() and indexer.is_contiguous()
                and mla.untyped_storage().data_ptr() == indexer.untyped_storage().data_ptr()
                and mla.data_ptr() + mla.nbytes == indexer.data_ptr())
    if adjacent:
        shape = (mla.shape[0] + indexer.shape[0], mla.shape[1])
        return mla.new_empty(0).set_(mla.untyped_storage(), mla.storage_offset(), shape)
    return torch.cat([mla, indexer])


def _page_buffer(column: pa.FixedSizeBinaryArray) -> pa.Buffer:
    """The column's bytes, in place: its data buffer trimmed to its rows (a batch may be a slice)."""
    width = column.type.byte_width
    return column.buffers()[1].slice(column.offset * width, len(column) * width)


def _page_tensor(column: pa.FixedSizeBinaryArray) -> torch.Tensor:
    """uint8 [rows, page_bytes] over the column's buffer, no copy.

    A buffer read from the object store is read-only shared memory; torch has no
    read-only tensors, so it warns, and the warning is silenced here because
    the landing only ever copies out of these tensors.
    """
    pages = np.frombuffer(_page_buffer(column), dtype=np.uint8).reshape(len(column), column.type.byte_width)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(pages)

