"""Find a model directory: a local path, DEEPINFER_HF_MODEL_DIR, or the Hugging Face cache/hub."""
from __future__ import annotations

import re
from pathlib import Path

ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelNotFoundError(FileNotFoundError):
    """No model directory was found; the message lists every place that was searched."""


def _has_config(path: Path) -> bool:
    return (path / "config.json").is_file()


def _short(err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first[:200]}" if first else type(err).__name__


def resolve_model_dir(model: str | None, *, hf_model_dir: str | None = None,
                      offline: bool = False) -> Path:
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

    from huggingface_hub import constants, snapshot_download

    offline = offline or bool(constants.HF_HUB_OFFLINE)
    cache = constants.HF_HUB_CACHE
    try:
        path = Path(snapshot_download(model, allow_patterns=ALLOW_PATTERNS, cache_dir=cache,
                                      local_files_only=offline))
    except Exception as e:  # hub / cache errors vary by version; report them, don't crash
        looked.append(f"HF cache {cache}" + (" (offline)" if offline else f" and the hub: {_short(e)}"))
        if offline:
            looked.append(_short(e))
        raise _not_found(model, looked) from e
    if not _has_config(path):
        looked.append(f"HF snapshot {path} (has no config.json)")
        raise _not_found(model, looked)
    return path


def _not_found(model: str | None, looked: list[str]) -> ModelNotFoundError:
    return ModelNotFoundError(f"model {model!r} not found; looked in: " + "; ".join(looked))
