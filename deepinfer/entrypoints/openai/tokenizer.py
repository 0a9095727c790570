"""The tokenizer the API process encodes and decodes with.

deepseek-recipe renders chat prompts with DeepSeek's special tokens (<｜System｜>, <｜DSML｜>, ...)
and refuses to encode one that is not in the tokenizer's added vocabulary. Real V4 / V4.1 tokenizers
have them all; the small tokenizers of the test and demo checkpoints (tools/tiny_tokenizer.py) have
only BOS / EOS / User / Assistant / think, and pad the vocabulary with `<｜tok_N｜>` added tokens.
For those, each missing special token takes over one padding entry (its id is unchanged, so the
model's vocabulary size is too); the weights are random there, so no meaning is lost.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import deepseek_recipe as recipe
import tokenizers

from deepinfer.structured.backend import DSML_MARKER, THINK_END, THINK_START

logger = logging.getLogger(__name__)

_PADDING = re.compile(r"^<｜tok_\d+｜>$")


def special_spellings() -> list[str]:
    """recipe's default spelling of every special token it may render or parse."""
    return [getattr(recipe.SpecialToken, n).default_str() for n in dir(recipe.SpecialToken)
            if n[:1].isupper()]


def complete_specials(spec: dict) -> tuple[dict, list[str]]:
    """(tokenizer.json with every missing special spelling in place of a padding added token, the
    spellings added). ValueError when there are fewer padding entries than missing spellings."""
    added = spec.get("added_tokens", [])
    have = {a["content"] for a in added}
    missing = [s for s in special_spellings() if s not in have]
    if not missing:
        return spec, []
    pads = [a for a in added if _PADDING.match(a["content"])]
    if len(pads) < len(missing):
        raise ValueError(f"tokenizer.json: lacks DeepSeek's special tokens {missing} and has only {len(pads)} "
                         "padding entries to hold them")
    spec = json.loads(json.dumps(spec))  # a copy
    pads = [a for a in spec["added_tokens"] if _PADDING.match(a["content"])][-len(missing):]
    for entry, spelling in zip(pads, missing):
        entry.update(content=spelling, special=True, normalized=False)
    return spec, missing


@dataclass
class ServingTokenizer:
    recipe: recipe.Tokenizer      # encodes prompts (through the encoding) and decodes outputs for recipe
    hf: tokenizers.Tokenizer      # the same vocabulary, for /v1/completions' own text
    # ids of <think> and </think> as the engine sees them (tokenizer.json as written): None for one that
    # took a padding entry here, which the engine's grammar backend does not know as a thinking token
    think_ids: tuple[int | None, int | None] = (None, None)
    # the DSML marker's id (tool-call grammars match it as that token): None where it took a padding entry
    dsml_id: int | None = None

    @classmethod
    def load(cls, model_dir: str | Path) -> "ServingTokenizer":
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"model: no tokenizer.json in {model_dir}; the server needs one")
        spec, added = complete_specials(json.loads(path.read_text()))
        if added:
            logger.warning("tokenizer.json lacks %d of DeepSeek's special tokens; they take padding entries "
                           "(%s)", len(added), ", ".join(added))
        text = json.dumps(spec, ensure_ascii=False)
        hf = tokenizers.Tokenizer.from_str(text)
        think = tuple(None if s in added else hf.token_to_id(s) for s in (THINK_START, THINK_END))
        dsml = None if DSML_MARKER in added else hf.token_to_id(DSML_MARKER)
        return cls(recipe.Tokenizer.from_str(text), hf, think, dsml)
