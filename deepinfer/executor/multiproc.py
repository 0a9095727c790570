"""The multi-process executor: one Worker per rank, on this node's processes and, multi-node, on others'.

The calling process is rank 0, the driver: it owns the engine's schedulers and is also a Worker. It
spawns this node's other ranks (torch.multiprocessing, spawn); on a multi-node layout every other node
runs `run_node` (deepinfer's `--node-rank K` for K > 0), which spawns that node's ranks and waits. All
ranks meet through torch.distributed's TCP store at master_addr:master_port (multi-node), or env:// when the
environment sets MASTER_ADDR and MASTER_PORT (as torchrun does), else a file store in a temporary directory.

Every step the driver sends one message (pickled) to every rank, which acts on it: through a shared-memory
ring to this node's ranks (shm_ring.py), over the gloo group (a broadcast) on a multi-node layout:
  ("launch_replicas", entries, fixed)  several data-parallel replicas in lockstep: per replica (plan, ahead,
      seq) or None; a rank launches its replica's plan (or the expert-parallel dummy step);
  ("collect_replicas", upto, rebalance)  per replica the seq of the step to collect (None: none); a rank
      collects its replica's pending steps up to it, and the replicas' leaders' outputs are gathered to
      the driver (all_gather_object); then EPLB's load record and rebalance;
  ("complete_replicas", plans)  per replica the frozen plan of its newest pending step (None: nothing);
  ("launch", plan, ahead)  one replica's step launched without waiting for the step before it (async
      scheduling): `ahead` says its placeholder inputs are the tokens of the rank's newest pending step;
  ("complete", plan)  the grammar masks of the newest pending step, launched ahead of the step whose
      tokens its masks needed (structured/frozen.py);
  None  the end.
The plans carry no live grammar: structured outputs' masks are computed on the driver, which alone
advances the grammars, and sent with the plan (freeze_grammars). Every rank of a replica then computes
the same logits (the tensor-parallel all-reduces leave every rank the same residual), masks and samples
with the same seeded generator: each holds the same tokens on its device, which is what a step launched
ahead reads as its placeholder inputs, and what the drafters draft from.

Failure (procs.py): a rank that raises or dies ends the engine; the driver's step raises TPWorkerError
naming it, and the engine is closed.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import shutil
import tempfile
import time
from pathlib import Path
import torch
import torch.multiprocessing as mp

from deepinfer.distributed import parallel_state as ps
from deepinfer.engine.outputs import ModelOutput, SchedulerOutput
from deepinfer.executor.procs import (FAILED_EXIT_CODE, REPORT_WAIT_S, RankDied, TPWorkerError, _abort_nccl,
                                      _exit_code, _RankWatch, describe_exit, report_failure)
from deepinfer.executor.shm_ring import ShmRing
from deepinfer.executor.worker import EngineArgs, Worker
from deepinfer.structured.frozen import freeze_grammars
from deepinfer.worker.model_runner import StepHandle

logger = logging.getLogger(__name__)


class _Deferred:
    """A plan's grammar while its masks wait for the step before it (sent again with "complete")."""


DEFERRED = _Deferred()


def layout_name(p: ps.ParallelConfig) -> str:
    """How errors name the ranks: "tensor-parallel", "data-parallel x tensor-parallel", ..."""
    parts = [n for n, size in (("data-parallel", p.data_parallel_size), ("context-parallel", p.context_parallel_size),
                               ("tensor-parallel", p.tensor_parallel_size)) if size > 1]
    return " x ".join(parts) or "one-rank"


def _rendezvous(args: EngineArgs) -> tuple[str, str | None]:
    """(init_method, the temporary directory of a file store or None)."""
    if args.nnodes > 1 or args.master_addr is not None:
        if not args.master_addr or not args.master_port:
            raise ValueError("master_addr: a multi-node engine needs master_addr and master_port (node 0's address "
                             "and a free port on it), as torchrun's --master-addr / --master-port")
        # the address in the init method, not the environment: this process may start other engines after it
        return f"tcp://{args.master_addr}:{args.master_port}", None
    found = ps.init_method_from_env()
    if found is not None:
        return found, None
    tmp = tempfile.mkdtemp(prefix="deepinfer-pg-")
    return f"file://{Path(tmp) / 'store'}", tmp


def _spin_s(args: EngineArgs) -> float:
    """How long a rank waiting for a message yields rather than sleeps: on CUDA, long enough to cover a burst
    of back-to-back steps; on the CPU none (the ranks compute on the same few cores)."""
    return 0.5 if torch.device(args.device).type == "cuda" else 0.0


