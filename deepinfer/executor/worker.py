"""One rank of an engine: its part of the model, its cache, its runner; every layout builds it the same way.

A rank loads what its place in the layout asks for (rank layout: distributed/parallel_state.py):
  - tensor_parallel_size > 1: its tensor-parallel shard (distributed/tensor_parallel.py load_shard);
  - enable_expert_parallel: the whole model but only its slots of each trunk MoE's routed experts
    (expert_shard.load_expert_shard), each MoE's exchange over the data-parallel group;
  - otherwise the whole checkpoint.
It then agrees with every other rank on the cache size (the smallest any rank can hold), allocates it
with the ring slack speculative decoding needs, builds the model's own drafter (DSpark stages, V4's MTP
layer) where the configuration asks for one, and a ModelRunner over all of it; under context
parallelism a CPRunner around that runner splits long prefills over the rank's context-parallel group.

`Worker.step` runs one data-parallel step message (what every rank of the world receives from the
driver, multiproc.py): this rank's replica's plan, or, with none, the dummy step that joins the
expert-parallel exchanges. The same Worker is the in-process engine's (world size 1, no process group).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from deepinfer.config import check_layout
from deepinfer.distributed import parallel_state as ps
from deepinfer.distributed.eplb import ExpertLoad, placement_from_physical, rebalance_experts, rebalance_plan
from deepinfer.distributed.expert_shard import (CountingExpertParallel, EPLBConfig, load_expert_shard, move_slots,
                                                trunk_moes)
from deepinfer.distributed.parallel_state import ParallelConfig
from deepinfer.distributed.tensor_parallel import load_shard
from deepinfer.engine.kv_manager import plan_capacity
from deepinfer.engine.memory_fit import WeightBytes
from deepinfer.engine.outputs import ModelOutput, SchedulerOutput
from deepinfer.layers.moe import repack_fp4_experts
from deepinfer.loader.model_loader import load_model, weight_bytes
from deepinfer.worker.drafter import DSparkDrafter, MTPDrafter
from deepinfer.worker.kv_cache import V4Cache, allocate_v4_cache, cache_spec, default_cache_memory
from deepinfer.worker.model_runner import ModelRunner, StepHandle

logger = logging.getLogger(__name__)

# drafters built on every rank from the model's own draft layers ("ngram" drafts on the driver's host)
MODEL_DRAFTERS = {"dspark": DSparkDrafter, "mtp": MTPDrafter}


@dataclass(frozen=True)
class EngineArgs:
    """What every rank needs to build its part of the engine (pickled to the spawned ranks)."""

    model_dir: str
    parallel: ParallelConfig = ParallelConfig()
    device: str = "cpu"
    dtype: str = "float32"
    quantized: bool = False
    # packed FP4 routed experts held as FP8 codes on every rank, scales folded where every rank can
    # (decided before start-up, where the repacked share fits: llm.py _check_ranks_fit / _check_before_load)
    repack_fp4_experts: bool = False
    load_format: str = "auto"         # "dummy": random weights, no shard read (loader/dummy.py)
    engram_device: str | None = None  # "cpu": V4.1 Engram tables on the host (one process only)
    kv_cache_dtype: str = "auto"
    kv_cache_memory: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 64
    seed: int | None = 0
    replay_keep: int | None = None    # V4.1 SWA bounded replay (LLM's yoco_prefill_keep_tokens); None: exact prefill
    batch_invariant: bool = False
    enforce_eager: bool = True        # False: pure-decode steps replay CUDA graphs (where the layout allows)
    # speculative decoding: (method, draft tokens per step) or None; "dspark" / "mtp" build the model's
    # drafter on every rank, "ngram" only reserves the ring slack (its drafts are the driver's)
    speculation: tuple[str, int] | None = None
    eplb: EPLBConfig | None = None    # expert-parallel load balancing (needs enable_expert_parallel)
    timeout_s: float = 600.0          # a collective waiting longer for a peer raises
    backend: str | None = None        # None: NCCL on CUDA, gloo on the CPU; "gloo" on CUDA: ranks may share a GPU
    num_threads: int | None = None    # torch CPU threads per rank (None: torch's default)
    # "mp": the multi-process executor even at one rank (the code path of every parallel layout); None: by world size
    distributed_executor_backend: str | None = None
    # multi-node (torch.distributed's TCP store, as torchrun's flags): this node's index of `nnodes`, each
    # running world_size / nnodes consecutive ranks; master_addr:master_port is node 0's TCP store
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    # called by every rank but the driver before each step as step_hook(rank, step); must be picklable
    # (a module-level function). Fault injection for tests; None in serving.
    step_hook: Callable[[int, int], None] | None = None

    def __post_init__(self):
        p = self.parallel
        check_layout(p.tensor_parallel_size, p.data_parallel_size, p.context_parallel_size,
                     p.enable_expert_parallel, self.eplb is not None, self.engram_device)
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: expected > 0, got {self.timeout_s}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank: {self.node_rank} is outside [0, nnodes={self.nnodes})")
        if self.parallel.world_size % self.nnodes:
            raise ValueError(f"nnodes: {self.nnodes} does not divide the world of {self.parallel.world_size} ranks "
                             "(every node runs as many ranks)")
        if self.speculation is not None and self.speculation[0] not in (*MODEL_DRAFTERS, "ngram"):
            raise ValueError(f"speculation: unknown method {self.speculation[0]!r}")

    @property
    def ranks_per_node(self) -> int:
        return self.parallel.world_size // self.nnodes

    @property
    def ring_slack(self) -> int:
        """Ring rows per slot for rejected draft positions (k - 1 suffice; k keeps one spare, as one process)."""
        return self.speculation[1] if self.speculation else 0


class Worker:
    """One rank: joins the groups (when `init_method` is given), builds its part of the engine, runs steps."""

    def __init__(self, args: EngineArgs, rank: int = 0, init_method: str | None = None):
        if init_method is not None:
            self.info = ps.init_parallel(args.parallel, rank, args.device, init_method, args.timeout_s, args.backend)
            # one configuration for every rank on every node: the driver's (seed included); a node's own model
            # directory (its path to the same checkpoint) and index stay its own
            driver = ps.broadcast_object(args)
            if driver.parallel != args.parallel:
                raise ValueError(f"parallel: node {args.node_rank} was started with {args.parallel}, the driver with "
                                 f"{driver.parallel}; start every node with the same parallel sizes")
            args = dataclasses.replace(driver, model_dir=args.model_dir, node_rank=args.node_rank)
        else:  # one process: no group
            self.info = ps.RankInfo(0, 1, 0, 1, 0, 1, torch.device(args.device))
        self.args = args
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        self.device = str(self.info.device)
        self.model = self._load()
        if args.repack_fp4_experts:
            repack_fp4_experts(self.model, agree=_agreed_flags)
        cfg = self.model.config
        spec = cache_spec(cfg, args.kv_cache_dtype, args.block_size, ring_slack=args.ring_slack)
        memory = args.kv_cache_memory or default_cache_memory(self.device)
        expected = args.max_model_len or min(cfg.max_position_embeddings, 4096)
        plan = plan_capacity(memory, spec.slot_bytes, spec.block_bytes, args.block_size, args.max_num_seqs, expected)
        gathered = ps.all_gather_object((plan, weight_bytes(self.model, args.engram_device == "cpu")))
        plans = [p for p, _ in gathered]
        self.num_slots = min(s for s, _ in plans)
        self.num_blocks = {m: min(b[m] for _, b in plans) for m in plans[0][1]}
        self.rank_weights: list[WeightBytes] = [w for _, w in gathered]  # every rank's, in rank order
        # one slot and one block per ratio beyond the manager's: the padding rows of decode graphs
        self.cache: V4Cache = allocate_v4_cache(cfg, self.num_slots, self.num_blocks, args.kv_cache_dtype,
                                                self.device, args.block_size, scratch=True,
                                                ring_slack=args.ring_slack)
        method = args.speculation[0] if args.speculation else None
        drafter = MODEL_DRAFTERS[method](self.model, self.cache, args.ring_slack) if method in MODEL_DRAFTERS else None
        self.moes = trunk_moes(self.model) if args.parallel.enable_expert_parallel else []
        self.eps = [m.expert_parallel for m in self.moes if m.expert_parallel is not None]
        # graphs capture a step's collectives: NCCL's (tensor parallelism's all-reduces; gloo's cannot be captured),
        # and not the expert-parallel exchange, which sizes its buffers on the host
        backend = args.backend or ps.backend_for(self.device)
        graphs = not args.enforce_eager and not self.eps and (self.info.tp_size == 1 or backend == "nccl")
        self.runner = ModelRunner(self.model, self.cache, self.device, args.seed, args.replay_keep, graphs,
                                  args.batch_invariant, drafter)
        if args.speculation and self.runner.graphs is not None:  # before any request: no capture inside a step
            t0, k = time.perf_counter(), args.speculation[1]
            n = self.runner.capture_speculative(min(args.max_num_seqs, self.num_slots), k, expected + k - 1)
            if self.info.rank == 0:
                logger.info("speculative decoding: %d CUDA graphs captured in %.1f s", n, time.perf_counter() - t0)
        if args.parallel.context_parallel_size > 1:  # long prefills split over the ranks, the rest replicated
            from deepinfer.distributed.context_parallel import CPRunner

            self.runner = CPRunner(self.runner, ps.cp_group())
        self._eplb_setup()
        # handles launched on a worker rank and not yet collected (oldest first): a step launched ahead
        # reads the newest one's device tokens (placeholder inputs)
        self.pending: collections.deque[StepHandle] = collections.deque()  # one replica's launched steps
        self.replica_pending: collections.deque[tuple[int, StepHandle]] = collections.deque()  # (seq, handle)
        if init_method is not None:
            ps.set_collective_timeout(args.timeout_s)  # start-up done: from here a peer this late is stuck

    def _load(self) -> torch.nn.Module:
        args, info = self.args, self.info
        dtype, seed = getattr(torch, args.dtype), args.seed or 0
        if info.tp_size > 1:
            return load_shard(args.model_dir, info.tp_rank, info.tp_size, dtype=dtype, device=self.device,
                              quantized=args.quantized, load_format=args.load_format, seed=seed)
        if args.parallel.enable_expert_parallel:
            redundant = args.eplb.redundant_per_rank if args.eplb else 0
            model = load_expert_shard(args.model_dir, info.dp_rank, info.dp_size, dtype=dtype, device=self.device,
                                      quantized=args.quantized, redundant_per_rank=redundant,
                                      load_format=args.load_format, seed=seed)
            for layer, moe in enumerate(trunk_moes(model)):
                moe.expert_parallel = CountingExpertParallel(moe.experts, model.placement.num_logical,
                                                             model.placement, layer, group=ps.dp_group(),
                                                             max_tokens=args.max_num_seqs)
            return model
        return load_model(args.model_dir, dtype=dtype, device=self.device, quantized=args.quantized,
                          engram_device=args.engram_device, load_format=args.load_format, seed=seed)[0]

    def _eplb_setup(self) -> None:
        self.load = None
        self.rebalances = self.moved_slots = self.remote_slots = 0  # counters (tests, reports)
        if self.args.eplb is None or not self.eps:
            return
        self.load = ExpertLoad(len(self.eps), self.eps[0].num_logical, self.args.eplb.window)
        # every layer's counts in one device tensor: one host copy a step
        self.counts = torch.zeros(len(self.eps), self.eps[0].num_logical, dtype=torch.long,
                                  device=self.eps[0].experts.w1.device)
        for layer, ep in enumerate(self.eps):
            ep.counts = self.counts[layer]

    # data-parallel replicas in lockstep: every replica's launches at once, then every replica's collect
    def launch_replica(self, plan: SchedulerOutput | None, ahead: bool, seq: int, fixed: bool) -> StepHandle | None:
        """Launch this rank's replica's plan numbered `seq` (`ahead`: its placeholder inputs are the newest
        pending step's tokens); without a plan, the expert-parallel dummy step (every rank joins each MoE
        layer's exchange once per launch). -> the handle, None without a plan."""
        for ep in self.eps:
            ep.fixed_capacity = fixed
        if plan is None:
            if self.eps:
                self._dummy()
            return None
        prev = self.replica_pending[-1][1] if ahead and self.replica_pending else None
        h = self.runner.launch(plan, prev)
        self.replica_pending.append((seq, h))
        return h

    def collect_replica(self, upto: int | None, rebalance: bool) -> ModelOutput | None:
        """Wait for this rank's pending steps numbered up to `upto` (a step dropped by the driver is collected
        with the next one) -> the output of step `upto` (None: none to collect); then record the expert
        load, and rebalance (EPLB) if asked."""
        out = None
        while upto is not None and self.replica_pending and self.replica_pending[0][0] <= upto:
            seq, h = self.replica_pending.popleft()
            o = self.runner.collect(h)
            out = o if seq == upto else out
        if self.load is not None:
            for layer, counts in enumerate(self.counts.cpu()):
                self.load.record(layer, counts)
            self.counts.zero_()
            self.load.next_step()
        if rebalance:
            self._rebalance()
        return out

    def complete_replica(self, so: SchedulerOutput) -> None:
        """Worker.complete for the newest pending step of this rank's replica."""
        _complete(self.runner, self.replica_pending[-1][1], so)

    # one replica's steps, launched ahead (async scheduling, data_parallel_size 1)
    def launch(self, so: SchedulerOutput, ahead: bool) -> StepHandle:
        """Launch `so` (`ahead`: its placeholder inputs are the newest pending step's tokens), then
        wait for every older pending step: the rank's host runs one step ahead of its device at most."""
        prev = self.pending[-1] if ahead and self.pending else None
        h = self.runner.launch(so, prev)
        while self.pending:
            self.runner.collect(self.pending.popleft())
        self.pending.append(h)
        return h

    def complete(self, so: SchedulerOutput) -> None:
        """Sample the newest pending step, launched ahead with its grammar masks left for later: `so` is that
        step with its masks (structured/frozen.py) now that the driver has advanced the grammars."""
        _complete(self.runner, self.pending[-1], so)

    @torch.inference_mode()
    def _dummy(self) -> ModelOutput:
        """Zero tokens through every trunk MoE, in forward order: joins each layer's collectives."""
        x = torch.empty(0, self.model.config.hidden_size, dtype=self.model.dtype, device=self.info.device)
        ids = torch.empty(0, dtype=torch.long, device=self.info.device)
        for moe in self.moes:
            moe(x, ids)
        return ModelOutput({})

    @torch.no_grad()
    def _rebalance(self) -> None:
        """New placement from the ranks' summed load window (computed by the driver, broadcast), then the
        weights moved into the slots whose expert changed, then routing by it."""
        if self.load is None:
            return
        old = self.model.placement
        load = sum(ps.all_gather_object(self.load.mean()))
        p2l = None
        if self.info.is_driver:
            p2l = rebalance_experts(load, old.num_physical, old.num_gpus, policy="global").physical_to_logical
        new = placement_from_physical(ps.broadcast_object(p2l), old.num_logical, old.num_gpus)
        moves = rebalance_plan(old, new)
        for layer, ep in enumerate(self.eps):
            mine = [m for m in moves if m.layer == layer]
            if mine:
                self.remote_slots += move_slots(ep.experts, mine, old.slots_per_gpu, ep.rank, ep.size, ep.group)
            ep.set_placement(new, layer)
        self.model.placement = new
        self.rebalances += 1
        self.moved_slots += len(moves)


def _complete(runner, h: StepHandle, so: SchedulerOutput) -> None:
    """Sample `h`, launched ahead with its grammar masks left for later, from `so` (that step with its masks)."""
    if h.deferred is None:
        raise RuntimeError("complete: the newest pending step was not deferred")
    _, logits, rows = h.deferred
    h.deferred = (so, logits, rows)
    runner.complete(h)


def _agreed_flags(flags: list[bool]) -> list[bool]:
    """Each flag true on every rank (a collective: every rank calls it with as many flags)."""
    return [all(col) for col in zip(*ps.all_gather_object(flags))]

