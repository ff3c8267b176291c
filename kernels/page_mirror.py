"""Page mirror: copy completed GPU pages (whole pages, every layer) to host pages.

After a decode step the pages a request completed are mirrored into the pinned
host pool ahead of memory pressure, so a later demotion frees GPU pages with no
copy on the critical path. One call enqueues all copies of a step on a side
stream (after the work already queued on the caller's stream, which wrote the
pages) and records a completion event the caller waits on before it treats the
host pages as valid.

Two ways to move the bytes, with the same signature:

- `mirror_pages_triton`: one Triton launch; SMs store straight into the pinned
  host tensor (UVA writes over PCIe), grid = (chunks of a page, pages);
- `mirror_pages_reference`: the plain PyTorch twin, one `copy_` per maximal run
  of consecutive (GPU page, host page) pairs on the side stream, done by the
  copy engine.

`mirror_pages` is the one the engine calls; it uses the copy engine. Measured
on an H200 (GLM-5.3 pages of 3,274,752 bytes to random host pages of an 8 GiB
pinned pool, device time, bench/kernels_residency.py, bench/RESULTS.md;
D2H memcpy ceiling 55.2 GB/s in the same run):

| pages | Triton (one launch) | copy engine (copy_ per run) |
| --- | --- | --- |
| 1 | 68.4 us, 47.9 GB/s | 64.6 us, 50.7 GB/s |
| 8 | 502.8 us, 52.1 GB/s | 495.7 us, 52.8 GB/s |
| 64 | 3990 us, 52.5 GB/s | 3971 us, 52.8 GB/s |

The copy engine is as fast or faster at every size and occupies no SMs while
the mirror overlaps the next forward on its side stream, so it is kept; the
Triton kernel stays as the one-launch alternative (one launch whatever the
number of pages, where the twin issues one copy_ per run of consecutive pages).
On CPU both are the torch copy.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

_CHUNK_WORDS = 4096
_CUDA_METHOD = "copy_engine"  # or "triton"; chosen by the measurement above

PageIds = torch.Tensor | Sequence[int]


@triton.jit
def _mirror_kernel(gpu_ptr, host_ptr, gpu_ids_ptr, host_ids_ptr, page_words, CHUNK: tl.constexpr):
    chunk = tl.program_id(0)
    i = tl.program_id(1)
    src_page = tl.load(gpu_ids_ptr + i)
    dst_page = tl.load(host_ids_ptr + i)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < page_words
    words = tl.load(gpu_ptr + src_page * page_words + offs, mask=mask)
    tl.store(host_ptr + dst_page * page_words + offs, words, mask=mask)


def _check(gpu_pool: torch.Tensor, host_pool: torch.Tensor, gpu_ids: list[int], host_ids: list[int]) -> None:
    for name, pool in (("gpu_pool", gpu_pool), ("host_pool", host_pool)):
        if pool.dim() != 2 or pool.dtype != torch.uint8 or not pool.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [pages, page_bytes] uint8 tensor")
    if gpu_pool.shape[1] != host_pool.shape[1]:
        raise ValueError("host and GPU pages must have the same size")
    if gpu_pool.is_cuda and (host_pool.is_cuda or not host_pool.is_pinned()):
        raise ValueError("host_pool must be a pinned CPU tensor")
    if len(gpu_ids) != len(host_ids):
        raise ValueError("gpu_page_ids and host_page_ids must be 1-D of the same length")
    if gpu_ids and not (0 <= min(gpu_ids) and max(gpu_ids) < gpu_pool.shape[0]):
        raise ValueError("a GPU page id is out of range")
    if host_ids and not (0 <= min(host_ids) and max(host_ids) < host_pool.shape[0]):
        raise ValueError("a host page id is out of range")


def _as_ids(ids: PageIds) -> list[int]:
    """Ids as Python ints. A step mirrors a few dozen ids; checked and packed in Python they cost
    microseconds, where each small CPU tensor op costs tens (the mirror runs every step)."""
    if not isinstance(ids, torch.Tensor):
        try:
            return [operator.index(x) for x in ids]
        except TypeError:  # nested: flattened like a tensor
            ids = torch.as_tensor(ids)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError("page ids and tokens must be integers")
    return ids.reshape(-1).tolist()


def _meta(values: list[int], gpu_pool: torch.Tensor) -> torch.Tensor:
    """int64 launch metadata on the pool's device (through pinned memory, not waited for)."""
    if not gpu_pool.is_cuda:
        return torch.tensor(values, dtype=torch.int64)
    return torch.tensor(values, dtype=torch.int64, pin_memory=True).to(gpu_pool.device, non_blocking=True)


