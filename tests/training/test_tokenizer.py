"""training/tokenizer.py: a byte-level BPE tokenizer trained on the stdlib's source, with the demo
tokenizer's and deepseek-recipe's special tokens at fixed ids."""
from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from deepinfer.entrypoints.openai.tokenizer import complete_specials, special_spellings
from deepinfer.tools.tiny_tokenizer import SPECIAL_TOKENS
from training.tokenizer import (IMAGE_TOKEN, RECIPE_SPECIALS, build, corpus_files, heldout_tokens, is_held_out,
                                read_tokens, train_tokenizer)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    build(out, 1024, held_out_percent=30, max_files=8)
    return out


def test_specials_have_the_demo_ids_and_every_recipe_token(tok_dir):
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == 1024
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tok.token_to_id(IMAGE_TOKEN) == 1022          # presets' image_token_id = vocab - 2
    assert tok.id_to_token(1023) == "<｜tok_1023｜>"     # presets' dspark_noise_token_id = vocab - 1
    spec, added = complete_specials(json.loads((tok_dir / "tokenizer.json").read_text()))
    assert added == [], "the API server would have to take padding entries over"
    assert {a["content"] for a in spec["added_tokens"]} >= set(special_spellings()) == set(RECIPE_SPECIALS)


def test_round_trips_unseen_source_and_learns_python(tok_dir):
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    unseen = corpus_files(max_files=12)[-1].text             # a file the tokenizer was not trained on
    text = unseen + "\nx = 'é∑😀'  # non-ASCII\n\tif a:\n        return b\n"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert len(ids) < 0.6 * len(text.encode())                # merges learnt: fewer tokens than bytes
    assert tok.token_to_id("Ġreturn") is not None or tok.token_to_id("return") is not None


def test_split_and_token_files(tok_dir):
    files = corpus_files(max_files=8, held_out_percent=30)
    manifest = json.loads((tok_dir / "manifest.json").read_text())
    held = [f.rel for f in files if f.held_out]
    assert manifest["held_out_files"] == held and manifest["train_files"] == len(files) - len(held)
    assert all(is_held_out(r, 30) for r in held)
    assert [f.rel for f in files] == sorted(f.rel for f in files)
    train = read_tokens(tok_dir / "train.bin")
    assert train.dtype == np.uint16 and manifest["token_dtype"] == "<u2" and train.size == manifest["train_tokens"]
    assert train[0] == 0 and (train == 0).sum() == (train == 1).sum() == manifest["train_files"]  # BOS ... EOS
    assert (tok_dir / "heldout.txt").read_text() == "".join(f.text for f in files if f.held_out)


def test_an_existing_tokenizer_encodes_the_same_held_out_files(tok_dir, tmp_path):
    """heldout_tokens (benchmarks/spec_decode.py --prompt-tokens demo-heldout): the split `build` made, encoded by a
    given tokenizer.json, equals the heldout.bin `build` wrote with that tokenizer."""
    root = tmp_path / "lib"
    for f in corpus_files(max_files=8, held_out_percent=30):
        (root / f.rel).parent.mkdir(parents=True, exist_ok=True)
        (root / f.rel).write_text(f.text)
    got = heldout_tokens(tok_dir / "tokenizer.json", 30, root=root)
    assert got.dtype == np.uint16 and np.array_equal(got, read_tokens(tok_dir / "heldout.bin"))
    with pytest.raises(ValueError, match="no held-out files"):
        heldout_tokens(tok_dir / "tokenizer.json", 0, root=root)


def test_too_small_vocab_is_refused():
    with pytest.raises(ValueError, match="--vocab-size"):
        train_tokenizer(["a b c"], 200)
