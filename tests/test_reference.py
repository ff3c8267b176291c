"""The model against transformers' GlmMoeDsaForCausalLM, the numerical reference.

float32 mode: same greedy tokens for 32 new tokens and logits within 1e-4
relative. bf16 and FP8-KV modes: scored against transformers' float32 logits
on the same sequence (teacher forcing), within the tolerances stated here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import (
    REFERENCE_CONFIGS,
    LogitsRecorder,
    greedy,
    hf_greedy,
    hf_logits_of,
    make_engine,
    save_hf_model,
)

NUM_NEW = 32
PROMPT_LEN = 70


def _prompt(seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((ours - ref).abs().amax(-1) / ref.abs().amax(-1)).max())


@pytest.fixture(scope="module", params=[("wide-latent", 1), ("grouped-router", 2), ("tiny", 0)])
def reference_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path):
    name, seed = request.param
    if name == "tiny":
        model_dir = tiny_dir
    else:
        model_dir = save_hf_model(REFERENCE_CONFIGS[name], tmp_path_factory.mktemp(name), seed)
    engine = make_engine(model_dir, max_num_batched_tokens=48)  # chunked prefill on the way
    vocab = min(engine.model_config.vocab_size, 256)
    prompt = _prompt(seed, vocab)
    ref_tokens, ref_logits = hf_greedy(model_dir, prompt, NUM_NEW)
    return model_dir, prompt, ref_tokens, ref_logits


def test_float32_matches_transformers(reference_case) -> None:
    model_dir, prompt, ref_tokens, ref_logits = reference_case
    engine = make_engine(model_dir, max_num_batched_tokens=48)
    assert engine.model_config.index_topk < len(prompt)
    recorder = LogitsRecorder(engine)
    [out] = engine.generate([prompt], [greedy(NUM_NEW)])
    assert out.token_ids == ref_tokens
    assert _rel_err(recorder.of(out.request_id), ref_logits) < 1e-4


def _cosine_and_top1(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    cosine = torch.nn.functional.cosine_similarity(ours, ref, dim=-1).mean()
    return float(cosine), float((ours.argmax(-1) == ref.argmax(-1)).float().mean())


def _hf_bf16_logits(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    from transformers import GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([token_ids])).logits[0].float()


# Random-weight models amplify rounding: a bf16 difference can flip an expert choice or a
# top-K entry and move the logits a lot. So lower precisions are judged against what
# transformers' own bf16 run achieves on the same sequence, and FP8 KV by a stated floor.
@pytest.mark.parametrize(("dtype", "kv_dtype"), [("bfloat16", "bf16"), ("float32", "fp8"), ("bfloat16", "fp8")])
def test_reduced_precision_tracks_reference(reference_case, dtype: str, kv_dtype: str) -> None:
    """Teacher-forced: our logits along our own greedy sequence vs transformers float32 on it."""
    model_dir, prompt, _, _ = reference_case
    engine = make_engine(model_dir, dtype=dtype, kv_dtype=kv_dtype)
    recorder = LogitsRecorder(engine)
    [out] = engine.generate([prompt], [greedy(NUM_NEW)])
    sequence = prompt + out.token_ids
    window = slice(PROMPT_LEN - 1, PROMPT_LEN - 1 + NUM_NEW)
    ref = hf_logits_of(model_dir, sequence)[window]
    cosine, top1 = _cosine_and_top1(recorder.of(out.request_id), ref)
    hf_cosine, hf_top1 = _cosine_and_top1(_hf_bf16_logits(model_dir, sequence)[window], ref)
    if kv_dtype == "bf16":
        assert cosine >= hf_cosine - 0.02 and top1 >= hf_top1 - 0.1, (cosine, top1, hf_cosine, hf_top1)
    else:
        assert cosine >= min(0.8, hf_cosine - 0.1) and top1 >= min(0.45, hf_top1 - 0.2), (cosine, top1)
