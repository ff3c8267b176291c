"""KV export and landing between two engines in one process: what a prefill replica exports, a decode replica lands.

Checks that landed pages give the decode engine exactly the tokens it would
compute itself, on GPU pages or from the host pool when the GPU pool is short,
that only pages the receiver lacks travel, and that every way an export can be
wrong (format version, columns, model, layout, prompt, bytes, evicted head) is
refused before a byte lands; a refused export leaves the decode replica to
prefill the prompt itself. The export is an Arrow record batch: it round-trips
byte for byte through Arrow IPC and through Ray's object store, and its page
tensors are views of the batch's buffer. An export with no pages left to send
is a normal outcome: it verifies, lands nothing, and the decode replica neither
fails nor counts a fallback.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import re
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import ray
import torch

from app import engine_server, heartbeats
from app.config import AppConfig
from app.decode import DecodeServer
from app.prefill import PrefillServer
from app.messages import GenerateChunk, GenerateRequest, PrefillRequest
from disagg.host_tier import KVHandle, fetch, publish
from disagg.kv_export import FORMAT_VERSION, ExportMismatch, KVExport, export_snapshot, layout_facts
from disagg.landing import cached_prefix_tokens, land_prefix
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.kv_layout import KVLayout
from engine.llm_engine import LLMEngine
from engine.prefix_transfer import PrefixSnapshot, install_prefix, snapshot_prefix
from engine.request import SamplingParams
from residency.config import HiSparseConfig
from tests.helpers import assert_pages_released, greedy, make_engine

MODEL_ID = "glm-tiny"
PAGE = 576  # indexer page of the tiny model: the unit of prefix reuse and transfer
PER_GROUP = PAGE // 64  # MLA pages per indexer page


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 380, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill_and_snapshot(engine: LLMEngine, ids: list[int]) -> PrefixSnapshot:
    engine.generate([ids], [SamplingParams(max_tokens=1, ignore_eos=True)])
    return snapshot_prefix(engine.kv, engine.runner.executor, ids)


def _prefill_and_export(engine: LLMEngine, ids: list[int], start_tokens: int = 0) -> KVExport:
    return export_snapshot(_prefill_and_snapshot(engine, ids), MODEL_ID, engine.layout, ids, start_tokens)


def _with_metadata(export: KVExport, **changes: str) -> pa.RecordBatch:
    """The export's batch with some `hisparse.*` metadata values replaced."""
    meta = {**export.batch.schema.metadata, **{f"hisparse.{k}".encode(): v.encode() for k, v in changes.items()}}
    return export.batch.replace_schema_metadata(meta)


