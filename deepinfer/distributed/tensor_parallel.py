"""Tensor parallelism for DeepSeek-V4 and V4.1: a loaded model sliced to one rank's shard.

With `tp` ranks, rank r keeps:

* attention: query heads [r*H/tp, (r+1)*H/tp): their rows of `wq_b` and their `attn_sink`
  entries; the grouped output projection of those heads: `wo_a`'s rows of the rank's groups
  (o_groups >= tp: o_groups/tp whole groups; o_groups < tp: one group, and `wo_a`'s input
  columns of the rank's heads inside it), `wo_b`'s input columns of those rows (row parallel);
* MoE: routed experts [r*E/tp, (r+1)*E/tp) (the router still picks among all E; pairs routed to
  another rank's expert add exactly 0 here), and the shared expert's intermediate columns
  (`w1` / `w3` rows, `w2` columns);
* everything else whole: embeddings, head, norms, hyper-connections, router, `wq_a`, the single KV
  head (`wkv`, `kv_norm`), compressors and the lightning indexer (so the cache is whole on every rank);
  V4.1's Engram tables and vision tower. Draft layers (MTP, DSpark stages) are sharded like the trunk.

wo_b(wo_a(.)) and the MoE sum are linear in what a rank holds, so each rank's wo_b and MoE output
is a partial sum of the one-process value; a forward hook all-reduces it over the TP group
(`parallel_state.tp_all_reduce`), after which every rank holds the same residual. Works on dense
weights and on checkpoint formats kept as shipped (FP8 blocks: slice bounds must fall on blocks).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from deepinfer.distributed.parallel_state import tp_all_reduce
from deepinfer.layers.linear import Linear
from deepinfer.layers.moe import MoE
from deepinfer.models.block_v41 import Attention41
from deepinfer.models.deepseek_v4 import Attention, DeepseekV4ForCausalLM
from deepinfer.models.deepseek_v41 import DeepseekV41ForCausalLM


@dataclass
class TPShard:
    """What shard_model did: the rank, the size, and the modules whose output is all-reduced."""

    rank: int
    size: int
    reduced: list[str] = field(default_factory=list)
    hooks: list = field(default_factory=list, repr=False)


def shard_model(model: nn.Module, tp_rank: int, tp_size: int) -> TPShard:
    """Slice `model` (loaded whole) in place to rank `tp_rank` of `tp_size`; returns what was done,
    also kept as `model.tensor_parallel`. tp_size 1 leaves the model as it is."""
    if not isinstance(model, (DeepseekV4ForCausalLM, DeepseekV41ForCausalLM)):
        raise ValueError(f"tensor_parallel_size: tensor parallelism supports DeepSeek-V4 and V4.1 models, "
                         f"not {type(model).__name__}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank: {tp_rank} is outside [0, {tp_size})")
    shard = TPShard(tp_rank, tp_size)
    if tp_size > 1:
        for name, mod in model.named_modules():
            if isinstance(mod, (Attention, Attention41)):
                shard_attention(name, mod, tp_rank, tp_size)
                # on wo_b, not the attention module: V4.1's DSpark stages call its projections directly
                name, mod = f"{name}.wo_b", mod.wo_b
            elif isinstance(mod, MoE):
                shard_moe(name, mod, tp_rank, tp_size)
            else:
                continue
            shard.reduced.append(name)
            shard.hooks.append(mod.register_forward_hook(_reduce_output))
    model.tensor_parallel = shard
    return shard


def _reduce_output(module: nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
    return tp_all_reduce(output)


def _split(total: int, tp: int, what: str, where: str) -> int:
    if total % tp:
        raise ValueError(f"tensor_parallel_size: {tp} does not divide {what} ({total}) of {where}")
    return total // tp


def shard_attention(name: str, attn: Attention | Attention41, r: int, tp: int) -> None:
    H, G, D, rank = attn.n_heads, attn.o_groups, attn.head_dim, attn.o_rank
    h = _split(H, tp, "num_attention_heads", name)
    if G % tp and tp % G:
        raise ValueError(f"tensor_parallel_size: {tp} and o_groups ({G}) of {name} must divide one another")
    group_in = H * D // G
    if G >= tp:  # whole groups per rank
        g0, g1, cols = r * G // tp, (r + 1) * G // tp, (0, group_in)
    else:  # tp / G ranks share one group, each with its heads' input columns
        per = tp // G
        width = group_in // per
        g0 = r // per
        g1, cols = g0 + 1, ((r % per) * width, (r % per + 1) * width)
    slice_linear(attn.wq_b, 0, r * h * D, (r + 1) * h * D)
    _replace(attn, "attn_sink", attn.attn_sink.data[r * h:(r + 1) * h])
    slice_linear(attn.wo_a, 0, g0 * rank, g1 * rank)
    slice_linear(attn.wo_a, 1, *cols)
    slice_linear(attn.wo_b, 1, g0 * rank, g1 * rank)
    attn.n_heads, attn.o_groups = h, g1 - g0


def shard_moe(name: str, moe: MoE, r: int, tp: int) -> None:
    ex = moe.experts
    n = _split(ex.num_experts, tp, "routed experts", name)
    for leaf in ("w1", "w2", "w3", "w1_scale", "w2_scale", "w3_scale"):
        t = getattr(ex, leaf, None)
        if t is not None:
            _replace(ex, leaf, t.data[r * n:(r + 1) * n])
    ex.first_expert, ex.num_experts = r * n, n
    mlp = moe.shared_experts
    i = _split(mlp.w1.out_features, tp, "the shared expert's intermediate size", name)
    slice_linear(mlp.w1, 0, r * i, (r + 1) * i)
    slice_linear(mlp.w3, 0, r * i, (r + 1) * i)
    slice_linear(mlp.w2, 1, r * i, (r + 1) * i)


def slice_linear(lin: Linear, dim: int, start: int, stop: int) -> None:
    """Keep rows (dim 0: outputs) or columns (dim 1: inputs) [start, stop) of `lin`'s weight, and
    of its FP8 block scale, whose blocks the bounds must not cut."""
    full = lin.weight.shape[dim]
    if lin.block_size is not None:
        b = lin.block_size[dim]
        if start % b or (stop % b and stop != full):
            raise ValueError(f"tensor_parallel_size: the slice [{start}, {stop}) of a {tuple(lin.weight.shape)} "
                             f"FP8 weight cuts its {tuple(lin.block_size)} scale blocks")
        _replace(lin, "scale", lin.scale.data.narrow(dim, start // b, -(-stop // b) - start // b))
    _replace(lin, "weight", lin.weight.data.narrow(dim, start, stop - start))
    if dim == 0:
        lin.out_features = stop - start
    else:
        lin.in_features = stop - start


def _replace(module: nn.Module, leaf: str, value: torch.Tensor) -> None:
    """Swap a parameter or buffer for a compact copy of `value` (the whole tensor is freed)."""
    value = value.clone(memory_format=torch.contiguous_format)
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value
