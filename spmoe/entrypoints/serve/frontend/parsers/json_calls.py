"""Tool calls as a JSON list, `[{"name": NAME, "parameters": {...}}, …]`: the output of a
`required` or named `tool_choice` on a server without `--tool-call-parser` whose chat template is
not GLM's (as vLLM serves them; the grammar is tool_grammar.json_call_list_grammar, which writes
`name` before `parameters`).

The list is read once it is all there (`flush`): a stream gets the calls in its last chunk. A
list cut by the length limit gives its whole calls, then the cut one with its arguments as
generated (unterminated, at least `{`: see parsers/tool_calls.py), or nothing for a call whose
name is not whole.
"""

import json
import re
import uuid

from spmoe.entrypoints.serve.frontend.parsers.tool_calls import ToolCallDelta

CUT_CALL = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*')


class JsonCallListParser:
    """`feed(text)` -> ("", []) (the list is held); `flush(cut)` -> ("", the calls' deltas)."""

    def __init__(self, tools: list[dict]):
        self.text = ""

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.text += text
        return "", []

    def flush(self, cut: bool = False) -> tuple[str, list[ToolCallDelta]]:
        calls = []
        text, decoder = self.text.strip(), json.JSONDecoder()
        position = 1 if text.startswith("[") else len(text)
        while position < len(text) and text[position] != "]":
            try:
                call, position = decoder.raw_decode(text, position)
            except ValueError:
                opened = CUT_CALL.match(text, position)
                if opened:
                    calls.append((json.loads(opened.group(1)), text[opened.end() :] or "{"))
                break
            arguments = json.dumps(call["parameters"], ensure_ascii=False)
            calls.append((call["name"], arguments))
            position = len(text) - len(text[position:].lstrip().removeprefix(",").lstrip())
        return "", [
            ToolCallDelta(i, arguments, id=f"call_{uuid.uuid4().hex[:24]}", name=name)
            for i, (name, arguments) in enumerate(calls)
        ]
