"""model_type (config.json) -> config class and model class."""
from __future__ import annotations

from deepinfer.models.config import ConfigError, DeepseekV4Config
from deepinfer.models.config_v41 import DeepseekV41Config
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.models.deepseek_v41 import DeepseekV41ForCausalLM

MODELS = {
    "deepseek_v4": (DeepseekV4Config, DeepseekV4ForCausalLM),
    "deepseek_v41": (DeepseekV41Config, DeepseekV41ForCausalLM),
}


def model_classes(model_type: str | None, where: str = "config.json"):
    if model_type not in MODELS:
        raise ConfigError(f"{where}: model_type {model_type!r} is not supported by this build "
                          f"(supported: {', '.join(MODELS)})")
    return MODELS[model_type]
