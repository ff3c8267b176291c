"""The absorbed MLA output kernel (`kernels.mla_output`) against the eager einsum, under the Triton interpreter
(TRITON_INTERPRET=1 before triton is imported) in float32 and float16. bf16 at GLM-5.3's shapes:
tests/gpu/test_norm_rope_gpu.py."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.mla_output import mla_output, mla_output_ref  # noqa: E402

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens, dl", [(1, 64), (19, 64), (40, 256)])
def test_mla_output_equals_the_einsum(dtype, tokens, dl):
    """o strided like the sparse MLA output of a wider buffer; w_v the value half of kv_b_proj's weight. The
    latent in one K step up to 16 tokens (and at 19 here, Dl being small), in two at 40 tokens and Dl 256."""
    gen = torch.Generator().manual_seed(tokens)
    heads, dn, dv = 2, 32, 128
    o = torch.randn(tokens, heads, dl + 16, generator=gen).to(dtype)[..., :dl]
    w = (torch.randn(heads * (dn + dv), dl, generator=gen) * 0.2).to(dtype).view(heads, dn + dv, dl)
    x = mla_output(o, w[:, dn:, :])
    assert x.shape == (tokens, heads * dv) and x.is_contiguous()
    torch.testing.assert_close(x, mla_output_ref(o, w[:, dn:, :]), **TOL[dtype])


def test_mla_output_refuses_bad_shapes():
    o = torch.randn(2, 2, 64)
    with pytest.raises(ValueError):
        mla_output(o, torch.randn(2, 40, 64))  # Dv 40: not a multiple of 16
    with pytest.raises(ValueError):
        mla_output(o, torch.randn(2, 128, 64).half())
