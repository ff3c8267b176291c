"""GPU equality checks of the attention kernels against their PyTorch twins at GLM-5.3 shapes.

Sparse MLA: H in {64, 8}, Dl=512, Dr=64, K=2048, bf16 and fp8 rows, bf16 queries
(plus float32 rows with float32 queries), decode rows and an extend chunk, lens
shorter than K and 0. Indexer: Hi=32, Di=128, K=2048, fp8 and bf16 rows, decode
and causal extend rows. Inputs are fresh random draws in pools built by
`engine.kv_layout`; outputs are poisoned with NaN first. Prints one PASS/FAIL
line per check and exits non-zero on any failure.

    python bench/gpu_check_attention.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.kv_layout import KVLayout  # noqa: E402
from kernels.indexer import IndexerConfig, indexer_scores, indexer_scores_ref, indexer_topk  # noqa: E402
from kernels.sparse_mla import SparseMLAConfig, sparse_mla, sparse_mla_ref  # noqa: E402

DL, DR, DI, HI, TOPK = 512, 64, 128, 32, 2048
NUM_PAGES = 1024


def glm_layout(kv_format: str) -> KVLayout:
    """A slice of GLM-5.3's layout: groups {0} and {1..4} (five MLA layers, two full indexer layers)."""
    return KVLayout(kv_format=kv_format, latent_dim=DL, rope_dim=DR, index_dim=DI, group_sizes=(1, 4),
                    layer_group=(0, 1, 1, 1, 1), layer_pos=(0, 0, 1, 2, 3), num_full_layers=2)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    fin = torch.isfinite(ref)
    d = (out[fin].double() - ref[fin].double()).norm()
    return (d / ref[fin].double().norm().clamp_min(1e-30)).item()


