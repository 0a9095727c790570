"""deepinfer: an inference engine for the DeepSeek-V4 family."""
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
