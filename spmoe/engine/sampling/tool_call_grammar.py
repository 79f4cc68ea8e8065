"""GLM tool calls whose every argument follows its JSON schema, as one grammar: the EBNF of a
`GrammarSpec` of kind "tool_calls", whose text says which calls may come (`request.ToolCalls`; the
server's front end writes it, `entrypoints/serve/frontend/tool_grammar.py`, once the keyword policy
has read every schema).

GLM writes a call as
`<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>…</tool_call>`, a string value
raw and any other as JSON. Each tool's call is an xgrammar structural tag in its `glm_xml` style,
which constrains every value by its schema: a string's length, pattern, enum and format, numbers'
bounds, nested objects and arrays. The tags are put together as the spec says:
- free text (`tool_choice` `auto`) in which each `<tool_call>` opens a call that follows its tool's
  schema, at most one call unless several may come;
- else exactly the calls named: one call of any of them, or one or more when several may come.

The grammar writes the GLM-4.7 layout: no whitespace between the tags, and compact JSON (`{"a":1}`).
A string value with a length bound holds no `<` (so that `</arg_value>` cannot hide inside it); one
without a bound holds anything but `</arg_value>`.
"""

import msgspec

from spmoe.engine.request import ToolCalls
from spmoe.engine.sampling.grammar_text import (
    compile_error_reason,
    with_json_string_characters,
    xgrammar,
)

# how xgrammar writes optional whitespace
WHITESPACE = r"[ \n\r\t]*"
# a length-bounded raw string's characters, as xgrammar writes them
ANY_CHARACTER = r"[\0-\U0010ffff]"
# no "<", no surrogate (see grammar_text.py)
BOUNDED_STRING_CHARACTER = r"[^<\ud800-\udfff]"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


class ToolParametersError(ValueError):
    """A tool's parameters do not compile: the message names the tool."""


def tool_calls_ebnf(text: str) -> str:
    """A "tool_calls" spec's text -> its grammar's EBNF; ToolParametersError naming the first tool
    whose parameters do not compile."""
    calls = msgspec.json.decode(text, type=ToolCalls)
    st = xgrammar().structural_tag
    tags = [_call_tag(name, parameters) for name, parameters in calls.tools]
    if calls.free_text:
        fmt = st.TriggeredTagsFormat(
            triggers=[TOOL_CALL_START], tags=tags, stop_after_first=not calls.several
        )
    else:
        fmt = st.OrFormat(elements=tags) if len(tags) > 1 else tags[0]
        fmt = st.PlusFormat(content=fmt) if calls.several else fmt
    return _ebnf(st.StructuralTag(format=fmt))


def _call_tag(name: str, parameters: dict):
    """The structural tag of a call of tool `name`."""
    st = xgrammar().structural_tag
    content = st.JSONSchemaFormat(json_schema=parameters, style="glm_xml")
    tag = st.TagFormat(begin=TOOL_CALL_START + name, content=content, end=TOOL_CALL_END)
    # alone, so that an error names its tool
    try:
        _ebnf(st.StructuralTag(format=tag))
    except RuntimeError as e:
        raise ToolParametersError(
            f"tool {name!r}: parameters do not compile: {compile_error_reason(e)}"[:400]
        ) from None
    return tag


def _ebnf(tag) -> str:
    """A structural tag -> its EBNF text, without optional whitespace, with a bounded raw string's
    characters (see the module's docstring) and JSON's string characters
    (`with_json_string_characters`)."""
    xgr = xgrammar()
    ebnf = str(xgr.Grammar.from_structural_tag(tag.model_dump_json()))
    ebnf = ebnf.replace(WHITESPACE, '""').replace(ANY_CHARACTER, BOUNDED_STRING_CHARACTER)
    return with_json_string_characters(ebnf)