def _rank_main(rank: int, args: EngineArgs, init_method: str, reports, ring: str | None = None) -> None:
    """A rank other than the driver: run every message the driver sends until it sends None (`ring`: the
    path of the driver's shared-memory ring, on the driver's node; None: messages come by gloo broadcast)."""
    os.environ["LOCAL_RANK"] = str(rank % args.ranks_per_node)
    channel = None
    try:
        w = Worker(args, rank, init_method)
        if ring is not None:
            channel = ShmRing.attach(ring, args.ranks_per_node - 1, rank - 1, _spin_s(args), args.timeout_s)
        recv = channel.recv if channel is not None else ps.broadcast_object
        step = 0
        while (msg := recv()) is not None:
            if args.step_hook is not None:
                args.step_hook(rank, step)
            kind, d = msg[0], w.info.dp_rank
            if kind == "launch_replicas":
                mine = msg[1][d]
                w.launch_replica(*(mine or (None, False, 0)), fixed=msg[2])
            elif kind == "collect_replicas":
                out = w.collect_replica(msg[1][d], msg[2])
                ps.all_gather_object(out if w.info.is_replica_leader else None)
            elif kind == "complete_replicas":
                if msg[1][d] is not None:
                    w.complete_replica(msg[1][d])
            elif kind == "launch":
                w.launch(*msg[1:])
            elif kind == "complete":
                w.complete(msg[1])
            else:
                raise ValueError(f"message: unknown kind {kind!r}")
            step += 1
    except BaseException as e:  # noqa: BLE001 (reported to the driver, then this process ends)
        report_failure(rank, e, reports)
    finally:
        if channel is not None:
            channel.close()
        ps.destroy()


