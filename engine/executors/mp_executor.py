"""The `mp` executor: one spawned process per rank, a pipe each, for machines without Ray.

Processes are spawned (never forked: CUDA and the driver's threads do not
survive a fork) and daemonic, so they end with the driver; a rank whose driver
is gone reads end-of-file and exits. Calls are pickled once and written to each
rank's pipe; the driver waits on the pipes and on the processes' sentinels
together, so a rank that dies, even while the others block in a collective,
surfaces at once as `WorkerError` with its exit code or its traceback.
"""

from __future__ import annotations

import logging
import pickle
import socket
import traceback
import weakref
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.multiprocessing as mp

from engine.executors.executor import WorkerError
from engine.executors.remote import Call, RemoteExecutor, RemoteWorker, rank_device
from engine.rank.worker import WorkerSpec

logger = logging.getLogger(__name__)

_STOP = "stop"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(spec: WorkerSpec, rank: int, dist_url: str, conn: Connection) -> None:
    """A rank's process: build, report ready, then run calls until told to stop or the driver is gone."""
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s rank{rank} %(name)s: %(message)s")
    worker: RemoteWorker | None = None
    try:
        worker = RemoteWorker(spec, rank, rank_device(spec.device_type, rank), dist_url)
        conn.send_bytes(pickle.dumps(("ok", None)))
        while True:
            method, args, reply = pickle.loads(conn.recv_bytes())
            if method == _STOP:
                break
            result = worker.handle(method, args)
            if reply:
                conn.send_bytes(pickle.dumps(("ok", result)))
    except EOFError:
        return  # the driver is gone
    except BaseException:  # noqa: BLE001 - the driver must hear of any failure
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        raise SystemExit(1) from None
    finally:
        if worker is not None:
            worker.close()


def _stop_processes(procs: list[mp.Process], conns: list[Connection]) -> None:
    """Asks every rank to stop, then kills what is still running (a rank stuck in a collective)."""
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps((_STOP, (), False)))
        except OSError:
            pass
    for proc in procs:
        proc.join(timeout=5.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()


class MPExecutor(RemoteExecutor):
    def _start(self, spec: WorkerSpec) -> None:
        ctx = mp.get_context("spawn")
        url = f"tcp://127.0.0.1:{_free_port()}"
        self._procs: list[mp.Process] = []
        self._conns: list[Connection] = []
        for rank in range(spec.tp_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(spec, rank, url, child), daemon=True,
                               name=f"tp-rank-{rank}")
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self.pids = [p.pid for p in self._procs]
        self._finalizer = weakref.finalize(self, _stop_processes, self._procs, self._conns)
        try:
            self._collect(range(spec.tp_size))
        except WorkerError:
            self._stop()
            raise
        logger.info("tensor parallel %d over processes %s", spec.tp_size, self.pids)

    def _post(self, ranks: Sequence[int], call: Call, reply: bool = False) -> None:
        payload = pickle.dumps((call[0], call[1], reply), protocol=pickle.HIGHEST_PROTOCOL)
        for r in ranks:
            try:
                self._conns[r].send_bytes(payload)
            except OSError as exc:
                raise self._died(r) from exc

    def _gather(self, ranks: Sequence[int], call: Call) -> list[Any]:
        self._post(ranks, call, reply=True)
        return self._collect(ranks)

    def _launch(self, ranks: Sequence[int], call: Call) -> list[int]:
        self._post(ranks, call, reply=True)
        return list(ranks)

    def _replies(self, token: list[int]) -> list[Any]:
        return self._collect(token)

    def _collect(self, ranks: Sequence[int]) -> list[Any]:
        """One reply per rank of `ranks`; a message from any other rank, or any death, is a failure."""
        results: dict[int, Any] = {}
        by_conn = {c: r for r, c in enumerate(self._conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self._procs)}
        while len(results) < len(ranks):
            for ready in wait(list(by_conn) + list(by_sentinel)):
                r = by_conn.get(ready, by_sentinel.get(ready))
                if ready in by_sentinel and not self._conns[r].poll():
                    raise self._died(r)
                status, value = self._receive(r)
                if status != "ok" or r not in ranks or r in results:
                    raise WorkerError(f"tensor-parallel rank {r} failed:\n{value}")
                results[r] = value
        return [results[r] for r in ranks]

    def _receive(self, rank: int) -> tuple[str, Any]:
        try:
            return pickle.loads(self._conns[rank].recv_bytes())
        except (EOFError, OSError) as exc:
            raise self._died(rank) from exc

    def _died(self, rank: int) -> WorkerError:
        proc = self._procs[rank]
        proc.join(timeout=1.0)
        return WorkerError(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")

    def check_health(self) -> None:
        if self._error is not None:
            raise self._error
        for rank, proc in enumerate(self._procs):
            if proc.exitcode is not None:
                self._error = self._died(rank)
                self._stop()
                raise self._error

    def _stop(self) -> None:
        self._finalizer()
