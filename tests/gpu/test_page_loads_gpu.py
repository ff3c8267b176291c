"""Page loads (promotion, swap-in, host prefix reuse) on the GPU: the copies queue behind the work already on the
compute stream and the call returns at once, so a step that loads pages does not stall the next step's
preparation; the pages land whole, after what the stream ran before them, and `wait_for_loads` is what a CPU
writer of the host pool waits on."""

from __future__ import annotations

import torch

from residency.rank import RankResidency

_PAGE_BYTES = 8192
_LONG_KERNEL_CYCLES = 500_000_000  # about a quarter of a second: far longer than queueing a load


def test_load_queues_behind_the_stream_and_lands_whole_pages() -> None:
    dev = torch.device("cuda")
    pool = torch.zeros(16, _PAGE_BYTES, dtype=torch.uint8, device=dev)
    host = torch.randint(0, 256, (12, _PAGE_BYTES), dtype=torch.uint8).pin_memory()
    rank = RankResidency([0], [64], pool, host)
    torch.cuda._sleep(_LONG_KERNEL_CYCLES)  # stands for the forward in flight
    pool.fill_(7)  # written by that forward: the load must land after it
    host_ids, gpu_ids = [3, 4, 5, 9, 0], [0, 1, 7, 2, 3]  # one run of three, then single pages

    event = rank.load(host_ids, gpu_ids)

    assert event is not None and not event.query(), "the load waited for the stream instead of queueing"
    rank.wait_for_loads()
    assert event.query()
    assert torch.equal(pool[gpu_ids].cpu(), host[host_ids])
    untouched = [p for p in range(pool.shape[0]) if p not in gpu_ids]
    assert bool((pool[untouched] == 7).all())


def test_no_load_is_done_already() -> None:
    pool = torch.zeros(2, _PAGE_BYTES, dtype=torch.uint8, device="cuda")
    rank = RankResidency([0], [64], pool, torch.zeros(2, _PAGE_BYTES, dtype=torch.uint8).pin_memory())
    assert rank.load([], []) is None
    rank.wait_for_loads()
