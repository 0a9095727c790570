"""Character classes of a grammar as xgrammar prints it, rewritten to exclude code points.

xgrammar 0.2.9's classes admit what no valid output holds: UTF-16 surrogates (U+D800..U+DFFF, not
encodable in UTF-8; a random-weights model samples their 3-byte forms), in `[^...]` classes, in the
any-character class a regex's `.` becomes, and in wide ranges; and control characters in JSON
strings with minLength / maxLength (which JSON requires escaped). `exclude` rewrites the printed
grammar (outside quoted literals and Regex("...") rules, left to xgrammar) so that the classes leave
them out; Grammar.from_ebnf parses the result back.
"""
from __future__ import annotations

SURROGATES = (0xD800, 0xDFFF)
CONTROL = (0x00, 0x1F)
LINE_BREAKS = ((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))  # what ECMA-262's `.` leaves out
ANY_CHAR = r"\0-\U0010ffff"  # how xgrammar prints a regex's `.`
_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B, "0": 0x00, "b": 0x08, "a": 0x07, "e": 0x1B}
_HEX = {"x": 2, "u": 4, "U": 8}


def _char(body: str, i: int) -> tuple[int, int]:
    """The code point written at body[i] (a literal or an escape) and the index after it."""
    if body[i] != "\\":
        return ord(body[i]), i + 1
    e = body[i + 1]
    if e in _HEX:
        n = _HEX[e]
        return int(body[i + 2:i + 2 + n], 16), i + 2 + n
    return _ESCAPES.get(e, ord(e)), i + 2


def _ranges(body: str) -> list[tuple[int, int]]:
    out, i = [], 0
    while i < len(body):
        lo, i = _char(body, i)
        hi = lo
        if i + 1 < len(body) and body[i] == "-":
            hi, i = _char(body, i + 1)
        out.append((lo, hi))
    return out


def _write(cp: int) -> str:
    return f"\\U{cp:08x}"


def _without(ranges: list[tuple[int, int]], cut: list[tuple[int, int]]) -> list[tuple[int, int]]:
    for a, b in cut:
        ranges = [part for lo, hi in ranges
                  for part in ((lo, min(hi, a - 1)), (max(lo, b + 1), hi)) if part[0] <= part[1]]
    return ranges


def _class(body: str, everywhere: list, negated: list, any_char: list) -> str:
    if body.startswith("^"):
        return "^" + "".join(f"{_write(a)}-{_write(b)}" for a, b in everywhere + negated) + body[1:]
    cut = everywhere + any_char if body == ANY_CHAR else everywhere
    ranges = _ranges(body)
    kept = _without(ranges, cut)
    if kept == ranges:
        return body
    if not kept:  # nothing left: a class that matches no character
        return "^" + _write(0) + "-" + _write(0x10FFFF)
    return "".join(_write(a) if a == b else f"{_write(a)}-{_write(b)}" for a, b in kept)


def exclude(ebnf: str, everywhere: list[tuple[int, int]], negated: list[tuple[int, int]] = (),
            any_char: list[tuple[int, int]] = ()) -> str:
    """`ebnf` with the code point ranges `everywhere` taken out of every character class, `negated` out
    of the negated ones ([^...], which JSON strings' characters are), `any_char` out of the
    any-character class; quoted literals are left as they are."""
    out, i, n = [], 0, len(ebnf)
    while i < n:
        c = ebnf[i]
        if c not in "\"[":
            out.append(c)
            i += 1
            continue
        j = i + 1
        while j < n and ebnf[j] != ("\"" if c == "\"" else "]"):
            j += 2 if ebnf[j] == "\\" else 1
        body = ebnf[i + 1:j]
        if c == "[":
            body = _class(body, list(everywhere), list(negated), list(any_char))
        out.append(c + body + ebnf[j:j + 1])
        i = j + 1
    return "".join(out)
