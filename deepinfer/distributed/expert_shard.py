"""Expert parallelism's rank-side pieces: one rank's slots of the routed experts, their load, their moves.

With enable_expert_parallel (data-parallel ranks of one rank each; executor/worker.py) every rank holds the
whole attention / router / shared-expert weights and only its slots of each trunk MoE layer's routed
experts: it reads its range of experts from the checkpoint and nothing of the others' (load_expert_shard).
Each MoE's `expert_parallel` hook is an ExpertParallel over the data-parallel group, so a forward sends
each (token, expert) pair to the rank holding its slot.

EPLB (`EPLBConfig`): each rank counts the tokens routed to every logical expert of every MoE layer
(CountingExpertParallel into ExpertLoad, a moving window of steps). Every `interval` steps, after the
step, the ranks sum their windows, the driver computes a placement (eplb.rebalance_experts, global
policy) over `num_physical` = experts + redundant_per_rank * ranks slots and broadcasts it, and every rank
moves expert weights to the slots whose expert changed (move_slots: from a replica on its own rank when
there is one, else through one all_to_all_single per layer and weight tensor), then routes by the new
placement (ExpertParallel.set_placement). Requests in flight are untouched: the move happens between
steps, and every replica of an expert holds the same weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.distributed.eplb import Placement, SlotMove, contiguous_placement, placement_from_physical
from deepinfer.distributed.expert_parallel import ExpertParallel, all_to_all, shard_experts
from deepinfer.layers.linear import prepare_fp8_linears
from deepinfer.layers.moe import Experts, MoE
from deepinfer.distributed.tensor_parallel import META_MIN_NUMEL, _Cutter, _LargeOnMeta, _materialize
from deepinfer.loader.model_loader import engram_token_map, model_spec, open_weights
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
