"""load_model: resolve a checkpoint, build the model class its config names, stream its weights in."""
from __future__ import annotations

from pathlib import Path

import torch

from deepinfer.loader.model_config import read_model_config
from deepinfer.loader.resolve import resolve_model_dir
from deepinfer.loader.weights import load_weights
from deepinfer.models.registry import model_classes


def load_model(model: str | Path | None, *, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
               quantized: bool = False, hf_model_dir: str | None = None, offline: bool = False):
    """-> (model in eval mode, its directory). `quantized=True` keeps FP8/FP4 weights as stored."""
    path = resolve_model_dir(str(model) if model else None, hf_model_dir=hf_model_dir, offline=offline)
    cfg = read_model_config(path)
    _, model_cls = model_classes(cfg.model_type)
    with torch.device(device):
        net = model_cls(cfg, dtype=dtype, quantized=quantized)
    load_weights(net, path, config=cfg)
    return net.eval(), path
