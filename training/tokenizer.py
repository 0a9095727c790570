"""A byte-level BPE tokenizer trained on the Python standard library's own source, and the token files
the trainer reads.

    python -m training.tokenizer --out DIR [--vocab-size 4096] [--held-out-percent 2] [--max-files N]

Corpus: every `*.py` under `sysconfig.get_paths()["stdlib"]` (site-packages / dist-packages excluded),
read as UTF-8 (files that are not are skipped), in sorted relative-path order. A file is held out when
the first 8 hex digits of sha256(relative path) modulo 100 fall below --held-out-percent, so the split
depends only on the file names, not on their contents or on the Python patch version.

Token ids (shared with deepinfer/tools/tiny_tokenizer.py, whose demo tokenizer the engine and
deepseek-recipe already read): 0 BOS, 1 EOS, 2 pad, 3 User, 4 Assistant, 5 <think>, 6 </think>; then
deepseek-recipe's other special tokens (sorted, `<｜image｜>` aside); then the BPE vocabulary, padded with
`<｜tok_N｜>`; then `<｜image｜>` at vocab-2 (the presets' image_token_id) and `<｜tok_{vocab-1}｜>` at vocab-1
(the presets' dspark_noise_token_id). Every special deepseek-recipe renders is present, so the API
server takes no padding entry over.

Writes into --out: tokenizer.json + tokenizer_config.json, train.bin / heldout.bin (token ids, little-endian
uint16 up to a 65536-token vocabulary, else int32, as manifest.json's token_dtype says: each file is
BOS + its tokens + EOS, files concatenated), heldout.txt (the held-out files'
text, for `deepinfer.eval.calibrate_dspark --file` and perplexity), manifest.json (files, counts).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from deepinfer.tools.tiny_tokenizer import SPECIAL_TOKENS, write_tokenizer

IMAGE_TOKEN = "<｜image｜>"
# deepseek-recipe 0.2.0's spelling of every special token it renders or parses (written out so that the
# trainer's machine needs no deepseek-recipe; tests/training checks it against
# deepinfer.entrypoints.openai.tokenizer.special_spellings()).
RECIPE_SPECIALS = ("<｜Assistant｜>", "<｜begin▁of▁sentence｜>", "<｜box｜>", "<｜/box｜>", "｜DSML｜",
                   "<｜end▁of▁sentence｜>", IMAGE_TOKEN, "<｜latest_reminder｜>", "<｜point｜>", "<｜/point｜>",
                   "<｜polygon｜>", "<｜/polygon｜>", "<｜ref｜>", "<｜/ref｜>", "<｜System｜>", "</think>", "<think>",
                   "<｜User｜>")


def leading_specials() -> list[str]:
    """The special tokens at ids 0..n-1: the demo tokenizer's seven, then recipe's others but <｜image｜>."""
    rest = sorted(s for s in RECIPE_SPECIALS if s not in SPECIAL_TOKENS and s != IMAGE_TOKEN)
    return list(SPECIAL_TOKENS) + rest


def token_dtype(vocab_size: int) -> np.dtype:
    """Little-endian uint16 while every id fits, else int32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<i4")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass(frozen=True)
class SourceFile:
    rel: str           # posix path relative to the stdlib directory
    text: str
    held_out: bool


def is_held_out(rel: str, percent: float) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % 100 < percent


