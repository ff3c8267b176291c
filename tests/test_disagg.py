"""KV export and landing between two engines in one process: what a prefill replica exports, a decode replica lands.

Checks that landed pages give the decode engine exactly the tokens it would
compute itself, on GPU pages or from the host pool when the GPU pool is short,
that only pages the receiver lacks travel, and that every way an export can be
wrong (model, layout, prompt, bytes, evicted head) is refused before a byte lands.
An export with no pages left to send is a normal outcome: it verifies, lands
nothing, and the decode replica neither fails nor counts a fallback.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from app.config import AppConfig
from app.decode import DecodeServer
from app.messages import GenerateRequest, PrefillRequest
from disagg.host_tier import KVHandle
from disagg.kv_export import ExportMismatch, KVExport, export_snapshot
from disagg.landing import cached_prefix_tokens, land_prefix
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.prefix_transfer import snapshot_prefix
from engine.request import SamplingParams
from residency.config import HiSparseConfig
from tests.helpers import assert_pages_released, greedy, make_engine

MODEL_ID = "glm-tiny"
PAGE = 576  # indexer page of the tiny model: the unit of prefix reuse and transfer


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 380, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill_and_export(engine: LLMEngine, ids: list[int], start_tokens: int = 0) -> KVExport:
    engine.generate([ids], [SamplingParams(max_tokens=1, ignore_eos=True)])
    snap = snapshot_prefix(engine.kv, engine.runner.executor, ids)
    return export_snapshot(snap, MODEL_ID, engine.layout, ids, start_tokens)


@pytest.fixture(scope="module")
def engines(tiny_dir: Path) -> tuple[LLMEngine, LLMEngine]:
    return make_engine(tiny_dir, num_gpu_pages=64), make_engine(tiny_dir, num_gpu_pages=64)


def test_landed_prefix_decodes_like_local_prefill(engines: tuple[LLMEngine, LLMEngine], tiny_dir: Path) -> None:
    prefill, decode = engines
    ids = _prompt(2 * PAGE + 100, seed=1)
    export = _prefill_and_export(prefill, ids)
    assert (export.start_tokens, export.num_tokens) == (0, 2 * PAGE)
    export.verify(MODEL_ID, decode.layout, ids)
    landing = land_prefix(decode, ids, export)
    assert landing == (2 * PAGE, 2 * PAGE, "gpu")
    [out] = decode.generate([ids], [greedy(12)])
    assert out.num_cached_tokens == 2 * PAGE
    [reference] = make_engine(tiny_dir, num_gpu_pages=64).generate([ids], [greedy(12)])
    assert out.token_ids == reference.token_ids
    assert_pages_released(decode)


def test_only_pages_the_receiver_lacks_travel(engines: tuple[LLMEngine, LLMEngine]) -> None:
    prefill, decode = engines
    head = _prompt(PAGE + 10, seed=2)
    decode.generate([head], [greedy(1)])  # the decode replica now caches one indexer page of this conversation
    ids = head + _prompt(2 * PAGE, seed=3)
    held = cached_prefix_tokens(decode, ids)
    assert held == PAGE
    export = _prefill_and_export(prefill, ids, start_tokens=held)
    assert export.start_tokens == PAGE and export.num_tokens == 3 * PAGE
    assert export.indexer.shape[0] == 2 and export.mla.shape[0] == 2 * PAGE // 64
    landing = land_prefix(decode, ids, export)
    assert landing == (3 * PAGE, 2 * PAGE, "gpu")
    [out] = decode.generate([ids], [greedy(4)])
    assert out.num_cached_tokens == 3 * PAGE
    assert_pages_released(decode)


@pytest.mark.parametrize("damage", ["model", "layout", "prompt", "bytes"])
def test_wrong_exports_are_refused(engines: tuple[LLMEngine, LLMEngine], damage: str) -> None:
    prefill, decode = engines
    ids = _prompt(PAGE + 50, seed=4)
    export = _prefill_and_export(prefill, ids)
    if damage == "model":
        export = dataclasses.replace(export, model_id="other")
    elif damage == "layout":
        export = dataclasses.replace(export, layout={**export.layout, "page_size": 32})
    elif damage == "prompt":
        ids = ids[:10] + [ids[10] + 1] + ids[11:]
    else:
        mla = export.mla.copy()
        mla[0, 0] ^= 0xFF
        export = dataclasses.replace(export, mla=mla)
    with pytest.raises(ExportMismatch):
        export.verify(MODEL_ID, decode.layout, ids)


def test_evicted_head_lands_nothing(tiny_dir: Path, engines: tuple[LLMEngine, LLMEngine]) -> None:
    prefill, _ = engines
    decode = make_engine(tiny_dir, num_gpu_pages=64)
    ids = _prompt(2 * PAGE + 10, seed=5)
    export = _prefill_and_export(prefill, ids, start_tokens=PAGE)  # claims the receiver held the first page
    assert land_prefix(decode, ids, export) == (0, 0, "none")
    assert decode.kv.cache.num_cached == 0


def test_landing_stops_where_the_pool_is_full(tiny_dir: Path, engines: tuple[LLMEngine, LLMEngine]) -> None:
    prefill, _ = engines
    decode = make_engine(tiny_dir, num_gpu_pages=12)  # one indexer page group (9 MLA + 1 indexer) fits, not two
    ids = _prompt(2 * PAGE + 10, seed=6)
    export = _prefill_and_export(prefill, ids)
    assert land_prefix(decode, ids, export) == (PAGE, PAGE, "gpu")
    decode.kv.check_integrity()


def test_short_gpu_pool_lands_on_host_and_the_request_starts_non_resident(
    tiny_dir: Path, engines: tuple[LLMEngine, LLMEngine]
) -> None:
    prefill, _ = engines
    hybrid = HiSparseConfig(policy="hybrid", host_pool_gib=0.05)
    decode = make_engine(tiny_dir, num_gpu_pages=24, hisparse=hybrid)
    decode.add_request("busy", _prompt(600, seed=9), greedy(100))
    decode.step()  # a running request holds half the pool
    ids = _prompt(2 * PAGE + 10, seed=8)
    export = _prefill_and_export(prefill, ids)
    assert export.num_pages > decode.kv.num_available  # 2 groups = 20 pages: not on the GPU now
    assert land_prefix(decode, ids, export) == (2 * PAGE, 2 * PAGE, "host")
    decode.abort_request("busy")
    assert decode.residency.host.cache.num_cached >= export.num_pages
    decode.residency.host.check_integrity()
    [out] = decode.generate([ids], [greedy(8)])
    assert out.num_cached_tokens == 2 * PAGE
    assert decode.stats()["requests_by_state"]["none"]["peak"] == 1
    [reference] = make_engine(tiny_dir, num_gpu_pages=64).generate([ids], [greedy(8)])
    assert out.token_ids == reference.token_ids
    assert_pages_released(decode)


def test_export_arrays_are_plain_numpy(engines: tuple[LLMEngine, LLMEngine]) -> None:
    prefill, _ = engines
    ids = _prompt(PAGE + 5, seed=7)
    export = _prefill_and_export(prefill, ids)
    assert isinstance(export.mla, np.ndarray) and export.mla.dtype == np.uint8
    assert export.num_bytes == export.num_pages * prefill.layout.page_bytes


@pytest.mark.parametrize("start_tokens", [PAGE, PAGE + 40, 3 * PAGE])
def test_export_with_nothing_past_the_start_lands_nothing(
    tiny_dir: Path, engines: tuple[LLMEngine, LLMEngine], start_tokens: int
) -> None:
    prefill, _ = engines
    decode = make_engine(tiny_dir, num_gpu_pages=64)
    ids = _prompt(PAGE + 50, seed=10)
    decode.generate([ids], [greedy(1)])  # the decode replica holds the one whole indexer page already
    export = _prefill_and_export(prefill, ids, start_tokens=start_tokens)
    assert (export.start_tokens, export.num_tokens, export.num_pages, export.num_bytes) == (PAGE, PAGE, 0, 0)
    export.verify(MODEL_ID, decode.layout, ids)
    cached = decode.kv.cache.num_cached
    assert land_prefix(decode, ids, export) == (PAGE, 0, "gpu")
    assert decode.kv.cache.num_cached == cached
    assert_pages_released(decode)


def test_export_of_an_empty_snapshot_lands_nothing(tiny_dir: Path, engines: tuple[LLMEngine, LLMEngine]) -> None:
    prefill, _ = engines
    decode = make_engine(tiny_dir, num_gpu_pages=64)
    ids = _prompt(PAGE - 1, seed=11)  # shorter than one indexer page: nothing is reusable
    export = _prefill_and_export(prefill, ids)
    assert (export.num_tokens, export.num_pages) == (0, 0)
    export.verify(MODEL_ID, decode.layout, ids)
    assert land_prefix(decode, ids, export) == (0, 0, "gpu")
    assert decode.kv.cache.num_cached == 0
    [out] = decode.generate([ids], [greedy(3)])
    assert len(out.token_ids) == 3


class _EmptyExportPrefill:
    """A prefill deployment whose replica had no page to export past what the decode replica holds."""

    def __init__(self) -> None:
        self.prefill = self  # `handle.prefill.remote(...)`
        self.requests: list[PrefillRequest] = []

    def remote(self, req: PrefillRequest) -> asyncio.Future:
        self.requests.append(req)
        response = asyncio.get_running_loop().create_future()
        # The ref is never read: a handle with no pages has nothing to fetch.
        response.set_result(KVHandle(None, req.start_tokens, req.start_tokens, num_pages=0, num_bytes=0))
        return response


class _TransferLog:
    def __init__(self) -> None:
        self.outcomes: list[str] = []

    def transfer(self, outcome: str, *args: object) -> None:
        self.outcomes.append(outcome)


def test_decode_takes_an_empty_export_as_nothing_to_import(tiny_dir: Path) -> None:
    async def run() -> tuple[collections.Counter, list[str], list[PrefillRequest]]:
        server = object.__new__(DecodeServer)  # the replica's state without Serve
        server._config = AppConfig.from_args({"model": {"path": str(tiny_dir)}})
        server.engine = AsyncEngine(EngineConfig(model=str(tiny_dir), num_gpu_pages=64))
        server.counters, server.metrics = collections.Counter(), _TransferLog()
        server._prefill = _EmptyExportPrefill()
        server._min_transfer_tokens = server._reuse_unit = PAGE
        try:
            await server._prefill_remotely(GenerateRequest("r1", _prompt(2 * PAGE + 10, seed=12), greedy(2)))
        finally:
            server.engine.shutdown()
        return server.counters, server.metrics.outcomes, server._prefill.requests

    counters, outcomes, requests = asyncio.run(run())
    assert [r.start_tokens for r in requests] == [0]
    assert counters["transfer_fallbacks"] == 0 and counters["imported_tokens"] == 0
    assert counters["empty_exports"] == 1
    assert outcomes == []
