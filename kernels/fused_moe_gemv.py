"""The fused MoE's few-token form (`FusedMoEConfig.gemv`, kernels/fused_moe.py): two launches, no alignment.

Gate/up runs one program per (slot, BLOCK_N columns of I) over the whole H; down runs one program per (token,
BLOCK_N columns of H) that quantises each slot's intermediate itself (the values the tiled form's quantisation
launch gives), streams the slot's expert rows and adds the k weighted slots in order. Same inputs, outputs and
roundings as `kernels.fused_moe.fused_moe` (which checks the inputs and calls `fused_moe_gemv`); products are
float32 FMAs in registers, no tensor cores: at one or two tokens the weight stream is all there is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.fp8_gemm import Fp8Activations, _quantize_groups, _soft_cvt, _take_quantized
from kernels.fp8_pack import _cast_out

if TYPE_CHECKING:
    from kernels.fused_moe import FusedMoEConfig

COMPUTE_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


class MoEOperands(NamedTuple):
    """What both forms of the fused MoE launch with besides the weights: x (quantised once for fp8 experts,
    not in every tile that reads it), the scale tensors or stand-ins, and the compile-time dtypes."""

    fp8: bool
    soft_cvt: bool
    compute: Any  # tl dtype of the dots / products
    xq: torch.Tensor
    xs: torch.Tensor  # x's scales (fp8), else x itself, unused
    xs_stride: int
    s13: torch.Tensor  # w13's scales (fp8), else x, unused
    s13_strides: tuple[int, ...]
    s2: torch.Tensor
    s2_strides: tuple[int, ...]

    @classmethod
    def of(cls, x: torch.Tensor, w13: torch.Tensor, w13_scale_inv: torch.Tensor | None,
           w2_scale_inv: torch.Tensor | None, x_fp8: Fp8Activations | None) -> MoEOperands:
        fp8 = w13.dtype == torch.float8_e4m3fn
        if not fp8:
            return cls(False, _soft_cvt(), COMPUTE_DTYPES[w13.dtype], x, x, 0, x, (0, 0, 0), x, (0, 0, 0))
        xq, xs = _take_quantized(x, x_fp8)
        return cls(True, _soft_cvt(), tl.float32, xq, xs, xs.stride(0), w13_scale_inv, w13_scale_inv.stride(),
                   w2_scale_inv, w2_scale_inv.stride())


@triton.jit
def _gate_up_gemv_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, ids_ptr, h_ptr,
    top_k, hidden, inter, num_experts,
    stride_xt, stride_xst, stride_it, stride_ij, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, stride_hm,
    FP8: tl.constexpr, SOFT_CVT: tl.constexpr, COMPUTE: tl.constexpr, K_TILES: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """h[s, n-tile] = silu(gate_e . x[t]) * (up_e . x[t]) for slot s = t*k + j of expert e = ids[t, j]: the
    expert's gate and up rows streamed once over the whole H, float32 products summed in registers (no
    K split, no partials); the block scales fold into the activation (BLOCK_N divides 128). Which rows to
    stream is the router's output, so with PDL nothing is loaded before the wait."""
    pdl.begin(PDL)
    pdl.wait(PDL)
    nt = tl.program_id(0)
    s = tl.program_id(1)
    t = (s // top_k).to(tl.int64)
    e = tl.load(ids_ptr + t * stride_it + (s % top_k) * stride_ij).to(tl.int32)
    if (e >= 0) & (e < num_experts):
        cols = nt * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < inter
        kk = tl.arange(0, BLOCK_K)
        g_rows = w_ptr + e.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn + kk[None, :]
        u_rows = g_rows + inter * stride_wn
        gs_row = ws_ptr + e * stride_wse + (nt * BLOCK_N // 128) * stride_wsn
        us_row = ws_ptr + e * stride_wse + ((nt * BLOCK_N + inter) // 128) * stride_wsn
        acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for kt in tl.static_range(K_TILES):  # unrolled: every tile's loads independent, none waits on the last
            k0 = kt * BLOCK_K
            kc = k0 + kk
            kmask = kc < hidden
            wmask = cmask[:, None] & kmask[None, :]
            a = tl.load(x_ptr + t * stride_xt + kc, mask=kmask, other=0.0)
            wg = tl.load(g_rows + k0, mask=wmask, other=0.0).to(tl.float32)
            wu = tl.load(u_rows + k0, mask=wmask, other=0.0).to(tl.float32)
            if FP8:
                group = tl.minimum(kc, hidden - 1) // 128
                a = a.to(tl.float32) * tl.load(xs_ptr + t * stride_xst + group)
                a_g = a * tl.load(gs_row + group * stride_wsk)
                a_u = a * tl.load(us_row + group * stride_wsk)
            else:
                a_g = a.to(COMPUTE).to(tl.float32)
                a_u = a_g
            acc_g += wg * a_g[None, :]
            acc_u += wu * a_u[None, :]
        g = tl.sum(acc_g, axis=1)
        u = tl.sum(acc_u, axis=1)
        act = g / (1.0 + tl.exp(-g)) * u
        tl.store(h_ptr + s.to(tl.int64) * stride_hm + cols, _cast_out(act, h_ptr, SOFT_CVT), mask=cmask)


@triton.jit
def _down_gemv_kernel(
    h_ptr, w_ptr, ws_ptr, ids_ptr, tw_ptr, out_ptr,
    hidden, inter, num_experts,
    stride_hm, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, stride_it, stride_ij,
    stride_twt, stride_twj, stride_ot,
    FP8: tl.constexpr, SOFT_CVT: tl.constexpr, COMPUTE: tl.constexpr, TOP_K: tl.constexpr, SLOTS: tl.constexpr,
    K_TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """out[t, n-tile] = sum over slots j in order of round(w[t, j] * (down_e . h[t*k + j])): the token's expert
    ids and weights loaded once as vectors and the slots unrolled without branches, so no slot's rows wait on
    the slot before (a loop that loaded each slot's id, then its rows, paid two memory round trips a slot);
    each slot's intermediate quantised here per 128 columns (as the twin does between the GEMMs); the weighted
    slots added in order in float32 (no per-slot output, no sum launch)."""
    pdl.begin(PDL)
    pdl.wait(PDL)
    nt = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    js = tl.arange(0, SLOTS)
    ids = tl.load(ids_ptr + t * stride_it + js * stride_ij, mask=js < TOP_K, other=-1).to(tl.int32)
    route_w = tl.load(tw_ptr + t * stride_twt + js * stride_twj, mask=js < TOP_K, other=0.0)
    cols = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < hidden
    kk = tl.arange(0, BLOCK_K)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.sum(tl.where(js == j, ids, 0)) + tl.zeros([BLOCK_N], dtype=tl.int32)  # slot j's id, per column
        live = (e >= 0) & (e < num_experts)
        live_cols = cmask & live
        e = tl.max(tl.where(live, e, 0), axis=0)
        row = h_ptr + (t * TOP_K + j) * stride_hm
        w_rows = w_ptr + e.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn + kk[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for kt in tl.static_range(K_TILES):
            kc = kt * BLOCK_K + kk
            kmask = kc < inter
            a = tl.load(row + kc, mask=kmask, other=0.0).to(tl.float32)
            w = tl.load(w_rows + kt * BLOCK_K, mask=live_cols[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            if FP8:
                q, scale = _quantize_groups(tl.reshape(a, [BLOCK_K // 128, 128]), SOFT_CVT)
                group = kt * (BLOCK_K // 128) + tl.arange(0, BLOCK_K // 128)
                ws = tl.load(ws_ptr + e * stride_wse + (nt * BLOCK_N // 128) * stride_wsn + group * stride_wsk,
                             mask=group < tl.cdiv(inter, 128), other=0.0)
                a = tl.reshape(q.to(tl.float32) * (scale * ws)[:, None], [BLOCK_K])
            else:
                a = a.to(COMPUTE).to(tl.float32)
            acc += w * a[None, :]
        rw = tl.sum(tl.where(js == j, route_w, 0.0))
        total += tl.where(live, _cast_out(tl.sum(acc, axis=1) * rw, out_ptr, SOFT_CVT).to(tl.float32), 0.0)
    tl.store(out_ptr + t * stride_ot + cols, _cast_out(total, out_ptr, SOFT_CVT), mask=cmask)


def fused_moe_gemv(ops: MoEOperands, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, res: torch.Tensor, cfg: FusedMoEConfig) -> None:
    """The few-token form: gate/up per (slot, column tile), then down per (token, column tile) summing the
    token's slots; every expert row read once per slot, no alignment and no per-slot output."""
    t, h = ops.xq.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    k = topk_ids.shape[1]
    act = torch.empty((t * k, inter), dtype=res.dtype, device=res.device)
    _gate_up_gemv_kernel[(triton.cdiv(inter, cfg.block_n), t * k)](
        ops.xq, ops.xs, w13, ops.s13, topk_ids, act, k, h, inter, num_experts,
        ops.xq.stride(0), ops.xs_stride, topk_ids.stride(0), topk_ids.stride(1),
        w13.stride(0), w13.stride(1), *ops.s13_strides, act.stride(0),
        FP8=ops.fp8, SOFT_CVT=ops.soft_cvt, COMPUTE=ops.compute, K_TILES=triton.cdiv(h, cfg.block_k),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options(res.device),
    )
    _down_gemv_kernel[(triton.cdiv(h, cfg.block_n_down), t)](
        act, w2, ops.s2, topk_ids, topk_weights, res, h, inter, num_experts,
        act.stride(0), w2.stride(0), w2.stride(1), *ops.s2_strides, topk_ids.stride(0), topk_ids.stride(1),
        topk_weights.stride(0), topk_weights.stride(1), res.stride(0),
        FP8=ops.fp8, SOFT_CVT=ops.soft_cvt, COMPUTE=ops.compute, TOP_K=k, SLOTS=triton.next_power_of_2(k),
        K_TILES=triton.cdiv(inter, cfg.block_k_down), BLOCK_N=cfg.block_n_down, BLOCK_K=cfg.block_k_down,
        num_warps=cfg.num_warps_down, num_stages=cfg.num_stages_down, **pdl.launch_options(res.device),
    )
