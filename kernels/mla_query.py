"""The absorbed MLA query in one launch: q_cat [T, H, Dl + Dr] from q_b_proj's output.

For each token t and head h, with q [T, H, Dn + Dr] (q_b_proj's output viewed per head) and the key
half of kv_b_proj, w_k [H, Dn, Dl]:

    q_cat[t, h, :Dl] = q[t, h, :Dn] @ w_k[h]              (float32 accumulation, rounded to q's dtype)
    q_cat[t, h, Dl:] = rope(q[t, h, Dn:])                  (as `kernels.rope`, one rounding)

which is what the sparse MLA kernel reads. The eager form is three launches (a batched GEMM, the rotary
kernel and the concatenation), each a few microseconds at decode batch sizes. Programs: (head, block of
tokens, block of Dl columns), plus one program per (head, block of tokens) for the rotary part. Contents:
`mla_query` (Triton) and its twin `mla_query_ref` (the eager form's arithmetic in PyTorch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.fp8_gemm import _interpreting, _num_sms
from kernels.rope import rope_ref, rotated_pairs


_COMPUTE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def mla_query_ref(q: torch.Tensor, w_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int,
                  interleaved: bool) -> torch.Tensor:
    """The eager form: einsum of the nope part with w_k in q's dtype, the rotation's twin, concatenated."""
    dn = q.shape[-1] - rope_dim
    absorbed = torch.einsum("thd,hdc->thc", q[..., :dn], w_k)
    return torch.cat([absorbed, rope_ref(q[..., dn:], cos, sin, interleaved)], dim=-1)


@triton.jit
def _mla_query_kernel(q_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, tokens, stride_qt, stride_qh, stride_wh, stride_wd,
                      stride_ot, stride_oh, table_stride,
                      DN: tl.constexpr, DL: tl.constexpr, R: tl.constexpr, INTERLEAVED: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HALF_BLOCK: tl.constexpr,
                      COMPUTE: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    pdl.wait(PDL)
    h = tl.program_id(0).to(tl.int64)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    n_tile = tl.program_id(2)
    tmask = offs_t < tokens
    q_rows = q_ptr + offs_t.to(tl.int64) * stride_qt + h * stride_qh
    out_rows = out_ptr + offs_t.to(tl.int64) * stride_ot + h * stride_oh
    if n_tile * BLOCK_N < DL:  # absorbed nope part: [BLOCK_T, DN] @ [DN, BLOCK_N]
        cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < DL
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for d0 in tl.static_range(0, DN, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            dmask = d < DN
            a = tl.load(q_rows[:, None] + d[None, :], mask=tmask[:, None] & dmask[None, :], other=0.0).to(COMPUTE)
            w = tl.load(w_ptr + h * stride_wh + d[:, None] * stride_wd + cols[None, :],
                        mask=dmask[:, None] & cmask[None, :], other=0.0).to(COMPUTE)
            if IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        tl.store(out_rows[:, None] + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=tmask[:, None] & cmask[None, :])
    else:  # rotary part, pairs as kernels.rope orders them
        i = tl.arange(0, HALF_BLOCK)
        pair = tmask[:, None] & (i < R // 2)[None, :]
        table = offs_t.to(tl.int64)[:, None] * table_stride
        lo, hi = rotated_pairs(q_rows[:, None] + DN, cos_ptr + table, sin_ptr + table, i[None, :], pair, R,
                               INTERLEAVED)
        tl.store(out_rows[:, None] + DL + i[None, :], lo.to(out_ptr.dtype.element_ty), mask=pair)
        tl.store(out_rows[:, None] + DL + R // 2 + i[None, :], hi.to(out_ptr.dtype.element_ty), mask=pair)


def query_block_d(dn: int, block_t: int) -> int:
    """Nope columns a K step of the absorbed product covers: all of them (one step, the tail masked) for up to
    16 tokens, else the largest power of two up to 64 dividing Dn. Each step's loads wait on the step before
    (the operands pass through shared memory); at a few tokens the weight stream is all there is."""
    whole = triton.next_power_of_2(dn)
    return whole if block_t <= 16 and whole <= 256 else min(64, dn & -dn)


def mla_query(q: torch.Tensor, w_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int,
              interleaved: bool) -> torch.Tensor:
    """q [T, H, Dn + Dr] (last dimension contiguous), w_k [H, Dn, Dl] (last dimension contiguous), tables
    cos/sin [T, rope_dim/2] -> q_cat [T, H, Dl + Dr] contiguous, in q's dtype."""
    t, heads, width = q.shape
    dn = width - rope_dim
    if (q.stride(2) != 1 or w_k.dim() != 3 or w_k.shape[:2] != (heads, dn) or w_k.stride(2) != 1
            or w_k.dtype != q.dtype or q.dtype not in _COMPUTE or rope_dim % 2 or dn % 16
            or cos.shape != (t, rope_dim // 2) or sin.shape != cos.shape or cos.stride(1) != 1
            or sin.stride() != cos.stride()):
        raise ValueError("mla_query needs q [T, H, Dn + Dr] and w_k [H, Dn, Dl] of one float dtype with contiguous "
                         "last dimensions, Dn a multiple of 16, and tables [T, rope_dim / 2]")
    if q.device.type != "cuda" and not _interpreting():
        raise ValueError(f"q is on {q.device}: the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1)")
    dl = w_k.shape[2]
    out = torch.empty((t, heads, dl + rope_dim), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    block_t = min(64, max(16, triton.next_power_of_2(t)))
    # about a program per SM: at a few tokens the weight (H x Dn x Dl) is the bytes, spread across programs
    tiles = heads * triton.cdiv(t, block_t)
    block_n = max(16, min(128, triton.next_power_of_2(triton.cdiv(dl * tiles, _num_sms(q.device)))))
    grid = (heads, triton.cdiv(t, block_t), triton.cdiv(dl, block_n) + 1)  # the last column of tiles: rotary
    _mla_query_kernel[grid](
        q, w_k, cos, sin, out, t, q.stride(0), q.stride(1), w_k.stride(0), w_k.stride(1), out.stride(0),
        out.stride(1), cos.stride(0), DN=dn, DL=dl, R=rope_dim, INTERLEAVED=interleaved, BLOCK_T=block_t,
        BLOCK_N=block_n, BLOCK_D=query_block_d(dn, block_t), HALF_BLOCK=triton.next_power_of_2(rope_dim // 2), COMPUTE=_COMPUTE[q.dtype],
        IEEE=q.dtype == torch.float32, num_warps=4, **pdl.launch_options(q.device)
    )
    return out
