"""Page tables travel to the ranks as changes to the last step's rows (engine/page_tables.py): whatever the
requests' pages do between steps (grow, get demoted to host-only, gain host copies, come back, leave a step and
return, a launch fails), the tables and the non-resident page lists a rank rebuilds equal those built whole from
the requests."""

from __future__ import annotations

import numpy as np

from engine.page_tables import PageTableSender, PageTableStore
from engine.request import Request, SamplingParams


def whole(reqs: list[Request]) -> tuple[np.ndarray, np.ndarray]:
    """The tables built whole, as the driver used to send them (host-only pages read as page 0)."""
    out = []
    for attr in ("mla_pages", "indexer_pages"):
        rows = [[0 if p is None else p for p in getattr(r, attr)] for r in reqs]
        table = np.zeros((len(rows), max([1] + [len(x) for x in rows])), dtype=np.int32)
        for i, x in enumerate(rows):
            table[i, : len(x)] = x
        out.append(table)
    return out[0], out[1]


def check(sender: PageTableSender, store: PageTableStore, reqs: list[Request]) -> list:
    rows = sender.rows(reqs)
    mla, idx = store.apply(rows)
    want_mla, want_idx = whole(reqs)
    assert np.array_equal(mla.numpy(), want_mla) and np.array_equal(idx.numpy(), want_idx)
    for r in reqs:  # the resolve's lists: -1 where a page is absent
        spec = store.nonresident(r.request_id, 5)
        assert spec.gpu_pages.tolist() == [-1 if p is None else p for p in r.mla_pages]
        assert spec.host_pages.tolist() == [-1 if p is None else p for p in r.host_pages]
    return rows


def test_rows_grow_move_leave_and_return():
    a, b, c = (Request(request_id=n, prompt_token_ids=[1], params=SamplingParams()) for n in "abc")
    sender, store = PageTableSender(), PageTableStore()
    a.mla_pages, a.indexer_pages = [3, 4], [9]
    b.mla_pages, b.indexer_pages = [5], [8]
    first = check(sender, store, [a, b])
    assert all(r.mla_from == 0 for r in first), "new requests are sent whole"
    a.mla_pages.append(6)
    for step in range(40):  # decode: one page now and then; b grows past its row's first capacity
        b.mla_pages.append(100 + step)
        rows = check(sender, store, [a, b])
        assert rows[1].mla_from == len(b.mla_pages) - 1 and len(rows[1].mla) == 1, "only the new page is sent"
    a.host_pages = [None, None, None]  # aligned: no host copies yet
    check(sender, store, [a, b])
    a.host_pages[1], a.host_pages[2] = 41, 42  # host copies complete
    a.pages_changed_at(1)
    a.pages_changed_at(2)
    a.mla_pages[2] = None  # demoted: its third page is host-only now
    a.pages_changed_at(2)
    rows = check(sender, store, [a, b])
    assert (rows[0].mla_from, rows[0].host_from) == (1, 1) and rows[1].mla_from == len(b.mla_pages)
    b.host_pages = list(range(len(b.mla_pages)))  # b's host copies arrive in one step (appended)
    rows = check(sender, store, [a, b])
    assert rows[0].mla_from == len(a.mla_pages) and rows[1].host_from == 0
    check(sender, store, [b])  # a waits a step: the ranks forget it
    c.mla_pages, c.indexer_pages = [7], [1]
    rows = check(sender, store, [c, a, b])
    assert rows[1].mla_from == 0, "a request back after a step away is sent whole"
    a.mla_pages, a.indexer_pages = [], []  # preempted and freed, then re-admitted with other pages
    a.pages_replaced_from(0)
    a.mla_pages, a.indexer_pages = [11, 12], [13]
    check(sender, store, [a, b, c])


def test_a_failed_launch_sends_every_row_whole_next():
    a = Request(request_id="a", prompt_token_ids=[1], params=SamplingParams())
    a.mla_pages, a.indexer_pages = [1, 2], [3]
    sender, store = PageTableSender(), PageTableStore()
    check(sender, store, [a])
    a.mla_pages.append(4)
    sender.rows([a])  # built, but the ranks never applied it
    sender.reset()
    a.mla_pages.append(5)
    rows = check(sender, store, [a])
    assert rows[0].mla_from == 0
