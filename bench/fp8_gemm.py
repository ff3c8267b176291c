"""Benchmark of the block-scaled FP8 GEMM (`kernels/fp8_gemm.py`) on one GPU at GLM-5.3 TP8 shapes.

Linear layers of one rank (hidden 6144): q_kv_a_proj [2624, 6144] (q_a_proj
[2048, 6144] and kv_a_proj_with_mqa [576, 6144] fused, as the engine runs them;
also each alone), q_b_proj [2048, 2048], the indexer's wq_b [4096, 2048], o_proj
[6144, 2048], MLP gate/up [1536, 6144], down [6144, 1536]; M = 1, 8, 32, 64, 128
bf16 rows (decode). For
each case: median time per call of a CUDA graph replaying the call over
rotating weight copies (at least 256 MB of weights per replay, so weights come
from HBM, not L2), weight bytes / time in GB/s and its share of the HBM copy
bandwidth measured in the same run (device-to-device copy, bytes read plus
written), TFLOP/s (for prefill runs, `--m 4096`); the same for bf16
`torch.matmul` with the dequantised weight (twice the bytes).
`FP8GemmConfig.for_problem` gives the default tiles; unless `--no-sweep`, a few
other tile configurations are timed too and the best is shown next to the
default (to retune `for_problem`). `--pairs` adds the engine's two GEMM pairs
(q_kv_a_proj with the indexer's wk, q_b_proj with its wq_b: `fp8_block_linear_pair`)
against their two launches. Prints a table last and writes it, with the
full log, under $OUT (or bench/out).

    python bench/fp8_gemm.py [--no-sweep] [--m 1,8] [--shapes q_a_proj,o_proj] [--pairs]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from bench.timing import OUT_DIR, bench_graph, hbm_copy_gbs, pick, run_log  # noqa: E402
from kernels.fp8_gemm import (  # noqa: E402
    FP8GemmConfig,
    Fp8Activations,
    dequantize_weight_blocks,
    fp8_block_linear,
    fp8_block_linear_pair,
    quantize_activations,
    quantize_weight_blocks,
)

SHAPES = {  # name: (N, K) of one TP8 rank
    "q_kv_a_proj": (2624, 6144),  # q_a_proj and kv_a_proj_with_mqa as the engine fuses them
    "wq_b": (4096, 2048),  # the indexer's query projection (full layers)
    "wk": (128, 6144),  # the indexer's key projection (full layers)
    "q_a_proj": (2048, 6144),
    "q_b_proj": (2048, 2048),
    "kv_a_proj_with_mqa": (576, 6144),
    "o_proj": (6144, 2048),
    "mlp_gate_up": (1536, 6144),
    "mlp_down": (6144, 1536),
    "eh_proj": (6144, 12288),  # the MTP layer's input projection (replicated; FP8 for drafting)
    "lm_head": (19360, 6144),  # the drafting head: the vocabulary's eighth as an FP8 copy
}
MS = (1, 8, 32, 64, 128)
PAIRS = (("q_kv_a_proj", "wk"), ("q_b_proj", "wq_b"))  # linears of one input the engine runs as one launch
GEMV_SWEEP_ROWS = 8  # up to this many tokens the sweep also times the GEMV (one program per token and row tile)
ROTATE_BYTES = 256 << 20  # weight copies per timed graph, well beyond the 50 MB L2

log = run_log("fp8_gemm")


def cfg_name(c: FP8GemmConfig) -> str:
    if c.gemv:
        return f"gemv n{c.block_n}k{c.gemv_block_k}w{c.num_warps}"
    return (f"m{c.block_m}n{c.block_n}s{c.split_k}w{c.num_warps}st{c.num_stages}"
            + ("t" if c.swap_ab else ""))


def candidates(m: int, n: int, k: int, sms: int) -> list[FP8GemmConfig]:
    """The default, then other tile shapes with their own split (and a few split / stage variants)."""
    base = FP8GemmConfig.for_problem(m, n, k, sms)
    out = [base]
    bm_small = 16 if m <= 16 else 32 if m <= 32 else 64
    shapes = [(bm_small, True), (max(bm_small, 64) if m > 16 else 16, False)]
    for bn in (64, 128):
        for bm, swap in shapes:
            split = FP8GemmConfig.split_for(m, n, k, bm, bn, sms)
            c = FP8GemmConfig(block_m=bm, block_n=bn, split_k=split, swap_ab=swap, num_warps=4, num_stages=4)
            if c not in out:
                out.append(c)
    if m <= GEMV_SWEEP_ROWS:  # GEMV tiles (rows per program, columns per unrolled K tile, warps), a program a token
        for bn in (4, 8, 16):
            for bk in (512, 1024, 2048):
                for warps in (4, 8):
                    c = FP8GemmConfig(block_m=16, block_n=bn, gemv=True, gemv_block_k=bk, num_warps=warps)
                    if c not in out:
                        out.append(c)
    return out


def variants(best: FP8GemmConfig, m: int, k: int) -> list[FP8GemmConfig]:
    """Split, stage and warp variants of the best tiles: every split up to twice the best's at up to
    GEMV_SWEEP_ROWS rows (where a split decides how many programs share the SMs), else halved and doubled."""
    if best.gemv:  # the GEMV's tiles were all candidates already
        return [best]
    kb = triton.cdiv(k, 128)
    out = [best]
    splits = (range(1, min(kb, 2 * best.split_k) + 1) if m <= GEMV_SWEEP_ROWS
              else {1, max(1, best.split_k // 2), min(kb, best.split_k * 2)})
    for split in sorted(set(splits) - {best.split_k}):
        out.append(dataclasses.replace(best, split_k=split))
    for stages in (3, 5):
        out.append(dataclasses.replace(best, num_stages=stages))
    out.append(dataclasses.replace(best, num_warps=8 if best.num_warps == 4 else 4))
    return out


def run_shape(name: str, n: int, k: int, ms_list, hbm: float, sms: int, sweep: bool, rows: list) -> None:
    w, s = quantize_weight_blocks(torch.randn(n, k, device="cuda") * 0.02)
    rot = max(2, min(64, triton.cdiv(ROTATE_BYTES, n * k)))
    weights = [(w.clone(), s.clone()) for _ in range(rot)]
    rot16 = max(2, min(64, triton.cdiv(ROTATE_BYTES, 2 * n * k)))
    w16 = [dequantize_weight_blocks(w, s).to(torch.bfloat16) for _ in range(rot16)]
    for m in ms_list:
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)

        def calls(cfg):
            return [lambda ww=ww, ss=ss: fp8_block_linear(x, ww, ss, config=cfg) for ww, ss in weights]

        default = FP8GemmConfig.for_problem(m, n, k, sms)
        label = f"{name} M={m}"
        ms = bench_graph(calls(default))
        best, best_ms = default, ms
        if sweep:
            found = pick(label, candidates(m, n, k, sms), lambda c: bench_graph(calls(c)), cfg_name, log)
            if found is not None:
                found = pick(label, variants(found[0], m, k), lambda c: bench_graph(calls(c)), cfg_name, log)
            if found is not None and found[1] < best_ms:
                best, best_ms = found
        ms16 = bench_graph([lambda ww=ww: torch.matmul(x, ww.T) for ww in w16])
        gbs = n * k / ms / 1e6
        gbs16 = 2 * n * k / ms16 / 1e6
        rows.append(dict(shape=name, N=n, K=k, M=m, MB=n * k / 1e6, us=ms * 1e3, gbs=gbs, hbm=gbs / hbm,
                         tflops=2 * m * n * k / ms / 1e9,
                         cfg=cfg_name(default), best_us=best_ms * 1e3, best_cfg=cfg_name(best),
                         bf16_us=ms16 * 1e3, bf16_hbm=gbs16 / hbm, speedup=ms16 / ms))
        log(fmt_row(cells(rows[-1])))
    del weights, w16
    torch.cuda.empty_cache()


def run_pair(first: str, second: str, ms_list, hbm: float) -> list[str]:
    """Table rows of `fp8_block_linear_pair` against the two launches it replaces (default tiles each)."""
    (n1, k), (n2, _) = SHAPES[first], SHAPES[second]
    rot = max(2, min(64, triton.cdiv(ROTATE_BYTES, (n1 + n2) * k)))
    sets = [(quantize_weight_blocks(torch.randn(n1, k, device="cuda") * 0.02),
             quantize_weight_blocks(torch.randn(n2, k, device="cuda") * 0.02)) for _ in range(rot)]
    rows = []
    for m in ms_list:
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        x_fp8 = Fp8Activations(*quantize_activations(x))  # made by the norm before, in the engine
        two = bench_graph([lambda a=a, b=b: (fp8_block_linear(x, *a, x_fp8=x_fp8), fp8_block_linear(x, *b, x_fp8=x_fp8))
                           for a, b in sets])
        one = bench_graph([lambda a=a, b=b: fp8_block_linear_pair(x, a, b, x_fp8=x_fp8) for a, b in sets])
        share = (n1 + n2) * k / one / 1e6 / hbm
        rows.append(fmt_row([f"{first} + {second} [{n1} + {n2}, {k}]", m, f"{two * 1e3:.1f}", f"{one * 1e3:.1f}",
                             f"{(two - one) * 1e3:.1f}", f"{100 * share:.0f}%"]))
        log(rows[-1])
    del sets
    torch.cuda.empty_cache()
    return rows


def fmt_row(c) -> str:
    return "| " + " | ".join(str(x) for x in c) + " |"


HEADER = ["shape [N, K]", "M", "MB fp8", "fp8 us", "GB/s", "of HBM copy", "TFLOP/s", "default tiles", "best us",
          "best tiles", "bf16 matmul us", "bf16 of HBM copy", "fp8 speed-up"]


def cells(r: dict) -> list:
    return [f"{r['shape']} [{r['N']}, {r['K']}]", r["M"], f"{r['MB']:.1f}", f"{r['us']:.1f}", f"{r['gbs']:.0f}",
            f"{100 * r['hbm']:.0f}%", f"{r['tflops']:.1f}", r["cfg"], f"{r['best_us']:.1f}", r["best_cfg"],
            f"{r['bf16_us']:.1f}", f"{100 * r['bf16_hbm']:.0f}%", f"{r['speedup']:.2f}x"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-sweep", action="store_true", help="time the default tiles only")
    ap.add_argument("--m", default=",".join(map(str, MS)), help="comma-separated row counts")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shape names")
    ap.add_argument("--pairs", action="store_true", help="also time the engine's GEMM pairs against two launches")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 0
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "fp8_gemm.log").write_text("")
    torch.manual_seed(0)
    start = time.time()
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    log(f"device {props.name}, {sms} SMs, torch {torch.__version__}, triton {triton.__version__}")
    hbm = hbm_copy_gbs()
    log(f"HBM device-to-device copy (read + write): {hbm:.0f} GB/s")
    ms_list = [int(v) for v in args.m.split(",")]
    rows: list[dict] = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        try:
            run_shape(name, n, k, ms_list, hbm, sms, not args.no_sweep, rows)
        except Exception as exc:
            log(f"{name} stopped: {type(exc).__name__}: {exc}")
            torch.cuda.empty_cache()
    pair_rows = [row for first, second in PAIRS for row in run_pair(first, second, ms_list, hbm)] if args.pairs else []
    table = [f"HBM copy bandwidth in this run: {hbm:.0f} GB/s (weight bytes / time against it); "
             f"{time.time() - start:.0f} s",
             "", fmt_row(HEADER), fmt_row(["---"] * len(HEADER))] + [fmt_row(cells(r)) for r in rows]
    if pair_rows:
        head = ["pair [N1 + N2, K]", "M", "two launches us", "one launch us", "saved us", "pair of HBM copy"]
        table += ["", fmt_row(head), fmt_row(["---"] * len(head))] + pair_rows
    print("\n".join(table), flush=True)
    (OUT_DIR / "fp8_gemm.md").write_text("\n".join(table) + "\n")
    (OUT_DIR / "fp8_gemm.json").write_text(json.dumps(dict(hbm_gbs=hbm, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
