"""The absorbed MLA query kernel (`kernels.mla_query`) against its twin and the model's eager form, under the
Triton interpreter (TRITON_INTERPRET=1 before triton is imported) in float32 and float16 (the interpreter's
bf16 dot is not trustworthy; bf16 at GLM-5.3's shapes runs on the GPU, tests/gpu/test_norm_rope_gpu.py)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.layers import rotate  # noqa: E402
from kernels.mla_query import mla_query, mla_query_ref  # noqa: E402

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens, interleaved, latent", [(1, True, 256), (19, False, 256), (3, True, 96)])
def test_mla_query_equals_einsum_rope_cat(dtype, tokens, interleaved, latent):
    """q as q_b_proj's output per head (Dn = 48: one K step of 64 with its tail masked up to 16 tokens, as
    GLM-5.3's 192 is one of 256; three steps of 16 at 19 tokens; Dr = 16), w_k a strided half of kv_b_proj's
    weight."""
    gen = torch.Generator().manual_seed(tokens + latent)
    heads, dn, dr, dv = 3, 48, 16, 24
    q = torch.randn(tokens, heads * (dn + dr), generator=gen).to(dtype).view(tokens, heads, dn + dr)
    w = (torch.randn(heads * (dn + dv), latent, generator=gen) * 0.2).to(dtype).view(heads, dn + dv, latent)
    w_k = w[:, :dn, :]
    angles = torch.rand(tokens, dr // 2, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got = mla_query(q, w_k, cos, sin, dr, interleaved)
    assert got.shape == (tokens, heads, latent + dr) and got.is_contiguous()
    torch.testing.assert_close(got, mla_query_ref(q, w_k, cos, sin, dr, interleaved), **TOL[dtype])
    model = torch.cat([torch.einsum("thd,hdc->thc", q[..., :dn], w_k), rotate(q[..., dn:], cos, sin, dr, interleaved)],
                      dim=-1)  # the model's CPU form
    torch.testing.assert_close(got, model, **TOL[dtype])


def test_mla_query_refuses_bad_shapes():
    q = torch.randn(2, 3, 40)
    with pytest.raises(ValueError):
        mla_query(q, torch.randn(3, 24, 64), torch.ones(2, 8), torch.ones(2, 8), 16, True)  # Dn 24: not 16k
    with pytest.raises(ValueError):
        mla_query(torch.randn(2, 3, 48), torch.randn(3, 32, 64).half(), torch.ones(2, 8), torch.ones(2, 8), 16, True)
