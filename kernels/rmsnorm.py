"""RMSNorm of rows in one launch (the eager PyTorch form is eight: casts, square, mean, add, rsqrt, two
multiplies).

A decode layer normalises four times (input, q latent, kv latent, post-attention); at small batch each
launch costs more than its bytes, so one kernel per norm is what a captured step wants. The arithmetic
follows the reference `engine.layers.RMSNorm`: float32 mean of squares, scale, round to the input dtype,
then the weight product rounded to the input dtype (a bf16 multiply is a float32 multiply rounded). The
mean's summation order differs from torch's, so results agree to the last bit or two, not bit for bit.
Rows may be strided (a split of a wider projection); the last dimension must be contiguous.

`add_rmsnorm` also adds the residual stream first (x + residual rounded to the input dtype, as a bf16 add
is) and returns the sum beside its norm: a decoder layer's two residual adds each feed a norm, so the add
costs no launch of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(x_ptr, r_ptr, sum_ptr, w_ptr, out_ptr, x_row_stride, r_row_stride, out_row_stride, dim, eps,
                    BLOCK: tl.constexpr, ADD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    x = tl.load(x_ptr + row * x_row_stride + offs, mask=mask, other=0.0)
    if ADD:
        r = tl.load(r_ptr + row * r_row_stride + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * out_row_stride + offs, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, 0) / dim
    h = (xf * tl.math.rsqrt(mean_sq + eps)).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    out = (h.to(tl.float32) * w.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + row * out_row_stride + offs, out, mask=mask)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    dim = x.shape[-1]
    if weight.shape != (dim,) or weight.dtype != x.dtype or x.stride(-1) != 1:
        raise ValueError("rmsnorm needs weight [D] of x's dtype and a contiguous last dimension")
    rows = x.reshape(-1, dim)  # a view for x [T, D] however strided its rows
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    total = None
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1:
            raise ValueError("the residual must be shaped and typed as x, with a contiguous last dimension")
        res_rows, total = residual.reshape(-1, dim), torch.empty_like(out)
    if rows.shape[0]:
        block = triton.next_power_of_2(dim)
        _rmsnorm_kernel[(rows.shape[0],)](
            rows, rows if residual is None else res_rows, out if total is None else total, weight, out,
            rows.stride(0), 0 if residual is None else res_rows.stride(0), out.stride(0), dim, eps, BLOCK=block,
            ADD=residual is not None, num_warps=max(1, min(16, block // 256)))
    return out.view(x.shape), None if total is None else total.view(x.shape)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x [..., D] (rows may be strided) with weight [D]; a new
    contiguous tensor of x's dtype."""
    return _launch(x, weight, eps, None)[0]


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm of s, s) for s = x + residual rounded to x's dtype, in one launch; both new tensors."""
    out, total = _launch(x, weight, eps, residual)
    assert total is not None
    return out, total
