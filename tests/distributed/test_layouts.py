"""Every feature on every layout (CPU, gloo ranks): LLM with tensor, data + expert, data x tensor and context x
tensor parallelism gives one process's greedy tokens with the model's own speculative decoding on (V4.1's DSpark
stages, V4's MTP layer), a JSON schema and prompt_logprobs, in one generate call; for V4 and V4.1.

Tolerance: prompt logprobs within LOGPROB_TOL of one process. Tensor parallelism adds each rank's partial sums
(its heads' rows of wo_b, its experts) in another order than one process does: fp32 moves a logprob by a few
1e-6 on the tiny models (tests/distributed/test_tensor_parallel.py measured <= 2e-6); the other layouts compute
every row as one process does. Greedy tokens and structured outputs must be equal.

Reduced for CI time (2 cores; a world of 4 gloo ranks on them): one engine per (model, layout), three
prompts; the V4 model runs the layouts whose code paths differ from V4.1's (its MTP drafter, its compressors).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.distributed import parallel_state
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

pytest.importorskip("xgrammar")

LOGPROB_TOL = 1e-4
MEMORY = 32 << 20
# every value bounded: a random model's greedy text closes the object within a few dozen tokens
SCHEMA = {"type": "object", "properties": {"tag": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
          "required": ["tag", "ok"], "additionalProperties": False}
LAYOUTS = {
    "mp1": dict(distributed_executor_backend="mp"),  # one rank through the multi-process executor
    "tp2": dict(tensor_parallel_size=2),
    "dp2-ep": dict(data_parallel_size=2, enable_expert_parallel=True),
    "dp2xtp2": dict(data_parallel_size=2, tensor_parallel_size=2),
    "cp2xtp2": dict(context_parallel_size=2, tensor_parallel_size=2),
}
# two "nodes" on localhost: this process is node 0 (rank 0, the driver), a `deepinfer serve --node-rank 1` process
# node 1 (rank 1), meeting through torch.distributed's env:// rendezvous
TWO_NODES = dict(tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1")
LAYOUTS["2node-tp2"] = TWO_NODES
# (model, layout) pairs run in CI; V4 on the layouts that reach its own MTP drafter through every rank kind
# and V4-Flash-0731's DSpark stages (V4 blocks drafting from the trunk's features) split by heads and by experts
CASES = [("v41", name) for name in LAYOUTS] + [("v4", "tp2"), ("v4", "cp2xtp2"), ("v4-0731", "tp2"),
                                               ("v4-0731", "dp2-ep")]
SPEC = {"v41": {"method": "dspark", "num_speculative_tokens": 2}, "v4": {"method": "mtp", "num_speculative_tokens": 1},
        "v4-0731": {"method": "dspark", "num_speculative_tokens": 3}}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    return {"v4": write_checkpoint(root / "v4", {**PRESETS["tiny"], "index_topk": 64}, seed=11, dtype="fp8"),
            "v41": write_checkpoint(root / "v41", PRESETS["tiny41"], seed=5, dtype="fp8"),
            "v4-0731": write_checkpoint(root / "v4-0731", {**PRESETS["tiny-dspark"], "index_topk": 64}, seed=11,
                                        dtype="fp8")}


def _requests(vocab: int = 500):
    """A structured request, a prompt_logprobs request and a long prompt, all greedy, in one call; then the long
    prompt alone (context parallelism splits a step that is one request's prefill chunk of 2 * cp * the largest
    compression ratio tokens at least)."""
    g = torch.Generator().manual_seed(0)
    ids = lambda n: [0] + torch.randint(7, vocab, (n,), generator=g).tolist()  # noqa: E731
    prompts = [ids(9), ids(14), ids(150)]
    params = [SamplingParams(temperature=0, max_tokens=64, so_args={"schema_type": "json", "schema": SCHEMA}),
              SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=2, logprobs=1),
              SamplingParams(temperature=0, max_tokens=8)]
    return prompts, params


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_node(ckpt, layout: dict) -> subprocess.Popen:
    """Node 1 of a two-node layout, as a user starts it: the CLI with the driver's parallel flags, its node rank."""
    argv = [sys.executable, "-m", "deepinfer.entrypoints.cli", "serve", "--model", str(ckpt), "--device", "cpu",
            "-tp", str(layout["tensor_parallel_size"]), "--nnodes", "2", "--node-rank", "1",
            "--master-addr", layout["master_addr"], "--master-port", str(layout["master_port"])]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _run(ckpt, model: str, layout: dict, device: str = "cpu", spec: bool = True) -> tuple[list, dict]:
    # V4.1 prefills with bounded replay (its default); keeping 24 rows (the window, 16, plus a DSpark block, 5, and
    # some) of the 151-token prompt leaves context parallelism the first 120 to split (runs and reference alike)
    keep = {"yoco_prefill_keep_tokens": 24} if model == "v41" and "context_parallel_size" in layout else {}
    node = None
    if layout.get("nnodes", 1) > 1:
        layout = dict(layout, master_port=_free_port())
        node = _start_node(ckpt, layout)
    llm = LLM(str(ckpt), device=device, dtype="float32", kv_cache_dtype="float32", kv_cache_memory=MEMORY,
              max_num_batched_tokens=256, seed=0, speculative_config=SPEC[model] if spec else None, **keep,
              **layout)
    try:
        prompts, params = _requests()
        outs = llm.generate(prompts, params, use_tqdm=False)
        outs += llm.generate(prompts[-1:], params[-1:], use_tqdm=False)
        metrics = llm.get_metrics()
        cp_steps = llm.engine.executor.worker.runner.cp_steps if "context_parallel_size" in layout else None
        ahead = llm.engine.ahead_launches if "data_parallel_size" in layout else None
    finally:
        llm.close()
        if node is not None:
            out, err = node.communicate(timeout=60)
            assert node.returncode == 0, err[-3000:]  # node 1 ends when the driver closes the engine
    return outs, dict(metrics, cp_steps=cp_steps, ahead_launches=ahead)


