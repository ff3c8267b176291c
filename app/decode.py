"""The decode deployment: owns an engine, orchestrates remote prefill, streams tokens.

Shaped like Ray Serve LLM's prefill/decode pattern: the decode replica receives
the request, asks a prefill replica to compute the prompt (`max_tokens=1`), gets
back a KV handle, lands the pages in its own prefix cache (on GPU pages, or in
its host pool when the GPU pool is short) and then generates locally. Remote
prefill happens only when a prefill deployment exists and the part of the prompt
this replica does not already cache (on the GPU or in its host tier) is at least
`disagg.min_transfer_tokens` long; only that part is moved. Any failure of the
remote path (prefill replica dead, none accepting the request within
`disagg.prefill_accept_timeout_s`, object lost, export refused, timeout) is logged
and counted, and the replica prefills locally: the request still succeeds. An
export with no pages (the prefill replica held nothing past what this replica
caches) is not a failure: there is nothing to land, and the replica computes the
rest itself. Without prefill replicas the deployment is colocated.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from ray.exceptions import RayError
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle, DeploymentResponse

from app.config import AppConfig
from app.engine_server import EngineServer
from app.heartbeats import with_heartbeats
from app.messages import GenerateChunk, GenerateRequest, PrefillRequest
from disagg.host_tier import TransferFailed, fetch
from disagg.landing import cached_prefix_tokens, land_prefix
from engine.request import InvalidRequestError
from residency.page_pool import OutOfPages

logger = logging.getLogger(__name__)


class DecodeServer(EngineServer):
    role = "decode"

    async def __init__(self, config: AppConfig, prefill: DeploymentHandle | None = None) -> None:
        await super().__init__(config)
        self._prefill = prefill
        kv = self.engine.engine.kv
        self._min_transfer_tokens = config.disagg.min_transfer_tokens or kv.indexer_page_tokens
        self._reuse_unit = kv.indexer_page_tokens

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Streams the request's chunks, with heartbeats while it waits for its first (`app.heartbeats`); a
        request the engine refuses yields one refusal chunk."""
        async for chunk in with_heartbeats(self._chunks(req), self.engine.is_healthy):
            yield chunk

    async def _chunks(self, req: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """The request's chunks. Its times (TTFT, end to end) run from here, so a remote prefill counts in them;
        a client that leaves during it is counted as an abort."""
        arrival = time.monotonic()
        try:
            self.engine.engine.validate(req.prompt_token_ids, req.params)
        except InvalidRequestError as exc:
            yield GenerateChunk.invalid(exc)
            return
        if self._prefill is not None and self.engine.is_healthy():
            try:
                await self._prefill_remotely(req)
            except asyncio.CancelledError:
                self._record_finished(arrival, "abort")
                raise
        async for chunk in self._stream(req, arrival):
            yield chunk

    @staticmethod
    async def _await_acceptance(response: DeploymentResponse, timeout_s: float) -> None:
        """Returns once a prefill replica accepted the call; `asyncio.TimeoutError` after `timeout_s`.

        Serve's router holds a call until some replica has room, and with no replica running it waits for one
        to start: after a prefill replica died, long prompts waited out the whole `prefill_timeout_s` here,
        holding every decode slot while short prompts and health probes queued behind them.
        """
        try:
            await asyncio.wait_for(response._to_object_ref(), timeout_s)  # resolves once a replica accepts it
        except asyncio.TimeoutError:
            raise asyncio.TimeoutError(f"no prefill replica accepted the request within {timeout_s:g} s") from None

    async def _prefill_remotely(self, req: GenerateRequest) -> None:
        """Lands the prompt's KV computed by a prefill replica; on any failure leaves it to local prefill."""
        ids = req.prompt_token_ids
        # The export starts after what the GPU holds; whether to ask for one at all counts what admission
        # reuses, the host tier's continuation too (never less than the GPU's): under pressure a conversation's
        # older pages live on the host, and its next turn only adds a little.
        held, reused = await self.engine.run_in_engine(
            lambda e: (cached_prefix_tokens(e, ids), e.kv.reusable_prefix_tokens(ids)))
        reusable = (len(ids) - 1) // self._reuse_unit * self._reuse_unit
        if reusable - reused < self._min_transfer_tokens:
            self.counters["local_prefills"] += 1
            return
        started = time.monotonic()
        disagg = self._config.disagg
        response = self._prefill.prefill.remote(PrefillRequest(req.request_id, ids, held))
        try:
            await self._await_acceptance(response, min(disagg.prefill_accept_timeout_s, disagg.prefill_timeout_s))
            timeout = disagg.prefill_timeout_s
            handle = await asyncio.wait_for(response, max(timeout - (time.monotonic() - started), 1.0))
            if handle.num_pages == 0:
                logger.info("%s: the prefill replica exported no pages; prefilling locally", req.request_id)
                self.counters["empty_exports"] += 1
                return
            export = await fetch(handle, max(timeout - (time.monotonic() - started), 1.0))
            await asyncio.to_thread(export.verify, self._config.model_id, self.engine.engine.layout, ids)
            landing = await self.engine.run_in_engine(lambda e: land_prefix(e, ids, export))
        except asyncio.CancelledError:
            response.cancel()
            raise
        except (RayError, RayServeException, TransferFailed, ValueError, OutOfPages, asyncio.TimeoutError) as exc:
            response.cancel()
            logger.warning("%s: remote prefill failed, prefilling locally: %r", req.request_id, exc)
            self.counters["transfer_fallbacks"] += 1
            self.metrics.transfer("fallback")
            return
        self.counters["remote_prefills"] += 1
        self.counters["imported_tokens"] += landing.imported_tokens
        self.counters[f"imported_tokens_{landing.tier}"] += landing.imported_tokens
        self.counters["imported_bytes"] += export.num_bytes
        self.metrics.transfer("imported", landing.imported_tokens, export.num_bytes, time.monotonic() - started)
