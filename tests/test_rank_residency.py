"""A rank's resolve of an extend's rows (CPU): every selected host-only position reads its host bytes.

An extend's rows select overlapping positions; the rank resolves their union once, in
fixed-width pieces, with the union's size never read on the host. Forcing tiny pieces
makes a union span many of them.
"""

import random
from pathlib import Path

import pytest
import torch

from engine.kv_layout import KVLayout
from engine.model_config import ModelConfig
from kernels.resolve import one_chunk_rows
from residency import rank as rank_residency
from residency.hot_buffer import HotTables
from residency.rank import TALLY_SIZE, NonResidentSpec, RankResidency, counts_of
from residency.stats import ResolveCounts

PAGE = 64


def _rank_residency(layout: KVLayout, pool: torch.Tensor, host: torch.Tensor) -> RankResidency:
    return RankResidency(layout.group_offsets, layout.group_run_bytes, pool, host)


def _take_counts(residency: RankResidency) -> ResolveCounts:
    """The resolve counts since the last read, as a step reads them."""
    return counts_of(residency.counts_into(torch.empty(TALLY_SIZE, dtype=torch.long)).tolist())


def group_runs(pool: torch.Tensor, layout: KVLayout, group: int) -> torch.Tensor:
    offset, run = layout.group_offset(group), layout.group_run_bytes[group]
    return pool[:, offset : offset + PAGE * run].unflatten(1, (PAGE, run))


@pytest.mark.parametrize("piece", [4096, 16])
def test_extend_rows_read_the_host_bytes_of_their_selection(tiny_dir: Path, piece: int, monkeypatch) -> None:
    monkeypatch.setattr(rank_residency, "_UNION_PIECE", piece)
    check_extend_rows(tiny_dir, piece, torch.device("cpu"))