_REFS: dict = {}


def _reference(ckpts, model: str, layout: dict, device: str = "cpu", spec: bool = True):
    key = (model, "context_parallel_size" in layout, device, spec)
    if key not in _REFS:
        _REFS[key] = _run(ckpts[model], model, {}, device, spec)
    return _REFS[key]


def _check(got, want, metrics, want_metrics, spec: bool = True) -> None:
    for g, w in zip(got, want, strict=True):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in w.outputs]
    schema_out = got[0].outputs[0]
    assert schema_out.finish_reason == "stop" and set(json.loads(schema_out.text)) == {"tag", "ok"}
    assert got[1].prompt_logprobs is not None and len(got[1].prompt_logprobs) == len(got[1].prompt_token_ids)
    worst = 0.0
    for gl, wl in zip(got[1].prompt_logprobs[1:], want[1].prompt_logprobs[1:], strict=True):
        assert gl.keys() == wl.keys()
        worst = max(worst, max(abs(gl[k] - wl[k]) for k in wl))
    assert worst <= LOGPROB_TOL, worst
    if spec:
        assert metrics["num_drafts"] > 0  # the drafter ran on every rank and its drafts were verified
    elif metrics["ahead_launches"] is not None:
        assert metrics["ahead_launches"] > 0  # the replicas' steps were launched ahead (async scheduling)
    if metrics["cp_steps"] is not None:
        assert metrics["cp_steps"] >= 1  # the long prompt's prefill was split over the context-parallel ranks
        # and the drafter saw the split prefill's whole output, as one process's: the same drafts were accepted
        assert (metrics["num_drafts"], metrics["num_accepted_tokens"]) == \
            (want_metrics["num_drafts"], want_metrics["num_accepted_tokens"])


@pytest.mark.parametrize("model, name", CASES, ids=[f"{m}-{n}" for m, n in CASES])
def test_layout_matches_one_process_with_every_feature(ckpts, model, name):
    layout = LAYOUTS[name]
    want, want_metrics = _reference(ckpts, model, layout)
    got, metrics = _run(ckpts[model], model, layout)
    assert parallel_state.rank_info() is None  # closed: this process can start another engine
    _check(got, want, metrics, want_metrics)


# async scheduling: a step is launched before the one before it is collected, on every replica at once (a
# grammar's masks follow the launch); speculative decoding still plans each step from the last one's accepted
# tokens (no step ahead), so these runs are without it
ASYNC_CASES = [("v41", "dp2-ep"), ("v41", "dp2xtp2")]


@pytest.mark.parametrize("model, name", ASYNC_CASES, ids=[f"{m}-{n}-async" for m, n in ASYNC_CASES])
def test_data_parallel_layout_launches_ahead_and_matches_one_process(ckpts, model, name):
    layout = LAYOUTS[name]
    want, want_metrics = _reference(ckpts, model, layout, spec=False)
    got, metrics = _run(ckpts[model], model, layout, spec=False)
    _check(got, want, metrics, want_metrics, spec=False)


GPU_LAYOUTS = ["tp2", "dp2-ep", "dp2xtp2", "cp2xtp2"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_LAYOUTS)
def test_layout_on_gpus_matches_one_gpu(ckpts, name):
    """The same on one GPU per rank (NCCL), V4.1, fp32 (tensor parallelism's partial sums move logprobs by
    ~1e-6 as on the CPU)."""
    layout = LAYOUTS[name]
    world = layout.get("tensor_parallel_size", 1) * layout.get("data_parallel_size", 1) * \
        layout.get("context_parallel_size", 1)
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    got, metrics = _run(ckpts["v41"], "v41", layout, "cuda")
    _check(got, *_reference(ckpts, "v41", layout, "cuda")[:1], metrics, _reference(ckpts, "v41", layout, "cuda")[1])
