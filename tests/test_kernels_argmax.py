"""The drafting head's row argmax (`kernels/argmax.py`) under the Triton interpreter: torch.argmax's column for
every row, ties to the first column, rows wider than one group of unrolled chunks and partial last chunks."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import argmax as A  # noqa: E402
from kernels.argmax import row_argmax  # noqa: E402


@pytest.mark.parametrize(("rows", "cols", "dtype"), [(3, 1, torch.float32), (2, 4097, torch.float16),
                                                     (4, 19360, torch.float32), (1, 9000, torch.bfloat16)])
def test_row_argmax_is_torch_argmax(rows: int, cols: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(cols)
    x = torch.randn(rows, cols, generator=gen).to(dtype)
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))


def test_ties_go_to_the_first_column_across_chunks_and_groups(monkeypatch) -> None:
    monkeypatch.setattr(A, "MAX_CHUNKS", 2)  # three groups of two 4096-column chunks for 20,000 columns
    x = torch.full((3, 20000), -1.0)
    x[0, [9000, 17, 19999]] = 2.0  # equal maxima in three chunks: the first column wins
    x[1, [8191, 8192]] = 5.0  # both sides of a chunk edge
    x[2] = 0.5  # the whole row tied
    assert row_argmax(x).tolist() == [17, 8191, 0]
    y = torch.randn(2, 20000, generator=torch.Generator().manual_seed(3))
    assert torch.equal(row_argmax(y), y.argmax(dim=-1))


def test_rejects_empty_rows() -> None:
    with pytest.raises(ValueError):
        row_argmax(torch.zeros(2, 0))
