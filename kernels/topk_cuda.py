"""Launcher of the cluster top-K (`topk_cluster.cu`): one thread-block cluster a row of float32 scores, one
launch for the batch, on a GPU of compute capability 9.0 with nvcc at hand. `kernels.topk.topk_positions`
takes it at every width when `supports` holds; elsewhere its Triton kernels run. Same contract, same
positions (kernels/topk.py's docstring). Each cluster size is its own build (a compile-time attribute);
the first call on a device builds all of `CLUSTERS` (the driver counts each build's clusters at once, which
picks the size), cached like the other cubins."""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from kernels.cubin import CudaKernel, device_index

_SOURCE = Path(__file__).with_name("topk_cluster.cu")


@dataclass(frozen=True)
class Variant:
    """The .cu's compile-time shape: threads a CTA, CTAs a cluster (a row), the keys a CTA keeps in shared
    memory between passes (a wider share of a row is read again each pass), and the positions of keys at or
    above the K-th key's first digit a CTA can list (a row with more of them visits every key in each pass)."""

    threads: int = 1024
    cluster: int = 8
    cache_keys: int = 32768
    list_cap: int = 8192

    @property
    def shared_bytes(self) -> int:
        """The .cu's `Shared` (rounded to 16 bytes), its key cache and its list; the .cu checks it at build
        time."""
        fixed = 4 * 4096 * 3 + 8 * (self.threads // 32) + 24 + 8 * self.cluster
        return (fixed + 15) // 16 * 16 + 4 * self.cache_keys + 4 * self.list_cap

    @property
    def defines(self) -> tuple[tuple[str, int], ...]:
        return (("TOPK_THREADS", self.threads), ("TOPK_CLUSTER", self.cluster),
                ("TOPK_CACHE_KEYS", self.cache_keys), ("TOPK_LIST_CAP", self.list_cap),
                ("TOPK_SHARED_BYTES", self.shared_bytes))

    def span(self, width: int) -> int:
        """Scores a thread reads: the row spread over the cluster's threads, four at a time."""
        return triton.cdiv(triton.cdiv(width, self.threads * self.cluster), 4) * 4


DEFAULT = Variant()
CLUSTERS = (8, 4, 2)  # the cluster sizes `variant_for` picks from
# A CTA's time in us, fitted on an H200 (bench/RESULTS.md): fixed, and a share's keys, kept in shared memory or
# read again from L2.
_CTA_US, _CACHED_US_PER_KEY, _READ_US_PER_KEY = 11.0, 0.33e-3, 0.45e-3


def variant_for(rows: int, width: int, one_wave: Mapping[int, int]) -> Variant:
    """The cluster for `rows` rows of `width` scores, given how many clusters of each size the GPU runs at
    once: the size whose waves of CTAs take least by the fitted cost of a CTA (more CTAs a row: a smaller
    share each, which shared memory may hold, but fewer rows a wave). On an H200 at 128K: 8 CTAs a row up to
    B = 8, 4 at B = 16, 2 from B = 32 (a 64K share read twice from L2, one wave)."""
    def cost(cluster: int) -> float:
        variant = Variant(cluster=cluster)
        keys = variant.span(width) * variant.threads
        per_key = _CACHED_US_PER_KEY if keys <= variant.cache_keys else _READ_US_PER_KEY
        return -(-rows // one_wave[cluster]) * (_CTA_US + keys * per_key)

    sizes = [c for c in CLUSTERS if one_wave.get(c, 0) > 0]
    return Variant(cluster=min(sizes, key=cost)) if sizes else DEFAULT


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
        ("limits", ctypes.c_void_p),
    ]


_ONE_WAVE: dict[int, dict[int, int]] = {}  # device index -> clusters of each size the GPU runs at once


def one_wave(device: torch.device) -> dict[int, int]:
    """Clusters of each size in `CLUSTERS` that `device` runs at once, by the driver (sizes whose build is not
    available left out); asked once a device."""
    index = device_index(device)
    if index not in _ONE_WAVE:
        counts = {}
        for cluster in CLUSTERS:
            variant = Variant(cluster=cluster)
            if available(device, variant):
                counts[cluster] = _kernel(variant).max_active_clusters(device, cluster, variant.threads)
        _ONE_WAVE[index] = counts
    return _ONE_WAVE[index]


def _variant(scores: torch.Tensor) -> Variant:
    rows, width = scores.shape
    return variant_for(rows, width, one_wave(scores.device))


def supports(scores: torch.Tensor, out: torch.Tensor, variant: Variant | None = None) -> bool:
    """Whether the kernel can run this call: rows that load as 16-byte vectors, at most 65,535 of them (the
    grid's second dimension), and the kernel built for the GPU. Shapes and dtypes are checked by the caller."""
    return (
        scores.is_cuda and scores.stride(0) % 4 == 0 and scores.data_ptr() % 16 == 0
        and 0 < scores.shape[0] <= 65535 and scores.shape[1] < 1 << 30
        and available(scores.device, variant or _variant(scores))
    )


def launch(scores: torch.Tensor, k: int, out: torch.Tensor, variant: Variant | None = None, *,
           limits: torch.Tensor | None = None) -> None:
    """Writes each row's top-K positions into `out` (int32 or int64 [R, K], unit last stride), positions at or
    past a row's `limits` (int32 [R], checked by the caller) as 0; only where `supports` holds. `variant`
    defaults to `variant_for` the rows, their width and the GPU."""
    rows, width = scores.shape
    variant = variant or _variant(scores)
    params = _Params(scores.data_ptr(), out.data_ptr(), scores.stride(0), out.stride(0), width, k,
                     variant.span(width), int(out.dtype == torch.int64),
                     None if limits is None else limits.data_ptr())
    _kernel(variant).launch(scores.device, (variant.cluster, rows, 1), variant.threads, params)
