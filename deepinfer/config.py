"""EngineConfig: the one declaration of the engine's options, and the one typed place where DEEPINFER_*
environment variables are read.

Each field's `metadata` (built by `_option`) declares its help text, its environment variable, its command-line
flag and whether `LLM(...)` takes it; the environment table (ENV_FIELDS), the engine flags of `deepinfer generate`
and `deepinfer serve` (add_engine_args, engine_kwargs) and LLM's keyword check (EngineConfig.from_options) are
all derived from it."""
from __future__ import annotations

import argparse
import difflib
import json
import os
import typing
from pathlib import Path
from dataclasses import dataclass, field, fields
from typing import Mapping

ACCELERATORS = ("nvidia", "cpu", "ascend")
KV_CACHE_DTYPES = ("auto", "fp8", "bfloat16", "float32")
DTYPES = ("bfloat16", "float32")
# vLLM's `quantization` values this build understands: None keeps the checkpoint's formats on CUDA and
# dequantises on the CPU (the torch reference path); "fp8" keeps DeepSeek's shipped formats (FP8 block
# weights, FP4 routed experts) on any device; "none" dequantises every weight to `dtype`
QUANTIZATIONS = (None, "fp8", "none")
# vLLM's `load_format` values this build understands: "auto" / "safetensors" read the checkpoint's shards;
# "dummy" builds the model from config.json alone with random weights (loader/dummy.py)
LOAD_FORMATS = ("auto", "safetensors", "dummy")
# vLLM's parallel-size arguments (and context_parallel_size), with their single-process defaults
PARALLEL_DEFAULTS = {"tensor_parallel_size": 1, "data_parallel_size": 1, "context_parallel_size": 1,
                     "enable_expert_parallel": False, "enable_eplb": False}
REPLAY_MODES = ("compact", "none")
LOGGING_ENV_FIELDS = {"DEEPINFER_CONFIGURE_LOGGING": "configure", "DEEPINFER_LOGGING_LEVEL": "level"}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _truthy(text: str) -> bool:
    """huggingface_hub's reading of HF_HUB_OFFLINE: these values are on, anything else off."""
    return text.strip().lower() in ("1", "true", "yes", "on")


