"""A rank's resolve of an extend's rows through the GPU kernels (the CPU test runs the PyTorch twin): the
union of the rows' host-only selections, in one piece and in many, reads the host bytes of every selected
row and loads each position once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from residency import rank as rank_residency
from tests.test_rank_residency import check_extend_rows


@pytest.mark.parametrize("piece", [4096, 16])
def test_extend_rows_read_the_host_bytes_of_their_selection_on_the_gpu(tiny_dir: Path, piece: int,
                                                                      monkeypatch) -> None:
    monkeypatch.setattr(rank_residency, "_UNION_PIECE", piece)
    check_extend_rows(tiny_dir, piece, torch.device("cuda"))
