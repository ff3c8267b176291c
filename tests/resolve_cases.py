"""Small residency cases shared by the interpreter tests and the GPU tests of the resolve: a batch's page tables
and hot buffers (held positions' rows already in their hot slots) and top-K rows, all on the CPU; a GPU test
moves them to the device. Importing it sets nothing in the environment."""

import random
from dataclasses import dataclass

import torch

PAGE = 64
ROW = 20  # bytes per layer row in the small layout
GROUP_SIZES = (1, 3)  # two IndexShare groups: {0}, {1, 2, 3}
PAGE_BYTES = PAGE * sum(GROUP_SIZES) * ROW


def group_place(group: int) -> tuple[int, int]:
    """(byte offset, run bytes) of an IndexShare group in the small layout."""
    return PAGE * ROW * sum(GROUP_SIZES[:group]), GROUP_SIZES[group] * ROW


def runs_view(pool: torch.Tensor, group: int) -> torch.Tensor:
    offset, run = group_place(group)
    return pool[:, offset : offset + PAGE * run].unflatten(1, (PAGE, run))


@dataclass
class ResolveCase:
    """A batch's residency inputs; `state()` clones the tensors the resolve mutates."""

    ctx: list[int]
    gpu_page: torch.Tensor  # [B, max_pages]
    host_page: torch.Tensor  # [B, max_pages]
    hot_slots: torch.Tensor  # [B, R]
    slot_pos: torch.Tensor  # [B, R]
    slot_stamp: torch.Tensor  # [B, R]
    pos_to_hot: torch.Tensor  # [B, max_ctx]
    gpu_pool: torch.Tensor
    host_pool: torch.Tensor

    def state(self):
        return [t.clone() for t in (self.slot_pos, self.slot_stamp, self.pos_to_hot, self.gpu_pool)]

    def to_gpu(self) -> "ResolveCase":
        """The case on the current CUDA device, its host pool pinned (the resolve reads it through UVA)."""
        dev = torch.device("cuda")
        return ResolveCase(self.ctx, *(t.to(dev) for t in (self.gpu_page, self.host_page, self.hot_slots,
                                                            self.slot_pos, self.slot_stamp, self.pos_to_hot,
                                                            self.gpu_pool)), self.host_pool.pin_memory())


def make_case(rng: random.Random, ctx: list[int], num_hot: int, max_ctx: int, step: int,
              stamp_dtype=torch.int64, map_dtype=torch.int16) -> ResolveCase:
    b, max_pages = len(ctx), max_ctx // PAGE
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    num_gpu_pages = b * max_pages + b * (num_hot // PAGE + 2)
    gpu_pool = torch.randint(0, 256, (num_gpu_pages, PAGE_BYTES), dtype=torch.uint8, generator=gen)
    host_pool = torch.randint(0, 256, (b * max_pages + 3, PAGE_BYTES), dtype=torch.uint8, generator=gen)
    gpu_page = torch.full((b, max_pages), -1, dtype=torch.int32)
    host_page = torch.randperm(host_pool.shape[0], generator=gen)[: b * max_pages].view(b, max_pages).int()
    free_gpu = torch.randperm(b * max_pages, generator=gen).tolist()
    hot_pool_slots = torch.arange(b * max_pages * PAGE, num_gpu_pages * PAGE)
    hot_slots = hot_pool_slots[torch.randperm(len(hot_pool_slots), generator=gen)[: b * num_hot]]
    slot_pos = torch.full((b, num_hot), -1, dtype=torch.int32)
    slot_stamp = torch.randint(0, max(step, 1), (b, num_hot), generator=gen).to(stamp_dtype)
    pos_to_hot = torch.full((b, max_ctx), -1, dtype=map_dtype)
    for i, n in enumerate(ctx):
        for p in range((n - 1) // PAGE + 1):
            if p == (n - 1) // PAGE or rng.random() < 0.25:  # tail page always resident
                gpu_page[i, p] = free_gpu.pop()
        cold = [pos for pos in range(n) if gpu_page[i, pos // PAGE] < 0]
        held = rng.sample(cold, min(len(cold), rng.randrange(num_hot + 1)))
        for pos, slot in zip(held, rng.sample(range(num_hot), len(held))):
            slot_pos[i, slot], pos_to_hot[i, pos] = pos, slot
            phys = hot_slots[i * num_hot + slot].item()
            for g in range(len(GROUP_SIZES)):  # a held position's rows are in its hot slot
                src = runs_view(host_pool, g)[host_page[i, pos // PAGE], pos % PAGE]
                runs_view(gpu_pool, g)[phys // PAGE, phys % PAGE] = src
    return ResolveCase(ctx, gpu_page, host_page, hot_slots.view(b, num_hot).int().contiguous(),
                       slot_pos, slot_stamp, pos_to_hot, gpu_pool, host_pool)


def make_topk(rng: random.Random, ctx: list[int], k: int, previous: list[list[int]] | None = None):
    """Unique positions per row, the newest token first, about half reused from `previous`."""
    topk = torch.full((len(ctx), k), 1 << 20, dtype=torch.int32)  # poison past count
    rows = []
    for i, n in enumerate(ctx):
        count = min(n, k) if rng.random() < 0.7 else rng.randrange(min(n, k) + 1)
        picked = [n - 1] if count else []
        reuse = [p for p in (previous[i] if previous else []) if p < n - 1]
        for p in rng.sample(reuse, min(len(reuse), count // 2)) + rng.sample(range(n - 1), max(0, count - 1)):
            if len(picked) < count and p not in picked:
                picked.append(p)
        rows.append(picked)
        topk[i, : len(picked)] = torch.tensor(picked, dtype=torch.int32)
    counts = torch.tensor([len(r) for r in rows], dtype=torch.int32)
    return topk, counts, rows


def run_resolve(fn, case: ResolveCase, topk, counts, state, step, group):
    """`fn` (the resolve or its twin) on `state` (from `case.state()`), its output poisoned first."""
    slot_pos, slot_stamp, pos_to_hot, gpu_pool = state
    offset, run = group_place(group)
    out = torch.full(topk.shape, -7, dtype=torch.int32, device=topk.device)  # poisoned output
    return fn(topk, counts, case.gpu_page, case.host_page, case.hot_slots, slot_pos, slot_stamp, pos_to_hot,
              step, offset, run, gpu_pool, case.host_pool, out=out)


# (seed, contexts, top-K, hot slots, step, stamp dtype, reverse-map dtype) of the small resolve cases (contexts
# within 384 tokens)
SMALL_CASES = [
    (0, [5, 300, 384, 64], 16, 24, 9, torch.int64, torch.int16),
    (1, [130, 1, 200], 32, 40, 9, torch.int32, torch.int32),
    (2, [256, 90], 16, 16, 9, torch.int64, torch.int16),  # R == K: misses can exceed free slots
    (3, [250, 256, 129], 24, 8, 9, torch.int32, torch.int16),  # R < count: caller broke the guarantee
    (4, [384, 300, 200], 16, 20, 1 << 40, torch.int64, torch.int16),  # wide stamp range: many search rounds
    (5, [384, 384], 32, 48, 2_000_000_000, torch.int32, torch.int32),
    (6, [300, 384, 200], 16, 24, 3, torch.int32, torch.int16),  # three stamps: victims below the threshold and at it
    (7, [384, 384, 300], 32, 64, 70, torch.int32, torch.int16),  # a stamp a slot: thresholds either side of 30 above
]
