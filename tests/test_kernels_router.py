"""The router's one-launch selection (`kernels/router.py`) against `engine.layers.Router`'s PyTorch form, under
the Triton interpreter: the same experts and float32 weights, for grouped routing (the tiny model's two groups)
and GLM-5.3's 256 experts in one group, with and without the shared expert appended."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.layers import Router  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402
from engine.tiny import TINY_CONFIG  # noqa: E402
from kernels.router import ROUTER_FMA_TOKENS, route, router_logits  # noqa: E402


@pytest.mark.parametrize(("experts", "groups", "topk_group", "k"), [(8, 2, 1, 2), (16, 4, 2, 4), (256, 1, 1, 8)])
@pytest.mark.parametrize("shared_slot", [-1, 5])
def test_route_equals_the_router(experts: int, groups: int, topk_group: int, k: int, shared_slot: int) -> None:
    cfg = ModelConfig.from_dict(dict(TINY_CONFIG, vocab_size=448, n_routed_experts=experts, n_group=groups, topk_group=topk_group,
                                     num_experts_per_tok=k))
    router = Router(cfg)
    gen = torch.Generator().manual_seed(experts + k)
    router.weight.data = torch.randn(experts, cfg.hidden_size, generator=gen) * 0.2
    router.e_score_correction_bias = torch.randn(experts, generator=gen) * 0.05
    x = torch.randn(33, cfg.hidden_size, generator=gen)
    want_w, want_ids = router(x, shared_slot)
    logits = torch.nn.functional.linear(x, router.weight)
    got_w, got_ids = route(logits, router.e_score_correction_bias, groups, topk_group, k, cfg.norm_topk_prob,
                           cfg.routed_scaling_factor, shared_slot)
    assert got_ids.shape == want_ids.shape == (33, k + (shared_slot >= 0))
    # the reference's order is unspecified: compare each token's experts sorted, weights along
    order_got, order_want = got_ids.long().sort(1), want_ids.sort(1)
    assert torch.equal(order_got.values, order_want.values)
    torch.testing.assert_close(got_w.gather(1, order_got.indices), want_w.gather(1, order_want.indices),
                               rtol=1e-6, atol=1e-7)


def test_route_orders_negative_scores_and_breaks_ties_to_the_lower_expert() -> None:
    """Biased scores below zero rank as floats do (the kernel compares their bits as integers), and equal
    scores go to the lower expert id, the order `torch.topk`'s stable twin gives."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 64, generator=gen)
    bias = -2.0 + 0.3 * torch.randn(64, generator=gen)  # every biased score negative
    _, ids = route(logits, bias, 1, 1, 6, True, 1.0)
    want = (logits.sigmoid() + bias).topk(6, dim=1).indices
    assert torch.equal(ids.long(), want)
    _, tied = route(torch.zeros(2, 64), torch.zeros(64), 1, 1, 6, True, 1.0)
    assert tied.tolist() == [list(range(6))] * 2


def test_bad_routing_is_refused() -> None:
    with pytest.raises(ValueError):
        route(torch.zeros(2, 12), torch.zeros(12), 1, 1, 2, True, 1.0)  # 12 experts: not a power of two


@pytest.mark.parametrize(("tokens", "experts", "hidden"), [(1, 256, 1024), (2, 64, 300), (21, 40, 700), (3, 16, 200)])
def test_router_logits_sum_to_the_float32_product(tokens: int, experts: int, hidden: int) -> None:
    """The partial sums over K ranges add up to x.float() @ W.T (bf16 activations, a float32 weight, edge tiles
    in tokens, experts and K), and routing on the partials picks what routing on their sum picks."""
    gen = torch.Generator().manual_seed(tokens + experts)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    weight = torch.randn(experts, hidden, generator=gen) * 0.1
    parts = router_logits(x, weight)
    assert parts.dtype == torch.float32 and parts.shape[1:] == (tokens, experts)
    # a token or two: summed by the last K range of each expert tile; more: a partial sum per range
    assert parts.shape[0] == 1 if tokens <= ROUTER_FMA_TOKENS else parts.shape[0] > 1 or hidden < 512
    want = torch.nn.functional.linear(x.float(), weight)
    torch.testing.assert_close(parts.sum(0), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(router_logits(x, weight).sum(0), parts.sum(0), rtol=0, atol=0)  # counters re-armed
    if experts & (experts - 1) == 0:
        bias = torch.randn(experts, generator=gen) * 0.05
        got_w, got_ids = route(parts, bias, 1, 1, 4, True, 2.5, experts)
        want_w, want_ids = route(parts.sum(0), bias, 1, 1, 4, True, 2.5, experts)
        assert got_ids.dtype == torch.int32 and torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("tokens", [1, 5])
def test_scaled_logits_equal_the_separate_multiply(tokens: int) -> None:
    """`out_scale` (the indexer's head weights times n_heads**-0.5) gives the float32 product that multiplying the
    summed logits afterwards gives, bit for bit; partial sums refuse it."""
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 700, generator=gen).to(torch.bfloat16)
    weight = torch.randn(32, 700, generator=gen) * 0.1
    scale = 32**-0.5
    got = router_logits(x, weight, fma_tokens=8, out_scale=scale)
    assert got.shape == (1, tokens, 32)
    assert torch.equal(got, router_logits(x, weight, fma_tokens=8) * scale)
    with pytest.raises(ValueError):
        router_logits(x, weight, fma_tokens=0, out_scale=scale)


@pytest.mark.parametrize("tokens", [1, 3, 8, 40])
def test_bf16_weight_logits_are_the_exact_products(tokens: int) -> None:
    """A bf16 router weight (the model's dtype, as the reference holds it) with bf16 activations: every form
    (float32 products for a token or two, one bf16 dot a tile above) gives the float64 product to float32
    summation error."""
    gen = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(tokens, 640, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(48, 640, generator=gen) * 0.1).to(torch.bfloat16)
    parts = router_logits(x, weight)
    want = x.double() @ weight.double().T
    assert parts.shape[0] == 1 if tokens <= ROUTER_FMA_TOKENS else parts.shape[0] > 1
    assert (parts.sum(0).double() - want).abs().max() <= 1e-6 * want.abs().max()