def _through_ipc(batch: pa.RecordBatch) -> tuple[pa.RecordBatch, pa.Buffer]:
    """The batch written as an Arrow IPC stream and read back from that stream's buffer (returned too)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    stream = sink.getvalue()
    return pa.ipc.open_stream(stream).read_next_batch(), stream


@pytest.fixture(scope="module")
def engines(tiny_dir: Path) -> tuple[LLMEngine, LLMEngine]:
    return make_engine(tiny_dir, num_gpu_pages=64), make_engine(tiny_dir, num_gpu_pages=64)


@pytest.fixture(scope="module")
def ray_store() -> Iterator[None]:
    """A local Ray instance for its object store, shut down after the module if this module started it."""
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


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


@pytest.mark.parametrize("damage, message", [
    ("model", "export is for model 'other', this replica serves 'glm-tiny'"),
    ("prompt", "export token ids [0, 1152) are not this prompt's"),
    ("head", "export page hashes differ from this prompt's: the tokens before 576 differ"),
])
def test_wrong_exports_are_refused(engines: tuple[LLMEngine, LLMEngine], damage: str, message: str) -> None:
    prefill, decode = engines
    ids = _prompt(2 * PAGE + 50, seed=4)
    export = _prefill_and_export(prefill, ids, start_tokens=PAGE if damage == "head" else 0)
    export.verify(MODEL_ID, decode.layout, ids)  # undamaged, it fits
    if damage == "model":
        export = KVExport(_with_metadata(export, model_id="other"))
    elif damage == "prompt":
        ids = ids[:10] + [ids[10] + 1] + ids[11:]
    elif damage == "head":  # the tokens the export does not carry differ: its chained page hashes tell
        ids = ids[:10] + [ids[10] + 1] + ids[11:]
        assert export.token_ids.tolist() == ids[PAGE : 2 * PAGE]
    with pytest.raises(ExportMismatch, match=re.escape(message)):
        export.verify(MODEL_ID, decode.layout, ids)


def test_export_of_another_row_format_is_refused_naming_the_differences(
    tiny_dir: Path, engines: tuple[LLMEngine, LLMEngine]
) -> None:
    _, decode = engines
    ids = _prompt(PAGE + 50, seed=13)
    export = _prefill_and_export(make_engine(tiny_dir, num_gpu_pages=64, kv_dtype="bf16"), ids)
    differs = ("indexer_key_bytes 64 != 128, kv_format 'bf16' != 'float32', mla_row_bytes 288 != 576, "
               "page_bytes 110592 != 221184")
    with pytest.raises(ExportMismatch, match=re.escape(f"differs from this replica's (export != replica): {differs}")):
        export.verify(MODEL_ID, decode.layout, ids)


@pytest.mark.parametrize("order, message", [
    ("values_then_scales", "indexer_block_order 'values_then_scales' != 'rows'"),
    (None, "indexer_block_order None != 'rows'"),
])
def test_export_of_another_indexer_block_order_is_refused(
    engines: tuple[LLMEngine, LLMEngine], order: str | None, message: str
) -> None:
    """Indexer pages are sent whole, so their bytes mean what the sender's order says: FP8 keys' values then
    scales, or whole rows. An export whose order is not the receiver's (or says none) is refused by name."""
    prefill, decode = engines
    ids = _prompt(PAGE + 50, seed=15)
    export = _prefill_and_export(prefill, ids)
    assert export.layout["indexer_block_order"] == "rows"
    key = b"hisparse.layout.indexer_block_order"
    meta = {k: v for k, v in export.batch.schema.metadata.items() if k != key}
    if order is not None:
        meta[key] = json.dumps(order).encode()
    with pytest.raises(ExportMismatch, match=re.escape(f"(export != replica): {message}")):
        KVExport(export.batch.replace_schema_metadata(meta)).verify(MODEL_ID, decode.layout, ids)


def test_layout_facts_name_the_indexer_block_order(engines: tuple[LLMEngine, LLMEngine]) -> None:
    tiny = engines[0].layout
    for kv_format, order, key_bytes in (("fp8", "values_then_scales", 36), ("bf16", "rows", 64)):
        facts = layout_facts(KVLayout(**{**dataclasses.asdict(tiny), "kv_format": kv_format}))
        assert (facts["indexer_block_order"], facts["indexer_key_bytes"]) == (order, key_bytes)


@pytest.mark.parametrize("damage, message", [
    ("older version", "export format version 1, this replica reads version 3"),
    ("version 2", "export format version 2, this replica reads version 3"),
    ("no version", "export format version None, this replica reads version 3"),
    ("columns", "export columns do not match its own layout"),
    ("rows", "export rows are not whole groups of MLA pages followed by their indexer pages"),
])
def test_exports_of_another_format_are_refused_when_read(
    engines: tuple[LLMEngine, LLMEngine], damage: str, message: str
) -> None:
    prefill, _ = engines
    export = _prefill_and_export(prefill, _prompt(PAGE + 50, seed=14))
    if damage == "older version":
        batch = _with_metadata(export, format_version="1")
    elif damage == "version 2":  # FP8 indexer keys as 132-byte rows
        batch = _with_metadata(export, format_version="2")
    elif damage == "no version":
        batch = export.batch.replace_schema_metadata(
            {k: v for k, v in export.batch.schema.metadata.items() if k != b"hisparse.format_version"})
    elif damage == "columns":  # metadata of another page size over these columns
        batch = _with_metadata(export, **{"layout.page_size": "32"})
    else:  # one MLA page short of a group
        batch = export.batch.slice(1)
    assert KVExport(export.batch).num_pages == PER_GROUP + 1
    with pytest.raises(ExportMismatch, match=re.escape(message)):
        KVExport(batch)


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


