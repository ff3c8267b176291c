"""Landing an export on a decode replica: its pages join the replica's prefix cache, on GPU or on host.

`land_prefix` is the one entry point and receives the whole engine. When the
GPU pool can take every page of the export now (under the hybrid policy: and
still hold the rest of the prompt and a hot lease), the pages land on GPU pages
through the engine's prefix install. Otherwise, if the replica runs the hybrid
residency policy, they land in its pinned host pool under the same prefix
hashes: the request then admits with its prefix host-only (residency state
`none`, or `mixed` when its head is on the GPU) and loads just the rows its
indexer selects. Without a host tier, as many whole indexer pages as fit land
on the GPU and the replica prefills the rest itself.

Must run on the engine thread (`AsyncEngine.run_in_engine`), between steps: the
check that the pages before the export's start are still cached and the install
that relies on it then see the same cache. The export's page tensors are views
of read-only object-store memory: landing only copies out of them.
"""

from __future__ import annotations

import logging
from typing import Literal, NamedTuple

import torch

from disagg.kv_export import ExportMismatch, KVExport
from engine.llm_engine import LLMEngine
from engine.prefix_transfer import PrefixSnapshot, install_prefix
from residency.page_pool import PageUse
from residency.prefix_cache import PrefixCache, chain_hashes

logger = logging.getLogger(__name__)


class Landing(NamedTuple):
    prefix_tokens: int  # prompt tokens cached on this replica (GPU or host) after landing
    imported_tokens: int  # of those, tokens whose pages came from the export
    tier: Literal["gpu", "host", "none"]


class _TailPages:
    """Pages `[head, head + len(tail))` of a prefix, standing in for all of them.

    The first `head` pages are cached on this replica (checked on the engine thread
    just before the install, which pins them before it allocates anything), so the
    install finds them and never copies their bytes. They read as an empty tensor:
    copying one would fail loudly instead of landing wrong bytes.
    """

    _NOT_SENT = torch.empty(0, dtype=torch.uint8)

    def __init__(self, head: int, tail: torch.Tensor) -> None:
        self._head, self._tail = head, tail

    @property
    def shape(self) -> tuple[int, ...]:
        return (self._head + self._tail.shape[0], *self._tail.shape[1:])

    def __getitem__(self, page: int) -> torch.Tensor:
        return self._NOT_SENT if page < self._head else self._tail[page - self._head]


def cached_prefix_tokens(engine: LLMEngine, token_ids: list[int]) -> int:
    """Tokens of the reusable prefix of `token_ids` this replica holds on GPU (whole indexer pages)."""
    if not engine.kv.enable_prefix_cache:
        return 0
    _, _, indexer_pages = engine.kv.lookup_prefix(token_ids)
    return len(indexer_pages) * engine.kv.indexer_page_tokens


def land_prefix(engine: LLMEngine, token_ids: list[int], export: KVExport) -> Landing:
    """Installs the export's pages for the prompt `token_ids`; the export must be verified first."""
    held = cached_prefix_tokens(engine, token_ids)
    if held < export.start_tokens:
        logger.info("pages before the export were evicted (%d < %d tokens); prefilling locally",
                    held, export.start_tokens)
        return Landing(held, 0, "none")
    residency = engine.residency
    if (residency is not None and residency.config.traits.runs_from_host
            and _gpu_room_needed(engine, token_ids, export) > engine.kv.num_available):
        landed = _land_on_host(engine, token_ids, export)
        return Landing(max(held, export.start_tokens + landed), landed, "host")
    layout = engine.layout
    snap = PrefixSnapshot(
        num_tokens=export.num_tokens,
        # The head's keys are this replica's own; the install checks the export's against its hashing.
        page_hashes=chain_hashes(token_ids[: export.start_tokens], layout.page_size) + export.page_hashes,
        mla=_TailPages(export.start_tokens // layout.page_size, export.mla),
        indexer=_TailPages(export.start_tokens // layout.indexer_tokens_per_page, export.indexer),
    )
    installed = install_prefix(engine.kv, engine.runner.executor, token_ids, snap)
    return Landing(max(installed, held), max(installed - held, 0), "gpu")


def _gpu_room_needed(engine: LLMEngine, token_ids: list[int], export: KVExport) -> int:
    """GPU pages a landing on the GPU needs free so its request can then run there: the export's, the rest of
    the prompt's and a hot lease. Landed on pages it fills, the prefix left no room for the rest, and the
    request could only start by computing the prefix again."""
    rest = engine.kv.pages_for_tokens(len(token_ids) - export.num_tokens)
    return export.num_pages + rest + engine.residency.hot.pages_per_lease


def _land_on_host(engine: LLMEngine, token_ids: list[int], export: KVExport) -> int:
    """Caches the export's indexer-page groups in the host pool, in order, while host pages last."""
    kv, host = engine.kv, engine.residency.host
    engine.residency.wait_for_loads()  # the pages written below may have been read by a load in flight
    hashes, _, _ = kv.lookup_prefix(token_ids)
    head = export.start_tokens // kv.page_size
    if hashes[head : head + len(export.page_hashes)] != export.page_hashes:
        raise ExportMismatch("export page hashes do not match these token ids")
    per_group = kv.indexer_page_tokens // kv.page_size
    mla, indexer, keys = export.mla, export.indexer, export.page_hashes
    held: list[int] = []  # pinned until the end so later groups cannot evict earlier ones
    landed = 0
    try:
        for g in range(indexer.shape[0]):
            first = g * per_group
            group = [(PageUse.MLA, keys[first + i], mla[first + i]) for i in range(per_group)]
            group.append((PageUse.INDEXER, keys[first + per_group - 1], indexer[g]))
            if not _cache_group(host.cache, host.data, group, held):
                break
            landed += 1
    finally:
        for page in held:
            host.cache.release(page)
    logger.debug("landed %d of %d indexer-page groups on host", landed, indexer.shape[0])
    return landed * kv.indexer_page_tokens


def _cache_group(cache: PrefixCache, data: torch.Tensor, pages: list[tuple], held: list[int]) -> bool:
    """Caches every page of `pages` (use, key, bytes) in `cache` over `data`, or none (`PrefixCache.claim`); pins
    them in `held`."""
    fresh = cache.claim([(use, key) for use, key, _ in pages], held)
    if fresh is None:
        return False
    for page, (use, key, bytes_) in zip(fresh, pages):
        if page is not None:
            data[page].copy_(bytes_)
            cache.insert(page, use, key)
    return True
