"""Rewriting xgrammar's printed character classes: surrogates out of every class, control characters
out of negated ones (JSON string characters), line breaks out of a regex's `.`."""
import pytest

from deepinfer.structured.char_classes import ANY_CHAR, CONTROL, LINE_BREAKS, SURROGATES, exclude

S = r"\U0000d800-\U0000dfff"


@pytest.mark.parametrize("ebnf, want", [
    (r'root ::= [^a\n]', rf'root ::= [^{S}\U00000000-\U0000001fa\n]'),  # negated: the ranges added
    (r'root ::= [a-z]', r'root ::= [a-z]'),  # untouched when nothing is cut
    (r'root ::= [\ud000-\ue010]', r'root ::= [\U0000d000-\U0000d7ff\U0000e000-\U0000e010]'),
    (r'root ::= [\ud800-\udbff]', r'root ::= [^\U00000000-\U0010ffff]'),  # nothing left: matches nothing
    (r'root ::= [\n\r\t ]', r'root ::= [\n\r\t ]'),  # whitespace classes keep their control characters
    (r'root ::= "[^a]" "\"[\u3000-\uffff]"', r'root ::= "[^a]" "\"[\u3000-\uffff]"'),  # quoted literals
    (rf'root ::= [{ANY_CHAR}]', r'root ::= [\U00000000-\U00000009\U0000000b-\U0000000c\U0000000e-\U00002027'
                                r'\U0000202a-\U0000d7ff\U0000e000-\U0010ffff]'),
    (r'root ::= [\0-\x1f\-\]]', r'root ::= [\0-\x1f\-\]]'),  # escapes read (\- and \] are characters)
])
def test_exclude(ebnf, want):
    assert exclude(ebnf, [SURROGATES], [CONTROL], list(LINE_BREAKS)) == want


def test_any_char_keeps_line_breaks_unless_asked():
    assert exclude(rf'root ::= [{ANY_CHAR}]', [SURROGATES]) == \
        r'root ::= [\U00000000-\U0000d7ff\U0000e000-\U0010ffff]'


def test_rewritten_grammars_parse_back():
    xgr = pytest.importorskip("xgrammar")
    for regex in ["a.b", r"a[\s\S]b", r"a[^x]b", r"[\u3000-\uffff]+"]:
        text = exclude(str(xgr.Grammar.from_regex(regex)), [SURROGATES], [], list(LINE_BREAKS))
        assert "\\ud800-\\udfff" not in str(xgr.Grammar.from_ebnf(text)).replace("^\\ud800-\\udfff", "")


def test_a_rewrite_that_does_not_parse_back_keeps_xgrammars_grammar(monkeypatch):
    pytest.importorskip("xgrammar")
    from deepinfer.structured import backend
    from deepinfer.structured.backend import _build_grammar, parse_so_args
    key = parse_so_args({"schema_type": "regex", "schema": "a[^b]"})
    monkeypatch.setattr(backend, "exclude", lambda text, *a: text + " ::=")
    assert "[^b]" in str(_build_grammar(key))
