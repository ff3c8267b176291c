"""An engine replica: one `AsyncEngine` with its health check, metrics, counters and drain.

Base of `PrefillServer` and `DecodeServer`. Serve builds it on the replica; the
engine (and its thread) is created off the event loop in `__init__`. A periodic
task copies the engine's stats into the replica's metrics. `check_health` fails
once the engine loop has died, so Serve replaces the replica. On shutdown Serve
first drains the replica's ongoing requests, then calls `__del__`, which waits
for the engine to go idle and stops its thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from ray.exceptions import RayActorError, RayError

from app.config import AppConfig
from app.logs import log_cancellations_briefly, route_app_logs
from app.messages import GenerateChunk, GenerateRequest
from app.metrics import RESIDENCY_STATES, ReplicaMetrics
from engine.async_engine import AsyncEngine, EngineDeadError, RequestCancelledError, RequestFailedError
from engine.llm_engine import LLMEngine
from engine.request import InvalidRequestError
from residency.manager import ResidencyManager

logger = logging.getLogger(__name__)

# Bound on waiting for the engine thread to answer a stats call (it answers between steps).
_STATS_TIMEOUT_S = 30.0
# How often a stream asks whether its caller's actor is alive (a ping to the ingress replica).
CALLER_CHECK_S = 5.0
_DRAIN_TIMEOUT_S = 30.0


def _engine_stats(engine: LLMEngine) -> dict[str, Any]:
    """`LLMEngine.stats()` plus the requests in each residency state now (the engine's own are per-step peaks)."""
    stats = engine.stats()
    scheduler = engine.scheduler
    states = dict.fromkeys(RESIDENCY_STATES, 0)
    states["waiting"], states["swapped"] = len(scheduler.waiting), len(scheduler.swapped)
    for req in scheduler.running:
        states[ResidencyManager.state(req)] += 1
    stats.update(requests_now=states, swapped=len(scheduler.swapped))
    return stats


class EngineServer:
    """Owns the replica's engine; subclasses add the prefill or decode verbs."""

    role: Literal["decode", "prefill"]

    async def __init__(self, config: AppConfig) -> None:
        route_app_logs()
        log_cancellations_briefly(asyncio.get_running_loop())
        self._config = config
        self.engine = await asyncio.to_thread(AsyncEngine, config.engine_config(self.role))
        self.metrics = ReplicaMetrics(config.model_id, self.role)
        # Transfer and request counts of this replica, returned by `stats()` next to the engine's.
        self.counters: collections.Counter[str] = collections.Counter()
        self._stats_task = asyncio.get_running_loop().create_task(self._publish_stats())
        logger.info("%s replica serving %s from %s", self.role, config.model_id, config.model.path)

    async def check_health(self) -> None:
        """Serve's health probe: fails once the engine loop has stopped."""
        if not self.engine.is_healthy():
            raise RuntimeError(f"the engine loop is not running: {self.engine.error!r}")

    async def stats(self) -> dict[str, Any]:
        """The engine's page and request figures plus this replica's counters."""
        engine_stats = await asyncio.wait_for(self.engine.run_in_engine(_engine_stats), _STATS_TIMEOUT_S)
        return {**engine_stats, **self.counters}

    async def _publish_stats(self) -> None:
        while self.engine.is_healthy():
            try:
                self.metrics.update_engine(await self.stats())
            except EngineDeadError:  # stopped between the check and the call: the loop ends
                return
            except Exception:  # noqa: BLE001 - a metrics failure must not end the replica's metrics for good
                logger.exception("updating engine metrics failed")
            await asyncio.sleep(self._config.metrics_interval_s)

    def _record_finished(self, arrival: float, reason: str, first_token_at: float | None = None,
                         prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        """Counts one request that ended after it reached this replica: finished, failed or aborted, before its
        first token too (a client that leaves during its remote prefill). Times run from `arrival`."""
        self.counters[f"finished_{reason}"] += 1
        ttft = None if first_token_at is None else first_token_at - arrival
        self.metrics.request_finished(prompt_tokens, output_tokens, ttft, time.monotonic() - arrival, reason)

    async def _stream(self, req: GenerateRequest, arrival: float) -> AsyncIterator[GenerateChunk]:
        """Runs `req` on the local engine; refusals become one refusal chunk, metrics are recorded at the end,
        its times from `arrival` (when the replica received it).

        A request the engine ended on its own error gets a 500 chunk (counted as
        `finished_error`) while this replica stays healthy; a dead engine gets 503. A refusal is not counted as
        a finished request.
        """
        first_token_at: float | None = None
        refused = False
        prompt_tokens = output_tokens = 0
        reason = "abort"
        watch = None if req.caller is None else asyncio.get_running_loop().create_task(self._watch_caller(req))
        try:
            outputs = self.engine.generate(req.prompt_token_ids, req.params, req.request_id)
            async with contextlib.aclosing(outputs):  # leaving early aborts the request now, not at collection
                async for output in outputs:
                    if first_token_at is None:
                        first_token_at = time.monotonic()
                    prompt_tokens, output_tokens = output.num_prompt_tokens, output.num_output_tokens
                    reason = output.finish_reason or reason
                    yield GenerateChunk.of(output)
        except InvalidRequestError as exc:
            refused = True
            yield GenerateChunk.invalid(exc)
            return
        except RequestFailedError as exc:
            reason = "error"
            yield GenerateChunk.refusal(500, f"the request failed: {exc}")
            return
        except EngineDeadError as exc:
            yield GenerateChunk.refusal(503, f"the engine of this replica stopped: {exc}")
            return
        except RequestCancelledError:  # its caller is gone: nobody to tell
            return
        finally:
            if watch is not None:
                watch.cancel()
            if not refused:
                self._record_finished(arrival, reason, first_token_at, prompt_tokens, output_tokens)

    async def _watch_caller(self, req: GenerateRequest) -> None:
        """Ends `req` once its caller's actor is gone. A caller that dies (an ingress replica killed or out of
        memory) never cancels its call, and Ray does not either: the request ran to `max_tokens`, holding its
        slot and pages, for nobody. A caller too busy to answer in time is taken as alive."""
        while True:
            await asyncio.sleep(CALLER_CHECK_S)
            try:
                await asyncio.wait_for(req.caller.__ray_ready__.remote(), CALLER_CHECK_S)
            except RayActorError:
                logger.info("%s: its caller is gone; ending it", req.request_id)
                self.engine.cancel(req.request_id, "the caller of this request is gone")
                return
            except (asyncio.TimeoutError, RayError):
                continue

    def __del__(self) -> None:
        """Serve's shutdown hook (after its own drain): let the engine go idle, then stop it."""
        engine: AsyncEngine | None = getattr(self, "engine", None)
        if engine is None:
            return
        task = getattr(self, "_stats_task", None)
        if task is not None:
            task.cancel()
        if engine.is_healthy() and not engine.wait_idle(_DRAIN_TIMEOUT_S):
            logger.warning("engine still busy after %.0fs; stopping it", _DRAIN_TIMEOUT_S)
        engine.shutdown()