def run_node(args: EngineArgs) -> None:
    """Node `args.node_rank` > 0 of a multi-node engine: spawn its ranks, wait for them to end (the driver,
    on node 0, ends them). Raises RuntimeError naming a rank that failed."""
    if args.node_rank == 0:
        raise ValueError("node_rank: node 0 runs the driver (LLM / serve); run_node is for the other nodes")
    init_method, _ = _rendezvous(args)
    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    first = args.node_rank * args.ranks_per_node
    procs = [ctx.Process(target=_rank_main, args=(r, args, init_method, reports), name=f"deepinfer-rank{r}")
             for r in range(first, first + args.ranks_per_node)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [(p.name, p.exitcode) for p in procs if p.exitcode]
    if failed:
        detail = ""
        try:
            rank, msg, _ = reports.get(timeout=1.0)
            detail = f": rank {rank}: {msg}"
        except queue.Empty:
            pass
        raise RuntimeError(f"node {args.node_rank}: {failed[0][0]} ended with {describe_exit(failed[0][1])}{detail}")


class MultiprocExecutor:
    """The driver's side: spawns the ranks, is rank 0's Worker, and runs each step on every rank.
    `close()` stops the ranks and leaves the process group (once; also after a failure)."""

    def __init__(self, args: EngineArgs):
        ps.check_free()  # before any rank is spawned: this process is to be rank 0
        if args.node_rank != 0:
            raise ValueError("node_rank: the driver runs on node 0; other nodes run executor.multiproc.run_node")
        self.args, self.kind = args, layout_name(args.parallel)
        self._error: TPWorkerError | None = None
        self._closed = False
        self._threads = torch.get_num_threads()  # rank 0 (this process) may set its own; close() restores it
        init_method, self._tmp = _rendezvous(args)
        # this node's ranks read the ring; other nodes' ranks take the gloo broadcast (one channel for all)
        self._ring = ShmRing.create(args.ranks_per_node - 1, _spin_s(args), args.timeout_s) \
            if args.nnodes == 1 else None
        ring = self._ring.path if self._ring is not None else None
        ctx = mp.get_context("spawn")
        self._reports = ctx.Queue()
        self._procs = {r: ctx.Process(target=_rank_main, args=(r, args, init_method, self._reports, ring),
                                      daemon=True, name=f"deepinfer-rank{r}") for r in range(1, args.ranks_per_node)}
        for p in self._procs.values():
            p.start()
        self._watch = _RankWatch(self._procs, _abort_nccl)
        try:
            self.worker = Worker(args, 0, init_method)
        except Exception as e:
            raise self._diagnose(e) from e
        self.failure: TPWorkerError | None = None  # the first failure of a step (kept: the engine is closed)
        self.steps = 0

    # several data-parallel replicas, in lockstep
    def launch_replicas(self, entries: list[tuple[SchedulerOutput, bool, int] | None], fixed: bool) -> None:
        """Per replica (plan, ahead, seq) or None, launched on its ranks at once (with `fixed`: expert
        parallelism's fixed-capacity exchange). A plan launched ahead whose grammar masks need the step
        before it goes without them (complete_replicas sends them)."""
        def go():
            sent = [None if e is None else (self._deferred(e[0]) if e[1] else self._for_ranks(e[0]), e[1], e[2])
                    for e in entries]
            self._send(("launch_replicas", sent, fixed))
            mine = entries[self.worker.info.dp_rank]
            self.worker.launch_replica(*(mine or (None, False, 0)), fixed=fixed)
        self._guard(go)

    def collect_replicas(self, upto: list[int | None], rebalance: bool = False) -> list[ModelOutput | None]:
        """Per replica the output of its step numbered upto[d] (None where upto[d] is None)."""
        def go():
            self._send(("collect_replicas", upto, rebalance))
            out = self.worker.collect_replica(upto[self.worker.info.dp_rank], rebalance)
            mine = out if self.worker.info.is_replica_leader else None
            return _replica_outputs(ps.all_gather_object(mine), self.args.parallel, upto)
        return self._guard(go)

    def complete_replicas(self, plans: list[SchedulerOutput | None]) -> None:
        """Per replica the newest pending step's plan, its grammars now advanced (None: nothing to complete)."""
        def go():
            self._send(("complete_replicas", [None if p is None else self._for_ranks(p) for p in plans]))
            if plans[self.worker.info.dp_rank] is not None:
                self.worker.runner.complete(self.worker.replica_pending[-1][1])
        self._guard(go)

    def _deferred(self, so: SchedulerOutput) -> SchedulerOutput:
        """`so`, launched ahead, as the other ranks receive it: grammar chunks that sample wait for their
        masks (DEFERRED, sent again by complete), the rest frozen."""
        if any(c.grammar is not None and c.num_samples for c in so.chunks):
            return _with_grammar(so, DEFERRED)
        return self._for_ranks(so)

    def launch(self, so: SchedulerOutput, prev: StepHandle | None) -> StepHandle:
        """One replica (data_parallel_size 1): `so` launched on every rank; the driver's handle."""
        def go():
            self._send(("launch", self._deferred(so) if prev is not None else self._for_ranks(so), prev is not None))
            return self.worker.runner.launch(so, prev)
        return self._guard(go)

    def collect(self, h: StepHandle) -> ModelOutput:
        return self._guard(lambda: self.worker.runner.collect(h))

    def complete(self, h: StepHandle) -> None:
        """Sample a step launched ahead whose grammar masks waited for the step before it (its grammars now
        advanced): the masks go to every rank first."""
        if h.deferred is None:
            return

        def go():
            self._send(("complete", self._for_ranks(h.deferred[0])))
            self.worker.runner.complete(h)
        self._guard(go)

    def _send(self, msg) -> None:
        """`msg` to every other rank (the ring on one node, else the gloo broadcast)."""
        if self._ring is not None:
            self._ring.send(msg, self._watch.check)
        else:
            ps.broadcast_object(msg)

    def _guard(self, fn):
        """Run a step's part; any failure ends the engine (the ranks may be out of step): it becomes the
        error naming the failing rank, kept and raised."""
        if self.failure is not None:
            raise self.failure
        try:
            self.check_open()
            out = fn()
            self._watch.check()  # a rank that died mid-step: its peers' results may come from aborted collectives
            self.steps += 1
            return out
        except Exception as e:
            self.failure = e if isinstance(e, TPWorkerError) else self._diagnose(e)
            raise self.failure from e

    def replica_runner(self) -> "ReplicaRunner":
        """The runner of the one replica (data_parallel_size 1) for its EngineCore."""
        return ReplicaRunner(self)

    def _for_ranks(self, so: SchedulerOutput | None) -> SchedulerOutput | None:
        """`so` as the other ranks receive it: live grammars replaced by their masks."""
        if so is None or not any(c.grammar is not None for c in so.chunks):
            return so
        return freeze_grammars(so, self.worker.model.config.vocab_size)

    # lifecycle
    def close(self) -> None:
        """Stop the other ranks (a clean goodbye when the group is healthy) and leave the group; once only
        (a second call must not leave the group of an engine started since)."""
        if self._closed:
            return
        self._closed = True
        self._watch.stop()
        if self._error is None and self._watch.dead is None and ps.rank_info() is not None \
                and (self._procs or self.args.nnodes > 1):
            try:
                self._send(None)
            except Exception:  # a rank already gone: it is stopped below
                logger.exception("the %s ranks could not be told to stop", self.kind)
        for p in self._procs.values():
            p.join(timeout=1.0 if self._error is not None else REPORT_WAIT_S)
            if p.is_alive():
                p.terminate()
                p.join(timeout=REPORT_WAIT_S)
        self._procs = {}
        try:
            ps.destroy()
        except Exception:  # after a death its communicators may be aborted: the rank's error is what matters
            if self._watch.dead is None:
                raise
            logger.exception("could not leave the process group cleanly after rank %d died", self._watch.dead[0])
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        self._reports.close()
        torch.set_num_threads(self._threads)

    def check_open(self) -> None:
        """Raises the engine's failure: kept, or found now (a rank that died since the last step)."""
        if self._error is not None:
            raise self._error
        if self._closed:
            raise RuntimeError(f"the {self.kind} engine is closed; build a new one")
        try:
            self._watch.check()
        except RankDied as e:
            raise self._diagnose(e) from e

    def _diagnose(self, err: BaseException) -> TPWorkerError:
        """Collect the ranks' reports (waiting a little for a failing rank to report or exit), close
        the engine, and return the error that names what failed."""
        if self._error is not None:
            return self._error
        reports: dict[int, str] = {}
        dead = self._watch.dead
        # a rank that died otherwise than by raising sends no report
        deadline = time.monotonic() + (REPORT_WAIT_S if dead is None or dead[1] == FAILED_EXIT_CODE else 0.0)
        while not reports and time.monotonic() < deadline:
            try:
                rank, msg, tb = self._reports.get(timeout=0.2)
                reports[rank] = f"{msg}\n{tb}"
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in self._procs.values()):
                    deadline = min(deadline, time.monotonic() + 1.0)  # exited: its report, if any, is close
        while True:  # reports already sent by other ranks
            try:
                rank, msg, tb = self._reports.get_nowait()
                reports.setdefault(rank, f"{msg}\n{tb}")
            except queue.Empty:
                break
        self._watch.stop()
        dead = self._watch.dead  # the watch may have seen the exit while the reports were read
        for rank, p in self._procs.items():
            if rank in self._watch.terminated:
                reports.setdefault(rank, f"terminated by the driver after rank {dead[0]} died\n")
            elif p.exitcode not in (None, 0) and rank not in reports:
                reports[rank] = "exited without a report\n"
        driver = f"{type(err).__name__}: {err}"
        if dead is not None or reports:
            first = dead[0] if dead is not None else min(reports)
            code = dead[1] if dead is not None else _exit_code(self._procs[first])
            reason = reports.get(first, "exited without a report\n").splitlines()[0]
            msg = f"{self.kind} rank {first} failed: {reason} ({describe_exit(code)})"
        else:
            first = None
            msg = (f"a {self.kind} collective failed on the driver and no other rank reported an error within "
                   f"{REPORT_WAIT_S:.0f} s (a rank stuck past timeout_s={self.args.timeout_s} s, or on another "
                   f"node?): {driver}")
        details = [f"rank {r}: {text}" for r, text in sorted(reports.items())] + [f"driver (rank 0): {driver}"]
        self._error = TPWorkerError(msg, first, details)
        self.close()
        return self._error


