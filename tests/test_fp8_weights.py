"""FP8 block-scaled weights stay FP8, stacked experts load from published names, the memory plan is exact.

An FP8 tiny checkpoint (e4m3 weights, 128x128 block scales, published naming) is loaded in bf16 mode
without dequantising; its greedy tokens are compared with the same checkpoint dequantised. The memory
plan's per-rank weight bytes are compared with what the built model really allocates, dense and FP8,
at one and two tensor-parallel ranks, and at GLM-5.3's shapes on the meta device.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine.linear import Fp8Linear, WeightFormat
from engine.memory_plan import weight_bytes
from engine.model import build_model
from engine.model_config import ModelConfig
from engine.tiny import make_tiny
from engine.tp.tensor_parallel import TensorParallel
from engine.weights import load_weights, random_init
from kernels.fp8_gemm import fp8_block_linear_ref
from tests.helpers import LogitsRecorder, greedy, make_engine

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model written as an FP8 block-quantised checkpoint."""
    return make_tiny(tmp_path_factory.mktemp("tiny-fp8"), seed=0, fp8=True)


def _allocated(model: torch.nn.Module) -> int:
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def test_fp8_checkpoint_is_published_format(fp8_dir: Path) -> None:
    raw = json.loads((fp8_dir / "config.json").read_text())
    assert raw["quantization_config"]["weight_block_size"] == [128, 128]
    names: dict[str, torch.dtype] = {}
    for shard in fp8_dir.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            names.update({k: f.get_slice(k).get_dtype() for k in f.keys()})
    assert names["model.layers.1.mlp.experts.7.gate_proj.weight"] == "F8_E4M3"
    assert names["model.layers.1.mlp.experts.7.gate_proj.weight_scale_inv"] == "F32"
    assert names["model.layers.1.mlp.shared_experts.down_proj.weight"] == "F8_E4M3"
    assert names["model.layers.0.self_attn.q_a_proj.weight"] == "F8_E4M3"
    assert names["model.layers.0.self_attn.kv_b_proj.weight"] == "F8_E4M3"  # dequantised by the engine
    assert names["lm_head.weight"] == "BF16" and not any("w13" in n for n in names)


