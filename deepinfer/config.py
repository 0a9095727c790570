"""EngineConfig: the one typed place where DEEPINFER_* environment variables are read."""
from __future__ import annotations

import os
from pathlib import Path
from dataclasses import dataclass, fields
from typing import Mapping

ACCELERATORS = ("nvidia", "cpu", "ascend")
KV_CACHE_DTYPES = ("auto", "fp8", "bfloat16", "float32")
DTYPES = ("bfloat16", "float32")

# env var -> EngineConfig field
ENV_FIELDS = {
    "DEEPINFER_ACCELERATOR": "accelerator",
    "DEEPINFER_HF_MODEL_DIR": "hf_model_dir",
}


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    accelerator: str = "nvidia"
    hf_model_dir: str | None = None
    hf_hub_offline: bool = False
    device: str = "cpu"
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"

    def __post_init__(self):
        _check_choice("accelerator", self.accelerator, ACCELERATORS)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.accelerator == "ascend":
            raise ValueError("accelerator: 'ascend' is not supported in this build of deepinfer")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> "EngineConfig":
        """Fields from DEEPINFER_* variables, then explicit keyword overrides (which win)."""
        env = os.environ if env is None else env
        kw = {f: env[v] for v, f in ENV_FIELDS.items() if env.get(v)}
        kw["hf_hub_offline"] = env.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        known = {f.name for f in fields(cls)}
        kw.update({k: v for k, v in overrides.items() if k in known and v is not None})
        return cls(**kw)


def default_cache_dir() -> Path:
    """Where deepinfer keeps what it builds itself (the demo checkpoint): $XDG_CACHE_HOME/deepinfer."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deepinfer"


def _check_choice(name: str, value: str, choices: tuple[str, ...]):
    if value not in choices:
        raise ValueError(f"{name}: {value!r} is not one of {', '.join(choices)}")
