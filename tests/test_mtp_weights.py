"""MTP layers' weights: the tiny checkpoint carries one, loading fills it only when it is built, the random init
and the tiny writer keep the target's weights whatever MTP layers exist, and the memory plan counts them.

The target's weights must not move when MTP layers are added: the engine is compared with transformers and
with stored expectations on the tiny checkpoint, and a random GLM-5.3-shaped model is the same with or
without its draft layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine.linear import WeightFormat
from engine.memory_plan import weight_bytes
from engine.model import GlmMoeDsaForCausalLM, build_model
from engine.model_config import ModelConfig
from engine.tiny import make_tiny
from engine.tp.tensor_parallel import TensorParallel
from engine.weight_map import SCALE_SUFFIX, published_slots
from engine.weights import dequantize_fp8_block, iter_checkpoint, load_weights, random_init
from kernels.fp8_gemm import quantize_weight_blocks
from tests.helpers import rewrite_checkpoint

ROOT = Path(__file__).resolve().parent.parent
MTP = "model.layers.6."  # the tiny model's MTP layer: num_hidden_layers is 6


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny-fp8"), seed=0, fp8=True)


def _format(fp8: bool) -> tuple[WeightFormat, torch.dtype]:
    return (WeightFormat("fp8"), torch.bfloat16) if fp8 else (WeightFormat(), torch.float32)


def _build(model_dir: Path, fp8: bool, num_draft_layers: int, tp: TensorParallel | None = None
           ) -> GlmMoeDsaForCausalLM:
    fmt, dtype = _format(fp8)
    return build_model(ModelConfig.from_dir(model_dir), tp or TensorParallel(), fmt, dtype, torch.device("cpu"),
                       num_draft_layers)


def _checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


def _published(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under their published names (views into the model)."""
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    return {name: slot.view(tensors) for name, slot in published_slots(model).items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("fp8", [False, True])
def test_tiny_checkpoint_has_a_published_mtp_layer(tiny_dir: Path, fp8_dir: Path, fp8: bool) -> None:
    model_dir = fp8_dir if fp8 else tiny_dir
    assert ModelConfig.from_dir(model_dir).num_nextn_predict_layers == 1
    stored = _checkpoint(model_dir)
    assert torch.equal(stored[MTP + "embed_tokens.weight"], stored["model.embed_tokens.weight"])
    assert torch.equal(stored[MTP + "shared_head.head.weight"], stored["lm_head.weight"])
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "mlp.experts.7.down_proj.weight", "mlp.gate.e_score_correction_bias", "self_attn.o_proj.weight"):
        assert MTP + name in stored
    assert not any(n.startswith(MTP + "self_attn.indexer.") for n in stored)
    # published FP8 checkpoints keep eh_proj plain and the block's linears FP8
    assert stored[MTP + "eh_proj.weight"].dtype == (torch.bfloat16 if fp8 else torch.float32)
    assert (MTP + "self_attn.q_b_proj.weight_scale_inv" in stored) == fp8


@pytest.mark.parametrize("fp8", [False, True])
def test_mtp_layer_loads_from_the_checkpoint_only_when_built(tiny_dir: Path, fp8_dir: Path, fp8: bool) -> None:
    """Built, every MTP tensor equals the checkpoint's (FP8 ones bit for bit, a stored-FP8 weight the model holds
    plain as its dequantised values); not built, nothing of it is read; the target loads the same either way."""
    model_dir = fp8_dir if fp8 else tiny_dir
    stored = _checkpoint(model_dir)
    with_mtp, without = _build(model_dir, fp8, 1), _build(model_dir, fp8, 0)
    load_weights(with_mtp, model_dir, _format(fp8)[1])
    load_weights(without, model_dir, _format(fp8)[1])
    assert len(with_mtp.mtp_layers) == 1 and not without.mtp_layers
    loaded, target = _published(with_mtp), _published(without)
    mtp_names = [n for n in loaded if n.startswith(MTP)]
    assert mtp_names and not any(n.startswith(MTP) for n in target)
    for name in mtp_names:
        value = stored[name]
        if loaded[name].dtype != torch.float8_e4m3fn and name + SCALE_SUFFIX in stored:
            value = dequantize_fp8_block(value, stored[name + SCALE_SUFFIX], loaded[name].dtype)
        assert torch.equal(_bits(loaded[name]), _bits(value.to(loaded[name].dtype))), name
    for name, tensor in target.items():
        assert torch.equal(_bits(loaded[name]), _bits(tensor)), name
    mtp = with_mtp.mtp_layers[0]
    assert (mtp.mlp.experts.w13.dtype == torch.float8_e4m3fn) == fp8
    assert (mtp.self_attn.o_proj.weight.dtype == torch.float8_e4m3fn) == fp8
    assert mtp.eh_proj.weight.dtype == _format(fp8)[1]


