"""Attention data parallelism with expert-parallel MoE, as one engine on one node (torch.multiprocessing, spawn).

data_parallel_size ranks (tensor_parallel_size 1 each); this process is rank 0, the driver. Every rank
holds the whole attention / router / shared-expert weights, its own KV cache and ModelRunner, and,
with enable_expert_parallel, only its slots of each trunk MoE layer's routed experts: it reads its
range of experts from the checkpoint and nothing of the others' (load_expert_shard). Each MoE's `expert_parallel`
hook is an ExpertParallel over the whole world, so a forward sends each (token, expert) pair to the
rank holding its slot. Without enable_expert_parallel the ranks are independent replicas (no collective
inside a forward).

Scheduling: every DP rank has its own Scheduler and KVCacheManager (its requests, its cache's
blocks); the schedulers live on the driver (host bookkeeping only), which keeps one EngineCore per
rank. A new request goes to the rank with the fewest unfinished requests (ties: lowest rank). One
step:

1. the driver plans every rank's step (None for a rank without work) and broadcasts the list with
   two step-wide flags: `fixed` (no rank prefills and every rank's tokens fit the capacity:
   ExpertParallel.forward_fixed, else the variable exchange) and `rebalance` (EPLB, below). One
   broadcast replaces a per-step agreement all-reduce: the driver already knows what every rank runs.
2. every rank runs its plan; a rank without one runs a dummy step: every MoE layer of the trunk,
   in forward order, on zero tokens, so it joins each layer's collectives and nothing waits for it.
3. the ranks' ModelOutputs are gathered (all_gather_object over the gloo group); the driver's
   EngineCores apply them (sampled tokens, stops, finished requests).

Sampling happens on the rank that ran the request (its runner's generator, seeded like one process's).

EPLB (`EPLBConfig`): each rank counts the tokens routed to every logical expert of every MoE layer
(ExpertLoad, a moving window of steps). Every `interval` steps, after the step's outputs are gathered,
the ranks sum their windows (all_gather_object), the driver computes a placement (eplb.rebalance_experts,
global policy) over `num_physical` = experts + redundant_per_rank * ranks slots and broadcasts it, and
every rank moves expert weights to the slots whose expert changed (eplb.rebalance_plan; a slot is filled
from a replica on its own rank when there is one, else through one all_to_all_single per layer and
weight tensor), then routes by the new placement (ExpertParallel.set_placement). Requests in flight
are untouched: the move happens between steps, and every replica of an expert holds the same weights.

Failure: as TPEngine (launch.py): a rank that raises reports its traceback and exits; the driver
watches every rank's process, so a rank that dies (raising or killed) ends the step promptly under
gloo or NCCL, and `step` raises TPWorkerError naming the rank and its exit code, after aborting every
request. The engine is then closed.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from deepinfer.distributed import parallel_state as ps
from deepinfer.distributed.eplb import (ExpertLoad, Placement, SlotMove, contiguous_placement, placement_from_physical,
                                        rebalance_experts, rebalance_plan)
from deepinfer.distributed.expert_parallel import ExpertParallel, all_to_all, shard_experts
from deepinfer.distributed.launch import EngineArgs, TPEngine, _build_rank, _Rank, report_failure
from deepinfer.engine.engine_core import EngineCore
from deepinfer.engine.kv_manager import KVCacheManager
from deepinfer.engine.outputs import ModelOutput, SchedulerOutput
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler
from deepinfer.layers.linear import prepare_fp8_linears
from deepinfer.layers.moe import Experts, MoE
from deepinfer.distributed.tensor_parallel import META_MIN_NUMEL, _Cutter, _LargeOnMeta, _materialize
from deepinfer.loader.model_loader import engram_token_map, load_model, model_spec, open_weights
from deepinfer.loader.resolve import resolve_model_dir
from deepinfer.loader.weights import load_weights

EXPERT_LEAVES = ("w1", "w2", "w3", "w1_scale", "w2_scale", "w3_scale")


@dataclass(frozen=True)
class EPLBConfig:
    """Expert-parallel load balancing while serving. interval: steps between rebalances; window: steps
    of load the placement is computed from; redundant_per_rank: extra expert slots per rank (replicas of
    the hottest experts)."""

    interval: int = 1000
    window: int = 1000
    redundant_per_rank: int = 1

    def __post_init__(self):
        for name in ("interval", "window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.redundant_per_rank < 0:
            raise ValueError(f"redundant_per_rank: expected >= 0, got {self.redundant_per_rank}")


class CountingExpertParallel(ExpertParallel):
    """ExpertParallel that adds the tokens routed to each logical expert to `counts` ([num_logical]
    int64, this rank's tokens, since the counts were last read) when it is set."""

    counts: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 shared: torch.Tensor | None = None) -> torch.Tensor:
        if self.counts is not None and ids.numel():
            self.counts += torch.bincount(ids.flatten().long(), minlength=self.num_logical)
        return super().__call__(x, weights, ids, shared)


