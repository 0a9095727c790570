"""What each model declares through models/interface.py: the drafting surface, the tensor-parallel
plan and the context-parallel capability (read by worker/drafter.py, distributed/tensor_parallel.py
and distributed/context_parallel.py instead of probing the model)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.layers.moe import MoE
from deepinfer.models.interface import EXPERT_SPLIT, HEAD_SPLIT, CausalLM, Drafting
from deepinfer.models.registry import model_classes
from deepinfer.tools.make_checkpoint import PRESETS


def _meta_model(preset: str, **overrides):
    d = PRESETS[preset]
    cfg_cls, model_cls = model_classes(d.get("model_type", "deepseek_v4"))
    cfg = cfg_cls.from_dict(d)
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    with torch.device("meta"):
        return model_cls(cfg)


@pytest.mark.parametrize("preset", ["tiny", "tiny-dspark", "tiny41"])
def test_every_model_implements_the_interface(preset):
    m = _meta_model(preset)
    assert isinstance(m, CausalLM)
    assert m.supports_context_parallel is True
    assert isinstance(m.drafting, Drafting) and isinstance(m.needs_engram_vocab, bool)


def test_the_drafting_surface_of_each_kind_of_draft_layer():
    mtp, dspark, v41 = _meta_model("tiny"), _meta_model("tiny-dspark"), _meta_model("tiny41")
    assert mtp.drafting == Drafting("mtp", 1, 1, frozenset({"mtp", "dspark"}))
    assert mtp.drafting.runs("mtp") and not mtp.drafting.runs("dspark") and not mtp.drafting.features
    d = dspark.drafting  # V4 -0731's DSpark stages
    assert (d.kind, d.stages, d.block_size) == ("dspark", 3, dspark.config.dspark_block_size)
    assert d.runs("dspark") and not d.runs("mtp") and d.features
    d = v41.drafting
    assert d.kind == "dspark" and d.stages == len(v41.mtp) > 0 and d.block_size == v41.config.dspark_block_size
    assert d.runs("dspark") and d.features
    none = _meta_model("tiny", num_nextn_predict_layers=0).drafting
    assert none.kind is None and none.stages == 0 and not none.runs("mtp")


def test_v4_refuses_draft_features():
    with pytest.raises(ValueError, match="draft_features"):
        _meta_model("tiny").forward(None, [], draft_features=True)


@pytest.mark.parametrize("preset", ["tiny", "tiny41"])
def test_the_tp_plan_covers_every_attention_and_moe_of_trunk_and_draft_layers(preset):
    m = _meta_model(preset)
    plan = m.tp_plan()
    heads = [p for p, s in plan.items() if s.style == HEAD_SPLIT]
    experts = [p for p, s in plan.items() if s.style == EXPERT_SPLIT]
    layers = m.config.num_hidden_layers + (0 if m.mtp is None else len(m.mtp))
    assert len(heads) == len(experts) == layers and len(plan) == 2 * layers
    assert "layers.0.attn" in heads and "layers.0.ffn" in experts
    assert any(p.startswith("mtp.") for p in heads)
    for path in heads:
        assert plan[path].reduce == f"{path}.wo_b"  # the grouped output projection's output is the partial sum
        attn = m.get_submodule(path)
        assert attn.wo_b is m.get_submodule(plan[path].reduce) and attn.n_heads and attn.o_groups
    for path in experts:
        assert plan[path].reduce == path and isinstance(m.get_submodule(path), MoE)
    assert list(plan) == [n for n, _ in m.named_modules() if n in plan]  # named_modules() order
