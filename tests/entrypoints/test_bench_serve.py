"""`deepinfer bench serve` against a fake OpenAI-compatible server that streams known tokens with
known delays: the timings, token counts, pacing, concurrency and failures it reports are checked
against what the fake server did."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from deepinfer.entrypoints import bench_serve
from deepinfer.entrypoints.bench_datasets import (_plain_ids, count_tokens, exact_length_prompt, random_requests,
                                                  sharegpt_requests)
from deepinfer.tools.tiny_tokenizer import write_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TTFT_S = 0.12  # the fake server's delay before the first token
ITL_S = 0.03  # and between tokens
TOKEN = " the"  # one token of the tiny tokenizer


class Fake:
    """What the fake server saw: request bodies, arrival times, the peak number in flight."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.bodies, self.arrivals, self.in_flight, self.peak, self.root = [], [], 0, 0, None


def _fake_app(fake: Fake) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        root = {"root": fake.root} if fake.root else {}
        return {"object": "list", "data": [{"id": "other-model", "object": "model"},
                                           {"id": "fake-model", "object": "model", **root}]}

    async def stream(body: dict, chat: bool):
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        n = body["max_completion_tokens"] if chat else body["max_tokens"]
        fake.in_flight += 1
        fake.peak = max(fake.peak, fake.in_flight)
        try:
            if chat:  # a role-only chunk at once: no text, so it must not end TTFT
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}) + "\n\n"
            await asyncio.sleep(TTFT_S)
            for i in range(n):
                if i:
                    await asyncio.sleep(ITL_S)
                if "DROP" in prompt and i == 2:
                    raise RuntimeError("connection dropped by the fake server")
                if "ERREVENT" in prompt and i == 1:
                    yield "data: " + json.dumps({"error": {"message": "engine died", "code": 503}}) + "\n\n"
                    return
                part = {"delta": {"content": TOKEN}} if chat else {"text": TOKEN}
                yield ": keep-alive comment\n\n" if i == 1 else ""
                yield "data: " + json.dumps({"choices": [{"index": 0, **part, "finish_reason": None}]}) + "\n\n"
            if "NOUSAGE" not in prompt:
                usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n,
                         "total_tokens": len(prompt.split()) + n}
                yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            if "NODONE" not in prompt:
                yield "data: [DONE]\n\n"
        finally:
            fake.in_flight -= 1

    async def handle(request: Request, chat: bool):
        body = await request.json()
        fake.arrivals.append(time.perf_counter())
        fake.bodies.append(body)
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if "FAIL500" in prompt:
            return JSONResponse({"error": {"message": "fake internal error", "type": "server_error"}}, status_code=500)
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        return StreamingResponse(stream(body, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


@pytest.fixture(scope="module")
def server():
    fake = Fake()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(_fake_app(fake), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not srv.started:
        assert time.time() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield fake, port
    srv.should_exit = True
    thread.join(timeout=5)


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tok"), 512)


@pytest.fixture(scope="module")
def tok(tok_path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tok_path))


def _args(port: int, *extra: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    bench_serve.register(ap.add_subparsers(dest="command"))
    return ap.parse_args(["bench", "serve", "--port", str(port), *extra])


def _run(server, *extra: str, root: str | None = None) -> dict:
    fake, port = server
    fake.reset()
    fake.root = root
    return bench_serve.main(_args(port, *extra))


def _sharegpt(tmp_path: Path, prompts: list[str], reply: str = TOKEN * 3) -> Path:
    data = [{"id": i, "conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": reply}]}
            for i, p in enumerate(prompts)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return path


def test_completions_timings_tokens_and_results_file(server, tok, tok_path, tmp_path):
    fake, _ = server
    out = 5
    res = _run(server, "--model", "m", "--tokenizer", str(tok_path), "--random-input-len", "20",
               "--random-output-len", str(out), "--num-prompts", "6", "--result-dir", str(tmp_path),
               "--metric-percentiles", "50,99.9")
    assert (res["completed"], res["failed"]) == (6, 0), res["first_errors"]
    # every prompt the server got is exactly 20 tokens by the tokenizer; max_tokens as asked
    assert [count_tokens(tok, b["prompt"]) for b in fake.bodies] == [20] * 6
    assert all(b["max_tokens"] == out and b["model"] == "m" and "ignore_eos" not in b for b in fake.bodies)
    assert res["input_lens"] == [20] * 6 and res["output_lens"] == [out] * 6
    assert (res["total_input_tokens"], res["total_output_tokens"]) == (120, 6 * out)
    # timings against the server's delays (slack above for a loaded CPU, none below)
    assert TTFT_S - 0.005 <= res["median_ttft_ms"] / 1000 < TTFT_S + 0.1
    assert all(len(g) == out - 1 for g in res["itls"])
    assert ITL_S - 0.005 <= res["median_itl_ms"] / 1000 < ITL_S + 0.04
    assert ITL_S - 0.005 <= res["median_tpot_ms"] / 1000 < ITL_S + 0.04
    e2el = TTFT_S + (out - 1) * ITL_S
    assert e2el - 0.005 <= res["median_e2el_ms"] / 1000 < e2el + 0.15
    assert res["p99.9_e2el_ms"] >= res["median_e2el_ms"] and "p90_ttft_ms" not in res
    assert res["request_throughput"] == pytest.approx(6 / res["duration"])
    assert res["output_throughput"] == pytest.approx(6 * out / res["duration"])
    assert res["total_token_throughput"] == pytest.approx((120 + 6 * out) / res["duration"])
    assert res["duration"] < e2el + 1.0  # all six sent at once (request rate inf)
    saved = json.loads(Path(res["result_path"]).read_text())
    for key in ("date", "commit", "base_url", "model", "endpoint", "dataset", "num_prompts", "request_rate",
                "burstiness", "max_concurrency", "completed", "failed", "first_errors", "duration",
                "total_input_tokens", "total_output_tokens", "request_throughput", "output_throughput",
                "total_token_throughput", "ttfts", "itls", "output_lens", "input_lens", "errors"):
        assert key in saved, key
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99.9"):
            assert isinstance(saved[f"{stat}_{metric}_ms"], float), (stat, metric)
    assert saved["request_rate"] == "inf" and saved["endpoint"] == "/v1/completions"
    assert re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?|unknown", saved["commit"]), saved["commit"]
    assert saved["commit"] == bench_serve.git_commit(ROOT)


def test_chat_sharegpt_model_from_server_and_ignore_eos(server, tok, tok_path, tmp_path):
    fake, _ = server
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "first question"}, {"from": "gpt", "value": TOKEN * 4}]},
        {"conversations": [{"from": "gpt", "value": "starts with gpt"}, {"from": "human", "value": "x"}]},
        {"conversations": [{"from": "human", "value": "only one turn"}]},
        {"no_conversations": []},
        {"conversations": [{"from": "human", "value": "second question"}, {"from": "gpt", "value": TOKEN * 2},
                           {"from": "human", "value": "later turn"}]},
    ]))
    res = _run(server, "--endpoint", "/v1/chat/completions", "--dataset-name", "sharegpt", "--dataset-path",
               str(path), "--tokenizer", str(tok_path), "--num-prompts", "2", "--ignore-eos",
               "--base-url", f"http://127.0.0.1:{server[1]}/v1", "--commit", "abc1234")
    assert (res["completed"], res["failed"], res["model"], res["commit"]) == (2, 0, "other-model", "abc1234")
    got = {b["messages"][0]["content"]: b for b in fake.bodies}
    assert set(got) == {"first question", "second question"}  # only well-formed conversations, first turn
    assert got["first question"]["max_completion_tokens"] == 4 and got["second question"]["max_completion_tokens"] == 2
    assert all(b["ignore_eos"] is True and b["model"] == "other-model" for b in fake.bodies)
    # TTFT counts from the first text, not the role-only chunk the server sent at once
    assert min(res["ttfts"]) >= TTFT_S - 0.005
    assert sorted(res["input_lens"]) == sorted(count_tokens(tok, p) for p in got)


