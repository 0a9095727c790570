"""load_model: resolve a checkpoint, build the model class its config names, stream its weights in."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Callable, TypeVar

import torch
from torch import nn

from deepinfer.engine.memory_fit import WeightBytes

from deepinfer.loader.checkpoint import CheckpointReader
from deepinfer.config import LOAD_FORMATS
from deepinfer.loader.dummy import DummyWeights
from deepinfer.loader.model_config import read_model_config
from deepinfer.loader.names import DRAFT_PREFIX, is_draft_name
from deepinfer.loader.resolve import resolve_model_dir
from deepinfer.loader.weights import load_weights
from deepinfer.layers.engram import EngramTable
from deepinfer.layers.moe import Experts
from deepinfer.layers.linear import prepare_fp8_linears
from deepinfer.models.interface import ModelConfig
from deepinfer.models.registry import model_classes

logger = logging.getLogger(__name__)
Config = TypeVar("Config", bound=ModelConfig)


def load_model(model: str | Path | None, *, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
               quantized: bool = False, hf_model_dir: str | None = None, offline: bool = False,
               engram_device: str | None = None, check: Callable[[nn.Module], None] | None = None,
               load_format: str = "auto", seed: int = 0):
    """-> (model in eval mode, its directory). `quantized=True` keeps FP8/FP4 weights as stored (a
    checkpoint with no quantization_config loads in `dtype` either way); engram_device="cpu" (V4.1)
    leaves the Engram tables memory-mapped on the host.

    `check`, when given, is called with the same model built on the meta device (same class, config,
    `quantized` and Engram placement: the tensors it will hold, with no storage) before any storage is
    allocated on `device` or any weight is read; whatever it raises stops the load.

    A checkpoint with no draft tensors at all (`mtp.*`) loads as its trunk: the model is built
    without draft layers (`model.mtp is None`, its config says 0 of them) and a warning says so.
    Any other missing tensor, or a draft that is only partly there, is a CheckpointError.

    load_format="dummy" (vLLM's name) needs only config.json (and, for Engram, tokenizer.json): every
    tensor gets random values drawn from `seed` (loader/dummy.py); the model is built whole, draft included."""
    weights = load_format != "dummy"
    path = resolve_model_dir(str(model) if model else None, hf_model_dir=hf_model_dir, offline=offline,
                             weights=weights)
    reader = open_weights(path, load_format, seed)
    cfg, model_cls, extra, trunk_only = model_spec(path, reader, engram_device)
    if check is not None:
        with torch.device("meta"):
            check(model_cls(cfg, dtype=dtype, quantized=quantized, **extra))
    with torch.device(device):
        net = model_cls(cfg, dtype=dtype, quantized=quantized, **extra)
    load_weights(net, reader, config=cfg)
    if trunk_only:
        logger.warning("%s: config.json declares %d draft layer(s) (num_nextn_predict_layers) but the checkpoint "
                       "has no %s* tensors (transformers' and NeMo's exports leave them out); loaded the trunk "
                       "without its draft layers", path, read_model_config(path).num_nextn_predict_layers,
                       DRAFT_PREFIX)
    if getattr(cfg, "engram_layer_ids", None):
        net.set_engram_vocab(engram_token_map(path))
    prepare_fp8_linears(net)
    return net.eval(), path


def weight_bytes(net: nn.Module, host_engram: bool = False) -> WeightBytes:
    """Bytes of `net`'s parameters and buffers (on any device, meta included), routed experts apart.
    `host_engram`: V4.1 Engram tables are left on the host (engram_device="cpu") and not counted."""
    experts = other = packed = 0
    seen: set[int] = set()
    for mod in net.modules():
        if host_engram and isinstance(mod, EngramTable):
            seen.update(id(t) for t in mod.parameters(recurse=False))
            seen.update(id(t) for t in mod.buffers(recurse=False))
            continue
        routed = isinstance(mod, Experts)
        for t in [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]:
            if id(t) in seen:  # shared tensors count once
                continue
            seen.add(id(t))
            n = t.numel() * t.element_size()
            if not routed:
                other += n
                continue
            experts += n
            if mod.quant.fp4_experts and t.dtype == torch.int8:  # two e2m1 codes per byte
                packed += n
    return WeightBytes(experts, other, packed)


def open_weights(path: Path, load_format: str = "auto", seed: int = 0) -> CheckpointReader | DummyWeights:
    """What load_weights fills the model from: the checkpoint's shards, or (load_format="dummy") nothing."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: {load_format!r} is not one of {', '.join(map(repr, LOAD_FORMATS))}")
    return DummyWeights(path, seed) if load_format == "dummy" else CheckpointReader(path)


def model_spec(path: Path, reader: CheckpointReader | DummyWeights, engram_device: str | None):
    """(config, model class, extra constructor kwargs, trunk only) of the checkpoint at `path`: a
    checkpoint with no draft tensors at all is built as its trunk (a dummy load keeps its draft)."""
    cfg = read_model_config(path)
    trunk_only = (cfg.num_nextn_predict_layers > 0 and not isinstance(reader, DummyWeights)
                  and not any(is_draft_name(n) for n in reader.names()))
    if trunk_only:
        cfg = without_draft(cfg)
    _, model_cls = model_classes(cfg.model_type)
    extra = {"engram_device": engram_device} if engram_device and hasattr(cfg, "engram_layer_ids") else {}
    return cfg, model_cls, extra, trunk_only


def meta_model(path: Path, *, dtype: torch.dtype, quantized: bool, engram_device: str | None = None,
               load_format: str = "auto") -> nn.Module:
    """The model load_model(path) would build, on the meta device (no storage, no weight read)."""
    cfg, model_cls, extra, _ = model_spec(path, open_weights(path, load_format), engram_device)
    with torch.device("meta"):
        return model_cls(cfg, dtype=dtype, quantized=quantized, **extra)


def without_draft(cfg: Config) -> Config:
    """The same model with no draft layers: no MTP block, no DSpark stages (and so no draft block)."""
    return dataclasses.replace(cfg, num_nextn_predict_layers=0, dspark_block_size=None)


def engram_token_map(path: Path) -> list[int]:
    """Engram hashes tokenizer-normalised ids: the map comes from the checkpoint's tokenizer.json."""
    from tokenizers import Tokenizer

    from deepinfer.layers.engram_hash import compressed_token_map

    tok = path / "tokenizer.json"
    if not tok.is_file():
        raise FileNotFoundError(f"{path}: Engram layers need the checkpoint's tokenizer.json, which is missing")
    return compressed_token_map(Tokenizer.from_file(str(tok)))[0]
