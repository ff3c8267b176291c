"""A rank's place in its tensor-parallel group, and the group's one collective.

Model modules take a `TensorParallel` when they are built: it says how many
attention heads and MLP features this rank holds, cuts full tensors down to the
rank's part and sums the partial outputs of the ranks. The group is the
default `torch.distributed` process group of a worker process (one replica per
process group). A size-1 group does nothing at all, so the single-rank model is
exactly the plain model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


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

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums the ranks' partial results in place. Every rank receives the same bytes, which keeps
        the replicated parts of the model (latent cache, indexer, router) identical on all ranks."""
        if self.size > 1:
            dist.all_reduce(x)
        return x
