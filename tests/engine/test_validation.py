"""Bad input to LLM.generate: a ValueError naming the field, raised before anything is scheduled;
the engine keeps serving (tiny model, CPU)."""
from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.config import EngineConfig
from deepinfer.executor import multiproc
from deepinfer.loader import model_loader
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

CFG = PRESETS["tiny"]
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
GOOD = [[0, 11, 12, 13], [0, 21, 22]]
LIMIT = CFG["max_position_embeddings"]
LONG_ENV = "DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("validation") / "ckpt", CFG, seed=5, dtype="fp8")


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=16 << 20)


def _refused(llm: LLM, prompts, params, *words: str) -> None:
    with pytest.raises(ValueError) as e:
        llm.generate(prompts, params, use_tqdm=False)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert not llm.scheduler.has_unfinished() and llm.scheduler.kv.all_free()
    assert not llm.engine.core.decode_state and not llm.engine.requests


@pytest.mark.parametrize("prompts, words", [
    (None, ["prompts", "NoneType"]), (5, ["prompts", "int"]), (3.5, ["prompts", "float"]),
    (GOOD + [None], ["prompts[2]", "NoneType"]), (GOOD + [7.0], ["prompts[2]", "float"]),
    ([[0, 1, "a"]], ["prompts[0]", "integers"]), ([[0, 1.5]], ["prompts[0]", "integers"]),
    ([{"prompt_token_ids": [0, 1], "images": "x.png"}], ["prompts[0].images", "list"]),
    ([{"prompt": 5}], ["prompts[0]", "int"]),
])
def test_prompts_of_the_wrong_type_name_the_field(llm, prompts, words):
    _refused(llm, prompts, GREEDY, *words)


def test_no_prompts_no_outputs(llm):
    assert llm.generate([], GREEDY, use_tqdm=False) == []


def test_logprobs_above_the_limit_are_refused_up_front(llm):
    vocab = CFG["vocab_size"]
    _refused(llm, GOOD, SamplingParams(temperature=0, logprobs=vocab + 1), "logprobs", str(vocab + 1))
    _refused(llm, GOOD, SamplingParams(temperature=0, logprobs=21), "logprobs", "max_logprobs=20")
    _refused(llm, GOOD, [GREEDY, SamplingParams(stop_token_ids=[vocab])], "prompts[1]", "stop_token_ids")
    outs = llm.generate(GOOD, SamplingParams(temperature=0, max_tokens=3, logprobs=20), use_tqdm=False)
    assert all(len(lp) == 20 or len(lp) == 21 for o in outs for lp in o.outputs[0].logprobs)


def test_a_larger_max_logprobs_is_bounded_by_the_vocabulary(tmp_path):
    vocab = CFG["vocab_size"]
    ckpt = write_checkpoint(tmp_path / "ckpt", CFG, seed=5, dtype="fp8")
    llm = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=16 << 20,
              max_logprobs=vocab + 8)
    _refused(llm, GOOD, SamplingParams(temperature=0, logprobs=vocab + 1), "logprobs", f"vocab_size={vocab}")
    out = llm.generate(GOOD[:1], SamplingParams(temperature=0, max_tokens=2, logprobs=vocab), use_tqdm=False)
    assert [len(lp) for lp in out[0].outputs[0].logprobs] == [vocab, vocab]


def test_token_ids_from_numpy_are_accepted(llm):
    np = pytest.importorskip("numpy")
    ids = [np.int64(t) for t in GOOD[0]]
    assert llm.generate([ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
        llm.generate([GOOD[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _no_weights(*args, **kwargs):
    raise AssertionError("weights read or ranks started before max_model_len was checked")


@pytest.mark.parametrize("parallel", [{}, {"tensor_parallel_size": 2}])
def test_max_model_len_above_the_model_is_refused_before_any_weight_is_read(ckpt, monkeypatch, parallel):
    monkeypatch.delenv(LONG_ENV, raising=False)
    monkeypatch.setattr(model_loader, "load_weights", _no_weights)
    monkeypatch.setattr(multiproc, "MultiprocExecutor", _no_weights)
    with pytest.raises(ValueError) as e:
        LLM(str(ckpt), device="cpu", dtype="float32", max_model_len=100000, skip_tokenizer_init=True, **parallel)
    assert all(w in str(e.value) for w in ("max_model_len", "100000", f"max_position_embeddings {LIMIT}", LONG_ENV))
    with pytest.raises(AssertionError, match="weights read"):  # the model's own length passes the check
        LLM(str(ckpt), device="cpu", dtype="float32", max_model_len=LIMIT, skip_tokenizer_init=True, **parallel)


def test_allow_long_max_model_len_runs_prompts_past_the_model(ckpt, monkeypatch, caplog):
    monkeypatch.setenv(LONG_ENV, "1")
    llm = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=16 << 20,
              max_model_len=LIMIT + 100, skip_tokenizer_init=True)
    assert llm.max_model_len == LIMIT + 100
    assert any(str(LIMIT + 100) in r.getMessage() and LONG_ENV in r.getMessage() for r in caplog.records)
    out = llm.generate([[0] + [7] * (LIMIT + 40)], GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == GREEDY.max_tokens


@pytest.mark.parametrize("value, expected", [(None, False), ("1", True), ("true", True), ("0", False)])
def test_allow_long_max_model_len_comes_from_the_environment(value, expected):
    env = {} if value is None else {LONG_ENV: value}
    assert EngineConfig.from_env(env).allow_long_max_model_len is expected


def test_a_bad_allow_long_max_model_len_names_the_field():
    with pytest.raises(ValueError, match="allow_long_max_model_len: 'sometimes'"):
        EngineConfig.from_env({LONG_ENV: "sometimes"})
