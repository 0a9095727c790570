"""Expert-parallel load balancing (EPLB): where each MoE layer's experts live on the GPUs.

An expert-parallel MoE layer has `num_logical` experts (the checkpoint's) and `num_physical` expert
slots spread evenly over the GPUs, `num_physical >= num_logical`: the extra slots hold redundant
replicas of the most loaded experts. Given the measured load of every logical expert (tokens routed
to it over a recent window), a placement decides, per layer,

* how many replicas each logical expert gets: one each, then every extra slot goes to the expert
  with the largest load per replica at that point (its load is then split over one more replica);
* which GPU each replica lives on: balanced packing, heaviest replica first into the lightest GPU
  that still has a free slot, so every GPU holds the same number of slots.

Two policies, after DeepSeek's published EPLB:

* hierarchical (prefill; needs `num_groups % num_nodes == 0`): the experts are split into
  `num_groups` contiguous groups (expert e is in group e // (num_logical / num_groups)); whole groups
  are packed onto nodes so that nodes carry equal load, then replicas are made within each node and
  packed onto that node's GPUs. A token's experts of one group then never leave one node.
* global (decode): replicate over all experts at once and pack onto all GPUs, ignoring groups.

Physical slot p lives on GPU p // slots_per_gpu, at local index p % slots_per_gpu; node n holds GPUs
n * gpus_per_node .. (n + 1) * gpus_per_node - 1. Loads are any non-negative numbers; every
result is deterministic (ties go to the lowest index).

`ExpertLoad` records per-step counts over a moving window; `rebalance_plan` lists the slots whose
expert changes between two placements (the weights a runner must copy between steps);
`route_to_physical` maps a token's logical experts to one replica each (what MoE dispatch sends).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

POLICIES = ("auto", "hierarchical", "global")


def _check_load(load: torch.Tensor, name: str = "load") -> torch.Tensor:
    if not isinstance(load, torch.Tensor) or load.dim() != 2:
        raise ValueError(f"{name} must be a 2-d tensor [num_layers, num_logical_experts], "
                         f"got {getattr(load, 'shape', type(load).__name__)}")
    if load.shape[0] < 1 or load.shape[1] < 1:
        raise ValueError(f"{name} must have at least one layer and one expert, got shape {tuple(load.shape)}")
    load = load.detach().to("cpu", torch.float64)
    if not torch.isfinite(load).all() or (load < 0).any():
        raise ValueError(f"{name} must be finite and non-negative")
    return load


def balanced_packing(weights: torch.Tensor, num_bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack the items of each row of `weights` [rows, n] into `num_bins` bins of n / num_bins items
    each: items in decreasing weight, each into the lightest bin that is not yet full.
    -> (bin of each item [rows, n], index of the item within its bin [rows, n]), int64."""
    rows, n = weights.shape
    if num_bins < 1 or n % num_bins:
        raise ValueError(f"num_bins ({num_bins}) must divide the number of items ({n})")
    per_bin = n // num_bins
    order = torch.sort(weights, dim=1, descending=True, stable=True).indices
    bin_of = torch.empty(rows, n, dtype=torch.long)
    index_in = torch.empty(rows, n, dtype=torch.long)
    bin_load = torch.zeros(rows, num_bins, dtype=weights.dtype)
    bin_count = torch.zeros(rows, num_bins, dtype=torch.long)
    r = torch.arange(rows)
    for i in range(n):
        item = order[:, i]
        open_load = bin_load.masked_fill(bin_count >= per_bin, float("inf"))
        b = open_load.argmin(dim=1)
        bin_of[r, item] = b
        index_in[r, item] = bin_count[r, b]
        bin_load[r, b] += weights[r, item]
        bin_count[r, b] += 1
    return bin_of, index_in