def test_cached_pages_of_a_landing_group_count_against_the_room(tiny_dir: Path, engines: tuple[LLMEngine, LLMEngine]
                                                                ) -> None:
    """The receiver holds the export's head and, evictable, four MLA pages of its next group (an earlier prompt
    diverged inside it). Acquiring those takes them out of the room the group's missing pages were checked
    against: the install raised `OutOfPages`, and the pages it had allocated were held by nobody for good."""
    prefill, _ = engines
    head, group = _prompt(PAGE, seed=50), _prompt(PAGE, seed=51)
    ids = head + group + _prompt(10, seed=52)
    decode = make_engine(tiny_dir, num_gpu_pages=24)
    decode.generate([head + group[:256] + _prompt(70, seed=53)], [greedy(1)])
    decode.add_request("busy", _prompt(300, seed=54), greedy(200))
    decode.step()
    held = cached_prefix_tokens(decode, ids)
    export = _prefill_and_export(prefill, ids, start_tokens=held)
    assert held == PAGE and export.num_pages <= decode.kv.num_available  # the GPU path is taken
    assert land_prefix(decode, ids, export) == (PAGE, 0, "gpu")  # the next group does not fit: lands nothing
    decode.abort_request("busy")
    assert_pages_released(decode)


def test_a_prefix_that_would_fill_a_hybrid_pool_lands_on_host(tiny_dir: Path, engines: tuple[LLMEngine, LLMEngine]
                                                              ) -> None:
    """Two indexer groups fit the 20-page pool exactly, but then the rest of the prompt would not: landed on the
    GPU, the prefix left its request waiting for good (nothing else runs to free a page). It lands on host, and
    the request runs from there without computing it again. A prefix already landed so (a local first run, an
    earlier replica state) is given up instead: the request computes it again rather than wait."""
    prefill, _ = engines
    ids = _prompt(2 * PAGE + 417, seed=55)
    export = _prefill_and_export(prefill, ids)
    hybrid = HiSparseConfig(policy="hybrid", host_pool_gib=0.05)
    decode = make_engine(tiny_dir, num_gpu_pages=20, max_model_len=2048, hisparse=hybrid)
    assert export.num_pages == decode.kv.num_available == 20
    assert land_prefix(decode, ids, export) == (2 * PAGE, 2 * PAGE, "host")
    [out] = decode.generate([ids], [greedy(8)])
    assert out.num_cached_tokens == 2 * PAGE
    [reference] = make_engine(tiny_dir, num_gpu_pages=64, max_model_len=2048).generate([ids], [greedy(8)])
    assert out.token_ids == reference.token_ids
    assert_pages_released(decode)

    filled = make_engine(tiny_dir, num_gpu_pages=20, max_model_len=2048, hisparse=hybrid)
    snapshot = _prefill_and_snapshot(prefill, ids)
    assert install_prefix(filled.kv, filled.runner.executor, ids, snapshot) == 2 * PAGE  # the pool is full of it
    filled.add_request("again", ids, greedy(8))
    finished = []
    for _ in range(200):  # it waited for good
        finished += [o for o in filled.step() if o.finished]
        if not filled.has_unfinished():
            break
    [again] = finished
    assert again.num_cached_tokens == 0 and again.token_ids == reference.token_ids
    assert_pages_released(filled)


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