def trunk_moes(model: torch.nn.Module) -> list[MoE]:
    """The MoE of every trunk layer, in forward order (the MTP / DSpark draft layers are not run by
    ModelRunner and keep their local experts)."""
    moes = [layer.ffn for layer in model.layers]
    if not all(isinstance(m, MoE) for m in moes):
        raise ValueError("model: expected a MoE `ffn` in every trunk layer")
    return moes


def initial_placement(num_layers: int, num_logical: int, ep: int, redundant_per_rank: int = 0) -> Placement:
    """Rank g holds experts g*n .. (g+1)*n - 1 (n = num_logical / ep), then replicas of its first
    `redundant_per_rank` of them: what it can fill from the checkpoint range it reads (load_expert_shard)."""
    n = contiguous_placement(1, num_logical, ep).slots_per_gpu  # checks that ep divides num_logical
    if not 0 <= redundant_per_rank <= n:
        raise ValueError(f"redundant_per_rank: expected 0 .. {n} (the experts a rank holds), got {redundant_per_rank}")
    own = torch.arange(num_logical).view(ep, n)
    slots = torch.cat([own, own[:, :redundant_per_rank]], 1).reshape(1, -1).repeat(num_layers, 1)
    return placement_from_physical(slots, num_logical, ep)


def load_expert_shard(model_dir: str, rank: int, ep: int, *, dtype: torch.dtype, device: str,
                      quantized: bool = False, redundant_per_rank: int = 0, load_format: str = "auto",
                      seed: int = 0, min_numel: int | None = None) -> torch.nn.Module:
    """load_model for one expert-parallel rank: the model is built with its large tensors on the meta
    device, each trunk MoE's experts cut to this rank's range of `initial_placement`, and only that
    range is read from the checkpoint (every other tensor whole); then each trunk MoE's `experts`
    becomes the rank's slots (shard_experts). `model.placement` is the placement. Draft (MTP / DSpark)
    layers are not run by the engine and keep all their experts."""
    path = resolve_model_dir(str(model_dir))
    reader = open_weights(path, load_format, seed)
    cfg, model_cls, _, _ = model_spec(path, reader, None)
    with _LargeOnMeta(torch.device(device), META_MIN_NUMEL if min_numel is None else min_numel):
        net = model_cls(cfg, dtype=dtype, quantized=quantized)
    moes = trunk_moes(net)
    placement = initial_placement(len(moes), moes[0].experts.num_experts, ep, redundant_per_rank)
    n, parts = placement.num_logical // ep, {}
    for i, moe in enumerate(moes):
        cut, ex = _Cutter(f"layers.{i}.ffn", parts), moe.experts
        for leaf in EXPERT_LEAVES:
            if getattr(ex, leaf, None) is not None:
                cut.tensor(moe, f"experts.{leaf}", 0, rank * n, (rank + 1) * n)
        ex.first_expert, ex.num_experts = rank * n, n
    _materialize(net, torch.device(device))
    load_weights(net, reader, config=cfg, shard=parts)
    if getattr(cfg, "engram_layer_ids", None):
        net.set_engram_vocab(engram_token_map(path))
    for layer, moe in enumerate(moes):
        moe.experts = shard_experts(moe.experts, placement, layer, rank, ep)
    net.placement = placement
    prepare_fp8_linears(net)  # as load_model leaves a model
    return net.eval()


