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
layer): the driver plans every replica's step, the executor runs them all at once and returns each
replica's output, and each replica's EngineCore applies its own. With expert parallelism a step is
`fixed` (ExpertParallel.forward_fixed) when no replica prefills and every replica's tokens fit the
capacity; every `eplb.interval` steps the experts are rebalanced after the step (EPLB).

A failure of the executor (a rank that raised or died) aborts every request and is raised
(TPWorkerError); the engine is then closed.
"""
from __future__ import annotations

import itertools
import time
from typing import Callable

from deepinfer.engine.engine_core import GRAMMAR_POLL_S, EngineCore
from deepinfer.engine.kv_manager import KVCacheManager
from deepinfer.engine.outputs import CompletionOutput, ModelOutput, SchedulerOutput
from deepinfer.engine.request import Request, Status
from deepinfer.engine.scheduler import Scheduler
from deepinfer.executor.worker import EngineArgs
from deepinfer.sampling_params import SamplingParams


class _PlannedScheduler(Scheduler):
    """A replica's Scheduler under lockstep steps: `plan()` makes the step before the executor runs every
    replica's, and the EngineCore's `schedule()` then takes that same step."""

    _planned: SchedulerOutput | None = None

    def plan(self) -> SchedulerOutput:
        self._planned = super().schedule()
        return self._planned

    def schedule(self) -> SchedulerOutput:
        so, self._planned = self._planned, None
        if so is None:
            raise RuntimeError("a replica's step was not planned before it ran")
        return so


class _LockstepOutput:
    """Replica `d`'s runner under lockstep steps: the step's output the executor returned for it."""

    supports_placeholders = False  # the next plan carries the sampled tokens

    def __init__(self, engine: "Engine", d: int):
        self.engine, self.d = engine, d

    def execute(self, so: SchedulerOutput) -> ModelOutput:
        if self.engine.failure is not None:
            raise self.engine.failure
        return self.engine._outputs[self.d]


class _ProfileRunner:
    """runner.execute for start-up profiling (worker/sps_profile.py) under lockstep steps: replica 0's
    step, the other replicas idle (joining the expert exchange)."""

    def __init__(self, engine: "Engine"):
        self.engine, self.device = engine, engine.executor.worker.runner.device

    def execute(self, so: SchedulerOutput) -> ModelOutput:
        return self.engine.executor.step([so] + [None] * (len(self.engine.cores) - 1))[0]


class Engine:
    def __init__(self, executor, args: EngineArgs, detokenizer=None, proposer: Callable[[], object] | None = None,
                 async_scheduling: bool = False, max_model_len: int | None = None):
        """`executor`: InProcExecutor or MultiprocExecutor (its `worker` is this process's rank);
        `proposer()`: a new draft proposer for a replica's scheduler (None: no speculation);
        `max_model_len`: the checked limit (None: what the cache and the model allow)."""
        self.executor, self.args = executor, args
        w = executor.worker
        self.model, self.cache, self.rank_weights = w.model, w.cache, w.rank_weights
        self.max_model_len = max_model_len or KVCacheManager(w.num_slots, w.num_blocks, args.block_size).max_model_len(
            args.max_model_len, self.model.config.max_position_embeddings,
            "every rank's smallest share" if args.parallel.world_size > 1 else "the cache")
        dp = args.parallel.data_parallel_size
        self.failure = None
        self._outputs: list[ModelOutput | None] = []
        self._steps = self.fixed_steps = 0
        self.cores: list[EngineCore] = []
        for d in range(dp):  # every replica's cache has the driver's size (the smallest)
            kv = KVCacheManager(w.num_slots, w.num_blocks, args.block_size)
            cls = Scheduler if dp == 1 else _PlannedScheduler
            sched = cls(kv, min(args.max_num_seqs, w.num_slots), args.max_num_batched_tokens, self.max_model_len,
                        proposer() if proposer else None)
            runner = executor.replica_runner() if dp == 1 else _LockstepOutput(self, d)
            self.cores.append(EngineCore(sched, runner, detokenizer, async_scheduling and dp == 1))
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
        """What worker/sps_profile.py times steps through (replica 0's steps)."""
        return self.cores[0].runner if len(self.cores) == 1 else _ProfileRunner(self)

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
        finished = [r for c in self.cores for r in c.grammar_failures()]
        active = [d for d, c in enumerate(self.cores) if c.has_unfinished()]
        plans: list[SchedulerOutput | None] = [None] * len(self.cores)
        for d in active:
            so = self.cores[d].scheduler.plan()
            plans[d] = so if so.chunks else None
        if all(p is None for p in plans):
            for d in active:
                self.cores[d].scheduler._planned = None
            if finished:
                return finished
            if any(not r.grammar.ready() for c in self.cores for r in c.scheduler.waiting_grammars):
                time.sleep(GRAMMAR_POLL_S)  # only requests whose grammars still compile could run
                return finished
            if active:
                raise RuntimeError("scheduler made no progress: the cache cannot hold any waiting request")
            return finished
        cap = self.args.max_num_seqs
        fixed = all(p is None or (len(p.chunks) <= cap and all(len(c.token_ids) == 1 for c in p.chunks))
                    for p in plans)
        self._steps += 1
        self.fixed_steps += fixed
        eplb = self.args.eplb
        rebalance = eplb is not None and self._steps % eplb.interval == 0
        try:
            self._outputs = self.executor.step(plans, fixed, rebalance)
        except Exception as e:
            self.failure = e
        errors = []
        for d in active:  # every replica's output is applied, even if one replica's update raises
            if plans[d] is None:
                self.cores[d].scheduler._planned = None
                continue
            try:
                finished += self.cores[d].step()  # a failed step aborts its requests in it, with the error
            except Exception as e:  # noqa: BLE001 (raised below, once every core has its output)
                errors.append(e)
        if self.failure is not None:
            for c in self.cores:
                finished += c.abort(list(c.requests), str(self.failure))
            raise self.failure
        if errors:
            raise errors[0]
        return finished

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
