"""Finding a model directory and streaming its safetensors checkpoint into a model."""
from deepinfer.loader.checkpoint import CheckpointError, CheckpointReader
from deepinfer.loader.model_config import read_model_config
from deepinfer.loader.resolve import ModelNotFoundError, resolve_model_dir
from deepinfer.loader.weights import load_weights

__all__ = ["CheckpointError", "CheckpointReader", "ModelNotFoundError", "load_weights",
           "read_model_config", "resolve_model_dir"]
