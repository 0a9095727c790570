"""A hub checkpoint is fetched in two parts around LLM's fit check: its small files first (config.json,
shard index, tokenizer), its weight shards only once the model built from them on the meta device fits.
No network: huggingface_hub.snapshot_download is replaced by a fake hub that copies a tiny checkpoint's
files, filtered by the patterns asked for (huggingface_hub's own filter), and records every request."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import constants
from huggingface_hub.utils import filter_repo_objects

from deepinfer import LLM, SamplingParams
from deepinfer.loader.resolve import fetch_weights, has_weights, resolve_model_dir
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

REPO = "org/tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("hub") / "src", PRESETS["tiny"], seed=5, dtype="fp8")


class FakeHub:
    """snapshot_download over `src` as repo REPO at COMMIT, into the HF cache layout under `cache`."""

    def __init__(self, src: Path, cache: Path):
        self.src, self.cache, self.calls, self.events = src, cache, [], []

    def __call__(self, repo_id, *, revision=None, allow_patterns=None, ignore_patterns=None, cache_dir=None,
                 local_files_only=False, **kw):
        assert repo_id == REPO and revision in (None, COMMIT) and cache_dir == str(self.cache)
        files = sorted(p.name for p in self.src.iterdir())
        got = list(filter_repo_objects(files, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns))
        self.calls.append({"allow": allow_patterns, "ignore": ignore_patterns, "revision": revision, "files": got,
                           "offline": local_files_only})
        self.events.append(("download", tuple(got)))
        snap = self.cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / COMMIT
        snap.mkdir(parents=True, exist_ok=True)
        for f in got:
            shutil.copy(self.src / f, snap / f)
        return str(snap)


@pytest.fixture
def hub(ckpt, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    fake = FakeHub(ckpt, cache)
    for name in ("HF_HUB_OFFLINE", "DEEPINFER_HF_MODEL_DIR", "DEEPINFER_MODEL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", _no_network)
    return fake


def _no_network(*a, **kw):
    raise OSError("no network in tests")


def _shards(names) -> list[str]:
    return [f for f in names if f.endswith(".safetensors")]


def _record_checks(monkeypatch, hub: FakeHub, name: str) -> None:
    import deepinfer.llm as llm

    check = getattr(llm, name)

    def recorded(cfg, meta):
        hub.events.append(("check", None))
        return check(cfg, meta)

    monkeypatch.setattr(llm, name, recorded)


def test_small_files_first_then_the_shards_at_the_same_revision(hub, ckpt):
    path = resolve_model_dir(REPO, weights=False)
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    assert not _shards(hub.calls[0]["files"]) and not has_weights(path)
    assert fetch_weights(REPO, path) == path and has_weights(path)
    assert hub.calls[1]["revision"] == COMMIT
    assert sorted(_shards(hub.calls[1]["files"])) == sorted(_shards(p.name for p in ckpt.iterdir()))
    assert fetch_weights(REPO, path) == path and len(hub.calls) == 2  # complete: nothing more is asked


def test_a_checkpoint_that_does_not_fit_is_refused_before_its_shards_are_downloaded(hub, monkeypatch):
    _record_checks(monkeypatch, hub, "_check_before_load")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 20, 2 << 20))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    with pytest.raises(ValueError) as e:
        LLM(REPO, device="cuda", kv_cache_memory=1 << 20, skip_tokenizer_init=True)
    msg = str(e.value)
    assert "does not fit cuda (Fake GPU)" in msg
    assert re.search(r"needs [\d.]+ [MG]iB per GPU .* and 1\.0 MiB is available", msg), msg
    assert [k for k, _ in hub.events] == ["download", "check"]
    assert not any(_shards(c["files"]) for c in hub.calls)  # no weight shard was asked for
    assert all("*.safetensors" in (c["ignore"] or []) for c in hub.calls)


def test_tensor_parallel_ranks_that_do_not_fit_are_refused_before_the_shards(hub, monkeypatch):
    _record_checks(monkeypatch, hub, "_check_ranks_fit")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 20, 2 << 20))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    with pytest.raises(ValueError, match=r"does not fit cuda:0 .* as tensor_parallel_size=2.* is available"):
        LLM(REPO, device="cuda", tensor_parallel_size=2, kv_cache_memory=1 << 20, skip_tokenizer_init=True)
    assert [k for k, _ in hub.events] == ["download", "check"]
    assert not any(_shards(c["files"]) for c in hub.calls)


def test_a_fitting_checkpoint_downloads_its_shards_after_the_check_and_serves(hub, ckpt, monkeypatch):
    _record_checks(monkeypatch, hub, "_check_before_load")
    llm = LLM(REPO, device="cpu", dtype="float32", kv_cache_memory=4 << 20, skip_tokenizer_init=True)
    kinds = [k for k, _ in hub.events]
    # the check on the small files (the model built on the meta device from them), then the shards: one check
    assert kinds == ["download", "check", "download"], hub.events
    assert not _shards(hub.events[0][1]) and _shards(hub.events[2][1])
    assert llm.model_dir == hub.cache / "models--org--tiny" / "snapshots" / COMMIT
    out = llm.generate([[0, 5, 17]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_offline_resolution_and_local_directories_are_unchanged(hub, ckpt, monkeypatch):
    assert resolve_model_dir(str(ckpt), weights=False) == ckpt and has_weights(ckpt)
    assert fetch_weights(str(ckpt), ckpt) == ckpt and not hub.calls  # a local directory: no hub
    path = resolve_model_dir(REPO, offline=True, weights=False)
    fetch_weights(REPO, path, offline=True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # HF_HUB_OFFLINE=1 as huggingface_hub reads it
    resolve_model_dir(REPO)
    assert [(c["offline"], c["ignore"]) for c in hub.calls] == [(True, ["*.safetensors"]), (True, None), (True, None)]
