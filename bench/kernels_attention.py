"""Benchmark of sparse MLA attention and indexer scoring on one GPU.

Sparse MLA decode: B in {1, 8, 32, 64, 128} rows, H in {64, 8}, K=2048 selected
rows, Dl=512, Dr=64, fp8 and bf16 rows chosen at random from a 4 GiB pool (far
beyond L2). Indexer decode: Hi=32, Di=128, fp8 rows, contexts 16K..1M over
random page tables into a 4 GiB pool (plus bf16 rows at 128K). For each case:
median time per call of a CUDA graph replaying the launch over rotating inputs
(at least 256 MB of rows per replay, so repeats are not served from L2; decode
runs under CUDA graphs too), achieved GB/s
(bytes of selected MLA rows, or of indexer rows scored), the share of the HBM
copy bandwidth measured in the same run (device-to-device copy, bytes read plus
written), for sparse MLA the TFLOP/s of its two products and their share of a
bf16 dense matmul measured in the same run (the ceiling at 64 heads, where the
work is the tensor cores'), and the speed-up over the PyTorch twin
(triton.testing.do_bench, L2 flushed) where the twin fits in memory; for sparse
MLA also the same rows gathered alone (`bench/row_gather.cu`, built with nvcc
where there is one): the ceiling of this access pattern, random rows of 656 or 1,152 bytes; for
the indexer also scoring plus the top-K kernel (`kernels.topk`), and at
B <= 8 the same with programmatic dependent launch, as the engine's decode graphs of so few rows launch it.
A few tile configurations are tried at B=64 and the best is used for all B; the
defaults (`SparseMLAConfig.for_problem`, `IndexerConfig.for_problem`: what the engine
launches) are timed beside it, and scoring plus top-K is timed with the defaults.
Prints a table last and writes it, with the full log, under $OUT (or bench/out).

    python bench/kernels_attention.py
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from bench.timing import OUT_DIR, bench, bench_graph, dense_tflops, hbm_copy_gbs, pick, run_log  # noqa: E402
from engine.kv_layout import KVLayout  # noqa: E402
from engine.rank.decode_graphs import PDL_MAX_ROWS  # noqa: E402
from kernels import pdl, sparse_mla_cuda  # noqa: E402
from kernels.cubin import CudaKernel  # noqa: E402
from kernels.indexer import IndexerConfig, indexer_scores, indexer_scores_ref, indexer_topk  # noqa: E402
from kernels.sparse_mla import SparseMLAConfig, sparse_mla, sparse_mla_ref  # noqa: E402

DL, DR, DI, HI, TOPK = 512, 64, 128, 32, 2048
BATCHES = (1, 8, 32, 64, 128)
CONTEXTS = (16384, 65536, 131072, 262144, 1048576)
POOL_BYTES = 4 << 30
_C = SparseMLAConfig
MLA_CONFIGS = {  # (rows, heads): tried at B=64; the best is then also tried with other wave counts
    ("fp8", 8): [_C(cuda=True, cuda_waves=0.5), _C(cuda=True), _C(cuda=True, cuda_waves=2),
                 _C(block_k=32, num_warps=8, num_stages=3), _C(block_k=32, num_warps=4, prefetch=True),
                 _C(block_k=32, num_warps=4, num_stages=2),
                 _C(block_k=32, num_warps=8, num_stages=3, dequant_f32=True), _C(block_k=64, num_warps=8, num_stages=3)],
    ("bf16", 8): [_C(block_k=32, num_warps=4, prefetch=True), _C(block_k=32, num_warps=4, num_stages=2),
                  _C(block_k=32, num_warps=8, num_stages=3),
                  _C(block_k=64, num_warps=8, num_stages=3)],
    ("fp8", 64): [_C(cuda=True), _C(block_h=64, block_k=32, num_warps=8),
                  _C(block_h=64, block_k=32, num_warps=8, dequant_f32=True),
                  _C(block_h=16, block_k=64, num_warps=8), _C(block_h=32, block_k=32, num_warps=8)],
    ("bf16", 64): [_C(block_h=16, block_k=64, num_warps=8), _C(block_h=64, block_k=32, num_warps=8),
                   _C(block_h=32, block_k=64, num_warps=8)],
}
INDEXER_CONFIGS = [IndexerConfig(block_t=64), IndexerConfig(block_t=64, num_stages=5),
                   IndexerConfig(block_t=128, num_stages=3), IndexerConfig(block_t=128, num_stages=5),
                   IndexerConfig(block_t=128, num_warps=8, num_stages=5), IndexerConfig(block_t=64, num_stages=6)]
ROTATE_BYTES = 256 << 20  # inputs rotated per timed graph so repeated calls do not hit L2 (60 MB)

log = run_log("kernels_attention")

_GATHER_SOURCE = Path(__file__).with_name("row_gather.cu")
_GATHER_WARPS, _GATHER_TILE = 8, 16  # the .cu's warps (a macro) and rows a tile
_gather_kernels: dict[int, CudaKernel] = {}


class _GatherParams(ctypes.Structure):
    """`RowGatherParams` of bench/row_gather.cu, field for field."""

    _fields_ = [("kv", ctypes.c_void_p), ("slots", ctypes.c_void_p), ("lens", ctypes.c_void_p),
                ("kv_stride_page", ctypes.c_longlong), ("kv_stride_tok", ctypes.c_longlong),
                ("slots_stride_n", ctypes.c_longlong), ("split_len", ctypes.c_int), ("page_size", ctypes.c_int)]


def gather_ceiling_ms(view: torch.Tensor, slots: list[torch.Tensor], lens: torch.Tensor) -> float | None:
    """Milliseconds a call of bench/row_gather.cu takes to gather the rows `slots` select (one CTA per split of
    K and query row, splits filling the SMs once, as the sparse MLA kernel's), or None without nvcc."""
    row_bytes = view.shape[2]
    stages = 2 if row_bytes <= 704 else 1  # two stages of FP8 rows fit the shared memory, one of bf16 rows
    shared = _GATHER_WARPS * stages * (_GATHER_TILE * row_bytes + 8)
    defines = (("ROW_BYTES", row_bytes), ("GATHER_WARPS", _GATHER_WARPS), ("GATHER_STAGES", stages))
    kernel = _gather_kernels.setdefault(row_bytes, CudaKernel(_GATHER_SOURCE, "row_gather", shared, defines))
    if not kernel.available(view.device):
        return None
    n, k = slots[0].shape
    splits, split_len = sparse_mla_cuda.num_splits(n, k, 1.0, view.device, step=_GATHER_WARPS * _GATHER_TILE)

    def call(s: torch.Tensor) -> None:
        params = _GatherParams(view.data_ptr(), s.data_ptr(), lens.data_ptr(), view.stride(0), view.stride(1),
                               s.stride(0), split_len, view.shape[1])
        kernel.launch(view.device, (splits, n, 1), _GATHER_WARPS * 32, params)

    return bench_graph([lambda s=s: call(s) for s in slots])


def num_rotations(nbytes: int) -> int:
    return max(1, min(256, triton.cdiv(ROTATE_BYTES, nbytes)))


def glm_layout(kv_format: str) -> KVLayout:
    return KVLayout(kv_format=kv_format, latent_dim=DL, rope_dim=DR, index_dim=DI, group_sizes=(1, 4),
                    layer_group=(0, 1, 1, 1, 1), layer_pos=(0, 0, 1, 2, 3), num_full_layers=2)


def make_pool(layout: KVLayout) -> torch.Tensor:
    pages = POOL_BYTES // layout.page_bytes
    return torch.empty((pages, layout.page_bytes), dtype=torch.uint8, device="cuda").random_(0, 256)


def fill_mla_view(layout: KVLayout, pool: torch.Tensor, layer: int) -> torch.Tensor:
    view = layout.mla_layer_view(pool, layer)
    distinct = 1 << 16
    rows = layout.encode_mla(torch.randn(distinct, DL, device="cuda"), torch.randn(distinct, DR, device="cuda"))
    total = view.shape[0] * view.shape[1]
    idx = torch.randint(0, distinct, (total,), device="cuda")
    view.copy_(rows[idx].view(view.shape))
    return view


def fill_indexer_view(layout: KVLayout, pool: torch.Tensor) -> torch.Tensor:
    view = layout.indexer_layer_view(pool, 1)
    distinct = 1 << 16
    rows = layout.encode_indexer(torch.randn(distinct, DI, device="cuda"))
    pages, tokens = view.values.shape[0], view.tokens_per_page
    for p0 in range(0, pages, 2048):
        at = p0 * tokens + torch.arange(min(2048, pages - p0) * tokens, device="cuda")
        idx = torch.randint(0, distinct, (at.shape[0],), device="cuda")
        view.store(at // tokens, at % tokens, rows[idx])
    return view


def fmt_row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _cfg_name(cfg) -> str:
    if isinstance(cfg, SparseMLAConfig) and cfg.cuda:
        return f"cuda-v{cfg.cuda_waves}" + (f"s{cfg.num_splits}" if cfg.num_splits else "")
    if isinstance(cfg, SparseMLAConfig):
        return (f"h{cfg.block_h}k{cfg.block_k}w{cfg.num_warps}s{cfg.num_stages}v{cfg.waves}"
                + ("p" if cfg.prefetch else "") + ("f" if cfg.dequant_f32 else ""))
    return f"t{cfg.block_t}w{cfg.num_warps}s{cfg.num_stages}" + ("p" if cfg.prefetch else "")


def _pick(label: str, candidates: list, time_of) -> object:
    found = pick(label, candidates, time_of, _cfg_name, log)
    return found[0] if found is not None else None


def run_mla(hbm: float, rows_out: list) -> None:
    tflops = dense_tflops()  # the tensor cores' ceiling, for 64 heads (about 200 flops a row byte)
    log(f"bf16 dense matmul 8192^3: {tflops:.0f} TFLOP/s")
    for kv_format in ("fp8", "bf16"):
        run_mla_format(kv_format, hbm, tflops, rows_out)
        torch.cuda.empty_cache()  # the format's pool went with its frame


def run_mla_format(kv_format: str, hbm: float, tflops: float, rows_out: list) -> None:
    layout = glm_layout(kv_format)
    pool = make_pool(layout)
    view = fill_mla_view(layout, pool, 2)
    num_slots = view.shape[0] * view.shape[1]
    rb = layout.mla_row_bytes
    kw = dict(kv_format=kv_format, latent_dim=DL, rope_dim=DR, scale=0.0417)
    for heads in (8, 64):
        best = None
        for b in (64,) + tuple(x for x in BATCHES if x != 64):
            nbytes = b * TOPK * rb
            rot = num_rotations(nbytes)
            slots = [torch.randint(0, num_slots, (b, TOPK), dtype=torch.int32, device="cuda") for _ in range(rot)]
            lens = torch.full((b,), TOPK, dtype=torch.int32, device="cuda")
            q = torch.randn(b, heads, DL + DR, device="cuda").to(torch.bfloat16)

            def calls(cfg):
                return [lambda s=s: sparse_mla(q, view, s, lens, **kw, config=cfg) for s in slots]

            if best is None:
                label = f"mla {kv_format} H={heads} B={b}"
                best = _pick(label, MLA_CONFIGS[(kv_format, heads)], lambda c: bench_graph(calls(c)))
                if best is None:
                    break
                others = ([dataclasses.replace(best, cuda_waves=v) for v in (0.75, 1.5)] if best.cuda
                          else [dataclasses.replace(best, waves=v) for v in (1, 4, 8)])
                best = _pick(label, [best] + others, lambda c: bench_graph(calls(c)))
            ms = bench_graph(calls(best))
            default_ms = bench_graph(calls(None))
            twin_ms = bench(lambda: sparse_mla_ref(q, view, slots[0], lens, **kw), rep=30)
            ceiling_ms = gather_ceiling_ms(view, slots, lens)
            gbs = nbytes / ms / 1e6
            flops = b * 2 * heads * TOPK * (DL + DR + DL)  # scores and output
            rows_out.append(dict(kernel="sparse_mla", fmt=kv_format, heads=heads, B=b, ctx=f"K={TOPK}",
                                 MB=nbytes / 1e6, us=ms * 1e3, gbs=gbs, hbm=gbs / hbm, twin=twin_ms / ms,
                                 tflops=flops / ms / 1e9, matmul=flops / ms / 1e9 / tflops,
                                 cfg=_cfg_name(best), default_us=default_ms * 1e3,
                                 default_hbm=nbytes / default_ms / 1e6 / hbm,
                                 default_cfg=_cfg_name(SparseMLAConfig.for_problem(heads, kv_format, b)),
                                 ceiling_us=None if ceiling_ms is None else ceiling_ms * 1e3,
                                 ceiling_hbm=None if ceiling_ms is None else nbytes / ceiling_ms / 1e6 / hbm))
            log(fmt_row(_cells(rows_out[-1])))


def run_indexer(hbm: float, rows_out: list) -> None:
    for kv_format in ("fp8", "bf16"):
        ok = run_indexer_format(kv_format, hbm, rows_out)
        torch.cuda.empty_cache()
        if not ok:
            return


def run_indexer_format(kv_format: str, hbm: float, rows_out: list) -> bool:
    """False when no kernel configuration ran (the sweep stops)."""
    layout = glm_layout(kv_format)
    pool = make_pool(layout)
    view = fill_indexer_view(layout, pool)
    tokens, num_pages, rb = view.tokens_per_page, view.values.shape[0], layout.indexer_key_bytes
    contexts = CONTEXTS if kv_format == "fp8" else (131072,)
    kw_base = dict(kv_format=kv_format, scale=DI**-0.5, topk=TOPK)
    best = None
    for ctx in (131072,) + tuple(c for c in contexts if c != 131072):
        for b in (64,) + tuple(x for x in BATCHES if x != 64):
            nbytes = b * ctx * rb
            rot = num_rotations(nbytes)
            max_pages = triton.cdiv(ctx, tokens)
            tables = [torch.randint(0, num_pages, (b, max_pages), dtype=torch.int32, device="cuda")
                      for _ in range(rot)]
            r2r = torch.arange(b, dtype=torch.int32, device="cuda")
            ctx_lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
            q = torch.randn(b, HI, DI, device="cuda").to(torch.bfloat16)
            w = torch.randn(b, HI, device="cuda")
            kw = dict(kw_base, max_ctx=ctx)

            def calls(cfg, fn=indexer_scores):
                return [lambda t=t: fn(q, w, view, t, r2r, ctx_lens, ctx_lens, **kw, config=cfg) for t in tables]

            if best is None:
                best = _pick(f"indexer {kv_format} B={b} ctx={ctx}", INDEXER_CONFIGS,
                             lambda c: bench_graph(calls(c)))
                if best is None:
                    return False
            ms = bench_graph(calls(best))
            default_ms = bench_graph(calls(None))  # the engine's tiles (`IndexerConfig.for_problem`)
            topk_ms = bench_graph(calls(None, indexer_topk), iters=5)
            topk_pdl_ms = None
            if b <= PDL_MAX_ROWS:  # decode graphs of this few rows launch with PDL in the engine
                with pdl.launches(True):
                    topk_pdl_ms = bench_graph(calls(None, indexer_topk), iters=5)
            twin = "-"
            if b * ctx <= (4 << 20):
                twin_ms = bench(lambda: indexer_scores_ref(q, w, view, tables[0], r2r, ctx_lens, ctx_lens, **kw),
                                rep=30)
                twin = twin_ms / ms
            gbs = nbytes / ms / 1e6
            rows_out.append(dict(kernel="indexer", fmt=kv_format, heads=HI, B=b, ctx=f"{ctx // 1024}K",
                                 MB=nbytes / 1e6, us=ms * 1e3, gbs=gbs, hbm=gbs / hbm, twin=twin,
                                 cfg=_cfg_name(best), topk_us=topk_ms * 1e3, default_us=default_ms * 1e3,
                                 default_hbm=nbytes / default_ms / 1e6 / hbm,
                                 default_cfg=_cfg_name(IndexerConfig.for_problem(kv_format)),
                                 topk_pdl_us=None if topk_pdl_ms is None else topk_pdl_ms * 1e3))
            log(fmt_row(_cells(rows_out[-1])))
    return True


HEADER = ["kernel", "rows", "heads", "B", "K / ctx", "MB read", "time us", "GB/s", "of HBM copy",
          "TFLOP/s (of bf16 matmul)", "x twin", "tiles", "+topk us", "+topk us, PDL", "defaults us (of HBM copy)",
          "rows gathered alone us (of HBM copy)", "defaults of gathers alone"]


def _cells(r: dict) -> list:
    twin = r["twin"] if isinstance(r["twin"], str) else f"{r['twin']:.1f}x"
    topk = f"{r['topk_us']:.0f}" if "topk_us" in r else "-"
    topk_pdl = f"{r['topk_pdl_us']:.0f}" if r.get("topk_pdl_us") is not None else "-"
    default = "-"
    if "default_us" in r:
        default = f"{r['default_us']:.1f} ({100 * r['default_hbm']:.0f}%, {r['default_cfg']})"
    ceiling = share = "-"
    if r.get("ceiling_us") is not None:
        ceiling = f"{r['ceiling_us']:.1f} ({100 * r['ceiling_hbm']:.0f}%)"
        share = f"{100 * r['ceiling_us'] / r['default_us']:.0f}%"
    flops = f"{r['tflops']:.0f} ({100 * r['matmul']:.0f}%)" if "tflops" in r else "-"
    return [r["kernel"], r["fmt"], r["heads"], r["B"], r["ctx"], f"{r['MB']:.1f}", f"{r['us']:.1f}",
            f"{r['gbs']:.0f}", f"{100 * r['hbm']:.0f}%", flops, twin, r["cfg"], topk, topk_pdl, default, ceiling, share]


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 0
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "kernels_attention.log").write_text("")
    torch.manual_seed(0)
    start = time.time()
    props = torch.cuda.get_device_properties(0)
    log(f"device {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    hbm = hbm_copy_gbs()
    log(f"HBM device-to-device copy (read + write): {hbm:.0f} GB/s")
    rows: list[dict] = []
    wanted = sys.argv[1:] or ["mla", "indexer"]  # e.g. `python bench/kernels_attention.py indexer`
    for part in [p for name, p in (("mla", run_mla), ("indexer", run_indexer)) if name in wanted]:
        try:
            part(hbm, rows)
        except Exception as exc:
            log(f"{part.__name__} stopped: {type(exc).__name__}: {exc}")
        torch.cuda.empty_cache()
    table = [f"HBM copy bandwidth in this run: {hbm:.0f} GB/s; {time.time() - start:.0f} s", "",
             fmt_row(HEADER), fmt_row(["---"] * len(HEADER))] + [fmt_row(_cells(r)) for r in rows]
    print("\n".join(table), flush=True)
    (OUT_DIR / "kernels_attention.md").write_text("\n".join(table) + "\n")
    (OUT_DIR / "kernels_attention.json").write_text(json.dumps(dict(hbm_gbs=hbm, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
