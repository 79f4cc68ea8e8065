"""A chat turn's generated text -> its reasoning, content and tool calls, a piece at a time: the
reasoning parser splits the thinking off first, then the tool-call parser reads the content that
remains (a call is only looked for in the answer, never in the reasoning). The parsers are chosen by
name, as on the command line."""

from dataclasses import dataclass, field

from spmoe.entrypoints.serve.frontend.parsers.json_calls import JsonCallListParser
from spmoe.entrypoints.serve.frontend.parsers.reasoning import Glm45ReasoningParser, ReasoningSplit
from spmoe.entrypoints.serve.frontend.parsers.tool_calls import (
    GlmToolCallParser,
    ToolCall,
    ToolCallDelta,
    assemble_tool_calls,
)

REASONING_PARSERS = {"glm45": Glm45ReasoningParser}
TOOL_CALL_PARSERS = {
    "glm45": GlmToolCallParser,
    "glm47": GlmToolCallParser,
}  # one reader for both layouts
JSON_CALLS = "json"  # a forced call's JSON list, without --tool-call-parser (not a flag's value)


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class ChatMessageOut:
    reasoning: str
    content: str
    tool_calls: list[ToolCall]


class ChatOutputParser:
    """`feed(text)` / `flush()` -> a `ChatDelta` each; `parse(text)` the whole message at once. A
    parser left out (None) passes its part through: without a reasoning parser everything is
    content, without a tool-call parser (or with `tool_choice: none`) no call is read."""

    def __init__(self, reasoning: Glm45ReasoningParser | None, tools):
        self.reasoning, self.tools = reasoning, tools

    @classmethod
    def build(
        cls,
        reasoning_parser: str | None,
        tool_call_parser: str | None,
        prompt_text: str,
        thinking: bool,
        tools: list[dict] | None,
    ) -> "ChatOutputParser":
        """The parsers by their command-line names; `tools` None: no tool-call parsing for this
        request."""
        reasoning = (
            REASONING_PARSERS[reasoning_parser](prompt_text, thinking) if reasoning_parser else None
        )
        parsers = TOOL_CALL_PARSERS | {JSON_CALLS: JsonCallListParser}
        calls = parsers[tool_call_parser](tools) if tool_call_parser and tools is not None else None
        return cls(reasoning, calls)

    def feed(self, text: str) -> ChatDelta:
        split = self.reasoning.feed(text) if self.reasoning else ReasoningSplit(content=text)
        return self._calls(split, final=False)

    def flush(self, cut: bool = False) -> ChatDelta:
        """`cut`: the generation was cut by the length limit (GlmToolCallParser.flush)."""
        split = self.reasoning.flush() if self.reasoning else ReasoningSplit()
        return self._calls(split, final=True, cut=cut)

    def _calls(self, split: ReasoningSplit, final: bool, cut: bool = False) -> ChatDelta:
        if self.tools is None:
            return ChatDelta(split.reasoning, split.content)
        content, deltas = self.tools.feed(split.content)
        if final:
            rest, more = self.tools.flush(cut)
            content, deltas = content + rest, deltas + more
        return ChatDelta(split.reasoning, content, deltas)

    def parse(self, text: str, cut: bool = False) -> ChatMessageOut:
        whole, last = self.feed(text), self.flush(cut)
        return ChatMessageOut(
            whole.reasoning + last.reasoning,
            whole.content + last.content,
            assemble_tool_calls(whole.tool_calls + last.tool_calls),
        )
