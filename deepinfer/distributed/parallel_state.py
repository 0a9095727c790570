"""Process groups for one deepinfer engine spread over several processes (torch.distributed).

Rank layout: rank = (dp_rank * context_parallel_size + cp_rank) * tensor_parallel_size + tp_rank, so a
tensor-parallel group is a run of consecutive ranks (on one node: neighbouring GPUs), a context-parallel
group the ranks of one data-parallel replica with the same tp_rank, and a data-parallel replica a run of
cp * tp consecutive ranks. Backends: "nccl" on CUDA, "gloo" on the CPU;
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
    """Where this process sits: global rank, and its index inside its TP, CP and DP groups."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    device: torch.device
    cp_rank: int = 0
    cp_size: int = 1

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def is_replica_leader(self) -> bool:
        """The first rank of its data-parallel replica: the one whose step outputs the driver reads."""
        return self.tp_rank == 0 and self.cp_rank == 0


def rank_coords(rank: int, parallel: ParallelConfig) -> tuple[int, int, int]:
    """(dp_rank, cp_rank, tp_rank) of global `rank` under the module's rank layout."""
    tp, cp = parallel.tensor_parallel_size, parallel.context_parallel_size
    return rank // (tp * cp), rank // tp % cp, rank % tp


def replica_leader(dp_rank: int, parallel: ParallelConfig) -> int:
    """The global rank of data-parallel replica `dp_rank`'s leader (cp_rank 0, tp_rank 0)."""
    return dp_rank * parallel.context_parallel_size * parallel.tensor_parallel_size


@dataclass
class _State:
    info: RankInfo
    tp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    cpu_group: dist.ProcessGroup  # gloo, all ranks: Python objects
    cp_group: dist.ProcessGroup | None = None


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
    Groups: tensor-parallel (consecutive ranks), context-parallel (one replica's ranks of the same tp_rank),
    data-parallel (the ranks of every replica at the same (cp_rank, tp_rank): the expert-parallel group when
    tensor and context parallel sizes are 1)."""
    global _STATE
    check_free()
    world = parallel.world_size
    if not 0 <= rank < world:
        raise ValueError(f"rank: {rank} is outside the world of {world} ranks")
    device = torch.device(device)
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", device.index if device.index is not None else local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    start = timedelta(seconds=max(timeout_s, START_TIMEOUT_S))
    backend = backend or backend_for(device)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend: expected 'gloo' or 'nccl', got {backend!r}")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=start)
    cpu_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=start)
    tp, dp, cp = parallel.tensor_parallel_size, parallel.data_parallel_size, parallel.context_parallel_size
    mine: dict[str, dist.ProcessGroup | None] = {"tp": None, "cp": None, "dp": None}
    # every rank creates every group, in the same order (torch.distributed's rule for new_group)
    for kind, groups in (("tp", _group_ranks(parallel, "tp")), ("cp", _group_ranks(parallel, "cp")),
                         ("dp", _group_ranks(parallel, "dp"))):
        for ranks in groups:
            if len(ranks) == 1:
                g = None  # a group of one: its collectives are identities, never called
            elif len(ranks) == world:
                g = dist.group.WORLD
            else:
                g = dist.new_group(ranks, timeout=start)
            if rank in ranks:
                mine[kind] = g
    d, c, t = rank_coords(rank, parallel)
    info = RankInfo(rank, world, t, tp, d, dp, device, c, cp)
    _STATE = _State(info, mine["tp"], mine["dp"], cpu_group, mine["cp"])
    return info


def _group_ranks(parallel: ParallelConfig, kind: str) -> list[list[int]]:
    """The global ranks of every group of `kind` ("tp", "cp" or "dp"), in a fixed order."""
    tp, dp, cp = parallel.tensor_parallel_size, parallel.data_parallel_size, parallel.context_parallel_size
    at = lambda d, c, t: (d * cp + c) * tp + t  # noqa: E731
    if kind == "tp":
        return [[at(d, c, t) for t in range(tp)] for d in range(dp) for c in range(cp)]
    if kind == "cp":
        return [[at(d, c, t) for c in range(cp)] for d in range(dp) for t in range(tp)]
    return [[at(d, c, t) for d in range(dp)] for c in range(cp) for t in range(tp)]


def check_free() -> None:
    """Raises unless this process is free to join a new engine's groups (it holds no rank of an open one)."""
    if _STATE is not None:
        raise RuntimeError(f"this process already holds rank {_STATE.info.rank} of a parallel engine that is still "
                           "open (an LLM with tensor_parallel_size, data_parallel_size or context_parallel_size > 1); "
                           "close it first with LLM.close(), or build it as `with LLM(...) as llm:` (an Engine of "
                           "executor/engine.py: its close())")


def set_collective_timeout(timeout_s: float) -> None:
    """From here on every collective of this rank's groups raises after timeout_s (the end of start-up)."""
    if _STATE is None:
        raise RuntimeError("set_collective_timeout: no process group joined (init_parallel)")
    timeout = timedelta(seconds=timeout_s)
    groups = (_STATE.cpu_group, _STATE.tp_group, _STATE.dp_group, _STATE.cp_group)
    for g in {dist.group.WORLD, *(g for g in groups if g is not None)}:
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


def cp_group() -> dist.ProcessGroup | None:
    """This rank's context-parallel group (None outside one, or at context_parallel_size 1)."""
    return None if _STATE is None else _STATE.cp_group


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
