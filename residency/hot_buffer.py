"""Hot buffers: GPU slots holding the rows of host-only tokens a request's indexer selects.

A lease is a few pages of the GPU pool (use HOT) with the MLA page layout, so a
hot slot is addressed like any KV slot. The driver's `HotLease` records which
pages a request holds (page accounting); the LRU state lives in `HotTables`,
one copy per tensor-parallel rank next to that rank's pool, because the resolve
updates it on the device during the forward. Per IndexShare group the tables
map slot -> token position (`slot_pos`, last use in `slot_stamp`) and back
(`pos_to_hot`, grown with the request). Every rank runs the same resolve on the
same inputs, so the copies stay identical. Returned to the pool when the
request finishes or is promoted back to fully resident.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.resolve import LeaseState

PAGE_SIZE = 64


@dataclass(frozen=True)
class HotLease:
    """The GPU pages a request's hot slots live in."""

    pages: tuple[int, ...]

    @property
    def num_rows(self) -> int:
        return len(self.pages) * PAGE_SIZE


@dataclass
class HotTables:
    """One rank's LRU tables of one lease.

    The tables live across steps and are changed both inside a forward (the resolve, a speculative step growing
    the reverse map) and outside it (the scheduler resizing a lease), so every tensor they hold is made outside
    inference mode: one made inside a forward is an inference tensor, which torch refuses to update in place
    outside one (a speculative step's grown map, shrunk by the next resize, ended the engine loop).
    """

    pages: tuple[int, ...]  # the GPU pages of the slots, in slot order
    hot_slots: torch.Tensor  # [R] int32 physical slot of each hot slot
    slot_pos: torch.Tensor  # [G, R] int32 token held by each slot, -1 when empty
    slot_stamp: torch.Tensor  # [G, R] int64 step of last use
    pos_to_hot: torch.Tensor  # [G, capacity] int32 hot slot of each position, -1 when none

    @staticmethod
    def _slots(pages: tuple[int, ...], device: torch.device) -> torch.Tensor:
        slots = (torch.tensor(pages, dtype=torch.int32)[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).reshape(-1)
        return slots.to(device=device, dtype=torch.int32, non_blocking=True)  # pageable: staged, no wait

    @staticmethod
    def _empty(num_groups: int, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`slot_pos` and `slot_stamp` of `rows` empty slots per group."""
        return (torch.full((num_groups, rows), -1, dtype=torch.int32, device=device),
                torch.zeros((num_groups, rows), dtype=torch.int64, device=device))

    @classmethod
    @torch.inference_mode(False)
    def new(cls, pages: tuple[int, ...], num_groups: int, capacity: int, device: torch.device) -> "HotTables":
        slot_pos, slot_stamp = cls._empty(num_groups, len(pages) * PAGE_SIZE, device)
        return cls(
            pages=tuple(pages),
            hot_slots=cls._slots(tuple(pages), device),
            slot_pos=slot_pos,
            slot_stamp=slot_stamp,
            pos_to_hot=torch.full((num_groups, capacity), -1, dtype=torch.int32, device=device),
        )

    @torch.inference_mode(False)
    def ensure_capacity(self, num_tokens: int) -> None:
        """Grows the reverse map to cover positions below `num_tokens`."""
        have = self.pos_to_hot.shape[1]
        if num_tokens <= have:
            return
        grow = max(num_tokens, 2 * have) - have
        pad = torch.full((self.pos_to_hot.shape[0], grow), -1, dtype=torch.int32, device=self.pos_to_hot.device)
        self.pos_to_hot = torch.cat([self.pos_to_hot, pad], dim=1)

    @torch.inference_mode(False)
    def resize(self, pages: tuple[int, ...], capacity: int) -> None:
        """Refits the tables to `pages`, which keep the current pages' order: either a prefix of them
        (shrink) or all of them followed by new ones (grow). Slots of kept pages keep their tokens and
        stamps, so a request's hot rows survive the resize an extend and the decode after it make;
        new slots start empty; tokens held by dropped slots leave the reverse map. No host sync."""
        pages = tuple(pages)
        keep = min(len(pages), len(self.pages))
        if not pages or pages[:keep] != self.pages[:keep]:
            raise ValueError("a resized lease keeps its pages in order: a non-empty prefix, or all and new ones")
        rows, have = len(pages) * PAGE_SIZE, self.hot_slots.numel()
        if rows < have:
            self.hot_slots = self.hot_slots[:rows].clone()
            self.slot_pos = self.slot_pos[:, :rows].clone()
            self.slot_stamp = self.slot_stamp[:, :rows].clone()
            self.pos_to_hot.masked_fill_(self.pos_to_hot >= rows, -1)
        elif rows > have:
            device = self.slot_pos.device
            new_pos, new_stamp = self._empty(self.slot_pos.shape[0], rows - have, device)
            self.hot_slots = torch.cat([self.hot_slots, self._slots(pages[len(self.pages):], device)])
            self.slot_pos = torch.cat([self.slot_pos, new_pos], dim=1)
            self.slot_stamp = torch.cat([self.slot_stamp, new_stamp], dim=1)
        self.pages = pages
        self.ensure_capacity(capacity)

    def lease(self, group: int) -> LeaseState:
        """This lease's tables of one IndexShare group, as views the resolve updates in place."""
        return LeaseState(self.hot_slots, self.slot_pos[group], self.slot_stamp[group], self.pos_to_hot[group])
