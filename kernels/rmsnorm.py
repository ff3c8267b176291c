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

With `fp8=True` the launch also writes the norm quantised for FP8 GEMMs (`kernels.fp8_gemm.Fp8Activations`,
per row and 128-column group, bit for bit what `quantize_activations` makes of the norm): a norm whose
consumers are FP8 linears (the latent projections, q_b_proj and the indexer's wq_b, the experts) then
saves each of them its quantisation launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.fp8_gemm import FP8_BLOCK, Fp8Activations, _quantize_groups, _soft_cvt


_CHUNK = 1024  # columns written per program (GLM-5.3's 6144-wide norms: 6 programs a row)


@triton.jit
def _rmsnorm_kernel(x_ptr, r_ptr, sum_ptr, w_ptr, out_ptr, q_ptr, s_ptr, x_row_stride, r_row_stride, out_row_stride,
                    s_row_stride, dim, eps, pair_chunks, x2_offset, w2_offset, x2_row_stride, BLOCK: tl.constexpr,
                    CHUNK: tl.constexpr, ADD: tl.constexpr, QUANT: tl.constexpr, PAIR: tl.constexpr,
                    SOFT_CVT: tl.constexpr, PDL: tl.constexpr):
    """Program (row, c): the row's mean square from the whole row, then columns [c * CHUNK, (c + 1) * CHUNK)
    normalised (and added, and quantised): a wide row's writes and quantisation spread over several SMs.
    With PAIR, programs from `pair_chunks` on normalise a second input (its rows and weight reached by element
    offsets from the first's, which keeps the loads' alignment) into the `dim` columns after the first's."""
    pdl.begin(PDL)
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if PAIR:
        second = chunk >= pair_chunks
        x_ptr += tl.where(second, x2_offset, 0)
        w_ptr += tl.where(second, w2_offset, 0)
        x_row_stride = tl.where(second, x2_row_stride, x_row_stride)
        out_ptr += tl.where(second, dim, 0)
        q_ptr += tl.where(second, dim, 0)
        s_ptr += tl.where(second, dim // 128, 0)
        chunk = tl.where(second, chunk - pair_chunks, chunk)
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    x = tl.load(x_ptr + row * x_row_stride + offs, mask=mask, other=0.0)
    if ADD:
        r = tl.load(r_ptr + row * r_row_stride + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, 0) / dim + eps)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    cmask = cols < dim
    xc = tl.load(x_ptr + row * x_row_stride + cols, mask=cmask, other=0.0)
    if ADD:
        rc = tl.load(r_ptr + row * r_row_stride + cols, mask=cmask, other=0.0)
        xc = (xc.to(tl.float32) + rc.to(tl.float32)).to(xc.dtype)
        tl.store(sum_ptr + row * out_row_stride + cols, xc, mask=cmask)
    h = (xc.to(tl.float32) * rstd).to(xc.dtype)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0)
    out = (h.to(tl.float32) * w.to(tl.float32)).to(xc.dtype)
    tl.store(out_ptr + row * out_row_stride + cols, out, mask=cmask)
    if QUANT:  # the norm as FP8 GEMM input: groups of 128 columns (masked columns are 0, as the padding is)
        GROUPS: tl.constexpr = CHUNK // 128
        q, scale = _quantize_groups(tl.reshape(out.to(tl.float32), [GROUPS, 128]), SOFT_CVT)
        tl.store(q_ptr + row * out_row_stride + cols, tl.reshape(q, [CHUNK]), mask=cmask)
        g = chunk * GROUPS + tl.arange(0, GROUPS)
        tl.store(s_ptr + row * s_row_stride + g, scale, mask=g * 128 < dim)