def corpus_files(root: Path | None = None, held_out_percent: float = 2.0,
                 max_files: int | None = None) -> list[SourceFile]:
    """The stdlib's UTF-8 `*.py` files in sorted relative-path order (the first max_files of them)."""
    root = Path(root) if root is not None else stdlib_dir()
    if not root.is_dir():
        raise ValueError(f"stdlib directory {root} does not exist")
    rels = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                  if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts) and p.is_file())
    out: list[SourceFile] = []
    for rel in rels:
        if max_files is not None and len(out) >= max_files:
            break
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip():
            out.append(SourceFile(rel, text, is_held_out(rel, held_out_percent)))
    if not out:
        raise ValueError(f"no UTF-8 *.py files under {root}")
    return out


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with the ids described in the module docstring."""
    lead = leading_specials()
    if vocab_size < len(lead) + 256 + 2:
        raise ValueError(f"--vocab-size {vocab_size} is too small: a byte-level tokenizer with {len(lead) + 2} "
                         f"special tokens needs at least {len(lead) + 258}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in lead],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    have = tok.get_vocab_size(with_added_tokens=True)
    pad = [AddedToken(f"<｜tok_{i}｜>", special=True, normalized=False) for i in range(have, vocab_size - 2)]
    tail = [AddedToken(IMAGE_TOKEN, special=True, normalized=False),
            AddedToken(f"<｜tok_{vocab_size - 1}｜>", special=True, normalized=False)]
    tok.add_special_tokens(pad + tail)
    for i, t in enumerate(lead):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"special token {t!r} got id {tok.token_to_id(t)}, expected {i}")
    if tok.token_to_id(IMAGE_TOKEN) != vocab_size - 2 or tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError("tokenizer: the tail special tokens did not land at vocab-2 / vocab-1")
    return tok


def encode_files(tok: Tokenizer, files: list[SourceFile]) -> np.ndarray:
    """BOS + tokens + EOS of each file, concatenated (dtype: token_dtype of the vocabulary)."""
    dtype = token_dtype(tok.get_vocab_size(with_added_tokens=True))
    bos, eos = tok.token_to_id(SPECIAL_TOKENS[0]), tok.token_to_id(SPECIAL_TOKENS[1])
    parts = []
    for enc in tok.encode_batch([f.text for f in files], add_special_tokens=False):
        parts.append(np.asarray([bos, *enc.ids, eos], dtype=dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def read_tokens(path: str | Path) -> np.ndarray:
    """A token file (memory-mapped) in the dtype its directory's manifest.json names."""
    path = Path(path)
    manifest = path.parent / "manifest.json"
    if not manifest.is_file():
        raise ValueError(f"{path}: no manifest.json beside it (python -m training.tokenizer writes both)")
    return np.memmap(str(path), dtype=np.dtype(json.loads(manifest.read_text())["token_dtype"]), mode="r")


def build(out_dir: str | Path, vocab_size: int, *, held_out_percent: float = 2.0, max_files: int | None = None,
          root: Path | None = None, model_max_length: int = 4096) -> dict:
    """Train the tokenizer on the training files and write everything listed in the module docstring."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = corpus_files(root, held_out_percent, max_files)
    train = [f for f in files if not f.held_out]
    held = [f for f in files if f.held_out]
    if not train:
        raise ValueError("every file is held out: lower --held-out-percent or raise --max-files")
    tok = train_tokenizer([f.text for f in train], vocab_size)
    write_tokenizer(out, vocab_size, model_max_length=model_max_length, tokenizer=tok)
    train_ids, held_ids = encode_files(tok, train), encode_files(tok, held)
    train_ids.tofile(str(out / "train.bin"))
    held_ids.tofile(str(out / "heldout.bin"))
    (out / "heldout.txt").write_text("".join(f.text for f in held))
    manifest = dict(python=sys.version.split()[0], stdlib=str(root or stdlib_dir()), vocab_size=vocab_size,
                    token_dtype=token_dtype(vocab_size).str,
                    held_out_percent=held_out_percent, train_files=len(train), held_out_files=[f.rel for f in held],
                    train_tokens=int(train_ids.size), held_out_tokens=int(held_ids.size),
                    train_bytes=sum(len(f.text.encode()) for f in train))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def heldout_tokens(tokenizer_json: str | Path, held_out_percent: float = 2.0, root: Path | None = None) -> np.ndarray:
    """The held-out files (this machine's stdlib, the same split as `build`) encoded by an existing tokenizer (e.g.
    the shipped demo's tokenizer.json), as heldout.bin holds them: prompts its DSpark stages never trained on."""
    tok = Tokenizer.from_file(str(tokenizer_json))
    held = [f for f in corpus_files(root, held_out_percent) if f.held_out]
    if not held:
        raise ValueError(f"no held-out files at --held-out-percent {held_out_percent}")
    return encode_files(tok, held)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for the tokenizer and the token files")
    p.add_argument("--vocab-size", type=int, default=4096, help="tokens in all, specials included (demo41: 4096)")
    p.add_argument("--held-out-percent", type=float, default=2.0)
    p.add_argument("--max-files", type=int, default=None, help="only the first N files (sorted order), for tests")
    args = p.parse_args(argv)
    m = build(args.out, args.vocab_size, held_out_percent=args.held_out_percent, max_files=args.max_files)
    summary = {k: v for k, v in m.items() if k != "held_out_files"} | {"held_out_files": len(m["held_out_files"])}
    print(json.dumps(summary))
    return m


if __name__ == "__main__":
    main()
