"""Process groups for one deepinfer engine spread over several processes (torch.distributed).

Rank layout: rank = dp_rank * tensor_parallel_size + tp_rank, so a tensor-parallel group is a run
of consecutive ranks (on one node: neighbouring GPUs). Backends: "nccl" on CUDA, "gloo" on the CPU;
on CUDA a second, gloo group over the same ranks carries Python objects (the driver's step plans).

The model code calls `tp_all_reduce` / `tp_all_gather` only; both are the identity while no group
is set up or the tensor-parallel size is 1, so one process runs exactly as without this module.
Module state is per process: one engine (one default process group) per process at a time.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# joining the process group and building the groups wait this long at least for every rank to arrive
START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ParallelConfig:
    """vLLM's parallel sizes. world size = tensor_parallel_size * data_parallel_size *
    context_parallel_size; experts are spread over the whole world when enable_expert_parallel."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    context_parallel_size: int = 1

    def __post_init__(self):
        for name in ("tensor_parallel_size", "data_parallel_size", "context_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {v!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel: expected a bool, got {self.enable_expert_parallel!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size * self.context_parallel_size


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits: global rank, and its index inside its TP and DP groups."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    device: torch.device

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


@dataclass
class _State:
    info: RankInfo
    tp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    cpu_group: dist.ProcessGroup  # gloo, all ranks: Python objects


_STATE: _State | None = None


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_method_from_env() -> str | None:
    """"env://" when MASTER_ADDR and MASTER_PORT are set (torchrun, multi-node), else None."""
    return "env://" if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT") else None


def init_parallel(parallel: ParallelConfig, rank: int, device: torch.device | str, init_method: str,
                  timeout_s: float = 600.0, backend: str | None = None) -> RankInfo:
    """Join the default process group (`init_method`: "env://", "tcp://host:port" or "file://path"),
    then build the TP and DP groups. Every collective of these groups raises after `timeout_s`
    seconds without its peers (gloo; NCCL with TORCH_NCCL_BLOCKING_WAIT or async error handling) once
    set_collective_timeout() is called; until then at least START_TIMEOUT_S: ranks still starting (importing
    torch, loading their shards: seconds apart on a loaded host) are no peer being stuck.
    `backend` overrides backend_for(device): "gloo" on CUDA lets several ranks share one GPU (NCCL
    refuses two ranks on a device), for testing the GPU path with fewer GPUs than ranks.
    Context parallelism (context_parallel_size > 1) runs alone (tensor and data parallel sizes 1):
    its group is the whole world."""
    global _STATE
    check_free()
    cp = parallel.context_parallel_size
    if cp != 1 and (parallel.tensor_parallel_size != 1 or parallel.data_parallel_size != 1):
        raise ValueError("context_parallel_size: runs alone so far (tensor_parallel_size and data_parallel_size 1)")
    world = parallel.world_size
    if not 0 <= rank < world:
        raise ValueError(f"rank: {rank} is outside the world of {world} ranks")
    device = torch.device(device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    start = timedelta(seconds=max(timeout_s, START_TIMEOUT_S))
    backend = backend or backend_for(device)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend: expected 'gloo' or 'nccl', got {backend!r}")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=start)
    cpu_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=start)
    tp, dp = parallel.tensor_parallel_size, parallel.data_parallel_size
    tp_group = dp_group = None
    if cp != 1:  # every rank one CP rank of the one group
        _STATE = _State(RankInfo(rank, world, 0, 1, 0, 1, device), None, None, cpu_group)
        return _STATE.info
    # every rank creates every group, in the same order (torch.distributed's rule for new_group)
    for d in range(dp):
        ranks = list(range(d * tp, (d + 1) * tp))
        g = dist.new_group(ranks, timeout=start) if tp < world else dist.group.WORLD
        if rank in ranks:
            tp_group = g
    for t in range(tp):
        ranks = list(range(t, world, tp))
        g = dist.new_group(ranks, timeout=start) if dp < world else dist.group.WORLD
        if rank in ranks:
            dp_group = g
    info = RankInfo(rank, world, rank % tp, tp, rank // tp, dp, device)
    _STATE = _State(info, tp_group, dp_group, cpu_group)
    return info


def check_free() -> None:
    """Raises unless this process is free to join a new engine's groups (it holds no rank of an open one)."""
    if _STATE is not None:
        raise RuntimeError(f"this process already holds rank {_STATE.info.rank} of a parallel engine that is still "
                           "open (an LLM with tensor_parallel_size, data_parallel_size or context_parallel_size > 1); "
                           "close it first with LLM.close(), or build it as `with LLM(...) as llm:` (a TPEngine or "
                           "DPEngine: its close())")


def set_collective_timeout(timeout_s: float) -> None:
    """From here on every collective of this rank's groups raises after timeout_s (the end of start-up)."""
    if _STATE is None:
        raise RuntimeError("set_collective_timeout: no process group joined (init_parallel)")
    timeout = timedelta(seconds=timeout_s)
    for g in {dist.group.WORLD, *(g for g in (_STATE.cpu_group, _STATE.tp_group, _STATE.dp_group) if g is not None)}:
        dist.distributed_c10d._set_pg_timeout(timeout, g)


def destroy() -> None:
    """Leave every group (no-op when none is set up)."""
    global _STATE
    if _STATE is None:
        return
    _STATE = None
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_info() -> RankInfo | None:
    return None if _STATE is None else _STATE.info


def tp_size() -> int:
    return 1 if _STATE is None else _STATE.info.tp_size


def tp_rank() -> int:
    return 0 if _STATE is None else _STATE.info.tp_rank


def tp_group() -> dist.ProcessGroup | None:
    return None if _STATE is None else _STATE.tp_group


def dp_group() -> dist.ProcessGroup | None:
    return None if _STATE is None else _STATE.dp_group


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over the tensor-parallel group (in place; every rank gets the same values).
    Identity at TP size 1."""
    if _STATE is None or _STATE.info.tp_size == 1:
        return x
    if not x.is_contiguous():
        x = x.contiguous()
    dist.all_reduce(x, group=_STATE.tp_group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The TP ranks' `x` concatenated along `dim`, in rank order. Identity at TP size 1."""
    if _STATE is None or _STATE.info.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.info.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=_STATE.tp_group)
    return torch.cat(parts, dim=dim)


def broadcast_object(obj=None, src: int = 0):
    """`obj` from global rank `src` to every rank over the gloo group (pickled); returns it."""
    if _STATE is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_STATE.cpu_group)
    return box[0]


def all_gather_object(obj) -> list:
    """Every rank's `obj`, in rank order, over the gloo group."""
    if _STATE is None:
        return [obj]
    out = [None] * _STATE.info.world_size
    dist.all_gather_object(out, obj, group=_STATE.cpu_group)
    return out
