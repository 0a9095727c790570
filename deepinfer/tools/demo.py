"""The demo models, so that a machine with no weights and no GPU can run the examples.

`demo`: a small DeepSeek-V4.1 (the `demo41` widths: every layer role, Engram, mHC, the 3-stage DSpark
draft) trained on the Python standard library's source (`training/`), shipped in the package in the
released layout (FP8 blocks, FP4 routed experts) with its DSpark calibration; every file is checked
against the SHA-256 below before the first use in a process.

`demo-random`: the same architecture with random weights, written on first use into the cache dir
(its completions are random text; tests and benchmarks that need no trained weights use it)."""
from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from pathlib import Path

from deepinfer.config import default_cache_dir
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

DEMO_NAME = "demo"
RANDOM_DEMO_NAME = "demo-random"
RANDOM_DEMO_DIRNAME = "demo-deepseek_v41"  # under default_cache_dir()
DEMO_DIR = Path(__file__).resolve().parents[1] / "assets" / "demo41"
# sha256 of every file the engine reads from DEMO_DIR (training.json, the provenance, is not read)
DEMO_SHA256 = {
    "config.json": "8914eff66a69ca070a52f33350648ada5d1fe54615b533ea8dc601da8f7f3e75",
    "dspark_calibration.json": "c421aefd8ff547660b670e15082d0076d5c49ffdfca001b493fbde7d3918ebf2",
    "model-00001-of-00004.safetensors": "11de36b2db8f1208d7a2928ca85e1d95f348f7d6da6e5567e28cb03631db7591",
    "model-00002-of-00004.safetensors": "9db65948eb9aff4db51161a639b8a77b06f95281dc0f886c9fc8900c3e671c2a",
    "model-00003-of-00004.safetensors": "0de635d60ce450c1be29f89e576fb19fa9360f11350bb2b4096fc65623585323",
    "model-00004-of-00004.safetensors": "82e87ac89aae3a0f3b4ef03c4d6b0a8b636e2b2bc9d13fe05de88c4e964b2b00",
    "model.safetensors.index.json": "d241fe8670328f50dbb6bfe7f0e5fab51c61c2f047539f241c525b6b80e1a19e",
    "tokenizer.json": "523d24bb733b9aa48034d6758813ca74ed23e7eb00b51ccd42d4cc374aeb6dd3",
    "tokenizer_config.json": "79738b7efa1108edf9ccb6a3d0db37e65242da35d6c725291ce357b1bf8d6076",
}
logger = logging.getLogger(__name__)
_verified: set[Path] = set()


def resolve_demo(name: str) -> str | None:
    """The checkpoint directory a demo model name stands for; None for any other name."""
    if name == DEMO_NAME:
        return str(demo_checkpoint())
    if name == RANDOM_DEMO_NAME:
        return str(random_demo_checkpoint())
    return None


def is_demo_dir(path: str | Path) -> bool:
    """Whether `path` is one of the demo checkpoints (however it was named: `demo`, `demo-random` or the path)."""
    here = Path(path).resolve()
    return here in (DEMO_DIR.resolve(), (default_cache_dir() / RANDOM_DEMO_DIRNAME).resolve())


def demo_checkpoint(directory: Path = DEMO_DIR, sha256: dict[str, str] = DEMO_SHA256) -> Path:
    """The trained demo checkpoint, its files checked against `sha256` (once per process)."""
    if directory in _verified:
        return directory
    for name, want in sha256.items():
        path = directory / name
        if not path.is_file():
            raise FileNotFoundError(f"model 'demo': {path} is missing (the package's demo checkpoint is "
                                    f"incomplete; reinstall deepinfer, or use model='{RANDOM_DEMO_NAME}')")
        got = _sha256(path)
        if got != want:
            raise ValueError(f"model 'demo': {path} has sha256 {got}, expected {want} (a damaged or "
                             "git-LFS-pointer file; reinstall deepinfer)")
    _verified.add(directory)
    return directory


def random_demo_checkpoint(cache_dir: Path | None = None) -> Path:
    """Path of the random demo checkpoint; written once (into a temp dir, then renamed into place)."""
    root = cache_dir or default_cache_dir()
    out = root / RANDOM_DEMO_DIRNAME
    if (out / "model.safetensors.index.json").is_file():
        return out
    logger.info("model '%s': writing a small random DeepSeek-V4.1 checkpoint to %s (first use only; its "
                "completions are random text)", RANDOM_DEMO_NAME, out)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".demo-"))
    write_checkpoint(tmp, PRESETS["demo41"], seed=0, dtype="fp8")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    logger.info("model '%s': checkpoint written (%.1f MB)", RANDOM_DEMO_NAME, _size(out) / 1e6)
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
