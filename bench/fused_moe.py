"""Benchmark of the fused MoE (`kernels/fused_moe.py`) on one GPU at GLM-5.3 TP8 shapes.

Experts of one rank as the engine runs them: H = 6144, I = 2048 / 8 = 256, 256 routed experts with k = 8,
and the shared expert folded in as expert 256, every token's ninth slot with weight 1 (E = 257, k = 9); bf16
activations; bf16 and fp8 (128x128 block-scaled) weights; T = 1, 8, 32, 64, 128
tokens (decode) with random routing (the top 8 of random scores: 8 distinct routed experts per token, and
the shared one). For each case: the distinct experts touched (mean over the routings),
their weight bytes (plus scales), the median time per call of a CUDA graph
replaying fused_moe over 16 routings and 4 layers' weights in turn (so repeats
are not served from L2), bytes / time in GB/s and its share of the HBM copy
bandwidth measured in the same run (device-to-device copy, bytes read plus
written); the eager time of one call (triton.testing.do_bench, L2 flushed), the
time of moe_align alone (graph), the default tiles with their blocks from the
alignment launch instead of gate/up's slot-led programs (`aligned blocks`,
timed interleaved with the default), and the engine's former loop over
`ids.unique().tolist()` (per-expert F.linear SwiGLU and index_add_; for fp8
weights per-expert `fp8_block_linear`), eager, for comparison.
`FusedMoEConfig.for_problem` gives the default tiles; with `--sweep` other tile
configurations are timed too and the best is shown next to the default (to
retune `for_problem`; a summary of the best tiles per T is printed last).
Prints a table last and writes it, with the full log, under $OUT (or bench/out).

    python bench/fused_moe.py [--sweep] [--tokens 1,8,32,64,128] [--formats bf16,fp8]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from bench.timing import OUT_DIR, bench, bench_graph, hbm_copy_gbs, pick, run_log  # noqa: E402
from kernels.fp8_gemm import fp8_block_linear, quantize_weight_blocks  # noqa: E402
from kernels.fused_moe import FusedMoEConfig, fused_moe  # noqa: E402
from kernels.moe_align import moe_align  # noqa: E402

H, I, ROUTED, E, K = 6144, 256, 256, 257, 9  # E and K include the shared expert's slot
TOKENS = (1, 8, 32, 64, 128)
LAYERS = 4  # weight sets rotated in the timed graph (2.4 GB bf16 / 1.2 GB fp8 each, far beyond the 50 MB L2)
ROUTINGS = 16  # calls per timed graph, each with its own routing
WDTYPE = {False: torch.bfloat16, True: torch.float8_e4m3fn}

log = run_log("fused_moe")


def make_layer(fmt: str, seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) * H**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device="cuda", generator=gen) * I**-0.5).to(torch.bfloat16)
    if fmt == "bf16":
        return dict(w13=w13, w2=w2)
    q13, s13 = quantize_weight_blocks(w13.reshape(E * 2 * I, H))
    q2, s2 = quantize_weight_blocks(w2.reshape(E * H, I))
    del w13, w2
    torch.cuda.empty_cache()
    return dict(w13=q13.reshape(E, 2 * I, H), w2=q2.reshape(E, H, I),
                w13_scale_inv=s13.reshape(E, 2 * I // 128, H // 128), w2_scale_inv=s2.reshape(E, H // 128, I // 128))


def expert_bytes(fmt: str) -> int:
    """Bytes one expert's weights occupy (what a call reads per touched expert)."""
    if fmt == "bf16":
        return 3 * H * I * 2
    return 3 * H * I + (2 * I // 128 * H // 128 + H // 128 * I // 128) * 4


def routing(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    vals, ids = torch.rand(t, ROUTED, device="cuda", generator=gen).topk(K - 1, dim=1)
    weights = (vals / vals.sum(1, keepdim=True) * 2.5).float()
    shared = torch.full_like(ids[:, :1], ROUTED)
    return torch.cat([weights, torch.ones_like(weights[:, :1])], 1), torch.cat([ids, shared], 1)


def old_loop(x: torch.Tensor, w: dict, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The engine's former MoE: one host sync, then per touched expert a SwiGLU MLP and index_add_."""
    out = torch.zeros_like(x)
    fp8 = "w13_scale_inv" in w
    for e in ids.unique().tolist():
        token_idx, slot = torch.where(ids == e)
        xe = x[token_idx]
        if fp8:
            gu = fp8_block_linear(xe, w["w13"][e], w["w13_scale_inv"][e])
            y = fp8_block_linear(F.silu(gu[:, :I]) * gu[:, I:], w["w2"][e], w["w2_scale_inv"][e])
        else:
            w13 = w["w13"][e]
            y = F.linear(F.silu(F.linear(xe, w13[:I])) * F.linear(xe, w13[I:]), w["w2"][e])
        out.index_add_(0, token_idx, (y * weights[token_idx, slot, None]).to(out.dtype))
    return out


def cfg_name(c: FusedMoEConfig) -> str:
    if c.gemv:
        return f"gemv n{c.block_n}k{c.block_k}w{c.num_warps}/n{c.block_n_down}k{c.block_k_down}w{c.num_warps_down}"
    return (f"m{c.block_m}n{c.block_n}k{c.block_k}w{c.num_warps}s{c.num_stages}"
            f"/n{c.block_n_down}k{c.block_k_down}w{c.num_warps_down}s{c.num_stages_down}" + ("t" if c.swap_ab else "")
            + (f"/split{c.split_k}" if c.split_k > 1 else "") + (f"/tiles{c.tiles_down}" if c.tiles_down > 1 else "")
            + ("/led" if c.slot_led else ""))


def candidates(t: int, fp8: bool) -> list[FusedMoEConfig]:
    """The default, then other tile shapes (decode: 16-row blocks; gate/up and down widths, swapped operands)."""
    out = [FusedMoEConfig.for_problem(t, K, E, weight_dtype=WDTYPE[fp8], hidden=H, inter=I)]
    for bn in (16, 32, 64, 128):
        for bnd in (64, 128, 256):
            for swap in (False, True):
                c = FusedMoEConfig(block_m=16, block_n=bn, block_n_down=bnd, swap_ab=swap)
                if c not in out:
                    out.append(c)
    for bn, stages in ((16, 6), (16, 8), (32, 6), (32, 8)):  # deeper pipelines: more weight bytes in flight
        c = FusedMoEConfig(block_m=16, block_n=bn, num_stages=stages)
        if c not in out:
            out.append(c)
    if t * K <= 128:  # a few tokens: gate/up with H in ranges, down tile widths
        for bn in (64, 128):
            for split in (4, 8, 12, 16, 24):
                for bnd in (64, 128):
                    c = FusedMoEConfig(block_m=16, block_n=bn, block_n_down=bnd, split_k=split)
                    if c not in out:
                        out.append(c)
    if t * K >= 4 * E:
        out.append(FusedMoEConfig(block_m=32, block_n=64, block_n_down=128, num_stages=3, num_stages_down=3))
    if t <= 4 and fp8:  # up to four tokens (a verifying step of k = 3): the GEMV form's tiles (gate/up rows and
        # columns, down columns)
        for bn, bk, warps in ((4, 2048, 4), (8, 2048, 8), (8, 1024, 4), (8, 512, 4), (2, 2048, 4), (4, 1024, 4)):
            for bnd in (8, 16, 32):
                c = FusedMoEConfig(gemv=True, block_n=bn, block_k=bk, num_warps=warps, block_n_down=bnd,
                                   block_k_down=256)
                if c not in out:
                    out.append(c)
    return out


def variants(best: FusedMoEConfig, fp8: bool) -> list[FusedMoEConfig]:
    if best.gemv:  # no pipeline stages to vary; the other warp count for each launch
        rep = dataclasses.replace
        return [best, rep(best, num_warps=12 - best.num_warps), rep(best, num_warps_down=12 - best.num_warps_down)]
    out = [best]
    rep = dataclasses.replace
    for stages in (3, 5, 6, 8):
        out.append(rep(best, num_stages=stages, num_stages_down=stages))
    for tiles in (1, 2, 4):  # down's column tiles a program
        out.append(rep(best, tiles_down=tiles))
    out.append(rep(best, num_warps=8, num_warps_down=8))
    out.append(rep(best, num_warps=8))
    out.append(rep(best, num_warps_down=8))
    if not fp8:
        out += [rep(best, block_k=64, block_k_down=64), rep(best, block_k=256, num_stages=3)]
    return [c for i, c in enumerate(out) if c not in out[:i]]


def run_format(fmt: str, tokens, hbm: float, sweep: bool, rows: list) -> None:
    log(f"building {LAYERS} layers of {fmt} experts")
    layers = [make_layer(fmt, seed) for seed in range(LAYERS)]
    fp8 = fmt == "fp8"
    per_expert = expert_bytes(fmt)
    for t in tokens:
        routs = [routing(t, 1000 * t + r) for r in range(ROUTINGS)]
        distinct = statistics.mean(ids.unique().numel() for _, ids in routs)
        nbytes = distinct * per_expert
        x = torch.randn(t, H, device="cuda").to(torch.bfloat16)
        out = torch.empty_like(x)

        def calls(cfg, x=x, out=out, routs=routs):
            return [lambda w=layers[r % LAYERS], tw=tw, ids=ids: fused_moe(x, topk_weights=tw, topk_ids=ids, out=out,
                                                                          config=cfg, **w)
                    for r, (tw, ids) in enumerate(routs)]

        default = FusedMoEConfig.for_problem(t, K, E, weight_dtype=WDTYPE[fp8], hidden=H, inter=I)
        label = f"{fmt} T={t}"
        # slot-led defaults are timed against the same tiles after the alignment launch, interleaved twice
        aligned = dataclasses.replace(default, slot_led=False)
        if default.slot_led:
            led_ms, aligned_ms = [], []
            for _ in range(2):
                led_ms.append(bench_graph(calls(default)))
                aligned_ms.append(bench_graph(calls(aligned)))
            ms, aligned_ms = statistics.mean(led_ms), statistics.mean(aligned_ms)
        else:
            ms = aligned_ms = bench_graph(calls(default))
        best, best_ms = default, ms
        if sweep:
            found = pick(label, candidates(t, fp8), lambda c: bench_graph(calls(c)), cfg_name, log)
            if found is not None:
                found = pick(label, variants(found[0], fp8), lambda c: bench_graph(calls(c)), cfg_name, log)
            if found is not None and found[1] < best_ms:
                best, best_ms = found
        tw0, ids0 = routs[0]
        eager_ms = bench(lambda: fused_moe(x, topk_weights=tw0, topk_ids=ids0, out=out, **layers[0]))
        align_ms = bench_graph([lambda ids=ids: moe_align(ids, E, default.block_m) for _, ids in routs])
        old_ms = bench(lambda: old_loop(x, layers[0], tw0, ids0), rep=50)
        gbs = nbytes / ms / 1e6
        rows.append(dict(fmt=fmt, T=t, experts=distinct, MB=nbytes / 1e6, us=ms * 1e3, gbs=gbs, hbm=gbs / hbm,
                         cfg=cfg_name(default), best_us=best_ms * 1e3, best_cfg=cfg_name(best),
                         best_hbm=nbytes / best_ms / 1e6 / hbm, eager_us=eager_ms * 1e3, align_us=align_ms * 1e3,
                         old_us=old_ms * 1e3, speedup=old_ms / ms, aligned_us=aligned_ms * 1e3))
        log(fmt_row(cells(rows[-1])))
    del layers
    torch.cuda.empty_cache()


def fmt_row(c) -> str:
    return "| " + " | ".join(str(x) for x in c) + " |"


HEADER = ["weights", "T", "distinct experts", "MB touched", "us (graph)", "GB/s", "of HBM copy", "default tiles",
          "best us", "best of HBM copy", "best tiles", "eager us", "moe_align us", "aligned blocks us",
          "aligned / default", "old loop us", "speed-up vs old"]


def cells(r: dict) -> list:
    return [r["fmt"], r["T"], f"{r['experts']:.1f}", f"{r['MB']:.1f}", f"{r['us']:.1f}", f"{r['gbs']:.0f}",
            f"{100 * r['hbm']:.0f}%", r["cfg"], f"{r['best_us']:.1f}", f"{100 * r['best_hbm']:.0f}%", r["best_cfg"],
            f"{r['eager_us']:.1f}", f"{r['align_us']:.1f}", f"{r['aligned_us']:.1f}",
            f"{r['aligned_us'] / r['us']:.3f}", f"{r['old_us']:.0f}", f"{r['speedup']:.1f}x"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time other tile configurations")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts")
    ap.add_argument("--formats", default="bf16,fp8", help="comma-separated weight formats (bf16, fp8)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 0
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "fused_moe.log").write_text("")
    torch.manual_seed(0)
    start = time.time()
    props = torch.cuda.get_device_properties(0)
    log(f"device {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
        f"triton {triton.__version__}")
    hbm = hbm_copy_gbs()
    log(f"HBM device-to-device copy (read + write): {hbm:.0f} GB/s")
    tokens = [int(v) for v in args.tokens.split(",")]
    rows: list[dict] = []
    for fmt in args.formats.split(","):
        try:
            run_format(fmt, tokens, hbm, args.sweep, rows)
        except Exception as exc:
            log(f"{fmt} stopped: {type(exc).__name__}: {exc}")
            torch.cuda.empty_cache()
    table = [f"GLM-5.3 TP8 experts, the shared one folded in (H={H}, I={I}, E={E}, k={K}); HBM copy bandwidth in "
             f"this run: "
             f"{hbm:.0f} GB/s; touched experts' weight bytes / time against it; {time.time() - start:.0f} s",
             "", fmt_row(HEADER), fmt_row(["---"] * len(HEADER))] + [fmt_row(cells(r)) for r in rows]
    if args.sweep:
        table += ["", "best tiles per case (for FusedMoEConfig.for_problem):"]
        table += [f"  {r['fmt']} T={r['T']}: {r['best_cfg']} ({r['best_us']:.1f} us, default {r['us']:.1f} us)"
                  for r in rows]
    print("\n".join(table), flush=True)
    (OUT_DIR / "fused_moe.md").write_text("\n".join(table) + "\n")
    (OUT_DIR / "fused_moe.json").write_text(json.dumps(dict(hbm_gbs=hbm, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
