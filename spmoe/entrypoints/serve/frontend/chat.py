"""Chat in GLM's terms on the server side: the server's parser flags, the rules for `tools` /
`tool_choice`, the messages as the chat template takes them, and each choice of a response (whole or
streamed) with its `reasoning_content`, `content` and `tool_calls`.

`tool_choice`: `none` (calls are not read: the text is content), `auto` (the model decides; needs
`--enable-auto-tool-choice` and `--tool-call-parser`, as in vLLM), `required` or a named function
(the output is constrained to the calls by a grammar, see `tool_grammar.py`). Without
`--tool-call-parser`, as vLLM does, a forced call is GLM's call text where the chat template writes
GLM's calls, else a JSON list of calls (`parsers/json_calls.py`). With `tools` and no `tool_choice`,
`auto`. The finish reason of a turn that called a tool is `tool_calls`.
"""

import json
from dataclasses import dataclass, field

from spmoe.entrypoints.serve.frontend.parsers.chat_output import (
    JSON_CALLS,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    ChatOutputParser,
)
from spmoe.entrypoints.serve.frontend.parsers.reasoning import THINK_END, thinking_enabled
from spmoe.entrypoints.serve.frontend.parsers.tool_calls import coalesce_deltas
from spmoe.entrypoints.serve.frontend.tokenizer import SERVER_TEMPLATE_KWARGS


