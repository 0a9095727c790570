"""The `demo` model: a small random DeepSeek-V4.1 checkpoint (every layer role, Engram, DSpark
stages) built on first use, so a machine with no weights and no GPU can run the examples."""
from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from deepinfer.config import default_cache_dir
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

DEMO_NAME = "demo"
logger = logging.getLogger(__name__)


def demo_checkpoint(cache_dir: Path | None = None) -> Path:
    """Path of the demo checkpoint; written once (into a temp dir, then renamed into place)."""
    root = cache_dir or default_cache_dir()
    out = root / "demo-deepseek_v41"
    if (out / "model.safetensors.index.json").is_file():
        return out
    logger.info("model 'demo': writing a small random DeepSeek-V4.1 checkpoint to %s (first use only; its "
                "completions are random text)", out)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".demo-"))
    write_checkpoint(tmp, PRESETS["demo41"], seed=0, dtype="fp8")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    logger.info("model 'demo': checkpoint written (%.1f MB)", _size(out) / 1e6)
    return out


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
