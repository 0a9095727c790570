"""prompt_logprobs (vLLM's extra request field) on a real `deepinfer serve` (a tiny random V4 checkpoint, fp32 on the
CPU): /v1/completions and /v1/chat/completions return the values LLM.generate computes for the same prompt and
SamplingParams, in vLLM's shape (completions: per choice; chat: on the response); the values the engine refuses
and streaming are 400s naming the field, and the server serves on. One server for the module."""
from __future__ import annotations

import httpx
import pytest
from server_process import ServerProcess

from deepinfer import LLM, SamplingParams
from deepinfer.entrypoints.openai.tokenizer import ServingTokenizer
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

MAX_MODEL_LEN = 256
TOL = 1e-4  # fp32: the server's engine process against this process's LLM (thread counts differ)
NO_THINKING = {"thinking": {"type": "disabled"}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", PRESETS["tiny"], seed=3, dtype="fp8")


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    srv = ServerProcess(ckpt, tmp_path_factory.mktemp("log") / "server.log", "--served-model-name", "tiny",
                        "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", str(64 << 20),
                        "--kv-cache-dtype", "float32")
    yield srv
    if srv.proc.poll() is None:
        srv.stop_cleanly()  # idle


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", max_model_len=MAX_MODEL_LEN,
               kv_cache_memory=64 << 20)


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    r = httpx.post(f"{server.url}/v1/{path}", json={"model": "tiny", **body}, timeout=120)
    return r.status_code, r.json()


def _check(got: list, ref: list, ranks: list, ids: list[int], k: int, decode) -> None:
    """`got` (the server's JSON) holds `ref` (LLM.generate's prompt_logprobs of `ids`, `ranks` its prompt tokens'
    ranks) in vLLM's shape."""
    assert len(got) == len(ref) == len(ids) and got[0] is None and ref[0] is None
    for p in range(1, len(ids)):
        want, have = ref[p], got[p]
        assert set(have) == {str(t) for t in want}, p
        top = sorted((t for t in want if len(want) == k or t != ids[p]), key=lambda t: -want[t])
        for t, v in want.items():
            e = have[str(t)]
            assert abs(e["logprob"] - v) <= TOL, (p, t, e["logprob"], v)
            assert e["decoded_token"] == decode([t], skip_special_tokens=False)
            if t == ids[p]:  # the prompt token: its true rank, inside the top-k or not
                assert e["rank"] == ranks[p], (p, t, e["rank"], ranks[p])
            else:  # ties may swap equal values' ranks
                assert want[top[e["rank"] - 1]] == v, (p, t, e["rank"])


def test_completions_return_what_llm_generate_computes(server, llm, ckpt):
    decode = ServingTokenizer.load(ckpt).hf.decode
    ids = [0] + [(37 * i) % 500 + 3 for i in range(1, 30)]
    text = "Once upon a time, a small model"
    params = SamplingParams(temperature=0, max_tokens=2, n=2, prompt_logprobs=3)
    ref = llm.generate([ids, text], params, use_tqdm=False)
    for prompt, want in zip([ids, text], ref):
        status, body = _post(server, "completions", {"prompt": prompt, "max_tokens": 2, "n": 2, "temperature": 0,
                                                     "prompt_logprobs": 3})
        assert status == 200, body
        assert [c["index"] for c in body["choices"]] == [0, 1]
        assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
        for c, out in zip(body["choices"], want.outputs):
            _check(c["prompt_logprobs"], want.prompt_logprobs, want.prompt_logprob_ranks, want.prompt_token_ids, 3,
                   decode)
            assert c["text"] == out.text
    status, body = _post(server, "completions", {"prompt": [ids, [0, 9]], "max_tokens": 1, "prompt_logprobs": 0})
    assert status == 200, body
    ref = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    _check(body["choices"][0]["prompt_logprobs"], ref.prompt_logprobs, ref.prompt_logprob_ranks, ids, 0, decode)
    short = body["choices"][1]["prompt_logprobs"]
    two = llm.generate([[0, 9]], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert len(short) == 2 and short[0] is None and list(short[1]) == ["9"]
    assert short[1]["9"]["rank"] == two.prompt_logprob_ranks[1] >= 1
    status, body = _post(server, "completions", {"prompt": ids, "max_tokens": 1})
    assert status == 200 and body["choices"][0]["prompt_logprobs"] is None


def test_chat_returns_what_llm_generate_computes_on_its_prompt(server, llm, ckpt):
    decode = ServingTokenizer.load(ckpt).hf.decode
    chat = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 1, **NO_THINKING}
    status, zero = _post(server, "chat/completions", {**chat, "prompt_logprobs": 0})
    assert status == 200, zero
    # with k = 0 each position holds the prompt token alone: the rendered prompt's ids (BOS first)
    ids = [llm.model.config.bos_token_id] + [int(next(iter(d))) for d in zero["prompt_logprobs"][1:]]
    assert len(ids) == zero["usage"]["prompt_tokens"] and all(c.get("prompt_logprobs") is None
                                                             for c in zero["choices"])
    status, body = _post(server, "chat/completions", {**chat, "prompt_logprobs": 4, "n": 2, "temperature": 0})
    assert status == 200 and len(body["choices"]) == 2, body
    ref = llm.generate([ids, ids], [SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k) for k in (0, 4)],
                       use_tqdm=False)
    _check(zero["prompt_logprobs"], ref[0].prompt_logprobs, ref[0].prompt_logprob_ranks, ids, 0, decode)
    _check(body["prompt_logprobs"], ref[1].prompt_logprobs, ref[1].prompt_logprob_ranks, ids, 4, decode)
    status, body = _post(server, "chat/completions", chat)
    assert status == 200 and body["prompt_logprobs"] is None


def test_refused_values_are_400s_naming_the_field_and_the_server_serves_on(server):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **NO_THINKING}
    for path, body, said in [("completions", {"prompt": "Hi", "prompt_logprobs": -1}, "greater than or equal to 0"),
                             ("completions", {"prompt": "Hi", "prompt_logprobs": 21}, "above the limit 20"),
                             ("completions", {"prompt": "Hi", "prompt_logprobs": 1, "stream": True}, "stream"),
                             ("chat/completions", {**chat, "prompt_logprobs": 21}, "above the limit 20"),
                             ("chat/completions", {**chat, "prompt_logprobs": 0, "stream": True}, "stream"),
                             ("messages", {**chat, "prompt_logprobs": 1}, "only /v1/completions")]:
        status, err = _post(server, path, body)
        assert status == 400 and err["error"]["param"] == "prompt_logprobs", (path, body, err)
        assert "prompt_logprobs" in err["error"]["message"] and said in err["error"]["message"], err
    status, body = _post(server, "completions", {"prompt": "Hi", "max_tokens": 2, "prompt_logprobs": 20})
    assert status == 200 and len(body["choices"][0]["prompt_logprobs"][1]) in (20, 21), body
