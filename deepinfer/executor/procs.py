"""Processes of a multi-process engine: how a rank reports its failure, how the driver watches its ranks.

A spawned rank that raises puts its traceback on the driver's queue and exits with FAILED_EXIT_CODE. A
driver thread (_RankWatch) waits on the spawned ranks' process sentinels: the first to exit while the
engine is open is recorded with its exit code, the other spawned ranks are terminated (under NCCL they
would block in a collective until `timeout_s`), and the driver's NCCL communicators are aborted so that
its own pending collective returns. Ranks on other nodes are not watched: their failure reaches the
driver as its collective's error (a closed connection) or its timeout.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import signal
import threading
import time
import traceback
from typing import Callable

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# seconds the driver waits, once a collective failed, for the failing rank's report or exit
REPORT_WAIT_S = 10.0
# exit code of a spawned rank that raised (report_failure)
FAILED_EXIT_CODE = 1


class TPWorkerError(RuntimeError):
    """A rank of a multi-process engine failed; the engine is closed. `rank` is the first failing rank
    found (None if only the driver's collective saw it), `details` every report collected."""

    def __init__(self, message: str, rank: int | None, details: list[str]):
        super().__init__(message)
        self.rank, self.details = rank, details


def report_failure(rank: int, err: BaseException, reports) -> None:
    """A spawned rank's end on error: its traceback to the driver's queue, then exit code 1."""
    reports.put((rank, f"{type(err).__name__}: {err}", traceback.format_exc()))
    reports.close()
    reports.join_thread()
    raise SystemExit(FAILED_EXIT_CODE)


class RankDied(RuntimeError):
    """The driver's view of a spawned rank that exited while the engine was open."""


class _RankWatch:
    """A driver thread waiting (multiprocessing.connection.wait) on the spawned ranks' sentinels and a
    wake-up pipe. The first rank to exit before `stop()` is `dead` = (rank, exit code); then the other
    spawned ranks are terminated and `on_death` runs (the driver aborts its NCCL communicators)."""

    def __init__(self, procs: dict, on_death: Callable[[], None]):
        self.procs, self.on_death = dict(procs), on_death
        self.dead: tuple[int, int | None] | None = None
        self.terminated: set[int] = set()  # ranks this watch ended
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        self._thread = threading.Thread(target=self._run, name="deepinfer-rank-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        by_sentinel = {p.sentinel: r for r, p in self.procs.items()}
        ready = multiprocessing.connection.wait([self._wake_r, *by_sentinel])
        if self._wake_r in ready:  # an orderly shutdown: exits from now on are expected
            return
        rank = min(by_sentinel[s] for s in ready)
        self.dead = (rank, _exit_code(self.procs[rank]))
        for r, p in self.procs.items():
            if r != rank and p.is_alive():
                self.terminated.add(r)
                p.terminate()
        try:
            self.on_death()
        except Exception:  # the driver's pending collective then ends by its timeout instead
            logger.exception("could not abort the driver's communicators after rank %d died", rank)

    def check(self) -> None:
        """Raises RankDied if a spawned rank has exited."""
        if self.dead is not None:
            rank, code = self.dead
            raise RankDied(f"rank {rank} exited ({describe_exit(code)})")

    def stop(self) -> None:
        """Stop watching (before the ranks are told to exit, or once they are gone)."""
        if self._thread.is_alive():
            self._wake_w.send(None)
            self._thread.join()
        self._wake_r.close()
        self._wake_w.close()


def _exit_code(proc, wait_s: float = 1.0) -> int | None:
    """The exit code of a process that is ending (None if it has not within `wait_s`). Polled: the
    driver's threads may both reap it, and the one that loses sees no code for a moment."""
    deadline = time.monotonic() + wait_s
    proc.join(timeout=wait_s)
    while proc.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc.exitcode


def describe_exit(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"exit code {code}, killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"exit code {code}, killed by signal {-code}"
    return f"exit code {code}"


def _abort_nccl() -> None:
    """Abort this process's NCCL communicators (from the watch thread): a collective or a stream sync
    waiting on a dead peer returns instead of blocking until the timeout. No-op under gloo, where the
    peers' closed connections end the driver's collective."""
    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return
    for pg in list(dist.distributed_c10d._world.pg_map):
        try:
            backend = pg._get_backend(torch.device("cuda"))
        except RuntimeError:  # a gloo group (the object channel)
            continue
        backend.abort()
