"""A rank's place in its tensor-parallel group, and the group's two collectives.

Model modules take a `TensorParallel` when they are built: it says how many
attention heads and MLP features this rank holds, cuts full tensors down to the
rank's part, sums the partial outputs of the ranks and gathers the vocabulary
split's logits. The group is the
default `torch.distributed` process group of a worker process (one replica per
process group). A size-1 group does nothing at all, so the single-rank model is
exactly the plain model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.argmax import row_argmax


# Gathers every rank's tensor into one, rank order along dim 0 (named all_gather_single from torch 2.13 on).
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class TensorParallel:
    """Rank `rank` of `size` ranks that split one model."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.size}")

    def local(self, n: int, what: str) -> int:
        """This rank's share of `n` (heads, features); `what` names it in the error."""
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={self.size}")
        return n // self.size

    def shard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous block of `tensor` along `dim`."""
        n = self.local(tensor.shape[dim], f"size of dim {dim}")
        return tensor.narrow(dim, self.rank * n, n)

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[S, n] on every rank -> [S, size * n], rank r's columns at r * n (a vocabulary split's logits);
        every rank receives the whole. S may be 0 (a step of prompt chunks that samples nothing)."""
        if self.size == 1:
            return x
        parts = torch.empty((self.size * x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
        _gather_into(parts, x.contiguous())  # one collective into one buffer: capturable in a CUDA graph
        return parts.view(self.size, *x.shape).permute(1, 0, 2).reshape(x.shape[0], self.size * x.shape[1])

    def argmax_columns(self, x: torch.Tensor) -> torch.Tensor:
        """int64 [S]: the column of each row's largest value in [S, size * n], of which every rank holds its
        columns [S, n] (a vocabulary split's logits), the first of equal ones as `argmax` of the whole would
        give. Each rank gathers its rows' best (value, column) pairs, not its columns: two numbers a row."""
        best = row_argmax(x) if x.is_cuda else x.argmax(dim=-1)  # one program a row on a GPU
        if self.size == 1:
            return best
        # columns as float32 are exact below 2**24: a vocabulary split is far below
        pairs = torch.stack([x.gather(1, best[:, None])[:, 0].float(), (best + self.rank * x.shape[1]).float()], 1)
        gathered = self.all_gather_columns(pairs).view(x.shape[0], self.size, 2)
        winner = gathered[..., 0].argmax(dim=1, keepdim=True)  # the lowest rank among equal values
        return gathered[..., 1].gather(1, winner)[:, 0].long()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums the ranks' partial results in place. Every rank receives the same bytes, which keeps
        the replicated parts of the model (latent cache, indexer, router) identical on all ranks."""
        if self.size > 1:
            dist.all_reduce(x)
        return x
