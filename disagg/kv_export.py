"""The KV export format: the pages of one computed prefix, self-describing and checksummed.

An export carries the pages covering prompt tokens `[start_tokens, num_tokens)`:
pages before `start_tokens` are already cached on the receiving replica and are
not moved. Page bytes are numpy arrays, so an export read from the object store
on the same node is a zero-copy view of shared memory. Everything the receiver
needs to refuse a wrong export travels with it: the model id, the page layout
(row format, page size, page bytes, IndexShare groups), the token ids, the
chained page hashes and a CRC-32 of the bytes. Built once by the prefill
replica, never mutated, read by the decode replica.
"""

from __future__ import annotations

import dataclasses
import warnings
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.kv_layout import KVLayout
from engine.prefix_transfer import PrefixSnapshot

FORMAT_VERSION = 1


class ExportMismatch(ValueError):
    """The export does not belong to this replica's model, layout or prompt, or its bytes are damaged."""


def layout_facts(layout: KVLayout) -> dict[str, Any]:
    """The layout fields two replicas must agree on for their pages to be interchangeable."""
    facts = dataclasses.asdict(layout)
    facts.update(
        page_bytes=layout.page_bytes,
        mla_row_bytes=layout.mla_row_bytes,
        indexer_row_bytes=layout.indexer_row_bytes,
        indexer_tokens_per_page=layout.indexer_tokens_per_page,
    )
    return {k: list(v) if isinstance(v, tuple) else v for k, v in facts.items()}


def _crc32(*arrays: np.ndarray) -> int:
    """CRC-32 of the arrays' bytes in order, read in place (pages are large and may be shared memory).

    Empty arrays add no bytes and are skipped: a memoryview with a zero in its
    shape cannot be cast, and an export with no pages left to send is normal.
    """
    crc = 0
    for array in arrays:
        if array.size:
            crc = zlib.crc32(memoryview(np.ascontiguousarray(array)).cast("B"), crc)
    return crc


@dataclass(frozen=True)
class KVExport:
    """Pages of the prefix `token_ids[:num_tokens]` from `start_tokens` on, with what identifies them."""

    format_version: int
    model_id: str
    layout: dict[str, Any]  # `layout_facts` of the sender
    token_ids: np.ndarray  # int64 [num_tokens]: the prefix the pages belong to
    start_tokens: int  # tokens before this are not included (the receiver holds them)
    page_hashes: list[bytes]  # chained hash of every MLA page of the prefix, from page 0
    mla: np.ndarray  # uint8 [num_mla_pages, page_bytes], MLA pages from start_tokens
    indexer: np.ndarray  # uint8 [num_indexer_pages, page_bytes], indexer pages from start_tokens
    checksum: int  # CRC-32 of mla then indexer bytes

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_bytes(self) -> int:
        return self.mla.nbytes + self.indexer.nbytes

    @property
    def num_pages(self) -> int:
        return self.mla.shape[0] + self.indexer.shape[0]

    def verify(self, model_id: str, layout: KVLayout, prompt_token_ids: list[int]) -> None:
        """Raises `ExportMismatch` unless the export fits this model, layout and prompt and its bytes are intact."""
        if self.format_version != FORMAT_VERSION:
            raise ExportMismatch(f"export format {self.format_version}, expected {FORMAT_VERSION}")
        if self.model_id != model_id:
            raise ExportMismatch(f"export is for model {self.model_id!r}, this replica serves {model_id!r}")
        if self.layout != layout_facts(layout):
            raise ExportMismatch("export page layout differs from this replica's")
        if list(prompt_token_ids[: self.num_tokens]) != self.token_ids.tolist():
            raise ExportMismatch("export token ids are not a prefix of this prompt")
        if _crc32(self.mla, self.indexer) != self.checksum:
            raise ExportMismatch("export bytes fail their checksum")


def export_snapshot(
    snap: PrefixSnapshot, model_id: str, layout: KVLayout, token_ids: list[int], start_tokens: int
) -> KVExport:
    """Builds the export of `snap` without the pages covering the first `start_tokens` tokens.

    `start_tokens` is rounded down to whole indexer pages, the unit of prefix reuse.
    When the snapshot holds nothing past it, the export has no pages (and lands nothing).
    """
    per_idx = layout.indexer_tokens_per_page
    start = min(start_tokens, snap.num_tokens) // per_idx * per_idx
    mla = snap.mla[start // layout.page_size :].numpy()
    indexer = snap.indexer[start // per_idx :].numpy()
    return KVExport(
        format_version=FORMAT_VERSION,
        model_id=model_id,
        layout=layout_facts(layout),
        token_ids=np.asarray(token_ids[: snap.num_tokens], dtype=np.int64),
        start_tokens=start,
        page_hashes=list(snap.page_hashes),
        mla=mla,
        indexer=indexer,
        checksum=_crc32(mla, indexer),
    )


def pages_as_tensor(pages: np.ndarray) -> torch.Tensor:
    """A torch view of export pages without a copy.

    Arrays read from the object store are read-only views of shared memory; the
    landing only reads them, so torch's warning about non-writable arrays is silenced.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(pages)
