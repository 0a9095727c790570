"""Stream a checkpoint into a model whose state_dict uses DeepSeek's original names.

Model contract: state_dict keys are DeepSeek names, except routed experts, which are
stacked per layer as `...ffn.experts.w1/w3 [E, F, D]` and `...ffn.experts.w2 [E, D, F]`.
A model that keeps a weight quantised declares it by owning `X.scale` (stacked experts:
`...experts.w1_scale`); those are copied raw. Everything else is dequantised / cast to
the model tensor's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, NamedTuple

import torch

from deepinfer.formats.quant import dequant_fp4, dequant_fp8_blocks
from deepinfer.loader.checkpoint import CheckpointError, CheckpointReader
from deepinfer.loader.dummy import DummyWeights, fill_dummy
from deepinfer.loader.names import WeightRef, plan_names, split_expert_name
from deepinfer.models.interface import ModelConfig

__all__ = ["CheckpointError", "Part", "Slice", "load_weights"]

FP4_GROUP = 32
_QUANT_WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.int8, torch.uint8)
_BYTE_DTYPES = (torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e8m0fnu)
_MAX_LISTED = 20


class Slice(NamedTuple):
    """Elements [start, stop) along `dim` of a checkpoint tensor `full` long there. A model tensor
    holding a part of its checkpoint tensor (tensor parallelism) is given one Slice per cut dim; for
    stacked experts, dim 0 is the expert index."""

    dim: int
    start: int
    stop: int
    full: int


Part = tuple[Slice, ...]


def _cut(t: torch.Tensor, part: Part) -> torch.Tensor:
    for s in part:
        t = t.narrow(s.dim, s.start, s.stop - s.start)
    return t


def _index(part: Part) -> tuple:
    index = [slice(None)] * (1 + max(s.dim for s in part))
    for s in part:
        index[s.dim] = slice(s.start, s.stop)
    return tuple(index)


@dataclass
class _Job:
    ref: WeightRef
    target: str
    expert: int | None  # slice of a stacked expert tensor
    scale: WeightRef | None = None
    scale_target: str | None = None  # set in quantised mode: copy weight + scale raw
    part: Part | None = None  # the model tensor holds this part of the checkpoint's
    scale_part: Part | None = None


_SKIP = object()  # a checkpoint expert that another rank holds


def _sliced_shape(shape: tuple[int, ...], index: tuple | None) -> tuple[int, ...]:
    if index is None:
        return tuple(shape)
    out: list[int] = []
    for dim, ix in enumerate(index):
        if isinstance(ix, slice):
            out.append(len(range(*ix.indices(shape[dim]))))
    return tuple(out) + tuple(shape[len(index):])


class _Planner:
    def __init__(self, reader: CheckpointReader, targets: dict[str, torch.Tensor], config: ModelConfig,
                 shard: Mapping[str, Part]):
        self.reader = reader
        self.targets = targets
        self.config = config
        self.shard = shard
        self.errors: list[str] = []

    def where(self, ref: WeightRef) -> str:
        src = ref.source if ref.source == ref.name else f"{ref.source} (as {ref.name})"
        return f"{src} in {self.reader.file_of(ref.source)}"

    def shape(self, ref: WeightRef) -> tuple[int, ...]:
        return _sliced_shape(self.reader.shape(ref.source), ref.index)

    def expected(self, job: _Job, key: str) -> tuple[int, ...]:
        """The checkpoint tensor's shape that fills model tensor `key` (whole, where it holds a part)."""
        shape = list(self.targets[key].shape)
        if job.expert is not None:
            return tuple(shape[1:])
        for cut in self.shard.get(key, ()):
            shape[cut.dim] = cut.full
        return tuple(shape)

    def check_shape(self, job: _Job, ref: WeightRef, got: tuple[int, ...], key: str) -> None:
        want = self.expected(job, key)
        if got != want:
            part = f"{key}[{job.expert}]" if job.expert is not None else key
            self.errors.append(f"shape mismatch: {self.where(ref)} has shape {list(got)}, "
                               f"model tensor {part} expects {list(want)}")

    def check(self, job: _Job) -> None:
        ref, scale = job.ref, job.scale
        src_dtype = self.reader.dtype(ref.source)
        got = self.shape(ref)
        if scale is not None and src_dtype not in _QUANT_WEIGHT_DTYPES:
            self.errors.append(f"quantised weight {self.where(ref)} has dtype {src_dtype}; "
                               "expected float8_e4m3fn (FP8 blocks) or int8 (packed FP4)")
            return
        if job.scale_target is not None:
            self.check_raw(job, ref, src_dtype, got, job.target)
            self.check_raw(job, scale, self.reader.dtype(scale.source), self.shape(scale), job.scale_target)
            return
        if scale is None:
            self.check_shape(job, ref, got, job.target)
            return
        if src_dtype == torch.float8_e4m3fn:
            block = self.config.quant.block_size
            if block is None:
                self.errors.append(f"{self.where(ref)} is FP8 with a .scale, but config.json has no "
                                   "quantization_config.weight_block_size")
                return
            want_scale = tuple(got[:-2]) + tuple(-(-d // b) for d, b in zip(got[-2:], block))
        else:
            want_scale = tuple(got[:-1]) + (got[-1] * 2 // FP4_GROUP,)
            got = tuple(got[:-1]) + (got[-1] * 2,)
        scale_shape = self.shape(scale)
        if scale_shape != want_scale:
            self.errors.append(f"scale {self.where(scale)} has shape {list(scale_shape)}, its weight "
                               f"{ref.source} {list(self.shape(ref))} ({src_dtype}) needs {list(want_scale)}")
        self.check_shape(job, ref, got, job.target)

    def check_raw(self, job: _Job, ref: WeightRef, dtype: torch.dtype, got: tuple[int, ...], key: str) -> None:
        want = self.targets[key].dtype
        if dtype != want and not (dtype in _BYTE_DTYPES and want in _BYTE_DTYPES):
            self.errors.append(f"{self.where(ref)} has dtype {dtype}; quantised model tensor {key} "
                               f"is {want} and is copied without conversion")
        self.check_shape(job, ref, got, key)


def load_weights(model: torch.nn.Module, model_dir: str | Path | CheckpointReader | DummyWeights, *,
                 config: ModelConfig, shard: Mapping[str, Part] | None = None) -> None:
    """Fill every tensor of `model.state_dict()` from the checkpoint, one tensor at a time.

    Raises CheckpointError for tensors the model lacks, model tensors the checkpoint
    lacks, shape or dtype mismatches. With `config.has_dspark`, unmatched `mtp.*`
    tensors go to `model.unmapped_tensors` instead.

    `shard` (tensor parallelism, deepinfer/distributed/tensor_parallel.py): model tensors that hold
    a part of their checkpoint tensor; only that part is copied (read alone where the file allows).
    For stacked experts the part is an expert range: the other experts are not read.

    `DummyWeights` (load_format="dummy") reads nothing: every tensor gets random values (loader/dummy.py).
    """
    reader = model_dir if isinstance(model_dir, (CheckpointReader, DummyWeights)) else CheckpointReader(model_dir)
    targets = model.state_dict(keep_vars=True)
    if isinstance(reader, DummyWeights):  # load_format="dummy": a tensor left on meta gets host storage
        for key, t in targets.items():
            if t.is_meta:
                targets[key] = _bind(model, key, torch.empty(t.shape, dtype=t.dtype, device="cpu"))
        fill_dummy(targets, reader.seed)
        return
    jobs, keep = _plan(reader, targets, config, shard or {})
    for job in [j for j in jobs if targets[j.target].is_meta]:
        _bind_mmap(model, job, reader, targets)
        jobs.remove(job)
    if keep:
        if not isinstance(getattr(model, "unmapped_tensors", None), dict):
            model.unmapped_tensors = {}
    with torch.no_grad():
        for ref in keep:
            model.unmapped_tensors[ref.name] = reader.get(ref.source, ref.index)
        for job in jobs:
            _run(job, reader, targets, config)


def _plan(reader: CheckpointReader, targets: dict[str, torch.Tensor], config: ModelConfig,
          shard: Mapping[str, Part]) -> tuple[list[_Job], list[WeightRef]]:
    refs: dict[str, WeightRef] = {}
    planner = _Planner(reader, targets, config, shard)
    for ref in plan_names(reader.names(), reader.shape):
        if ref.name in refs:
            raise CheckpointError(f"two checkpoint tensors map to {ref.name}: {planner.where(refs[ref.name])} "
                                  f"and {planner.where(ref)}")
        refs[ref.name] = ref

    jobs: list[_Job] = []
    unexpected: list[WeightRef] = []
    keep: list[WeightRef] = []
    filled: set[str] = set()
    experts_filled: dict[str, set[int]] = {}
    for name, ref in refs.items():
        if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in refs:
            continue  # loaded together with its weight
        job = _target_of(name, ref, targets, shard)
        if job is _SKIP:
            continue
        if job is None:
            if config.has_dspark and name.startswith("mtp."):
                keep.append(ref)
                scale_name = name[: -len(".weight")] + ".scale"
                if name.endswith(".weight") and scale_name in refs:
                    keep.append(refs[scale_name])
            else:
                unexpected.append(ref)
            continue
        scale_name = name[: -len(".weight")] + ".scale" if name.endswith(".weight") else None
        job.scale = refs.get(scale_name) if scale_name else None
        quant_key = _quant_scale_key(job)
        if quant_key in targets:
            if job.scale is None:
                planner.errors.append(f"model keeps {job.target} quantised (has {quant_key}) but "
                                      f"{planner.where(ref)} has no .scale tensor")
                continue
            job.scale_target = quant_key
            job.scale_part = shard.get(quant_key) if job.expert is None else None
        planner.check(job)
        jobs.append(job)
        for key in filter(None, (job.target, job.scale_target)):
            if job.expert is None:
                filled.add(key)
            else:
                experts_filled.setdefault(key, set()).add(job.expert)

    if unexpected:
        listed = [f"{planner.where(r)}" for r in unexpected[:_MAX_LISTED]]
        more = f" ... and {len(unexpected) - _MAX_LISTED} more" if len(unexpected) > _MAX_LISTED else ""
        planner.errors.append("checkpoint tensors with no model tensor: " + "; ".join(listed) + more)
    missing: list[str] = []
    for key, t in targets.items():
        if key in experts_filled:
            lacking = sorted(set(range(t.shape[0])) - experts_filled[key])
            if lacking:
                missing.append(f"{key} (experts {lacking})")
        elif key not in filled:
            missing.append(key)
    if missing:
        more = f" ... and {len(missing) - _MAX_LISTED} more" if len(missing) > _MAX_LISTED else ""
        planner.errors.append(f"model tensors not found in the checkpoint at {reader.dir}: "
                              + ", ".join(missing[:_MAX_LISTED]) + more)
    if planner.errors:
        errs = planner.errors[:_MAX_LISTED]
        if len(planner.errors) > _MAX_LISTED:
            errs.append(f"... and {len(planner.errors) - _MAX_LISTED} more problems")
        raise CheckpointError(f"cannot load checkpoint {reader.dir}:\n  " + "\n  ".join(errs))
    return jobs, keep


def _target_of(name: str, ref: WeightRef, targets: dict[str, torch.Tensor], shard: Mapping[str, Part]):
    """The job filling a model tensor from `ref`; None: no model tensor; _SKIP: another rank's expert."""
    split = split_expert_name(name)
    if split is not None:
        stem, e, proj, leaf = split
        key = f"{stem}.{proj}"
        if key in shard and leaf == "weight":
            (experts,) = shard[key]  # an expert range
            if not experts.start <= e < experts.stop:
                return _SKIP
            e -= experts.start
        if leaf != "weight" or key not in targets or e >= targets[key].shape[0]:
            return None
        return _Job(ref, key, e)
    return _Job(ref, name, None, part=shard.get(name)) if name in targets else None


def _bind_mmap(model: torch.nn.Module, job: _Job, reader: CheckpointReader, targets) -> None:
    """A model tensor left on the meta device is bound to the checkpoint's bytes, memory-mapped,
    instead of being copied (the host-resident Engram tables); it must be stored as-is."""
    for key, ref in ((job.target, job.ref), (job.scale_target, job.scale)):
        if key is None:
            continue
        mapped = reader.mmap(ref.source)
        if job.expert is not None or ref.index is not None or mapped.dtype != targets[key].dtype:
            raise CheckpointError(f"{ref.source} in {reader.file_of(ref.source)} cannot be memory-mapped into "
                                  f"{key}: it must be stored whole as {targets[key].dtype}")
        _bind(model, key, mapped)


def _bind(model: torch.nn.Module, key: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as the model's `key` (parameter or buffer), in place of its placeholder."""
    owner, _, leaf = key.rpartition(".")
    mod = model.get_submodule(owner)
    if leaf in mod._buffers:
        mod._buffers[leaf] = tensor
    else:
        mod._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)
    return tensor


def _quant_scale_key(job: _Job) -> str | None:
    if job.expert is not None:
        return job.target + "_scale"
    if job.target.endswith(".weight"):
        return job.target[: -len(".weight")] + ".scale"
    return None


def _put(targets: dict[str, torch.Tensor], key: str, expert: int | None, value: torch.Tensor) -> None:
    dst = targets[key] if expert is None else targets[key][expert]
    if value.dtype != dst.dtype and value.dtype in _BYTE_DTYPES and dst.dtype in _BYTE_DTYPES:
        value = value.view(dst.dtype)
    dst.copy_(value)


def _read(reader: CheckpointReader, ref: WeightRef, part: Part | None) -> torch.Tensor:
    """`ref`'s tensor, or its `part` (read alone from the file when `ref` is a whole tensor)."""
    if part is None:
        return reader.get(ref.source, ref.index)
    if ref.index is None:
        return reader.get(ref.source, _index(part))
    return _cut(reader.get(ref.source, ref.index), part)


def _run(job: _Job, reader: CheckpointReader, targets: dict[str, torch.Tensor],
         config: ModelConfig) -> None:
    if job.scale_target is not None:
        _put(targets, job.target, job.expert, _read(reader, job.ref, job.part))
        _put(targets, job.scale_target, job.expert, _read(reader, job.scale, job.scale_part))
        return
    dtype = targets[job.target].dtype
    if job.scale is None:
        _put(targets, job.target, job.expert, _read(reader, job.ref, job.part).to(dtype))
        return
    w, s = reader.get(job.ref.source, job.ref.index), reader.get(job.scale.source, job.scale.index)
    if w.dtype == torch.float8_e4m3fn:
        value = dequant_fp8_blocks(w, s, config.quant.block_size, dtype)
    else:
        value = dequant_fp4(w, s, FP4_GROUP, dtype)
    _put(targets, job.target, job.expert, value if job.part is None else _cut(value, job.part))