def test_an_fp8_eh_proj_loads_dequantised(fp8_dir: Path, tmp_path: Path) -> None:
    """The model holds eh_proj plain; a checkpoint that stores it FP8 gives its dequantised values."""
    name = MTP + "eh_proj.weight"

    def quantise_eh_proj(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if name in tensors:
            tensors[name], tensors[name + SCALE_SUFFIX] = quantize_weight_blocks(tensors[name].float())
        return tensors

    model_dir = rewrite_checkpoint(fp8_dir, tmp_path / "fp8-eh", quantise_eh_proj)
    stored = _checkpoint(model_dir)
    model = _build(model_dir, True, 1)
    load_weights(model, model_dir, torch.bfloat16)
    expected = dequantize_fp8_block(stored[name], stored[name + SCALE_SUFFIX], torch.bfloat16)
    assert stored[name].dtype == torch.float8_e4m3fn and torch.equal(model.mtp_layers[0].eh_proj.weight, expected)


def test_an_fp8_model_drafts_through_fp8_copies_of_the_head_and_eh_proj(fp8_dir: Path) -> None:
    """`prepare_drafting`: the drafting passes read FP8 copies of lm_head and eh_proj (block scales within the
    e4m3 rounding of the loaded weights); the verifying pass keeps the bf16 head. Drafts by the copy are the
    bf16 head's most probable tokens but where two logits nearly tie."""
    model = _build(fp8_dir, True, 1)
    load_weights(model, fp8_dir, torch.bfloat16)
    lm_head, eh_proj = model.lm_head.weight.detach().clone(), model.mtp_layers[0].eh_proj.weight.detach().clone()
    model.prepare_drafting()
    mtp = model.mtp_layers[0]
    assert model.lm_head.weight.dtype == torch.bfloat16 and torch.equal(model.lm_head.weight, lm_head)
    for copy, plain in ((model.draft_lm_head, lm_head), (mtp.eh_proj, eh_proj)):
        assert copy.weight.dtype == torch.float8_e4m3fn and copy.weight.shape == plain.shape
        error = (dequantize_fp8_block(copy.weight, copy.weight_scale_inv, torch.float32) - plain.float()).abs()
        assert float(error.max()) <= float(plain.float().abs().max()) / 16  # e4m3: 3 mantissa bits
    normed = torch.randn(64, model.cfg.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16()
    drafts, best = model.draft_tokens(normed), model.logits(normed).argmax(dim=-1)
    assert drafts.dtype == torch.int64 and float((drafts == best).float().mean()) >= 0.9
    dense = _build(fp8_dir, False, 1)
    dense.prepare_drafting()  # a dense model drafts through its own head
    assert dense.draft_lm_head is None and not isinstance(dense.mtp_layers[0].eh_proj, type(mtp.eh_proj))


def test_mtp_layers_copies_and_indexer_are_never_read(tiny_dir: Path, tmp_path: Path) -> None:
    """Published checkpoints also store an indexer in the MTP layer, which the engine's MTP layer does not
    have (it attends over the target's selection): loading skips it, as it skips the embedding and head copies."""
    def with_mtp_indexer(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        indexer = {k.replace("model.layers.0.", MTP): v.clone() for k, v in tensors.items()
                   if k.startswith("model.layers.0.self_attn.indexer.")}
        return {**tensors, **indexer}

    model_dir = rewrite_checkpoint(tiny_dir, tmp_path / "indexer", with_mtp_indexer)
    cfg = ModelConfig.from_dir(model_dir)
    assert any(n.startswith(MTP + "self_attn.indexer.") for n in _checkpoint(model_dir))
    read = [t.name for t in iter_checkpoint(model_dir, cfg, num_draft_layers=1)]
    mtp_read = [n for n in read if n.startswith(MTP)]
    assert mtp_read and not any(".indexer." in n or "embed_tokens" in n or "shared_head.head" in n for n in mtp_read)
    assert not any(t.name.startswith(MTP) for t in iter_checkpoint(model_dir, cfg))
    load_weights(_build(model_dir, False, 1), model_dir, torch.float32)


def test_a_checkpoint_without_the_built_mtp_layer_fails_clearly(tiny_dir: Path, tmp_path: Path) -> None:
    def strip(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in tensors.items() if not k.startswith(MTP)}

    stripped = rewrite_checkpoint(tiny_dir, tmp_path / "stripped", strip)
    load_weights(_build(stripped, False, 0), stripped, torch.float32)
    with pytest.raises(KeyError, match=r"lacks \d+ tensors .*model\.layers\.6\..*MTP layers \[6\]"):
        load_weights(_build(stripped, False, 1), stripped, torch.float32)


@pytest.mark.parametrize("fp8", [False, True])
def test_random_target_weights_do_not_depend_on_the_mtp_layers(tiny_dir: Path, fp8_dir: Path, fp8: bool) -> None:
    """At ten layers the MTP layer's names (`model.layers.10.*`) sort between the target's layers 1 and 2, as
    GLM-5.3's `model.layers.78.*` sort before its layer 8: drawn in name order, it would shift the target."""
    raw = json.loads(((fp8_dir if fp8 else tiny_dir) / "config.json").read_text())
    cfg = ModelConfig.from_dict({**raw, "num_hidden_layers": 10, "indexer_types": ["full", "shared"] * 5})
    fmt, dtype = _format(fp8)
    with_mtp, without = (build_model(cfg, TensorParallel(), fmt, dtype, torch.device("cpu"), n) for n in (1, 0))
    random_init(with_mtp, seed=7)
    random_init(without, seed=7)
    drawn, target = _published(with_mtp), _published(without)
    for name, tensor in target.items():
        assert torch.equal(_bits(drawn[name]), _bits(tensor)), name
    assert min(n for n in drawn if n.startswith("model.layers.10.")) < "model.layers.2."
    eh_proj = with_mtp.mtp_layers[0].eh_proj.weight
    assert 0.015 < float(eh_proj.float().std()) < 0.025  # drawn, not left as allocated


@pytest.mark.parametrize(("fp8", "tp_size"), [(False, 1), (False, 2), (True, 1)])
def test_memory_plan_counts_the_mtp_layers_bytes(tiny_dir: Path, fp8_dir: Path, fp8: bool, tp_size: int) -> None:
    cfg = ModelConfig.from_dir(fp8_dir if fp8 else tiny_dir)
    fmt, dtype = _format(fp8)
    for rank in range(tp_size):
        model = build_model(cfg, TensorParallel(rank, tp_size), fmt, dtype, torch.device("cpu"), num_draft_layers=1)
        model.hold_float32_parts()  # as the worker holds them
        model.prepare_drafting()
        allocated = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        assert weight_bytes(cfg, tp_size, fmt, dtype, num_draft_layers=1) == allocated
    assert weight_bytes(cfg, tp_size, fmt, dtype, num_draft_layers=1) > weight_bytes(cfg, tp_size, fmt, dtype)


def test_glm53_plan_counts_its_mtp_layer() -> None:
    cfg = ModelConfig.from_dir(ROOT / "configs" / "models" / "glm-5.3")
    fmt = WeightFormat("fp8")
    model = build_model(cfg, TensorParallel(0, 8), fmt, torch.bfloat16, torch.device("meta"), num_draft_layers=1)
    model.hold_float32_parts()
    model.prepare_drafting()
    allocated = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert weight_bytes(cfg, 8, fmt, torch.bfloat16, num_draft_layers=1) == allocated


def test_transformers_loads_the_tiny_target_and_leaves_the_mtp_layer(tiny_dir: Path) -> None:
    """transformers builds no MTP layer: it must find every target tensor and report only the MTP layer's
    tensors as unexpected."""
    transformers = pytest.importorskip("transformers")
    _, info = transformers.GlmMoeDsaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32,
                                                                output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert info["unexpected_keys"] and all(k.startswith(MTP) for k in info["unexpected_keys"])
