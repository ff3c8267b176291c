"""A full layer's slots of its chosen positions (`kernels/page_slots.py`) under the Triton interpreter: the
PyTorch form's slots for every row's request, in int32 and int64, over a partial second block of columns,
with strided positions and int32 / int64 tables."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.page_slots import page_slots, page_slots_ref  # noqa: E402


@pytest.mark.parametrize("table_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("out_dtype", [torch.int64, torch.int32])
def test_page_slots_are_the_pytorch_forms(table_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    page, pages = 64, 40
    table = torch.randperm(3 * pages, generator=gen).view(3, pages).to(table_dtype)
    req_of_row = torch.tensor([2, 0, 0, 1, 2])
    contexts = torch.tensor([2500, 300, 300, 1, 2560])[:, None]  # a one-token context: its page 0 only
    wide = (torch.rand(5, 2 * 1100, generator=gen) * contexts).long()  # 1,100 columns: two blocks, one partial
    positions = wide[:, ::2]  # strided rows and columns
    got = page_slots(table, req_of_row, positions, page, out_dtype)
    want = page_slots_ref(table, req_of_row, positions, page, out_dtype)
    assert got.dtype == out_dtype and torch.equal(got, want)
    assert torch.equal(got.long() // page, table[req_of_row].long().gather(1, positions // page))


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError):
        page_slots(torch.zeros(2, 4, dtype=torch.long), torch.zeros(3, dtype=torch.long),
                   torch.zeros(2, 8, dtype=torch.long), 64)
    with pytest.raises(ValueError):
        page_slots(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                   torch.zeros(2, 8, dtype=torch.long), 64, torch.float32)
