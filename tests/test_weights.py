"""Weight loading: FP8 block-quantised checkpoints, fused expert tensors, clear failures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.linear import WeightFormat
from engine.model import build_model
from engine.model_config import ModelConfig
from engine.tp.tensor_parallel import TensorParallel
from engine.weights import FP8_BLOCK, dequantize_fp8_block, load_weights
from tests.helpers import LogitsRecorder, greedy, make_engine, rewrite_checkpoint

_DENSE = WeightFormat()


def quantize_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What published FP8 checkpoints hold: e4m3 weights and one inverse scale per 128x128 block."""
    rows, cols = -(-w.shape[0] // FP8_BLOCK), -(-w.shape[1] // FP8_BLOCK)
    scale = torch.empty(rows, cols)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            block = w[i * FP8_BLOCK : (i + 1) * FP8_BLOCK, j * FP8_BLOCK : (j + 1) * FP8_BLOCK]
            s = block.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            q[i * FP8_BLOCK : (i + 1) * FP8_BLOCK, j * FP8_BLOCK : (j + 1) * FP8_BLOCK] = (block / s).to(q.dtype)
    return q, scale


def test_dequantize_handles_partial_edge_blocks() -> None:
    w = torch.randn(200, 130)
    q, s = quantize_fp8_block(w)
    back = dequantize_fp8_block(q, s, torch.float32)
    assert back.shape == w.shape
    assert float(((back - w).abs() / w.abs().amax()).max()) < 0.07


def test_fp8_checkpoint_loads_as_its_dequantised_weights(tiny_dir: Path, tmp_path: Path) -> None:
    def to_fp8(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in tensors.items():
            if name.endswith("proj.weight") and t.dim() == 2:
                q, s = quantize_fp8_block(t.float())
                out[name], out[name + "_scale_inv"] = q, s
                out[name.replace(".weight", ".ref")] = dequantize_fp8_block(q, s, torch.float32)
            else:
                out[name] = t
        return out

    def drop_refs(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in tensors.items() if not k.endswith(".ref")}

    fp8_dir, ref_dir = tmp_path / "fp8", tmp_path / "ref"
    rewrite_checkpoint(tiny_dir, fp8_dir, lambda t: drop_refs(to_fp8(t)))
    # the same weights, already dequantised, as a plain float32 checkpoint
    rewrite_checkpoint(tiny_dir, ref_dir, lambda t: {
        (k.replace(".ref", ".weight")): v for k, v in to_fp8(t).items()
        if not k.endswith("_scale_inv") and not (k.endswith("proj.weight") and v.dtype == torch.float8_e4m3fn)
    })
    prompt = list(range(3, 80))
    a, b = make_engine(fp8_dir), make_engine(ref_dir)
    ra, rb = LogitsRecorder(a), LogitsRecorder(b)
    [oa], [ob] = a.generate([prompt], [greedy(8)]), b.generate([prompt], [greedy(8)])
    assert oa.token_ids == ob.token_ids
    torch.testing.assert_close(ra.of(oa.request_id), rb.of(ob.request_id))


def test_fused_expert_tensors_load(tiny_dir: Path, tmp_path: Path) -> None:
    """transformers' in-memory layout ([E, 2I, H] and [E, H, I]) in one unindexed file."""
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(tiny_dir.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    fused: dict[str, torch.Tensor] = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    num_experts = 8
    for prefix in sorted({k.split(".mlp.experts.")[0] for k in tensors if ".mlp.experts." in k}):
        def w(e: int, kind: str) -> torch.Tensor:
            return tensors[f"{prefix}.mlp.experts.{e}.{kind}.weight"]

        fused[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([w(e, "gate_proj"), w(e, "up_proj")]) for e in range(num_experts)])
        fused[f"{prefix}.mlp.experts.down_proj"] = torch.stack([w(e, "down_proj") for e in range(num_experts)])
    out = tmp_path / "fused"
    shutil.copytree(tiny_dir, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_file(fused, str(out / "model.safetensors"))
    prompt = list(range(3, 60))
    [a] = make_engine(out).generate([prompt], [greedy(6)])
    [b] = make_engine(tiny_dir).generate([prompt], [greedy(6)])
    assert a.token_ids == b.token_ids


def test_missing_and_mismatched_tensors_fail_clearly(tiny_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    rewrite_checkpoint(tiny_dir, broken, lambda t: {k: v for k, v in t.items() if "lm_head" not in k})
    with pytest.raises(KeyError, match="lacks"):
        make_engine(broken)
    with pytest.raises(FileNotFoundError):
        make_engine(tmp_path / "nowhere")


def test_tied_lm_head_takes_each_ranks_rows_of_the_embedding(tiny_dir: Path, tmp_path: Path) -> None:
    """A checkpoint with tied embeddings and no lm_head tensor: each tensor-parallel rank's lm_head holds its
    vocabulary rows of the embedding, and the ranks' logits side by side are the single rank's."""
    tied = tmp_path / "tied"
    rewrite_checkpoint(tiny_dir, tied, lambda t: {k: v for k, v in t.items() if "lm_head" not in k})
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps(dict(config, tie_word_embeddings=True)))
    cfg = ModelConfig.from_dir(tied)
    hidden = torch.randn(3, cfg.hidden_size)
    whole = build_model(cfg, TensorParallel(), _DENSE, torch.float32, torch.device("cpu"))
    load_weights(whole, tied, torch.float32)
    assert torch.equal(whole.lm_head.weight, whole.model.embed_tokens.weight)
    parts = []
    for rank in range(2):
        model = build_model(cfg, TensorParallel(rank, 2), _DENSE, torch.float32, torch.device("cpu"))
        load_weights(model, tied, torch.float32)
        rows = cfg.vocab_size // 2
        assert torch.equal(model.lm_head.weight, whole.model.embed_tokens.weight[rank * rows:(rank + 1) * rows])
        parts.append(model.lm_head(hidden))
    torch.testing.assert_close(torch.cat(parts, dim=1), whole.logits(hidden))