def _option(help: str, *, user: bool = True, env: str | None = None, choices: tuple | None = None,
            short: str | None = None, default_doc: str | None = None, parse=None) -> dict:
    """A field's declaration. `user`: LLM(...) takes it and `generate` / `serve` have its flag (--name-with-dashes,
    plus `short`); otherwise only `env` sets it. `env`: the variable that sets it when LLM is not given it (`parse`:
    the text's reading, default by the field's type). `choices`: its allowed values. `default_doc`: the default as
    the help states it, where the field's own default is not the whole story."""
    return {"help": help, "user": user, "env": env, "choices": choices, "short": short, "default_doc": default_doc,
            "parse": parse}


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = field(default=None, metadata=_option(
        "local dir, hub id, or 'demo' / 'demo-random'",
        default_doc="DEEPINFER_HF_MODEL_DIR, else the V4.1-Flash hub id"))
    accelerator: str = field(default="nvidia", metadata=_option(
        "the accelerator family ('ascend' is refused by this build)", user=False, env="DEEPINFER_ACCELERATOR",
        choices=ACCELERATORS))
    hf_model_dir: str | None = field(default=None, metadata=_option(
        "the model when `model` is not given", user=False, env="DEEPINFER_HF_MODEL_DIR"))
    hf_hub_offline: bool = field(default=False, metadata=_option(
        "never reach the hub (huggingface_hub's variable)", user=False, env="HF_HUB_OFFLINE", parse=_truthy))
    device: str = field(default="cpu", metadata=_option(
        "cpu or cuda[:N]", default_doc="cuda where torch sees one, else cpu"))
    dtype: str = field(default="bfloat16", metadata=_option(
        "the dtype of activations and of dequantised weights", choices=DTYPES))
    kv_cache_dtype: str = field(default="auto", metadata=_option("the cache's dtype", choices=KV_CACHE_DTYPES))
    max_model_len: int | None = field(default=None, metadata=_option(
        "the longest request (prompt + output) in tokens", default_doc="the model's, capped by what the cache holds"))
    allow_long_max_model_len: bool = field(default=False, metadata=_option(
        "a max_model_len above the model's max_position_embeddings is accepted with a warning instead of refused "
        "(vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN)", user=False, env="DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN"))
    max_num_seqs: int = field(default=256, metadata=_option("requests in a step at most"))
    max_num_batched_tokens: int = field(default=8192, metadata=_option("tokens in a step at most"))
    kv_cache_memory: int | None = field(default=None, metadata=_option(
        "bytes for the cache pools", default_doc="sized from the device's free memory"))
    block_size: int = field(default=64, metadata=_option("compressed entries per cache block"))
    skip_tokenizer_init: bool = field(default=False, metadata=_option(
        "no tokenizer: prompts are token ids and outputs carry no text"))
    seed: int | None = field(default=None, metadata=_option(
        "the seed of unseeded requests' sampling and of dummy weights", default_doc="a random one; dummy weights 0"))
    yoco_prefill_truncation_mode: str = field(default="compact", metadata=_option(
        "V4.1's SWA bounded replay: 'compact' runs the layers above the last KV source only on each prompt's last "
        "yoco_prefill_keep_tokens rows; 'none' is the exact prefill", env="DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE",
        choices=REPLAY_MODES))
    yoco_prefill_keep_tokens: int = field(default=140, metadata=_option(
        "the prompt rows bounded replay keeps", env="DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"))
    engram_device: str | None = field(default=None, metadata=_option(
        "cpu: V4.1's Engram tables stay on the host, memory-mapped", choices=(None, "cpu"),
        default_doc="the model's device"))
    enforce_eager: bool = field(default=False, metadata=_option("no CUDA graphs for decode steps"))
    async_scheduling: bool = field(default=True, metadata=_option(
        "plan and launch step N+1 while step N runs (the zero-overhead scheduler); models that hash tokens on the "
        "host (V4.1 Engram) run synchronously"))
    max_logprobs: int = field(default=20, metadata=_option("the most logprobs a request may ask for"))
    batch_invariant: bool = field(default=False, metadata=_option(
        "a request's logits do not depend on the rest of the batch, its size or its prompt's chunking (fixed-tile "
        "GEMMs, fixed-block attention reductions; costs speed)", env="DEEPINFER_BATCH_INVARIANT"))
    quantization: str | None = field(default=None, metadata=_option(
        "fp8: keep the checkpoint's FP8/FP4 weights on any device; none: dequantise to dtype", choices=QUANTIZATIONS,
        default_doc="keep them on CUDA, dequantise on the CPU"))
    load_format: str = field(default="auto", metadata=_option(
        "dummy: random weights from config.json alone, no shard read (benchmarks, memory sizing)",
        choices=LOAD_FORMATS))
    tensor_parallel_size: int = field(default=1, metadata=_option(
        "attention heads split over this many ranks", short="-tp"))
    data_parallel_size: int = field(default=1, metadata=_option(
        "attention data parallelism: ranks that own their own requests", short="-dp"))
    enable_expert_parallel: bool = field(default=False, metadata=_option(
        "split the routed experts over the data-parallel ranks (tensor and context parallel sizes 1)"))
    enable_eplb: bool = field(default=False, metadata=_option(
        "expert-parallel load balancing (redundant, moving expert replicas); needs enable_expert_parallel"))
    context_parallel_size: int = field(default=1, metadata=_option("long prefills split over this many ranks"))
    distributed_executor_backend: str | None = field(default=None, metadata=_option(
        "vLLM's name: 'uni' runs the one rank in this process; 'mp' runs the ranks as processes (at one rank too: "
        "the code path of every parallel layout)", choices=(None, "uni", "mp"),
        default_doc="'uni' at one rank, 'mp' otherwise"))
    # multi-node, as torchrun names them: every node runs world / nnodes ranks and meets at master_addr:master_port
    nnodes: int = field(default=1, metadata=_option(
        "nodes the ranks are spread over (tp x dp x cp ranks in all, as many on each node)"))
    node_rank: int = field(default=0, metadata=_option(
        "this node's index: 0 runs the engine's driver (LLM, serve); the others only run ranks"))
    master_addr: str | None = field(default=None, metadata=_option(
        "node 0's address for torch.distributed's env:// rendezvous (multi-node)"))
    master_port: int | None = field(default=None, metadata=_option(
        "a free port on master_addr for the rendezvous (multi-node)"))
    eplb_config: dict | None = field(default=None, metadata=_option(
        'vLLM\'s EPLB settings, e.g. {"step_interval": 3000, "window_size": 1000, "num_redundant_experts": 8}; '
        "needs enable_eplb", default_doc="distributed/expert_shard.py EPLBConfig"))
    speculative_config: dict | None = field(default=None, metadata=_option(
        'vLLM\'s speculative decoding settings: {"method": "ngram", "num_speculative_tokens": k, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 1} (prompt-lookup drafts), {"method": "dspark", '
        '"num_speculative_tokens": k} (V4.1\'s draft stages) or {"method": "mtp", "num_speculative_tokens": k} '
        "(V4's MTP layer)", default_doc="off"))
    num_speculative_tokens: int | None = field(default=None, metadata=_option(
        "draft tokens per step from the checkpoint's own draft layers, which pick the method (DSpark stages: "
        "dspark, an MTP layer: mtp); 0: off; not with speculative_config", env="DEEPINFER_USE_NEXTN_DECODE",
        default_doc="off"))
    enable_mtp_varlen: bool = field(default=False, metadata=_option(
        "verify lengths per step from the drafts' confidences (over a steps-per-second table profiled at start-up) "
        "instead of every draft token; model drafts only, off under batch_invariant",
        env="DEEPINFER_ENABLE_MTP_VARLEN"))

    def __post_init__(self):
        for f in fields(self):
            choices = f.metadata["choices"]
            if choices is not None and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name}: {getattr(self, f.name)!r} is not one of "
                                 f"{', '.join(repr(c) if c is None else str(c) for c in choices)}")
        _check_positive("yoco_prefill_keep_tokens", self.yoco_prefill_keep_tokens)
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device: {self.device!r} is not 'cpu' or 'cuda[:N]'")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_logprobs"):
            _check_positive(name, getattr(self, name))
        for name in ("max_model_len", "kv_cache_memory"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        for name in ("tensor_parallel_size", "data_parallel_size", "context_parallel_size"):
            _check_positive(name, getattr(self, name))
        for name in ("enable_expert_parallel", "enable_eplb"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be True or False, got {getattr(self, name)!r}")
        if self.distributed_executor_backend == "uni" and \
                self.tensor_parallel_size * self.data_parallel_size * self.context_parallel_size > 1:
            raise ValueError("distributed_executor_backend: 'uni' runs one rank; the parallel sizes ask for more "
                             "(leave it unset, or 'mp')")
        _check_positive("nnodes", self.nnodes)
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank: {self.node_rank!r} is outside [0, nnodes={self.nnodes})")
        world = self.tensor_parallel_size * self.data_parallel_size * self.context_parallel_size
        if world % self.nnodes:
            raise ValueError(f"nnodes: {self.nnodes} does not divide the world of {world} ranks "
                             "(tensor x data x context parallel sizes; every node runs as many)")
        if self.nnodes > 1 and (not self.master_addr or self.master_port is None):
            raise ValueError("master_addr: a multi-node engine needs master_addr and master_port (node 0's address "
                             "and a free port on it), as torchrun's --master-addr / --master-port")
        for name in ("master_addr", "master_port"):
            if getattr(self, name) is not None and self.nnodes == 1:
                raise ValueError(f"{name}: only a multi-node engine reads it (nnodes > 1); one node meets in a "
                                 "temporary file store")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise ValueError(f"master_port: {self.master_port!r} is not a port (1..65535)")
        if self.eplb_config is not None:
            _check_eplb_config(self.eplb_config, self.enable_eplb)
        check_layout(self.tensor_parallel_size, self.data_parallel_size, self.context_parallel_size,
                     self.enable_expert_parallel, self.enable_eplb, self.engram_device)
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
        """Keyword overrides (None and unknown names ignored), then each other field's environment variable where
        set and not empty, then the field's default."""
        env = os.environ if env is None else env
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in overrides.items() if k in known and v is not None}
        for f in fields(cls):
            var = f.metadata["env"]
            if var and env.get(var) and f.name not in kw:
                kw[f.name] = _from_text(f, env[var])
        return cls(**kw)

    @classmethod
    def from_options(cls, env: Mapping[str, str] | None = None, /, **options) -> "EngineConfig":
        """The configuration of LLM(**options): each name must be one of OPTIONS (TypeError naming it and the
        closest option otherwise); an option not given, or None, comes from its environment variable where it has
        one, else its default; `device` not given: cuda where torch sees one, else cpu."""
        check_options(options)
        if options.get("device") is None:
            options["device"] = default_device()
        return cls.from_env(env, **options)


# field -> its type without None (bool, int, str or dict)
_BASE_TYPES = {name: next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))
               for name, hint in typing.get_type_hints(EngineConfig).items()}