def _load_dp_rank(args: EngineArgs, info: ps.RankInfo, eplb: EPLBConfig | None) -> torch.nn.Module:
    """The whole checkpoint (replicated experts), or (expert parallel) all but other ranks' experts,
    each trunk MoE's `expert_parallel` hook set."""
    dtype, device = getattr(torch, args.dtype), str(info.device)
    if not args.parallel.enable_expert_parallel:
        return load_model(args.model_dir, dtype=dtype, device=device, quantized=args.quantized,
                          load_format=args.load_format, seed=args.seed or 0)[0]
    model = load_expert_shard(args.model_dir, info.dp_rank, info.dp_size, dtype=dtype, device=device,
                              quantized=args.quantized, redundant_per_rank=eplb.redundant_per_rank if eplb else 0,
                              load_format=args.load_format, seed=args.seed or 0)
    for layer, moe in enumerate(trunk_moes(model)):
        moe.expert_parallel = CountingExpertParallel(moe.experts, model.placement.num_logical, model.placement,
                                                     layer, max_tokens=args.max_num_seqs)
    return model


class _DPRank:
    """What every rank (the driver included) runs each step."""

    def __init__(self, args: EngineArgs, rank: int, init_method: str, eplb: EPLBConfig | None):
        self.args, self.eplb = args, eplb
        self.r: _Rank = _build_rank(args, rank, init_method, functools.partial(_load_dp_rank, eplb=eplb))
        self.moes = trunk_moes(self.r.model)
        self.eps = [m.expert_parallel for m in self.moes if m.expert_parallel is not None]
        self.load = None
        if eplb is not None and self.eps:
            self.load = ExpertLoad(len(self.eps), self.eps[0].num_logical, eplb.window)
            # every layer's counts in one device tensor: one host copy a step
            self.counts = torch.zeros(len(self.eps), self.eps[0].num_logical, dtype=torch.long,
                                      device=self.eps[0].experts.w1.device)
            for layer, ep in enumerate(self.eps):
                ep.counts = self.counts[layer]
        self.rebalances = 0    # rebalances done
        self.moved_slots = 0   # slots whose expert changed, over all rebalances
        self.remote_slots = 0  # of those, slots filled from another rank (over the process group)

    def step(self, plans: list[SchedulerOutput | None], fixed: bool, rebalance: bool) -> list[ModelOutput]:
        """This rank's part of one step -> every rank's output, in rank order."""
        plan = plans[self.r.info.dp_rank]
        for ep in self.eps:
            ep.fixed_capacity = fixed
        if plan is not None:
            out = self.r.runner.execute(plan)
        else:  # replicated experts (no expert parallelism): nothing to join
            out = self._dummy() if self.eps else ModelOutput({})
        if self.load is not None:
            for layer, counts in enumerate(self.counts.cpu()):
                self.load.record(layer, counts)
            self.counts.zero_()
            self.load.next_step()
        outs = ps.all_gather_object(out)
        if rebalance:
            self._rebalance()
        return outs

    @torch.inference_mode()
    def _dummy(self) -> ModelOutput:
        """Zero tokens through every trunk MoE, in forward order: joins each layer's collectives."""
        model = self.r.model
        x = torch.empty(0, model.config.hidden_size, dtype=model.dtype, device=self.r.info.device)
        ids = torch.empty(0, dtype=torch.long, device=self.r.info.device)
        for moe in self.moes:
            moe(x, ids)
        return ModelOutput({})

    @torch.no_grad()
    def _rebalance(self) -> None:
        """New placement from the ranks' summed load window (computed by the driver, broadcast), then
        the weights moved into the slots whose expert changed, then routing by it."""
        if self.load is None:
            return
        old: Placement = self.r.model.placement
        load = sum(ps.all_gather_object(self.load.mean()))
        p2l = None
        if self.r.info.is_driver:
            p2l = rebalance_experts(load, old.num_physical, old.num_gpus, policy="global").physical_to_logical
        new = placement_from_physical(ps.broadcast_object(p2l), old.num_logical, old.num_gpus)
        moves = rebalance_plan(old, new)
        for layer, ep in enumerate(self.eps):
            mine = [m for m in moves if m.layer == layer]
            if mine:
                self.remote_slots += move_slots(ep.experts, mine, old.slots_per_gpu, ep.rank, ep.size, ep.group)
            ep.set_placement(new, layer)
        self.r.model.placement = new
        self.rebalances += 1
        self.moved_slots += len(moves)


