"""config.json -> the typed config of the model_type it names (unknown types are refused)."""
from __future__ import annotations

from pathlib import Path

from deepinfer.models.config import load_config_dict
from deepinfer.models.interface import ConfigError, ModelConfig
from deepinfer.models.registry import model_classes


def read_model_config(model_dir: str | Path) -> ModelConfig:
    raw = load_config_dict(model_dir)
    where = str(Path(model_dir) / "config.json")
    config_cls, _ = model_classes(raw.get("model_type"), where)
    try:
        return config_cls.from_dict(raw)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