def test_export_schema_and_metadata(engines: tuple[LLMEngine, LLMEngine]) -> None:
    prefill, _ = engines
    ids = _prompt(2 * PAGE + 5, seed=7)
    export = _prefill_and_export(prefill, ids, start_tokens=PAGE)
    page_bytes = prefill.layout.page_bytes
    schema = export.batch.schema
    assert [(f.name, str(f.type), f.nullable) for f in schema] == [
        ("use", "dictionary<values=string, indices=int8, ordered=0>", False),
        ("page_hash", "fixed_size_binary[16]", False),
        ("token_ids", "fixed_size_list<item: int64>[64]", True),
        ("page", f"fixed_size_binary[{page_bytes}]", False),
    ]
    meta = {k.decode(): v.decode() for k, v in schema.metadata.items()}
    assert FORMAT_VERSION == 3
    assert {k: meta.pop(k) for k in ["hisparse.format_version", "hisparse.model_id", "hisparse.start_tokens"]} == {
        "hisparse.format_version": "3", "hisparse.model_id": MODEL_ID, "hisparse.start_tokens": str(PAGE)}
    layout = [meta[f"hisparse.layout.{k}"]
              for k in ("page_size", "page_bytes", "kv_format", "group_sizes", "indexer_block_order")]
    assert layout == ["64", "221184", '"float32"', "[1, 3, 2]", '"rows"']
    assert meta == {f"hisparse.layout.{k}": json.dumps(v) for k, v in layout_facts(prefill.layout).items()}
    assert export.batch.column("use").to_pylist() == ["mla"] * PER_GROUP + ["indexer"]
    tokens = export.batch.column("token_ids")
    assert tokens.null_count == 1 and not tokens[PER_GROUP].is_valid
    assert (export.num_pages, export.num_bytes) == (PER_GROUP + 1, (PER_GROUP + 1) * page_bytes)


