"""Ranks in other processes: the driver's side (`RemoteExecutor`) and the rank's side (`RemoteWorker`).

The transport (multiprocessing pipes or Ray actor calls, in the subclasses)
only has to deliver named calls to each rank in order, and bring back replies
where the driver waits for them. Everything else is here and shared:

- One-way calls (page loads, mirrors, lease changes) are not waited for; a
  rank that fails on one reports it, and the driver raises at its next wait.
- A step is launched to every rank (`launch_model`) and its replies are read
  later, after the driver prepared the next step; rank 0 answers with the
  sampled token ids (a few bytes per request), the other ranks with nothing.
  Every rank samples the same ids and keeps them on its device for the next
  step's inputs. Replies are read in the order their calls were sent: a call
  that waits reads the replies of launched steps first.
- Mirrors are done by rank 0 on its side stream, overlapping the next step;
  rank 0 finishes them before it answers that step (or a `sync`), so a mirror
  ticket is done once a step launched (or a sync sent) after it has answered.
- Host pages are read by every rank (loads; resolves inside a step) but
  written by rank 0 alone (mirrors). Loads are queued on each rank's stream,
  not waited for, and a host page the driver freed after a load may be reused
  by a mirror before a slower rank has done that load, so when loads were sent
  since the ranks last met (a step's collectives or a wait), all ranks meet at
  a barrier, each once its loads are done, before rank 0 writes the host pool.
  Reads inside a step are fenced by the step's own all-reduces.
"""

from __future__ import annotations

import collections
import logging
import os
from abc import abstractmethod
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from engine.executors.executor import Executor, WorkerError
from engine.executors.shared_memory import SharedTensor, SharedTensorHandle
from engine.rank.step import StepInput, StepOutput
from engine.rank.worker import Worker, WorkerSpec
from residency.interfaces import CopyTicket

logger = logging.getLogger(__name__)

Call = tuple[str, tuple[Any, ...]]  # (method of RemoteWorker, arguments)

# A collective that waits this long means a peer is gone; the driver notices dead ranks much sooner.
_COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def rank_device(device_type: str, index: int) -> torch.device:
    return torch.device(device_type, index) if device_type == "cuda" else torch.device("cpu")


class RemoteWorker:
    """A rank in a worker process: a `Worker` in a process group, driven by named calls."""

    # Calls this class adapts to the process (shared buffers, events, collectives) ...
    CALLS = frozenset({"attach_host_pool", "execute_model", "mirror_pages", "load_pages", "sync", "fence"})
    # ... and calls the rank's `Worker` answers as it is.
    FORWARDED = frozenset({
        "memory_info", "init_kv_pool", "read_pages", "write_pages", "copy_pages", "open_lease",
        "resize_lease", "close_lease", "lease_digests",
    })

    def __init__(self, spec: WorkerSpec, rank: int, device: torch.device, dist_url: str) -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:  # ranks share the machine's cores; more threads each would only contend
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.tp_size))
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=dist_url, rank=rank, world_size=spec.tp_size,
                                timeout=_COLLECTIVE_TIMEOUT)
        self.worker = Worker(spec, rank, device)
        self._mirrors: list[torch.cuda.Event] = []

    def handle(self, method: str, args: tuple[Any, ...]) -> Any:  # noqa: ANN401 - per-call results
        if method in self.CALLS:
            return getattr(self, method)(*args)
        if method in self.FORWARDED:
            return getattr(self.worker, method)(*args)
        raise ValueError(f"unknown worker call {method!r}")

    def close(self) -> None:
        self.worker.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    # --- calls -----------------------------------------------------------------------

    def attach_host_pool(self, host: SharedTensorHandle) -> None:
        self.worker.attach_host_pool(host.attach(pin=self.worker.device.type == "cuda"))

    def execute_model(self, step: StepInput) -> StepOutput | None:
        out = self.worker.execute_model(step)
        if self.worker.rank != 0:
            return None
        self.sync()
        return out

    def mirror_pages(self, gpu_ids: Sequence[int], host_ids: Sequence[int]) -> None:
        event = self.worker.mirror_pages(gpu_ids, host_ids)
        if event is not None:
            self._mirrors.append(event)

    def load_pages(self, host_ids: Sequence[int], gpu_ids: Sequence[int]) -> None:
        self.worker.load_pages(host_ids, gpu_ids)  # its event stays with the rank (`fence`, `sync`)

    def sync(self) -> None:
        """Finishes this rank's outstanding mirrors (and its device work, on CUDA)."""
        for event in self._mirrors:
            event.synchronize()
        self._mirrors.clear()
        if self.worker.device.type == "cuda":
            torch.cuda.synchronize(self.worker.device)

    def fence(self) -> None:
        """Meets every rank once each has read the host pages of its loads (queued, not yet waited for)."""
        self.worker.wait_for_loads()
        dist.barrier()


