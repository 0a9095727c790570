"""Expert parallelism for data-parallel attention: one MoE layer's dispatch / combine over an EP group.

Every rank of the EP group has its own tokens x_r [T_r, D] (its requests: attention is data
parallel) and the router's output for them (weights [T_r, k] fp32, logical expert ids [T_r, k]).
The layer's experts live in `num_physical` slots split evenly over the group: rank r holds slots
r*S .. (r+1)*S - 1 (S = slots per rank) as a local `Experts` module whose expert i is slot r*S + i.
Without a placement the slots are the logical experts (S = E / ep); with an EPLB placement
(distributed/eplb.py) slot p holds logical expert physical_to_logical[layer, p] and hot experts have
several replicas.

One forward:

1. route: each (token, j) pair's logical expert -> one physical slot. Token t of rank r takes
   replica (t + token_offset) mod replica_count, token_offset = r by default: eplb.route_to_physical's
   rule with the token index shifted per rank, so at decode (one token a rank) the ranks' copies of a
   hot expert land on different replicas (route_to_physical itself when token_offset = 0).
2. dispatch: each pair's activation row goes to the rank that holds its slot, with the slot's local
   index riding in the row's trailing columns (`pack_rows`): one all_to_all_single.
3. local compute: the received rows run through the local `Experts` module, one row per pair, with
   weight 1 (so its fp32 result is exactly the expert's output row, y.float(); sent back in x's dtype,
   which loses nothing: y was computed in it).
4. combine: the rows go back to where they came from; token t's output is
   sum_j y[t, j].float() * weights[t, j] accumulated in fp32 in slot order j = 0 .. k-1, then
   `shared` added, by kernels/moe_combine.py (the kernel the one-process GPU path ends with).

So the result equals the one-process `Experts(x_r, weights, ids)` up to the expert GEMMs' own
arithmetic: each row's expert output is the same function of the row; only the rows sharing a GEMM
differ. In batch-invariant mode (layers/invariant.py) the rows are computed bit for bit as in one
process and the result is identical for k <= 2; for k > 2 the one-process CPU loop adds a token's
products in expert order rather than slot order (fp32 rounding may then differ in the last bit).

Two exchange variants, chosen for a whole step by the caller (every rank must take the same one, or
the group's collectives do not match):

* `forward` (prefill, eager): split sizes exchanged first (one all_to_all of [ep] counts), read on
  the host, then variable-size all_to_all_single of the rows out and back: three collectives a layer.
  Sends only the real rows.
* `forward_fixed` (decode, CUDA-graph capturable): a fixed capacity of C = max_tokens * k rows per
  (source, destination) pair: a rank sends at most T*k <= C pairs to any one rank, so nothing can
  overflow. Each destination's block is filled on the device (positions from a cumulative count),
  padding rows carry local id S (the drop id), every all_to_all has equal splits and fixed shapes: no
  host sync, no size exchange (a receiver tells real rows from padding by their id): two collectives
  a layer. Costs ep*C rows
  of buffer and transfer per layer; padding rows sort past the local experts' last offset, where no
  expert GEMM reads them, and come back as zeros (`Experts` drops ids outside its held range, so the
  local module must have num_global = S + 1: `shard_experts` sets that).

Idle ranks (T_r = 0, a dummy batch) call the same collectives with empty inputs and get [0, D], so
no rank's collective waits for one that has no requests. Each MoE layer of each step must be called
on every rank of the group, in the same order.

Backends: torch.distributed's all_to_all_single on NCCL (GPUs) and gloo (CPUs): gloo in this torch
(2.13) implements it, uneven and empty splits included, so one exchange function serves both.
Without an initialised process group (or with a group of one) the exchange is a local copy.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from deepinfer.distributed.eplb import Placement, contiguous_placement
from deepinfer.kernels.moe_combine import moe_combine
from deepinfer.layers.moe import Experts, MoE


def group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) of this process in `group` (None: the default group); (0, 1) without one."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None,
               in_splits: list[int] | None, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Rows of `inp` split by `in_splits` (None: equal parts) go to ranks 0..ep-1; `out` receives
    each rank's part, by `out_splits`, in rank order. NCCL and gloo both run all_to_all_single;
    a group of one copies."""
    if group_rank_size(group)[1] == 1:
        return out.copy_(inp)
    dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
    return out


