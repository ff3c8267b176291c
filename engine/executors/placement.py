"""Placement group bundles of one replica, for the Serve deployment that hosts it.

Bundle 0 holds the replica actor itself (Serve places it there): with one rank
it runs the model on its own GPU; with several it is the driver (scheduler,
page accounting) and needs no GPU, and bundles 1..N hold one rank
each. `STRICT_PACK` keeps a replica on one node: its ranks share the host pool
through shared memory and talk over NVLink.
"""

from __future__ import annotations

PLACEMENT_STRATEGY = "STRICT_PACK"


def placement_group_bundles(tensor_parallel_size: int, device: str, replica_cpus: float = 1.0,
                            rank_cpus: float = 1.0) -> list[dict[str, float]]:
    """`placement_group_bundles` of a replica serving with `tensor_parallel_size` ranks on `device`."""
    if tensor_parallel_size < 1:
        raise ValueError("tensor_parallel_size must be at least 1")
    gpu = {"GPU": 1.0} if device.startswith("cuda") else {}
    if tensor_parallel_size == 1:
        return [{"CPU": replica_cpus, **gpu}]
    return [{"CPU": replica_cpus}] + [{"CPU": rank_cpus, **gpu} for _ in range(tensor_parallel_size)]