class SyncTicket(CopyTicket):
    """A copy done by the ranks: complete once a call the ranks answer, sent after it, has been answered."""

    def __init__(self, executor: RemoteExecutor, seq: int) -> None:
        self.executor, self.seq = executor, seq  # answered calls sent before the copy

    def done(self) -> bool:
        return self.executor.num_waits > self.seq

    def wait(self) -> None:
        if not self.done():
            self.executor.sync()


class RemoteStep:
    """A step launched to every rank; `output` reads the ranks' replies (and those of steps launched
    before it)."""

    def __init__(self, executor: RemoteExecutor, token: Any) -> None:  # noqa: ANN401 - the transport's
        self.executor, self.token = executor, token
        self.replies: list[Any] | None = None

    def output(self) -> StepOutput:
        self.executor._read_launched(self)
        return self.replies[0]


class RemoteExecutor(Executor):
    """The driver's side of ranks in worker processes; subclasses supply the transport."""

    pids: list[int]  # the ranks' processes, rank order (logs, operators)

    def __init__(self, spec: WorkerSpec) -> None:
        self.tp_size = spec.tp_size
        self.num_waits = 0  # completed waits after which rank 0 had finished its mirrors
        self._loads_since_wait = False
        self._error: WorkerError | None = None
        self._ranks = tuple(range(spec.tp_size))
        self._num_sent_waits = 0  # calls sent whose answers are read (steps launched, syncs)
        self._launched: collections.deque[RemoteStep] = collections.deque()  # launched, replies not read
        self._start(spec)

    # --- transport (subclasses) -------------------------------------------------------

    @abstractmethod
    def _start(self, spec: WorkerSpec) -> None:
        """Starts one process per rank, each building `RemoteWorker`; returns when all are ready."""

    @abstractmethod
    def _post(self, ranks: Sequence[int], call: Call) -> None:
        """Sends `call` to `ranks` without waiting."""

    @abstractmethod
    def _gather(self, ranks: Sequence[int], call: Call) -> list[Any]:
        """Sends `call` to `ranks` and returns their replies; raises `WorkerError` if a rank failed."""

    @abstractmethod
    def _launch(self, ranks: Sequence[int], call: Call) -> Any:  # noqa: ANN401 - the transport's
        """Sends `call` to `ranks`, whose replies are read later by `_replies`; returns what finds them."""

    @abstractmethod
    def _replies(self, token: Any) -> list[Any]:  # noqa: ANN401
        """The replies of a `_launch`; raises `WorkerError` if a rank failed."""

    @abstractmethod
    def _stop(self) -> None:
        """Ends the rank processes."""

    # --- guarded calls ----------------------------------------------------------------

    def _run(self, ranks: Sequence[int], call: Call, wait: bool) -> list[Any]:
        if self._error is not None:
            raise self._error
        if wait and self._launched:
            self._read_launched(self._launched[-1])
        try:
            if not wait:
                self._post(ranks, call)
                return []
            replies = self._gather(ranks, call)
        except WorkerError as exc:
            self._fail(exc)
        if len(ranks) == self.tp_size:  # every rank has read the host pages of earlier loads
            self._loads_since_wait = False
        return replies

    def _fail(self, exc: WorkerError) -> NoReturn:
        self._error = exc
        logger.error("tensor-parallel replica failed: %s", exc)
        self._stop()
        raise exc

    def _read_launched(self, step: RemoteStep) -> None:
        """Reads the replies of launched steps, in launch order, up to `step`."""
        while step.replies is None:
            if self._error is not None:
                raise self._error
            oldest = self._launched.popleft()
            try:
                oldest.replies = self._replies(oldest.token)
            except WorkerError as exc:
                self._fail(exc)
            self.num_waits += 1  # rank 0 finished its mirrors before answering

    # --- Executor -----------------------------------------------------------------------

    def memory_info(self) -> list[tuple[int, int]]:
        return self._run(self._ranks, ("memory_info", ()), wait=True)

    def init_kv_pool(self, num_pages: int) -> None:
        self._run(self._ranks, ("init_kv_pool", (num_pages,)), wait=True)

    def create_host_pool(self, num_pages: int, page_bytes: int) -> torch.Tensor:
        shared = SharedTensor((num_pages, page_bytes), torch.uint8)
        try:
            self._run(self._ranks, ("attach_host_pool", (shared.handle,)), wait=True)
        finally:
            shared.unlink()
        return shared.tensor

    def launch_model(self, step: StepInput) -> RemoteStep:
        if self._error is not None:
            raise self._error
        try:
            launched = RemoteStep(self, self._launch(self._ranks, ("execute_model", (step,))))
        except WorkerError as exc:
            self._fail(exc)
        self._launched.append(launched)
        self._num_sent_waits += 1
        self._loads_since_wait = False  # every rank reads earlier loads before the step's collectives
        return launched

    def mirror_pages(self, gpu_ids: Sequence[int], host_ids: Sequence[int]) -> CopyTicket:
        if self._loads_since_wait:
            self._run(self._ranks, ("fence", ()), wait=False)
            self._loads_since_wait = False
        self._run((0,), ("mirror_pages", (list(gpu_ids), list(host_ids))), wait=False)
        return SyncTicket(self, self._num_sent_waits)

    def sync(self) -> None:
        """Waits until every rank has done everything sent so far, rank 0's mirrors included."""
        self._num_sent_waits += 1
        self._run(self._ranks, ("sync", ()), wait=True)
        self.num_waits += 1

    def load_pages(self, host_ids: Sequence[int], gpu_ids: Sequence[int]) -> CopyTicket:
        self._run(self._ranks, ("load_pages", (list(host_ids), list(gpu_ids))), wait=False)
        self._loads_since_wait = True
        return SyncTicket(self, self._num_sent_waits)  # a rank answers a step only after its loads

    def read_pages(self, gpu_ids: Sequence[int]) -> torch.Tensor:
        [data] = self._run((0,), ("read_pages", (list(gpu_ids),)), wait=True)
        return data

    def write_pages(self, gpu_ids: Sequence[int], data: torch.Tensor) -> None:
        self._run(self._ranks, ("write_pages", (list(gpu_ids), data.contiguous())), wait=False)

    def copy_pages(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        self._run(self._ranks, ("copy_pages", (list(src_ids), list(dst_ids))), wait=False)

    def open_lease(self, request_id: str, pages: Sequence[int], capacity: int) -> None:
        self._run(self._ranks, ("open_lease", (request_id, list(pages), capacity)), wait=False)

    def resize_lease(self, request_id: str, pages: Sequence[int], capacity: int) -> None:
        self._run(self._ranks, ("resize_lease", (request_id, list(pages), capacity)), wait=False)

    def close_lease(self, request_id: str) -> None:
        self._run(self._ranks, ("close_lease", (request_id,)), wait=False)

    def lease_digests(self) -> list[dict[str, str]]:
        return self._run(self._ranks, ("lease_digests", ()), wait=True)

    def shutdown(self) -> None:
        if self._error is None:
            self._error = WorkerError("the executor was shut down")
        self._stop()
