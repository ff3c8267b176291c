"""Block-scaled FP8 GEMM on the GPU against its PyTorch twins at GLM-5.3 one-rank (TP8) shapes.

Linear layers with FP8 weights (hidden 6144): q_a_proj [2048, 6144], q_b_proj
[2048, 2048], kv_a_proj_with_mqa [576, 6144] (a partial 128-block on N),
o_proj [6144, 2048], dense MLP gate/up [1536, 6144] and down [6144, 1536]
(lm_head is bf16 and not here); M in (1, 8, 64, 128, 4096) plus two mid-size
M, bf16 activations, the default tiles of `FP8GemmConfig.for_problem`. Checks:
- quantize_activations equals its twin bit for bit, with the hardware fp32 ->
  e4m3 conversion and with the integer rounding (`HW_FP8_CVT`), including every
  rounding tie;
- fp8_block_linear equals the twin (same quantised product in float32) to a
  tolerance relative to the output magnitude: float32 output within the fp8
  tensor core's reduced-precision accumulation inside each 128-deep block,
  bf16 output within that plus half a bf16 ulp;
- repeated calls are bitwise equal (split-K sums in a fixed order) and a
  decode call replays correctly from a CUDA graph.

    pytest tests/gpu/test_fp8_gemm_gpu.py -q -rA -s     # prints the measured errors
"""

from __future__ import annotations

import importlib

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPES = {  # name: (N, K) of one TP8 rank
    "q_a_proj": (2048, 6144),
    "q_b_proj": (2048, 2048),
    "kv_a_proj_with_mqa": (576, 6144),
    "o_proj": (6144, 2048),
    "mlp_gate_up": (1536, 6144),
    "mlp_down": (6144, 1536),
}
MS = (1, 8, 64, 128, 4096)
# Kernel vs twin: the same quantised product, so only float32 rounding and (sm90) the fp8 tensor core's
# reduced-precision accumulation inside each 128-deep dot (about 14 mantissa bits) separate them. These
# bounds are 30x below the e4m3 quantisation error itself (about 2^-5 normwise), so a wrong scale, a lost
# K range or a misplaced tile fails them; the measured errors are printed (-s) to tighten them.
FP32_NORM_TOL, FP32_MAX_TOL = 1e-3, 4e-3  # of ||ref||, of max |ref|
BF16_NORM_TOL, BF16_MAX_TOL = 5e-3, 4e-3  # bf16 adds up to half an ulp (2^-8 relative) per element


@pytest.fixture(scope="module")
def fp8():
    """The kernel module, imported at test time (never while collecting on a CPU machine)."""
    return importlib.import_module("kernels.fp8_gemm")


@pytest.fixture(scope="module")
def weights(fp8):
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        out[name] = fp8.quantize_weight_blocks(w)
    return out


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    # unequal ranges across 128-groups, as hidden states with outlier channels
    x = torch.randn(m, k, device="cuda", generator=gen) * torch.logspace(-1, 1, k, device="cuda")[None, :]
    return x.to(torch.bfloat16)


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    d = (out.double() - ref.double())
    return (d.norm() / ref.double().norm()).item(), (d.abs().max() / ref.double().abs().max()).item()


@pytest.mark.parametrize("hw_cvt", [True, False], ids=["hw_cvt", "int_rounding"])
@pytest.mark.parametrize("k", [6144, 2048, 1536, 576 + 64])
def test_quantize_activations_bitwise(fp8, monkeypatch, hw_cvt, k):
    monkeypatch.setattr(fp8, "HW_FP8_CVT", hw_cvt)
    x = activations(4096, k, seed=k)
    x[7] = 0
    q, s = fp8.quantize_activations(x)
    q_ref, s_ref = fp8.quantize_activations_ref(x)
    bad = (q.view(torch.uint8) != q_ref.view(torch.uint8)).sum().item()
    assert bad == 0, f"{bad} of {q.numel()} fp8 bytes differ from the twin"
    assert torch.equal(s, s_ref), f"{(s != s_ref).sum().item()} scales differ"


