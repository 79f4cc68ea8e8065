"""A grammar spec's text as xgrammar takes it: JSON schemas written compact with JSON's own string
characters, a choice's EBNF, and xgrammar's errors in one line. xgrammar is imported at the first
grammar (`xgrammar()`): the engine runs without it until a request asks for structured output."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import xgrammar as xgr

# xgrammar 0.2.9 writes a JSON string's characters as one of the first two classes: the first
# (length-bounded strings) lets raw control characters in, where JSON forbids them, and on a
# byte-level vocabulary both let the UTF-8 bytes of a surrogate (U+D800-U+DFFF, no character)
# through, which decode to U+FFFD and break the length bounds. The third class is JSON's characters
# without the surrogates.
LOOSE_STRING_CHARACTERS = (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]")
JSON_STRING_CHARACTER = r"[^\0-\x1f\"\\\ud800-\udfff]"


def xgrammar():
    """The xgrammar package, imported at the first grammar: the engine and the server run without it
    until a request asks for structured output (a GPU image may lack it)."""
    try:
        import xgrammar as module
    except ImportError:
        raise ValueError(
            "structured output needs the xgrammar package (pip install xgrammar)"
        ) from None
    return module


def json_schema_grammar(schema_text: str) -> xgr.Grammar:
    """A JSON schema's text -> its grammar (compact JSON: no whitespace beyond ", " and ": "), with
    JSON's string characters everywhere; RuntimeError (xgrammar's) for a schema it cannot
    convert."""
    xgr = xgrammar()
    ebnf = str(xgr.Grammar.from_json_schema(schema_text, any_whitespace=False))
    return xgr.Grammar.from_ebnf(with_json_string_characters(ebnf))


def with_json_string_characters(ebnf: str) -> str:
    """xgrammar's EBNF with JSON's string characters where it writes looser ones
    (LOOSE_STRING_CHARACTERS)."""
    for loose in LOOSE_STRING_CHARACTERS:
        ebnf = ebnf.replace(loose, JSON_STRING_CHARACTER)
    return ebnf


def compile_error_reason(error: Exception) -> str:
    """xgrammar's error -> its first line without the "[time] file.cc:line: " xgrammar puts before
    it."""
    lines = str(error).strip().splitlines()
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[0]) if lines else type(error).__name__


def choice_ebnf(choices: list[str]) -> str:
    """The EBNF grammar whose sentences are exactly `choices`."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(
            f"a choice must be a non-empty list of non-empty strings, got {choices!r}"[:300]
        )
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
