"""Block-scaled FP8 GEMM (`kernels/fp8_gemm.py`) against its PyTorch twins, under the Triton interpreter.

TRITON_INTERPRET=1 is set before triton is imported. Shapes are small and
include partial 128-blocks on both N and K (N=200, K=300). Activation
quantisation must equal the twin bit for bit (fp8 bytes and scales); the linear
layer must equal the twin to float32 rounding, checked element by element
against the worst-case bound of recursive float32 summation (K * 2^-24 times
the sum of |terms|, for each side). The twin itself is checked against the
unquantised-activation product with e4m3's error bound. Under the interpreter
fp8 loads and `tl.dot` on fp8 operands are exact, but its fp32 -> e4m3
conversion is not round-to-nearest-even, so the kernels round in integer
arithmetic there; the GPU's hardware conversion is checked by
tests/gpu/test_fp8_gemm_gpu.py.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kernels import pdl  # noqa: E402
from kernels.fp8_gemm import (  # noqa: E402
    FP8_BLOCK,
    FP8GemmConfig,
    GEMV_MAX_WEIGHT,
    LONG_RANGE_BLOCKS,
    dequantize_weight_blocks,
    fp8_block_linear,
    fp8_block_linear_pair,
    fp8_block_linear_ref,
    quantize_activations,
    quantize_activations_ref,
    quantize_weight_blocks,
)

U32 = 2.0**-24  # float32 unit roundoff


@pytest.fixture(autouse=True)
def _interpreter_active():
    """Triton decides interpreter mode when it is imported: if a conftest imported it first, say so."""
    if not isinstance(tl.sum, InterpretedFunction):
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set (a conftest or plugin imported it "
                    "first); set it before any import, e.g. `TRITON_INTERPRET=1 pytest ...`")


def same_fp8(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.float8_e4m3fn and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def make_weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random FP8 weight whose blocks have scales spread over four decades."""
    w = torch.randn(n, k, generator=gen)
    w = w * torch.logspace(-2, 1, triton_blocks(n), dtype=torch.float32).repeat_interleave(FP8_BLOCK)[:n, None]
    return quantize_weight_blocks(w)


