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
from engine.parallel import rank_residency
from engine.parallel.rank_residency import RankResidency
from engine.parallel.step import NonResidentSpec

PAGE = 64


def group_runs(pool: torch.Tensor, layout: KVLayout, group: int) -> torch.Tensor:
    offset, run = layout.group_offset(group), layout.group_run_bytes[group]
    return pool[:, offset : offset + PAGE * run].unflatten(1, (PAGE, run))


@pytest.mark.parametrize("piece", [4096, 16])
def test_extend_rows_read_the_host_bytes_of_their_selection(tiny_dir: Path, piece: int, monkeypatch) -> None:
    monkeypatch.setattr(rank_residency, "_UNION_PIECE", piece)
    layout = KVLayout.for_model(ModelConfig.from_dir(tiny_dir), "bf16")
    rng = random.Random(piece)
    num_tokens = 10 * PAGE
    gen = torch.Generator().manual_seed(0)
    pool = torch.randint(0, 256, (24, layout.page_bytes), dtype=torch.uint8, generator=gen)
    host = torch.randint(0, 256, (16, layout.page_bytes), dtype=torch.uint8, generator=gen)
    gpu_pages = torch.tensor([-1, 3, -1, -1, 5, -1, -1, -1, 7, 8], dtype=torch.int32)  # tail resident
    host_pages = torch.tensor([15, 2, 9, 4, 0, 11, 6, 13, 1, 3], dtype=torch.int32)
    host_only = [p for p in range(num_tokens) if gpu_pages[p // PAGE] < 0]
    residency = RankResidency(layout, pool, host)
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
        residency.resolve_rows(spec, group, positions, lens, step=group + 1, slots=slots)
        runs, host_runs = group_runs(pool, layout, group), group_runs(host, layout, group)
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
    counts = residency.take_counts()
    assert counts.hot_misses == groups * len(set(chosen)) > 0
    assert counts.hot_hits == groups * (len(chosen) - len(set(chosen)))
    assert counts.bytes_h2d == len(set(chosen)) * sum(layout.group_run_bytes)
