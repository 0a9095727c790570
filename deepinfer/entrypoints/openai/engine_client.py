"""The API process's side of the engine-core process (engine_proc.py).

A reader thread blocks on the engine's outbox and hands each message to the asyncio loop, so no
coroutine ever waits on a step. Each request has an asyncio queue of deltas. If the engine process
dies, every request in flight ends with EngineDeadError, new ones are refused with it, and
`on_dead` is called (the server then exits non-zero).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from deepinfer.entrypoints.openai.engine_proc import engine_main
from deepinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

POLL_S = 0.2  # how often the reader thread checks that the engine process is alive


class EngineDeadError(RuntimeError):
    pass


class EngineStartError(RuntimeError):
    def __init__(self, message: str, usage: bool):
        super().__init__(message)
        self.usage = usage  # a bad argument or missing model (the user's to fix), not a crash


class RequestRejected(ValueError):
    """The engine refused the request's parameters (the message names the field)."""


@dataclass
class Delta:
    index: int                  # which of the request's n samples
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None   # "stop" | "length" | "abort" on a sample's last delta
    error: str | None = None
    # SamplingParams.prompt_logprobs: on the leader's (index 0) first delta only, one entry per prompt position
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None  # with them: each prompt token's rank


class EngineClient:
    def __init__(self, llm_kwargs: dict, log_level: int = logging.INFO):
        ctx = mp.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=engine_main, args=(llm_kwargs, self.inbox, self.outbox, log_level),
                                name="deepinfer-engine-core", daemon=False)  # it spawns TP / DP ranks itself
        self.info: dict = {}
        self.stats: dict = {}
        self.dead: str | None = None  # why the engine is gone
        self.on_dead: Callable[[str], None] | None = None
        self.on_stats: Callable[[dict], None] | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._detached = False  # set by detach(): the reader thread hands nothing more to the loop
        self._stopping = False

    # --- start-up and shutdown (blocking; called outside the event loop or from lifespan) ---

    def start(self, timeout: float | None = None) -> dict:
        """Start the engine process and wait for it to load the model; EngineStartError if it fails."""
        self.proc.start()
        while True:
            msg = self._poll()
            if msg is None:
                continue
            if msg[0] == "exited":
                raise EngineStartError(f"the engine-core process exited during start-up (code {msg[1]})", False)
            if msg[0] == "fatal":
                self.proc.join(10)
                raise EngineStartError(msg[1], msg[2])
            if msg[0] == "ready":
                self.info = msg[1]
                self.stats = self.info["stats"]
                return self.info

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start delivering the engine's messages to `loop`."""
        self._loop = loop
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()

    def detach(self) -> None:
        """Stop delivering to the loop; the reader thread has ended when this returns (within POLL_S), so the
        loop may close."""
        self._detached = True
        if self._reader is not None:
            self._reader.join()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self.proc.is_alive():
            self.inbox.put(("shutdown",))
            self.proc.join(timeout)
        if self.proc.is_alive():
            logger.warning("the engine-core process did not stop in %.0f s; killing it", timeout)
            self.proc.kill()
            self.proc.join(5)

    # --- requests (on the event loop) ---

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[Delta | None]:
        """None once the engine has accepted the request, then its deltas as the engine produces them.
        Raises RequestRejected (bad parameters) instead of the None, EngineDeadError if the engine is or
        goes away. Closing the iterator early (a client that went away) aborts the request in the engine,
        which frees its cache at once."""
        if self.dead:
            raise EngineDeadError(self.dead)
        rid = f"{next(self._ids)}"
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = q
        finished = [False] * params.n
        try:
            self.inbox.put(("add", rid, prompt_token_ids, params))
            msg = await q.get()
            if isinstance(msg, BaseException):
                raise msg
            if msg is not None:
                raise RequestRejected(msg)
            yield None
            while not all(finished):
                d = await q.get()
                if isinstance(d, BaseException):
                    raise d
                if d.finish_reason is not None:
                    finished[d.index] = True
                yield d
        finally:
            self._streams.pop(rid, None)
            if not all(finished) and not self.dead:
                self.inbox.put(("abort", rid))

    # --- the reader thread and its hand-off to the loop ---

    def _read(self) -> None:
        while not self._detached:
            try:
                msg = self._poll()
            except (EOFError, OSError):
                continue
            if msg is None:
                continue
            if msg[0] == "exited":
                if not self._stopping:
                    self._loop.call_soon_threadsafe(self._died, f"the engine-core process exited (code {msg[1]})")
                return
            self._loop.call_soon_threadsafe(self._deliver, msg)

    def _poll(self) -> tuple | None:
        """The engine's next message, ("exited", exit code) once its process is gone, or None (nothing
        within POLL_S)."""
        try:
            return self.outbox.get(timeout=POLL_S)
        except queue.Empty:
            return None if self.proc.is_alive() else ("exited", self.proc.exitcode)

    def _deliver(self, msg: tuple) -> None:
        if msg[0] == "added":
            q = self._streams.get(msg[1])
            if q is not None:
                q.put_nowait(msg[2])
        elif msg[0] == "step":
            _, deltas, stats, prompt = msg
            for rid, j, ids, lps, reason, error in deltas:
                q = self._streams.get(rid)
                if q is not None:
                    q.put_nowait(Delta(j, ids, lps, reason, error, *(prompt.get(rid) or (None, None)) if j == 0
                                       else (None, None)))
            self.stats = stats
            if self.on_stats is not None:
                self.on_stats(stats)

    def _died(self, why: str) -> None:
        logger.error("%s; failing %d request(s) in flight", why, len(self._streams))
        self.dead = why
        for q in self._streams.values():
            q.put_nowait(EngineDeadError(why))
        if self.on_dead is not None:
            self.on_dead(why)
