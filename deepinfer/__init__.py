"""deepinfer: an inference engine for the DeepSeek-V4 family.

`LLM` (and with it torch) is imported on first use, so `deepinfer --help` and SamplingParams
validation stay fast."""
from deepinfer.config import LoggingConfig
from deepinfer.logger import configure_logging
from deepinfer.sampling_params import SamplingParams

configure_logging(LoggingConfig.from_env())

__all__ = ["LLM", "GenerationError", "SamplingParams"]


def __getattr__(name: str):
    if name in ("LLM", "GenerationError"):
        from deepinfer import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