@dataclass(frozen=True)
class ChatOptions:
    """The server's `--reasoning-parser`, `--tool-call-parser`, `--enable-auto-tool-choice` and
    `--default-chat-template-kwargs` (the template arguments a request's `chat_template_kwargs` goes
    over, key by key, as in vLLM: `{"enable_thinking": false}` turns thinking off server-wide)."""

    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    default_template_kwargs: dict = field(default_factory=dict)

    def template_kwargs(self, requested: dict) -> dict:
        """A request's chat template arguments: the server's defaults, then the request's own."""
        return {**self.default_template_kwargs, **requested}

    def __post_init__(self):
        for flag, name, known in (
            ("--reasoning-parser", self.reasoning_parser, REASONING_PARSERS),
            ("--tool-call-parser", self.tool_call_parser, TOOL_CALL_PARSERS),
        ):
            if name is not None and name not in known:
                raise ValueError(f"{flag} must be one of {', '.join(known)}, got {name!r}")
        reserved = sorted(SERVER_TEMPLATE_KWARGS & set(self.default_template_kwargs))
        if reserved:
            raise ValueError(
                f"--default-chat-template-kwargs must not set {', '.join(reserved)}: the server "
                f"sets them"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "--enable-auto-tool-choice needs --tool-call-parser (glm47 or glm45 for GLM models)"
            )


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools as the server serves them: `choice` is "none", "auto", "required" or
    {"type": "function", "function": {"name": ...}}; `parser` reads the calls out of the output (a
    --tool-call-parser name, or JSON_CALLS; None: no calls are read)."""

    tools: list[dict] | None
    choice: str | dict
    parser: str | None
    parallel: bool = True

    @classmethod
    def for_request(cls, tools, tool_choice, parallel, options: ChatOptions, forced_parser: str):
        """The request's `tool_choice` checked against its tools and the server's flags; ValueError
        with what to change. `forced_parser`: the parser of a forced call without --tool-call-parser
        (`forced_call_parser`)."""
        if tool_choice is None:
            tool_choice = "auto" if tools else "none"
        if tool_choice == "none":
            return cls(tools, "none", None, parallel is not False)
        if not tools:
            raise ValueError(f"tool_choice {_shown(tool_choice)} needs 'tools'")
        if tool_choice == "auto" and options.tool_call_parser is None:
            raise ValueError(
                'tool_choice "auto" needs the server started with --tool-call-parser and '
                "--enable-auto-tool-choice"
            )
        if tool_choice == "auto" and not options.enable_auto_tool_choice:
            raise ValueError(
                'tool_choice "auto" needs the server started with --enable-auto-tool-choice'
            )
        return cls(
            tools, tool_choice, options.tool_call_parser or forced_parser, parallel is not False
        )

    def grammar_fields(self) -> dict:
        """The request fields constraints.grammar_for_request reads about tools."""
        call_format = "json" if self.parser == JSON_CALLS else "glm"
        fields = {"tool_choice": self.choice, "parallel_tool_calls": self.parallel}
        return fields | {"tool_call_format": call_format}


def forced_call_parser(tokenizer) -> str:
    """How a server without --tool-call-parser reads a forced call: GLM's calls ("glm47") where the
    chat template writes `<arg_key>`, else a JSON list of calls (JSON_CALLS)."""
    template = getattr(tokenizer, "chat_template", None)
    return "glm47" if isinstance(template, str) and "<arg_key>" in template else JSON_CALLS


def reasoning_end_ids(options: ChatOptions, tokenizer) -> tuple[int, ...]:
    """The tokens of `</think>` when the reasoning parser is on, else (): encoded once a server, for
    `grammar_start_after`."""
    if options.reasoning_parser is None:
        return ()
    return tuple(tokenizer.encode(THINK_END, add_special_tokens=False))


def grammar_start_after(end_ids: tuple[int, ...], chat_template_kwargs: dict) -> tuple[int, ...]:
    """Where a constrained chat output's grammar starts: after `end_ids` (`reasoning_end_ids`: ()
    without the reasoning parser) when the request thinks (the reasoning is free), else at the first
    token (())."""
    return end_ids if thinking_enabled(chat_template_kwargs) else ()


def _shown(tool_choice) -> str:
    return (
        json.dumps(tool_choice)
        if isinstance(tool_choice, str)
        else f"function {tool_choice['function']['name']!r}"
    )


class ChatChoices:
    """One request's choice, built from its text: `__call__(text, finish_reason, stream)` -> the
    choice of a whole response (the text is all of it) or of one stream chunk (the text is the next
    piece)."""

    def __init__(self, parser: ChatOutputParser):
        self.parser = parser
        self.called = False  # a tool call has been read

    @classmethod
    def for_request(
        cls, options: ChatOptions, prompt_text: str, chat_template_kwargs: dict, tool_use: ToolUse
    ) -> "ChatChoices":
        parser = ChatOutputParser.build(
            options.reasoning_parser,
            tool_use.parser,
            prompt_text,
            thinking_enabled(chat_template_kwargs),
            tool_use.tools,
        )
        return cls(parser)

    def __call__(self, text: str, finish_reason: str | None, stream: bool) -> dict:
        if not stream:
            message = self.parser.parse(text, cut=finish_reason == "length")
            calls = [call.as_openai() for call in message.tool_calls]
            body = {
                "role": "assistant",
                "content": message.content if message.content or not calls else None,
                "reasoning_content": message.reasoning or None,
                "tool_calls": calls,
            }
            return {
                "index": 0,
                "message": body,
                "logprobs": None,
                "finish_reason": self._finish(finish_reason, calls),
            }
        delta = self.parser.feed(text)
        if finish_reason is not None:
            last = self.parser.flush(cut=finish_reason == "length")
            delta.reasoning += last.reasoning
            delta.content += last.content
            delta.tool_calls += last.tool_calls
        body = {}
        if delta.reasoning:
            body["reasoning_content"] = delta.reasoning
        if delta.content:
            body["content"] = delta.content
        if delta.tool_calls:
            body["tool_calls"] = [d.as_openai() for d in coalesce_deltas(delta.tool_calls)]
        reason = self._finish(finish_reason, delta.tool_calls)
        return {"index": 0, "delta": body, "logprobs": None, "finish_reason": reason}

    def _finish(self, finish_reason: str | None, calls: list) -> str | None:
        self.called |= bool(calls)
        return "tool_calls" if finish_reason == "stop" and self.called else finish_reason
