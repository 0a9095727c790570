"""Prompts for `deepinfer bench serve`: the `random` and `sharegpt` datasets.

A `BenchRequest` holds the prompt text, its length in tokens (None when no tokenizer was given:
the server's `usage.prompt_tokens` is used then) and the number of tokens to ask for. Datasets are
drawn from a seeded `random.Random`, so a seed names the same prompts on every run.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# a prompt of exact token length is found by decode -> encode round trips; each one shortens or
# pads the ids, and a handful settle every length tried with byte-level BPE tokenizers
_ROUND_TRIPS = 16
# words for random prompts when no tokenizer is given (lengths are then counted in words)
_WORDS = ("time", "model", "river", "number", "light", "garden", "system", "story", "paper", "music",
          "window", "market", "signal", "forest", "engine", "letter", "bridge", "summer", "table", "voice")


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int | None  # tokens of `prompt` by the benchmark's tokenizer; None without one
    output_len: int  # max_tokens asked for


def load_tokenizer(path: str | Path):
    """A HF `tokenizers` Tokenizer from a tokenizer.json file (or a directory holding one)."""
    from tokenizers import Tokenizer

    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ValueError(f"--tokenizer: {path} is not a tokenizer.json file or a directory holding one")
    return Tokenizer.from_file(str(p))


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def _plain_ids(tokenizer) -> list[int]:
    """Ids of ordinary tokens that decode to well-formed text and encode back to themselves alone
    (added/special tokens and partial UTF-8 byte tokens excluded)."""
    added = set(tokenizer.get_added_tokens_decoder())
    ids = []
    for i in range(tokenizer.get_vocab_size(with_added_tokens=False)):
        if i in added:
            continue
        text = tokenizer.decode([i], skip_special_tokens=True)
        if text and "\ufffd" not in text and tokenizer.encode(text, add_special_tokens=False).ids == [i]:
            ids.append(i)
    if not ids:
        raise ValueError("--tokenizer: the tokenizer has no ordinary tokens to build random prompts from")
    return ids


def exact_length_prompt(tokenizer, n: int, rng: random.Random, pool: list[int]) -> tuple[str, int]:
    """Random text of `n` tokens (by `tokenizer`, no special tokens), and its measured length, which
    is `n` unless the round trips do not settle (then the closest text found, its length measured)."""
    ids = [rng.choice(pool) for _ in range(n)]
    text, got = "", -1
    for _ in range(_ROUND_TRIPS):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        enc = tokenizer.encode(text, add_special_tokens=False).ids
        got = len(enc)
        if got == n:
            break
        # merges across token boundaries shorten the text; a cut can split a merge and lengthen it
        ids = enc[:n] if got > n else enc + [rng.choice(pool) for _ in range(n - got)]
    return text, got


def _lengths(mean: int, ratio: float, count: int, rng: random.Random) -> list[int]:
    """vLLM's --random-range-ratio: lengths uniform over [mean * (1 - ratio), mean * (1 + ratio)]."""
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(count)]


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                    tokenizer=None) -> list[BenchRequest]:
    """`num` random prompts; with a tokenizer each has exactly its drawn token length, without one
    it has that many words (and its prompt_len is None)."""
    if input_len < 1 or output_len < 1:
        raise ValueError(f"--random-input-len / --random-output-len must be >= 1, got {input_len} / {output_len}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    ins = _lengths(input_len, range_ratio, num, rng)
    outs = _lengths(output_len, range_ratio, num, rng)
    out = []
    pool = _plain_ids(tokenizer) if tokenizer is not None else None
    for n, m in zip(ins, outs):
        if tokenizer is None:
            out.append(BenchRequest(" ".join(rng.choice(_WORDS) for _ in range(n)), None, m))
        else:
            text, got = exact_length_prompt(tokenizer, n, rng, pool)
            out.append(BenchRequest(text, got, m))
    return out


def sharegpt_requests(path: str | Path, num: int, seed: int, tokenizer=None,
                      output_len: int | None = None) -> list[BenchRequest]:
    """First human turn of each conversation as the prompt; the gpt reply's token count (or
    `output_len` when given) as max_tokens. Conversations are shuffled by `seed`; when the file has
    fewer usable ones than `num` they are reused in the same order."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--dataset-path: cannot read {path} as JSON: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path: {path} must hold a JSON list of conversations, "
                         f"got {type(data).__name__}")
    if tokenizer is None and output_len is None:
        raise ValueError("--dataset-name sharegpt needs --tokenizer (to size each reply) or --sharegpt-output-len")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, reply = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(reply, dict) and first.get("from") == "human"
                and reply.get("from") == "gpt"):
            continue
        prompt, completion = first.get("value"), reply.get("value")
        if isinstance(prompt, str) and isinstance(completion, str) and prompt and completion:
            pairs.append((prompt, completion))
    if not pairs:
        raise ValueError(f"--dataset-path: {path} has no conversation starting with a human turn "
                         "followed by a gpt turn")
    random.Random(seed).shuffle(pairs)
    out = []
    for i in range(num):
        prompt, completion = pairs[i % len(pairs)]
        m = output_len if output_len is not None else max(1, count_tokens(tokenizer, completion))
        out.append(BenchRequest(prompt, count_tokens(tokenizer, prompt) if tokenizer is not None else None, m))
    return out