def triton_blocks(n: int) -> int:
    return -(-n // FP8_BLOCK)


def make_x(m: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(m, k, generator=gen) * torch.logspace(-1, 1, k)[None, :]  # groups of unequal range
    if m > 2:
        x[1] = 0  # an all-zero row: scale 1, zero output
    return x.to(dtype)


def abs_product(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """sum_k |a_k| |w_k| of the quantised operands (float64): the scale of float32 summation errors."""
    q, s = quantize_activations_ref(x.reshape(-1, x.shape[-1]))
    a = q.double() * s.double().repeat_interleave(FP8_BLOCK, 1)[:, : x.shape[-1]]
    return a.abs() @ dequantize_weight_blocks(weight, scales).double().abs().T


def assert_matches_twin(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> None:
    """out (any out dtype) equals the twin to float32 rounding (plus one rounding to out's dtype)."""
    ref = fp8_block_linear_ref(x, weight, scales, out_dtype=torch.float32).reshape(-1, weight.shape[0]).double()
    got = out.reshape(-1, weight.shape[0]).double()
    assert not got.isnan().any()
    k = x.shape[-1]
    tol = 2 * k * U32 * abs_product(x, weight, scales)
    if out.dtype != torch.float32:  # the kernel rounds to the out dtype once: at most one ulp (the
        # interpreter truncates fp32 -> bf16 instead of rounding to nearest, so a whole ulp)
        ulp = 2.0**-7 if out.dtype == torch.bfloat16 else 2.0**-10
        tol = tol + ulp * ref.abs() + 1e-30
    err = (got - ref).abs()
    worst = (err / tol.clamp_min(1e-30)).max().item()
    assert (err <= tol).all(), f"max error {err.max().item():.3e}, {worst:.2f}x the bound"


# --- activation quantisation ---------------------------------------------------------------


def e4m3_values() -> torch.Tensor:
    """Every finite non-negative e4m3fn value, ascending."""
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    v = v[torch.isfinite(v) & (v >= 0)]
    return v.unique().sort().values


def test_e4m3_rounding_is_nearest_even():
    """Every midpoint between neighbouring e4m3 values (ties), values just off them, subnormals and signs:
    a group led by 448 has scale 1, so x / scale is x itself."""
    v = e4m3_values()
    mids = (v[1:] + v[:-1]) / 2
    near = torch.cat([mids, torch.nextafter(mids, torch.zeros_like(mids)), torch.nextafter(mids, mids + 1), v])
    near = torch.cat([near, -near, torch.tensor([0.0, -0.0, 2.0**-12, -(2.0**-12), 2.0**-10])])
    per_group = FP8_BLOCK - 1
    groups = -(-near.numel() // per_group)
    x = torch.zeros(groups * FP8_BLOCK)
    for g in range(groups):
        chunk = near[g * per_group : (g + 1) * per_group]
        x[g * FP8_BLOCK] = 448.0
        x[g * FP8_BLOCK + 1 : g * FP8_BLOCK + 1 + chunk.numel()] = chunk
    x = x[None, :]
    q, s = quantize_activations(x)
    q_ref, s_ref = quantize_activations_ref(x)
    assert (s == 1).all() and torch.equal(s, s_ref)
    assert same_fp8(q, q_ref)
    assert same_fp8(q, x.to(torch.float8_e4m3fn))  # torch's own rounding: nearest, ties to even


@pytest.mark.parametrize("m, k, dtype", [(1, 300, torch.float32), (3, 128, torch.float16), (17, 1000, torch.bfloat16),
                                         (5, 40, torch.float32)])
def test_quantize_activations_matches_twin(m, k, dtype):
    gen = torch.Generator().manual_seed(m * 1000 + k)
    x = make_x(m, k, dtype, gen)
    q, s = quantize_activations(x)
    q_ref, s_ref = quantize_activations_ref(x)
    assert q.shape == (m, k) and s.shape == (m, triton_blocks(k)) and s.dtype == torch.float32
    assert same_fp8(q, q_ref) and torch.equal(s, s_ref)
    if m > 2:
        assert (s[1] == 1).all() and (q[1].float() == 0).all()
    # scale = group amax / 448, and the group's largest value maps to +-448
    assert q.float().abs().amax().item() == 448.0


def test_quantize_activations_strided_rows():
    gen = torch.Generator().manual_seed(4)
    big = torch.randn(6, 512, generator=gen)
    x = big[::2, 64:364]  # row stride 1024, unit last stride
    q, s = quantize_activations(x)
    q_ref, s_ref = quantize_activations_ref(x.contiguous())
    assert same_fp8(q, q_ref) and torch.equal(s, s_ref)


# --- linear layer --------------------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("n, k", [(200, 300), (256, 256), (72, 520)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_linear_matches_twin(m, n, k, dtype):
    gen = torch.Generator().manual_seed(m * 7919 + n * 31 + k + dtype.itemsize)
    weight, scales = make_weight(n, k, gen)
    x = make_x(m, k, dtype, gen)
    out = fp8_block_linear(x, weight, scales, out_dtype=torch.float32)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert_matches_twin(out, x, weight, scales)
    if m > 2:
        assert (out[1] == 0).all()


def test_linear_inside_pdl_launches_runs_plainly_under_the_interpreter():
    """Decode graphs launch inside `pdl.launches(True)`; without a Hopper GPU (here: the interpreter, which
    has no grid dependency control) the kernels launch plainly and compute the same."""
    gen = torch.Generator().manual_seed(5)
    weight, scales = make_weight(256, 512, gen)
    x = make_x(1, 512, torch.float32, gen)
    with pdl.launches(True):
        assert pdl.launch_options(x.device) == {"PDL": False}
        out = fp8_block_linear(x, weight, scales, out_dtype=torch.float32)
    assert_matches_twin(out, x, weight, scales)


CONFIGS = [
    FP8GemmConfig(block_m=16, block_n=32, swap_ab=True, split_k=3),
    FP8GemmConfig(block_m=16, block_n=64, swap_ab=False, group_m=2),
    FP8GemmConfig(block_m=32, block_n=16, swap_ab=True, split_k=2),
    FP8GemmConfig(block_m=64, block_n=128, swap_ab=False, split_k=2),
    FP8GemmConfig(block_m=16, block_n=32, swap_ab=False, group_m=3),
    FP8GemmConfig(gemv=True, block_n=8, gemv_block_k=256),  # one program per token and 8 rows, whole K
    FP8GemmConfig(gemv=True, block_n=128, gemv_block_k=128),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"m{c.block_m}n{c.block_n}s{c.split_k}g{c.group_m}"
                         + ("t" if c.swap_ab else ""))
def test_linear_configs(cfg):
    """Several M tiles (grouped order), partial N and K blocks, split-K with an uneven last range; a GEMV
    config, whose programs take one token each, on three tokens."""
    gen = torch.Generator().manual_seed(cfg.block_m + cfg.block_n + cfg.split_k)
    weight, scales = make_weight(200, 300, gen)
    x = make_x(3 if cfg.gemv else 70, 300, torch.float16, gen)
    out = fp8_block_linear(x, weight, scales, out_dtype=torch.float32, config=cfg)
    assert_matches_twin(out, x, weight, scales)


PAIR_CONFIGS = [
    FP8GemmConfig(block_m=16, block_n=64, swap_ab=True, split_k=3),  # the first weight's last tile partial
    FP8GemmConfig(block_m=32, block_n=32, swap_ab=False, group_m=2),
    FP8GemmConfig(gemv=True, block_n=8, gemv_block_k=256),
]


def _pair_id(v: object) -> str:
    return str(v) if isinstance(v, int) else "gemv" if v.gemv else f"m{v.block_m}s{v.split_k}"


@pytest.mark.parametrize("cfg,m", [(cfg, m) for cfg in PAIR_CONFIGS for m in (1, 5, 40) if not (cfg.gemv and m > 5)],
                         ids=_pair_id)
def test_linear_pair_is_both_linears_side_by_side(cfg, m):
    """Two weights of one K in one launch (N1 = 200: a partial 128-row scale block and, at 64-row tiles, a
    partial tile; N2 = 136): each column equals its own linear's with the same tiles, bit for bit, and the
    default tiles match the twins."""
    gen = torch.Generator().manual_seed(100 + m)
    (w1, s1), (w2, s2) = make_weight(200, 300, gen), make_weight(136, 300, gen)
    x = make_x(m, 300, torch.float16, gen)
    pair = fp8_block_linear_pair(x, (w1, s1), (w2, s2), torch.float32, config=cfg)
    assert pair.shape == (m, 336)
    assert torch.equal(pair[:, :200], fp8_block_linear(x, w1, s1, torch.float32, config=cfg))
    assert torch.equal(pair[:, 200:], fp8_block_linear(x, w2, s2, torch.float32, config=cfg))
    default = fp8_block_linear_pair(x, (w1, s1), (w2, s2), torch.float32)
    assert_matches_twin(default[:, :200], x, w1, s1)
    assert_matches_twin(default[:, 200:], x, w2, s2)


def test_linear_pair_refuses_mismatched_weights():
    gen = torch.Generator().manual_seed(3)
    x = make_x(2, 300, torch.float16, gen)
    with pytest.raises(ValueError):
        fp8_block_linear_pair(x, make_weight(200, 300, gen), make_weight(64, 256, gen))


@pytest.mark.parametrize("dtype, out_dtype", [(torch.float16, None), (torch.float32, torch.bfloat16),
                                              (torch.bfloat16, None), (torch.float16, torch.float32)])
def test_linear_dtypes_and_leading_dims(dtype, out_dtype):
    gen = torch.Generator().manual_seed(21)
    weight, scales = make_weight(200, 300, gen)
    x = make_x(6, 300, dtype, gen).reshape(2, 3, 300)
    out = fp8_block_linear(x, weight, scales, out_dtype)
    assert out.shape == (2, 3, 200) and out.dtype == (out_dtype or dtype)
    assert_matches_twin(out, x, weight, scales)
    ref = fp8_block_linear_ref(x, weight, scales, out_dtype)
    assert ref.shape == out.shape and ref.dtype == out.dtype


def test_linear_empty_and_strided_x():
    gen = torch.Generator().manual_seed(5)
    weight, scales = make_weight(200, 300, gen)
    assert fp8_block_linear(torch.empty(0, 300), weight, scales).shape == (0, 200)
    big = make_x(8, 400, torch.float32, gen)
    x = big[::2, 50:350]  # row stride 800
    out = fp8_block_linear(x, weight, scales, torch.float32)
    assert_matches_twin(out, x.contiguous(), weight, scales)


def test_twin_close_to_dequantised_product():
    """Quantising activations to e4m3 (3 mantissa bits) moves each normal value by at most 2^-4 of itself,
    a subnormal one by at most half a step, 2^-10 * scale: the error of out[m, n] is bounded by
    2^-4 sum_k |x_k w_k| + 2^-10 max_g(scale) sum_k |w_k| (plus float32 rounding)."""
    gen = torch.Generator().manual_seed(9)
    weight, scales = make_weight(200, 300, gen)
    x = make_x(17, 300, torch.float32, gen)
    wd = dequantize_weight_blocks(weight, scales).double()
    exact = x.double() @ wd.T
    got = fp8_block_linear_ref(x, weight, scales).double()
    _, s = quantize_activations_ref(x)
    bound = 2.0**-4 * (x.double().abs() @ wd.abs().T) + 2.0**-10 * s.double().amax(1, keepdim=True) * wd.abs().sum(1)
    bound = bound + 1e-6 * exact.abs().amax()
    assert ((got - exact).abs() <= bound).all()
    rel = (got - exact).norm() / exact.norm()
    assert rel < 2.0**-5, f"normwise error {rel:.3e} too large for e4m3 rounding"
    assert (fp8_block_linear(x, weight, scales).double() - exact).norm() / exact.norm() < 2.0**-5


@pytest.mark.parametrize("n, k", [(200, 300), (128, 256), (1, 5)])
def test_quantize_weight_blocks(n, k):
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen) * 3
    if n > 128 and k > 128:
        w[:128, 128:256] = 0  # an all-zero block
    q, s = quantize_weight_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (n, k) and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == (triton_blocks(n), triton_blocks(k))
    if n > 128 and k > 128:
        assert s[0, 1] == 1 and (q[:128, 128:256].float() == 0).all()
    # each block's largest magnitude maps to 448
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            blk = q[bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128].float().abs()
            assert blk.amax() == (448.0 if s[bi, bj] != 1 or blk.amax() > 0 else 0.0)
    deq = dequantize_weight_blocks(q, s)
    smax = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    assert ((deq - w).abs() <= 2.0**-4 * w.abs() + 2.0**-10 * smax).all()


GLM_SHAPES = [(2048, 6144), (2048, 2048), (576, 6144), (6144, 2048), (1536, 6144), (6144, 1536),
              (19360, 6144), (6144, 12288)]  # the last two: the drafting head and eh_proj (one token a pass)


@pytest.mark.parametrize("m", [1, 8, 32, 64, 128, 256, 1024, 4096, 32768])
def test_for_problem_configs(m):
    for n, k in GLM_SHAPES:
        cfg = FP8GemmConfig.for_problem(m, n, k)
        assert cfg == FP8GemmConfig.for_problem(m, n, k)  # a function of the shape alone
        kb = triton_blocks(k)
        assert cfg.gemv == (m == 1 and n * k < GEMV_MAX_WEIGHT), (n, k, cfg)  # a large weight streams in tiles
        assert 1 <= cfg.split_k <= kb and -(-kb // -(-kb // cfg.split_k)) == cfg.split_k  # no empty ranges
        if cfg.gemv:  # one token: whole-K programs of a few rows, one per 8 rows (72 for the narrowest)
            assert m == 1 and cfg.split_k == 1 and -(-n // cfg.block_n) >= 72, (n, k, cfg)
            continue
        tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
        programs = tiles * cfg.split_k
        if m > 128:
            assert programs >= 100, (n, k, cfg)  # prefill fills the GPU
        else:  # decode: at most a program an SM (unless the tiles alone are more, or each range is long), and
            # at least half of them
            assert programs <= max(132, tiles) or kb // cfg.split_k >= LONG_RANGE_BLOCKS, (n, k, cfg)
            assert 2 * programs > min(132, tiles * FP8GemmConfig.max_split(m, k)), (n, k, cfg)
        if cfg.split_k > 1 and m <= 128:
            assert cfg.split_k * m * n * 8 <= n * k, (n, k, cfg)  # partials at most half the weight bytes


def test_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(1)
    weight, scales = make_weight(200, 300, gen)
    x = make_x(3, 300, torch.float32, gen)
    bad = [
        (x.double(), weight, scales, None),  # x dtype
        (x.to(torch.int32), weight, scales, None),
        (x[:, :299], weight, scales, None),  # K mismatch
        (x, weight.float(), scales, None),  # weight not fp8
        (x, weight.view(torch.uint8), scales, None),
        (x, weight, scales[:, :2], None),  # scale shape
        (x, weight, scales.T.contiguous(), None),
        (x, weight, scales.double(), None),  # scale dtype
        (x, weight, scales, torch.int8),  # out dtype
        (torch.zeros(3, 600)[:, ::2], weight, scales, None),  # x last stride 2
        (x, torch.cat([weight, weight], 1)[:, :300], scales, None),  # weight not contiguous
        (x, weight[:0], scales[:0], None),  # N = 0
    ]
    for args in bad:
        with pytest.raises(ValueError):
            fp8_block_linear(*args)
    with pytest.raises(ValueError):
        fp8_block_linear(x, weight, scales, config=FP8GemmConfig(block_m=8))
    with pytest.raises(ValueError):
        fp8_block_linear(x, weight, scales, config=FP8GemmConfig(block_n=48))
    with pytest.raises(ValueError):
        fp8_block_linear(x, weight, scales, config=FP8GemmConfig(split_k=0))
    for gemv in (FP8GemmConfig(gemv=True, block_n=3), FP8GemmConfig(gemv=True, block_n=256),
                 FP8GemmConfig(gemv=True, gemv_block_k=96)):
        with pytest.raises(ValueError):
            fp8_block_linear(x, weight, scales, config=gemv)
    with pytest.raises(ValueError):
        quantize_activations(x.reshape(3, 1, 300))
    with pytest.raises(ValueError):
        quantize_activations(x.double())
    with pytest.raises(ValueError):
        quantize_weight_blocks(torch.zeros(3))
    with pytest.raises(ValueError):
        fp8_block_linear_ref(x, weight, scales[:, :2])
