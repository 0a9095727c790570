"""Bad input to LLM.generate: a ValueError naming the field, raised before anything is scheduled;
the engine keeps serving (tiny model, CPU)."""
from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

CFG = PRESETS["tiny"]
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
GOOD = [[0, 11, 12, 13], [0, 21, 22]]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    ckpt = write_checkpoint(tmp_path_factory.mktemp("validation") / "ckpt", CFG, seed=5, dtype="fp8")
    return LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=16 << 20)


def _refused(llm: LLM, prompts, params, *words: str) -> None:
    with pytest.raises(ValueError) as e:
        llm.generate(prompts, params, use_tqdm=False)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert not llm.scheduler.has_unfinished() and llm.scheduler.kv.all_free()
    assert not llm.engine.decode_state and not llm.engine.requests


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
