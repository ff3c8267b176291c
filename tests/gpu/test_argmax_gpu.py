"""The drafting head's row argmax on the GPU at GLM-5.3's shapes: torch.argmax's column for bf16 logits rows of
one rank's vocabulary (19,360) and of the whole one (154,880), ties to the first column."""

from __future__ import annotations

import pytest
import torch

from kernels.argmax import row_argmax

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize(("rows", "cols"), [(1, 19360), (64, 19360), (4, 154880)])
def test_row_argmax_matches_torch_at_vocabulary_widths(rows: int, cols: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, cols, generator=gen, device="cuda").to(torch.bfloat16)  # bf16: many equal values
    x[0, cols // 3] = x[0, cols - 1] = x[0].max() + 1  # a tie across far chunks
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    assert row_argmax(x)[0].item() == cols // 3