def test_tokenizer_from_the_servers_model_root_and_warmups(server, tok, tok_path):
    fake, _ = server
    res = _run(server, "--model", "fake-model", "--random-input-len", "33", "--random-output-len", "2",
               "--num-prompts", "3", "--num-warmups", "2", root=str(tok_path.parent))
    assert res["tokenizer"] == str(tok_path.parent) and res["input_lens"] == [33] * 3
    assert len(fake.bodies) == 5 and res["completed"] == 3  # warmups are sent, not measured
    assert all(count_tokens(tok, b["prompt"]) == 33 for b in fake.bodies)
    res = _run(server, "--model", "fake-model", "--random-input-len", "33", "--random-output-len", "2",
               "--num-prompts", "1")  # no root reported: prompts of 33 words, input length from usage
    assert res["tokenizer"] is None and res["input_lens"] == [33]


def test_max_concurrency_is_honoured(server):
    fake, _ = server
    res = _run(server, "--model", "m", "--random-input-len", "4", "--random-output-len", "2", "--num-prompts", "9",
               "--max-concurrency", "3")
    assert res["completed"] == 9 and fake.peak == 3
    # a request's clock starts when it is released, not while it waits for a free slot (3 waves of 3)
    assert max(res["ttfts"]) < TTFT_S + 0.12 and res["duration"] > 3 * (TTFT_S + ITL_S)
    res = _run(server, "--model", "m", "--random-input-len", "4", "--random-output-len", "2", "--num-prompts", "9")
    assert res["completed"] == 9 and fake.peak == 9  # unlimited: the connection pool queues nothing