def replicate(weights: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Give each of the n items of every row one slot, and each further slot (up to `num_slots`) to
    the item whose weight per replica is then the largest.
    -> (item of each slot [rows, num_slots], replica count of each item [rows, n]), int64.
    Slots 0..n-1 hold items 0..n-1; slot j >= n holds the j-th extra replica."""
    rows, n = weights.shape
    if num_slots < n:
        raise ValueError(f"num_slots ({num_slots}) must be at least the number of items ({n})")
    slot_item = torch.empty(rows, num_slots, dtype=torch.long)
    slot_item[:, :n] = torch.arange(n)
    counts = torch.ones(rows, n, dtype=torch.long)
    r = torch.arange(rows)
    for j in range(n, num_slots):
        pick = (weights / counts).argmax(dim=1)
        slot_item[:, j] = pick
        counts[r, pick] += 1
    return slot_item, counts


@dataclass(frozen=True)
class Placement:
    """Where every layer's experts live. Invariants: each logical expert has >= 1 replica; slot p is
    on GPU p // slots_per_gpu; logical_to_physical[l, e, :replica_counts[l, e]] are the slots holding
    e in increasing order, the rest -1."""

    physical_to_logical: torch.Tensor   # [num_layers, num_physical] int64
    logical_to_physical: torch.Tensor   # [num_layers, num_logical, max_replicas] int64, -1 padded
    replica_counts: torch.Tensor        # [num_layers, num_logical] int64
    num_gpus: int
    num_nodes: int = 1

    @property
    def num_layers(self) -> int:
        return self.physical_to_logical.shape[0]

    @property
    def num_physical(self) -> int:
        return self.physical_to_logical.shape[1]

    @property
    def num_logical(self) -> int:
        return self.replica_counts.shape[1]

    @property
    def slots_per_gpu(self) -> int:
        return self.num_physical // self.num_gpus

    def gpu_of_slot(self, slot: int) -> int:
        return slot // self.slots_per_gpu

    def node_of_gpu(self, gpu: int) -> int:
        return gpu // (self.num_gpus // self.num_nodes)

    def gpu_experts(self, layer: int, gpu: int) -> torch.Tensor:
        """The logical expert of each of `gpu`'s slots in `layer`, in local slot order."""
        s = self.slots_per_gpu
        return self.physical_to_logical[layer, gpu * s:(gpu + 1) * s]


def placement_from_physical(physical_to_logical: torch.Tensor, num_logical: int, num_gpus: int,
                            num_nodes: int = 1) -> Placement:
    """The Placement whose slot p holds expert physical_to_logical[l, p]; every expert must appear."""
    p2l = physical_to_logical.to(torch.long).cpu()
    if p2l.dim() != 2:
        raise ValueError(f"physical_to_logical must be [num_layers, num_physical], got {tuple(p2l.shape)}")
    layers, num_physical = p2l.shape
    if num_gpus < 1 or num_physical % num_gpus:
        raise ValueError(f"num_gpus ({num_gpus}) must divide the number of physical slots ({num_physical})")
    if num_nodes < 1 or num_gpus % num_nodes:
        raise ValueError(f"num_nodes ({num_nodes}) must divide num_gpus ({num_gpus})")
    if ((p2l < 0) | (p2l >= num_logical)).any():
        raise ValueError(f"physical_to_logical has expert ids outside [0, {num_logical})")
    counts = torch.zeros(layers, num_logical, dtype=torch.long).scatter_add_(1, p2l, torch.ones_like(p2l))
    if (counts == 0).any():
        layer, expert = (counts == 0).nonzero()[0].tolist()
        raise ValueError(f"physical_to_logical: layer {layer} has no slot for logical expert {expert}")
    # slots grouped by expert, in slot order within an expert: rank = position within the expert's run
    order = torch.argsort(p2l * num_physical + torch.arange(num_physical), dim=1)
    expert_sorted = p2l.gather(1, order)
    starts = torch.cumsum(counts, dim=1) - counts
    rank = torch.arange(num_physical) - starts.gather(1, expert_sorted)
    l2p = torch.full((layers, num_logical, int(counts.max())), -1, dtype=torch.long)
    l2p[torch.arange(layers)[:, None], expert_sorted, rank] = order
    return Placement(p2l, l2p, counts, num_gpus, num_nodes)


def contiguous_placement(num_layers: int, num_logical: int, num_gpus: int) -> Placement:
    """The placement without balancing: no replicas, experts g*E/G .. (g+1)*E/G - 1 on GPU g."""
    if num_gpus < 1 or num_logical % num_gpus:
        raise ValueError(f"num_gpus ({num_gpus}) must divide num_logical ({num_logical})")
    return placement_from_physical(torch.arange(num_logical).repeat(num_layers, 1), num_logical, num_gpus)


def rebalance_experts(load: torch.Tensor, num_physical: int, num_gpus: int, num_nodes: int = 1,
                      num_groups: int = 1, policy: str = "auto") -> Placement:
    """A placement of `num_physical` slots over `num_gpus` GPUs on `num_nodes` nodes from the measured
    per-expert `load` [num_layers, num_logical]. policy "hierarchical" packs `num_groups` expert
    groups onto nodes first; "global" ignores groups and nodes; "auto" takes hierarchical when
    num_groups % num_nodes == 0 and global otherwise."""
    load = _check_load(load)
    layers, num_logical = load.shape
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if num_gpus < 1 or num_physical % num_gpus:
        raise ValueError(f"num_gpus ({num_gpus}) must divide num_physical ({num_physical})")
    if num_physical < num_logical:
        raise ValueError(f"num_physical ({num_physical}) must be at least the number of logical experts "
                         f"({num_logical})")
    if num_nodes < 1 or num_gpus % num_nodes:
        raise ValueError(f"num_nodes ({num_nodes}) must divide num_gpus ({num_gpus})")
    if num_groups < 1 or num_logical % num_groups:
        raise ValueError(f"num_groups ({num_groups}) must divide the number of logical experts ({num_logical})")
    if policy == "auto":
        policy = "hierarchical" if num_groups % num_nodes == 0 else "global"
    if policy == "hierarchical":
        if num_groups % num_nodes:
            raise ValueError(f"hierarchical policy: num_nodes ({num_nodes}) must divide num_groups ({num_groups})")
        if num_physical % num_nodes:
            raise ValueError(f"hierarchical policy: num_nodes ({num_nodes}) must divide num_physical "
                             f"({num_physical})")
        return _hierarchical(load, num_physical, num_groups, num_nodes, num_gpus)
    return _hierarchical(load, num_physical, 1, 1, num_gpus, placed_nodes=num_nodes)


def _hierarchical(load: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int,
                  placed_nodes: int | None = None) -> Placement:
    layers, num_logical = load.shape
    group_size = num_logical // num_groups
    # 1. whole groups onto nodes, equal group counts, balanced load
    group_load = load.view(layers, num_groups, group_size).sum(-1)
    node_of_group, index_in_node = balanced_packing(group_load, num_nodes)
    groups_per_node = num_groups // num_nodes
    # node_experts[l, n, j]: the logical expert at node-local position j (its groups in packing order)
    node_group = torch.empty(layers, num_nodes, groups_per_node, dtype=torch.long)
    node_group[torch.arange(layers)[:, None], node_of_group, index_in_node] = torch.arange(num_groups)
    node_experts = (node_group[..., None] * group_size + torch.arange(group_size)).view(
        layers * num_nodes, groups_per_node * group_size)
    # 2. replicas within each node
    local_load = load.gather(1, node_experts.view(layers, -1)).view(layers * num_nodes, -1)
    slots_per_node = num_physical // num_nodes
    slot_local, counts = replicate(local_load, slots_per_node)
    # 3. the node's slots onto its GPUs, equal slot counts, balanced load per replica
    slot_load = (local_load / counts).gather(1, slot_local)
    gpus_per_node = num_gpus // num_nodes
    gpu_in_node, index_in_gpu = balanced_packing(slot_load, gpus_per_node)
    slots_per_gpu = num_physical // num_gpus
    position = gpu_in_node * slots_per_gpu + index_in_gpu             # within the node
    expert_at = torch.empty_like(slot_local)
    expert_at.scatter_(1, position, node_experts.gather(1, slot_local))
    p2l = expert_at.view(layers, num_physical)
    return placement_from_physical(p2l, num_logical, num_gpus, placed_nodes or num_nodes)


def gpu_loads(load: torch.Tensor, placement: Placement) -> torch.Tensor:
    """[num_layers, num_gpus]: each GPU's share of `load` when every expert's load is split evenly
    over its replicas."""
    load = _check_load(load)
    if load.shape != placement.replica_counts.shape:
        raise ValueError(f"load shape {tuple(load.shape)} does not match the placement's "
                         f"[num_layers, num_logical] {tuple(placement.replica_counts.shape)}")
    per_slot = (load / placement.replica_counts).gather(1, placement.physical_to_logical)
    return per_slot.view(placement.num_layers, placement.num_gpus, placement.slots_per_gpu).sum(-1)


def balancedness(load: torch.Tensor, placement: Placement) -> float:
    """Mean GPU load over max GPU load, averaged over layers (1.0 = perfectly even)."""
    g = gpu_loads(load, placement)
    return float((g.mean(1) / g.max(1).values.clamp_min(1e-30)).mean())


class ExpertLoad:
    """Tokens routed to each logical expert, per layer, over the last `window` steps.

    `record(layer, counts)` adds one layer's counts (a [num_logical] tensor, or top-k ids [T, k]
    through `count_experts`) to the current step; `next_step()` closes it. `mean()` is the average
    per-step load over the closed steps still in the window."""

    def __init__(self, num_layers: int, num_logical: int, window: int):
        if num_layers < 1 or num_logical < 1:
            raise ValueError(f"num_layers ({num_layers}) and num_logical ({num_logical}) must be positive")
        if window < 1:
            raise ValueError(f"window must be at least 1 step, got {window}")
        self.window = window
        # window closed steps plus the open one, as a ring
        self._steps = torch.zeros(window + 1, num_layers, num_logical, dtype=torch.float64)
        self._current = 0           # ring row of the open step
        self.closed = 0             # steps closed so far (all time)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self._steps.shape[1:])

    def record(self, layer: int, counts: torch.Tensor) -> None:
        num_layers, num_logical = self.shape
        if not 0 <= layer < num_layers:
            raise ValueError(f"layer {layer} out of range [0, {num_layers})")
        counts = torch.as_tensor(counts).detach().to("cpu", torch.float64)
        if counts.shape != (num_logical,):
            raise ValueError(f"counts must have shape ({num_logical},), got {tuple(counts.shape)}")
        self._steps[self._current, layer] += counts

    def next_step(self) -> None:
        self.closed += 1
        self._current = (self._current + 1) % (self.window + 1)
        self._steps[self._current] = 0

    def mean(self) -> torch.Tensor:
        """[num_layers, num_logical] mean load per step over the window; zeros before any step closed."""
        n = min(self.closed, self.window)
        if n == 0:
            return torch.zeros(self.shape, dtype=torch.float64)
        open_row = self._steps[self._current]
        return (self._steps.sum(0) - open_row) / n


def count_experts(topk_ids: torch.Tensor, num_logical: int) -> torch.Tensor:
    """Tokens routed to each expert by one layer's top-k ids [T, k] -> [num_logical] int64."""
    return torch.bincount(topk_ids.reshape(-1).to("cpu", torch.long), minlength=num_logical)[:num_logical]


@dataclass(frozen=True)
class SlotMove:
    """Slot `slot` (GPU `gpu`, local index `local_slot`) of `layer` must receive the weights of logical
    expert `expert` (it held `old_expert`). `sources` are the old placement's slots that already hold
    `expert` (empty only if the old placement did not have it, which a valid placement rules out)."""

    layer: int
    slot: int
    gpu: int
    local_slot: int
    expert: int
    old_expert: int
    sources: tuple[int, ...]


def rebalance_plan(old: Placement, new: Placement) -> list[SlotMove]:
    """The slots whose logical expert differs between `old` and `new`, layer by layer in slot order.
    Slots that keep their expert are not listed: their weights stay where they are."""
    if old.physical_to_logical.shape != new.physical_to_logical.shape or old.num_gpus != new.num_gpus \
            or old.num_logical != new.num_logical:
        raise ValueError(f"placements differ in shape: old {tuple(old.physical_to_logical.shape)} on "
                         f"{old.num_gpus} GPUs, new {tuple(new.physical_to_logical.shape)} on {new.num_gpus} GPUs")
    moves = []
    changed = (old.physical_to_logical != new.physical_to_logical).nonzero().tolist()
    for layer, slot in changed:
        e = int(new.physical_to_logical[layer, slot])
        src = old.logical_to_physical[layer, e, :int(old.replica_counts[layer, e])].tolist()
        moves.append(SlotMove(layer, slot, new.gpu_of_slot(slot), slot % new.slots_per_gpu, e,
                              int(old.physical_to_logical[layer, slot]), tuple(src)))
    return moves


def apply_moves(slots: torch.Tensor, moves: list[SlotMove], expert_weights: torch.Tensor) -> None:
    """Copy into `slots` [num_layers, num_physical, ...] (every slot's weights) the logical experts'
    weights `expert_weights` [num_layers, num_logical, ...] for each move, in place; other slots are
    not written."""
    for m in moves:
        slots[m.layer, m.slot].copy_(expert_weights[m.layer, m.expert])


def route_to_physical(topk_ids: torch.Tensor, placement: Placement, layer: int) -> torch.Tensor:
    """Each token's logical experts [T, k] -> one physical slot each [T, k]: token t's copy of
    expert e goes to replica t mod replica_counts[e]. Deterministic, and a hot expert's tokens are
    spread evenly over its replicas."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [num_tokens, k], got {tuple(topk_ids.shape)}")
    if not 0 <= layer < placement.num_layers:
        raise ValueError(f"layer {layer} out of range [0, {placement.num_layers})")
    dev = topk_ids.device
    ids = topk_ids.long()
    if ids.numel() and (ids.min() < 0 or ids.max() >= placement.num_logical):
        raise ValueError(f"topk_ids must be logical expert ids in [0, {placement.num_logical})")
    counts = placement.replica_counts[layer].to(dev)
    l2p = placement.logical_to_physical[layer].to(dev)
    token = torch.arange(ids.shape[0], device=dev)[:, None]
    replica = token % counts[ids]
    return l2p[ids, replica]
