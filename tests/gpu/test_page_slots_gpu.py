"""A full layer's slots of its chosen positions on the GPU at GLM-5.3's top-K width (2,048) and page size:
the PyTorch form's slots, in the int32 the sparse MLA reads and in int64."""

from __future__ import annotations

import pytest
import torch

from kernels.page_slots import page_slots, page_slots_ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_page_slots_match_the_pytorch_form(rows: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    page, pages = 64, 2048  # 128K tokens a request
    table = torch.randperm(16 * pages, device="cuda", generator=gen).view(16, pages)
    req_of_row = torch.randint(0, 16, (rows,), device="cuda", generator=gen)
    positions = torch.randint(0, page * pages, (rows, 2048), device="cuda", generator=gen)
    for dtype in (torch.int32, torch.int64):
        assert torch.equal(page_slots(table, req_of_row, positions, page, dtype),
                           page_slots_ref(table, req_of_row, positions, page, dtype))
