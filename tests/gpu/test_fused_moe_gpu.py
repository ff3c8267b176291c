"""Fused MoE on the GPU against its PyTorch twins at GLM-5.3 one-rank (TP8) shapes.

Routed experts of one MoE layer: H = 6144, I = 2048 / 8 = 256, E = 256, k = 8,
bf16 activations; bf16 weights and fp8 weights (128x128 block scales); T in
(1, 8, 64, 128, 2048) tokens with random top-k routing (plus a skewed routing
where half the slots land on 8 hot experts). Checks:
- moe_align equals moe_align_ref element for element (the one-launch
  path of the alignment and its count and scatter launches);
- fused_moe equals fused_moe_ref (same roundings, float32 matmuls) to a
  tolerance relative to the output: the kernel differs by float32 summation
  order (and, for fp8, the tensor core's reduced-precision accumulation inside
  each 128-deep block), which can move a bf16 rounding of the intermediate or
  of the output by one ulp;
- repeated calls are bitwise equal; the shared expert folded in as expert 256
  (E = 257, k = 9, as engine/layers.py's MoE does) works;
- a call makes no host synchronisation (sync debug mode "error") and replays
  from a CUDA graph with new routings copied into the captured inputs.
Runs in well under a minute on an H200 (weights: 2.4 GB bf16, 1.2 GB fp8).

    pytest tests/gpu/test_fused_moe_gpu.py -q -rA -s     # prints the measured errors
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

H, I, E, K = 6144, 256, 256, 8
TOKENS = (1, 8, 64, 128, 2048)
NORM_TOL, MAX_TOL = 5e-3, 2e-2  # of ||ref||, of max |ref| (bf16 output: 1 ulp is 2^-8 relative)
# fp8 weights: a bf16 intermediate that rounds the other way (summation order) can re-quantise to the
# neighbouring e4m3 value, a 2^-4 relative step on that element, and fp8 tensor-core dots accumulate with
# fewer bits than float32: twice the bf16 bounds.
FP8_NORM_TOL, FP8_MAX_TOL = 1e-2, 4e-2


@pytest.fixture(scope="module")
def moe():
    """The kernel module, imported at test time (never while collecting on a CPU machine)."""
    return importlib.import_module("kernels.fused_moe")


@pytest.fixture(scope="module")
def experts():
    """{"bf16": weights, "fp8": weights}: random experts with unit-variance outputs, fp8 by 128x128 blocks."""
    fp8_gemm = importlib.import_module("kernels.fp8_gemm")
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) * H**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device="cuda", generator=gen) * I**-0.5).to(torch.bfloat16)
    q13, s13 = fp8_gemm.quantize_weight_blocks(w13.reshape(E * 2 * I, H))  # 2I % 128 == 0: blocks stay in an expert
    q2, s2 = fp8_gemm.quantize_weight_blocks(w2.reshape(E * H, I))  # H % 128 == 0
    fp8 = dict(w13=q13.reshape(E, 2 * I, H), w2=q2.reshape(E, H, I),
               w13_scale_inv=s13.reshape(E, 2 * I // 128, H // 128), w2_scale_inv=s2.reshape(E, H // 128, I // 128))
    torch.cuda.empty_cache()
    return {"bf16": dict(w13=w13, w2=w2), "fp8": fp8}


def routing(t: int, seed: int, skewed: bool = False, num_experts: int = E, k: int = K):
    """Top-k of random scores (k distinct experts per token), weights normalised and scaled as GLM's router."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(t, num_experts, device="cuda", generator=gen)
    if skewed:
        scores[: t // 2, :8] += 1.0  # half the tokens pick the 8 hot experts first
    vals, ids = scores.topk(k, dim=1)
    return (vals / vals.sum(1, keepdim=True) * 2.5).float(), ids


def activations(t: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(t, H, device="cuda", generator=gen).to(torch.bfloat16)


def check(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert not out.isnan().any(), f"{what}: NaN in the output"
    diff = (out.double() - ref.double())
    norm_err = (diff.norm() / ref.double().norm().clamp_min(1e-30)).item()
    max_err = (diff.abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()
    print(f"{what}: |err| / |ref| = {norm_err:.2e}, max err / max |ref| = {max_err:.2e}")
    norm_tol, max_tol = (FP8_NORM_TOL, FP8_MAX_TOL) if what.startswith("fp8") else (NORM_TOL, MAX_TOL)
    assert norm_err <= norm_tol and max_err <= max_tol, what


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("skewed", [False, True])
@pytest.mark.parametrize("block_m", [16, 64])
def test_moe_align_matches_twin(moe, t, skewed, block_m):
    _, ids = routing(t, seed=t, skewed=skewed)
    align = importlib.import_module("kernels.moe_align")
    got = align.moe_align(ids, E, block_m)
    want = align.moe_align_ref(ids, E, block_m)
    for name, a, b in zip(("sorted_ids", "expert_of_block", "num_padded"), got, want):
        assert torch.equal(a, b), f"{name} differs"


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("t", TOKENS)
def test_fused_moe_matches_twin(moe, experts, fmt, t):
    w = experts[fmt]
    x = activations(t, seed=100 + t)
    weights, ids = routing(t, seed=200 + t, skewed=t == 2048)
    out = torch.full_like(x, float("nan"))
    moe.fused_moe(x, topk_weights=weights, topk_ids=ids, out=out, **w)
    ref = moe.fused_moe_ref(x, topk_weights=weights, topk_ids=ids, **w)
    check(out.float(), ref.float(), f"{fmt} T={t} ({ids.unique().numel()} experts)")
    again = moe.fused_moe(x, topk_weights=weights, topk_ids=ids, **w)
    assert torch.equal(again, out), "repeated calls differ"


def test_fused_moe_swap_ab_and_prefill_tiles(moe, experts):
    """Configs other than the defaults for T: swapped operands at decode, the prefill tiles at T = 128
    (fp8 only, to keep compilation time down; bench/fused_moe.py --sweep times both formats)."""
    fmt = "fp8"
    w = experts[fmt]
    cfg = moe.FusedMoEConfig
    for t, config in ((8, cfg(block_m=16, block_n=64, swap_ab=True)), (128, cfg.for_problem(2048, K, E))):
        x = activations(t, seed=300 + t)
        weights, ids = routing(t, seed=400 + t)
        out = moe.fused_moe(x, topk_weights=weights, topk_ids=ids, config=config, **w)
        check(out.float(), moe.fused_moe_ref(x, topk_weights=weights, topk_ids=ids, **w).float(),
              f"{fmt} T={t} {config}")


def test_fused_moe_folded_shared_expert(moe, experts):
    """engine/layers.py stacks the shared expert as expert E and routes every token to it with weight 1; at
    T = 4 (a verifying step of k = 3) that is 36 slots, which take five-stage swapped tiles
    (`FusedMoEConfig.for_problem`)."""
    w = experts["fp8"]
    extra = dict(w13=torch.cat([w["w13"], w["w13"][:1]]), w2=torch.cat([w["w2"], w["w2"][:1]]),
                 w13_scale_inv=torch.cat([w["w13_scale_inv"], w["w13_scale_inv"][:1]]),
                 w2_scale_inv=torch.cat([w["w2_scale_inv"], w["w2_scale_inv"][:1]]))
    for t in (4, 64):
        x = activations(t, seed=7)
        weights, ids = routing(t, seed=8)
        weights = torch.cat([weights, torch.ones_like(weights[:, :1])], 1)
        ids = torch.cat([ids, torch.full_like(ids[:, :1], E)], 1)
        out = moe.fused_moe(x, topk_weights=weights, topk_ids=ids, **extra)
        ref = moe.fused_moe_ref(x, topk_weights=weights, topk_ids=ids, **extra)
        check(out.float(), ref.float(), f"fp8 + shared, T={t}")
    del extra
    torch.cuda.empty_cache()


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_fused_moe_no_sync_and_cuda_graph(moe, experts, fmt):
    w = experts[fmt]
    t = 8
    x = activations(t, seed=11)
    weights, ids = routing(t, seed=12)
    out = torch.empty_like(x)
    moe.fused_moe(x, topk_weights=weights, topk_ids=ids, out=out, **w)  # compiled before the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe.fused_moe(x, topk_weights=weights, topk_ids=ids, out=out, **w)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe.fused_moe(x, topk_weights=weights, topk_ids=ids, out=out, **w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe.fused_moe(x, topk_weights=weights, topk_ids=ids, out=out, **w)
    for seed in (21, 22, 23):
        new_w, new_ids = routing(t, seed=seed)
        x.copy_(activations(t, seed=seed))
        weights.copy_(new_w)
        ids.copy_(new_ids)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out.float(), moe.fused_moe_ref(x, topk_weights=weights, topk_ids=ids, **w).float(),
              f"{fmt} graph replay seed {seed}")


@pytest.mark.parametrize("t", [3, 8, 16, 32])
def test_slot_led_blocks_equal_the_alignment(moe, experts, t):
    """The decode tiles' blocks found by gate/up's own programs (`slot_led`, the default up to 288 slots) give
    the aligned launches' bits, with the shared expert folded in (E = 257, k = 9: at T = 32 the shared expert's
    slots fill two blocks), skewed routing (16 slots on each hot expert), a foreign id; and again from a CUDA graph
    replayed with new routings (the listed-block count is re-armed by every call)."""
    w = experts["fp8"]
    extra = dict(w13=torch.cat([w["w13"], w["w13"][:1]]), w2=torch.cat([w["w2"], w["w2"][:1]]),
                 w13_scale_inv=torch.cat([w["w13_scale_inv"], w["w13_scale_inv"][:1]]),
                 w2_scale_inv=torch.cat([w["w2_scale_inv"], w["w2_scale_inv"][:1]]))
    led = moe.FusedMoEConfig.for_problem(t, K + 1, E + 1, weight_dtype=torch.float8_e4m3fn, hidden=H, inter=I)
    assert led.slot_led
    aligned = dataclasses.replace(led, slot_led=False)

    def inputs(seed):
        weights, ids = routing(t, seed=seed, skewed=seed % 2 == 1)
        ids[0, 1] = -1
        return (activations(t, seed=seed), torch.cat([weights, torch.ones_like(weights[:, :1])], 1),
                torch.cat([ids, torch.full_like(ids[:, :1], E)], 1))

    x, weights, ids = inputs(31)
    want = moe.fused_moe(x, topk_weights=weights, topk_ids=ids, config=aligned, **extra)
    got = moe.fused_moe(x, topk_weights=weights, topk_ids=ids, config=led, **extra)
    assert torch.equal(got, want), "slot-led blocks differ from the aligned ones"
    check(got.float(), moe.fused_moe_ref(x, topk_weights=weights, topk_ids=ids, **extra).float(), f"fp8 led T={t}")
    out = torch.empty_like(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe.fused_moe(x, topk_weights=weights, topk_ids=ids, out=out, config=led, **extra)
    for seed in (32, 33):
        new_x, new_w, new_ids = inputs(seed)
        x.copy_(new_x)
        weights.copy_(new_w)
        ids.copy_(new_ids)
        graph.replay()
        want = moe.fused_moe(x, topk_weights=weights, topk_ids=ids, config=aligned, **extra)
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"graph replay with seed {seed} differs from the aligned blocks"
    del extra
    torch.cuda.empty_cache()
