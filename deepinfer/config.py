"""EngineConfig: the one typed place where DEEPINFER_* environment variables are read."""
from __future__ import annotations

import os
from pathlib import Path
from dataclasses import dataclass, fields
from typing import Mapping

ACCELERATORS = ("nvidia", "cpu", "ascend")
KV_CACHE_DTYPES = ("auto", "fp8", "bfloat16", "float32")
DTYPES = ("bfloat16", "float32")
# vLLM's `quantization` values this build understands: None keeps the checkpoint's formats on CUDA and
# dequantises on the CPU (the torch reference path); "fp8" keeps DeepSeek's shipped formats (FP8 block
# weights, FP4 routed experts) on any device; "none" dequantises every weight to `dtype`
QUANTIZATIONS = (None, "fp8", "none")
# vLLM's parallel-size arguments (and context_parallel_size), with their single-process defaults
# vLLM's `load_format` values this build understands: "auto" / "safetensors" read the checkpoint's shards;
# "dummy" builds the model from config.json alone with random weights (loader/dummy.py)
LOAD_FORMATS = ("auto", "safetensors", "dummy")
PARALLEL_DEFAULTS = {"tensor_parallel_size": 1, "data_parallel_size": 1, "context_parallel_size": 1,
                     "enable_expert_parallel": False, "enable_eplb": False}

