"""Find a model directory: a local path, DEEPINFER_HF_MODEL_DIR, or the Hugging Face cache/hub.

A hub checkpoint can be fetched in two parts: `resolve_model_dir(..., weights=False)` fetches its small
files (config.json, the shard index, tokenizer files), from which the model can be built on the meta
device and checked against the devices; `fetch_weights` then fetches its weight shards into the same
snapshot (same revision). A checkpoint that cannot fit is refused before its weights are downloaded.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from deepinfer.loader.checkpoint import INDEX_FILE

WEIGHT_PATTERNS = ["*.safetensors"]  # the weight shards: the bulk of a checkpoint
ALLOW_PATTERNS = ["*.json", *WEIGHT_PATTERNS, "tokenizer*"]
logger = logging.getLogger(__name__)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelNotFoundError(FileNotFoundError):
    """No model directory was found; the message lists every place that was searched."""


def _has_config(path: Path) -> bool:
    return (path / "config.json").is_file()


def _short(err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first[:200]}" if first else type(err).__name__


def resolve_model_dir(model: str | None, *, hf_model_dir: str | None = None,
                      offline: bool = False, weights: bool = True) -> Path:
    """The directory of `model`: a local path, a directory under `hf_model_dir`, or a hub snapshot
    (from the cache, downloaded unless `offline`). `weights=False`: a hub snapshot is fetched without
    its weight shards (fetch_weights adds them); local directories are returned as they are either way."""
    looked: list[str] = []
    root = Path(hf_model_dir).expanduser() if hf_model_dir else None
    if not model:
        if root is not None and _has_config(root):
            return root
        looked.append(f"hf_model_dir {root}/config.json" if root else "no model and no hf_model_dir given")
        raise _not_found(model, looked)

    local = Path(model).expanduser()
    if local.is_dir():
        return local
    looked.append(f"local path {local.resolve()}")
    if not _HUB_ID.match(model):
        raise _not_found(model, looked)

    if root is not None:
        org, name = model.split("/")
        for cand in (root / org / name, root / name):
            if _has_config(cand):
                return cand
            looked.append(f"hf_model_dir candidate {cand}")

    path = _snapshot(model, looked, offline, None if weights else WEIGHT_PATTERNS)
    if not _has_config(path):
        looked.append(f"HF snapshot {path} (has no config.json)")
        raise _not_found(model, looked)
    return path


def fetch_weights(model: str, path: Path, *, offline: bool = False) -> Path:
    """The hub snapshot `path` of `model` (resolve_model_dir(model, weights=False)) with its weight shards
    fetched, at the snapshot's revision. Any other directory, or one whose shards are all present, is
    returned as it is (the checkpoint reader names any shard still missing)."""
    path = Path(path)
    if has_weights(path) or path.parent.name != "snapshots" or not _HUB_ID.match(model):
        return path
    return _snapshot(model, [], offline, None, revision=path.name)


def has_weights(path: Path) -> bool:
    """Whether the directory holds its weights: every shard its index names, or without an index, a
    *.safetensors file."""
    index = weight_index(path)
    if index is None:
        return any(Path(path).glob("*.safetensors"))
    return all((Path(path) / f).is_file() for f in set(index.values()))


def weight_index(path: Path) -> dict[str, str] | None:
    """The shard index's weight_map (tensor name -> shard file), None if the directory has no index."""
    index = Path(path) / INDEX_FILE
    if not index.is_file():
        return None
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: 'weight_map' must map tensor names to shard files")
    return weight_map


def _snapshot(model: str, looked: list[str], offline: bool, ignore: list[str] | None,
              revision: str | None = None) -> Path:
    """snapshot_download of ALLOW_PATTERNS less `ignore`, from the cache (offline) or the hub."""
    from huggingface_hub import constants, snapshot_download

    offline = offline or bool(constants.HF_HUB_OFFLINE)
    cache = constants.HF_HUB_CACHE
    if not offline:
        _announce_download(model, cache, ignore, revision)
    try:
        return Path(snapshot_download(model, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                      ignore_patterns=ignore, cache_dir=cache, local_files_only=offline))
    except Exception as e:  # hub / cache errors vary by version; report them, don't crash
        looked.append(f"HF cache {cache}" + (" (offline)" if offline else f" and the hub: {_short(e)}"))
        if offline:
            looked.append(_short(e))
        raise _not_found(model, looked) from e


def _announce_download(model: str, cache: str, ignore: list[str] | None = None, revision: str | None = None) -> None:
    """Log how much of `model` the hub download will fetch (files not in the cache yet, less `ignore`d
    patterns, at `revision` or the default branch), before it starts."""
    from huggingface_hub import HfApi, try_to_load_from_cache
    from huggingface_hub.utils import filter_repo_objects

    try:
        info = HfApi().model_info(model, files_metadata=True, **({"revision": revision} if revision else {}))
    except Exception as e:  # the download itself reports what is wrong with the hub or the id
        logger.info("%s: could not read its file list from the hub (%s)", model, _short(e))
        return
    files = list(filter_repo_objects(info.siblings or [], allow_patterns=ALLOW_PATTERNS,
                                        ignore_patterns=ignore, key=lambda f: f.rfilename))
    missing = [f for f in files if not isinstance(try_to_load_from_cache(model, f.rfilename, cache_dir=cache,
                                                                         revision=info.sha), str)]
    if not missing:
        return
    size = sum(f.size or 0 for f in missing)
    logger.info("%s: downloading %d of %d files, %.1f GB, from the Hugging Face hub into %s", model,
                len(missing), len(files), size / 1e9, cache)


def _not_found(model: str | None, looked: list[str]) -> ModelNotFoundError:
    return ModelNotFoundError(f"model {model!r} not found; looked in: " + "; ".join(looked))
