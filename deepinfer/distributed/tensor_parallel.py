"""Tensor parallelism: a loaded model sliced to one rank's shard, as the model's declared plan says
(models/interface.py: CausalLM.tp_plan, a TPSplit per module path). For DeepSeek-V4 and V4.1, with
`tp` ranks rank r keeps:

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
(the plan's TPSplit.reduce) is a partial sum of the one-process value; a forward hook all-reduces it
over the TP group (`parallel_state.tp_all_reduce`), after which every rank holds the same residual. Works on dense
weights and on checkpoint formats kept as shipped (FP8 blocks: slice bounds must fall on blocks).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

from deepinfer.distributed.parallel_state import tp_all_reduce
from deepinfer.layers.linear import prepare_fp8_linears
from deepinfer.loader.model_loader import engram_token_map, model_spec, open_weights
from deepinfer.loader.resolve import resolve_model_dir
from deepinfer.loader.weights import Part, Slice, load_weights
from deepinfer.layers.moe import MoE
from deepinfer.models.interface import EXPERT_SPLIT, HEAD_SPLIT, CausalLM, HeadSplitAttention


@dataclass
class TPShard:
    """What shard_model did: the rank, the size, the modules whose output is all-reduced, and the
    part of its checkpoint tensor each sliced state_dict entry holds (for load_weights' `shard`)."""

    rank: int
    size: int
    reduced: list[str] = field(default_factory=list)
    parts: dict[str, Part] = field(default_factory=dict)
    hooks: list = field(default_factory=list, repr=False)


def shard_model(model: nn.Module, tp_rank: int, tp_size: int) -> TPShard:
    """Slice `model` in place to rank `tp_rank` of `tp_size`; returns what was done, also kept as
    `model.tensor_parallel`. The model may hold its weights (they are sliced) or not yet (built on
    the meta device: then load_weights(..., shard=result.parts) reads only this rank's part).
    tp_size 1 leaves the model as it is."""
    plan = model.tp_plan() if isinstance(model, CausalLM) else {}
    if not plan:
        raise ValueError(f"tensor_parallel_size: {type(model).__name__} declares no tensor-parallel plan "
                         "(models/interface.py CausalLM.tp_plan)")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank: {tp_rank} is outside [0, {tp_size})")
    shard = TPShard(tp_rank, tp_size)
    if tp_size > 1:
        for name, split in plan.items():
            mod = model.get_submodule(name)
            if split.style == HEAD_SPLIT:
                shard_attention(mod, tp_rank, tp_size, name, shard.parts)
            elif split.style == EXPERT_SPLIT:
                shard_moe(mod, tp_rank, tp_size, name, shard.parts)
            else:
                raise ValueError(f"{type(model).__name__}.tp_plan: {name} has split style {split.style!r}, "
                                 f"not {HEAD_SPLIT!r} or {EXPERT_SPLIT!r}")
            shard.reduced.append(split.reduce)
            shard.hooks.append(model.get_submodule(split.reduce).register_forward_hook(_reduce_output))
    model.tensor_parallel = shard
    return shard


def _reduce_output(module: nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
    return tp_all_reduce(output)


def _split(total: int, tp: int, what: str, where: str) -> int:
    if total % tp:
        raise ValueError(f"tensor_parallel_size: {tp} does not divide {what} ({total}) of {where}")
    return total // tp


class _Cutter:
    """Slices the tensors of the module named `prefix` and records each one's part by state_dict key."""

    def __init__(self, prefix: str, parts: dict[str, Part]):
        self.prefix, self.parts = prefix, parts

    def tensor(self, module: nn.Module, path: str, dim: int, start: int, stop: int) -> None:
        """Keep [start, stop) along `dim` of the tensor at `path` (dotted, below this module)."""
        owner, _, leaf = path.rpartition(".")
        mod = module.get_submodule(owner) if owner else module
        t = getattr(mod, leaf)
        key = f"{self.prefix}.{path}" if self.prefix else path
        self.parts[key] = self.parts.get(key, ()) + (Slice(dim, start, stop, t.shape[dim]),)
        value = t.data.narrow(dim, start, stop - start).clone(memory_format=torch.contiguous_format)
        if leaf in mod._parameters:  # a compact copy: the whole tensor is freed
            mod._parameters[leaf] = nn.Parameter(value, requires_grad=False)
        else:
            mod._buffers[leaf] = value

    def linear(self, module: nn.Module, path: str, dim: int, start: int, stop: int) -> None:
        """Keep rows (dim 0: outputs) or columns (dim 1: inputs) [start, stop) of the Linear at
        `path`, and of its FP8 block scale, whose blocks the bounds must not cut."""
        lin = module.get_submodule(path)
        full = lin.weight.shape[dim]
        if lin.block_size is not None:
            b = lin.block_size[dim]
            if start % b or (stop % b and stop != full):
                raise ValueError(f"tensor_parallel_size: the slice [{start}, {stop}) of {self.prefix}.{path} "
                                 f"{tuple(lin.weight.shape)} cuts its FP8 {tuple(lin.block_size)} scale blocks")
            self.tensor(module, f"{path}.scale", dim, start // b, -(-stop // b))
        self.tensor(module, f"{path}.weight", dim, start, stop)
        if dim == 0:
            lin.out_features = stop - start
        else:
            lin.in_features = stop - start


def shard_attention(attn: HeadSplitAttention, r: int, tp: int, prefix: str = "",
                    parts: dict[str, Part] | None = None) -> None:
    """Keep rank r's query heads and their output projection; `parts` gets the state_dict keys
    (under `prefix`) that hold a part of their checkpoint tensor."""
    cut = _Cutter(prefix, {} if parts is None else parts)
    H, G, D, rank = attn.n_heads, attn.o_groups, attn.head_dim, attn.o_rank
    h = _split(H, tp, "num_attention_heads", cut.prefix)
    if G % tp and tp % G:
        raise ValueError(f"tensor_parallel_size: {tp} and o_groups ({G}) of {cut.prefix} must divide one another")
    group_in = H * D // G
    if G >= tp:  # whole groups per rank
        g0, g1, cols = r * G // tp, (r + 1) * G // tp, None
    else:  # tp / G ranks share one group, each with its heads' input columns
        per = tp // G
        width = group_in // per
        g0 = r // per
        g1, cols = g0 + 1, ((r % per) * width, (r % per + 1) * width)
    cut.linear(attn, "wq_b", 0, r * h * D, (r + 1) * h * D)
    cut.tensor(attn, "attn_sink", 0, r * h, (r + 1) * h)
    cut.linear(attn, "wo_a", 0, g0 * rank, g1 * rank)
    if cols is not None:
        cut.linear(attn, "wo_a", 1, *cols)
    cut.linear(attn, "wo_b", 1, g0 * rank, g1 * rank)
    attn.n_heads, attn.o_groups = h, g1 - g0


def shard_moe(moe: MoE, r: int, tp: int, prefix: str = "", parts: dict[str, Part] | None = None) -> None:
    """Keep rank r's routed experts and shared-expert columns (`parts` as in shard_attention)."""
    cut = _Cutter(prefix, {} if parts is None else parts)
    ex = moe.experts
    n = _split(ex.num_experts, tp, "routed experts", cut.prefix)
    for leaf in ("w1", "w2", "w3", "w1_scale", "w2_scale", "w3_scale"):
        if getattr(ex, leaf, None) is not None:
            cut.tensor(moe, f"experts.{leaf}", 0, r * n, (r + 1) * n)
    ex.first_expert, ex.num_experts = r * n, n
    i = _split(moe.shared_experts.w1.out_features, tp, "the shared expert's intermediate size", cut.prefix)
    cut.linear(moe, "shared_experts.w1", 0, r * i, (r + 1) * i)
    cut.linear(moe, "shared_experts.w3", 0, r * i, (r + 1) * i)
    cut.linear(moe, "shared_experts.w2", 1, r * i, (r + 1) * i)


# tensors of at least this many elements are built on the meta device by load_shard (smaller ones for
# real: an __init__ may compute them, such as RoPE frequencies, and they cost nothing whole)
META_MIN_NUMEL = 1 << 16


class _LargeOnMeta(TorchFunctionMode):
    """Factory calls (torch.empty, zeros, ...) without a device make tensors of at least `min_numel`
    elements on the meta device and smaller ones on `device`."""

    def __init__(self, device: torch.device, min_numel: int):
        super().__init__()
        self.device, self.min_numel = device, min_numel

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _device_constructors() and kwargs.get("device") is None:
            probe = func(*args, **{**kwargs, "device": "meta"})
            if isinstance(probe, torch.Tensor) and probe.numel() >= self.min_numel:
                return probe
            kwargs["device"] = self.device
        return func(*args, **kwargs)


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Storage on `device` for every meta parameter and buffer (filled by load_weights next)."""
    for name, mod in model.named_modules():
        for leaf, t in list(mod._parameters.items()):
            if t is not None and t.is_meta:
                mod._parameters[leaf] = nn.Parameter(torch.empty_like(t, device=device), requires_grad=False)
        for leaf, t in list(mod._buffers.items()):
            if t is not None and t.is_meta:
                if leaf in mod._non_persistent_buffers_set:  # computed, never loaded: it would stay garbage
                    raise RuntimeError(f"{name}.{leaf}: a computed buffer of {t.numel()} elements was built on "
                                       f"the meta device; raise META_MIN_NUMEL above it")
                mod._buffers[leaf] = torch.empty_like(t, device=device)


def load_shard(model_dir: str | Path, tp_rank: int, tp_size: int, *, dtype: torch.dtype, device: str,
               quantized: bool = False, min_numel: int | None = None, load_format: str = "auto",
               seed: int = 0) -> nn.Module:
    """load_model for one TP rank: the model is built with its large tensors on the meta device,
    sliced by shard_model, given storage for its shard only, and filled with its part of each
    checkpoint tensor: device memory holds the shard, never the whole model. (Engram tables, which
    load_model can leave on the host, are loaded onto `device` whole.)"""
    path = resolve_model_dir(str(model_dir))
    reader = open_weights(path, load_format, seed)
    cfg, model_cls, _, _ = model_spec(path, reader, None)
    device = torch.device(device)
    with _LargeOnMeta(device, META_MIN_NUMEL if min_numel is None else min_numel):
        net = model_cls(cfg, dtype=dtype, quantized=quantized)
    shard = shard_model(net, tp_rank, tp_size)
    _materialize(net, device)
    load_weights(net, reader, config=cfg, shard=shard.parts)
    if net.needs_engram_vocab:
        net.set_engram_vocab(engram_token_map(path))
    prepare_fp8_linears(net)  # as load_model leaves a model (the shard's scales)
    return net.eval()
