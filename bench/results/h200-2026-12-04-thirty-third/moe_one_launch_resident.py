"""Probe: the few-token fused MoE as one launch (gate/up tiles, a grid barrier, down tiles) against the two
launches, in CUDA graphs over 4 layers' fp8 weights at GLM-5.3 TP8 shapes (H 6144, I 256, E 257, k 9)."""
import os, sys, statistics
sys.path.insert(0, ".")
import torch, triton, triton.language as tl
from kernels import pdl
from kernels.fp8_gemm import _quantize_groups
from kernels.fp8_pack import _cast_out
from kernels.fused_moe import FusedMoEConfig, fused_moe
from kernels.fused_moe_gemv import MoEOperands, _gate_up_gemv_kernel, _down_gemv_kernel
from bench.timing import bench_graph, hbm_copy_gbs
sys.path.insert(0, "bench")
import fused_moe as fb

H, I, E, K = fb.H, fb.I, fb.E, fb.K


@triton.jit
def _prefetch(ptrs, mask):
    tl.inline_asm_elementwise("@$2 prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l,b",
                              [ptrs, mask], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _grid_barrier(bar_ptr):
    """All programs of the launch meet here (they must all be resident): arrivals in bar[0], generation in bar[1]."""
    tl.debug_barrier()
    gen = tl.atomic_add(bar_ptr + 1, 0, sem="relaxed", scope="gpu")
    arrived = tl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_add(bar_ptr + 1, 1, sem="release", scope="gpu")
    else:
        while tl.atomic_add(bar_ptr + 1, 0, sem="acquire", scope="gpu") == gen:
            pass
    tl.debug_barrier()


@triton.jit
def _moe_one_launch(
    x_ptr, xs_ptr, w_ptr, ws_ptr, ids_ptr, h_ptr, w2_ptr, ws2_ptr, tw_ptr, out_ptr, bar_ptr,
    n_tok, top_k, hidden, inter, num_experts,
    stride_xt, stride_xst, stride_it, stride_ij, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, stride_hm,
    stride_we2, stride_wn2, stride_wse2, stride_wsn2, stride_wsk2, stride_twt, stride_twj, stride_ot,
    SOFT_CVT: tl.constexpr, TOP_K: tl.constexpr, SLOTS: tl.constexpr,
    K_TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_TILES_D: tl.constexpr, BLOCK_N_D: tl.constexpr, BLOCK_K_D: tl.constexpr,
    PREFETCH_DOWN: tl.constexpr, PREFETCH_UP: tl.constexpr, PDL: tl.constexpr,
):
    pdl.begin(PDL)
    pdl.wait(PDL)
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    n1_tiles = tl.cdiv(inter, BLOCK_N)
    n2_tiles = tl.cdiv(hidden, BLOCK_N_D)
    n1 = n1_tiles * n_tok * top_k
    n2 = n2_tiles * n_tok
    kk = tl.arange(0, BLOCK_K)
    if PREFETCH_DOWN:
        for tile in range(pid, n2, P):
            nt = tile % n2_tiles
            t = (tile // n2_tiles).to(tl.int64)
            rows = nt * BLOCK_N_D + tl.arange(0, BLOCK_N_D)
            for j in range(TOP_K):
                e = tl.load(ids_ptr + t * stride_it + j * stride_ij).to(tl.int32)
                live = (e >= 0) & (e < num_experts)
                lines = tl.arange(0, BLOCK_K_D * K_TILES_D // 128) * 128
                _prefetch(w2_ptr + e.to(tl.int64) * stride_we2 + rows.to(tl.int64)[:, None] * stride_wn2
                          + lines[None, :], (rows < hidden)[:, None] & live)
    if PREFETCH_UP:
        for tile in range(pid + P, n1, P):
            nt = tile % n1_tiles
            s = tile // n1_tiles
            t = (s // top_k).to(tl.int64)
            e = tl.load(ids_ptr + t * stride_it + (s % top_k) * stride_ij).to(tl.int32)
            live = (e >= 0) & (e < num_experts)
            cols = nt * BLOCK_N + tl.arange(0, BLOCK_N)
            lines = tl.arange(0, K_TILES * BLOCK_K // 128) * 128
            base = w_ptr + e.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn + lines[None, :]
            m = (cols < inter)[:, None] & (lines < hidden)[None, :] & live
            _prefetch(base, m)
            _prefetch(base + inter * stride_wn, m)
    for tile in range(pid, n1, P):
        nt = tile % n1_tiles
        s = tile // n1_tiles
        t = (s // top_k).to(tl.int64)
        e = tl.load(ids_ptr + t * stride_it + (s % top_k) * stride_ij).to(tl.int32)
        if (e >= 0) & (e < num_experts):
            cols = nt * BLOCK_N + tl.arange(0, BLOCK_N)
            cmask = cols < inter
            g_rows = w_ptr + e.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn + kk[None, :]
            u_rows = g_rows + inter * stride_wn
            gs_row = ws_ptr + e * stride_wse + (nt * BLOCK_N // 128) * stride_wsn
            us_row = ws_ptr + e * stride_wse + ((nt * BLOCK_N + inter) // 128) * stride_wsn
            acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            for kt in tl.static_range(K_TILES):
                k0 = kt * BLOCK_K
                kc = k0 + kk
                kmask = kc < hidden
                wmask = cmask[:, None] & kmask[None, :]
                a = tl.load(x_ptr + t * stride_xt + kc, mask=kmask, other=0.0)
                wg = tl.load(g_rows + k0, mask=wmask, other=0.0).to(tl.float32)
                wu = tl.load(u_rows + k0, mask=wmask, other=0.0).to(tl.float32)
                group = tl.minimum(kc, hidden - 1) // 128
                a = a.to(tl.float32) * tl.load(xs_ptr + t * stride_xst + group)
                a_g = a * tl.load(gs_row + group * stride_wsk)
                a_u = a * tl.load(us_row + group * stride_wsk)
                acc_g += wg * a_g[None, :]
                acc_u += wu * a_u[None, :]
            g = tl.sum(acc_g, axis=1)
            u = tl.sum(acc_u, axis=1)
            act = g / (1.0 + tl.exp(-g)) * u
            tl.store(h_ptr + s.to(tl.int64) * stride_hm + cols, _cast_out(act, h_ptr, SOFT_CVT), mask=cmask)
    _grid_barrier(bar_ptr)
    kd = tl.arange(0, BLOCK_K_D)
    js = tl.arange(0, SLOTS)
    for tile in range(pid, n2, P):
        nt = tile % n2_tiles
        t = (tile // n2_tiles).to(tl.int64)
        ids = tl.load(ids_ptr + t * stride_it + js * stride_ij, mask=js < TOP_K, other=-1).to(tl.int32)
        route_w = tl.load(tw_ptr + t * stride_twt + js * stride_twj, mask=js < TOP_K, other=0.0)
        cols = nt * BLOCK_N_D + tl.arange(0, BLOCK_N_D)
        cmask = cols < hidden
        total = tl.zeros([BLOCK_N_D], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            e = tl.sum(tl.where(js == j, ids, 0)) + tl.zeros([BLOCK_N_D], dtype=tl.int32)
            live = (e >= 0) & (e < num_experts)
            live_cols = cmask & live
            e = tl.max(tl.where(live, e, 0), axis=0)
            row = h_ptr + (t * TOP_K + j) * stride_hm
            w_rows = w2_ptr + e.to(tl.int64) * stride_we2 + cols.to(tl.int64)[:, None] * stride_wn2 + kd[None, :]
            acc = tl.zeros([BLOCK_N_D, BLOCK_K_D], dtype=tl.float32)
            for kt in tl.static_range(K_TILES_D):
                kc = kt * BLOCK_K_D + kd
                kmask = kc < inter
                a = tl.load(row + kc, mask=kmask, other=0.0).to(tl.float32)
                w = tl.load(w_rows + kt * BLOCK_K_D, mask=live_cols[:, None] & kmask[None, :], other=0.0).to(tl.float32)
                q, scale = _quantize_groups(tl.reshape(a, [BLOCK_K_D // 128, 128]), SOFT_CVT)
                group = kt * (BLOCK_K_D // 128) + tl.arange(0, BLOCK_K_D // 128)
                ws = tl.load(ws2_ptr + e * stride_wse2 + (nt * BLOCK_N_D // 128) * stride_wsn2 + group * stride_wsk2,
                             mask=group < tl.cdiv(inter, 128), other=0.0)
                a = tl.reshape(q.to(tl.float32) * (scale * ws)[:, None], [BLOCK_K_D])
                acc += w * a[None, :]
            rw = tl.sum(tl.where(js == j, route_w, 0.0))
            total += tl.where(live, _cast_out(tl.sum(acc, axis=1) * rw, out_ptr, SOFT_CVT).to(tl.float32), 0.0)
        tl.store(out_ptr + t * stride_ot + cols, _cast_out(total, out_ptr, SOFT_CVT), mask=cmask)


BAR = {}


RESIDENT = {}


def one_launch(x, w, tw, ids, out, programs, block_n, block_n_d, prefetch_down, prefetch_up, warps=4):
    ops = MoEOperands.of(x, w["w13"], w["w13_scale_inv"], w["w2_scale_inv"], None)
    t, h = ops.xq.shape
    k = ids.shape[1]
    act = BAR.setdefault(("act", t), torch.empty((t * k, I), dtype=x.dtype, device=x.device))
    bar = BAR.setdefault("bar", torch.zeros(2, dtype=torch.int32, device=x.device))
    w13, w2 = w["w13"], w["w2"]
    key = (programs, block_n, block_n_d, prefetch_down, prefetch_up, warps)
    launch = _moe_one_launch.warmup if key not in RESIDENT else _moe_one_launch[(programs,)]
    extra = dict(grid=(programs,)) if key not in RESIDENT else {}
    kern = launch(
        ops.xq, ops.xs, w13, ops.s13, ids, act, w2, ops.s2, tw, out, bar,
        t, k, h, I, w13.shape[0],
        ops.xq.stride(0), ops.xs_stride, ids.stride(0), ids.stride(1), w13.stride(0), w13.stride(1), *ops.s13_strides,
        act.stride(0), w2.stride(0), w2.stride(1), *ops.s2_strides, tw.stride(0), tw.stride(1), out.stride(0),
        SOFT_CVT=ops.soft_cvt, TOP_K=k, SLOTS=triton.next_power_of_2(k),
        K_TILES=triton.cdiv(h, 2048), BLOCK_N=block_n, BLOCK_K=2048,
        K_TILES_D=1, BLOCK_N_D=block_n_d, BLOCK_K_D=256,
        PREFETCH_DOWN=prefetch_down, PREFETCH_UP=prefetch_up, num_warps=warps, **extra, **pdl.launch_options(x.device))
    if key not in RESIDENT:
        per_sm = -(-programs // torch.cuda.get_device_properties(0).multi_processor_count)
        if hasattr(kern, '_init_handles'):
            kern._init_handles()
        regs, shared = kern.n_regs, kern.metadata.shared
        ok = per_sm * warps * 32 * max(regs, 1) <= 65536 and per_sm * warps <= 64 and per_sm * shared <= 227 * 1024
        print(f"  P={programs}: {regs} regs, {kern.n_spills} spills, {shared} B shared, {per_sm} a SM: "
              f"{'resident' if ok else 'NOT resident'}", flush=True)
        if not ok:
            raise RuntimeError("not all programs resident")
        RESIDENT[key] = True
        one_launch(x, w, tw, ids, out, programs, block_n, block_n_d, prefetch_down, prefetch_up, warps)


def main():
    torch.manual_seed(0)
    hbm = hbm_copy_gbs()
    layers = [fb.make_layer("fp8", 100 + i) for i in range(fb.LAYERS)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for T in (1,):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        routs = [fb.routing(T, 1000 + r) for r in range(fb.ROUTINGS)]
        out = torch.empty(T, H, device="cuda", dtype=torch.bfloat16)
        cfg = FusedMoEConfig.for_problem(T, K, E, weight_dtype=torch.float8_e4m3fn, hidden=H, inter=I)
        def base_calls(cfg=cfg, x=x, out=out, routs=routs):
            return [lambda r=r, l=l: fused_moe(x, l["w13"], l["w2"], routs[r][0], routs[r][1],
                                               w13_scale_inv=l["w13_scale_inv"], w2_scale_inv=l["w2_scale_inv"],
                                               out=out, config=cfg)
                    for r in range(fb.ROUTINGS) for l in [layers[r % fb.LAYERS]]]
        ref = []
        for r in range(4):
            l = layers[r % fb.LAYERS]
            ref.append(fused_moe(x, l["w13"], l["w2"], routs[r][0], routs[r][1], w13_scale_inv=l["w13_scale_inv"],
                                 w2_scale_inv=l["w2_scale_inv"], config=cfg).clone())
        touched = statistics.mean(len(set(routs[r][1].flatten().tolist())) for r in range(fb.ROUTINGS))
        byts = touched * fb.expert_bytes("fp8")
        forms = [("two launches", None)]
        bn_d = cfg.block_n_down
        for bn in (4, 8):
            programs = (I // bn) * K * T
            for pd_ in (False, True):
                forms.append((f"one P={programs} bn={bn}{' pd' if pd_ else ''}", (programs, bn, bn_d, pd_, False)))
        for name, form in forms:
            try:
                if form is None:
                    calls = base_calls()
                else:
                    for r in range(4):
                        l = layers[r % fb.LAYERS]
                        o = torch.empty_like(out)
                        one_launch(x, l, routs[r][0], routs[r][1], o, *form)
                        torch.cuda.synchronize()
                        if not torch.equal(o, ref[r]):
                            raise AssertionError(f"differs from two launches: max {(o.float() - ref[r].float()).abs().max().item()}")
                    calls = [lambda r=r, l=l: one_launch(x, l, routs[r][0], routs[r][1], out, *form)
                             for r in range(fb.ROUTINGS) for l in [layers[r % fb.LAYERS]]]
                times = [bench_graph(calls) * 1e3 for _ in range(3)]
                us = statistics.median(times)
                rows.append((T, name, us, byts / us / 1e3 / hbm * 100))
                print(f"T={T} {name}: {us:.1f} us ({min(times):.1f}-{max(times):.1f}), {rows[-1][3]:.0f} % of copy", flush=True)
            except Exception as exc:
                print(f"T={T} {name}: failed {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                torch.cuda.synchronize()
    print(f"\nHBM copy {hbm:.0f} GB/s")
    print(f"{'T':>2} {'form':<28} {'us':>7} {'copy %':>7}")
    for T, name, us, pct in rows:
        print(f"{T:>2} {name:<28} {us:7.1f} {pct:6.0f}%")


if __name__ == "__main__":
    main()
