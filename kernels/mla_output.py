"""The absorbed MLA output in one launch: o_proj's input from the attention's latent outputs.

For token t and head h, with the latent output o [T, H, Dl] of sparse MLA and the value half of kv_b_proj,
w_v [H, Dv, Dl]:

    x[t, h * Dv + v] = o[t, h, :] . w_v[h, v, :]     (float32 accumulation, rounded to o's dtype)

written as the [T, H * Dv] rows o_proj reads. The eager form is a batched GEMM whose [H, T, Dv] result must be
copied to [T, H * Dv]: two launches of a few microseconds at decode batch sizes. Programs: (head, block of
tokens, block of Dv columns), about one per SM (w_v is the bytes at a few tokens). Quantising for an FP8 o_proj
inside the tile was measured and dropped: a tile must then hold a whole 128-column group, which left 16
programs of 128 KB each at GLM-5.3's shapes (13.7 us on an H200 against 3.4 + 1.4 + 1.6 for the GEMM, the copy
and the quantisation). Contents: `mla_output` (Triton) and its twin `mla_output_ref` (the eager form).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.fp8_gemm import _interpreting, _num_sms


_COMPUTE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def mla_output_ref(o: torch.Tensor, w_v: torch.Tensor) -> torch.Tensor:
    """The eager form: einsum in o's dtype, reshaped to [T, H * Dv]."""
    return torch.einsum("thc,hvc->thv", o, w_v).reshape(o.shape[0], -1)


@triton.jit
def _mla_output_kernel(o_ptr, w_ptr, x_ptr, tokens, stride_ot, stride_oh, stride_wh, stride_wv, stride_xt,
                       DV: tl.constexpr, DL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
                       BLOCK_C: tl.constexpr, COMPUTE: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    pdl.wait(PDL)
    h = tl.program_id(0).to(tl.int64)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    tmask = offs_t < tokens
    o_rows = o_ptr + offs_t.to(tl.int64)[:, None] * stride_ot + h * stride_oh
    w_rows = w_ptr + h * stride_wh + v[:, None] * stride_wv  # [BLOCK_V, 1] row starts of w_v[h, v, :]
    acc = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
    for c0 in tl.static_range(0, DL, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        a = tl.load(o_rows + c[None, :], mask=tmask[:, None], other=0.0).to(COMPUTE)
        w = tl.load(w_rows + c[None, :]).to(COMPUTE)  # [BLOCK_V, BLOCK_C], read along its contiguous rows
        if IEEE:
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    cols = h * DV + v
    tl.store(x_ptr + offs_t.to(tl.int64)[:, None] * stride_xt + cols[None, :], acc.to(x_ptr.dtype.element_ty),
             mask=tmask[:, None])


def output_block_c(dl: int, block_t: int) -> int:
    """Latent columns a K step of the kernel covers: the whole latent (one step) for up to 16 tokens, fewer for
    larger token blocks (at most 8K elements of o a step). Each step's loads wait on the step before (the
    operands pass through shared memory), so at a few tokens eight 64-column steps took 6.4 us for GLM-5.3's
    2 MB of w_v at every block_v tried."""
    return min(dl & -dl, max(16, 8192 // block_t))


def mla_output(o: torch.Tensor, w_v: torch.Tensor) -> torch.Tensor:
    """o [T, H, Dl] (last dimension contiguous), w_v [H, Dv, Dl] (last dimension contiguous) -> x [T, H * Dv] in
    o's dtype, contiguous."""
    t, heads, dl = o.shape
    dv = w_v.shape[1] if w_v.dim() == 3 else 0
    if (o.stride(2) != 1 or w_v.dim() != 3 or w_v.shape[0] != heads or w_v.shape[2] != dl or w_v.stride(2) != 1
            or w_v.dtype != o.dtype or o.dtype not in _COMPUTE or dl % 16 or dv % 16):
        raise ValueError("mla_output needs o [T, H, Dl] and w_v [H, Dv, Dl] of one float dtype with contiguous last "
                         "dimensions, Dl and Dv multiples of 16")
    if o.device.type != "cuda" and not _interpreting():
        raise ValueError(f"o is on {o.device}: the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1)")
    x = torch.empty((t, heads * dv), dtype=o.dtype, device=o.device)
    if t == 0:
        return x
    block_t = min(64, max(16, triton.next_power_of_2(t)))
    tiles = heads * triton.cdiv(t, block_t)
    block_v = max(16, min(128, dv & -dv, triton.next_power_of_2(triton.cdiv(dv * tiles, _num_sms(o.device)))))
    _mla_output_kernel[(heads, triton.cdiv(t, block_t), dv // block_v)](
        o, w_v, x, t, o.stride(0), o.stride(1), w_v.stride(0), w_v.stride(1), x.stride(0),
        DV=dv, DL=dl, BLOCK_T=block_t, BLOCK_V=block_v, BLOCK_C=output_block_c(dl, block_t), COMPUTE=_COMPUTE[o.dtype],
        IEEE=o.dtype == torch.float32, num_warps=4, **pdl.launch_options(o.device)
    )
    return x