def test_request_rate_paces_arrivals(server):
    fake, _ = server
    rate, n = 20.0, 8
    _run(server, "--model", "m", "--random-input-len", "4", "--random-output-len", "1", "--num-prompts", str(n),
         "--request-rate", str(rate), "--burstiness", "0.5", "--seed", "3")
    want = bench_serve.arrival_offsets(n, rate, 0.5, 3)
    got = sorted(t - min(fake.arrivals) for t in fake.arrivals)
    assert got[-1] > 0.1  # spread out, not a burst
    assert all(abs(g - w) < 0.05 for g, w in zip(got, want)), (got, want)


def test_arrival_gaps_follow_rate_and_burstiness():
    assert bench_serve.arrival_offsets(5, float("inf"), 1.0, 0) == [0.0] * 5
    for burstiness in (1.0, 0.25):
        t = bench_serve.arrival_offsets(20001, 50.0, burstiness, 7)
        gaps = [b - a for a, b in zip(t, t[1:])]
        mean = statistics.fmean(gaps)
        assert mean == pytest.approx(1 / 50.0, rel=0.05)
        # gamma(shape k): squared coefficient of variation 1/k
        assert statistics.pvariance(gaps) / mean ** 2 == pytest.approx(1 / burstiness, rel=0.1)
    assert bench_serve.arrival_offsets(10, 5.0, 1.0, 1) == bench_serve.arrival_offsets(10, 5.0, 1.0, 1)


def test_failures_are_counted_with_their_error(server, tmp_path):
    prompts = ["ok one", "FAIL500 please", "DROP mid-stream", "ERREVENT now", "NODONE here", "ok two"]
    path = _sharegpt(tmp_path, prompts)
    res = _run(server, "--model", "m", "--dataset-name", "sharegpt", "--dataset-path", str(path),
               "--sharegpt-output-len", "4", "--num-prompts", "6", "--seed", "1")
    assert (res["completed"], res["failed"]) == (2, 4)
    order = [r.prompt for r in sharegpt_requests(path, 6, 1, None, 4)]  # the order requests were made in
    assert order != prompts  # shuffled by the seed: the per-request lists follow the requests
    err = dict(zip(order, res["errors"]))
    assert err["ok one"] == "" and err["ok two"] == ""
    assert err["FAIL500 please"].startswith("HTTP 500: ") and "fake internal error" in err["FAIL500 please"]
    assert err["DROP mid-stream"].startswith("RemoteProtocolError: ")
    assert err["ERREVENT now"].startswith("stream error event: ") and "engine died" in err["ERREVENT now"]
    assert err["NODONE here"] == "stream ended before data: [DONE]"
    assert sorted(res["first_errors"]) == sorted(e for e in res["errors"] if e)
    # failed requests count no tokens, even those that streamed some before failing
    assert res["total_output_tokens"] == 8
    lens = dict(zip(order, res["output_lens"]))
    assert lens["DROP mid-stream"] == 0 and lens["ok one"] == 4
    assert res["ttfts"][order.index("FAIL500 please")] == 0.0 and res["ttfts"][order.index("ok one")] > TTFT_S - 0.005
    assert res["request_throughput"] == pytest.approx(2 / res["duration"])


