"""The grammar of GLM tool calls, as the front end asks for it: a spec of kind "tool_calls" that
names the tools, each with its parameters' schema, and how the calls may come (`request.ToolCalls`);
the engine process builds and compiles the grammar (`spmoe/engine/sampling/tool_call_grammar.py`),
and a tool whose parameters do not compile is refused there, a 400 naming the tool. `tool_choice`:
- `required`: one call of any tool, or one or more with `parallel_tool_calls`; a named function: one
  call of it;
- `auto`: free text in which each `<tool_call>` opens a call that follows its tool's schema (at most
  one call without `parallel_tool_calls`).

Each tool's parameters go through the keyword policy of schema_policy.py, under the tool's own
`strict`, and travel with the `uniqueItems` they can enforce written out (json_schema.py).
`json_call_list_grammar` writes the calls as a JSON list instead (a plain JSON schema).
"""

import json

from spmoe.engine.request import GrammarSpec, ToolCalls
from spmoe.entrypoints.serve.frontend.json_schema import with_unique_items
from spmoe.entrypoints.serve.frontend.schema_policy import OutputGrammar, Unenforced, checked


def tool_call_grammar(tools: list[dict], tool_choice, parallel: bool) -> OutputGrammar:
    """`tool_choice`: "required", "auto" or {"type": "function", "function": {"name": ...}};
    `parallel`: whether several calls may come -> the grammar of the output (see the module's
    docstring)."""
    functions, unenforced = _parameters(tools)
    auto = tool_choice == "auto"
    names = list(functions) if auto else _chosen(functions, tool_choice)
    calls = ToolCalls(
        tools=[(name, functions[name]) for name in names],
        free_text=auto,
        several=parallel and tool_choice in ("auto", "required"),
    )
    return OutputGrammar(GrammarSpec("tool_calls", calls.spec_text()), unenforced)


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
    """-> ({tool name: its parameters' schema as the grammar takes it}, the keywords they leave
    unenforced); ValueError for a tool or a schema that cannot be constrained."""
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
        functions[name] = with_unique_items(parameters)
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
