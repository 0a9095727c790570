"""Engine: EngineCore's surface (add_request, step, has_unfinished, completion, abort, release) over an
executor's data-parallel replicas; one engine for every layout.

Each replica has its own Scheduler and KVCacheManager (its requests, its cache's blocks) and one
EngineCore, all on the driver (host bookkeeping only). A new request goes to the replica with the
fewest unfinished requests (ties: the lowest).

One replica (every layout without data parallelism, one process included): its EngineCore drives the
executor's runner for it directly: the in-process ModelRunner, or the multi-process executor's
launch / collect / complete, so async scheduling (a step launched ahead while the one before runs) and
every runner feature work the same on every layout.

Several replicas: steps run in lockstep (the expert-parallel exchange joins every rank at every MoE
layer), in rounds: every replica's EngineCore starts its step (EngineCore.start_step: schedules, launches,
with async scheduling also plans and launches the next step ahead); the executor then launches every
replica's queued steps at once, k-th with k-th (a replica with fewer runs the expert-parallel dummy step);
one collect gathers every replica's output of the step it finishes; each EngineCore finishes its step
(EngineCore.finish_step); grammar masks of steps launched ahead go to the ranks last. With expert
parallelism a launch is `fixed` (ExpertParallel.forward_fixed) when no replica prefills and every replica's
tokens fit the capacity; every `eplb.interval` rounds the experts are rebalanced after the collect (EPLB;
its load record reads the device, so with EPLB the replicas step without launching ahead).

A failure of the executor (a rank that raised or died) aborts every request and is raised
(TPWorkerError); the engine is then closed.
"""
from __future__ import annotations

import itertools
import time
from typing import Callable

from deepinfer.engine.engine_core import GRAMMAR_POLL_S, EngineCore, StartedStep
from deepinfer.engine.kv_manager import KVCacheManager
from deepinfer.engine.outputs import CompletionOutput, ModelOutput, SchedulerOutput
from deepinfer.engine.request import Request, Status
from deepinfer.engine.scheduler import Scheduler
from deepinfer.executor.worker import EngineArgs
from deepinfer.sampling_params import SamplingParams


class _LockstepReplica:
    """Replica d's runner when several replicas step in lockstep: a launch is queued (-> its seq, the handle)
    until every replica's step has started, then the executor launches them all at once (Engine._launch);
    collect returns the replica's output of the round's collect (Engine._collect), which gathers every
    replica's at once. `execute` runs one step of this replica alone (start-up profiling)."""

    pipelines = False  # (a launch waits for every replica's: start-up profiling times one step at a time)

    def __init__(self, engine: "Engine", d: int, placeholders: bool):
        self.engine, self.d, self.supports_placeholders = engine, d, placeholders

    def launch(self, so: SchedulerOutput, prev: int | None = None) -> int:
        return self.engine._queue(self.d, so, prev is not None)

    def collect(self, seq: int) -> ModelOutput:
        return self.engine._collected(self.d, seq)

    def complete(self, seq: int) -> None:
        self.engine._complete(self.d, seq)

    def execute(self, so: SchedulerOutput) -> ModelOutput:
        return self.engine._alone(self.d, so)


