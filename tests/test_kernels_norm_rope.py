"""RMSNorm and rotary kernels (`kernels/rmsnorm.py`, `kernels/rope.py`) against the model's PyTorch forms, under
the Triton interpreter (TRITON_INTERPRET=1 before triton is imported), in float32 and float16 at small shapes,
with the strided inputs the model hands them (a split of a wider projection, a slice of the heads). bf16 at
GLM-5.3's shapes runs on the GPU (tests/gpu/test_norm_rope_gpu.py)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.layers import RMSNorm, apply_rope  # noqa: E402
from kernels.fp8_gemm import fp8_block_linear, quantize_activations, quantize_weight_blocks  # noqa: E402
from kernels.rmsnorm import add_rmsnorm, rmsnorm, rmsnorm_fp8, rmsnorm_pair  # noqa: E402
from kernels.rope import rope  # noqa: E402

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rmsnorm_equals_the_module(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    wide = (torch.randn(5, 96, generator=gen) * 3).to(dtype)
    x = wide[:, :80]  # rows strided like the latent split of kv_a_proj
    norm = RMSNorm(80, 1e-6).to(dtype)
    norm.weight.data = (torch.rand(80, generator=gen) + 0.5).to(dtype)
    got = rmsnorm(x, norm.weight, norm.eps)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, norm(x), **TOL[dtype])
    heads = wide[:, :64].reshape(5, 2, 32)  # per-head norm of a [T, H, D] tensor
    head_norm = RMSNorm(32, 1e-6).to(dtype)
    head_norm.weight.data = norm.weight.data[:32].clone()
    torch.testing.assert_close(rmsnorm(heads, head_norm.weight, 1e-6), head_norm(heads), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_rmsnorm_equals_the_add_then_the_module(dtype: torch.dtype) -> None:
    """The residual stream's sum is the dtype's own add bit for bit; its norm equals the module's."""
    gen = torch.Generator().manual_seed(1)
    x, residual = ((torch.randn(6, 80, generator=gen) * 3).to(dtype) for _ in range(2))
    norm = RMSNorm(80, 1e-6).to(dtype)
    norm.weight.data = (torch.rand(80, generator=gen) + 0.5).to(dtype)
    got, total = add_rmsnorm(x, residual, norm.weight, norm.eps)
    assert torch.equal(total, x + residual) and got.dtype == dtype
    torch.testing.assert_close(got, norm(x + residual), **TOL[dtype])
    want, want_total = norm.add_forward(x, residual)  # the CPU form the model runs off the GPU
    assert torch.equal(want_total, total)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_equals_apply_rope(dtype: torch.dtype, interleaved: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    t, heads, rope_dim = 6, 3, 16
    angles = torch.rand(t, rope_dim // 2, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q = torch.randn(t, heads, 40, generator=gen).to(dtype)
    # the MLA query's rope part: the last 16 of 40 dimensions of each head (strided heads, no rest)
    got = rope(q[..., 24:], cos, sin, rope_dim, interleaved)
    torch.testing.assert_close(got, apply_rope(q[..., 24:].float(), cos.float(), sin.float(), interleaved).to(dtype),
                               **TOL[dtype])
    # the indexer's: the first 16 of 40 rotated, the rest copied
    got = rope(q, cos, sin, rope_dim, interleaved)
    want = torch.cat([apply_rope(q[..., :16].float(), cos.float(), sin.float(), interleaved).to(dtype), q[..., 16:]], -1)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(got[..., 16:], q[..., 16:])
    # a 2-D key, a split of a wider row
    wide = torch.randn(t, 56, generator=gen).to(dtype)
    got = rope(wide[:, 40:], cos, sin, rope_dim, interleaved)
    torch.testing.assert_close(got, apply_rope(wide[:, 40:].float(), cos.float(), sin.float(), interleaved).to(dtype),
                               **TOL[dtype])


def test_bad_shapes_are_refused() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(ValueError):
        rmsnorm(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError):
        rope(x, torch.ones(4, 3), torch.ones(4, 3), 8, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dim", [256, 200])  # whole 128-column groups, and a partial last group
def test_rmsnorm_fp8_writes_the_gemm_input_a_linear_would_make(dtype: torch.dtype, dim: int) -> None:
    """The norm's FP8 copy is bit for bit what the GEMM's own quantisation makes of the norm, so an FP8 linear
    fed it gives the same output as one that quantises the norm itself; with a residual, the sum too."""
    gen = torch.Generator().manual_seed(dim)
    x, residual = ((torch.randn(4, dim, generator=gen) * 3).to(dtype) for _ in range(2))
    weight = (torch.rand(dim, generator=gen) + 0.5).to(dtype)
    out, total, quant = rmsnorm_fp8(x, weight, 1e-6, residual)
    want, want_total = add_rmsnorm(x, residual, weight, 1e-6)
    assert torch.equal(out, want) and torch.equal(total, want_total)
    q, scales = quantize_activations(out)
    assert torch.equal(quant.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(quant.scales, scales)
    w, ws = quantize_weight_blocks(torch.randn(64, dim, generator=gen))
    assert torch.equal(fp8_block_linear(out, w, ws, x_fp8=quant), fp8_block_linear(out, w, ws))
    plain, none, _ = rmsnorm_fp8(x, weight, 1e-6)
    assert none is None and torch.equal(plain, rmsnorm(x, weight, 1e-6))
    with pytest.raises(ValueError):
        fp8_block_linear(out[:2], w, ws, x_fp8=quant)  # a quantisation of other rows is refused


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rmsnorm_pair_is_two_norms_joined(dtype: torch.dtype) -> None:
    """The MTP layer's joined input in one launch: [norm(x), norm2(x2)] bit for bit the two norms concatenated,
    its FP8 copy bit for bit the quantisation of that concatenation (a strided second input included)."""
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(3, 256, generator=gen) * 3).to(dtype)
    x2 = (torch.randn(3, 512, generator=gen) * 2).to(dtype)[:, 128:384]  # rows 512 apart
    weight, weight2 = ((torch.rand(256, generator=gen) + 0.5).to(dtype) for _ in range(2))
    joined, quant = rmsnorm_pair(x, weight, x2, weight2, 1e-6, fp8=True)
    want = torch.cat([rmsnorm(x, weight, 1e-6), rmsnorm(x2, weight2, 1e-6)], dim=-1)
    assert torch.equal(joined, want)
    q, scales = quantize_activations(want)
    assert torch.equal(quant.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(quant.scales, scales)
    plain, none = rmsnorm_pair(x, weight, x2, weight2, 1e-6, fp8=False)
    assert none is None and torch.equal(plain, want)
    narrow, none = rmsnorm_pair(x[:, :96], weight[:96], x2[:, :96], weight2[:96], 1e-6, fp8=False)  # any D unquantised
    assert none is None and torch.equal(narrow, torch.cat([rmsnorm(x[:, :96], weight[:96], 1e-6),
                                                           rmsnorm(x2[:, :96], weight2[:96], 1e-6)], dim=-1))
    with pytest.raises(ValueError):
        rmsnorm_pair(x[:, :200], weight[:200], x2[:, :200], weight2[:200], 1e-6, fp8=True)  # D % 128 != 0
