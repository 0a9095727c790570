from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from deepinfer.tools.tiny_tokenizer import SPECIAL_TOKENS, build_tokenizer, write_tokenizer


@pytest.mark.parametrize("vocab", [1024, 4096])
def test_vocab_and_special_ids(vocab):
    tok = build_tokenizer(vocab)
    assert tok.get_vocab_size(with_added_tokens=True) == vocab
    assert tok.token_to_id("<｜begin▁of▁sentence｜>") == 0
    assert tok.token_to_id("<｜end▁of▁sentence｜>") == 1
    assert tok.token_to_id("<｜▁pad▁｜>") == 2
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert max(tok.get_vocab(with_added_tokens=True).values()) == vocab - 1


def test_roundtrip_and_files(tmp_path):
    write_tokenizer(tmp_path, 1024)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in ["Hello, world! The quick brown fox.", "  spaces\tand\nnewlines ~`@#$%^&*()_+{}|:<>?",
                 "zqxj 12345 CamelCase under_score"]:
        ids = tok.encode(text).ids
        assert all(0 <= i < 1024 for i in ids)
        assert tok.decode(ids) == text
    ids = tok.encode("<｜User｜>hi<｜Assistant｜><think>").ids
    assert ids[0] == 3 and 4 in ids and ids[-1] == 5
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == "<｜begin▁of▁sentence｜>" and cfg["eos_token"] == "<｜end▁of▁sentence｜>"


def test_transformers_can_read(tmp_path):
    transformers = pytest.importorskip("transformers")
    write_tokenizer(tmp_path, 1024)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1 and len(tok) == 1024
