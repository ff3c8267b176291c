"""Engine configuration: one frozen spec object passed down instead of keyword lists."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from engine.kv_layout import KVFormat
from engine.linear import WeightFormat
from residency.config import HiSparseConfig

DType = Literal["float32", "bfloat16"]
KVDType = Literal["auto", "float32", "bf16", "fp8"]
ExecutorKind = Literal["mp", "ray"]
Quantization = Literal["auto", "fp8", "none"]


def check_device(device: str) -> str:
    """`device` if it names a CPU or CUDA device (`cpu`, `cuda`, `cuda:N`); a ValueError saying so otherwise.

    Only the spelling is checked: the process that validates a config (a Serve controller, a driver) need
    not be the one with the GPU.
    """
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        kind = None
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    return device


@dataclass(frozen=True)
class EngineConfig:
    """What one engine replica serves and how much it may hold."""

    model: str  # local Hugging Face model directory
    dtype: DType = "float32"  # weights and activations; float32 is the reference mode
    kv_dtype: KVDType = "auto"  # KV row format; auto = the model dtype (float32 rows or bf16 rows)
    device: str = "cpu"
    num_gpu_pages: int | None = None  # KV pool pages; None = sized from kv_cache_gib
    kv_cache_gib: float = 0.25  # KV pool size on a CPU when num_gpu_pages is not given
    gpu_memory_utilization: float = 0.9  # share of GPU memory for weights + KV + activations
    activation_reserve_gib: float = 4.0  # GPU workspace kept out of the KV pool
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    enable_prefix_cache: bool = True
    hisparse: HiSparseConfig = field(default_factory=HiSparseConfig)  # residency: host tier and pressure policy
    seed: int = 0  # seeds requests that bring no seed of their own
    random_weights: bool = False  # shapes-only run: seeded random init instead of loading weights
    # Linear weights: "auto" keeps an FP8 block-quantised checkpoint FP8 in bf16 mode (dequantised in the
    # float32 reference mode); "fp8" makes them FP8 whatever the checkpoint (random weights at FP8);
    # "none" dequantises to the compute dtype.
    quantization: Quantization = "auto"
    # Ranks the model is split over (heads, MLP features); each holds a full replica of the KV pool.
    tensor_parallel_size: int = 1
    # How ranks run when tensor_parallel_size > 1: "mp" spawned processes (no Ray needed, no nested
    # placement groups) or "ray" actors in the replica's placement group (the Serve path). One rank
    # always runs in the engine's own process.
    executor: ExecutorKind = "mp"
    # Decode steps run eagerly from each step's own tensors instead of through persistent buffers and
    # captured CUDA graphs (engine/rank/decode_graphs.py).
    enforce_eager: bool = False
    # The host schedules and prepares step N+1 while the device runs step N, and reads N's tokens after
    # launching N+1 (inputs the host has not read come from the device). A request that stops at N has
    # one discarded row in N+1. Off: every step is read back before the next is scheduled.
    async_scheduling: bool = True
    # Draft tokens a step from the model's MTP layer (engine/mtp.py), verified by the next step's target
    # forward (engine/rank/speculative.py); 0 = off. With async scheduling a verifying step is launched before
    # the one it continues is read, as if that one accepted every draft, and the ranks move it back by the
    # drafts rejected (engine/llm_engine.py); when the next step's shape is not certain, the previous is read first.
    num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.kv_dtype not in ("auto", "float32", "bf16", "fp8"):
            raise ValueError(f"kv_dtype must be auto, float32, bf16 or fp8, got {self.kv_dtype!r}")
        if self.num_gpu_pages is not None and self.num_gpu_pages < 1:
            raise ValueError("num_gpu_pages must be positive")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
        if self.quantization not in ("auto", "fp8", "none"):
            raise ValueError(f"quantization must be auto, fp8 or none, got {self.quantization!r}")
        if self.quantization == "fp8" and self.dtype == "float32":
            raise ValueError("quantization fp8 needs dtype bfloat16 (float32 is the unquantised reference mode)")
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be non-negative")
        if self.executor not in ("mp", "ray"):
            raise ValueError(f"executor must be mp or ray, got {self.executor!r}")
        check_device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float32 if self.dtype == "float32" else torch.bfloat16

    def weight_format(self, fp8_checkpoint: bool) -> WeightFormat:
        """How linear weights are held, given whether the checkpoint is FP8 block-quantised."""
        fp8 = self.quantization == "fp8" or (self.quantization == "auto" and fp8_checkpoint and self.dtype != "float32")
        return WeightFormat("fp8" if fp8 else "dense")

    @property
    def kv_format(self) -> KVFormat:
        if self.kv_dtype == "auto":
            return "float32" if self.dtype == "float32" else "bf16"
        return self.kv_dtype
