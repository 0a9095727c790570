"""One engine over N processes on one node: tensor parallelism, and context parallelism through the
same driver (torch.multiprocessing, spawn).

The calling process is rank 0, the driver: it owns the Scheduler and the EngineCore. It spawns
ranks 1..N-1; every rank loads its shard of the checkpoint (tensor_parallel.load_shard: only its
part of each tensor is read and stored), allocates the same cache and builds a ModelRunner (a
CPRunner around it under context parallelism). Each step the driver broadcasts the step's
SchedulerOutput (pickled, over the gloo group) and every rank runs the forward on it; the TP
all-reduces inside the forward keep the ranks' residuals equal.

Sampling: only the driver's sampled tokens are used. Scheduling is synchronous (no placeholder
inputs), so the next SchedulerOutput carries every token the other ranks need: nothing has to be
sent back, and a rank's own sampling (same seed, same logits) is computed and dropped. Chosen
over broadcasting tokens because it adds no collective to a step.

Failure: any rank that raises or dies ends the engine. A worker that raises puts its traceback on a
queue and exits with code 1. A driver thread (_RankWatch) waits on the spawned ranks' process
sentinels: the first rank to exit while the engine is open is recorded with its exit code, the other
spawned ranks are terminated (under NCCL they would block in a collective until `timeout_s`), and the
driver's NCCL communicators are aborted so that its own pending collective returns. The driver's
step checks that record before and after the step, so its collective failing (a peer's connection
closed), timing out, or returning from an abort all end the same way: `TPEngine.step` raises
TPWorkerError naming the rank, its exit code and its error. The engine is then closed: a new one
must be built.
"""
from __future__ import annotations

import itertools
import logging
import multiprocessing
import multiprocessing.connection
import queue
import shutil
import signal
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer.distributed import parallel_state as ps
from deepinfer.distributed.parallel_state import ParallelConfig
from deepinfer.distributed.tensor_parallel import load_shard
from deepinfer.engine.engine_core import EngineCore
from deepinfer.engine.kv_manager import KVCacheManager, plan_capacity
from deepinfer.engine.memory_fit import WeightBytes
from deepinfer.engine.outputs import CompletionOutput, ModelOutput, SchedulerOutput
from deepinfer.engine.request import Request, Status
from deepinfer.engine.scheduler import Scheduler
from deepinfer.layers.moe import repack_fp4_experts
from deepinfer.loader.model_loader import weight_bytes
from deepinfer.sampling_params import SamplingParams
from deepinfer.worker.kv_cache import V4Cache, allocate_v4_cache, cache_spec, default_cache_memory
from deepinfer.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# seconds the driver waits, once a collective failed, for the failing rank's report or exit
REPORT_WAIT_S = 10.0
# exit code of a spawned rank that raised (report_failure)
FAILED_EXIT_CODE = 1


@dataclass(frozen=True)
class EngineArgs:
    """What every rank needs to build its part of the engine (pickled to the spawned ranks)."""

    model_dir: str
    parallel: ParallelConfig
    device: str = "cpu"
    dtype: str = "float32"
    quantized: bool = False
    # packed FP4 routed experts held as FP8 codes on every rank, scales folded where every rank can
    # (the driver decides it before start-up: LLM's _check_ranks_fit, where the repacked share fits)
    repack_fp4_experts: bool = False
    load_format: str = "auto"         # "dummy": random weights, no shard read (loader/dummy.py)
    kv_cache_dtype: str = "auto"
    kv_cache_memory: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 64
    seed: int | None = 0
    replay_keep: int | None = None    # V4.1 SWA bounded replay (LLM's yoco_prefill_keep_tokens); None: exact prefill
    batch_invariant: bool = False
    enforce_eager: bool = True        # CUDA graphs with NCCL all-reduces inside are not validated yet
    timeout_s: float = 600.0          # a collective waiting longer for a peer raises
    backend: str | None = None        # None: NCCL on CUDA, gloo on the CPU; "gloo" on CUDA: ranks may share a GPU
    num_threads: int | None = None    # torch CPU threads per rank (None: torch's default)
    # called by every rank but the driver before each step as step_hook(rank, step); must be picklable
    # (a module-level function). Fault injection for tests; None in serving.
    step_hook: Callable[[int, int], None] | None = None

    def __post_init__(self):
        p = self.parallel
        if p.context_parallel_size != 1 and (p.tensor_parallel_size != 1 or p.data_parallel_size != 1):
            raise ValueError("parallel: context parallelism is launched alone so far (tensor_parallel_size and "
                             "data_parallel_size 1)")
        if p.data_parallel_size != 1 and p.tensor_parallel_size != 1:
            raise ValueError("parallel: tensor parallelism inside data-parallel ranks is not launched yet "
                             "(data_parallel_size > 1 needs tensor_parallel_size=1)")
        if p.enable_expert_parallel and p.data_parallel_size == 1:
            raise ValueError("parallel: enable_expert_parallel spreads the experts over the data-parallel ranks; "
                             "it needs data_parallel_size > 1")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: expected > 0, got {self.timeout_s}")


