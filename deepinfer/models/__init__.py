from deepinfer.models.config import ConfigError, DeepseekV4Config
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.models.registry import MODELS, model_classes

__all__ = ["ConfigError", "DeepseekV4Config", "DeepseekV4ForCausalLM", "MODELS", "model_classes"]
