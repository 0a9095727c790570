"""Host-side Engram n-gram hashing for DeepSeek-V4.1 (docs/models.md).

Three pieces, all pure functions of the tokenizer and the config:

* `compressed_token_map(tokenizer)`: every token id -> a dense "compressed" id; ids whose
  decoded text normalises to the same string (case, accents, whitespace) share one id.
* `EngramHashParams.build(...)`: per Engram layer the hash primes, the table-row offsets of
  the hash heads and the odd multipliers.
* `ngram_rows(windows, params, ...)`: for a flat batch of N tokens, each given with its
  previous tokens (a "window"), the table rows [N, n_layers, hash_heads] to gather.

A window row holds raw token ids, column k = the token k positions back (column 0 = the token
itself), -1 where there is no token (before the start of the sequence). `mask` (optional,
same shape) marks usable tokens; False (image / padding) blocks. Blocking is cumulative: once
column k is blocked every column > k is too, and a blocked column hashes as the compressed id
of the pad token. `windows_from_sequence` builds the windows of whole sequences (prefill); a
decoder keeps the last max_ngram-1 ids (and mask bits) of each request and prepends the new one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

from deepinfer.kernels.engram_lookup import hash_rows

_NORMALIZERS = None  # built lazily
_PRIVATE_SENTINEL = "\ue000"


def _normalizers():
    global _NORMALIZERS
    if _NORMALIZERS is None:
        from tokenizers import Regex, normalizers

        unicode = normalizers.Sequence([normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(),
                                        normalizers.Lowercase(),
                                        normalizers.Replace(Regex(r"[ \t\r\n]+"), " ")])
        _NORMALIZERS = (unicode, normalizers.Strip())
    return _NORMALIZERS


def normalize_token_text(text: str) -> str:
    """The Engram key of one decoded token (before the U+FFFD / empty fallbacks).

    NFKC -> NFD -> strip accents -> lowercase -> runs of space/tab/CR/LF become one space;
    a result that is exactly " " is kept, anything else is stripped (the `tokenizers`
    whitespace definition). The reference protects " " with a private-use sentinel U+E000
    that it turns back into a space at the end, so a literal U+E000 also ends up as " "."""
    unicode, strip = _normalizers()
    s = unicode.normalize_str(text)
    if s != " ":
        s = strip.normalize_str(s)
    return s.replace(_PRIVATE_SENTINEL, " ")


def _backend(tokenizer):
    return getattr(tokenizer, "backend_tokenizer", tokenizer)


def compressed_token_map(tokenizer) -> tuple[list[int], int]:
    """(compressed id of every token id 0..vocab-1, number of compressed ids).

    `tokenizer`: a `tokenizers.Tokenizer` (or a transformers fast tokenizer). Each id is
    decoded alone with special tokens kept; text containing U+FFFD (a partial UTF-8
    sequence) is keyed by the raw token string instead; an empty normalised key falls back
    to the decoded text. Compressed ids are dense, in first-seen order."""
    tok = _backend(tokenizer)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    keys: dict[str, int] = {}
    out = []
    for i in range(vocab):
        text = tok.decode([i], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(i)
        else:
            key = normalize_token_text(text) or text
        out.append(keys.setdefault(key, len(keys)))
    return out, len(keys)


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


@dataclass(frozen=True)
class EngramHashParams:
    """Hash constants of every Engram layer, in `layer_ids` order.

    primes[e] / offsets[e]: (max_ngram-1)*n_heads ints (n-gram size 2 heads first);
    multipliers[e]: max_ngram odd ints (one per window column); pad_id: compressed id used
    for blocked window columns."""

    layer_ids: tuple[int, ...]
    max_ngram: int
    n_heads: int
    compressed_vocab: int
    primes: tuple[tuple[int, ...], ...]
    offsets: tuple[tuple[int, ...], ...]
    multipliers: tuple[tuple[int, ...], ...]
    rows_needed: tuple[int, ...]
    pad_id: int = 0

    @property
    def hash_heads(self) -> int:
        return (self.max_ngram - 1) * self.n_heads

    @classmethod
    def build(cls, layer_ids: Sequence[int], num_embeddings: Sequence[int], max_ngram: int, n_heads: int,
              vocab_size_for_primes: int, compressed_vocab: int, *, pad_id: int = 0) -> "EngramHashParams":
        """`vocab_size_for_primes` is the config's engram_vocab_size (primes start above it - 1);
        `pad_id` the compressed id of engram_pad_token_id. Raises ValueError if a layer's
        hash heads need more rows than its table has."""
        layer_ids = tuple(int(i) for i in layer_ids)
        if len(layer_ids) != len(num_embeddings) or len(set(layer_ids)) != len(layer_ids):
            raise ValueError(f"engram: need one row count per distinct layer, got {layer_ids} / {list(num_embeddings)}")
        if max_ngram < 2 or n_heads < 1 or vocab_size_for_primes < 2 or compressed_vocab < 1:
            raise ValueError("engram: needs max_ngram >= 2, n_heads >= 1, engram_vocab_size >= 2, "
                             "compressed vocab >= 1")
        if not 0 <= pad_id < compressed_vocab:
            raise ValueError(f"engram: pad id {pad_id} outside the compressed vocab {compressed_vocab}")
        bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
        used: set[int] = set()
        primes, offsets, mults, needed = [], [], [], []
        for layer, rows in zip(layer_ids, num_embeddings):
            mine = []
            for _size in range(2, max_ngram + 1):
                p = vocab_size_for_primes - 1
                for _head in range(n_heads):
                    p += 1
                    while p in used or not _is_prime(p):
                        p += 1
                    used.add(p)
                    mine.append(p)
            total = sum(mine)
            if total > rows:
                raise ValueError(f"engram layer {layer}: hash heads need {total} table rows, "
                                 f"engram_num_embeddings gives {rows}")
            primes.append(tuple(mine))
            offsets.append(tuple(int(x) for x in np.cumsum([0] + mine[:-1])))
            rng = np.random.default_rng(10007 * layer)
            m = rng.integers(0, bound, size=max_ngram, dtype=np.int64) * 2 + 1
            mults.append(tuple(int(x) for x in m))
            needed.append(total)
        return cls(layer_ids, int(max_ngram), int(n_heads), int(compressed_vocab), tuple(primes),
                   tuple(offsets), tuple(mults), tuple(needed), int(pad_id))

    @classmethod
    def from_text_config(cls, text_config: dict, token_map: Sequence[int]) -> "EngramHashParams":
        """From a V4.1 text_config dict and this tokenizer's compressed map (checks the
        compressed vocab size against engram_compressed_vocab_size)."""
        c = text_config
        n_comp = (max(token_map) + 1) if len(token_map) else 0
        want = c.get("engram_compressed_vocab_size")
        if want is not None and want != n_comp:
            raise ValueError(f"engram: tokenizer gives {n_comp} compressed ids, "
                             f"config says engram_compressed_vocab_size={want}")
        pad_tok = c.get("engram_pad_token_id", 2)
        if not 0 <= pad_tok < len(token_map):
            raise ValueError(f"engram_pad_token_id {pad_tok} is outside the tokenizer vocabulary")
        return cls.build(c["engram_layer_ids"], c["engram_num_embeddings"], c["engram_max_ngram_size"],
                         c["engram_n_heads"], c["engram_vocab_size"], n_comp, pad_id=token_map[pad_tok])


@lru_cache(maxsize=64)
def hash_constants(params: EngramHashParams, device: torch.device):
    """(multipliers [L, M], primes [L, HH], offsets [L, HH]) as int64 tensors on `device`, made once."""
    mult = torch.tensor(params.multipliers, dtype=torch.int64, device=device)   # [L, M]
    primes = torch.tensor(params.primes, dtype=torch.int64, device=device)      # [L, (M-1)*H]
    offsets = torch.tensor(params.offsets, dtype=torch.int64, device=device)    # [L, (M-1)*H]
    return mult, primes, offsets


def ngram_rows(windows: torch.Tensor, params: EngramHashParams, *, token_map: torch.Tensor | None = None,
               mask: torch.Tensor | None = None) -> torch.Tensor:
    """Engram table rows of N tokens: int64 [N, n_layers, (max_ngram-1)*n_heads], already
    offset (row j of layer e indexes that layer's table directly).

    windows: int [N, max_ngram]; windows[:, k] is the raw token id k positions back, -1 for
      none (before the sequence start). With `token_map` None the ids are already compressed.
    token_map: int64 [vocab] raw id -> compressed id (same device as windows).
    mask: optional bool [N, max_ngram]; False = unusable token (image / padding).
    Column k is blocked if any column <= k is -1 or masked; blocked columns hash as pad_id.
    Any leading shape works: [..., max_ngram] -> [..., n_layers, hash_heads]."""
    m = params.max_ngram
    if windows.shape[-1] != m:
        raise ValueError(f"engram windows need {m} columns, got shape {tuple(windows.shape)}")
    w = windows.long()
    if mask is not None:
        if mask.shape != windows.shape:
            raise ValueError(f"engram mask shape {tuple(mask.shape)} != windows {tuple(windows.shape)}")
        w = w.masked_fill(~mask.bool(), -1)  # an unusable token blocks as a missing one does
    mult, primes, offsets = hash_constants(params, windows.device)
    flat = w.reshape(-1, m)
    rows = [hash_rows(flat, token_map, mult[e], primes[e], offsets[e], params.pad_id)
            for e in range(len(params.layer_ids))]
    return torch.stack(rows, dim=1).view(*windows.shape[:-1], len(params.layer_ids), params.hash_heads)


def history_windows(input_ids: torch.Tensor, image_mask: torch.Tensor | None, history: torch.Tensor,
                    plan) -> torch.Tensor:
    """The step's n-gram windows [T, K] (raw ids, -1 = none or image) read through a HistoryPlan
    (state/forward_batch.py), then the step's newest tokens stored into the per-slot ring `history`
    [slots, K]. Device-side throughout: input ids filled on the device (placeholders) are hashed
    as they are. Image tokens are stored as -1, which blocks exactly as an image mask does."""
    ids = input_ids if image_mask is None else input_ids.masked_fill(image_mask, -1)
    ext = torch.cat((ids, history.view(-1)))
    windows = torch.where(plan.win_src >= 0, ext[plan.win_src.clamp(min=0)], -1)
    history.view(-1)[plan.hist_dst] = ids[plan.hist_src]  # after the read: a step's reads see earlier steps only
    return windows


def windows_from_sequence(ids: torch.Tensor, max_ngram: int, mask: torch.Tensor | None = None,
                          history: torch.Tensor | None = None, history_mask: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sliding windows of a (chunk of a) sequence: ids [..., S] -> windows [..., S, max_ngram].

    `history` [..., max_ngram-1] (oldest first, -1 = none) holds the tokens that precede
    ids[..., 0] (a continued prefill chunk); without it the chunk starts the sequence.
    `mask` / `history_mask` mark usable tokens; the returned mask is None if both are None."""
    p = max_ngram - 1
    lead = ids.shape[:-1]
    if history is None:
        history = torch.full((*lead, p), -1, dtype=ids.dtype, device=ids.device)
    full = torch.cat([history.to(ids.dtype), ids], dim=-1)             # [..., p + S]
    s = ids.shape[-1]
    # column k of position t = full[p + t - k]
    idx = (torch.arange(s, device=ids.device).unsqueeze(-1) + p
           - torch.arange(max_ngram, device=ids.device))               # [S, M]
    win = full[..., idx]
    if mask is None and history_mask is None:
        return win, None
    if mask is None:
        mask = torch.ones_like(ids, dtype=torch.bool)
    if history_mask is None:
        history_mask = torch.ones_like(history, dtype=torch.bool)
    fm = torch.cat([history_mask.bool(), mask.bool()], dim=-1)
    return win, fm[..., idx]
