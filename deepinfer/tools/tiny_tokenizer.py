"""A small byte-level BPE tokenizer, trained locally, with DeepSeek's special tokens.

Ids are fixed: BOS 0, EOS 1, pad 2, then User / Assistant / <think> / </think>; the vocab is
padded with `<｜tok_N｜>` added tokens so that it has exactly `vocab_size` entries.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers import AddedToken

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
SPECIAL_TOKENS = [BOS, EOS, PAD, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]

CORPUS = [
    "The quick brown fox jumps over the lazy dog. A small model is trained to check that an "
    "inference engine loads weights, runs attention, and samples tokens the same way every time.",
    "Once upon a time there was a little village by the sea. Every morning the fishermen went "
    "out in their boats, and every evening they came back with baskets full of fish. The "
    "children ran along the beach and the old people sat in the sun and told stories.",
    "Machine learning models turn numbers into other numbers. A language model reads a sequence "
    "of tokens and predicts the next one. Attention lets each position look at earlier positions; "
    "a mixture of experts sends each token to a few of many feed-forward networks.",
    "Question: What is the capital of France? Answer: Paris is the capital of France. "
    "Question: How many days are in a week? Answer: There are seven days in a week.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, add(i, i * 2))\n",
    "Numbers like 1, 2, 3, 10, 42, 100, 2024 and 3.14159 appear in text, as do dates such as "
    "2026-04-24 and times like 12:30. Prices: $5, $19.99, 100%.",
    "She said, \"Hello! How are you today?\" He answered, \"I'm fine, thanks; and you?\" "
    "They walked to the park, talked about books, music, science, history and the weather.",
]


def build_tokenizer(vocab_size: int) -> Tokenizer:
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    pad = [AddedToken(f"<｜tok_{i}｜>", special=True, normalized=False)
           for i in range(vocab_size - tok.get_vocab_size(with_added_tokens=True))]
    if pad:
        tok.add_special_tokens(pad)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    return tok


def write_tokenizer(out_dir: str | Path, vocab_size: int, *, model_max_length: int = 1048576,
                    tokenizer: Tokenizer | None = None) -> Path:
    """Write tokenizer.json + tokenizer_config.json (`tokenizer`: one already built with
    build_tokenizer(vocab_size), to avoid training it twice)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (tokenizer or build_tokenizer(vocab_size)).save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return out / "tokenizer.json"
