"""Launchers of the CUDA sparse MLA decode kernels over FP8 rows, GLM's row shape (512 latent values, 64 rope
values), bf16 queries, with nvcc at hand: `sparse_mla_fp8.cu` for at most 8 heads (one rank of GLM-5.3 at
TP 8; compute capability 9.0 and up) and `sparse_mla_fp8_h64.cu` for 9 to 64 heads (GLM-5.3's 64 heads on
one GPU; Hopper's wgmma, so sm_90 only; the defaults take it from 17 heads). `kernels.sparse_mla.sparse_mla`
takes them for the configurations that ask for it (`SparseMLAConfig.cuda`) when `supports` holds, and merges
their splits with the Triton combine kernel; elsewhere the Triton kernel runs."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from kernels.cubin import CudaKernel

LATENT_DIM, ROPE_DIM, MAX_HEADS = 512, 64, 8
WIDE_MAX_HEADS = 64  # the wgmma kernel's M: fewer heads are zero queries
TILE = 16  # rows a tile, as in the .cu
WIDE_TILE = 32  # rows a tile of the 64-head .cu
ROW_BYTES = LATENT_DIM + 4 * (LATENT_DIM // 128) + 2 * ROPE_DIM
_SOURCE = Path(__file__).with_name("sparse_mla_fp8.cu")
_WIDE_SOURCE = Path(__file__).with_name("sparse_mla_fp8_h64.cu")


@dataclass(frozen=True)
class Variant:
    """The .cu's compile-time shape: warps a CTA (in pairs that share a tile), tiles of a pair in flight or
    in use, CTAs an SM (the launch bound). Measured on an H200 (bench/NOTES.md, eighteenth session): pairs
    of warps (64 accumulators a thread) beat the former single warps a tile (128) by 12-37 % at 8-128 rows;
    8 warps are the best or within 1 % from 1 to 64 rows (12 are 4 % faster at 128), and more stages a
    pair, or two to four CTAs an SM, did not pay."""

    warps: int = 8
    stages: int = 2
    ctas_per_sm: int = 1

    @property
    def pairs(self) -> int:
        return self.warps // 2

    @property
    def rows_per_step(self) -> int:
        """A split is a whole number of these: one tile for each pair."""
        return self.pairs * TILE

    @property
    def shared_bytes(self) -> int:
        query = MAX_HEADS * (LATENT_DIM + 16) * 2
        partial_scores = self.pairs * 2 * 2 * 32 * 16  # [pair, tile parity, warp, lane] float4
        stages = self.pairs * self.stages * (TILE * ROW_BYTES + 8 + 4)  # rows, mbarrier, done counter
        return query + partial_scores + stages

    @property
    def defines(self) -> tuple[tuple[str, int], ...]:
        """The .cu's macros; the shared memory too, which the .cu checks against its layout at build time."""
        return (("SMLA_WARPS", self.warps), ("SMLA_STAGES", self.stages), ("SMLA_CTAS_PER_SM", self.ctas_per_sm),
                ("SMLA_SHARED_BYTES", self.shared_bytes))


@dataclass(frozen=True)
class WideVariant:
    """The 64-head .cu's compile-time shape: raw tiles gathered ahead. Its shared memory holds the query and
    two converted tiles in fp16 (147 KB), so three raw stages are what fits beside them."""

    stages: int = 3

    @property
    def threads(self) -> int:
        """The .cu's THREADS: two consumer warpgroups and a producer."""
        return 384

    @property
    def shared_bytes(self) -> int:
        values = LATENT_DIM + ROPE_DIM
        query = WIDE_MAX_HEADS * values * 2
        tiles = 2 * WIDE_TILE * values * 2
        stages = self.stages * (WIDE_TILE * ROW_BYTES + 8)  # rows, mbarrier
        partial_scores = 2 * 4 * 128 * 16  # [consumer, 4, thread] float4
        tile_barriers = 2 * 2 * 8  # a tile buffer's full and empty
        return query + tiles + stages + partial_scores + tile_barriers

    @property
    def defines(self) -> tuple[tuple[str, int], ...]:
        return (("SMLA64_STAGES", self.stages), ("SMLA64_SHARED_BYTES", self.shared_bytes))


DEFAULT = Variant()
WIDE = WideVariant()
_KERNEL = CudaKernel(_SOURCE, "sparse_mla_fp8_h8", DEFAULT.shared_bytes, DEFAULT.defines)
_WIDE_KERNEL = CudaKernel(_WIDE_SOURCE, "sparse_mla_fp8_h64", WIDE.shared_bytes, WIDE.defines, arch_specific=True)


@dataclass(frozen=True)
class _Form:
    """What a call of one of the two kernels needs: the kernel and its threads, the rows a split is a whole
    number of, and the query values a load and output values a store (the alignments `supports` checks)."""

    kernel: CudaKernel
    threads: int
    rows_per_step: int
    query_values: int
    output_values: int


