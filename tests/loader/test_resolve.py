from __future__ import annotations

import pytest
from huggingface_hub import constants

from deepinfer.loader.resolve import ModelNotFoundError, resolve_model_dir


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def _model(d):
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    return d


def test_local_dir(tmp_path):
    d = _model(tmp_path / "m")
    assert resolve_model_dir(str(d)) == d


def test_hf_model_dir(tmp_path, hub_cache):
    root = tmp_path / "models"
    _model(root / "deepseek-ai" / "DeepSeek-V4-Flash")
    _model(root / "Other")
    assert resolve_model_dir("deepseek-ai/DeepSeek-V4-Flash", hf_model_dir=str(root), offline=True) == \
        root / "deepseek-ai" / "DeepSeek-V4-Flash"
    assert resolve_model_dir("org/Other", hf_model_dir=str(root), offline=True) == root / "Other"
    direct = _model(tmp_path / "direct")
    assert resolve_model_dir(None, hf_model_dir=str(direct)) == direct
    assert resolve_model_dir("", hf_model_dir=str(direct)) == direct


def test_hub_id_in_offline_cache(hub_cache):
    repo = hub_cache / "models--org--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = _model(repo / "snapshots" / commit)
    (snap / "model.safetensors").write_bytes(b"")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    assert resolve_model_dir("org/tiny", offline=True) == snap


def test_not_found_lists_places(tmp_path, hub_cache):
    root = tmp_path / "models"
    root.mkdir()
    with pytest.raises(ModelNotFoundError) as ei:
        resolve_model_dir("org/missing", hf_model_dir=str(root), offline=True)
    msg = str(ei.value)
    assert isinstance(ei.value, FileNotFoundError)
    assert "'org/missing'" in msg
    assert "local path" in msg and "org/missing" in msg
    assert str(root / "org" / "missing") in msg and str(root / "missing") in msg
    assert str(hub_cache) in msg and "offline" in msg
    assert msg.count("\n") == 0


def test_not_found_local_path_and_empty(tmp_path):
    with pytest.raises(ModelNotFoundError, match="local path"):
        resolve_model_dir(str(tmp_path / "a" / "b" / "c"))
    with pytest.raises(ModelNotFoundError, match="hf_model_dir"):
        resolve_model_dir(None, hf_model_dir=str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="no model and no hf_model_dir"):
        resolve_model_dir(None)
