"""`--tool-call-parser glm47` (and `glm45`): GLM's tool calls in the generated text -> OpenAI
`tool_calls`.

GLM writes a call as `<tool_call>NAME` followed by
`<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>` pairs and `</tool_call>`. GLM-4.5 puts a
newline after the name and between the tags; GLM-4.7 and later write them with nothing between, so
the name runs straight into the first `<arg_key>`. One parser reads both: whitespace between the
tags is optional. A call may have no arguments, and a turn may hold several calls (parallel calls).

A string value is written raw; any other value as JSON. The tool's JSON schema says which is which:
a key whose schema type is `string` becomes a JSON string, anything else is parsed as JSON (a number
stays a number, `true` a boolean, `{…}` an object) and kept as a string only when it does not parse
or its type is not one the schema allows while `string` is.

Streaming: the first delta of a call carries its index, id, type and `function.name`; the arguments
follow as pieces of one JSON object text. A string value is JSON-escaped and sent as it arrives,
never held until the call closes; a typed value is sent when its `</arg_value>` arrives (its whole
text is needed to parse it). Text before a call is content; whitespace between content and a call,
and after a call, is dropped.
"""

import json
import uuid
from dataclasses import dataclass

from spmoe.entrypoints.serve.frontend.parsers.markers import partial_marker_length

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
ARG_KEY_START, ARG_KEY_END = "<arg_key>", "</arg_key>"
ARG_VALUE_START, ARG_VALUE_END = "<arg_value>", "</arg_value>"
JSON_TYPES = {
    str: "string",
    bool: "boolean",
    int: "integer",
    float: "number",
    list: "array",
    dict: "object",
}


@dataclass
class ToolCallDelta:
    """One streamed piece of the call at `index`: the first has `id` and `name`, the others
    `arguments` text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def as_openai(self) -> dict:
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text

    def as_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def assemble_tool_calls(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """Deltas -> the whole calls, in index order (as a client reassembles a stream)."""
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        if delta.name is not None:
            calls[delta.index] = ToolCall(delta.id, delta.name, "")
        calls[delta.index].arguments += delta.arguments
    return [calls[i] for i in sorted(calls)]


def coalesce_deltas(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive deltas of one call as one (fewer, larger pieces in a stream chunk; the same
    calls)."""
    out: list[ToolCallDelta] = []
    for delta in deltas:
        if out and out[-1].index == delta.index and delta.name is None:
            out[-1] = ToolCallDelta(
                delta.index, out[-1].arguments + delta.arguments, out[-1].id, out[-1].name
            )
        else:
            out.append(delta)
    return out


def tool_argument_schemas(tools: list[dict]) -> dict[str, dict]:
    """OpenAI `tools` -> {function name: {argument name: its JSON schema}}."""
    schemas = {}
    for tool in tools:
        function = tool.get("function") or {}
        parameters = function.get("parameters") or {}
        schemas[function.get("name", "")] = dict(parameters.get("properties") or {})
    return schemas


def schema_types(schema: dict) -> set[str]:
    """The JSON types a schema allows, as far as its `type`, `enum`, `const` and `anyOf` / `oneOf`
    say; empty when it says nothing (any type)."""
    if "type" in schema:
        kind = schema["type"]
        return set(kind) if isinstance(kind, list) else {kind}
    if "enum" in schema or "const" in schema:
        values = schema.get("enum", [schema.get("const")])
        return {_json_type(v) for v in values}
    types = set()
    for option in schema.get("anyOf", []) + schema.get("oneOf", []):
        option_types = schema_types(option)
        if not option_types:
            return set()
        types |= option_types
    return types


def _json_type(value) -> str:
    return "null" if value is None else JSON_TYPES.get(type(value), "string")


def typed_value(text: str, schema: dict):
    """A non-string argument's text -> its JSON value, as the schema types it (see the module's
    docstring)."""
    types = schema_types(schema)
    try:
        value = json.loads(text)
    except ValueError:
        lowered = text.strip().lower()
        if "boolean" in types and lowered in ("true", "false"):  # Python's spelling of a boolean
            return lowered == "true"
        return text
    kind = _json_type(value)
    allowed = kind in types or (kind == "integer" and "number" in types)
    if types and not allowed and "string" in types:
        return text
    return value