def move_slots(experts: Experts, moves: list[SlotMove], slots_per_rank: int, rank: int, size: int, group) -> int:
    """One layer's SlotMoves on this rank's `experts` (its slots, local order): each moved slot gets its
    new expert's weights from a slot of the old placement, on this rank when one holds it, else over
    one all_to_all_single per weight tensor (every rank calls it, with what it sends and receives). All
    sources are read before any slot is written. -> the moves (on any rank) filled from another rank."""
    local_src, local_dst, remote = [], [], 0
    send = [[] for _ in range(size)]   # per destination rank: my local slots it reads
    recv = [[] for _ in range(size)]   # per source rank: my local slots it fills
    for m in moves:
        if not m.sources:
            raise ValueError(f"moves: layer {m.layer} slot {m.slot} has no source for expert {m.expert}")
        src = next((s for s in m.sources if s // slots_per_rank == m.gpu), m.sources[0])
        src_rank, src_local = divmod(src, slots_per_rank)
        if src_rank == m.gpu:
            if m.gpu == rank:
                local_src.append(src_local)
                local_dst.append(m.local_slot)
        else:
            remote += 1
            if src_rank == rank:
                send[m.gpu].append(src_local)
            if m.gpu == rank:
                recv[src_rank].append(m.local_slot)
    device = experts.w1.device
    index = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    send_idx, recv_idx = index([i for d in send for i in d]), index([i for s in recv for i in s])
    send_splits, recv_splits = [len(d) for d in send], [len(s) for s in recv]
    for leaf in EXPERT_LEAVES:
        t = getattr(experts, leaf, None)
        if t is None:
            continue
        rows = t.data.view(t.shape[0], -1)
        if rows.element_size() == 1:  # fp8 / e8m0 / packed fp4: moved as bytes
            rows = rows.view(torch.uint8)
        copies = rows.index_select(0, index(local_src))
        got = rows.new_empty(recv_idx.numel(), rows.shape[1])
        all_to_all(got, rows.index_select(0, send_idx), recv_splits, send_splits, group)
        rows.index_copy_(0, index(local_dst), copies)
        rows.index_copy_(0, recv_idx, got)
    return remote


def _dp_worker_main(rank: int, args: EngineArgs, init_method: str, reports, eplb: EPLBConfig | None) -> None:
    """A non-driver rank: run every step the driver broadcasts until it sends None."""
    try:
        r = _DPRank(args, rank, init_method, eplb)
        step = 0
        while (msg := ps.broadcast_object(None)) is not None:
            if args.step_hook is not None:
                args.step_hook(rank, step)
            r.step(*msg)
            step += 1
    except BaseException as e:  # noqa: BLE001 (reported to the driver, then this process ends)
        report_failure(rank, e, reports)
    finally:
        ps.destroy()


class _PlannedScheduler(Scheduler):
    """A Scheduler whose next `schedule()` returns the step `plan()` made (the driver plans every rank's
    step before the collective that runs them, and EngineCore.step schedules when it is called after)."""

    _planned: SchedulerOutput | None = None

    def plan(self) -> SchedulerOutput:
        self._planned = super().schedule()
        return self._planned

    def schedule(self) -> SchedulerOutput:
        so, self._planned = self._planned, None
        return so if so is not None else super().schedule()


class _GatheredOutput:
    """DP rank `d`'s runner as its EngineCore sees it: the step's output gathered from the ranks, or
    the engine's failure."""

    supports_placeholders = False

    def __init__(self, engine: DPEngine, d: int):
        self.engine, self.d = engine, d

    def execute(self, so: SchedulerOutput) -> ModelOutput:
        if self.engine._failure is not None:
            raise self.engine._failure
        return self.engine._outputs[self.d]


class DPEngine(TPEngine):
    """TPEngine's surface (add_request, step, has_unfinished, completion, abort, release, generate,
    close) over data_parallel_size ranks on this node (see the module docstring); this process is
    rank 0. `eplb`: rebalance the experts while serving (needs enable_expert_parallel)."""

    kind = "data-parallel"

    def __init__(self, args: EngineArgs, detokenizer=None, eplb: EPLBConfig | None = None):
        p = args.parallel
        if p.data_parallel_size < 2 or p.tensor_parallel_size != 1:
            raise ValueError(f"parallel: DPEngine needs data_parallel_size >= 2 and tensor_parallel_size=1, got "
                             f"{p.data_parallel_size} and {p.tensor_parallel_size}")
        if eplb is not None and not p.enable_expert_parallel:
            raise ValueError("eplb: load balancing moves routed experts between ranks; it needs "
                             "enable_expert_parallel=True")
        self.eplb, self._failure, self._outputs, self._steps = eplb, None, [], 0
        self.fixed_steps = 0  # steps run with the fixed-capacity exchange (decode on every rank)
        init_method = self._start_ranks(args, _dp_worker_main, eplb)
        try:
            self.rank = _DPRank(args, 0, init_method, eplb)
        except Exception as e:
            raise self._diagnose(e) from e
        r = self.rank.r
        self.model, self.rank_info = r.model, r.info
        self.cache, self.rank_weights = r.cache, r.weights  # for the start-up capacity log
        self.max_model_len = KVCacheManager(r.num_slots, r.num_blocks, args.block_size).max_model_len(
            args.max_model_len, self.model.config.max_position_embeddings, "every rank's smallest share")
        self.cores: list[EngineCore] = []
        for d in range(p.data_parallel_size):  # every rank's cache has the driver's size (the smallest)
            kv = KVCacheManager(r.num_slots, r.num_blocks, args.block_size)
            sched = _PlannedScheduler(kv, min(args.max_num_seqs, r.num_slots), args.max_num_batched_tokens,
                                      self.max_model_len)
            self.cores.append(EngineCore(sched, _GatheredOutput(self, d), detokenizer, async_scheduling=False))
        self.scheduler = self.cores[0].scheduler  # rank 0's (LLM reads its limits)
        self._owner: dict[str, int] = {}  # request id -> its DP rank, until completion / release
        self._ids = itertools.count()

    # EngineCore's surface
    def add_request(self, req: Request) -> None:
        """To the rank with the fewest unfinished requests (ties: the lowest rank); siblings go with it."""
        self._check_open()
        d = min(range(len(self.cores)), key=lambda i: (len(self.cores[i].requests), i))
        for r in [req] + req.siblings:
            self._owner[r.request_id] = d
        self.cores[d].add_request(req)

    def has_unfinished(self) -> bool:
        return any(c.has_unfinished() for c in self.cores)

    def step(self) -> list[Request]:
        """One step on every rank; raises TPWorkerError (and closes the engine) if any rank failed."""
        self._check_open()
        active = [d for d, c in enumerate(self.cores) if c.has_unfinished()]
        plans: list[SchedulerOutput | None] = [None] * len(self.cores)
        for d in active:
            so = self.cores[d].scheduler.plan()
            plans[d] = so if so.chunks else None  # no progress: EngineCore.step raises it below
        cap = self.args.max_num_seqs
        fixed = all(p is None or (len(p.chunks) <= cap and all(len(c.token_ids) == 1 for c in p.chunks))
                    for p in plans)
        self._steps += 1
        self.fixed_steps += fixed and any(p is not None for p in plans)
        rebalance = self.eplb is not None and self._steps % self.eplb.interval == 0
        try:
            self._watch.check()
            ps.broadcast_object((plans, fixed, rebalance))
            self._outputs = self.rank.step(plans, fixed, rebalance)
            self._watch.check()  # a rank that died mid-step: the gathered outputs may be incomplete
        except Exception as e:
            self._failure = self._diagnose(e)
        finished, errors = [], []
        for d in active:  # every rank's output is applied, even if one rank's update raises
            try:
                finished += self.cores[d].step()  # a failed step aborts its requests in it, with the error
            except Exception as e:  # noqa: BLE001 (raised below, once every core has its output)
                errors.append(e)
        if self._failure is not None:
            for c in self.cores:
                finished += c.abort(list(c.requests), str(self._failure))
            raise self._failure
        if errors:
            raise errors[0]
        return finished

    def completion(self, req: Request, index: int):
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