class ReplicaRunner:
    """The multi-process executor's one replica as EngineCore's runner (Runner: launch / collect / complete /
    execute), every call on every rank."""

    def __init__(self, executor):
        self.executor = executor
        self.device = executor.worker.runner.device
        self.supports_placeholders = executor.worker.runner.supports_placeholders

    def launch(self, so: SchedulerOutput, prev: StepHandle | None = None) -> StepHandle:
        return self.executor.launch(so, prev)

    def collect(self, h: StepHandle) -> ModelOutput:
        return self.executor.collect(h)

    def complete(self, h: StepHandle) -> None:
        self.executor.complete(h)

    def execute(self, so: SchedulerOutput) -> ModelOutput:
        return self.collect(self.launch(so))


def _replica_outputs(gathered: list, parallel: ps.ParallelConfig, upto: list) -> list[ModelOutput | None]:
    """Each replica's output from every rank's (its leader's), None where it collected nothing."""
    return [gathered[ps.replica_leader(d, parallel)] if upto[d] is not None else None for d in range(len(upto))]


def _with_grammar(so: SchedulerOutput, grammar: object) -> SchedulerOutput:
    """`so` with every grammar chunk's grammar replaced by `grammar` (the other chunks shared)."""
    chunks = [dataclasses.replace(c, grammar=grammar) if c.grammar is not None else c for c in so.chunks]
    return dataclasses.replace(so, chunks=chunks)