def test_without_usage_tokens_are_counted_by_tokenizer_or_chunks(server, tok_path, tmp_path):
    path = _sharegpt(tmp_path, ["NOUSAGE a b c"])
    common = ["--model", "m", "--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "2"]
    res = _run(server, *common, "--sharegpt-output-len", "3")
    assert res["output_lens"] == [3, 3] and res["input_lens"] == [0, 0]  # chunks; no prompt count known
    res = _run(server, *common, "--tokenizer", str(tok_path))  # reply " the the the": 3 tokens
    assert res["output_lens"] == [3, 3] and res["completed"] == 2
    res = _run(server, "--model", "m", "--dataset-name", "sharegpt", "--dataset-path",
               str(_sharegpt(tmp_path, ["with usage x y"])), "--num-prompts", "1", "--sharegpt-output-len", "2")
    assert res["input_lens"] == [4]  # the server's usage.prompt_tokens when no tokenizer was given


def test_random_prompts_have_exact_token_lengths(tok):
    rng = random.Random(0)
    pool = _plain_ids(tok)
    for n in list(range(1, 40)) + [127, 500, 2048]:
        text, got = exact_length_prompt(tok, n, rng, pool)
        assert got == n and count_tokens(tok, text) == n, n
    reqs = random_requests(50, 100, 10, 0.5, seed=4, tokenizer=tok)
    assert all(50 <= r.prompt_len <= 150 and 5 <= r.output_len <= 15 for r in reqs)
    assert all(count_tokens(tok, r.prompt) == r.prompt_len for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 10
    assert reqs == random_requests(50, 100, 10, 0.5, seed=4, tokenizer=tok)
    words = random_requests(3, 7, 2, 0.0, seed=0)
    assert all(len(r.prompt.split()) == 7 and r.prompt_len is None for r in words)
    with pytest.raises(ValueError, match="random-range-ratio"):
        random_requests(1, 10, 10, 1.0, seed=0)


def test_sharegpt_errors_name_the_flag(tmp_path, tok):
    bad = tmp_path / "bad.json"
    bad.write_text('{"conversations": []}')
    with pytest.raises(ValueError, match="--dataset-path.*JSON list"):
        sharegpt_requests(bad, 1, 0, tok)
    bad.write_text("[{\"conversations\": [{\"from\": \"gpt\", \"value\": \"x\"}]}]")
    with pytest.raises(ValueError, match="--dataset-path.*human"):
        sharegpt_requests(bad, 1, 0, tok)
    with pytest.raises(ValueError, match="--tokenizer"):
        sharegpt_requests(_sharegpt(tmp_path, ["p"]), 1, 0, None)
    reqs = sharegpt_requests(_sharegpt(tmp_path, ["a", "b"]), 5, 0, tok)  # fewer than asked: reused
    assert len(reqs) == 5 and {r.prompt for r in reqs} == {"a", "b"} and reqs[0].output_len == 3


def test_flags_are_checked(capsys):
    ap = argparse.ArgumentParser(prog="deepinfer")
    bench_serve.register(ap.add_subparsers(dest="command"))
    for flag, value in [("--commit", "not-a-hash"), ("--percentile-metrics", "ttft,foo"),
                        ("--metric-percentiles", "0"), ("--request-rate", "-1"), ("--max-concurrency", "0"),
                        ("--endpoint", "/v1/embeddings")]:
        with pytest.raises(SystemExit):
            ap.parse_args(["bench", "serve", flag, value])
        assert flag in capsys.readouterr().err
    args = ap.parse_args(["bench", "serve", "--request-rate", "inf", "--commit", "0123abc-dirty"])
    assert args.request_rate == float("inf") and args.commit == "0123abc-dirty" and args.bench_command == "serve"
    assert args.run is bench_serve.main  # deepinfer's CLI dispatches on args.run(args)


def test_standalone_module_runs_without_torch(server, tmp_path):
    fake, port = server
    fake.reset()
    code = ("import sys, runpy\nsys.argv = ['bench_serve'] + sys.argv[1:]\n"
            "runpy.run_module('deepinfer.entrypoints.bench_serve', run_name='__main__')\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", code, "--port", str(port), "--model", "m", "--num-prompts", "2",
                          "--random-input-len", "3", "--random-output-len", "2", "--result-filename",
                          str(tmp_path / "r.json")], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Serving Benchmark Result" in res.stdout and "Mean TTFT (ms):" in res.stdout
    assert json.loads((tmp_path / "r.json").read_text())["completed"] == 2
    res = subprocess.run([sys.executable, "-m", "deepinfer.entrypoints.bench_serve", "--dataset-name", "sharegpt"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stderr.strip() == "deepinfer: error: --dataset-name sharegpt needs --dataset-path"
