"""GLM tool calls whose every argument follows its JSON schema, as one grammar.

GLM writes a call as
`<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>…</tool_call>`, a string value
raw and any other as JSON (parsers/tool_calls.py reads it back). Each tool's call is an xgrammar
structural tag in its `glm_xml` style, which constrains every value by its schema: a string's
length, pattern, enum and format, numbers' bounds, nested objects and arrays. The tags are put
together by `tool_choice`:
- `required`: one call of any tool, or one or more with `parallel_tool_calls`; a named function: one
  call of it;
- `auto`: free text in which each `<tool_call>` opens a call that follows its tool's schema (at most
  one call without `parallel_tool_calls`).

The grammar writes the GLM-4.7 layout: no whitespace between the tags, and compact JSON (`{"a":1}`).
A string value with a length bound holds no `<` (so that `</arg_value>` cannot hide inside it); one
without a bound holds anything but `</arg_value>`.

Each tool's parameters go through the keyword policy of schema_policy.py, under the tool's own
`strict`.
"""

import json

from spmoe.engine.request import GrammarSpec
from spmoe.engine.sampling.grammar import (
    compile_error_reason,
    with_json_string_characters,
    xgrammar,
)
from spmoe.engine.sampling.json_schema import with_unique_items
from spmoe.entrypoints.serve.schema_policy import OutputGrammar, Unenforced, checked

WHITESPACE = r"[ \n\r\t]*"  # how xgrammar writes optional whitespace
ANY_CHARACTER = (
    r"[\0-\U0010ffff]"  # a length-bounded raw string's characters, as xgrammar writes them
)
BOUNDED_STRING_CHARACTER = (
    r"[^<\ud800-\udfff]"  # no "<", no surrogate (see engine/sampling/grammar.py)
)
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


def tool_call_grammar(tools: list[dict], tool_choice, parallel: bool) -> OutputGrammar:
    """`tool_choice`: "required", "auto" or {"type": "function", "function": {"name": ...}};
    `parallel`: whether several calls may come -> the grammar of the output (see the module's
    docstring)."""
    st = xgrammar().structural_tag
    functions, unenforced = _parameters(tools)
    tags = {name: _call_tag(name, parameters) for name, parameters in functions.items()}
    if tool_choice == "auto":
        fmt = st.TriggeredTagsFormat(
            triggers=[TOOL_CALL_START], tags=list(tags.values()), stop_after_first=not parallel
        )
    else:
        chosen = [tags[name] for name in _chosen(tags, tool_choice)]
        fmt = st.OrFormat(elements=chosen) if len(chosen) > 1 else chosen[0]
        fmt = st.PlusFormat(content=fmt) if parallel and tool_choice == "required" else fmt
    return OutputGrammar(GrammarSpec("ebnf", _ebnf(st.StructuralTag(format=fmt))), unenforced)


def json_call_list_grammar(tools: list[dict], tool_choice, parallel: bool) -> OutputGrammar:
    """The output of a `required` / named `tool_choice` as a JSON list of calls, `[{"name": NAME,
    "parameters": {...}}, …]` (parsers/json_calls.py): at least one call, one at most unless
    `parallel` with `required`, each call's parameters following the tool's schema."""
    functions, unenforced = _parameters(tools)
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": functions[name]},
            "required": ["name", "parameters"],
        }
        for name in _chosen(functions, tool_choice)
    ]
    schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    schema |= {"minItems": 1} | ({} if parallel and tool_choice == "required" else {"maxItems": 1})
    text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    return OutputGrammar(GrammarSpec("json_schema", text), unenforced)


def _parameters(tools: list[dict]) -> tuple[dict[str, dict], tuple[Unenforced, ...]]:
    """-> ({tool name: its parameters' schema}, the keywords they leave unenforced); ValueError for
    a tool or a schema that cannot be constrained."""
    functions, unenforced = {}, ()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(
                "each tool must be {'type': 'function', 'function': {'name': ...}}, "
                f"got {tool!r}"[:300]
            )
        name, parameters = function["name"], function.get("parameters") or {"type": "object"}
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            got = parameters.get("type") if isinstance(parameters, dict) else parameters
            raise ValueError(
                f"tool {name!r}: parameters must be an object schema, got {got!r}"[:300]
            )
        strict = function.get("strict") is True
        unenforced += checked(parameters, f"tools[{i}].function.parameters", strict)
        functions[name] = parameters
    return functions, unenforced


def _chosen(functions: dict, tool_choice) -> list[str]:
    """The names a `required` or named `tool_choice` allows."""
    if tool_choice == "required":
        if not functions:
            raise ValueError("tool_choice 'required' needs at least one tool in 'tools'")
        return list(functions)
    function = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = (function or {}).get("name")
    if name not in functions:
        raise ValueError(
            f"tool_choice names function {name!r}, which is not in 'tools' ({', '.join(functions)})"
        )
    return [name]


def _call_tag(name: str, parameters: dict):
    """The structural tag of a call of tool `name`."""
    st = xgrammar().structural_tag
    where = f"tool {name!r}: parameters"
    content = st.JSONSchemaFormat(json_schema=with_unique_items(parameters), style="glm_xml")
    tag = st.TagFormat(begin=TOOL_CALL_START + name, content=content, end=TOOL_CALL_END)
    try:  # alone, so that an error names its tool
        _ebnf(st.StructuralTag(format=tag))
    except RuntimeError as e:
        raise ValueError(f"{where} do not compile: {compile_error_reason(e)}"[:400]) from None
    return tag


def _ebnf(tag) -> str:
    """A structural tag -> its EBNF text, without optional whitespace, with a bounded raw string's
    characters (see the module's docstring) and JSON's string characters
    (with_json_string_characters)."""
    xgr = xgrammar()
    ebnf = str(xgr.Grammar.from_structural_tag(tag.model_dump_json()))
    ebnf = ebnf.replace(WHITESPACE, '""').replace(ANY_CHARACTER, BOUNDED_STRING_CHARACTER)
    ebnf = with_json_string_characters(ebnf)
    return str(xgr.Grammar.from_ebnf(ebnf))  # checked here, not at the engine's compile
