"""Physical KV slots of chosen token positions, through each row's page table, in one launch.

Each full layer turns its top-K positions [T, K] into slots of the page pool:

    slot[t, k] = table[req[t], pos[t, k] // page] * page + pos[t, k] % page

In PyTorch that is an arange, two index launches, a gather, a division, a remainder, a product, a sum and a
conversion to the int32 the sparse MLA reads: nine launches of 1.5-4 us at decode batch sizes, at each of
GLM-5.3's 21 full layers. Here one program per (row, block of K columns) reads the row's request once and
writes the slots in the dtype asked for. A position whose page lies outside the table (never a chosen one:
positions are below the row's context) reads the table's first or last column instead of faulting.
Contents: `page_slots_ref` (the PyTorch form) and `page_slots`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl

BLOCK = 1024  # columns a program (GLM-5.3's K = 2048: two programs a row)


def page_slots_ref(table: torch.Tensor, req_of_row: torch.Tensor, positions: torch.Tensor, page_size: int,
                   out_dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """The PyTorch form: slots [T, K] of positions [T, K] (>= 0) of the requests `req_of_row` [T]."""
    pages = table[req_of_row].long().gather(1, (positions // page_size).long())
    return (pages * page_size + positions % page_size).to(out_dtype)


@triton.jit
def _page_slots_kernel(table_ptr, req_ptr, pos_ptr, out_ptr, width, pages, stride_table, stride_pos, stride_out,
                       PAGE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    pdl.wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    req = tl.load(req_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t * stride_pos + cols, mask=mask, other=0).to(tl.int64)
    page = tl.minimum(tl.maximum(pos // PAGE, 0), pages - 1)
    phys = tl.load(table_ptr + req * stride_table + page, mask=mask, other=0).to(tl.int64)
    tl.store(out_ptr + t * stride_out + cols, (phys * PAGE + pos % PAGE).to(out_ptr.dtype.element_ty), mask=mask)


def page_slots(table: torch.Tensor, req_of_row: torch.Tensor, positions: torch.Tensor, page_size: int,
               out_dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """slots [T, K] in `out_dtype` (int32 or int64) of positions [T, K] (>= 0, below each row's context) of
    the requests `req_of_row` [T] through `table` [R, pages] (integer), in one launch."""
    if positions.dim() != 2 or req_of_row.shape != positions.shape[:1] or table.dim() != 2:
        raise ValueError(f"page_slots takes positions [T, K], req_of_row [T] and a table [R, pages], got "
                         f"{tuple(positions.shape)}, {tuple(req_of_row.shape)} and {tuple(table.shape)}")
    if out_dtype not in (torch.int32, torch.int64):
        raise ValueError(f"out_dtype must be int32 or int64, got {out_dtype}")
    rows, width = positions.shape
    out = torch.empty((rows, width), dtype=out_dtype, device=positions.device)
    if rows and width and table.shape[1]:
        if positions.stride(1) != 1:
            positions = positions.contiguous()
        if table.stride(1) != 1:
            table = table.contiguous()
        _page_slots_kernel[(rows, triton.cdiv(width, BLOCK))](
            table, req_of_row, positions, out, width, table.shape[1], table.stride(0), positions.stride(0),
            out.stride(0), PAGE=page_size, BLOCK=BLOCK, num_warps=4, **pdl.launch_options(positions.device))
    return out