class Engine:
    def __init__(self, executor, args: EngineArgs, detokenizer=None, proposer: Callable[[], object] | None = None,
                 async_scheduling: bool = False, max_model_len: int | None = None):
        """`executor`: InProcExecutor or MultiprocExecutor (its `worker` is this process's rank);
        `proposer()`: a new draft proposer for a replica's scheduler (None: no speculation);
        `max_model_len`: the checked limit (None: what the cache and the model allow)."""
        self.executor, self.args = executor, args
        w = executor.worker
        self.model, self.cache, self.rank_weights = w.model, w.cache, w.rank_weights
        self.cuda_graphs = w.runner.graphs is not None  # (every rank builds its runner alike: the driver's tells)
        self.max_model_len = max_model_len or KVCacheManager(w.num_slots, w.num_blocks, args.block_size).max_model_len(
            args.max_model_len, self.model.config.max_position_embeddings,
            "every rank's smallest share" if args.parallel.world_size > 1 else "the cache")
        dp = args.parallel.data_parallel_size
        self.failure = None
        self._steps = self.fixed_steps = 0  # lockstep rounds; launches with the fixed-capacity exchange
        self.ahead_launches = 0  # lockstep launches planned before the step they follow was collected
        self._seq = 0  # lockstep launches are numbered (every replica's ranks collect by number)
        self._queued: list[list[tuple[SchedulerOutput, bool, int]]] = [[] for _ in range(dp)]
        self._deferred: list[dict[int, SchedulerOutput]] = [{} for _ in range(dp)]  # seq -> plan awaiting masks
        self._completes: list[SchedulerOutput | None] = [None] * dp
        self._round: tuple[list[int | None], list[ModelOutput | None]] | None = None  # (upto, outputs)
        self.cores: list[EngineCore] = []
        placeholders = w.runner.supports_placeholders
        for d in range(dp):  # every replica's cache has the driver's size (the smallest)
            kv = KVCacheManager(w.num_slots, w.num_blocks, args.block_size)
            sched = Scheduler(kv, min(args.max_num_seqs, w.num_slots), args.max_num_batched_tokens,
                              self.max_model_len, proposer() if proposer else None)
            runner = executor.replica_runner() if dp == 1 else _LockstepReplica(self, d, placeholders)
            ahead = async_scheduling and (dp == 1 or args.eplb is None)
            self.cores.append(EngineCore(sched, runner, detokenizer, ahead))
        self.scheduler = self.cores[0].scheduler  # replica 0's (LLM reads its limits)
        self._owner: dict[str, int] = {}  # request id -> its replica, until completion / release
        self._ids = itertools.count()

    @property
    def core(self) -> EngineCore:
        """The one replica's EngineCore (layouts without data parallelism)."""
        if len(self.cores) != 1:
            raise AttributeError(f"core: this engine has {len(self.cores)} data-parallel replicas (see .cores)")
        return self.cores[0]

    @property
    def schedulers(self) -> list[Scheduler]:
        return [c.scheduler for c in self.cores]

    def profile_runner(self):
        """What worker/sps_profile.py times steps through (replica 0's steps; the others idle)."""
        return self.cores[0].runner

    # EngineCore's surface
    def add_request(self, req: Request) -> None:
        """To the replica with the fewest unfinished requests (ties: the lowest); siblings go with it."""
        self._check_open()
        d = min(range(len(self.cores)), key=lambda i: (len(self.cores[i].requests), i))
        for r in [req] + req.siblings:
            self._owner[r.request_id] = d
        self.cores[d].add_request(req)

    def has_unfinished(self) -> bool:
        return any(c.has_unfinished() for c in self.cores)

    def step(self) -> list[Request]:
        """One step on every rank; raises TPWorkerError (the engine then closed) if a rank failed."""
        self._check_open()
        if len(self.cores) == 1:
            finished = self.cores[0].step()  # a failing step's requests are aborted in it, with the error
            failure = self.executor.failure
            if failure is not None:
                self.failure = failure
                self.cores[0].abort(list(self.cores[0].requests), str(failure))  # and all others
                raise failure
            return finished
        return self._lockstep()

    def _lockstep(self) -> list[Request]:
        """One round of every replica's step (see the module's docstring)."""
        self._round = None
        started, errors = [], []
        for c in self.cores:
            try:
                started.append(c.start_step(wait_grammars=False))
            except Exception as e:  # noqa: BLE001 (raised below, once every other replica's step is done)
                errors.append(e)
                started.append([])
        if any(self._queued):
            self._steps += 1
            self._guarded(self._launch)
        upto = [st.handle if isinstance(st, StartedStep) and st.error is None else None for st in started]
        if any(u is not None for u in upto):
            eplb = self.args.eplb
            rebalance = eplb is not None and self._steps % eplb.interval == 0
            self._guarded(lambda: self._collect(upto, rebalance))
        finished = []
        for c, st in zip(self.cores, started):  # every replica's output is applied, even if one's update raises
            try:
                finished += c.finish_step(st)
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        if any(p is not None for p in self._completes):
            self._guarded(self._send_completes)
        if self.failure is not None:
            for c in self.cores:
                finished += c.abort(list(c.requests), str(self.failure))
            raise self.failure
        if errors:
            raise errors[0]
        if not any(isinstance(st, StartedStep) for st in started) and not finished and self.has_unfinished():
            if not any(c.compiling() for c in self.cores):
                raise RuntimeError("scheduler made no progress: the cache cannot hold any waiting request")
            time.sleep(GRAMMAR_POLL_S)  # only requests whose grammars still compile could run
        return finished

    def _guarded(self, fn) -> None:
        """An executor call of the round; a failure is kept (every request is aborted at the round's end)."""
        if self.failure is None:
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                self.failure = e

    # the replicas' runners (_LockstepReplica) call these
    def _queue(self, d: int, so: SchedulerOutput, ahead: bool) -> int:
        self._seq += 1
        self.ahead_launches += ahead
        self._queued[d].append((so, ahead, self._seq))
        if ahead and any(c.grammar is not None and c.num_samples for c in so.chunks):
            self._deferred[d][self._seq] = so  # its masks need this round's tokens: complete sends them
        return self._seq

    def _launch(self) -> None:
        """Every replica's queued launches, k-th with k-th."""
        queued, self._queued = self._queued, [[] for _ in self.cores]
        cap = self.args.max_num_seqs
        for k in range(max(len(q) for q in queued)):
            entries = [q[k] if k < len(q) else None for q in queued]
            fixed = all(e is None or (len(e[0].chunks) <= cap and all(len(c.token_ids) == 1 for c in e[0].chunks))
                        for e in entries)
            self.fixed_steps += fixed
            self.executor.launch_replicas(entries, fixed)

    def _collect(self, upto: list[int | None], rebalance: bool) -> None:
        self._round = (upto, self.executor.collect_replicas(upto, rebalance))

    def _collected(self, d: int, seq: int) -> ModelOutput:
        if self.failure is not None:
            raise self.failure
        if self._round is None or self._round[0][d] != seq:
            self._deferred[d].pop(seq, None)  # its masks are never sent: nobody reads its tokens
            return ModelOutput({})  # a step launched ahead and dropped: the ranks collect it with the next
        return self._round[1][d]

    def _complete(self, d: int, seq: int) -> None:
        so = self._deferred[d].pop(seq, None)
        if so is not None:
            self._completes[d] = so

    def _send_completes(self) -> None:
        plans, self._completes = self._completes, [None] * len(self.cores)
        self.executor.complete_replicas(plans)

    def _alone(self, d: int, so: SchedulerOutput) -> ModelOutput:
        """Replica d's step `so` alone (the others idle), launched and collected."""
        self._seq += 1
        entries = [(so, False, self._seq) if i == d else None for i in range(len(self.cores))]
        self.executor.launch_replicas(entries, fixed=False)
        return self.executor.collect_replicas([e[2] if e else None for e in entries])[d]

    def completion(self, req: Request, index: int) -> CompletionOutput:
        return self.cores[self._owner.pop(req.request_id)].completion(req, index)

    def abort(self, request_ids: list[str], error: str) -> list[Request]:
        done = []
        for d, c in enumerate(self.cores):
            done += c.abort([i for i in request_ids if self._owner.get(i) == d], error)
        return done

    def release(self, req: Request) -> None:
        d = self._owner.pop(req.request_id, None)
        if d is not None:
            self.cores[d].release(req)

    @property
    def requests(self) -> dict[str, Request]:
        return {k: v for c in self.cores for k, v in c.requests.items()}

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams]) -> list[list[CompletionOutput]]:
        """Token-id prompts to completion; per prompt its n completions (LLM.generate's validation and text
        handling stay in LLM)."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        eos, groups = self.model.config.eos_token_id, []
        for ids, sp in zip(prompts, params, strict=True):
            reqs = [Request(f"{next(self._ids)}", list(ids), sp, eos, sample_index=j) for j in range(sp.n)]
            reqs[0].siblings = reqs[1:]
            for r in reqs[1:]:
                r.status = Status.FORKING
            self.add_request(reqs[0])
            groups.append(reqs)
        while self.has_unfinished():
            self.step()
        return [[self.completion(r, j) for j, r in enumerate(g)] for g in groups]

    # lifecycle
    def _check_open(self) -> None:
        if self.failure is not None:
            raise self.failure
        self.executor.check_open()

    def close(self) -> None:
        self.executor.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_engine(args: EngineArgs, detokenizer=None, proposer: Callable[[], object] | None = None,
                 async_scheduling: bool = False, max_model_len: int | None = None) -> Engine:
    """The engine for `args`, on every layout: one rank in this process (world size 1, unless
    distributed_executor_backend is "mp") or the multi-process executor's ranks (this process rank 0: a script that starts one needs an `if __name__ == "__main__":`
    guard). `close()` it (or use it in a `with` block) to stop the ranks."""
    from deepinfer.executor.multiproc import MultiprocExecutor
    from deepinfer.executor.uniproc import InProcExecutor

    one = args.parallel.world_size == 1 and args.distributed_executor_backend != "mp"
    executor = InProcExecutor(args) if one else MultiprocExecutor(args)
    try:
        return Engine(executor, args, detokenizer, proposer, async_scheduling, max_model_len)
    except BaseException:
        executor.close()
        raise


def generate(args: EngineArgs, prompts: list[list[int]],
             params: SamplingParams | list[SamplingParams]) -> list[list[CompletionOutput]]:
    """Token-id prompts through an engine started and closed here; per prompt its n completions."""
    with start_engine(args) as engine:
        return engine.generate(prompts, params)
