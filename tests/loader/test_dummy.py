"""load_format="dummy": the model is built from config.json alone, with the tensors, shapes and formats a real
load gives, random values in them (finite, FP8 codes and scales valid, hash routes distinct experts), the
same values for the same seed, and the engine serves it (one process, host Engram, DP + EP ranks, the CLI)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import EngineConfig
from deepinfer.loader.model_loader import load_model
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

ROOT = Path(__file__).resolve().parents[2]
KW = dict(device="cpu", dtype="float32", kv_cache_memory=32 << 20, max_model_len=256, max_num_seqs=8)
GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=1)


@pytest.fixture(scope="module", params=["tiny", "tiny41"])
def dirs(request, tmp_path_factory):
    """(full checkpoint, the writer's config-only directory of the same preset: config.json and tokenizer)."""
    root = tmp_path_factory.mktemp(request.param)
    full = Path(write_checkpoint(root / "full", PRESETS[request.param], seed=0, dtype="fp8"))
    bare = Path(write_checkpoint(root / "config-only", PRESETS[request.param], dtype="fp8", weights=False))
    assert sorted(p.name for p in bare.iterdir()) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    for name in ("config.json", "tokenizer.json"):
        assert (bare / name).read_text() == (full / name).read_text()
    return full, bare


@pytest.mark.parametrize("quantized", [True, False])
def test_a_dummy_model_holds_what_a_real_load_holds(dirs, quantized):
    full, bare = dirs
    real = load_model(full, dtype=torch.float32, quantized=quantized)[0].state_dict()
    dummy = load_model(bare, dtype=torch.float32, quantized=quantized, load_format="dummy")[0].state_dict()
    assert real.keys() == dummy.keys()  # the draft layers included: a dummy load keeps them
    for key, t in real.items():
        assert (dummy[key].shape, dummy[key].dtype) == (t.shape, t.dtype), key
    for key, t in dummy.items():
        if t.dtype == torch.float8_e4m3fn:
            assert not torch.isnan(t.float()).any(), key
        elif t.dtype == torch.float8_e8m0fnu:
            assert (t.view(torch.uint8) == 127 - 6).all(), key
        elif t.is_floating_point():
            assert torch.isfinite(t).all(), key
            if key.endswith("norm.weight"):
                assert (t == 1).all(), key
            elif t.numel() > 1:
                assert t.std() > 0, key
        if key.endswith(".tid2eid"):  # V4's hash layers: distinct experts of the gate's, per token
            experts = dummy[key[: -len("tid2eid")] + "weight"].shape[0]
            assert int(t.min()) >= 0 and int(t.max()) < experts
            assert all(len(set(row)) == t.shape[1] for row in t.tolist()), key


def test_the_same_seed_gives_the_same_weights(dirs):
    _, bare = dirs
    a, b, c = (load_model(bare, dtype=torch.float32, load_format="dummy", seed=s)[0].state_dict() for s in (0, 0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point() and "norm" not in k)


def test_llm_serves_a_dummy_model_in_the_shipped_formats(dirs, caplog):
    _, bare = dirs
    with caplog.at_level("INFO", logger="deepinfer"):
        llm = LLM(str(bare), quantization="fp8", load_format="dummy", **KW)
    assert any("load_format='dummy'" in r.getMessage() for r in caplog.records)
    out = llm.generate(["def f(x):", "hello"], GREEDY, use_tqdm=False)
    for o in out:
        assert len(o.outputs[0].token_ids) == 6
        assert all(math.isfinite(lp[t]) for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids))


def test_host_engram_tables_of_a_dummy_model(tmp_path):
    full = Path(write_checkpoint(tmp_path / "full", PRESETS["tiny41"], seed=0, dtype="fp8"))
    (full / "model.safetensors.index.json").unlink()
    for f in full.glob("*.safetensors"):
        f.unlink()
    llm = LLM(str(full), engram_device="cpu", load_format="dummy", **KW)
    tables = [t for n, t in llm.model.state_dict().items() if "engram" in n and t.dim() == 2]
    assert tables and all(t.device.type == "cpu" and not t.is_meta for t in tables)
    assert len(llm.generate(["hello"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 6


def test_an_unknown_load_format_is_refused_by_name():
    with pytest.raises(ValueError, match="load_format: 'pt' is not one of"):
        EngineConfig(load_format="pt")


def test_two_data_parallel_ranks_with_expert_parallelism_serve_a_dummy_model(tmp_path):
    """The multi-GPU runs of issue 21 load a released config this way: each rank fills only its experts."""
    full = Path(write_checkpoint(tmp_path / "full", PRESETS["tiny"], seed=0, dtype="fp8"))
    for f in [*full.glob("*.safetensors"), full / "model.safetensors.index.json"]:
        f.unlink()
    llm = LLM(str(full), data_parallel_size=2, enable_expert_parallel=True, load_format="dummy",
              skip_tokenizer_init=True, **KW)
    try:
        experts = llm.model.layers[1].ffn.experts.num_experts
        assert experts == PRESETS["tiny"]["n_routed_experts"] // 2
        out = llm.generate([[1, 2, 3], [4, 5, 6, 7]], GREEDY, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]
    finally:
        llm.close()


def test_the_cli_takes_load_format(dirs):
    _, bare = dirs
    res = subprocess.run([sys.executable, "-m", "deepinfer.entrypoints.cli", "generate", "--model", str(bare),
                          "--load-format", "dummy", "--prompt", "Hello", "--max-tokens", "3", "--temperature", "0",
                          "--device", "cpu", "--dtype", "float32"],
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert len(json.loads(res.stdout.strip().splitlines()[-1])["token_ids"]) == 3
