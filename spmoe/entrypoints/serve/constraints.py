"""What in a chat or completion request constrains its output -> one `GrammarSpec` (or None).

The request fields, as OpenAI and vLLM define them:
- `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`, or `{"type": "json_schema",
  "json_schema": {"name": ..., "schema": {...}}}`;
- vLLM's `structured_outputs`: one of `json` (a schema, as an object or its text), `regex`, `choice` (a list of
  strings), `grammar` (EBNF) or `json_object: true`; and the older `guided_json`, `guided_regex`,
  `guided_choice`, `guided_grammar`;
- `tool_choice` `"required"` or `{"type": "function", "function": {"name": ...}}` (chat only): the output is
  GLM's tool-call text, `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>…</tool_call>`, with
  each value following its argument's schema (a string argument may hold any text without `</`) and every
  required argument present. `required` allows one call of any tool, or several with `parallel_tool_calls`.

At most one of them may be given; anything malformed is a ValueError whose message the server returns as a 400.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from spmoe.engine.sampling.grammar import (
    GrammarSpec,
    compile_error_reason,
    json_schema_grammar,
    xgrammar,
)
from spmoe.entrypoints.serve.parsers.tool_calls import schema_types

if TYPE_CHECKING:
    import xgrammar as xgr

STRUCTURED_OUTPUT_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "ebnf"}
# any text without "</" (so that "</arg_value>" ends it) and without surrogates (see engine/sampling/grammar.py)
STRING_ARGUMENT = r'([^<\ud800-\udfff] | "<" [^/\ud800-\udfff])*'


def grammar_for_request(fields: dict, tools: list[dict] | None = None) -> GrammarSpec | None:
    """`fields`: the request body's fields (those absent or None are not given) -> the grammar its output must
    follow, or None."""
    given = {
        name: fields[name] for name in STRUCTURED_OUTPUT_FIELDS if fields.get(name) is not None
    }
    tool_choice = fields.get("tool_choice")
    if tool_choice == "required" or isinstance(tool_choice, dict):
        given["tool_choice"] = tool_choice
    if len(given) > 1:
        raise ValueError(
            f"only one of these may constrain the output, got {', '.join(sorted(given))}"
        )
    if not given:
        return None
    ((name, value),) = given.items()
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return _structured_outputs(value)
    if name == "tool_choice":
        return tool_call_grammar(
            tools or [], value, fields.get("parallel_tool_calls", True) is not False
        )
    return _structured(GUIDED_FIELDS[name], value, name)


def _response_format(value) -> GrammarSpec | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError(
                f"response_format.json_schema must be an object with a 'schema', got {spec!r}"[:300]
            )
        schema = spec.get("schema")
        return (
            GrammarSpec("json_object")
            if schema is None
            else _json_schema(schema, "response_format.json_schema")
        )
    raise ValueError(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}"
    )


def _structured_outputs(value) -> GrammarSpec:
    if not isinstance(value, dict):
        raise ValueError(f"structured_outputs must be an object, got {type(value).__name__}")
    given = [
        key for key in (*STRUCTURED_KINDS, "json_object") if value.get(key) not in (None, False)
    ]
    if len(given) != 1:
        expected = ", ".join((*STRUCTURED_KINDS, "json_object"))
        raise ValueError(
            f"structured_outputs must set exactly one of {expected}, got {given or 'none'}"
        )
    key = given[0]
    return (
        GrammarSpec("json_object")
        if key == "json_object"
        else _structured(key, value[key], f"structured_outputs.{key}")
    )


def _structured(key: str, value, where: str) -> GrammarSpec:
    if key == "json":
        return _json_schema(value, where)
    if key == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise ValueError(
                f"{where} must be a non-empty list of non-empty strings, got {value!r}"[:300]
            )
        return GrammarSpec("choice", json.dumps(value, ensure_ascii=False))
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where} must be a non-empty string, got {value!r}"[:300])
    return GrammarSpec(STRUCTURED_KINDS[key], value)


def _json_schema(schema, where: str) -> GrammarSpec:
    """A schema as an object or as its JSON text -> its spec, the text canonical (sorted keys) so that equal
    schemas share a cache entry."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"{where} is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON schema object, got {type(schema).__name__}")
    return GrammarSpec("json_schema", json.dumps(schema, sort_keys=True, ensure_ascii=False))


def tool_call_grammar(tools: list[dict], tool_choice, parallel: bool) -> GrammarSpec:
    """The grammar of GLM tool calls for `tool_choice` "required" (any of `tools`; one call, or one or more
    when `parallel`) or a named function (exactly one call of it)."""
    xgr = xgrammar()
    functions = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(
                f"each tool must be {{'type': 'function', 'function': {{'name': ...}}}}, got {tool!r}"[
                    :300
                ]
            )
        functions[function["name"]] = function.get("parameters") or {}
    if tool_choice == "required":
        if not functions:
            raise ValueError("tool_choice 'required' needs at least one tool in 'tools'")
        names = list(functions)
    else:
        name = (
            (tool_choice.get("function") or {}).get("name")
            if tool_choice.get("type") == "function"
            else None
        )
        if name not in functions:
            raise ValueError(
                f"tool_choice names function {name!r}, which is not in 'tools' ({', '.join(functions)})"
            )
        names, parallel = [name], False
    calls = xgr.Grammar.union(*(_call_grammar(name, functions[name]) for name in names))
    ebnf = str(calls).replace(
        "root ::= ", "tool_call ::= ", 1
    )  # xgrammar writes the root rule first
    return GrammarSpec("ebnf", f"root ::= tool_call{'+' if parallel else ''}\n{ebnf}")


def _call_grammar(name: str, parameters: dict) -> xgr.Grammar:
    """`<tool_call>name`, the arguments in the schema's order (the required ones always, the others optional),
    `</tool_call>`."""
    xgr = xgrammar()
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or [])
    parts = [_literal(f"<tool_call>{name}")]
    for key, schema in properties.items():
        opening = f"<arg_key>{key}</arg_key><arg_value>"
        try:
            text = (
                _string_argument(schema)
                if schema_types(schema) == {"string"}
                else _typed_argument(schema)
            )
        except RuntimeError as e:
            reason = compile_error_reason(e)
            raise ValueError(
                f"the schema of {name}'s argument {key!r} does not compile: {reason}"[:400]
            ) from None
        value = xgr.Grammar.concat(_literal(opening), text, _literal("</arg_value>"))
        parts.append(value if key in required else xgr.Grammar.union(value, _literal("")))
    parts.append(_literal("</tool_call>"))
    return xgr.Grammar.concat(*parts)


def _string_argument(schema: dict) -> xgr.Grammar:
    """A string argument is written raw (no quotes): its `enum` or `pattern` if it has one, else any text
    without "</" (`minLength` / `maxLength` are not enforced)."""
    xgr = xgrammar()
    if "enum" in schema or "const" in schema:
        return xgr.Grammar.union(*(_literal(v) for v in schema.get("enum", [schema.get("const")])))
    if "pattern" in schema:
        return xgr.Grammar.from_regex(schema["pattern"])
    return xgr.Grammar.from_ebnf(f"root ::= {STRING_ARGUMENT}")


def _typed_argument(schema: dict) -> xgr.Grammar:
    """Any other argument is written as JSON."""
    return json_schema_grammar(json.dumps(schema))


def _literal(text: str) -> xgr.Grammar:
    xgr = xgrammar()
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text, ensure_ascii=False)}")
