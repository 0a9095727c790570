"""Incremental detokenisation and stop strings, over a `tokenizers.Tokenizer`."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer

# how many already-emitted tokens are re-decoded as context so merges across the boundary are right
_CONTEXT = 6


@dataclass
class DecodeState:
    prefix_offset: int = 0  # ids[prefix_offset:read_offset] is the context already turned into text
    read_offset: int = 0
    text: str = ""
    stop_hit: bool = False
    _scanned: int = field(default=0)  # text before this index has been checked for stop strings


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tok, self.skip = tokenizer, skip_special_tokens

    def encode(self, text: str, bos_token_id: int | None) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return ([bos_token_id] if bos_token_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def update(self, st: DecodeState, ids: list[int], stop: list[str], check: bool = True) -> None:
        """Extend st.text with what ids[read_offset:] adds; hold back an incomplete UTF-8 tail.
        On a stop string, truncate text before it and set stop_hit. `check` False (before min_tokens outputs):
        the new text is never searched, except the end that a stop string found later may begin in."""
        if st.stop_hit or st.read_offset >= len(ids):
            return
        prefix = self.decode(ids[st.prefix_offset:st.read_offset])
        full = self.decode(ids[st.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return  # wait for the bytes that complete the character
        st.text += full[len(prefix):]
        st.prefix_offset = max(st.prefix_offset, len(ids) - _CONTEXT)
        st.read_offset = len(ids)
        if check:
            self._check_stop(st, stop)
        else:
            st._scanned = len(st.text)

    def finalize(self, st: DecodeState, ids: list[int]) -> str:
        """The completion text: everything decoded (a held-back tail included) unless a stop string cut it."""
        return st.text if st.stop_hit else self.decode(ids)

    @staticmethod
    def _check_stop(st: DecodeState, stop: list[str]) -> None:
        if not stop:
            return
        start = max(0, st._scanned - max(map(len, stop)) + 1)
        hits = [i for i in (st.text.find(s, start) for s in stop) if i >= 0]
        if hits:
            st.text, st.stop_hit = st.text[:min(hits)], True
        st._scanned = len(st.text)


def bad_words_token_ids(words: list[str], detok: Detokenizer) -> list[list[int]]:
    """SamplingParams.bad_words as token ids: each word without its leading spaces, and again after one space where
    that encodes differently (a word inside text usually follows a space)."""
    out: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = detok.encode(text, None)
            if ids and ids not in out:
                out.append(ids)
    return out