def exchange_counts(send_counts: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[ep] rows this rank sends to each rank -> [ep] rows it receives from each rank."""
    return all_to_all(torch.empty_like(send_counts), send_counts.contiguous(), None, None, group)


def pack_rows(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """rows [M, D] with each row's id (int32 bits) in trailing columns -> [M, D + c], c = 4 bytes in
    rows' elements (bf16: 2, fp32: 1): one collective carries both, bit for bit (collectives copy)."""
    M, D = rows.shape
    size = rows.element_size()
    if D * size % 4:
        raise ValueError(f"x: rows of {D} x {size} bytes cannot carry an aligned int32 id (need a multiple of 4)")
    buf = rows.new_empty(M, D + max(1, 4 // size))
    buf[:, :D] = rows
    buf[:, D:].view(torch.int32)[:, 0] = ids
    return buf


def unpack_rows(buf: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_rows' inverse: (rows [M, dim], a view of `buf`; ids [M] int64)."""
    return buf[:, :dim], buf[:, dim:].view(torch.int32)[:, 0].long()


def shard_experts(whole: Experts, placement: Placement | None, layer: int, rank: int, ep_size: int) -> Experts:
    """Rank `rank`'s local experts: the slots rank*S .. (rank+1)*S - 1 of `placement` (the contiguous
    one, slot = logical expert, when None), each a copy of its logical expert's weights (and scales)
    from `whole`, which holds logical experts first_expert .. first_expert + num_experts - 1 of
    num_global (all of them, or a range loaded alone that covers the rank's slots). num_global = S + 1:
    local id S is the drop id of `ExpertParallel.forward_fixed`'s padding rows."""
    placement = placement or contiguous_placement(1, whole.num_global, ep_size)
    if placement.num_logical != whole.num_global or placement.num_gpus != ep_size:
        raise ValueError(f"placement: {placement.num_logical} logical experts on {placement.num_gpus} ranks, "
                         f"expected {whole.num_global} on {ep_size}")
    if not 0 <= rank < ep_size:
        raise ValueError(f"rank: {rank} is outside [0, {ep_size})")
    experts = placement.gpu_experts(layer, rank).to(whole.w1.device) - whole.first_expert
    if experts.numel() and (experts.min() < 0 or experts.max() >= whole.num_experts):
        raise ValueError(f"whole: holds experts {whole.first_expert} .. {whole.first_expert + whole.num_experts - 1}; "
                         f"rank {rank}'s slots of layer {layer} need {placement.gpu_experts(layer, rank).tolist()}")
    S = experts.numel()
    dtype = whole.w1.dtype if not whole.quant.quantized else torch.bfloat16  # quantised storage ignores it
    with torch.device("meta"):
        local = Experts(whole.w2.shape[1], whole.w1.shape[1], S, whole.limit, dtype, whole.quant)
    for leaf in ("w1", "w2", "w3", "w1_scale", "w2_scale", "w3_scale"):
        t = getattr(whole, leaf, None)
        if t is None:
            continue
        value = t.data.index_select(0, experts)
        if leaf in local._parameters:
            local._parameters[leaf] = nn.Parameter(value, requires_grad=False)
        else:
            local._buffers[leaf] = value
    local.first_expert, local.num_global = 0, S + 1
    return local


class ExpertParallel:
    """One MoE layer's expert-parallel forward on this rank (see the module docstring).

    experts: this rank's slots as an `Experts` module (`shard_experts`); num_logical: the router's
    expert count; placement / layer: the EPLB placement and the layer's row in it (None: contiguous,
    no replicas); group: the EP group (None: the default group, every rank); max_tokens: the most
    tokens a rank passes to `forward_fixed` (its capacity; same on every rank); token_offset: the
    replica choice's token shift (None: this rank's index in the group)."""

    def __init__(self, experts: Experts, num_logical: int, placement: Placement | None = None, layer: int = 0,
                 group: dist.ProcessGroup | None = None, max_tokens: int | None = None,
                 token_offset: int | None = None):
        self.group = group
        self.rank, self.size = group_rank_size(group)
        if placement is None:
            placement, layer = contiguous_placement(1, num_logical, self.size), 0
        if placement.num_logical != num_logical or placement.num_gpus != self.size:
            raise ValueError(f"placement: {placement.num_logical} logical experts on {placement.num_gpus} ranks, "
                             f"expected {num_logical} on the EP group's {self.size}")
        S = placement.slots_per_gpu
        if experts.num_experts != S or experts.first_expert != 0 or experts.num_global not in (S, S + 1):
            raise ValueError(f"experts: expected this rank's {S} slots as experts 0..{S - 1} of {S} or {S + 1} "
                             f"(shard_experts), got {experts.num_experts} from {experts.first_expert} of "
                             f"{experts.num_global}")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens: expected >= 1, got {max_tokens}")
        self.experts, self.num_logical, self.slots_per_rank, self.max_tokens = experts, num_logical, S, max_tokens
        self.token_offset = self.rank if token_offset is None else token_offset
        self.fixed_capacity = False  # which exchange __call__ takes
        device = experts.w1.device
        # device tables, so routing needs no host transfer inside a captured graph; logical_to_physical
        # is as wide as any placement of these slots can need, so set_placement always fits in place
        P = placement.num_physical
        self.logical_to_physical = torch.full((num_logical, P - num_logical + 1), -1, dtype=torch.long, device=device)
        self.replica_counts = torch.empty(num_logical, dtype=torch.long, device=device)
        self.set_placement(placement, layer)

    def set_placement(self, placement: Placement, layer: int) -> None:
        """Route by `placement` (layer `layer`) from now on: the routing tables are overwritten in
        place, so CUDA graphs captured before still read them. Same slot count per rank; the local
        experts' weights must be moved to the new slots by the caller (eplb.rebalance_plan)."""
        if placement.num_logical != self.num_logical or placement.num_gpus != self.size or \
                placement.slots_per_gpu != self.slots_per_rank:
            raise ValueError(f"placement: {placement.num_logical} logical experts in {placement.slots_per_gpu} slots "
                             f"on each of {placement.num_gpus} ranks, expected {self.num_logical} in "
                             f"{self.slots_per_rank} on {self.size}")
        if not 0 <= layer < placement.num_layers:
            raise ValueError(f"layer: {layer} is outside the placement's {placement.num_layers} layers")
        l2p = placement.logical_to_physical[layer]
        self.logical_to_physical.fill_(-1)[:, :l2p.shape[1]].copy_(l2p)
        self.replica_counts.copy_(placement.replica_counts[layer])

    # routing
    def route(self, ids: torch.Tensor) -> torch.Tensor:
        """Logical expert ids [T, k] -> physical slots [T, k]: token t takes replica
        (t + token_offset) mod replica_count of its expert."""
        token = torch.arange(ids.shape[0], device=ids.device) + self.token_offset
        ids = ids.long()
        return self.logical_to_physical[ids, token[:, None] % self.replica_counts[ids]]

    def _pairs(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Checks the inputs; -> (destination rank, local slot) of each pair, [T*k] each, token-major."""
        if ids.dim() != 2 or x.dim() != 2 or x.shape[0] != ids.shape[0] or weights.shape != ids.shape:
            raise ValueError(f"x [T, D], weights [T, k], ids [T, k]: got x {tuple(x.shape)}, weights "
                             f"{tuple(weights.shape)}, ids {tuple(ids.shape)}")
        slots = self.route(ids).flatten()
        dest = torch.div(slots, self.slots_per_rank, rounding_mode="floor")
        return dest, slots - dest * self.slots_per_rank

    def received_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[ep] int64: the rows each rank of the group receives for this step's `ids` [T, k] on every
        rank (a collective: every rank calls it, with its own ids, possibly empty)."""
        dest = torch.div(self.route(ids).flatten(), self.slots_per_rank, rounding_mode="floor")
        counts = torch.bincount(dest, minlength=self.size)
        if self.size > 1:
            dist.all_reduce(counts, group=self.group)
        return counts

    # local compute and combine
    def _compute(self, rows: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Each received row through its local expert (weight 1) -> [N, D] in the rows' dtype. Rows with
        local id S (padding) come back as zeros."""
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
        return self.experts(rows, ones, local[:, None]).to(rows.dtype)

    @staticmethod
    def _combine(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None,
                 dtype: torch.dtype) -> torch.Tensor:
        """y [T*k, D]: the pairs' expert outputs, row r holding pair order[r] (pair t*k + j) ->
        sum_j y.float() * weights[t, j] in fp32 in slot order j (kernels/moe_combine.py: one fused
        launch on CUDA), fp32; with `shared`, (sum + float(shared)).to(dtype), as Experts.forward."""
        T, k = weights.shape
        out_dtype = torch.float32 if shared is None else dtype
        if T == 0:  # no launch for an empty grid
            return y.new_empty(0, y.shape[1], dtype=out_dtype)
        return moe_combine(y, order, weights, k, None, shared, out_dtype)

    # the two exchanges
    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                shared: torch.Tensor | None = None) -> torch.Tensor:
        """Variable-size dispatch / combine (eager; reads the split sizes on the host). x [T, D]
        (T may be 0), weights [T, k] fp32, ids [T, k] logical -> [T, D] fp32, or x's dtype with
        `shared` (as Experts.forward)."""
        dest, local = self._pairs(x, weights, ids)
        T, k = ids.shape
        order = torch.argsort(dest, stable=True)  # pairs grouped by destination, token-major inside
        send_counts = torch.bincount(dest, minlength=self.size)
        recv_counts = exchange_counts(send_counts, self.group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        n = sum(recv_splits)
        send = pack_rows(x[torch.div(order, k, rounding_mode="floor")], local[order])
        recv = all_to_all(send.new_empty(n, send.shape[1]), send, recv_splits, send_splits, self.group)
        y = self._compute(*unpack_rows(recv, x.shape[1])) if n else x.new_empty(0, x.shape[1])
        back = all_to_all(x.new_empty(T * k, x.shape[1]), y, send_splits, recv_splits, self.group)
        return self._combine(back, order, weights, shared, x.dtype)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 shared: torch.Tensor | None = None) -> torch.Tensor:
        """Experts.forward's signature: `forward_fixed` while `fixed_capacity` is set (a step-wide
        choice the runner makes on every rank alike, e.g. for captured decode steps), else `forward`."""
        return (self.forward_fixed if self.fixed_capacity else self.forward)(x, weights, ids, shared)

    def forward_fixed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      shared: torch.Tensor | None = None) -> torch.Tensor:
        """Fixed-capacity dispatch / combine: no host sync, fixed shapes (capturable in a CUDA graph
        for a fixed T). Same inputs and result as `forward`; T <= max_tokens."""
        if self.max_tokens is None:
            raise ValueError("max_tokens: forward_fixed needs the capacity set at construction")
        if self.experts.num_global != self.slots_per_rank + 1:
            raise ValueError(f"experts: forward_fixed needs num_global = {self.slots_per_rank + 1} (local id "
                             f"{self.slots_per_rank} drops padding rows; shard_experts sets it), got "
                             f"{self.experts.num_global}")
        dest, local = self._pairs(x, weights, ids)
        T, k = ids.shape
        if T > self.max_tokens:
            raise ValueError(f"x: {T} tokens exceed max_tokens={self.max_tokens} of forward_fixed")
        cap = self.max_tokens * k  # >= the T*k pairs a rank can send to any one rank
        # row of each pair in the send buffer: its destination's block, then its rank among that
        # destination's pairs (token-major); (dest == r) rather than one_hot, which may check its input
        # on the host
        ranks = torch.arange(self.size, device=dest.device)
        pos = ((dest[:, None] == ranks).long().cumsum(0) - 1).gather(1, dest[:, None]).squeeze(1)
        row = dest * cap + pos
        tok = torch.div(torch.arange(T * k, device=x.device), k, rounding_mode="floor")
        padding = local.new_full((self.size * cap,), self.slots_per_rank)
        send = pack_rows(x.new_zeros(self.size * cap, x.shape[1]), padding)
        send.index_copy_(0, row, pack_rows(x[tok], local))
        recv = all_to_all(torch.empty_like(send), send, None, None, self.group)
        y = self._compute(*unpack_rows(recv, x.shape[1]))
        back = all_to_all(torch.empty_like(y), y, None, None, self.group)
        return self._combine(back[row], torch.arange(T * k, device=x.device), weights, shared, x.dtype)


def moe_forward(moe: MoE, ep: ExpertParallel, x: torch.Tensor, input_ids: torch.Tensor,
                image_mask: torch.Tensor | None = None) -> torch.Tensor:
    """MoE.forward with the routed experts expert-parallel: the router and the shared expert run on
    this rank's tokens (replicated weights), `ep` in place of moe.experts. T may be 0."""
    weights, idx = moe.gate(x, input_ids, image_mask)
    return ep(x, weights, idx, moe.shared_experts(x))
