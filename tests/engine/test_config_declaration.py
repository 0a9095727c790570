"""One declaration of the engine's options (EngineConfig's field metadata): LLM's keywords, the engine flags of
`deepinfer generate` and `deepinfer serve`, the environment table and the documented table all derive from it."""
from __future__ import annotations

import argparse
import inspect
import re
from dataclasses import fields
from pathlib import Path

import pytest

from deepinfer.config import (ENV_FIELDS, OPTIONS, EngineConfig, check_options, engine_kwargs, options_table)

ROOT = Path(__file__).resolve().parents[2]
USER_OPTIONS = {f.name for f in fields(EngineConfig) if f.metadata["user"]}
# the names users set before the declaration existed: each must keep setting the same field
LEGACY_ENV = {
    "DEEPINFER_ACCELERATOR": "accelerator",
    "DEEPINFER_HF_MODEL_DIR": "hf_model_dir",
    "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "yoco_prefill_truncation_mode",
    "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "yoco_prefill_keep_tokens",
    "DEEPINFER_BATCH_INVARIANT": "batch_invariant",
    "DEEPINFER_USE_NEXTN_DECODE": "num_speculative_tokens",
    "DEEPINFER_ENABLE_MTP_VARLEN": "enable_mtp_varlen",
    "DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN": "allow_long_max_model_len",
}
# DEEPINFER_* variables that are not engine options (read by the logger and by `deepinfer serve`)
NOT_ENGINE_ENV = {"DEEPINFER_CONFIGURE_LOGGING", "DEEPINFER_LOGGING_LEVEL", "DEEPINFER_API_KEY"}


def _subparser(command: str) -> argparse.ArgumentParser:
    from deepinfer.entrypoints import cli

    sub = next(a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _engine_dests(command: str) -> set[str]:
    """The dests of the command's engine group; no flag outside it may set an EngineConfig field."""
    parser = _subparser(command)
    group = next(g for g in parser._action_groups if g.title == "engine")
    dests = {a.dest for a in group._group_actions}
    others = {a.dest for a in parser._actions} - dests
    assert not others & {f.name for f in fields(EngineConfig)}, others
    return dests


def test_llm_options_and_both_commands_engine_flags_are_the_same_set():
    from deepinfer import LLM

    llm = set(inspect.signature(LLM).parameters)
    assert USER_OPTIONS == set(OPTIONS) == llm == _engine_dests("generate") == _engine_dests("serve")
    assert {"model", "device", "tensor_parallel_size", "speculative_config", "enable_mtp_varlen"} <= USER_OPTIONS
    assert not {"accelerator", "hf_model_dir", "hf_hub_offline", "allow_long_max_model_len"} & USER_OPTIONS


def test_every_option_is_accepted_and_every_other_name_refused():
    check_options({name: None for name in OPTIONS})
    for f in fields(EngineConfig):
        if f.name not in USER_OPTIONS:
            with pytest.raises(TypeError, match=rf"^{f.name}: .*{f.metadata['env']}"):
                check_options({f.name: 1})


def test_every_environment_variable_sets_exactly_one_field():
    assert len(set(ENV_FIELDS.values())) == len(ENV_FIELDS)
    assert ENV_FIELDS == {f.metadata["env"]: f.name for f in fields(EngineConfig) if f.metadata["env"]}
    assert LEGACY_ENV.items() <= ENV_FIELDS.items()
    source = "\n".join(p.read_text() for p in (ROOT / "deepinfer").rglob("*.py"))
    read = set(re.findall(r"DEEPINFER_[A-Z0-9_]+", source)) - NOT_ENGINE_ENV
    assert read == {v for v in ENV_FIELDS if v.startswith("DEEPINFER_")}, read ^ set(ENV_FIELDS)


@pytest.mark.parametrize("var, text, value", [
    ("DEEPINFER_ACCELERATOR", "cpu", "cpu"), ("DEEPINFER_HF_MODEL_DIR", "/ckpt", "/ckpt"),
    ("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "none", "none"), ("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "7", 7),
    ("DEEPINFER_BATCH_INVARIANT", "1", True), ("DEEPINFER_USE_NEXTN_DECODE", "2", 2),
    ("DEEPINFER_ENABLE_MTP_VARLEN", "true", True), ("DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN", "yes", True),
    ("HF_HUB_OFFLINE", "1", True), ("HF_HUB_OFFLINE", "anything else", False),
])
def test_each_variable_is_read_by_its_fields_type(var, text, value):
    assert getattr(EngineConfig.from_env({var: text}), ENV_FIELDS[var]) == value


def test_an_option_given_wins_over_its_variable_and_none_leaves_it_to_the_variable():
    env = {"DEEPINFER_BATCH_INVARIANT": "1", "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "9"}
    assert EngineConfig.from_options(env, device="cpu").batch_invariant
    assert not EngineConfig.from_options(env, device="cpu", batch_invariant=False).batch_invariant
    assert EngineConfig.from_options(env, device="cpu", yoco_prefill_keep_tokens=None).yoco_prefill_keep_tokens == 9
    # an overridden variable is not read, so a bad one does not matter
    assert EngineConfig.from_env({"DEEPINFER_BATCH_INVARIANT": "maybe"}, batch_invariant=True).batch_invariant


def test_the_device_defaults_to_cuda_where_torch_sees_one():
    import torch

    assert EngineConfig.from_options({}).device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert EngineConfig.from_options({}, device="cpu").device == "cpu"


@pytest.mark.parametrize("name, closest", [("max_num_seq", "max_num_seqs"), ("tp_size", None),
                                           ("tensor_parallel", "tensor_parallel_size"), ("dtpye", "dtype")])
def test_an_unknown_llm_option_is_named_with_the_closest_one(name, closest):
    from deepinfer import LLM

    with pytest.raises(TypeError, match=rf"^{name}: unknown engine option") as e:
        LLM("demo", **{name: 1})  # refused before any model is looked for
    if closest:
        assert f"did you mean {closest!r}" in str(e.value)


def test_an_environment_only_field_is_not_an_llm_option():
    from deepinfer import LLM

    with pytest.raises(TypeError, match="hf_model_dir: .*DEEPINFER_HF_MODEL_DIR"):
        LLM(hf_model_dir="/ckpt")


def test_engine_kwargs_are_the_flags_given():
    parser = _subparser("generate")
    assert engine_kwargs(parser.parse_args(["--prompt", "x"])) == {}
    args = parser.parse_args(["--prompt", "x", "-tp", "2", "--enforce-eager", "--no-async-scheduling", "--model",
                              "demo", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                              "--quantization", "none", "--num-speculative-tokens", "0"])
    assert engine_kwargs(args) == {"tensor_parallel_size": 2, "enforce_eager": True, "async_scheduling": False,
                                   "model": "demo", "quantization": "none", "num_speculative_tokens": 0,
                                   "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    serve = _subparser("serve").parse_args(["-dp", "2", "--enable-expert-parallel", "--async-scheduling"])
    assert engine_kwargs(serve) == {"data_parallel_size": 2, "enable_expert_parallel": True,
                                    "async_scheduling": True}


def test_the_documented_table_is_the_declarations():
    doc = (ROOT / "docs" / "offline_api.md").read_text()
    table = doc.split("<!-- options: generated by deepinfer.config.options_table() -->\n")[1].split("<!--")[0]
    assert table == options_table(), "regenerate docs/offline_api.md's table with deepinfer.config.options_table()"
