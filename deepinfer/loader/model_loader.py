"""load_model: resolve a checkpoint, build the model class its config names, stream its weights in."""
from __future__ import annotations

from pathlib import Path

import torch

from deepinfer.loader.model_config import read_model_config
from deepinfer.loader.resolve import resolve_model_dir
from deepinfer.loader.weights import load_weights
from deepinfer.models.registry import model_classes


def load_model(model: str | Path | None, *, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
               quantized: bool = False, hf_model_dir: str | None = None, offline: bool = False,
               engram_device: str | None = None):
    """-> (model in eval mode, its directory). `quantized=True` keeps FP8/FP4 weights as stored;
    engram_device="cpu" (V4.1) leaves the Engram tables memory-mapped on the host."""
    path = resolve_model_dir(str(model) if model else None, hf_model_dir=hf_model_dir, offline=offline)
    cfg = read_model_config(path)
    _, model_cls = model_classes(cfg.model_type)
    extra = {"engram_device": engram_device} if engram_device and hasattr(cfg, "engram_layer_ids") else {}
    with torch.device(device):
        net = model_cls(cfg, dtype=dtype, quantized=quantized, **extra)
    load_weights(net, path, config=cfg)
    if getattr(cfg, "engram_layer_ids", None):
        net.set_engram_vocab(_engram_token_map(path))
    return net.eval(), path


def _engram_token_map(path: Path) -> list[int]:
    """Engram hashes tokenizer-normalised ids: the map comes from the checkpoint's tokenizer.json."""
    from tokenizers import Tokenizer

    from deepinfer.layers.engram_hash import compressed_token_map

    tok = path / "tokenizer.json"
    if not tok.is_file():
        raise FileNotFoundError(f"{path}: Engram layers need the checkpoint's tokenizer.json, which is missing")
    return compressed_token_map(Tokenizer.from_file(str(tok)))[0]
