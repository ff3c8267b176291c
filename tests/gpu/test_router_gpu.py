"""The router's one-launch selection on the GPU at GLM-5.3's routing (256 experts, one group, top-8, shared
expert appended) chooses what `engine.layers.Router` chooses on the CPU, with float32 weights."""

from __future__ import annotations

import pytest
import torch

from engine.layers import Router
from engine.model_config import ModelConfig
from engine.tiny import TINY_CONFIG

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_router_on_the_gpu_matches_the_cpu() -> None:
    cfg = ModelConfig.from_dict(dict(TINY_CONFIG, vocab_size=448, hidden_size=512, n_routed_experts=256, n_group=1,
                                     topk_group=1, num_experts_per_tok=8))
    router = Router(cfg)
    gen = torch.Generator().manual_seed(5)
    router.weight.data = torch.randn(256, 512, generator=gen) * 0.05
    router.e_score_correction_bias = torch.randn(256, generator=gen) * 0.02
    x = torch.randn(128, 512, generator=gen)
    want_w, want_ids = router(x, 256)
    got_w, got_ids = router.cuda()(x.cuda(), 256)
    got_ids, got_w = got_ids.cpu().long(), got_w.cpu()
    order_got, order_want = got_ids.sort(1), want_ids.sort(1)
    # a GPU matmul may round a logit differently from the CPU's: allow a near-tie to swap the 8th expert
    same = (order_got.values == order_want.values).all(1)
    assert same.float().mean() >= 0.97, same.float().mean()
    torch.testing.assert_close(got_w.gather(1, order_got.indices)[same], want_w.gather(1, order_want.indices)[same],
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 4, 8, 32])
def test_decode_router_logits_at_glm_shapes(tokens: int) -> None:
    """Decode batches of a float32 weight take the partial-sum logits (tf32x3 dots): their sum is the float32
    product within float32 rounding at GLM-5.3's 256 x 6144 router, and routing on them picks the float32
    product's experts."""
    from kernels.router import ROUTER_PARTIAL_TOKENS, route, router_logits

    assert tokens <= ROUTER_PARTIAL_TOKENS
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    weight = torch.randn(256, 6144, generator=gen, device="cuda") * 0.02
    x = torch.randn(tokens, 6144, generator=gen, device="cuda").to(torch.bfloat16)
    parts = router_logits(x, weight)
    want = torch.nn.functional.linear(x.float(), weight)
    torch.testing.assert_close(parts.sum(0), want, rtol=1e-5, atol=2e-5)
    bias = torch.zeros(256, device="cuda")
    _, got_ids = route(parts, bias, 1, 1, 8, True, 2.5, 256)
    _, want_ids = route(want, bias, 1, 1, 8, True, 2.5, 256)
    same = (got_ids.sort(1).values == want_ids.sort(1).values).all(1)
    assert same.float().mean() >= 0.9, same.float().mean()


@pytest.mark.parametrize("tokens", [1, 4, 8, 32, 64, 128])
def test_decode_router_logits_of_a_bf16_weight(tokens: int) -> None:
    """A bf16 router weight (a serving model's): one bf16 dot a tile, every product exact, so the sum of the
    partials is the float32 product within the tensor core's accumulation error, and routing on them picks the
    float32 product's experts."""
    from kernels.router import route, router_logits

    gen = torch.Generator(device="cuda").manual_seed(50 + tokens)
    weight = (torch.randn(256, 6144, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
    x = torch.randn(tokens, 6144, generator=gen, device="cuda").to(torch.bfloat16)
    parts = router_logits(x, weight)
    want = x.double() @ weight.double().T
    assert (parts.sum(0).double() - want).abs().max().item() <= 2e-5
    bias = torch.zeros(256, device="cuda")
    _, got_ids = route(parts, bias, 1, 1, 8, True, 2.5, 256)
    _, want_ids = route(want.float(), bias, 1, 1, 8, True, 2.5, 256)
    same = (got_ids.sort(1).values == want_ids.sort(1).values).all(1)
    assert same.float().mean() >= 0.9, same.float().mean()
