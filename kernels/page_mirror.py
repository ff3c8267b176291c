"""Page mirror: copy completed GPU pages (whole pages, every layer) to host pages,
and single tokens' rows (every layer) to the same tokens of host pages.

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

Rows: under `hybrid` every forward's new tokens are mirrored into the host copy
of their (still incomplete) page. A token's rows of one IndexShare group are
one contiguous run of `run_bytes[g]` bytes at `group_offsets[g] + token *
run_bytes[g]` inside its page, so one token is one small run per group,
scattered over the page. `mirror_rows` copies them with the same contract as
`mirror_pages`: enqueued on the side stream after the caller's stream, a
completion event returned, the host never blocked. On CUDA it is the Triton
kernel (`mirror_rows_triton`: one launch for every (token, group) run, SMs
storing into the pinned host pool through UVA), because the copy engine would
need one `copy_` per (token, group) run of a few KiB, each paying a launch
(not measured yet: bench/kernels_residency.py times whole pages only). On CPU
it is the PyTorch twin (`mirror_rows_reference`), one indexed copy per group.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

_CHUNK_WORDS = 4096
_ROW_BLOCK_WORDS = 1024  # most words one program of the rows kernel copies
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


def _runs(gpu_ids: list[int], host_ids: list[int]) -> list[tuple[int, int, int]]:
    """(gpu start, host start, length) of maximal runs of consecutive page pairs."""
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
    runs = _runs(gpu_ids, host_ids)
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


# --- single tokens' rows --------------------------------------------------------------


@triton.jit
def _mirror_rows_kernel(gpu_ptr, host_ptr, meta_ptr, num_rows, num_groups, page_words, BLOCK: tl.constexpr):
    """Program (row, group, block): words [block * BLOCK, +BLOCK) of one token's run of one group.

    meta (int64): GPU pages, host pages, tokens (num_rows each), then group offsets and run
    sizes (num_groups each), all in words; every address is computed in int64.
    """
    i = tl.program_id(0)
    g = tl.program_id(1)
    src_page = tl.load(meta_ptr + i)
    dst_page = tl.load(meta_ptr + num_rows + i)
    token = tl.load(meta_ptr + 2 * num_rows + i)
    offset = tl.load(meta_ptr + 3 * num_rows + g)
    run = tl.load(meta_ptr + 3 * num_rows + num_groups + g)
    start = offset + token * run
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < run
    words = tl.load(gpu_ptr + src_page * page_words + start + offs, mask=mask)
    tl.store(host_ptr + dst_page * page_words + start + offs, words, mask=mask)


def _rows_args(gpu_pool: torch.Tensor, host_pool: torch.Tensor, gpu_page_ids: PageIds, host_page_ids: PageIds,
               tokens: PageIds, group_offsets: Sequence[int], run_bytes: Sequence[int]):  # noqa: ANN202
    """Validated ids, tokens, offsets and run sizes (Python ints).

    Every (host page, token) must be distinct: the kernel's programs run in no order, so two
    writes to one destination would leave either one.
    """
    gpu_ids, host_ids, toks = _as_ids(gpu_page_ids), _as_ids(host_page_ids), _as_ids(tokens)
    _check(gpu_pool, host_pool, gpu_ids, host_ids)
    if len(toks) != len(gpu_ids):
        raise ValueError("tokens must be 1-D of the same length as the page ids")
    offsets, runs = [int(x) for x in group_offsets], [int(x) for x in run_bytes]
    if len(offsets) != len(runs) or not offsets:
        raise ValueError("group_offsets and run_bytes must be non-empty and of the same length")
    if any(o < 0 for o in offsets) or any(r <= 0 for r in runs):
        raise ValueError("group offsets must be >= 0 and run sizes > 0")
    page_bytes = gpu_pool.shape[1]
    tokens_per_page = min((page_bytes - o) // r for o, r in zip(offsets, runs))  # tokens whose runs fit
    if toks and not (0 <= min(toks) and max(toks) < tokens_per_page):
        raise ValueError(f"a token is out of range: a group's runs past it would leave the {page_bytes}-byte page")
    if len(set(zip(host_ids, toks))) != len(toks):
        raise ValueError("two rows have the same destination (host page, token)")
    return gpu_ids, host_ids, toks, offsets, runs


def mirror_rows_triton(gpu_pool: torch.Tensor, host_pool: torch.Tensor, gpu_page_ids: PageIds,
                       host_page_ids: PageIds, tokens: PageIds, group_offsets: Sequence[int],
                       run_bytes: Sequence[int], stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
    """Copy single tokens' rows of every group (GPU page, token) -> (host page, token) in one Triton
    launch; returns the completion event (None on CPU).

    For row i and group g the run of `run_bytes[g]` bytes at `group_offsets[g] + tokens[i] *
    run_bytes[g]` of GPU page `gpu_page_ids[i]` goes to the same bytes of host page
    `host_page_ids[i]`; nothing else of the host pool is written. Pools as in
    `mirror_pages_triton`; ids and tokens: CPU int tensors or sequences of equal length, the
    destinations distinct. The bytes move as int32 words when the page size, every offset and
    run size and both pools' addresses are 4-byte aligned, else byte by byte. The ids travel
    to the device as one small int64 tensor (page ids times page sizes pass 2**31).
    """
    gpu_ids, host_ids, toks, offsets, runs = _rows_args(
        gpu_pool, host_pool, gpu_page_ids, host_page_ids, tokens, group_offsets, run_bytes)
    if not gpu_ids:
        return _record(gpu_pool, stream)
    aligned = (gpu_pool.shape[1], gpu_pool.data_ptr(), host_pool.data_ptr(), *offsets, *runs)
    word = 4 if all(x % 4 == 0 for x in aligned) else 1
    gpu_words = gpu_pool.view(torch.int32) if word == 4 else gpu_pool
    host_words = host_pool.view(torch.int32) if word == 4 else host_pool
    meta = gpu_ids + host_ids + toks + [o // word for o in offsets] + [r // word for r in runs]
    max_run = max(runs) // word
    block = min(_ROW_BLOCK_WORDS, triton.next_power_of_2(max_run))
    grid = (len(gpu_ids), len(runs), triton.cdiv(max_run, block))
    args = (len(gpu_ids), len(runs), gpu_pool.shape[1] // word)
    if not gpu_pool.is_cuda:
        _mirror_rows_kernel[grid](gpu_words, host_words, _meta(meta, gpu_pool), *args, BLOCK=block)
        return None
    side = _side_stream(gpu_pool, stream)
    with torch.cuda.stream(side):
        _mirror_rows_kernel[grid](gpu_words, host_words, _meta(meta, gpu_pool), *args, BLOCK=block)
        event = torch.cuda.Event()
        event.record(side)
    return event


def mirror_rows_reference(gpu_pool: torch.Tensor, host_pool: torch.Tensor, gpu_page_ids: PageIds,
                          host_page_ids: PageIds, tokens: PageIds, group_offsets: Sequence[int],
                          run_bytes: Sequence[int], stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
    """PyTorch twin of `mirror_rows_triton`: on CPU one indexed copy per group; on CUDA one
    asynchronous `copy_` per (row, group) run on the side stream."""
    gpu_ids, host_ids, toks, offsets, runs = _rows_args(
        gpu_pool, host_pool, gpu_page_ids, host_page_ids, tokens, group_offsets, run_bytes)
    if not gpu_pool.is_cuda:
        if toks:
            num_tokens = max(toks) + 1
            g_idx, h_idx, t_idx = (torch.tensor(x, dtype=torch.int64) for x in (gpu_ids, host_ids, toks))
            for offset, run in zip(offsets, runs):
                src = gpu_pool[:, offset : offset + num_tokens * run].unflatten(1, (num_tokens, run))
                dst = host_pool[:, offset : offset + num_tokens * run].unflatten(1, (num_tokens, run))
                dst[h_idx, t_idx] = src[g_idx, t_idx]
        return None
    side = _side_stream(gpu_pool, stream)
    with torch.cuda.stream(side):
        for g, h, t in zip(gpu_ids, host_ids, toks):
            for offset, run in zip(offsets, runs):
                start = offset + t * run
                host_pool[h, start : start + run].copy_(gpu_pool[g, start : start + run], non_blocking=True)
        event = torch.cuda.Event()
        event.record(side)
    return event


def mirror_rows(gpu_pool: torch.Tensor, host_pool: torch.Tensor, gpu_page_ids: PageIds, host_page_ids: PageIds,
                tokens: PageIds, group_offsets: Sequence[int], run_bytes: Sequence[int],
                stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
    """Mirror single tokens' rows: the Triton kernel on CUDA (one launch, see the module docstring),
    the PyTorch twin on CPU."""
    fn = mirror_rows_triton if gpu_pool.is_cuda else mirror_rows_reference
    return fn(gpu_pool, host_pool, gpu_page_ids, host_page_ids, tokens, group_offsets, run_bytes, stream)
