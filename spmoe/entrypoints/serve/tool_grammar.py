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

A schema keyword xgrammar would drop without enforcing is refused with a ValueError that names it
and where it is (`check_enforceable`), rather than let a call through that breaks its schema.
"""

import json

from spmoe.engine.request import GrammarSpec
from spmoe.engine.sampling.grammar import (
    compile_error_reason,
    with_json_string_characters,
    xgrammar,
)

# what xgrammar 0.2.9 enforces (each checked against a value that breaks it in test_tool_grammar.py)
ENFORCED_KEYWORDS = frozenset(
    (
        "type",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "enum",
        "const",
        "anyOf",
        "allOf",  # with one schema; more are refused below
        "$ref",
        "$defs",
        "definitions",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "minProperties",
        "maxProperties",
        "patternProperties",
        "propertyNames",
        "unevaluatedProperties",
    )
)
ANNOTATIONS = frozenset(  # keywords that say nothing about which values are valid
    (
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "contentMediaType",
        "contentEncoding",
    )
)
FORMATS = frozenset(
    (
        "date",
        "time",
        "date-time",
        "duration",
        "email",
        "hostname",
        "ipv4",
        "ipv6",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
        "uuid",
    )
)
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # {name: schema}
SCHEMA_LISTS = ("prefixItems", "anyOf", "allOf")  # [schema, ...]
SCHEMA_VALUES = ("items", "additionalProperties", "unevaluatedProperties", "propertyNames")
WHITESPACE = r"[ \n\r\t]*"  # how xgrammar writes optional whitespace
ANY_CHARACTER = (
    r"[\0-\U0010ffff]"  # a length-bounded raw string's characters, as xgrammar writes them
)
BOUNDED_STRING_CHARACTER = (
    r"[^<\ud800-\udfff]"  # no "<", no surrogate (see engine/sampling/grammar.py)
)
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


def check_enforceable(schema, where: str) -> None:
    """ValueError naming the first keyword of `schema` (at any depth) that the grammar would not
    enforce."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON schema object, got {type(schema).__name__}")
    for key, value in schema.items():
        if key in ANNOTATIONS:
            continue
        if key not in ENFORCED_KEYWORDS:
            raise ValueError(
                f"{where} uses '{key}', which the tool-call grammar cannot enforce "
                "(docs/glm-chat.md lists what it enforces)"
            )
        if key == "format" and value not in FORMATS:
            raise ValueError(
                f"{where} has format {value!r}, which the tool-call grammar cannot enforce; "
                f"it enforces {', '.join(sorted(FORMATS))}"
            )
        if key == "allOf" and len(value) != 1:
            raise ValueError(f"{where} has 'allOf' with {len(value)} schemas; only one is enforced")
        if key in SCHEMA_MAPS and isinstance(value, dict):
            for name, inner in value.items():
                check_enforceable(inner, f"{where}.{key}.{name}")
        elif key in SCHEMA_LISTS and isinstance(value, list):
            for i, inner in enumerate(value):
                check_enforceable(inner, f"{where}.{key}[{i}]")
        elif key in SCHEMA_VALUES:
            check_enforceable(value, f"{where}.{key}")


def tool_call_grammar(tools: list[dict], tool_choice, parallel: bool) -> GrammarSpec:
    """`tool_choice`: "required", "auto" or {"type": "function", "function": {"name": ...}};
    `parallel`: whether several calls may come -> the grammar of the output (see the module's
    docstring)."""
    st = xgrammar().structural_tag
    tags = {name: _call_tag(name, parameters) for name, parameters in _parameters(tools).items()}
    if tool_choice == "auto":
        fmt = st.TriggeredTagsFormat(
            triggers=[TOOL_CALL_START], tags=list(tags.values()), stop_after_first=not parallel
        )
    else:
        chosen = [tags[name] for name in _chosen(tags, tool_choice)]
        fmt = st.OrFormat(elements=chosen) if len(chosen) > 1 else chosen[0]
        fmt = st.PlusFormat(content=fmt) if parallel and tool_choice == "required" else fmt
    return GrammarSpec("ebnf", _ebnf(st.StructuralTag(format=fmt)))


def json_call_list_grammar(tools: list[dict], tool_choice, parallel: bool) -> GrammarSpec:
    """The output of a `required` / named `tool_choice` as a JSON list of calls, `[{"name": NAME,
    "parameters": {...}}, …]` (parsers/json_calls.py): at least one call, one at most unless
    `parallel` with `required`, each call's parameters following the tool's schema."""
    functions = _parameters(tools)
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
    return GrammarSpec("json_schema", json.dumps(schema, ensure_ascii=False))


def _parameters(tools: list[dict]) -> dict[str, dict]:
    """{tool name: its parameters' schema}; ValueError for a tool or a schema that cannot be
    constrained."""
    functions = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(
                "each tool must be {'type': 'function', 'function': {'name': ...}}, "
                f"got {tool!r}"[:300]
            )
        name, parameters = function["name"], function.get("parameters") or {"type": "object"}
        where = f"tool {name!r}: parameters"
        check_enforceable(parameters, where)
        if parameters.get("type", "object") != "object":
            raise ValueError(f"{where} must be an object schema, got type {parameters['type']!r}")
        functions[name] = parameters
    return functions


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
    content = st.JSONSchemaFormat(json_schema=parameters, style="glm_xml")
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