def _tiles(dim: int) -> tuple[int, int, int]:
    """(BLOCK, CHUNK, warps) of a launch over rows of `dim` columns: the whole row for its mean square (at
    least one 128-column quantisation group), at most `_CHUNK` columns written a program."""
    block = max(FP8_BLOCK, triton.next_power_of_2(dim))
    return block, min(block, _CHUNK), max(1, min(16, block // 256))


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, fp8: bool
            ) -> tuple[torch.Tensor, torch.Tensor | None, Fp8Activations | None]:
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
    quant = None
    if fp8:
        quant = Fp8Activations(torch.empty(rows.shape, dtype=torch.float8_e4m3fn, device=x.device),
                               torch.empty((rows.shape[0], -(-dim // FP8_BLOCK)), dtype=torch.float32,
                                           device=x.device))
    if rows.shape[0]:
        block, chunk, warps = _tiles(dim)
        _rmsnorm_kernel[(rows.shape[0], triton.cdiv(dim, chunk))](
            rows, rows if residual is None else res_rows, out if total is None else total, weight, out,
            out if quant is None else quant.q, out if quant is None else quant.scales,
            rows.stride(0), 0 if residual is None else res_rows.stride(0), out.stride(0),
            0 if quant is None else quant.scales.stride(0), dim, eps, 0, 0, 0, 0, BLOCK=block, CHUNK=chunk,
            ADD=residual is not None, QUANT=fp8, PAIR=False, SOFT_CVT=_soft_cvt(), num_warps=warps,
            **pdl.launch_options(rows.device))
    return out.view(x.shape), None if total is None else total.view(x.shape), quant


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x [..., D] (rows may be strided) with weight [D]; a new
    contiguous tensor of x's dtype."""
    return _launch(x, weight, eps, None, False)[0]


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm of s, s) for s = x + residual rounded to x's dtype, in one launch; both new tensors."""
    out, total, _ = _launch(x, weight, eps, residual, False)
    assert total is not None
    return out, total


def rmsnorm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None, Fp8Activations]:
    """(norm, x + residual or None, the norm quantised for FP8 GEMMs) in one launch; x is [T, D]."""
    if x.dim() != 2:
        raise ValueError(f"rmsnorm_fp8 takes rows [T, D], got {tuple(x.shape)}")
    out, total, quant = _launch(x, weight, eps, residual, True)
    assert quant is not None
    return out, total, quant


def rmsnorm_pair(x: torch.Tensor, weight: torch.Tensor, x2: torch.Tensor, weight2: torch.Tensor, eps: float,
                 fp8: bool) -> tuple[torch.Tensor, Fp8Activations | None]:
    """([norm(x), norm2(x2)] side by side [T, 2D], quantised for FP8 GEMMs when `fp8`) in one launch, for rows
    x, x2 [T, D] of one dtype: the MTP layer's joined input (`enorm` of the token embeddings, `hnorm` of the
    hidden states), which the eager form builds in two norms, a concatenation and a quantisation. Each half
    is what `rmsnorm` / `rmsnorm_fp8` makes of its input (with `fp8`, D % 128 == 0: no group spans both)."""
    if x.dim() != 2 or x2.shape != x.shape or x2.dtype != x.dtype or weight2.shape != weight.shape:
        raise ValueError(f"rmsnorm_pair takes two inputs [T, D] alike, got {tuple(x.shape)} and {tuple(x2.shape)}")
    rows, dim = x.shape
    if (weight.shape != (dim,) or weight.dtype != x.dtype or weight2.dtype != x.dtype or x.stride(1) != 1
            or x2.stride(1) != 1):
        raise ValueError("rmsnorm_pair needs weights [D] of the inputs' dtype and rows with unit last stride")
    if fp8 and dim % FP8_BLOCK:
        raise ValueError(f"rmsnorm_pair quantises whole 128-column groups of each half: D = {dim} is not a multiple")
    out = torch.empty((rows, 2 * dim), dtype=x.dtype, device=x.device)
    quant = None
    if fp8:
        quant = Fp8Activations(torch.empty(out.shape, dtype=torch.float8_e4m3fn, device=x.device),
                               torch.empty((rows, 2 * dim // FP8_BLOCK), dtype=torch.float32, device=x.device))
    if rows:
        size = x.element_size()
        block, chunk, warps = _tiles(dim)
        chunks = triton.cdiv(dim, chunk)
        _rmsnorm_kernel[(rows, 2 * chunks)](
            x, x, out, weight, out, out if quant is None else quant.q, out if quant is None else quant.scales,
            x.stride(0), 0, out.stride(0), 0 if quant is None else quant.scales.stride(0), dim, eps, chunks,
            (x2.data_ptr() - x.data_ptr()) // size, (weight2.data_ptr() - weight.data_ptr()) // size, x2.stride(0),
            BLOCK=block, CHUNK=chunk, ADD=False, QUANT=fp8, PAIR=True, SOFT_CVT=_soft_cvt(), num_warps=warps,
            **pdl.launch_options(x.device))
    return out, quant