def _assert_export_of(export: KVExport, snap: PrefixSnapshot, ids: list[int], start: int, layout: KVLayout) -> None:
    """Every page's bytes, every hash and token id and every metadata value are the snapshot's."""
    first = start // 64
    assert (export.model_id, export.layout, export.start_tokens, export.num_tokens) == (
        MODEL_ID, layout_facts(layout), start, snap.num_tokens)
    assert export.mla.shape[0] == snap.mla.shape[0] - first
    assert export.indexer.shape[0] == snap.indexer.shape[0] - start // PAGE
    for i in range(export.mla.shape[0]):
        assert torch.equal(export.mla[i], snap.mla[first + i]), f"MLA page {first + i}"
    for j in range(export.indexer.shape[0]):
        assert torch.equal(export.indexer[j], snap.indexer[start // PAGE + j]), f"indexer page {start // PAGE + j}"
    assert export.page_hashes == snap.page_hashes[first:]
    assert export.batch.column("page_hash").to_pylist()[len(export.page_hashes) :] == \
        snap.page_hashes[first + PER_GROUP - 1 :: PER_GROUP]
    assert export.token_ids.tolist() == ids[start : snap.num_tokens]


@pytest.mark.parametrize("start_tokens", [0, PAGE])
def test_export_round_trips_through_arrow_ipc(engines: tuple[LLMEngine, LLMEngine], start_tokens: int) -> None:
    prefill, decode = engines
    ids = _prompt(3 * PAGE + 10, seed=17)
    snap = _prefill_and_snapshot(prefill, ids)
    export = export_snapshot(snap, MODEL_ID, prefill.layout, ids, start_tokens)
    assert export.num_pages == (3 - start_tokens // PAGE) * (PER_GROUP + 1)
    batch, _ = _through_ipc(export.batch)
    assert batch.equals(export.batch, check_metadata=True)
    read = KVExport(batch)
    _assert_export_of(read, snap, ids, start_tokens, prefill.layout)
    read.verify(MODEL_ID, decode.layout, ids)


def test_export_round_trips_through_the_object_store_and_lands_read_only(
    tiny_dir: Path, engines: tuple[LLMEngine, LLMEngine], ray_store: None
) -> None:
    prefill, _ = engines
    ids = _prompt(3 * PAGE + 10, seed=18)
    snap = _prefill_and_snapshot(prefill, ids)
    handle = asyncio.run(publish(export_snapshot(snap, MODEL_ID, prefill.layout, ids, PAGE)))
    assert (handle.num_tokens, handle.start_tokens, handle.num_pages) == (3 * PAGE, PAGE, 2 * (PER_GROUP + 1))
    export = asyncio.run(fetch(handle, timeout_s=30))
    _assert_export_of(export, snap, ids, PAGE, prefill.layout)
    buffer = export.batch.column("page").buffers()[1]
    assert not buffer.is_mutable  # object-store memory
    assert export.mla.data_ptr() == buffer.address
    decode = make_engine(tiny_dir, num_gpu_pages=64)
    decode.generate([ids[:PAGE + 1]], [greedy(1)])  # it holds the head the export leaves out
    export.verify(MODEL_ID, decode.layout, ids)
    assert land_prefix(decode, ids, export) == (3 * PAGE, 2 * PAGE, "gpu")
    _assert_export_of(export, snap, ids, PAGE, prefill.layout)  # landing wrote nothing into the export
    [out] = decode.generate([ids], [greedy(4)])
    assert out.num_cached_tokens == 3 * PAGE


def test_page_tensors_are_views_of_the_arrow_buffers(engines: tuple[LLMEngine, LLMEngine]) -> None:
    prefill, _ = engines
    ids = _prompt(2 * PAGE + 5, seed=19)
    snap = _prefill_and_snapshot(prefill, ids)
    export = export_snapshot(snap, MODEL_ID, prefill.layout, ids, 0)
    page_buffer = export.batch.column("page").buffers()[1]
    assert page_buffer.address == snap.mla.data_ptr()  # from token 0 the snapshot's pages are used in place
    batch, stream = _through_ipc(export.batch)
    read = KVExport(batch)
    page_buffer = batch.column("page").buffers()[1]
    assert stream.address <= page_buffer.address
    assert page_buffer.address + page_buffer.size <= stream.address + stream.size  # read in place from the stream
    assert read.mla.data_ptr() == page_buffer.address
    assert read.indexer.data_ptr() == page_buffer.address + 2 * PER_GROUP * prefill.layout.page_bytes
    token_values = batch.column("token_ids").values.buffers()[1]
    assert read.token_ids.ctypes.data == token_values.address


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


class _StubPrefill:
    """A prefill deployment whose replica answers every request with the handle `handle_of` gives."""

    def __init__(self, handle_of: Callable[[PrefillRequest], KVHandle]) -> None:
        self.prefill = self  # `handle.prefill.remote(...)`
        self.handle_of = handle_of
        self.requests: list[PrefillRequest] = []

    def remote(self, req: PrefillRequest) -> _StubResponse:
        self.requests.append(req)
        return _StubResponse(self.handle_of(req))


class _StubResponse:
    """A call the stub's replica accepted at once and answered with `handle`."""

    def __init__(self, handle: KVHandle) -> None:
        self.handle = handle

    async def _to_object_ref(self) -> None:  # accepted: nothing to wait for
        return None

    async def _result(self) -> KVHandle:
        return self.handle

    def __await__(self) -> Generator[Any, None, KVHandle]:
        return self._result().__await__()

    def cancel(self) -> None:
        pass


class _Metrics:
    """Records the replica's transfer outcomes; ignores its request metrics."""

    def __init__(self) -> None:
        self.outcomes: list[str] = []

    def transfer(self, outcome: str, *args: object) -> None:
        self.outcomes.append(outcome)

    def request_finished(self, *args: object) -> None:
        pass


def _decode_replica(tiny_dir: Path, prefill: _StubPrefill | None, num_gpu_pages: int = 64,
                    hisparse: HiSparseConfig | None = None) -> DecodeServer:
    """A decode replica's state without Serve, its prefill deployment `prefill` (None: colocated)."""
    server = object.__new__(DecodeServer)
    server._config = AppConfig.from_args({"model": {"path": str(tiny_dir)}})
    server.engine = AsyncEngine(EngineConfig(model=str(tiny_dir), num_gpu_pages=num_gpu_pages,
                                             hisparse=hisparse or HiSparseConfig()))
    server.counters, server.metrics = collections.Counter(), _Metrics()
    server._prefill = prefill
    server._min_transfer_tokens = server._reuse_unit = PAGE
    return server


def _decode(tiny_dir: Path, prefill: _StubPrefill, req: GenerateRequest, num_gpu_pages: int = 64,
            hisparse: HiSparseConfig | None = None, setup: Callable[[LLMEngine], None] | None = None
            ) -> tuple[DecodeServer, list[GenerateChunk]]:
    """Runs `req` on a decode replica's state (without Serve) whose prefill deployment is `prefill`; `setup`
    runs first on its engine."""

    async def run() -> tuple[DecodeServer, list[GenerateChunk]]:
        server = _decode_replica(tiny_dir, prefill, num_gpu_pages, hisparse)
        try:
            if setup is not None:
                await server.engine.run_in_engine(setup)
            return server, [chunk async for chunk in server.generate(req)]
        finally:
            server.engine.shutdown()

    return asyncio.run(run())


def test_decode_takes_an_empty_export_as_nothing_to_import(tiny_dir: Path) -> None:
    # The ref is never read: a handle with no pages has nothing to fetch.
    prefill = _StubPrefill(lambda req: KVHandle(None, req.start_tokens, req.start_tokens, num_pages=0, num_bytes=0))
    server, chunks = _decode(tiny_dir, prefill, GenerateRequest("r1", _prompt(2 * PAGE + 10, seed=12), greedy(2)))
    assert [r.start_tokens for r in prefill.requests] == [0]
    assert server.counters["transfer_fallbacks"] == 0 and server.counters["imported_tokens"] == 0
    assert server.counters["empty_exports"] == 1
    assert server.metrics.outcomes == []
    assert chunks[-1].finished and chunks[-1].num_output_tokens == 2


def test_decode_prefills_locally_when_the_export_is_of_another_version(
    tiny_dir: Path, engines: tuple[LLMEngine, LLMEngine], ray_store: None
) -> None:
    prefill, _ = engines
    ids = _prompt(2 * PAGE + 10, seed=16)
    export = _prefill_and_export(prefill, ids)
    ref = ray.put(_with_metadata(export, format_version="1"))
    stub = _StubPrefill(lambda req: KVHandle(ref, export.num_tokens, 0, export.num_pages, export.num_bytes))
    server, chunks = _decode(tiny_dir, stub, GenerateRequest("r2", ids, greedy(4)))
    assert len(stub.requests) == 1
    assert server.counters["transfer_fallbacks"] == 1 and server.counters["remote_prefills"] == 0
    assert server.metrics.outcomes == ["fallback"]
    last = chunks[-1]  # served all the same, its prompt computed here
    assert (last.finished, last.error_status, last.num_output_tokens, last.num_cached_tokens) == (True, None, 4, 0)
    [reference] = make_engine(tiny_dir, num_gpu_pages=64).generate([ids], [greedy(4)])
    assert "".join(c.text_delta for c in chunks) == reference.text


class _Unaccepting:
    """A prefill deployment whose calls no replica accepts: its replica died and the replacement is starting."""

    def __init__(self) -> None:
        self.prefill = self  # `handle.prefill.remote(...)`
        self.cancelled = 0

    def remote(self, req: PrefillRequest) -> _Unaccepting:
        return self

    async def _to_object_ref(self) -> None:
        await asyncio.Event().wait()

    def cancel(self) -> None:
        self.cancelled += 1


def test_decode_prefills_locally_when_no_prefill_replica_accepts(tiny_dir: Path, monkeypatch) -> None:
    """Serve's router holds a call no replica can take; a long prompt waited out `prefill_timeout_s` for a dead
    prefill replica's replacement, holding a decode slot, then prefilled locally. It waits only
    `prefill_accept_timeout_s`, and sends heartbeats meanwhile (the replica is busy, not sick)."""
    monkeypatch.setattr(heartbeats, "HEARTBEAT_S", 0.1)
    ids = _prompt(2 * PAGE + 10, seed=17)
    stub = _Unaccepting()

    async def run() -> tuple[DecodeServer, list[GenerateChunk]]:
        server = _decode_replica(tiny_dir, stub)
        server._config = AppConfig.from_args({"model": {"path": str(tiny_dir)},
                                              "disagg": {"prefill_accept_timeout_s": 0.5}})
        try:
            return server, [chunk async for chunk in server.generate(GenerateRequest("r5", ids, greedy(4)))]
        finally:
            server.engine.shutdown()

    server, chunks = asyncio.run(run())
    beats = [i for i, c in enumerate(chunks) if c.heartbeat]
    first_text = next(i for i, c in enumerate(chunks) if not c.heartbeat)
    assert len(beats) >= 3 and beats[0] < first_text
    assert stub.cancelled == 1 and server.counters["transfer_fallbacks"] == 1
    assert server.metrics.outcomes == ["fallback"]
    [reference] = make_engine(tiny_dir, num_gpu_pages=64).generate([ids], [greedy(4)])
    assert "".join(c.text_delta for c in chunks) == reference.text and chunks[-1].finished


def test_decode_reuses_a_prefix_held_on_the_host_without_a_transfer(
    tiny_dir: Path, engines: tuple[LLMEngine, LLMEngine]
) -> None:
    """A conversation's next turn whose earlier pages the decode replica holds only in its host tier (hybrid
    under pressure) adds a few tokens: it is prefilled here, from the host pages, not sent to a prefill
    replica to be computed and moved again whole."""
    prefill, _ = engines
    turn = _prompt(2 * PAGE + 10, seed=21)
    export = _prefill_and_export(prefill, turn)
    next_turn = turn + _prompt(40, seed=22)

    def land_on_host(engine: LLMEngine) -> None:
        assert land_prefix(engine, turn, export).tier == "host"
        assert cached_prefix_tokens(engine, next_turn) == 0  # nothing of it on the GPU
        assert engine.kv.reusable_prefix_tokens(next_turn) == 2 * PAGE

    def refuse(req: PrefillRequest) -> KVHandle:
        raise AssertionError(f"{req.request_id}: a prefix held on the host was sent to the prefill replica")

    stub = _StubPrefill(refuse)
    server, chunks = _decode(tiny_dir, stub, GenerateRequest("r3", next_turn, greedy(4)), num_gpu_pages=16,
                             hisparse=HiSparseConfig(policy="hybrid", host_pool_gib=0.05), setup=land_on_host)
    assert stub.requests == [] and server.counters["local_prefills"] == 1
    last = chunks[-1]
    assert (last.finished, last.error_status, last.num_cached_tokens) == (True, None, 2 * PAGE)
    [reference] = make_engine(tiny_dir, num_gpu_pages=64).generate([next_turn], [greedy(4)])
    assert "".join(c.text_delta for c in chunks) == reference.text


def test_a_prefix_held_partly_on_the_host_is_exported_whole(tiny_dir: Path) -> None:
    """A prefill replica under `hybrid` pressure whose GPU cache lost a prompt's pages keeps their host copies; a
    request for the prompt again runs from those host pages and leaves them there, and the export still covers
    the whole prefix, byte for byte what the GPU pages held (it stopped at the first page missing on the GPU)."""
    engine = make_engine(tiny_dir, num_gpu_pages=24, hisparse=HiSparseConfig(policy="hybrid", host_pool_gib=0.05))
    ids = _prompt(2 * PAGE + 10, seed=40)
    reference = _prefill_and_snapshot(engine, ids)
    assert reference.num_tokens == 2 * PAGE
    for seed in (41, 42):  # other prompts take the GPU pool: the first prompt's cached pages are evicted there
        engine.generate([_prompt(2 * PAGE + 10, seed)], [SamplingParams(max_tokens=1, ignore_eos=True)])
    assert len(engine.kv.lookup_prefix(ids)[1]) < 2 * PER_GROUP
    snap = _prefill_and_snapshot(engine, ids)
    assert len(engine.kv.lookup_prefix(ids)[1]) < 2 * PER_GROUP  # the request ran from the host copies
    assert (snap.num_tokens, snap.page_hashes) == (reference.num_tokens, reference.page_hashes)
    assert torch.equal(snap.mla, reference.mla) and torch.equal(snap.indexer, reference.indexer)
    assert_pages_released(engine)


def _prefill_replica(tiny_dir: Path, num_gpu_pages: int, hisparse: HiSparseConfig | None = None) -> PrefillServer:
    """A prefill replica's state without Serve."""
    server = object.__new__(PrefillServer)
    server._config = AppConfig.from_args({"model": {"path": str(tiny_dir)}})
    server.engine = AsyncEngine(EngineConfig(model=str(tiny_dir), num_gpu_pages=num_gpu_pages,
                                             hisparse=hisparse or HiSparseConfig()))
    server.counters, server.metrics = collections.Counter(), _Metrics()
    return server


def test_a_prompt_larger_than_the_prefill_pool_is_not_computed_there(tiny_dir: Path, ray_store: None) -> None:
    """A prefill replica whose GPU pool cannot hold a prompt's pages would compute it and export nothing it could
    keep, and the decode replica would compute it again: it answers at once with what it holds (nothing here). A
    prompt that fits is computed and exported whole."""
    server = _prefill_replica(tiny_dir, num_gpu_pages=2 * (PER_GROUP + 1))  # two indexer pages' worth

    async def run(ids: list[int]) -> tuple[KVHandle, int]:
        handle = await server.prefill(PrefillRequest("p", ids, 0))
        return handle, await server.engine.run_in_engine(lambda e: e.num_steps)

    try:
        handle, steps = asyncio.run(run(_prompt(3 * PAGE, seed=30)))
        assert (handle.num_pages, steps) == (0, 0)
        assert server.counters["prefills_too_large"] == 1 and server.counters["prefill_computed_tokens"] == 0
        handle, steps = asyncio.run(run(_prompt(PAGE + 10, seed=31)))
        assert handle.num_tokens == PAGE and handle.num_pages == PER_GROUP + 1 and steps > 0
        assert server.counters["prefills"] == 1 and server.counters["prefill_computed_tokens"] == PAGE + 10
    finally:
        server.engine.shutdown()


@ray.remote
class _Caller:
    """Stands in for the ingress replica that calls a decode replica."""

    def ready(self) -> bool:
        return True


def test_a_request_whose_caller_died_is_ended(tiny_dir: Path, ray_store: None, monkeypatch) -> None:
    """A caller that dies (an ingress replica killed) cannot cancel its call: the decode replica, pinging the
    caller's actor, ends the request and frees its pages; a request whose caller lives runs to its end."""
    monkeypatch.setattr(engine_server, "CALLER_CHECK_S", 0.2)
    dying, living = _Caller.remote(), _Caller.remote()
    ray.get([dying.ready.remote(), living.ready.remote()])

    async def run() -> tuple[DecodeServer, list[GenerateChunk], list[GenerateChunk], tuple[bool, int]]:
        server = _decode_replica(tiny_dir, None)
        try:
            orphaned = []
            long = SamplingParams(max_tokens=1500, ignore_eos=True)
            async for chunk in server.generate(GenerateRequest("orphan", _prompt(40, seed=40), long, dying)):
                orphaned.append(chunk)
                if len(orphaned) == 3:
                    ray.kill(dying)
            kept = [c async for c in server.generate(GenerateRequest("kept", _prompt(40, seed=41), greedy(30), living))]
            idle = await server.engine.run_in_engine(lambda e: (e.has_unfinished(), e.kv.num_pages_in_use()))
            return server, orphaned, kept, idle
        finally:
            server.engine.shutdown()

    server, orphaned, kept, idle = asyncio.run(run())
    assert not orphaned[-1].finished and len(orphaned) < 1500
    assert kept[-1].finished and kept[-1].num_output_tokens == 30
    assert idle == (False, 0)
    assert server.counters["finished_abort"] == 1 and server.counters["finished_length"] == 1


@pytest.mark.parametrize("policy", ["off", "offload"])
def test_concurrent_prefills_each_export_their_whole_prompt(tiny_dir: Path, ray_store: None, policy: str) -> None:
    """Prefills that outnumber a small GPU pool run in turns: the pages one leaves cached are the next one's free
    pages. Each export is still whole: it is taken right after the step that ends its prompt, before another
    prompt's step can evict them (taken at the next call into the engine, exports came back empty)."""
    hisparse = HiSparseConfig(policy=policy, host_pool_gib=0.05 if policy != "off" else 0.0)
    server = _prefill_replica(tiny_dir, 3 * (PER_GROUP + 1) + 4, hisparse)  # room for one prompt and a half
    prompts = [_prompt(2 * PAGE + 10, seed=50 + i) for i in range(4)]

    async def run() -> list[KVHandle]:
        return await asyncio.gather(*(server.prefill(PrefillRequest(f"p{i}", ids, 0)) for i, ids in enumerate(prompts)))

    try:
        handles = asyncio.run(run())
        assert [h.num_tokens for h in handles] == [2 * PAGE] * len(prompts)
        assert server.counters["prefills"] == len(prompts)
        assert server.counters["exported_tokens"] == 2 * PAGE * len(prompts)
        assert_pages_released(server.engine.engine)
    finally:
        server.engine.shutdown()