class TPWorkerError(RuntimeError):
    """A rank of a multi-process engine failed; the engine is closed. `rank` is the first failing rank
    found (None if only the driver's collective saw it), `details` every report collected."""

    def __init__(self, message: str, rank: int | None, details: list[str]):
        super().__init__(message)
        self.rank, self.details = rank, details


@dataclass
class _Rank:
    info: ps.RankInfo
    model: torch.nn.Module
    runner: ModelRunner  # or a CPRunner around one (context parallelism): the same execute
    num_slots: int
    num_blocks: dict[int, int]
    cache: V4Cache         # the same size on every rank
    weights: list[WeightBytes]  # every rank's, in rank order (its shard / its expert slots)


def _build_rank(args: EngineArgs, rank: int, init_method: str,
                load: Callable[[EngineArgs, ps.RankInfo], torch.nn.Module] | None = None) -> _Rank:
    """Join the groups, load this rank's part of the model (`load`; default: its tensor-parallel
    shard), agree on the cache size (the smallest any rank can hold) and share the weights' bytes, allocate
    the cache and the runner."""
    info = ps.init_parallel(args.parallel, rank, args.device, init_method, args.timeout_s, args.backend)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    device = str(info.device)
    model = (load or _load_tp_shard)(args, info)
    if args.repack_fp4_experts:
        repack_fp4_experts(model, agree=_agreed_flags)
    cfg = model.config
    spec = cache_spec(cfg, args.kv_cache_dtype, args.block_size)
    memory = args.kv_cache_memory or default_cache_memory(device)
    expected = args.max_model_len or min(cfg.max_position_embeddings, 4096)
    gathered = ps.all_gather_object((plan_capacity(memory, spec.slot_bytes, spec.block_bytes, args.block_size,
                                                   args.max_num_seqs, expected), weight_bytes(model)))
    plans = [plan for plan, _ in gathered]
    num_slots = min(s for s, _ in plans)
    num_blocks = {m: min(b[m] for _, b in plans) for m in plans[0][1]}
    cache = allocate_v4_cache(cfg, num_slots, num_blocks, args.kv_cache_dtype, device, args.block_size, scratch=True)
    runner = ModelRunner(model, cache, device, args.seed, args.replay_keep, not args.enforce_eager,
                         args.batch_invariant)
    if args.parallel.context_parallel_size > 1:  # long prefills split over the ranks, the rest replicated
        from deepinfer.distributed.context_parallel import CPRunner

        runner = CPRunner(runner, dist.group.WORLD)
    ps.set_collective_timeout(args.timeout_s)  # start-up done: from here a peer this late is stuck
    return _Rank(info, model, runner, num_slots, num_blocks, cache, [w for _, w in gathered])


def _agreed_flags(flags: list[bool]) -> list[bool]:
    """Each flag true on every rank (a collective: every rank calls it with as many flags)."""
    return [all(col) for col in zip(*ps.all_gather_object(flags))]


def _load_tp_shard(args: EngineArgs, info: ps.RankInfo) -> torch.nn.Module:
    return load_shard(args.model_dir, info.tp_rank, info.tp_size, dtype=getattr(torch, args.dtype),
                      device=str(info.device), quantized=args.quantized, load_format=args.load_format,
                      seed=args.seed or 0)


def _worker_main(rank: int, args: EngineArgs, init_method: str, reports) -> None:
    """A non-driver rank: run every step plan the driver broadcasts until it sends None."""
    try:
        r = _build_rank(args, rank, init_method)
        step = 0
        while (so := ps.broadcast_object(None)) is not None:
            if args.step_hook is not None:
                args.step_hook(rank, step)
            r.runner.execute(so)
            step += 1
    except BaseException as e:  # noqa: BLE001 (reported to the driver, then this process ends)
        report_failure(rank, e, reports)
    finally:
        ps.destroy()


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


class _DriverRunner:
    """The driver's runner as EngineCore sees it: every step plan goes to the other ranks first.
    Any failure ends the engine (the ranks may be out of step): `diagnose` turns it into the error
    that names the failing rank, which is kept (`failure`) and raised, so the step's requests are
    aborted with it."""

    supports_placeholders = False  # synchronous steps: the next plan carries the sampled tokens

    def __init__(self, runner: ModelRunner, diagnose: Callable[[BaseException], TPWorkerError],
                 check: Callable[[], None]):
        self.runner, self.diagnose, self.check, self.failure = runner, diagnose, check, None

    def execute(self, so: SchedulerOutput) -> ModelOutput:
        if self.failure is not None:
            raise self.failure
        try:
            self.check()
            ps.broadcast_object(so)
            out = self.runner.execute(so)
            self.check()  # a rank that died mid-step: its peers' results may come from aborted collectives
            return out
        except Exception as e:
            self.failure = self.diagnose(e)
            raise self.failure from e