class GlmToolCallParser:
    """`feed(text)` -> (content, tool-call deltas) for the new text; `flush()` -> the same for what
    was held back at the end (a call the generation left open stays open: see `flush`)."""

    CONTENT, NAME, ARGS, KEY, VALUE_START, STRING_VALUE, TYPED_VALUE = range(7)

    def __init__(self, tools: list[dict]):
        self.schemas = tool_argument_schemas(tools)
        self.state = self.CONTENT
        self.buffer = ""  # fed text not consumed yet
        self.held_space = ""  # whitespace at the end of the content: dropped if a call follows
        self.after_call = False  # drop whitespace until the next content character
        self.index = -1  # the current call's
        self.name = ""
        self.key = ""
        self.arguments_open = False  # whether the current call's arguments have their "{"

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.buffer += text
        content, deltas = [], []
        while self._step(content, deltas):
            pass
        return "".join(content), deltas

    def flush(self, cut: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """What was held back, at the end of the generation (`cut`: by the length limit). Nothing
        is repaired: a call left open keeps its arguments as generated, unterminated (invalid JSON,
        so that a client sees the call is broken); a call whose name did not end is not a call; a
        tag cut off is dropped (a cut generation's text ending in the start of `<tool_call>` is no
        content)."""
        content, deltas = self.feed("")
        rest, self.buffer = self.buffer, ""
        if self.state == self.CONTENT:
            if not (cut and rest):
                content += self.held_space + rest
            self.held_space = ""
        elif self.state == self.TYPED_VALUE:  # the value's text as generated, without a cut-off tag
            text = rest[: len(rest) - partial_marker_length(rest, (ARG_VALUE_END,))]
            deltas.append(ToolCallDelta(self.index, self._key_prefix() + text))
        elif self.state == self.KEY:  # the key's text as generated, without a cut-off tag
            key = rest[: len(rest) - partial_marker_length(rest, (ARG_KEY_END,))].lstrip()
            prefix = ", " if self.arguments_open else "{"
            deltas.append(ToolCallDelta(self.index, f'{prefix}"{_escaped(key)}'))
        elif self.state == self.VALUE_START:
            deltas.append(ToolCallDelta(self.index, self._key_prefix()))
        elif self.state == self.ARGS and not self.arguments_open:  # "": a call without arguments
            deltas.append(ToolCallDelta(self.index, "{"))
        return content, deltas

    def _step(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        """Consume what the buffer allows in the current state; True if the state moved on."""
        buffer = self.buffer
        if self.state == self.CONTENT:
            start = buffer.find(TOOL_CALL_START)
            if start >= 0:
                self._content(buffer[:start], content)
                self.held_space, self.after_call = "", False
                self.buffer, self.state = buffer[start + len(TOOL_CALL_START) :], self.NAME
                return True
            keep = len(buffer) - partial_marker_length(buffer, (TOOL_CALL_START,))
            self._content(buffer[:keep], content)
            self.buffer = buffer[keep:]
            return False
        if self.state == self.NAME:
            name = buffer.lstrip()
            end = next((i for i, c in enumerate(name) if c == "<" or c.isspace()), None)
            if end is None:
                return False
            self._open_call(name[:end], deltas)
            self.buffer, self.state = name[end:], self.ARGS
            return True
        if self.state in (self.ARGS, self.VALUE_START):
            rest = buffer.lstrip()
            expected = (
                (ARG_KEY_START, TOOL_CALL_END) if self.state == self.ARGS else (ARG_VALUE_START,)
            )
            tag = next((t for t in expected if rest.startswith(t)), None)
            if tag is None:
                if any(
                    t.startswith(rest) for t in expected
                ):  # a tag still arriving (or nothing yet)
                    self.buffer = rest
                    return False
                # text that is no tag inside a call (a model's slip): skipped up to the next tag
                next_tag = rest.find("<", 1)
                self.buffer = rest[next_tag:] if next_tag >= 0 else ""
                return next_tag >= 0
            self.buffer = rest[len(tag) :]
            if tag == ARG_KEY_START:
                self.state = self.KEY
            elif tag == TOOL_CALL_END:
                self._close_call(deltas)
                self.state, self.after_call = self.CONTENT, True
            elif self._is_string(self.key):
                deltas.append(ToolCallDelta(self.index, self._key_prefix() + '"'))
                self.state = self.STRING_VALUE
            else:
                self.state = self.TYPED_VALUE
            return True
        if self.state == self.KEY:
            end = buffer.find(ARG_KEY_END)
            if end < 0:
                return False
            self.key = buffer[:end].strip()
            self.buffer, self.state = buffer[end + len(ARG_KEY_END) :], self.VALUE_START
            return True
        end = buffer.find(ARG_VALUE_END)
        if self.state == self.STRING_VALUE:
            keep = (
                end if end >= 0 else len(buffer) - partial_marker_length(buffer, (ARG_VALUE_END,))
            )
            piece = _escaped(buffer[:keep]) + ('"' if end >= 0 else "")
            if piece:
                deltas.append(ToolCallDelta(self.index, piece))
        elif end >= 0:  # a typed value: only once it is whole
            self._typed_argument(buffer[:end], deltas)
        if end < 0:
            if self.state == self.STRING_VALUE:
                self.buffer = buffer[keep:]
            return False
        self.buffer, self.state = buffer[end + len(ARG_VALUE_END) :], self.ARGS
        return True

    def _content(self, text: str, content: list[str]) -> None:
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        text = self.held_space + text
        body = text.rstrip()
        self.held_space = text[len(body) :]
        content.append(body)

    def _open_call(self, name: str, deltas: list[ToolCallDelta]) -> None:
        self.index += 1
        self.name, self.key, self.arguments_open = name, "", False
        deltas.append(ToolCallDelta(self.index, "", id=f"call_{uuid.uuid4().hex[:24]}", name=name))

    def _close_call(self, deltas: list[ToolCallDelta]) -> None:
        deltas.append(ToolCallDelta(self.index, "}" if self.arguments_open else "{}"))

    def _argument_schema(self, key: str) -> dict:
        return self.schemas.get(self.name, {}).get(key) or {}

    def _is_string(self, key: str) -> bool:
        return schema_types(self._argument_schema(key)) == {"string"}

    def _key_prefix(self) -> str:
        prefix = ", " if self.arguments_open else "{"
        self.arguments_open = True
        return f"{prefix}{json.dumps(self.key, ensure_ascii=False)}: "

    def _typed_argument(self, text: str, deltas: list[ToolCallDelta]) -> None:
        value = typed_value(text, self._argument_schema(self.key))
        deltas.append(
            ToolCallDelta(self.index, self._key_prefix() + json.dumps(value, ensure_ascii=False))
        )


def _escaped(text: str) -> str:
    """`text` as it reads inside a JSON string (pieces escaped one by one join to the whole text
    escaped)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]
