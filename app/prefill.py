"""The prefill deployment: computes prompts and exports their KV through the object store.

Called by decode replicas only (never by the ingress). For each `PrefillRequest`
it runs the prompt on its own engine with `max_tokens=1` (when the prompt's pages
fit its GPU pool: else they could not all stay cached to be exported, and it
computes nothing), snapshots the cached pages of the prompt right after the step
that ends it, drops those the decode replica already holds, and publishes
the rest as a `KVExport` (an Arrow record batch) in an object it owns. It
returns the `KVHandle`; the decode replica reads the object. If this replica
dies, its objects die with it and the decode replicas prefill locally.
"""

from __future__ import annotations

import logging

from app.engine_server import EngineServer
from app.messages import PrefillRequest
from disagg.host_tier import KVHandle, publish
from disagg.kv_export import export_snapshot
from engine.llm_engine import LLMEngine
from engine.prefix_transfer import PrefixSnapshot, snapshot_prefix
from engine.request import SamplingParams

logger = logging.getLogger(__name__)

_ONE_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)


class PrefillServer(EngineServer):
    role = "prefill"

    async def prefill(self, req: PrefillRequest) -> KVHandle:
        """Computes `req`'s prompt and publishes the KV pages from `req.start_tokens` on."""
        ids = req.prompt_token_ids
        kv = self.engine.engine.kv
        computed = 0

        def snapshot(engine: LLMEngine) -> PrefixSnapshot:
            return snapshot_prefix(engine.kv, engine.runner.executor, ids)

        if kv.pages_for_tokens(len(ids)) <= kv.pool.num_pages:
            # Taken right after the step that ends the prompt: a later step of another prefill would take the
            # pages it left cached as free pages.
            output, snap = await self.engine.generate_then(ids, _ONE_TOKEN, snapshot, f"{req.request_id}-prefill")
            computed = len(ids) - output.num_cached_tokens
            self.counters["prefills"] += 1
        else:
            # Its pages outgrow this replica's GPU pool: computed here, they could not all stay cached to be
            # exported, and the decode replica would compute the prompt again. What is cached is exported.
            logger.info("%s: a prompt of %d tokens needs more than this replica's %d KV pages; not computed here",
                        req.request_id, len(ids), kv.pool.num_pages)
            self.counters["prefills_too_large"] += 1
            snap = await self.engine.run_in_engine(snapshot)
        export = export_snapshot(snap, self._config.model_id, self.engine.engine.layout, ids, req.start_tokens)
        handle = await publish(export)
        self.counters["prefill_computed_tokens"] += computed
        self.counters["exported_tokens"] += handle.num_transferred_tokens
        self.counters["exported_bytes"] += handle.num_bytes
        self.metrics.transfer("exported", handle.num_transferred_tokens, handle.num_bytes)
        logger.debug("%s: exported tokens [%d, %d), %d bytes", req.request_id, handle.start_tokens,
                     handle.num_tokens, handle.num_bytes)
        return handle