def check_extend_rows(tiny_dir: Path, piece: int, device: torch.device) -> None:
    """Nine rows of an extend select overlapping host-only positions: each group resolves their union
    (in pieces of `_UNION_PIECE`), every selected host-only row reads its host bytes, resident rows keep
    their slots, and the union is loaded once (repeats are hits). On the GPU through the kernels."""
    layout = KVLayout.for_model(ModelConfig.from_dir(tiny_dir), "bf16")
    rng = random.Random(piece)
    num_tokens = 10 * PAGE
    gen = torch.Generator().manual_seed(0)
    pool = torch.randint(0, 256, (24, layout.page_bytes), dtype=torch.uint8, generator=gen).to(device)
    host = torch.randint(0, 256, (16, layout.page_bytes), dtype=torch.uint8, generator=gen)
    host = host.pin_memory() if device.type == "cuda" else host
    gpu_pages = torch.tensor([-1, 3, -1, -1, 5, -1, -1, -1, 7, 8], dtype=torch.int32)  # tail resident
    host_pages = torch.tensor([15, 2, 9, 4, 0, 11, 6, 13, 1, 3], dtype=torch.int32)
    host_only = [p for p in range(num_tokens) if gpu_pages[p // PAGE] < 0]
    residency = _rank_residency(layout, pool, host)
    residency.open_lease("r", [16, 17, 18, 19, 20, 21, 22, 23][: -(-len(host_only) // PAGE)], num_tokens)
    spec = NonResidentSpec("r", gpu_pages, host_pages, num_tokens)

    k, rows = 24, 9
    positions = torch.zeros(rows, k, dtype=torch.long)
    lens = torch.tensor([rng.randrange(k + 1) for _ in range(rows)])
    for r in range(rows):  # unique within a row, overlapping across rows
        positions[r, : lens[r]] = torch.tensor(rng.sample(range(num_tokens), int(lens[r])))
    for group in range(len(layout.group_sizes)):
        slots = torch.full((rows, k), -5, dtype=torch.long)
        resident = gpu_pages[positions // PAGE] >= 0
        slots[resident] = 1000 + positions[resident]  # what the rows already point at in place
        before = slots.clone()
        on_device = slots.to(device)
        residency.resolve_rows(spec, group, positions.to(device), lens.to(device), step=group + 1, slots=on_device)
        slots = on_device.cpu()
        runs, host_runs = group_runs(pool.cpu(), layout, group), group_runs(host, layout, group)
        for r in range(rows):
            for j in range(k):
                p = int(positions[r, j])
                if j >= lens[r] or gpu_pages[p // PAGE] >= 0:
                    assert slots[r, j] == before[r, j]  # past the count or resident: untouched
                    continue
                slot = int(slots[r, j])
                assert slot // PAGE in range(16, 24)  # a hot slot of the lease
                assert torch.equal(runs[slot // PAGE, slot % PAGE], host_runs[host_pages[p // PAGE], p % PAGE])
    # each group's tables start empty: its union is loaded once, repeats across rows are hits
    chosen = [int(p) for r in range(rows) for p in positions[r, : lens[r]] if gpu_pages[int(p) // PAGE] < 0]
    groups = len(layout.group_sizes)
    counts = _take_counts(residency)
    assert counts.hot_misses == groups * len(set(chosen)) > 0
    assert counts.hot_hits == groups * (len(chosen) - len(set(chosen)))
    assert counts.bytes_h2d == len(set(chosen)) * sum(layout.group_run_bytes)


def test_a_resized_lease_keeps_the_rows_of_the_slots_that_stay(tiny_dir: Path) -> None:
    """An extend grows a request's hot buffer and the decode after it shrinks it back: rows held by
    the slots that stay are hits after the shrink, rows of dropped slots are loaded again, and every
    selected row reads its host bytes."""
    layout = KVLayout.for_model(ModelConfig.from_dir(tiny_dir), "bf16")
    gen = torch.Generator().manual_seed(1)
    pool = torch.randint(0, 256, (24, layout.page_bytes), dtype=torch.uint8, generator=gen)
    host = torch.randint(0, 256, (16, layout.page_bytes), dtype=torch.uint8, generator=gen)
    num_tokens = 10 * PAGE
    gpu_pages = torch.tensor([-1, 3, -1, -1, 5, -1, -1, -1, 7, 8], dtype=torch.int32)
    host_pages = torch.tensor([15, 2, 9, 4, 0, 11, 6, 13, 1, 3], dtype=torch.int32)
    host_only = [p for p in range(num_tokens) if gpu_pages[p // PAGE] < 0]
    order = torch.randperm(len(host_only), generator=gen).tolist()
    held_before, extend_rows = [host_only[i] for i in order[:100]], [host_only[i] for i in order[100:250]]
    residency = _rank_residency(layout, pool, host)
    spec = NonResidentSpec("r", gpu_pages, host_pages, num_tokens)
    groups = len(layout.group_sizes)

    def resolve(selected: list[int], step: int) -> None:
        positions = torch.tensor([selected])
        lens = torch.tensor([len(selected)])
        for group in range(groups):
            slots = torch.full(positions.shape, -5, dtype=torch.long)
            residency.resolve_rows(spec, group, positions, lens, step=step, slots=slots)
            runs, host_runs = group_runs(pool, layout, group), group_runs(host, layout, group)
            for p, slot in zip(selected, slots[0].tolist()):
                assert torch.equal(runs[slot // PAGE, slot % PAGE], host_runs[host_pages[p // PAGE], p % PAGE])

    residency.open_lease("r", [16, 17], num_tokens)  # 128 slots
    resolve(held_before, step=1)
    residency.resize_lease("r", [16, 17, 18, 19], num_tokens)  # the extend's 150 rows need more slots
    resolve(extend_rows, step=2)
    residency.resize_lease("r", [16, 17], num_tokens)  # back to the configured size
    tables = residency.tables["r"]
    for group in range(groups):  # the reverse map and the slots agree, and name only slots that stay
        mapped = (tables.pos_to_hot[group] >= 0).nonzero().flatten()
        assert int(tables.pos_to_hot[group].max()) < 2 * PAGE
        assert torch.equal(tables.slot_pos[group, tables.pos_to_hot[group, mapped].long()], mapped.int())
        assert len(mapped) == int((tables.slot_pos[group] >= 0).sum()) == 2 * PAGE
    dropped = [p for p in extend_rows if tables.pos_to_hot[0, p] < 0]
    assert len(dropped) == 250 - 2 * PAGE
    _take_counts(residency)
    resolve(held_before + dropped[:20], step=3)
    counts = _take_counts(residency)
    assert counts.hot_hits == groups * len(held_before)
    assert counts.hot_misses == groups * 20
    with pytest.raises(ValueError):
        residency.resize_lease("r", [17, 16], num_tokens)  # slots would change places


def test_a_lease_past_one_chunk_is_wide(tiny_dir: Path) -> None:
    """A captured step compiles the resolve plan for leases of one chunk of slots unless a lease of the step is
    wider: the configured 2 x top-K lease (4,096 slots for GLM-5.3) is not, an extend's grown lease is."""
    layout = KVLayout.for_model(ModelConfig.from_dir(tiny_dir), "bf16")
    pool = torch.zeros(80, layout.page_bytes, dtype=torch.uint8)
    residency = _rank_residency(layout, pool, torch.zeros(4, layout.page_bytes, dtype=torch.uint8))
    one_chunk_pages = one_chunk_rows() // PAGE
    residency.open_lease("a", range(one_chunk_pages), 8 * PAGE)
    residency.open_lease("b", [one_chunk_pages], 8 * PAGE)
    specs = [NonResidentSpec(rid, torch.full((8,), -1, dtype=torch.int32), torch.arange(8, dtype=torch.int32), 8 * PAGE)
             for rid in ("a", "b")]
    assert not residency.wide_leases(specs) and not residency.wide_leases([])
    residency.resize_lease("a", range(one_chunk_pages + 1), 8 * PAGE)  # an extend grows it past one chunk
    assert residency.wide_leases(specs) and not residency.wide_leases(specs[1:])


def test_hot_tables_grown_in_a_forward_are_resized_outside_one() -> None:
    """A speculative step grows a request's reverse map inside the forward (inference mode); the scheduler then
    shrinks the lease outside it. A table made in inference mode refused that in-place update, and the
    engine loop died (2+ drafts under hybrid pressure, through the served app). Every table stays an ordinary
    tensor, and both sides may update it."""
    with torch.inference_mode():
        tables = HotTables.new((1, 2), 2, 100, torch.device("cpu"))
        tables.ensure_capacity(1000)
        tables.resize((1, 2, 3), 1000)  # a verifying step's union of selections needs more slots
        tables.pos_to_hot[0, 900] = 150
    assert not any(t.is_inference() for t in (tables.hot_slots, tables.slot_pos, tables.slot_stamp, tables.pos_to_hot))
    tables.resize((1,), 1000)  # back to the decode lease: slot 150 is gone
    assert tables.pos_to_hot[0, 900] == -1 and tables.slot_pos.shape == (2, 64)
    with torch.inference_mode():
        tables.lease(0).pos_to_hot[5] = 3  # the resolve updates the tables in place during the forward
    assert tables.pos_to_hot[0, 5] == 3
