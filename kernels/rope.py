"""Rotary embedding of the first R dimensions of each head, in one launch (the eager PyTorch form is
seven: four products, a difference, a sum and the concatenation, plus one more to append the unrotated
rest).

x [T, H, D] (heads may be strided, the last dimension contiguous), tables cos/sin [T, R/2]. Pairs are
(x0, x1), (x2, x3), ... when interleaved, (x_i, x_{R/2+i}) otherwise; the output holds the rotated first
members, then the rotated second members, then dimensions R..D unchanged: the order
`engine.layers.apply_rope` writes, which queries and keys share, so their dot products are the true
rotation's. The products are computed in float32 and rounded once (the eager bf16 form rounds each
product), so bf16 results may differ from the eager form in the last bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The twin of the rotation alone: x [T, ..., R] entirely rotated in float32 and rounded once to x's dtype
    (as the kernel does on a GPU; the eager bf16 form rounds each product), pairs ordered as the kernel writes
    them; tables [T, R/2]."""
    f = x.float()
    half = x.shape[-1] // 2
    a, b = (f[..., 0::2], f[..., 1::2]) if interleaved else (f[..., :half], f[..., half:])
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.float().reshape(shape), sin.float().reshape(shape)
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1).to(x.dtype)


@triton.jit
def rotated_pairs(x_row, cos_row, sin_row, i, mask, R: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Pairs i (< R/2) of the R values at x_row rotated by the angles at cos_row / sin_row, in float32: (the
    rotated first members, the rotated second members), which outputs store at i and R/2 + i. Pointers may
    be blocks (rows of a tile) that broadcast against i."""
    half = R // 2
    if INTERLEAVED:
        first, second = 2 * i, 2 * i + 1
    else:
        first, second = i, i + half
    a = tl.load(x_row + first, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_row + second, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_row + i, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_row + i, mask=mask, other=0.0).to(tl.float32)
    return a * c - b * s, b * c + a * s


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, x_row_stride, x_head_stride, table_stride,
                 R: tl.constexpr, D: tl.constexpr, INTERLEAVED: tl.constexpr, HALF_BLOCK: tl.constexpr,
                 REST_BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    pdl.wait(PDL)
    pid = tl.program_id(0).to(tl.int64)
    t, h = pid // heads, pid % heads
    x_row = x_ptr + t * x_row_stride + h * x_head_stride
    out_row = out_ptr + pid * D
    i = tl.arange(0, HALF_BLOCK)
    pair = i < R // 2
    lo, hi = rotated_pairs(x_row, cos_ptr + t * table_stride, sin_ptr + t * table_stride, i, pair, R, INTERLEAVED)
    tl.store(out_row + i, lo.to(out_ptr.dtype.element_ty), mask=pair)
    tl.store(out_row + R // 2 + i, hi.to(out_ptr.dtype.element_ty), mask=pair)
    if D > R:
        j = tl.arange(0, REST_BLOCK)
        rest = j < D - R
        tl.store(out_row + R + j, tl.load(x_row + R + j, mask=rest), mask=rest)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int, interleaved: bool) -> torch.Tensor:
    """x [T, D] or [T, H, D], cos/sin [T, rope_dim/2] -> a new contiguous tensor of x's shape and dtype with
    the first `rope_dim` dimensions of every head rotated and the rest copied."""
    x3 = x.unsqueeze(1) if x.dim() == 2 else x
    t, heads, dim = x3.shape
    if (x3.stride(2) != 1 or rope_dim % 2 or rope_dim > dim or cos.shape != (t, rope_dim // 2)
            or sin.shape != cos.shape or cos.stride(1) != 1 or sin.stride() != cos.stride()):
        raise ValueError("rope needs x [T, (H,) D] with a contiguous last dimension and tables [T, rope_dim/2]")
    out = torch.empty((t, heads, dim), dtype=x.dtype, device=x.device)
    if t * heads:
        _rope_kernel[(t * heads,)](
            x3, cos, sin, out, heads, x3.stride(0), x3.stride(1), cos.stride(0),
            R=rope_dim, D=dim, INTERLEAVED=interleaved, HALF_BLOCK=triton.next_power_of_2(rope_dim // 2),
            REST_BLOCK=triton.next_power_of_2(max(dim - rope_dim, 1)), num_warps=1, **pdl.launch_options(x3.device)
        )
    return out.view(x.shape)
