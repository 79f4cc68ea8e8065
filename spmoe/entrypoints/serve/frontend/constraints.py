"""What in a chat or completion request constrains its output -> one `GrammarSpec` (or None).

The request fields, as OpenAI and vLLM define them:
- `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`, or `{"type":
  "json_schema", "json_schema": {"name": ..., "schema": {...}}}`;
- vLLM's `structured_outputs`: one of `json` (a schema, as an object or its text), `regex`, `choice`
  (a list of strings), `grammar` (EBNF) or `json_object: true`; and the older `guided_json`,
  `guided_regex`, `guided_choice`, `guided_grammar`;
- `tool_choice` `"required"` or `{"type": "function", "function": {"name": ...}}` (chat only): the
  output is GLM's tool calls (or, with `tool_call_format` "json", a JSON list of calls), every
  argument following its schema (tool_grammar.py). `required` allows one call of any tool, or
  several with `parallel_tool_calls`.
- `tool_choice` `"auto"` with `tools` and none of the above: the output is free, but each
  `<tool_call>` it opens follows its tool's schema.

At most one of them may be given, except that `response_format` may come with a forced
`tool_choice`, as OpenAI allows: the forced call is then the output (there is no message text to
constrain), and `response_format` is read only for its shape. Anything malformed is a ValueError
whose message the server returns as a 400.

A JSON schema is compiled as the client wrote it (its properties in the order given: the output's
keys come in that order); its spec, and so the grammar cache's key, is its compact text, so that the
same schema differently spaced shares an entry, and two that differ only in property order are two
grammars. Every schema goes through the keyword policy of schema_policy.py (`strict` from
`response_format.json_schema.strict`; `guided_json` and `structured_outputs.json` have none).
"""

from __future__ import annotations

import json

from spmoe.engine.request import GrammarSpec
from spmoe.entrypoints.serve.frontend.json_schema import with_unique_items
from spmoe.entrypoints.serve.frontend.schema_policy import OutputGrammar, checked
from spmoe.entrypoints.serve.frontend.tool_grammar import json_call_list_grammar, tool_call_grammar

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


def grammar_for_request(fields: dict, tools: list[dict] | None = None) -> OutputGrammar | None:
    """`fields`: the request body's fields (those absent or None are not given) -> the grammar its
    output must follow, or None."""
    given = {
        name: fields[name] for name in STRUCTURED_OUTPUT_FIELDS if fields.get(name) is not None
    }
    tool_choice = fields.get("tool_choice")
    if tool_choice == "required" or isinstance(tool_choice, dict):
        if "response_format" in given:
            _read_response_format(given.pop("response_format"))
        given["tool_choice"] = tool_choice
    if len(given) > 1:
        raise ValueError(
            f"only one of these may constrain the output, got {', '.join(sorted(given))}"
        )
    parallel = fields.get("parallel_tool_calls", True) is not False
    if not given:
        return (
            tool_call_grammar(tools, "auto", parallel) if tool_choice == "auto" and tools else None
        )
    ((name, value),) = given.items()
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return _structured_outputs(value)
    if name == "tool_choice":
        json_calls = fields.get("tool_call_format") == "json"
        grammar = json_call_list_grammar if json_calls else tool_call_grammar
        return grammar(tools or [], value, parallel)
    return _structured(GUIDED_FIELDS[name], value, name)


def _read_response_format(value) -> tuple[str, object, bool]:
    """`response_format` -> (its type, its schema or None, its `strict`); ValueError for a malformed
    one."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("text", "json_object"):
        return kind, None, False
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError(
                f"response_format.json_schema must be an object with a 'schema', got {spec!r}"[:300]
            )
        return kind, spec.get("schema"), spec.get("strict") is True
    raise ValueError(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}"
    )


def _response_format(value) -> OutputGrammar | None:
    kind, schema, strict = _read_response_format(value)
    if kind == "text":
        return None
    if schema is None:
        return OutputGrammar(GrammarSpec("json_object"))
    return _json_schema(schema, strict, "response_format.json_schema.schema")


def _structured_outputs(value) -> OutputGrammar:
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
        OutputGrammar(GrammarSpec("json_object"))
        if key == "json_object"
        else _structured(key, value[key], f"structured_outputs.{key}")
    )


def _structured(key: str, value, where: str) -> OutputGrammar:
    if key == "json":
        return _json_schema(value, False, where)
    if key == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise ValueError(
                f"{where} must be a non-empty list of non-empty strings, got {value!r}"[:300]
            )
        return OutputGrammar(GrammarSpec("choice", json.dumps(value, ensure_ascii=False)))
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where} must be a non-empty string, got {value!r}"[:300])
    return OutputGrammar(GrammarSpec(STRUCTURED_KINDS[key], value))


def _json_schema(schema, strict: bool, where: str) -> OutputGrammar:
    """A schema as an object or as its JSON text -> its grammar: the schema's compact text, in the
    client's order with the `uniqueItems` it can enforce written out (`with_unique_items`), and the
    keywords it leaves unenforced (under `strict`: a ValueError)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"{where} is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON schema object, got {type(schema).__name__}")
    unenforced = checked(schema, where, strict)
    text = json.dumps(with_unique_items(schema), ensure_ascii=False, separators=(",", ":"))
    return OutputGrammar(GrammarSpec("json_schema", text), unenforced)