def report(name: str, ok: bool, detail: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    return ok


def check_mla(kv_format: str, heads: int, dtype: torch.dtype, lens: list[int], gen: torch.Generator,
              config: SparseMLAConfig | None = None) -> bool:
    layout = glm_layout(kv_format)
    pool = torch.randint(0, 256, (NUM_PAGES, layout.page_bytes), dtype=torch.uint8, device="cuda", generator=gen)
    view = layout.mla_layer_view(pool, 3)
    num = NUM_PAGES * 64
    rows = layout.encode_mla(torch.randn(num, DL, device="cuda", generator=gen),
                             torch.randn(num, DR, device="cuda", generator=gen))
    view.copy_(rows.view(view.shape))
    n = len(lens)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    slots = torch.randint(0, num, (n, TOPK), dtype=torch.int32, device="cuda", generator=gen)
    slots[torch.arange(TOPK, device="cuda")[None, :] >= lens_t[:, None]] = 2**30  # never read
    q = torch.randn(n, heads, DL + DR, device="cuda", generator=gen).to(dtype)
    kw = dict(kv_format=kv_format, latent_dim=DL, rope_dim=DR, scale=(DL + DR) ** -0.5 * 4)
    out = torch.full((n, heads, DL), float("nan"), device="cuda")
    sparse_mla(q, view, slots, lens_t, **kw, out=out, config=config)
    ref = sparse_mla_ref(q, view, slots, lens_t, **kw)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    err = rel_err(out, ref)
    zero_ok = bool((out[lens_t == 0] == 0).all())
    ok = not out.isnan().any().item() and err < tol and zero_ok
    return report(f"sparse_mla {kv_format} rows, {str(dtype)[6:]} q, H={heads}, N={n}, {config or 'default'}", ok,
                  f"rel err {err:.2e} (tol {tol:.0e}), lens 0 rows zero: {zero_ok}")


def check_indexer(kv_format: str, extend: bool, gen: torch.Generator, config: IndexerConfig | None = None) -> bool:
    layout = glm_layout(kv_format)
    pool = torch.randint(0, 256, (NUM_PAGES, layout.page_bytes), dtype=torch.uint8, device="cuda", generator=gen)
    view = layout.indexer_layer_view(pool, 1)
    tokens = view.tokens_per_page
    keys = torch.randn(NUM_PAGES * tokens, DI, device="cuda", generator=gen)
    every = torch.arange(NUM_PAGES * tokens, device="cuda")
    view.store(every // tokens, every % tokens, layout.encode_indexer(keys))
    max_pages = 48
    if extend:  # one request, 16 causal rows at the end of a 20000-token context
        ctx = 20000
        table = torch.randperm(NUM_PAGES, device="cuda", generator=gen)[:max_pages][None].to(torch.int32)
        row_to_req = torch.zeros(16, dtype=torch.int32, device="cuda")
        ctx_lens = torch.full((16,), ctx, dtype=torch.int32, device="cuda")
        limits = torch.arange(ctx - 15, ctx + 1, dtype=torch.int32, device="cuda")
        limits[0] = 1000  # a row that sees fewer than K positions
    else:  # eight decode requests of various lengths, one of them empty
        ctx_lens = torch.tensor([30000, 17, 2048, 2049, 0, 12345, 25000, 4096], dtype=torch.int32, device="cuda")
        row_to_req = torch.arange(8, dtype=torch.int32, device="cuda")
        table = torch.stack([torch.randperm(NUM_PAGES, device="cuda", generator=gen)[:max_pages]
                             for _ in range(8)]).to(torch.int32)
        limits = ctx_lens.clone()
    n = row_to_req.shape[0]
    q = torch.randn(n, HI, DI, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(n, HI, device="cuda", generator=gen) * HI**-0.5
    kw = dict(kv_format=kv_format, scale=DI**-0.5, topk=TOPK)
    width = max_pages * tokens
    scores = torch.full((n, width), float("nan"), device="cuda")
    indexer_scores(q, w, view, table, row_to_req, ctx_lens, limits, **kw, out=scores, config=config)
    ref = indexer_scores_ref(q, w, view, table, row_to_req, ctx_lens, limits, **kw)
    err = rel_err(scores, ref)
    inf_ok = bool((torch.isinf(scores) == torch.isinf(ref)).all()) and not scores.isnan().any().item()
    got = indexer_topk(q, w, view, table, row_to_req, ctx_lens, limits, **kw, config=config)
    visible = torch.minimum(ctx_lens, limits)
    counts_ok = bool((got.counts == visible.clamp(max=TOPK)).all())
    topk_ok, worst = True, 0.0
    for i, c in enumerate(got.counts.tolist()):
        pos = got.positions[i, :c].long()
        if pos.unique().numel() != c or (pos >= visible[i]).any():
            topk_ok = False
            continue
        picked = ref[i, pos].sort().values
        best = ref[i].topk(c).values.sort().values
        gap = (picked - best).abs().max().item() if c else 0.0
        worst = max(worst, gap / max(best.abs().max().item() if c else 1.0, 1e-30))
    topk_ok = topk_ok and worst < 2e-2
    ok = err < 1e-2 and inf_ok and counts_ok and topk_ok
    kind = "extend" if extend else "decode"
    return report(f"indexer {kv_format} rows, bf16 q, {kind}, N={n}, {config or 'default'}", ok,
                  f"scores rel err {err:.2e}, -inf pattern {inf_ok}, counts {counts_ok}, "
                  f"top-K value gap {worst:.1e} ({topk_ok})")


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 0
    gen = torch.Generator(device="cuda").manual_seed(1234)
    decode_lens = [TOPK, TOPK, 100, 0, TOPK - 1, 1, TOPK, 777]
    extend_lens = [TOPK] * 12 + [5, 0, 64, 2047]
    ok = True
    for fmt in ("bf16", "fp8"):
        for heads in (64, 8):
            ok &= check_mla(fmt, heads, torch.bfloat16, decode_lens, gen)
        ok &= check_mla(fmt, 8, torch.bfloat16, extend_lens, gen)
    ok &= check_mla("float32", 8, torch.float32, decode_lens, gen)
    for cfg in (SparseMLAConfig(block_h=64, block_k=32, num_warps=8, prefetch=True),
                SparseMLAConfig(block_h=16, block_k=64, num_warps=8, prefetch=True, dequant_f32=True),
                SparseMLAConfig(block_h=32, block_k=32, num_splits=3, prefetch=True)):
        ok &= check_mla("fp8", 64, torch.bfloat16, decode_lens, gen, cfg)
    ok &= check_mla("bf16", 8, torch.bfloat16, extend_lens, gen, SparseMLAConfig(block_k=64, prefetch=True))
    for fmt in ("fp8", "bf16"):
        ok &= check_indexer(fmt, extend=False, gen=gen)
        ok &= check_indexer(fmt, extend=True, gen=gen)
    for cfg in (IndexerConfig(block_t=64, prefetch=True), IndexerConfig(block_t=128, num_warps=8, prefetch=True)):
        ok &= check_indexer("fp8", extend=False, gen=gen, config=cfg)
    print("ALL PASS" if ok else "SOME FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
