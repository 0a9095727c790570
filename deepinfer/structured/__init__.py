"""Structured outputs (`so_args`): grammars compiled with xgrammar, per-request matchers filling
token bitmasks on the host. CPU-only; xgrammar is imported on first use."""
from deepinfer.structured.backend import (SCHEMA_TYPES, GrammarBackend, GrammarKey, RequestGrammar,
                                          opens_thinking, parse_so_args)
from deepinfer.structured.frozen import FrozenGrammar, freeze_grammars

__all__ = ["SCHEMA_TYPES", "FrozenGrammar", "GrammarBackend", "GrammarKey", "RequestGrammar", "freeze_grammars",
           "opens_thinking", "parse_so_args"]
