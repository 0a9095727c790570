"""What a new user sees first: the demo checkpoint and hub downloads are announced before they
happen, and the README only points at files a clone of the repository has."""
from __future__ import annotations

import logging
import re
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
from huggingface_hub import constants

import deepinfer.tools.demo as demo
from deepinfer.loader import resolve

ROOT = Path(__file__).resolve().parents[1]


def test_the_random_demo_checkpoint_is_announced_once(tmp_path, monkeypatch, caplog):
    def fake_write(out, preset, seed, dtype):
        (out / "model.safetensors.index.json").write_text("{}")
    monkeypatch.setattr(demo, "write_checkpoint", fake_write)
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        path = demo.random_demo_checkpoint(tmp_path)
        demo.random_demo_checkpoint(tmp_path)
    said = [r.getMessage() for r in caplog.records if "demo" in r.getMessage()]
    assert any(str(path) in m and "writing" in m for m in said), said
    assert sum("writing" in m for m in said) == 1  # the second call finds it written


def test_a_hub_download_says_how_much_before_it_starts(tmp_path, monkeypatch, caplog):
    repo = "deepseek-ai/DeepSeek-V4.1-Flash-1017"
    files = [("config.json", 2_000), ("model-00001.safetensors", 150_000_000_000),
             ("model-00002.safetensors", 160_000_000_000), ("tokenizer.json", 8_000_000), ("README.md", 10)]
    cached = {"model-00001.safetensors"}
    order = []
    info = SimpleNamespace(sha="f" * 40, siblings=[SimpleNamespace(rfilename=f, size=n) for f, n in files])
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, rid, files_metadata=False: info)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache",
                        lambda rid, f, cache_dir=None, revision=None: str(tmp_path / f) if f in cached else None)

    def fake_download(rid, **kw):
        order.append([r.getMessage() for r in caplog.records])  # what had been said when it started
        snap = tmp_path / "snap"
        snap.mkdir(exist_ok=True)
        (snap / "config.json").write_text("{}")
        return str(snap)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        assert resolve.resolve_model_dir(repo) == tmp_path / "snap"
    [said] = order
    # config.json, the second shard and tokenizer.json are missing; README.md is not downloaded at all
    assert len(said) == 1 and "3 of 4 files" in said[0] and "160.0 GB" in said[0] and repo in said[0], said


def test_a_hub_download_of_a_cached_model_says_nothing(tmp_path, monkeypatch, caplog):
    info = SimpleNamespace(sha="f" * 40, siblings=[SimpleNamespace(rfilename="config.json", size=10)])
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, rid, files_metadata=False: info)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache",
                        lambda rid, f, cache_dir=None, revision=None: str(tmp_path / f))
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        resolve._announce_download("org/model", str(tmp_path))
    assert not caplog.records


# folders of this repository a README may point into
_TREE = ("deepinfer", "benchmarks", "tests", "examples", "docs", ".ci", "requirements")


@pytest.mark.parametrize("doc", ["README.md", *[str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")],
                                 "benchmarks/NOTES.md"])
def test_documents_point_only_at_files_in_the_repository(doc):
    text = (ROOT / doc).read_text()
    assert "shared/" not in text, f"{doc} points outside the repository (shared/ is not part of a clone)"
    paths = set(re.findall(r"`((?:%s)/[\w./-]+)`" % "|".join(map(re.escape, _TREE)), text))
    paths |= {p for p in re.findall(r"\]\(([\w./-]+)\)", text) if not p.startswith("http")}
    missing = sorted(p for p in paths if not (ROOT / p).exists() and not (ROOT / Path(doc).parent / p).exists())
    assert not missing, f"{doc} names files the repository does not have: {missing}"