# env var -> EngineConfig field
ENV_FIELDS = {
    "DEEPINFER_ACCELERATOR": "accelerator",
    "DEEPINFER_HF_MODEL_DIR": "hf_model_dir",
    "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "yoco_prefill_truncation_mode",
    "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "yoco_prefill_keep_tokens",
    "DEEPINFER_BATCH_INVARIANT": "batch_invariant",
    "DEEPINFER_USE_NEXTN_DECODE": "num_speculative_tokens",
    "DEEPINFER_ENABLE_MTP_VARLEN": "enable_mtp_varlen",
    "DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN": "allow_long_max_model_len",
}
REPLAY_MODES = ("compact", "none")
LOGGING_ENV_FIELDS = {"DEEPINFER_CONFIGURE_LOGGING": "configure", "DEEPINFER_LOGGING_LEVEL": "level"}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    accelerator: str = "nvidia"
    hf_model_dir: str | None = None
    hf_hub_offline: bool = False
    device: str = "cpu"
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None         # None: the model's, capped by what the cache holds
    # DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN): a max_model_len above the
    # model's max_position_embeddings is accepted (with a warning) instead of refused
    allow_long_max_model_len: bool = False
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_cache_memory: int | None = None       # bytes for the cache pools; None: sized from free memory
    block_size: int = 64                     # compressed entries per cache block
    skip_tokenizer_init: bool = False
    seed: int | None = None
    # SWA bounded replay (V4.1): "compact" runs the layers above the last KV source only on each
    # prompt's last `yoco_prefill_keep_tokens` rows; "none" is the exact prefill
    yoco_prefill_truncation_mode: str = "compact"
    yoco_prefill_keep_tokens: int = 140
    engram_device: str | None = None  # "cpu": V4.1 Engram tables stay on the host, memory-mapped
    enforce_eager: bool = False       # vLLM's name: True disables CUDA graphs for decode steps
    # plan and launch step N+1 while step N runs (DeepInfer's zero-overhead scheduler; vLLM's
    # --async-scheduling). Models that hash tokens on the host (V4.1 Engram) run synchronously.
    async_scheduling: bool = True
    max_logprobs: int = 20  # vLLM's name and default: the most logprobs a request may ask for
    # a request's logits do not depend on the rest of the batch, its size or its prompt's chunking
    # (fixed-tile GEMMs, fixed-block attention reductions); costs speed, so off by default
    batch_invariant: bool = False
    quantization: str | None = None   # one of QUANTIZATIONS
    load_format: str = "auto"         # one of LOAD_FORMATS
    tensor_parallel_size: int = 1     # attention heads split over this many ranks
    data_parallel_size: int = 1       # attention data parallelism: ranks that own their own requests
    enable_expert_parallel: bool = False  # routed experts split over the tp x dp ranks
    enable_eplb: bool = False         # expert-parallel load balancing (redundant, moving expert replicas)
    context_parallel_size: int = 1    # long prefills split over this many ranks
    # vLLM's EPLB settings: {"window_size", "step_interval", "num_redundant_experts"} (None: deepinfer's
    # defaults, distributed/dp_engine.py EPLBConfig); needs enable_eplb
    eplb_config: dict | None = None
    # vLLM's speculative decoding settings: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_max": 4, "prompt_lookup_min": 1} (prompt-lookup drafts, spec/ngram.py) or
    # {"method": "dspark", "num_speculative_tokens": k} (V4.1's draft stages, worker/drafter.py) or
    # {"method": "mtp", "num_speculative_tokens": 1} (V4's MTP layer, one token per step); None: off
    speculative_config: dict | None = None
    # draft tokens of the checkpoint's own draft stages (DeepInfer's DEEPINFER_USE_NEXTN_DECODE; 0 or None: off,
    # or what speculative_config says); the checkpoint's draft layers pick the method (DSpark stages: "dspark",
    # an MTP layer: "mtp"; LLM decides once the model is read: `speculation` says "dspark")
    num_speculative_tokens: int | None = None
    # DEEPINFER_ENABLE_MTP_VARLEN: verify lengths per step from the drafts' confidences (spec/schedule.py
    # allocate over a steps-per-second table profiled at start-up) instead of every draft token; model drafts only
    enable_mtp_varlen: bool = False

    def __post_init__(self):
        _check_choice("accelerator", self.accelerator, ACCELERATORS)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("yoco_prefill_truncation_mode", self.yoco_prefill_truncation_mode, REPLAY_MODES)
        if isinstance(self.yoco_prefill_keep_tokens, str):  # from the environment
            object.__setattr__(self, "yoco_prefill_keep_tokens", _parse_int("yoco_prefill_keep_tokens",
                                                                             self.yoco_prefill_keep_tokens))
        _check_positive("yoco_prefill_keep_tokens", self.yoco_prefill_keep_tokens)
        for name in ("batch_invariant", "allow_long_max_model_len"):
            if isinstance(getattr(self, name), str):  # from the environment
                object.__setattr__(self, name, _parse_bool(name, getattr(self, name)))
        if self.engram_device not in (None, "cpu"):
            raise ValueError(f"engram_device: {self.engram_device!r} is not None or 'cpu'")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device: {self.device!r} is not 'cpu' or 'cuda[:N]'")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_logprobs"):
            _check_positive(name, getattr(self, name))
        for name in ("max_model_len", "kv_cache_memory"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization: {self.quantization!r} is not one of None, 'fp8', 'none'")
        for name in ("tensor_parallel_size", "data_parallel_size", "context_parallel_size"):
            _check_positive(name, getattr(self, name))
        for name in ("enable_expert_parallel", "enable_eplb"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be True or False, got {getattr(self, name)!r}")
        if self.enable_eplb and not self.enable_expert_parallel:
            raise ValueError("enable_eplb: load balancing moves routed experts between expert-parallel ranks; "
                             "it needs enable_expert_parallel=True")
        if self.eplb_config is not None:
            _check_eplb_config(self.eplb_config, self.enable_eplb)
        if isinstance(self.num_speculative_tokens, str):  # from the environment
            object.__setattr__(self, "num_speculative_tokens",
                               _parse_int("num_speculative_tokens", self.num_speculative_tokens))
        if isinstance(self.enable_mtp_varlen, str):
            object.__setattr__(self, "enable_mtp_varlen", _parse_bool("enable_mtp_varlen", self.enable_mtp_varlen))
        if self.num_speculative_tokens is not None and (
                not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 0):
            raise ValueError(f"num_speculative_tokens: must be an integer >= 0, got {self.num_speculative_tokens!r}")
        if self.num_speculative_tokens and self.speculative_config is not None:
            raise ValueError("num_speculative_tokens: give it or speculative_config, not both")
        if self.speculative_config is not None:
            _check_speculative_config(self.speculative_config)
        if self.enable_mtp_varlen and self.batch_invariant:
            # DeepInfer: deterministic sampling forces fixed-length verification (a step's lengths would
            # depend on the other requests' confidences)
            object.__setattr__(self, "enable_mtp_varlen", False)
        if self.accelerator == "ascend":
            raise ValueError("accelerator: 'ascend' is not supported in this build of deepinfer")

    @property
    def speculation(self) -> dict | None:
        """The speculative decoding asked for, as a speculative_config (None: off)."""
        if self.num_speculative_tokens:
            return {"method": "dspark", "num_speculative_tokens": self.num_speculative_tokens}
        return self.speculative_config

    @property
    def keeps_checkpoint_formats(self) -> bool:
        """Whether the model holds FP8/FP4 weights as the checkpoint stores them (`quantization`)."""
        if self.quantization is None:
            return self.device.startswith("cuda")
        return self.quantization == "fp8"

    def parallel_changes(self) -> dict[str, object]:
        """The parallel-size fields set to something other than one process's defaults."""
        return {k: getattr(self, k) for k, v in PARALLEL_DEFAULTS.items() if getattr(self, k) != v}

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> "EngineConfig":
        """Fields from DEEPINFER_* variables, then explicit keyword overrides (which win)."""
        env = os.environ if env is None else env
        kw = {f: env[v] for v, f in ENV_FIELDS.items() if env.get(v)}
        kw["hf_hub_offline"] = env.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        known = {f.name for f in fields(cls)}
        kw.update({k: v for k, v in overrides.items() if k in known and v is not None})
        return cls(**kw)


@dataclass(frozen=True)
class LoggingConfig:
    """How the `deepinfer` logger reports (read once, when deepinfer is imported). `configure`:
    give it its own stderr handler at `level` (vLLM's default); 0 leaves logging to the application."""

    configure: bool = True
    level: str = "INFO"

    def __post_init__(self):
        if isinstance(self.configure, str):  # from the environment
            object.__setattr__(self, "configure", _parse_bool("configure", self.configure))
        object.__setattr__(self, "level", self.level.upper())
        _check_choice("level", self.level, LOG_LEVELS)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "LoggingConfig":
        env = os.environ if env is None else env
        return cls(**{f: env[v] for v, f in LOGGING_ENV_FIELDS.items() if env.get(v)})


def default_cache_dir() -> Path:
    """Where deepinfer keeps what it builds itself (the random demo checkpoint): $XDG_CACHE_HOME/deepinfer."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deepinfer"


def _parse_int(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}: {value!r} is not an integer") from None


def _parse_bool(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}: {value!r} is not a boolean (1/0, true/false)")


EPLB_KEYS = ("window_size", "step_interval", "num_redundant_experts")


def _check_eplb_config(value, enabled: bool) -> None:
    if not isinstance(value, dict):
        raise ValueError(f"eplb_config: expected a dict with keys among {EPLB_KEYS}, got {type(value).__name__}")
    unknown = sorted(set(value) - set(EPLB_KEYS))
    if unknown:
        raise ValueError(f"eplb_config: unknown key(s) {unknown}; known: {', '.join(EPLB_KEYS)}")
    for k, v in value.items():
        low = 0 if k == "num_redundant_experts" else 1
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise ValueError(f"eplb_config.{k}: must be an integer >= {low}, got {v!r}")
    if not enabled:
        raise ValueError("eplb_config: given without enable_eplb=True")


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")


def _check_choice(name: str, value: str, choices: tuple[str, ...]):
    if value not in choices:
        raise ValueError(f"{name}: {value!r} is not one of {', '.join(choices)}")


# "mtp" (vLLM's other name for it: "deepseek_mtp"): V4's MTP layer, one draft token per step (worker/drafter.py)
SPECULATIVE_METHODS = ("ngram", "dspark", "mtp", "deepseek_mtp")


def _check_speculative_config(sc) -> None:
    """The keys deepinfer reads (vLLM's names); the proposer checks their values."""
    if not isinstance(sc, dict):
        raise ValueError(f"speculative_config: expected a dict, got {type(sc).__name__}")
    known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
    unknown = sorted(set(sc) - known)
    if unknown:
        raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
    if sc.get("method") not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_config.method: {sc.get('method')!r} is not supported (supported: "
                         f"{', '.join(SPECULATIVE_METHODS)})")
    lookup = sorted(k for k in sc if k.startswith("prompt_lookup"))
    if sc["method"] != "ngram" and lookup:
        raise ValueError(f"speculative_config.{lookup[0]}: only the 'ngram' method reads it")
    if "num_speculative_tokens" not in sc:
        raise ValueError("speculative_config.num_speculative_tokens: required")
    if sc["method"] in ("mtp", "deepseek_mtp") and sc["num_speculative_tokens"] != 1:
        raise ValueError(f"speculative_config.num_speculative_tokens: the 'mtp' method drafts 1 token per step, got "
                         f"{sc['num_speculative_tokens']!r} (chaining V4's MTP layer needs each chained position "
                         "planned on the device; not built)")
