"""How the driver reaches the ranks of its replica: one small interface, three implementations.

The driver (scheduler, page accounting, residency decisions) talks to its ranks
only through an `Executor`: run a forward step, copy pages between the GPU
pools and the host pool, open and close hot leases. `LocalExecutor` holds the
single rank in the engine's own process (tensor_parallel_size 1, on CPU and
CUDA alike: no extra process, no serialisation). The multi-process executors
(engine/executors/remote.py: `mp` and `ray`) keep the same contract across
process boundaries.

Contract, whatever the implementation:
- calls reach every rank in the order the driver made them;
- `launch_model` queues a step on every rank; its output, read later, holds the token ids rank 0 sampled;
- `mirror_pages` is done by one rank into the shared host pool,
  asynchronously; its ticket says when the host copies are complete;
- once a rank fails, every later call raises `WorkerError`.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

import torch

from engine.rank.step import StepInput, StepOutput
from engine.rank.worker import Worker, WorkerSpec
from residency.interfaces import CopyTicket


class WorkerError(RuntimeError):
    """A rank of the replica died or failed; the replica cannot continue and must be replaced."""


class EventTicket(CopyTicket):
    """A copy on this process's device: a CUDA event, or None when the copy already finished."""

    def __init__(self, event: torch.cuda.Event | None) -> None:
        self.event = event

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class PendingOutput(Protocol):
    """A step's output once the ranks have it."""

    def output(self) -> StepOutput: ...


class Executor(ABC):
    """The replica's ranks as the driver sees them; residency uses the page and lease half
    (`PoolExecutor` in residency/manager.py), the model runner `launch_model`."""

    tp_size: int

    @abstractmethod
    def memory_info(self) -> list[tuple[int, int]]:
        """Per rank (free, total) bytes of its GPU after loading weights; (0, 0) off the GPU."""

    @abstractmethod
    def init_kv_pool(self, num_pages: int) -> None:
        """Every rank allocates its replica of the page pool."""

    @abstractmethod
    def create_host_pool(self, num_pages: int, page_bytes: int) -> torch.Tensor:
        """The replica's one host pool [num_pages, page_bytes] uint8, mapped by every rank; returns the
        driver's view of it (the residency manager's page accounting wraps it)."""

    @abstractmethod
    def launch_model(self, step: StepInput) -> PendingOutput:
        """Queues `step` on every rank; its output is read later (`output()`), after the driver prepared the
        next step (every rank takes the inputs the driver has not read from its own device)."""

    @abstractmethod
    def mirror_pages(self, gpu_ids: Sequence[int], host_ids: Sequence[int]) -> CopyTicket: ...

    @abstractmethod
    def load_pages(self, host_ids: Sequence[int], gpu_ids: Sequence[int]) -> CopyTicket:
        """Every rank copies the host pages into its GPU pages before its next step; the ticket is done
        once every rank has read the host pages (until then none of them may be written by the CPU)."""

    @abstractmethod
    def read_pages(self, gpu_ids: Sequence[int]) -> torch.Tensor:
        """Whole GPU pages as one CPU tensor [n, page_bytes] (read from one rank: all hold the same)."""

    @abstractmethod
    def copy_pages(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Every rank copies whole GPU pages to other GPU pages before its next step."""

    @abstractmethod
    def write_pages(self, gpu_ids: Sequence[int], data: torch.Tensor) -> None:
        """Every rank writes `data` [n, page_bytes] into the GPU pages before its next step."""

    @abstractmethod
    def open_lease(self, request_id: str, pages: Sequence[int], capacity: int) -> None:
        """Every rank creates empty hot tables for the request (positions below `capacity` mapped)."""

    @abstractmethod
    def resize_lease(self, request_id: str, pages: Sequence[int], capacity: int) -> None:
        """Every rank refits the request's hot tables to `pages` (a prefix of its pages, or all of them
        and new ones), keeping the entries of the slots that stay."""

    @abstractmethod
    def close_lease(self, request_id: str) -> None: ...

    @abstractmethod
    def lease_digests(self) -> list[dict[str, str]]:
        """Per rank: request id -> hash of its hot tables (integrity checks compare them)."""

    @abstractmethod
    def check_health(self) -> None:
        """Raises `WorkerError` if a rank is gone."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stops the ranks; the executor is unusable afterwards."""

    @property
    def kv_pool(self) -> torch.Tensor:
        """The page pool itself, only where it lives in this process."""
        raise RuntimeError(f"the KV pool lives in {self.tp_size} worker processes; it has no local tensor")


class LocalExecutor(Executor):
    """The single rank in the engine's process: direct calls, today's single-device engine."""

    def __init__(self, spec: WorkerSpec, device: torch.device) -> None:
        self.tp_size = 1
        self.worker = Worker(spec, 0, device)

    @property
    def kv_pool(self) -> torch.Tensor:
        return self.worker.kv_pool

    def memory_info(self) -> list[tuple[int, int]]:
        return [self.worker.memory_info()]

    def init_kv_pool(self, num_pages: int) -> None:
        self.worker.init_kv_pool(num_pages)

    def create_host_pool(self, num_pages: int, page_bytes: int) -> torch.Tensor:
        pin = self.worker.device.type == "cuda"  # GPU kernels read it through UVA
        data = torch.zeros((num_pages, page_bytes), dtype=torch.uint8, pin_memory=pin)
        self.worker.attach_host_pool(data)
        return data

    def launch_model(self, step: StepInput) -> PendingOutput:
        return self.worker.launch_model(step)

    def mirror_pages(self, gpu_ids: Sequence[int], host_ids: Sequence[int]) -> CopyTicket:
        return EventTicket(self.worker.mirror_pages(gpu_ids, host_ids))

    def load_pages(self, host_ids: Sequence[int], gpu_ids: Sequence[int]) -> CopyTicket:
        return EventTicket(self.worker.load_pages(host_ids, gpu_ids))

    def read_pages(self, gpu_ids: Sequence[int]) -> torch.Tensor:
        return self.worker.read_pages(gpu_ids)

    def write_pages(self, gpu_ids: Sequence[int], data: torch.Tensor) -> None:
        self.worker.write_pages(gpu_ids, data)

    def copy_pages(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        self.worker.copy_pages(src_ids, dst_ids)

    def open_lease(self, request_id: str, pages: Sequence[int], capacity: int) -> None:
        self.worker.open_lease(request_id, pages, capacity)

    def resize_lease(self, request_id: str, pages: Sequence[int], capacity: int) -> None:
        self.worker.resize_lease(request_id, pages, capacity)

    def close_lease(self, request_id: str) -> None:
        self.worker.close_lease(request_id)

    def lease_digests(self) -> list[dict[str, str]]:
        return [self.worker.lease_digests()]

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        self.worker.close()


# Multi-process executors by name; imported on use, so Ray is needed only where it is used.
_REMOTE_EXECUTORS = {
    "mp": "engine.executors.mp_executor:MPExecutor",
    "ray": "engine.executors.ray_executor:RayExecutor",
}


def make_executor(spec: WorkerSpec, executor: str, device: torch.device) -> Executor:
    """The executor for `spec`: in-process for one rank, else the named multi-process one."""
    if spec.tp_size == 1:
        return LocalExecutor(spec, device)
    if executor not in _REMOTE_EXECUTORS:
        raise ValueError(f"executor must be one of {sorted(_REMOTE_EXECUTORS)}, got {executor!r}")
    module, name = _REMOTE_EXECUTORS[executor].split(":")
    cls = getattr(importlib.import_module(module), name)
    return cls(spec)
