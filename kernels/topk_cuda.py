"""Launcher of the cluster top-K (`topk_cluster.cu`): one thread-block cluster a row of float32 scores, one
launch for the batch, on a GPU of compute capability 9.0 with nvcc at hand. `kernels.topk.topk_positions`
takes it at every width when `supports` holds; elsewhere its Triton kernels run. Same contract, same
positions (kernels/topk.py's docstring). Each cluster size is its own build (a compile-time attribute),
made at its first use and cached like the other cubins."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from kernels.cubin import CudaKernel

_SOURCE = Path(__file__).with_name("topk_cluster.cu")


@dataclass(frozen=True)
class Variant:
    """The .cu's compile-time shape: threads a CTA, CTAs a cluster (a row), and the keys a CTA keeps in
    shared memory between passes (a wider share of a row is read again each pass)."""

    threads: int = 1024
    cluster: int = 8
    cache_keys: int = 32768

    @property
    def shared_bytes(self) -> int:
        """The .cu's `Shared` (rounded to 16 bytes) and its key cache; the .cu checks it at build time."""
        fixed = 4 * 4096 * 3 + 8 * (self.threads // 32) + 16 + 8 * self.cluster
        return (fixed + 15) // 16 * 16 + 4 * self.cache_keys

    @property
    def defines(self) -> tuple[tuple[str, int], ...]:
        return (("TOPK_THREADS", self.threads), ("TOPK_CLUSTER", self.cluster),
                ("TOPK_CACHE_KEYS", self.cache_keys), ("TOPK_SHARED_BYTES", self.shared_bytes))

    def span(self, width: int) -> int:
        """Scores a thread reads: the row spread over the cluster's threads, four at a time."""
        return triton.cdiv(triton.cdiv(width, self.threads * self.cluster), 4) * 4


DEFAULT = Variant()
CLUSTERS = (8, 4, 2)  # the cluster sizes `variant_for` picks from
_ONE_WAVE = {8: 15, 4: 32, 2: 66}  # clusters an H200 (132 SMs) runs at once: a cluster's CTAs share a GPC


def variant_for(rows: int, width: int, sms: int = 132) -> Variant:
    """The cluster for `rows` rows of `width` scores on a GPU of `sms` SMs: among the sizes whose CTAs keep
    their share of a row in shared memory, the largest whose clusters all run in one wave, else the smallest
    of them (rows too wide for any cache: the largest size that fits a wave, else 2). Measured on an H200
    (bench/RESULTS.md, nineteenth session): 128K rows, B = 1-8 clusters of 8 (15.9 us against 24.0 at 4),
    B = 16 of 4 (24.1 against 29.3), B = 64 of 4 (72.3; 2 CTAs a row read it again each pass: 82.2); 12K rows,
    B = 64 of 2 (12.0 against 25.7 at 4)."""
    one_wave = {c: max(1, n * sms // 132) for c, n in _ONE_WAVE.items()}
    cached = [c for c in CLUSTERS if Variant(cluster=c).span(width) * Variant().threads <= Variant().cache_keys]
    sizes = cached or list(CLUSTERS)
    fits = [c for c in sizes if rows <= one_wave[c]]
    return Variant(cluster=max(fits) if fits else min(sizes))


_KERNELS: dict[Variant, CudaKernel] = {}


def _kernel(variant: Variant) -> CudaKernel:
    if variant not in _KERNELS:
        _KERNELS[variant] = CudaKernel(_SOURCE, "topk_cluster", variant.shared_bytes, variant.defines)
    return _KERNELS[variant]


def available(device: torch.device, variant: Variant = DEFAULT) -> bool:
    """Whether `variant` is built and loaded for `device` (on first ask; never on a CPU)."""
    return _kernel(variant).available(device)


class _Params(ctypes.Structure):
    """`TopKParams` of the .cu, field for field."""

    _fields_ = [
        ("scores", ctypes.c_void_p), ("out", ctypes.c_void_p),
        ("stride_s", ctypes.c_longlong), ("stride_o", ctypes.c_longlong),
        ("width", ctypes.c_int), ("k", ctypes.c_int), ("span", ctypes.c_int), ("out_int64", ctypes.c_int),
    ]


def _variant(scores: torch.Tensor) -> Variant:
    rows, width = scores.shape
    return variant_for(rows, width, torch.cuda.get_device_properties(scores.device).multi_processor_count)


def supports(scores: torch.Tensor, out: torch.Tensor, variant: Variant | None = None) -> bool:
    """Whether the kernel can run this call: rows that load as 16-byte vectors, at most 65,535 of them (the
    grid's second dimension), and the kernel built for the GPU. Shapes and dtypes are checked by the caller."""
    return (
        scores.is_cuda and scores.stride(0) % 4 == 0 and scores.data_ptr() % 16 == 0
        and 0 < scores.shape[0] <= 65535 and scores.shape[1] < 1 << 30
        and available(scores.device, variant or _variant(scores))
    )


def launch(scores: torch.Tensor, k: int, out: torch.Tensor, variant: Variant | None = None) -> None:
    """Writes each row's top-K positions into `out` (int32 or int64 [R, K], unit last stride); only where
    `supports` holds. `variant` defaults to `variant_for` the rows, their width and the GPU."""
    rows, width = scores.shape
    variant = variant or _variant(scores)
    params = _Params(scores.data_ptr(), out.data_ptr(), scores.stride(0), out.stride(0), width, k,
                     variant.span(width), int(out.dtype == torch.int64))
    _kernel(variant).launch(scores.device, (variant.cluster, rows, 1), variant.threads, params)
