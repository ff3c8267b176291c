"""The `ray` executor: one Ray actor per rank, in the replica's placement group.

Inside a Serve replica deployed with `placement_group_bundles(...)`
(engine/executors/placement.py) the replica actor sits in bundle 0 and rank r is
placed in bundle r + 1. Outside Serve (a driver script, the tests) the executor
creates its own STRICT_PACK group for the ranks and removes it on shutdown.
Actor calls from one caller run in submission order, which is the ordering the
executor contract needs; a step's input is put in the object store once and
read by every rank. A dead actor or a failed call surfaces as `WorkerError`.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, get_current_placement_group, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.executors.executor import WorkerError
from engine.executors.placement import PLACEMENT_STRATEGY, placement_group_bundles
from engine.executors.remote import Call, RemoteExecutor, RemoteWorker, rank_device
from engine.rank.worker import WorkerSpec

logger = logging.getLogger(__name__)

_PLACEMENT_TIMEOUT_S = 120.0
_WAIT_SLICE_S = 1.0


@ray.remote
class _RankActor:
    """Hosts one `RemoteWorker`; sees one GPU (cuda:0) when the bundle has one."""

    def __init__(self) -> None:
        self.worker: RemoteWorker | None = None

    def rendezvous_url(self) -> str:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def setup(self, spec: WorkerSpec, rank: int, dist_url: str) -> int:
        self.worker = RemoteWorker(spec, rank, rank_device(spec.device_type, 0), dist_url)
        return os.getpid()

    def call(self, method: str, *args: Any) -> Any:  # noqa: ANN401 - per-call results
        return self.worker.handle(method, args)


def _pid_alive(pid: int) -> bool:
    """Whether a process of this node runs (a zombie counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


class RayExecutor(RemoteExecutor):
    def _start(self, spec: WorkerSpec) -> None:
        self._pending: list[ray.ObjectRef] = []
        self._actors: list[ray.actor.ActorHandle] = []
        self._own_group: PlacementGroup | None = None
        group, first = self._placement(spec)
        resources = {"num_cpus": 1, "num_gpus": 1 if spec.device_type == "cuda" else 0}
        self._actors = [
            _RankActor.options(
                **resources,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=first + r),
            ).remote()
            for r in range(spec.tp_size)
        ]
        try:
            [url] = self._await([self._actors[0].rendezvous_url.remote()])
            self.pids = self._await([a.setup.remote(spec, r, url) for r, a in enumerate(self._actors)])
        except WorkerError:
            self._stop()
            raise
        logger.info("tensor parallel %d over Ray actors (pids %s)", spec.tp_size, self.pids)

    def _placement(self, spec: WorkerSpec) -> tuple[PlacementGroup, int]:
        """The group the ranks go into, and the bundle of rank 0."""
        current = get_current_placement_group()
        if current is not None:
            if current.bundle_count != spec.tp_size + 1:
                raise ValueError(
                    f"the replica's placement group has {current.bundle_count} bundles; tensor parallel "
                    f"{spec.tp_size} needs placement_group_bundles({spec.tp_size}, {spec.device_type!r})"
                )
            return current, 1
        bundles = placement_group_bundles(spec.tp_size, spec.device_type)[1:]
        self._own_group = placement_group(bundles, strategy=PLACEMENT_STRATEGY)
        ready, _ = ray.wait([self._own_group.ready()], timeout=_PLACEMENT_TIMEOUT_S)
        if not ready:
            ray.util.remove_placement_group(self._own_group)
            raise WorkerError(f"Ray could not place {spec.tp_size} ranks ({bundles}) in {_PLACEMENT_TIMEOUT_S:.0f} s")
        return self._own_group, 0

    def _submit(self, ranks: Sequence[int], call: Call) -> list[ray.ObjectRef]:
        method, args = call
        if method == "execute_model":  # one copy in the object store, read by every rank
            args = (ray.put(args[0]),)
        return [self._actors[r].call.remote(method, *args) for r in ranks]

    def _post(self, ranks: Sequence[int], call: Call) -> None:
        self._pending += self._submit(ranks, call)

    def _launch(self, ranks: Sequence[int], call: Call) -> list[ray.ObjectRef]:
        return self._submit(ranks, call)

    def _replies(self, token: list[ray.ObjectRef]) -> list[Any]:
        return self._await(token)

    def _gather(self, ranks: Sequence[int], call: Call) -> list[Any]:
        refs = self._submit(ranks, call)
        earlier, self._pending = self._pending, []
        self._await(earlier)
        return self._await(refs)

    def _await(self, refs: list[ray.ObjectRef]) -> list[Any]:
        """Results of `refs`; the first failure among them (in completion order) raises `WorkerError`."""
        waiting = list(refs)
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=_WAIT_SLICE_S)
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as exc:
                    raise WorkerError(f"a tensor-parallel rank failed: {exc}") from exc
        return ray.get(refs)

    def check_health(self) -> None:
        if self._error is not None:
            raise self._error
        dead = [pid for pid in self.pids if not _pid_alive(pid)]
        if dead:
            self._error = WorkerError(f"tensor-parallel rank processes {dead} are gone")
            self._stop()
            raise self._error

    def _stop(self) -> None:
        for actor in self._actors:
            ray.kill(actor)
        self._actors = []
        if self._own_group is not None:
            ray.util.remove_placement_group(self._own_group)
            self._own_group = None
