"""The host tier between prefill and decode replicas: exports as objects in Ray's object store.

A prefill replica `publish`es an export's Arrow record batch with `ray.put`: the
object lives in the shared memory of the prefill replica's node, owned by that
replica, and Ray moves it to the decode replica's node on first read; a reader
on the same node gets the batch's buffers as read-only views of that memory.
The decode replica `fetch`es it through the `KVHandle` it got back from the
prefill call and reads it as a `KVExport`, which refuses another format version.
If the object is lost or its owner died, `fetch` raises `TransferFailed`; either
way the decode replica prefills locally instead. The object is freed when the
last handle to it is dropped.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import ray
from ray.exceptions import RayError

from disagg.kv_export import KVExport


class TransferFailed(RuntimeError):
    """The export could not be read: object lost, owner dead, or too slow."""


@dataclass(frozen=True)
class KVHandle:
    """What a prefill call returns: a reference to the export and its size."""

    ref: ray.ObjectRef
    num_tokens: int  # prefix tokens the export covers
    start_tokens: int  # tokens before this are not in the export
    num_pages: int
    num_bytes: int

    @property
    def num_transferred_tokens(self) -> int:
        return self.num_tokens - self.start_tokens


async def publish(export: KVExport) -> KVHandle:
    """Puts the export's batch in the object store (off the event loop: it copies every byte)."""
    ref = await asyncio.to_thread(ray.put, export.batch)
    return KVHandle(ref, export.num_tokens, export.start_tokens, export.num_pages, export.num_bytes)


async def fetch(handle: KVHandle, timeout_s: float) -> KVExport:
    """Reads the export behind `handle`; raises `TransferFailed` when it cannot, `ExportMismatch` when it is
    of another format version."""
    try:
        batch = await asyncio.wait_for(handle.ref, timeout_s)
    except (RayError, asyncio.TimeoutError) as exc:
        raise TransferFailed(f"cannot read the KV export: {exc!r}") from exc
    return KVExport(batch)
