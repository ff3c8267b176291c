"""Launcher of the CUDA resolve plan (`resolve_plan.cu`): one CTA a request, on a GPU of compute capability 9.0
with nvcc at hand. `kernels.resolve` takes it for the plan launch when `supports` holds (top-K up to
`MAX_TOPK`, pages of a power of two tokens); elsewhere its Triton plan runs. Same contract, same effects,
byte for byte (kernels/resolve.py's docstring); the copy launch that follows is the Triton one either way."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.cubin import CudaKernel

_SOURCE = Path(__file__).with_name("resolve_plan.cu")
THREADS = 512
SLOTS_PER_THREAD = 8  # as the .cu: the hot slots a thread keeps in registers
TOPK_PER_THREAD = 8
MAX_TOPK = THREADS * TOPK_PER_THREAD
_CACHED_SLOTS = THREADS * SLOTS_PER_THREAD
# the .cu's dynamic shared memory: positions and physical slots of the cached slots, each miss's position and
# host page, the victims' slot, old position and physical slot
SHARED_BYTES = 4 * (2 * _CACHED_SLOTS + 5 * MAX_TOPK)
_DEFINES = (("PLAN_THREADS", THREADS), ("PLAN_SHARED_BYTES", SHARED_BYTES))
# one kernel of the .cu a pair of table dtypes: (stamps int64, reverse map int16) -> its name
_KERNELS = {(stamp64, map16): CudaKernel(_SOURCE, f"resolve_plan_s{64 if stamp64 else 32}_m{16 if map16 else 32}",
                                         SHARED_BYTES, _DEFINES)
            for stamp64 in (False, True) for map16 in (False, True)}


def _kernel(stamp_dtype: torch.dtype, map_dtype: torch.dtype) -> CudaKernel:
    return _KERNELS[stamp_dtype == torch.int64, map_dtype == torch.int16]


def available(device: torch.device, stamp_dtype: torch.dtype = torch.int64, map_dtype: torch.dtype = torch.int32) -> bool:
    """Whether the kernel for these table dtypes is built and loaded for `device` (on first ask; never on a
    CPU)."""
    return _kernel(stamp_dtype, map_dtype).available(device)


class _Params(ctypes.Structure):
    """`PlanParams` of the .cu, field for field."""

    _fields_ = [
        ("topk", ctypes.c_void_p), ("counts", ctypes.c_void_p), ("gpu_page", ctypes.c_void_p),
        ("host_page", ctypes.c_void_p), ("lease", ctypes.c_void_p), ("step", ctypes.c_void_p),
        ("kv", ctypes.c_void_p), ("num_copied", ctypes.c_void_p), ("copy_src", ctypes.c_void_p),
        ("copy_dst", ctypes.c_void_p), ("max_pages", ctypes.c_longlong), ("k", ctypes.c_int),
        ("page_shift", ctypes.c_int),
    ]


def supports(topk_pos: torch.Tensor, page_size: int, stamp_dtype: torch.dtype, map_dtype: torch.dtype) -> bool:
    """Whether the CUDA plan can run this call: a CUDA batch of at most 2**31 - 1 requests, top-K width up to
    `MAX_TOPK`, pages of a power of two tokens, the kernel for these table dtypes built for the GPU."""
    b, k = topk_pos.shape
    return (topk_pos.is_cuda and 0 < b < 1 << 31 and 0 < k <= MAX_TOPK and page_size > 0
            and page_size & (page_size - 1) == 0 and available(topk_pos.device, stamp_dtype, map_dtype))


def launch(topk_pos: torch.Tensor, counts: torch.Tensor, gpu_slot_of_page: torch.Tensor,
           host_page_of_page: torch.Tensor, lease_table: torch.Tensor, step: torch.Tensor, kv_slots: torch.Tensor,
           num_copied: torch.Tensor, copy_src: torch.Tensor, copy_dst: torch.Tensor, stamp_dtype: torch.dtype,
           map_dtype: torch.dtype, page_size: int) -> None:
    """One launch, a CTA a request (only where `supports` holds; the caller has checked shapes and dtypes):
    `step` is a one-element tensor of the stamp dtype."""
    b, k = topk_pos.shape
    params = _Params(
        topk_pos.data_ptr(), counts.data_ptr(), gpu_slot_of_page.data_ptr(), host_page_of_page.data_ptr(),
        lease_table.data_ptr(), step.data_ptr(), kv_slots.data_ptr(), num_copied.data_ptr(), copy_src.data_ptr(),
        copy_dst.data_ptr(), gpu_slot_of_page.shape[1], k, page_size.bit_length() - 1,
    )
    _kernel(stamp_dtype, map_dtype).launch(topk_pos.device, (b, 1, 1), THREADS, params)