# env var -> EngineConfig field: every variable EngineConfig reads
ENV_FIELDS = {f.metadata["env"]: f.name for f in fields(EngineConfig) if f.metadata["env"]}
# LLM's keyword arguments, and the engine flags of `deepinfer generate` / `deepinfer serve` (as argparse dests)
OPTIONS = tuple(f.name for f in fields(EngineConfig) if f.metadata["user"])


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_options(options: Mapping[str, object]) -> None:
    """TypeError naming the first name of `options` that is not an engine option, with the closest one."""
    fields_by_name = {f.name: f for f in fields(EngineConfig)}
    for name in options:
        if name in OPTIONS:
            continue
        if name in fields_by_name:
            raise TypeError(f"{name}: not an option; it is set by the environment variable "
                            f"{fields_by_name[name].metadata['env']} only")
        close = difflib.get_close_matches(name, OPTIONS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise TypeError(f"{name}: unknown engine option{hint} (the options: EngineConfig, deepinfer/config.py)")


def option_default(name: str) -> str:
    """An option's default as its help states it."""
    f = {f.name: f for f in fields(EngineConfig)}[name]
    return f.metadata["default_doc"] or str(f.default)


def add_engine_args(group) -> None:
    """One flag per option in OPTIONS on `group` (an argparse parser or argument group): --name-with-dashes (and
    the declared short alias), dest the option's name, default None (not given: engine_kwargs leaves it out);
    a bool is a switch (default on: also --no-NAME), a dict a JSON object, a declared choice list argparse's."""
    for f in fields(EngineConfig):
        meta = f.metadata
        if not meta["user"]:
            continue
        names = ["--" + f.name.replace("_", "-")] + ([meta["short"]] if meta["short"] else [])
        kind = _BASE_TYPES[f.name]
        notes = [] if f.default is False else [f"default: {option_default(f.name)}"]
        notes += [f"{meta['env']} when not given"] if meta["env"] else []
        help = meta["help"] + (f" ({'; '.join(notes)})" if notes else "")
        kw = {"dest": f.name, "default": None, "help": help.replace("%", "%%")}
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
        else:
            kw["type"] = json_object if kind is dict else kind
            if meta["choices"]:
                kw["choices"] = [c for c in meta["choices"] if c is not None]
            kw["metavar"] = {dict: "JSON", int: "N"}.get(kind, None if meta["choices"] else f.name.upper())
        group.add_argument(*names, **kw)


def with_option_signature(init):
    """Decorates LLM.__init__(self, model=None, **options): its signature as inspect and help() show it names every
    option (keyword-only after `model`; default None where the environment or the device decides)."""
    import inspect

    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)]
    for f in fields(EngineConfig):
        if f.metadata["user"] and f.name != "model":
            default = None if f.metadata["env"] or f.name == "device" else f.default
            params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default))
    init.__signature__ = inspect.Signature(params)
    return init