_FORMS = (_Form(_KERNEL, DEFAULT.warps * 32, DEFAULT.rows_per_step, query_values=4, output_values=4),
          _Form(_WIDE_KERNEL, WIDE.threads, WIDE_TILE, query_values=8, output_values=2))


def _form(num_heads: int) -> _Form:
    return _FORMS[0] if num_heads <= MAX_HEADS else _FORMS[1]


def available(device: torch.device, num_heads: int = MAX_HEADS) -> bool:
    """Whether the kernel for `num_heads` is built and loaded for `device` (on first ask; never on a CPU)."""
    return num_heads <= WIDE_MAX_HEADS and _form(num_heads).kernel.available(device)


def rows_per_step(num_heads: int) -> int:
    """A split of the kernel for `num_heads` is a whole number of these rows."""
    return _form(num_heads).rows_per_step


class _Params(ctypes.Structure):
    """`SparseMLAParams` of the .cu, field for field."""

    _fields_ = [
        ("q", ctypes.c_void_p), ("kv", ctypes.c_void_p), ("slots", ctypes.c_void_p), ("lens", ctypes.c_void_p),
        ("out", ctypes.c_void_p), ("part", ctypes.c_void_p), ("lse", ctypes.c_void_p),
        ("q_stride_n", ctypes.c_longlong), ("q_stride_h", ctypes.c_longlong),
        ("kv_stride_page", ctypes.c_longlong), ("kv_stride_tok", ctypes.c_longlong),
        ("slots_stride_n", ctypes.c_longlong),
        ("out_stride_n", ctypes.c_longlong), ("out_stride_h", ctypes.c_longlong),
        ("num_heads", ctypes.c_int), ("num_splits", ctypes.c_int), ("split_len", ctypes.c_int),
        ("page_shift", ctypes.c_int), ("out_bf16", ctypes.c_int), ("scale_log2", ctypes.c_float),
    ]


def supports(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, kv_format: str, latent_dim: int,
             rope_dim: int) -> bool:
    """Whether a CUDA kernel can run this call: shapes, dtypes, 16-byte aligned rows, pages of a power of
    two rows, queries read four values (8 bytes; eight, 16 bytes, above 8 heads) and outputs written four
    at a time (two above 8 heads), a capable GPU."""
    page = kv.shape[1]
    heads = q.shape[1]
    vector, written = _form(heads).query_values, _form(heads).output_values
    return (
        kv_format == "fp8" and latent_dim == LATENT_DIM and rope_dim == ROPE_DIM and q.is_cuda
        and q.dtype == torch.bfloat16 and out.dtype in (torch.bfloat16, torch.float32)
        and q.stride(0) % vector == 0 and q.stride(1) % vector == 0 and q.data_ptr() % (2 * vector) == 0
        and out.stride(0) % written == 0 and out.stride(1) % written == 0
        and out.data_ptr() % (written * out.element_size()) == 0
        and kv.data_ptr() % 16 == 0 and kv.stride(0) % 16 == 0 and kv.stride(1) % 16 == 0
        and page > 0 and page & (page - 1) == 0
        and available(q.device, heads)
    )


def num_splits(num_rows: int, k: int, waves: float, device: torch.device,
               splits: int | None = None, step: int = DEFAULT.rows_per_step) -> tuple[int, int]:
    """(splits, rows a split) in whole steps of `step` rows: `splits` if given, else about `waves` x the CTAs
    the GPU holds at once."""
    if splits is None:
        slots = DEFAULT.ctas_per_sm * torch.cuda.get_device_properties(device).multi_processor_count
        splits = max(1, min(int(waves * slots) // max(num_rows, 1), triton.cdiv(k, step)))
    split_len = triton.cdiv(triton.cdiv(max(k, 1), splits), step) * step
    return max(1, triton.cdiv(k, split_len)), split_len


def launch(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, out: torch.Tensor,
           part: torch.Tensor | None, lse: torch.Tensor | None, splits: int, split_len: int,
           scale_log2: float) -> None:
    """One launch of the kernel for q's heads over grid (splits, rows): `out` directly with one split, else
    `part` / `lse` for the combine kernel (the Triton kernel's layout). Only where `supports` holds."""
    n, heads, _ = q.shape
    params = _Params(
        q.data_ptr(), kv.data_ptr(), slots.data_ptr(), lens.data_ptr(), out.data_ptr(),
        part.data_ptr() if part is not None else 0, lse.data_ptr() if lse is not None else 0,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), slots.stride(0), out.stride(0), out.stride(1),
        heads, splits, split_len, kv.shape[1].bit_length() - 1, int(out.dtype == torch.bfloat16), scale_log2,
    )
    form = _form(heads)
    form.kernel.launch(q.device, (splits, n, 1), form.threads, params)