def test_fp8_weights_stay_fp8_and_agree_with_the_dequantised_model(tmp_path: Path) -> None:
    """Teacher-forced: at each position both models see the same tokens.

    Both hold the same e4m3 weights; the FP8 path also quantises activations per token and 128 columns
    (3 mantissa bits), measured at 2-4 % relative error per GEMM here. With index_topk above the context
    (every token selected) that leaves the logits correlated above 0.98 at most positions; a router
    choice that flips between two nearly tied experts moves one position further, so the check is on
    the median correlation and on most, not all, greedy choices.
    """
    model_dir = make_tiny(tmp_path / "fp8", seed=0, fp8=True, overrides={"index_topk": 128})
    fp8 = make_engine(model_dir, dtype="bfloat16")
    layer = fp8.executor.worker.model.model.layers[1]
    assert isinstance(layer.self_attn.q_a_proj, Fp8Linear)
    assert layer.self_attn.q_a_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.mlp.experts.w13.dtype == torch.float8_e4m3fn and layer.mlp.experts.w2_scale_inv.dtype == torch.float32
    assert layer.self_attn.kv_b_proj.weight.dtype == torch.bfloat16  # absorbed: needs the matrix itself
    dense = make_engine(model_dir, dtype="bfloat16", quantization="none")
    # plain weights hold q_a_proj and kv_a_proj_with_mqa as one (FP8 ones here do not: q_lora_rank 64 < 128)
    assert dense.executor.worker.model.model.layers[1].self_attn.q_kv_a_proj.weight.dtype == torch.bfloat16
    prompt = list(range(3, 90))
    [continuation] = dense.generate([prompt], [greedy(6)])
    ra, rb = LogitsRecorder(fp8), LogitsRecorder(dense)
    correlations, agree = [], 0
    for i in range(6):
        forced = prompt + continuation.token_ids[:i]
        [a], [b] = fp8.generate([forced], [greedy(1)]), dense.generate([forced], [greedy(1)])
        la, lb = ra.of(a.request_id)[0].float(), rb.of(b.request_id)[0].float()
        correlations.append(float(torch.corrcoef(torch.stack([la, lb]))[0, 1]))
        agree += a.token_ids == b.token_ids
    assert sorted(correlations)[len(correlations) // 2] > 0.98 and agree >= 4, (correlations, agree)


@pytest.mark.parametrize(("fp8", "tp_size"), [(False, 1), (False, 2), (True, 1)])
def test_memory_plan_counts_the_bytes_the_model_allocates(tiny_dir: Path, fp8_dir: Path, fp8: bool,
                                                          tp_size: int) -> None:
    cfg = ModelConfig.from_dir(fp8_dir if fp8 else tiny_dir)
    fmt, dtype = (WeightFormat("fp8"), torch.bfloat16) if fp8 else (WeightFormat(), torch.float32)
    for rank in range(tp_size):
        model = build_model(cfg, TensorParallel(rank, tp_size), fmt, dtype, torch.device("cpu"))
        model.hold_float32_parts()  # as the worker holds them
        assert weight_bytes(cfg, tp_size, fmt, dtype) == _allocated(model)


def test_glm53_plan_matches_the_model_built_at_its_shapes() -> None:
    cfg = ModelConfig.from_dir(ROOT / "configs" / "models" / "glm-5.3")
    fmt = WeightFormat("fp8")
    model = build_model(cfg, TensorParallel(0, 8), fmt, torch.bfloat16, torch.device("meta"))
    model.hold_float32_parts()
    planned = weight_bytes(cfg, 8, fmt, torch.bfloat16)
    assert planned == _allocated(model)
    assert 80e9 < planned < 110e9  # FP8 GLM-5.3 fits one H200 per rank; bf16 would not
    assert weight_bytes(cfg, 8, WeightFormat(), torch.bfloat16) > 141e9


# Shapes whose per-rank slices at two ranks lie on 128-blocks (as GLM-5.3's do at eight).
WIDE = {"hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 256, "qk_nope_head_dim": 48,
        "v_head_dim": 64}


def test_random_fp8_model_is_the_same_at_every_tensor_parallel_size(tmp_path: Path) -> None:
    overrides = WIDE
    cfg = ModelConfig.from_dir(make_tiny(tmp_path / "wide", seed=1, overrides=overrides, fp8=True))
    fmt = WeightFormat("fp8")
    whole = build_model(cfg, TensorParallel(), fmt, torch.bfloat16, torch.device("cpu"))
    random_init(whole, seed=5)
    for rank in range(2):
        part = build_model(cfg, TensorParallel(rank, 2), fmt, torch.bfloat16, torch.device("cpu"))
        random_init(part, seed=5)
        w13, w13_part = whole.model.layers[1].mlp.experts.w13, part.model.layers[1].mlp.experts.w13
        gate = w13[:, :256].chunk(2, dim=1)[rank]
        assert torch.equal(w13_part[:, :128].view(torch.uint8), gate.view(torch.uint8))
        scale = whole.model.layers[1].mlp.experts.w2_scale_inv.chunk(2, dim=2)[rank]
        assert torch.equal(part.model.layers[1].mlp.experts.w2_scale_inv, scale)


def test_fp8_slices_load_per_rank_from_the_checkpoint(tmp_path: Path) -> None:
    overrides = WIDE
    model_dir = make_tiny(tmp_path / "wide", seed=2, overrides=overrides, fp8=True)
    cfg = ModelConfig.from_dir(model_dir)
    fmt = WeightFormat("fp8")
    whole = build_model(cfg, TensorParallel(), fmt, torch.bfloat16, torch.device("cpu"))
    load_weights(whole, model_dir, torch.bfloat16)
    for rank in range(2):
        part = build_model(cfg, TensorParallel(rank, 2), fmt, torch.bfloat16, torch.device("cpu"))
        load_weights(part, model_dir, torch.bfloat16)
        down = whole.model.layers[1].mlp.experts.w2.chunk(2, dim=2)[rank]
        assert torch.equal(part.model.layers[1].mlp.experts.w2.view(torch.uint8), down.view(torch.uint8))
        o_proj = whole.model.layers[0].self_attn.o_proj.weight_scale_inv.chunk(2, dim=1)[rank]
        assert torch.equal(part.model.layers[0].self_attn.o_proj.weight_scale_inv, o_proj)


def test_tensor_parallel_sizes_that_split_a_scale_block_are_refused(fp8_dir: Path) -> None:
    with pytest.raises(ValueError, match="q_b_proj rows .* is 96, not a multiple of 128"):
        make_engine(fp8_dir, dtype="bfloat16", tensor_parallel_size=2)
    make_engine(fp8_dir, dtype="bfloat16", quantization="none", tensor_parallel_size=2).shutdown()


def test_fp8_latent_projections_load_into_one_weight(tmp_path: Path) -> None:
    """With q_lora_rank a whole number of 128-blocks, q_a_proj and kv_a_proj_with_mqa load as the rows of one
    FP8 weight (values and block scales, from their published names) whose one GEMM gives both outputs;
    the memory plan still counts the bytes the model allocates."""
    model_dir = make_tiny(tmp_path / "joint", seed=3, overrides={"q_lora_rank": 128}, fp8=True)
    cfg = ModelConfig.from_dir(model_dir)
    fmt = WeightFormat("fp8")
    model = build_model(cfg, TensorParallel(), fmt, torch.bfloat16, torch.device("cpu"))
    load_weights(model, model_dir, torch.bfloat16)
    model.hold_float32_parts()
    assert weight_bytes(cfg, 1, fmt, torch.bfloat16) == _allocated(model)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_kv_a_proj, Fp8Linear) and not hasattr(attn, "q_a_proj")
    published = {}
    for shard in model_dir.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            published.update({k: f.get_tensor(k) for k in f.keys() if k.startswith("model.layers.0.self_attn.")})
    prefix = "model.layers.0.self_attn."
    q, q_scale = published[prefix + "q_a_proj.weight"], published[prefix + "q_a_proj.weight_scale_inv"]
    kv, kv_scale = (published[prefix + "kv_a_proj_with_mqa.weight"],
                    published[prefix + "kv_a_proj_with_mqa.weight_scale_inv"])
    joint = attn.q_kv_a_proj
    assert torch.equal(joint.weight.view(torch.uint8), torch.cat([q, kv]).view(torch.uint8))
    assert torch.equal(joint.weight_scale_inv, torch.cat([q_scale, kv_scale]))
    x = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out = joint(x)
    torch.testing.assert_close(out[:, :128], fp8_block_linear_ref(x, q, q_scale), rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(out[:, 128:], fp8_block_linear_ref(x, kv, kv_scale), rtol=1e-2, atol=1e-3)