def engine_kwargs(namespace: argparse.Namespace) -> dict:
    """LLM's keyword arguments from add_engine_args' flags: those the command line gave."""
    return {name: value for name in OPTIONS if (value := getattr(namespace, name, None)) is not None}


def options_table() -> str:
    """The options as docs/offline_api.md lists them (a Markdown table, regenerated from this declaration)."""
    rows = ["| option | flag | default | environment | meaning |", "|---|---|---|---|---|"]
    for f in fields(EngineConfig):
        meta = f.metadata
        if not meta["user"]:
            continue
        flag = f"`--{f.name.replace('_', '-')}`" + (f" `{meta['short']}`" if meta["short"] else "")
        flag += f" `--no-{f.name.replace('_', '-')}`" if f.default is True else ""
        env = f"`{meta['env']}`" if meta["env"] else ""
        choices = [c for c in meta["choices"] or () if c is not None]
        text = meta["help"] + (f" ({' / '.join(map(str, choices))})" if choices else "")
        rows.append(f"| `{f.name}` | {flag} | {option_default(f.name)} | {env} | {text.replace('|', '/')} |")
    return "\n".join(rows) + "\n"


def json_object(text: str) -> dict:
    """argparse type of a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def _from_text(f, text: str):
    """A field's value from its environment variable's text."""
    if f.metadata["parse"]:
        return f.metadata["parse"](text)
    kind = _BASE_TYPES[f.name]
    if kind is bool:
        return _parse_bool(f.name, text)
    if kind is int:
        return _parse_int(f.name, text)
    return text


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


def check_layout(tp: int, dp: int, cp: int, expert_parallel: bool, eplb: bool = False,
                 engram_device: str | None = None) -> None:
    """The layouts this build runs: tensor x data x context parallel sizes in any combination; expert parallelism
    over data-parallel ranks of one rank each. Refusals name the fields."""
    if expert_parallel and dp == 1:
        raise ValueError("enable_expert_parallel: the routed experts are spread over the data-parallel ranks; it "
                         "needs data_parallel_size > 1 (tensor parallelism already splits them by range)")
    if expert_parallel and (tp > 1 or cp > 1):
        raise ValueError(f"enable_expert_parallel: with tensor_parallel_size={tp} / context_parallel_size={cp} the "
                         "ranks of a data-parallel replica hold the same tokens, which the exchange would route "
                         "once from each; not built (expert parallelism runs over replicas of one rank each)")
    if eplb and not expert_parallel:
        raise ValueError("enable_eplb: load balancing moves routed experts between expert-parallel ranks; "
                         "it needs enable_expert_parallel=True")
    if engram_device is not None and tp * dp * cp > 1:
        raise ValueError("engram_device: host-resident Engram tables are read by one process; with several ranks "
                         "every rank holds the tables on its device (leave engram_device unset)")


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")


def _check_choice(name: str, value: str, choices: tuple[str, ...]):
    if value not in choices:
        raise ValueError(f"{name}: {value!r} is not one of {', '.join(choices)}")


# "mtp" (vLLM's other name for it: "deepseek_mtp"): V4's MTP layer, chained for k > 1 (worker/drafter.py)
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