class TPEngine:
    """EngineCore's surface (add_request, step, has_unfinished, completion, abort, release) over a
    tensor-parallel group started on this node; this process is rank 0. `close()` (or leaving a
    `with` block) stops the other ranks and leaves the process group."""

    kind = "tensor-parallel"  # how errors name the ranks

    def __init__(self, args: EngineArgs, detokenizer=None):
        if args.parallel.data_parallel_size != 1:
            raise ValueError("parallel: TPEngine runs one data-parallel rank; data_parallel_size > 1 is "
                             "distributed/dp_engine.py's DPEngine")
        if args.parallel.context_parallel_size > 1:  # the same driver: every rank runs every step's plan
            self.kind = "context-parallel"
        init_method = self._start_ranks(args, _worker_main)
        try:
            rank = _build_rank(args, 0, init_method)
        except Exception as e:
            raise self._diagnose(e) from e
        self.model, self.rank_info = rank.model, rank.info
        self.cache, self.rank_weights = rank.cache, rank.weights  # for the start-up capacity log
        kv = KVCacheManager(rank.num_slots, rank.num_blocks, args.block_size)
        self.max_model_len = kv.max_model_len(args.max_model_len, self.model.config.max_position_embeddings,
                                              "every rank's smallest share")
        self.scheduler = Scheduler(kv, min(args.max_num_seqs, rank.num_slots), args.max_num_batched_tokens,
                                   self.max_model_len)
        self._runner = _DriverRunner(rank.runner, self._diagnose, self._watch.check)
        self.engine = EngineCore(self.scheduler, self._runner, detokenizer, async_scheduling=False)
        self._ids = itertools.count()

    def _start_ranks(self, args: EngineArgs, target: Callable, *extra) -> str:
        """Spawn ranks 1..world-1 as target(rank, args, init_method, reports, *extra); -> init_method."""
        ps.check_free()  # before any rank is spawned: this process is to be rank 0
        self.args, self._error, self._closed = args, None, False
        self._threads = torch.get_num_threads()  # rank 0 (this process) may set its own; close() restores it
        self._tmp = None
        init_method = ps.init_method_from_env()
        if init_method is None:
            self._tmp = tempfile.mkdtemp(prefix="deepinfer-pg-")
            init_method = f"file://{Path(self._tmp) / 'store'}"
        ctx = mp.get_context("spawn")
        self._reports = ctx.Queue()
        self._procs = {r: ctx.Process(target=target, args=(r, args, init_method, self._reports, *extra), daemon=True,
                                      name=f"deepinfer-rank{r}") for r in range(1, args.parallel.world_size)}
        for p in self._procs.values():
            p.start()
        self._watch = _RankWatch(self._procs, _abort_nccl)
        return init_method

    # EngineCore's surface
    def add_request(self, req: Request) -> None:
        self._check_open()
        self.engine.add_request(req)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list[Request]:
        """One step on every rank; raises TPWorkerError (and closes the engine) if any rank failed."""
        self._check_open()
        finished = self.engine.step()  # a failing step's requests are aborted in it, with the error
        if self._runner.failure is not None:
            self.engine.abort(list(self.engine.requests), str(self._runner.failure))  # and all others
            raise self._runner.failure
        return finished

    def completion(self, req: Request, index: int) -> CompletionOutput:
        return self.engine.completion(req, index)

    def abort(self, request_ids: list[str], error: str) -> list[Request]:
        return self.engine.abort(request_ids, error)

    def release(self, req: Request) -> None:
        self.engine.release(req)

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams]) -> list[list[CompletionOutput]]:
        """Token-id prompts to completion; per prompt its n completions (LLM.generate's validation
        and text handling stay in LLM)."""
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

    def close(self) -> None:
        """Stop the other ranks (a clean goodbye when the group is healthy) and leave the group; once only
        (a second call must not leave the group of an engine started since)."""
        if self._closed:
            return
        self._closed = True
        self._watch.stop()
        if self._procs and self._error is None and self._watch.dead is None and ps.rank_info() is not None:
            try:
                ps.broadcast_object(None)
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
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        self._reports.close()
        torch.set_num_threads(self._threads)

    def __enter__(self) -> TPEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
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
                   f"{REPORT_WAIT_S:.0f} s (a rank stuck past timeout_s={self.args.timeout_s} s?): {driver}")
        details = [f"rank {r}: {text}" for r, text in sorted(reports.items())] + [f"driver (rank 0): {driver}"]
        self._error = TPWorkerError(msg, first, details)
        self.close()
        return self._error


def generate_tp(args: EngineArgs, prompts: list[list[int]],
                params: SamplingParams | list[SamplingParams]) -> list[list[CompletionOutput]]:
    """Token-id prompts through a TPEngine started and closed here; per prompt its n completions."""
    with TPEngine(args) as eng:
        return eng.generate(prompts, params)
