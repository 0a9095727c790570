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

    def update(self, st: DecodeState, ids: list[int], stop: list[str]) -> None:
        """Extend st.text with what ids[read_offset:] adds; hold back an incomplete UTF-8 tail.
        On a stop string, truncate text before it and set stop_hit."""
        if st.stop_hit or st.read_offset >= len(ids):
            return
        prefix = self.decode(ids[st.prefix_offset:st.read_offset])
        full = self.decode(ids[st.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return  # wait for the bytes that complete the character
        st.text += full[len(prefix):]
        st.prefix_offset = max(st.prefix_offset, len(ids) - _CONTEXT)
        st.read_offset = len(ids)
        self._check_stop(st, stop)

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
