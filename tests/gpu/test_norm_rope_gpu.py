"""RMSNorm and rotary kernels at GLM-5.3's shapes in bf16 on the GPU, against the eager forms computed in
float32 and rounded once: within one bf16 rounding (the eager bf16 forms round every intermediate)."""

from __future__ import annotations

import pytest
import torch

from engine.layers import RMSNorm, apply_rope
from kernels.rmsnorm import add_rmsnorm, rmsnorm
from kernels.rope import rope

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16 = dict(rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize(("rows", "width", "dim"), [(1, 6144, 6144), (64, 6144, 6144), (64, 576, 512), (8, 2048, 2048)])
def test_rmsnorm_bf16(rows: int, width: int, dim: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows + dim)
    x = (torch.randn(rows, width, device="cuda", generator=gen) * 4).bfloat16()[:, :dim]
    weight = (torch.rand(dim, device="cuda", generator=gen) + 0.5).bfloat16()
    norm = RMSNorm(dim, 1e-5).cuda().float()
    norm.weight.data = weight.float()
    want = norm(x.float()).bfloat16()
    torch.testing.assert_close(rmsnorm(x, weight, 1e-5), want, **BF16)


@pytest.mark.parametrize("rows", [1, 64])
def test_add_rmsnorm_bf16(rows: int) -> None:
    """The residual sum is torch's bf16 add bit for bit, its norm within one rounding of float32."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x, residual = ((torch.randn(rows, 6144, device="cuda", generator=gen) * 4).bfloat16() for _ in range(2))
    weight = (torch.rand(6144, device="cuda", generator=gen) + 0.5).bfloat16()
    got, total = add_rmsnorm(x, residual, weight, 1e-5)
    assert torch.equal(total, x + residual)
    norm = RMSNorm(6144, 1e-5).cuda().float()
    norm.weight.data = weight.float()
    torch.testing.assert_close(got, norm(total.float()).bfloat16(), **BF16)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_bf16(interleaved: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(3)
    t = 64
    angles = torch.rand(t, 32, device="cuda", generator=gen) * 100
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    q = torch.randn(t, 8, 256, device="cuda", generator=gen).bfloat16()  # 8 heads of 192 nope + 64 rope (padded)
    want = apply_rope(q[..., 192:].float(), cos.float(), sin.float(), interleaved).bfloat16()
    torch.testing.assert_close(rope(q[..., 192:], cos, sin, 64, interleaved), want, **BF16)
    idx_q = torch.randn(t, 32, 128, device="cuda", generator=gen).bfloat16()  # indexer: rope first, then the rest
    got = rope(idx_q, cos, sin, 64, interleaved)
    want = apply_rope(idx_q[..., :64].float(), cos.float(), sin.float(), interleaved).bfloat16()
    torch.testing.assert_close(got[..., :64], want, **BF16)
    assert torch.equal(got[..., 64:], idx_q[..., 64:])


@pytest.mark.parametrize(("rows", "dim"), [(1, 6144), (64, 6144), (8, 2048)])
def test_rmsnorm_fp8_bf16(rows: int, dim: int) -> None:
    """The norm's FP8 copy (hardware e4m3 conversion) is bit for bit the GEMM's own quantisation of the norm."""
    from kernels.fp8_gemm import quantize_activations
    from kernels.rmsnorm import rmsnorm_fp8

    gen = torch.Generator(device="cuda").manual_seed(rows * dim)
    x, residual = ((torch.randn(rows, dim, device="cuda", generator=gen) * 4).bfloat16() for _ in range(2))
    weight = (torch.rand(dim, device="cuda", generator=gen) + 0.5).bfloat16()
    out, total, quant = rmsnorm_fp8(x, weight, 1e-5, residual)
    want, want_total = add_rmsnorm(x, residual, weight, 1e-5)
    assert torch.equal(out, want) and torch.equal(total, want_total)
    q, scales = quantize_activations(out)
    assert torch.equal(quant.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(quant.scales, scales)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_rmsnorm_pair_bf16(rows: int) -> None:
    """The MTP layer's joined input at GLM-5.3's hidden size: bit for bit the two norms concatenated and the
    GEMM's own quantisation of that (the second input in a separate allocation, as the engine passes it)."""
    from kernels.fp8_gemm import quantize_activations
    from kernels.rmsnorm import rmsnorm_pair

    gen = torch.Generator(device="cuda").manual_seed(rows)
    x, x2 = ((torch.randn(rows, 6144, device="cuda", generator=gen) * 4).bfloat16() for _ in range(2))
    weight, weight2 = ((torch.rand(6144, device="cuda", generator=gen) + 0.5).bfloat16() for _ in range(2))
    joined, quant = rmsnorm_pair(x, weight, x2, weight2, 1e-5, fp8=True)
    want = torch.cat([rmsnorm(x, weight, 1e-5), rmsnorm(x2, weight2, 1e-5)], dim=-1)
    assert torch.equal(joined, want)
    q, scales = quantize_activations(want)
    assert torch.equal(quant.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(quant.scales, scales)


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_mla_query_bf16(rows: int) -> None:
    """The absorbed query at one rank's GLM-5.3 shapes (8 heads, Dn 192, Dr 64, Dl 512) equals the eager einsum,
    rotary and concatenation within one bf16 rounding."""
    from kernels.mla_query import mla_query, mla_query_ref

    gen = torch.Generator(device="cuda").manual_seed(rows)
    q = torch.randn(rows, 8 * 256, device="cuda", generator=gen).bfloat16().view(rows, 8, 256)
    w = (torch.randn(8 * 448, 512, device="cuda", generator=gen) * 0.05).bfloat16().view(8, 448, 512)
    angles = torch.rand(rows, 32, device="cuda", generator=gen) * 6
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    got = mla_query(q, w[:, :192, :], cos, sin, 64, True)
    torch.testing.assert_close(got, mla_query_ref(q, w[:, :192, :], cos, sin, 64, True), **BF16)


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_mla_output_bf16(rows: int) -> None:
    """The absorbed output at one rank's GLM-5.3 shapes (8 heads, Dv 256, Dl 512) equals the eager einsum within
    one bf16 rounding."""
    from kernels.mla_output import mla_output, mla_output_ref

    gen = torch.Generator(device="cuda").manual_seed(rows)
    o = torch.randn(rows, 8, 512, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(8 * 448, 512, device="cuda", generator=gen) * 0.05).bfloat16().view(8, 448, 512)
    torch.testing.assert_close(mla_output(o, w[:, 192:, :]), mla_output_ref(o, w[:, 192:, :]), **BF16)


@pytest.mark.parametrize("rows", [1, 64])
def test_pack_with_norm_and_rotation_bf16(rows: int) -> None:
    """The FP8 row write that normalises the latent and rotates the key itself (GLM-5.3: Dl 512, Dr 64) stores
    the rope bytes of the rotary kernel exactly and the latent of the norm kernel within one e4m3 step."""
    from kernels import fp8_pack, fp8_rows
    from kernels.rmsnorm import rmsnorm

    gen = torch.Generator(device="cuda").manual_seed(rows)
    raw = (torch.randn(rows, 2624, device="cuda", generator=gen) * 2).bfloat16()
    latent, k_rope = raw[:, 2048:2560], raw[:, 2560:]
    weight = (torch.rand(512, device="cuda", generator=gen) + 0.5).bfloat16()
    angles = torch.rand(rows, 32, device="cuda", generator=gen) * 6
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    row = fp8_rows.mla_row_bytes(512, 64)
    place = fp8_pack.RowPlacement(64, 0, row)
    slots = torch.randperm(4 * 64, device="cuda", generator=gen)[:rows]
    got = torch.zeros((4, 64 * row), dtype=torch.uint8, device="cuda")
    want = got.clone()
    fp8_pack.pack_mla_rows_into(latent, k_rope, got, slots, place, fp8_pack.LatentPrep(weight, 1e-6, cos, sin, True))
    fp8_pack.pack_mla_rows_into(rmsnorm(latent, weight, 1e-6), rope(k_rope, cos, sin, 64, True), want, slots, place)
    got_rows, want_rows = got.view(-1, row)[slots], want.view(-1, row)[slots]
    assert torch.equal(got_rows[:, row - 128:], want_rows[:, row - 128:]), "rope bytes"
    got_vals, want_vals = (fp8_rows.unpack_mla_rows(r, 512, 64)[:, :512] for r in (got_rows, want_rows))
    step = want_vals.abs().amax(dim=1, keepdim=True) / 448 * 32
    assert ((got_vals - want_vals).abs() <= step).all()
    assert (got_vals == want_vals).float().mean() > 0.99
