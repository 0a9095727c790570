"""benchmarks/scale_model.py, the memory and scale model on paper: its weight split, cache and
all-to-all arithmetic against hand counts and deepinfer's own allocations, and a smoke run of the
whole report."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sm():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import scale_model

        yield scale_model
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


@pytest.fixture(scope="module")
def v4_shipped(sm):
    cfg = sm.released_config("V4-Flash")
    model = sm.build_meta(cfg, quantized=True)
    return cfg, model, sm.weight_split(model, cfg.n_routed_experts)


def test_v4_flash_shipped_weights_match_the_released_size(sm, v4_shipped):
    cfg, model, split = v4_shipped
    everything = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    assert split.total == everything
    # deepseek-v4.md: ~160 GB as shipped (FP4 experts, FP8 elsewhere); 13.4 MB per FP4 expert
    assert 150e9 < split.total < 170e9
    assert split.expert_bytes == pytest.approx(13.4e6, rel=0.02)
    assert split.moe_layers == cfg.num_hidden_layers == 43
    assert split.engram == 0 and 0 < split.head < split.replicated


def test_weights_per_gpu_split_experts_and_keep_the_rest(sm, v4_shipped):
    _, _, split = v4_shipped
    assert sm.weights_per_gpu(split, 1, 0, "none") == pytest.approx(split.total)
    per = [sm.weights_per_gpu(split, n, 0, "none") for n in (4, 8, 16, 64)]
    assert per == sorted(per, reverse=True)
    assert per[0] == pytest.approx(split.replicated + split.routed / 4)
    # one redundant slot per GPU costs one expert of every MoE layer (trunk and MTP)
    extra = sm.weights_per_gpu(split, 8, 1, "none") - sm.weights_per_gpu(split, 8, 0, "none")
    assert extra == pytest.approx(split.routed_slot) and extra == pytest.approx(split.routed / 256)


def test_v41_engram_is_host_or_split(sm):
    cfg = sm.released_config("V4.1-Flash")
    split = sm.weight_split(sm.build_meta(cfg, quantized=True), cfg.n_routed_experts)
    assert split.engram > 150e9
    host, sharded = sm.weights_per_gpu(split, 8, 0, "host"), sm.weights_per_gpu(split, 8, 0, "sharded")
    assert sharded - host == pytest.approx(split.engram / 8)
    # the draft stages' experts (128 each) make an expert slot more than one trunk expert per layer
    assert split.routed_slot > split.expert_bytes * split.moe_layers


def test_cache_cost_matches_an_allocation(sm):
    from deepinfer.models.config import DeepseekV4Config
    from deepinfer.tools.make_checkpoint import PRESETS, checkpoint_config
    from deepinfer.worker.kv_cache import allocate_v4_cache, cache_spec

    cfg = DeepseekV4Config.from_dict(checkpoint_config(PRESETS["tiny"], "fp8"))
    spec = cache_spec(cfg, "bfloat16")
    cost = sm.cache_cost(cfg, "bfloat16")
    tokens = spec.block_size * max(spec.ratios) * 3
    blocks = {m: tokens // (spec.block_size * m) for m in spec.ratios}
    cache = allocate_v4_cache(cfg, 1, blocks, "bfloat16", "meta")
    allocated = sum(c.nbytes() for c in cache.layers + cache.mtp)
    assert cost.request_bytes(tokens) == pytest.approx(allocated)


def test_cache_budget_is_the_engine_fraction_of_what_is_left(sm):
    gib = 1 << 30
    left = (sm.assumption("hbm_gib") - sm.assumption("context_gib")) * gib
    assert sm.cache_budget(10 * gib) == pytest.approx(0.9 * (left - 10 * gib))
    assert sm.cache_budget(left + gib) == pytest.approx(-gib)


def test_a2a_bytes_by_hand(sm):
    per_copy = 8 * (1 + 4 / 128 + 2)
    nv, ib = sm.a2a_bytes(batch=2, layers=3, top_k=6, hidden=8, gpus=4)
    assert nv == pytest.approx(36 * 3 / 4 * per_copy) and ib == 0
    nv, ib = sm.a2a_bytes(batch=2, layers=3, top_k=6, hidden=8, gpus=16)
    assert nv == pytest.approx(36 * 7 / 16 * per_copy) and ib == pytest.approx(36 * 8 / 16 * per_copy)
    assert sm.a2a_ms(450e9, 10e9) == pytest.approx(1e3 * max(1.0, 10 / 50))


def test_decode_step_scaling_and_ep_saving(sm, v4_shipped):
    _, _, split = v4_shipped
    hbm = 4000.0
    head_ms = 1e3 * split.head / (hbm * 1e9)
    engine, replay, adjusted = sm.decode_step_ms((5.0, 4.0), 4, split, hbm, batch=64, gpus=1, top_k=6)
    assert engine == pytest.approx((5.0 - head_ms) / 4 * 43 + head_ms)
    assert replay == pytest.approx((4.0 - head_ms) / 4 * 43 + head_ms)
    assert adjusted == pytest.approx(replay)        # one GPU holds every expert: nothing saved
    _, _, on4 = sm.decode_step_ms((5.0, 4.0), 4, split, hbm, batch=64, gpus=4, top_k=6)
    touched1 = 256 * (1 - (1 - 6 / 256) ** 64)
    touched4 = 64 * (1 - (1 - 6 / 256) ** 256)
    saved = (touched1 - touched4) * split.expert_bytes / (hbm * 1e9) * 1e3
    assert on4 == pytest.approx(replay - 43 * saved)
    assert math.isclose(sm.distinct_experts(10**6, 256, 6, 64), 64)


def test_report_smoke(sm, tmp_path, monkeypatch):
    out = tmp_path / "scale.md"
    monkeypatch.setattr(sys, "argv", ["scale_model.py", "--commit", "abcdef1", "--out", str(out)])
    sm.main()
    text = out.read_text()
    assert "a model, not a measurement" in text
    assert f"`python benchmarks/scale_model.py --commit abcdef1 --out {out}`" in text
    assert "commit abcdef1" in text
    for name in sm.ASSUMPTIONS:
        assert f"`{name}`" in text
    for model in ("V4-Flash", "V4.1-Flash"):
        for fmt in ("shipped", "bf16"):
            assert f"## {model}, {fmt} weights" in text
    rows = [line for line in text.splitlines() if line.startswith("| 64 | ")]
    assert rows and "4,573" in text and "606" in text
    # V4-Flash in bf16 (542 GiB) cannot fit 4 H200s
    v4_bf16 = text.split("## V4-Flash, bf16 weights")[1].split("##")[0]
    assert "| 4 | none | 0 |" in v4_bf16 and "does not fit" in v4_bf16