@pytest.mark.parametrize("hw_cvt", [True, False], ids=["hw_cvt", "int_rounding"])
def test_e4m3_ties_bitwise(fp8, monkeypatch, hw_cvt):
    """Every midpoint between e4m3 neighbours, and values next to them, in groups led by 448 (scale 1)."""
    monkeypatch.setattr(fp8, "HW_FP8_CVT", hw_cvt)
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    v = v[torch.isfinite(v) & (v >= 0)].unique().sort().values
    mids = (v[1:] + v[:-1]) / 2
    near = torch.cat([mids, torch.nextafter(mids, torch.zeros_like(mids)), torch.nextafter(mids, mids + 1), v])
    near = torch.cat([near, -near])
    per = 127
    groups = -(-near.numel() // per)
    x = torch.zeros(groups, 128)
    x[:, 0] = 448.0
    x.view(-1)[torch.arange(near.numel()) // per * 128 + 1 + torch.arange(near.numel()) % per] = near
    x = x.reshape(1, -1).cuda()
    q, s = fp8.quantize_activations(x)
    assert (s == 1).all()
    want = x.cpu().to(torch.float8_e4m3fn)
    bad = (q.cpu().view(torch.uint8) != want.view(torch.uint8)).sum().item()
    assert bad == 0, f"{bad} of {q.numel()} tie/near-tie values rounded unlike torch"


@pytest.mark.parametrize("name, m", [(name, m) for name in SHAPES for m in MS]
                         + [("kv_a_proj_with_mqa", 300), ("o_proj", 1000)])  # mid-size M: split / 64-row tiles
def test_linear_matches_twin(fp8, weights, name, m):
    weight, scales = weights[name]
    n, k = SHAPES[name]
    x = activations(m, k, seed=m * 131 + n)
    cfg = fp8.FP8GemmConfig.for_problem(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    ref = fp8.fp8_block_linear_ref(x, weight, scales, out_dtype=torch.float32)

    out32 = fp8.fp8_block_linear(x, weight, scales, out_dtype=torch.float32)
    norm32, max32 = errors(out32, ref)
    out16 = fp8.fp8_block_linear(x, weight, scales)
    assert out16.dtype == torch.bfloat16 and out16.shape == (m, n)
    norm16, max16 = errors(out16.float(), ref)
    print(f"\n{name} [{n}, {k}] M={m} {cfg}: fp32 out rel err {norm32:.2e} (max {max32:.2e}), "
          f"bf16 out {norm16:.2e} (max {max16:.2e})")
    assert not out32.isnan().any() and not out16.isnan().any()
    assert norm32 <= FP32_NORM_TOL and max32 <= FP32_MAX_TOL, (norm32, max32)
    elem = (out16.double() - ref.double()).abs()
    bound = 2.0**-8 * ref.double().abs() + BF16_MAX_TOL * ref.double().abs().max()
    assert norm16 <= BF16_NORM_TOL and (elem <= bound).all(), (norm16, max16)


@pytest.mark.parametrize("m", [1, 8, 128])
def test_deterministic_and_graph_capturable(fp8, weights, m):
    weight, scales = weights["q_a_proj"]
    n, k = SHAPES["q_a_proj"]
    x = activations(m, k, seed=5)
    first = fp8.fp8_block_linear(x, weight, scales)
    assert torch.equal(first, fp8.fp8_block_linear(x, weight, scales))

    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fp8.fp8_block_linear(static_x, weight, scales)  # warm-up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fp8.fp8_block_linear(static_x, weight, scales)
    x2 = activations(m, k, seed=6)
    static_x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, fp8.fp8_block_linear(x2, weight, scales))


@pytest.mark.parametrize("m", [1, 5, 64])
@pytest.mark.parametrize("first, second", [("q_a_proj", "kv_a_proj_with_mqa"), ("q_b_proj", "o_proj")])
def test_pair_is_both_linears(fp8, weights, first, second, m):
    """Two weights of one K in one launch (the engine pairs q_kv_a with the indexer's wk and q_b with its wq_b):
    with the pair's tiles each half equals its own launch bit for bit, and with the defaults the twin."""
    (w1, s1), (w2, s2) = weights[first], weights[second]
    (n1, k), (n2, _) = SHAPES[first], SHAPES[second]
    x = activations(m, k, seed=m + n2)
    cfg = fp8.FP8GemmConfig.for_problem(m, n1 + n2, k, torch.cuda.get_device_properties(0).multi_processor_count)
    pair = fp8.fp8_block_linear_pair(x, (w1, s1), (w2, s2), config=cfg)
    assert pair.shape == (m, n1 + n2)
    assert torch.equal(pair[:, :n1], fp8.fp8_block_linear(x, w1, s1, config=cfg))
    assert torch.equal(pair[:, n1:], fp8.fp8_block_linear(x, w2, s2, config=cfg))
    for half, (w, s) in ((pair[:, :n1], (w1, s1)), (pair[:, n1:], (w2, s2))):
        ref = fp8.fp8_block_linear_ref(x, w, s, out_dtype=torch.float32)
        norm, _ = errors(half.float(), ref)
        assert norm <= BF16_NORM_TOL, norm