def _side_stream(gpu_pool: torch.Tensor, stream: torch.cuda.Stream | None) -> torch.cuda.Stream:
    stream = stream if stream is not None else torch.cuda.current_stream(gpu_pool.device)
    stream.wait_stream(torch.cuda.current_stream(gpu_pool.device))
    return stream


def mirror_pages_triton(gpu_pool: torch.Tensor, host_pool: torch.Tensor, gpu_page_ids: PageIds,
                        host_page_ids: PageIds, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
    """Copy GPU pages to host pages in one Triton launch; returns the completion event (None on CPU).

    gpu_pool / host_pool: [pages, page_bytes] uint8 (host pinned when the GPU pool is
    on CUDA); page ids: CPU int tensors or sequences of equal length; stream: the side
    stream (default: the current stream), which first waits for the current stream.
    """
    gpu_ids, host_ids = _as_ids(gpu_page_ids), _as_ids(host_page_ids)
    _check(gpu_pool, host_pool, gpu_ids, host_ids)
    if not gpu_ids:
        return _record(gpu_pool, stream)
    word = 4 if all(x % 4 == 0 for x in (gpu_pool.shape[1], gpu_pool.data_ptr(), host_pool.data_ptr())) else 1
    gpu_words = gpu_pool.view(torch.int32) if word == 4 else gpu_pool
    host_words = host_pool.view(torch.int32) if word == 4 else host_pool
    page_words = gpu_pool.shape[1] // word
    grid = (triton.cdiv(page_words, _CHUNK_WORDS), len(gpu_ids))
    if not gpu_pool.is_cuda:
        ids = _meta(gpu_ids + host_ids, gpu_pool).view(2, -1)
        _mirror_kernel[grid](gpu_words, host_words, ids[0], ids[1], page_words, CHUNK=_CHUNK_WORDS)
        return None
    side = _side_stream(gpu_pool, stream)
    with torch.cuda.stream(side):
        ids = _meta(gpu_ids + host_ids, gpu_pool).view(2, -1)
        _mirror_kernel[grid](gpu_words, host_words, ids[0], ids[1], page_words, CHUNK=_CHUNK_WORDS)
        event = torch.cuda.Event()
        event.record(side)
    return event


def page_runs(gpu_ids: list[int], host_ids: list[int]) -> list[tuple[int, int, int]]:
    """(gpu start, host start, length) of maximal runs of consecutive page pairs: one copy each."""
    runs: list[tuple[int, int, int]] = []
    for g, h in zip(gpu_ids, host_ids):
        if runs and runs[-1][0] + runs[-1][2] == g and runs[-1][1] + runs[-1][2] == h:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((g, h, 1))
    return runs


def mirror_pages_reference(gpu_pool: torch.Tensor, host_pool: torch.Tensor, gpu_page_ids: PageIds,
                           host_page_ids: PageIds, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
    """PyTorch twin of `mirror_pages_triton`: one `copy_` per run of consecutive pages."""
    gpu_ids, host_ids = _as_ids(gpu_page_ids), _as_ids(host_page_ids)
    _check(gpu_pool, host_pool, gpu_ids, host_ids)
    runs = page_runs(gpu_ids, host_ids)
    if not gpu_pool.is_cuda:
        for g, h, n in runs:
            host_pool[h : h + n].copy_(gpu_pool[g : g + n])
        return None
    side = _side_stream(gpu_pool, stream)
    with torch.cuda.stream(side):
        for g, h, n in runs:
            host_pool[h : h + n].copy_(gpu_pool[g : g + n], non_blocking=True)
        event = torch.cuda.Event()
        event.record(side)
    return event


def _record(gpu_pool: torch.Tensor, stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    if not gpu_pool.is_cuda:
        return None
    side = _side_stream(gpu_pool, stream)
    event = torch.cuda.Event()
    event.record(side)
    return event


def mirror_pages(gpu_pool: torch.Tensor, host_pool: torch.Tensor, gpu_page_ids: PageIds,
                 host_page_ids: PageIds, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
    """Mirror pages with the faster method on CUDA (see the module docstring), torch copy on CPU."""
    if gpu_pool.is_cuda and _CUDA_METHOD == "triton":
        return mirror_pages_triton(gpu_pool, host_pool, gpu_page_ids, host_page_ids, stream)
    return mirror_pages_reference(gpu_pool, host_pool, gpu_page_ids, host_page_ids, stream)

