"""`POST /v1/responses` requests (OpenAI's Responses API, as vLLM serves it) read as chat requests.

A Responses request becomes a chat completions body: `instructions` a system message first, `input`
(a text, or items: messages, `function_call`s, `function_call_output`s, `reasoning`) the messages
after it, the flat function `tools` and `tool_choice` in chat's nested shape, `text.format` as
`response_format`, `max_output_tokens` as `max_tokens`, and the sampling fields (vLLM's extensions
such as `seed` and `top_k` included) as they are. `RequestReader.chat` then reads it as any chat
request: the template, the parsers, the grammar. An error names the Responses field
(`max_output_tokens`, `text.format`, `input`), not the chat one it became.

A response made with `store` (the default) is kept in the server's `ResponseStore`, which every
front end shares: `previous_response_id` puts the stored conversation (its input and output, not
its instructions) before the new input, and `GET /v1/responses/{id}` returns the response."""

from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import Request
from pydantic import BeforeValidator, Discriminator, Field, Tag, field_validator, model_validator

from spmoe.entrypoints.serve.frontend.protocol import (
    ApiError,
    FunctionDefinition,
    SamplingFields,
    Strict,
    named_or_listed_choice,
    parse,
    text_parts_only,
)
from spmoe.entrypoints.serve.frontend.request_reader import ParsedRequest, RequestReader
from spmoe.entrypoints.serve.frontend.response_store import ResponseStore

# chat names in an error -> the Responses fields they came from, the longer names first
RENAMED = (
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("].function.parameters", "].parameters"),  # a tool's: flat in the Responses API
    ("max_tokens", "max_output_tokens"),
    ("messages", "input"),
)


class ContentText(Strict):
    """A part of a message's content: text the user gave or the model wrote (no images or files)."""

    type: Literal["input_text", "output_text"]
    text: str


def _as_parts(content):
    """A content given as one string -> the one text part it stands for; an image, audio or file
    part is refused as such (`text_parts_only`)."""
    if isinstance(content, str):
        return [{"type": "input_text", "text": content}]
    return text_parts_only(content)


def _text(parts: list[ContentText]) -> str:
    return "".join(part.text for part in parts)


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[list[ContentText], BeforeValidator(_as_parts)]


class FunctionCallItem(Strict):
    """A call the model made (from an earlier response's output)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # a JSON object's text


class FunctionCallOutputItem(Strict):
    """A function's result, for the call `call_id`."""

    type: Literal["function_call_output"]
    call_id: str
    output: Annotated[list[ContentText], BeforeValidator(_as_parts)]


class ReasoningText(Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Strict):
    """The model's thinking (from an earlier response's output), given back to the chat template."""

    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None

    @property
    def text(self) -> str:
        return _text(self.content or self.summary)


def _item_type(item) -> str | None:
    return item.get("type", "message") if isinstance(item, dict) else None


ITEM_TYPES = frozenset({"message", "function_call", "function_call_output", "reasoning"})
InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]  # pydantic names an item's type (a tag of ITEM_TYPES) in an error's location


class InputItems(Strict):
    """`input` as items, validated apart from the request (its errors name the item's type)."""

    input: list[InputItem]


class FunctionTool(FunctionDefinition):
    """The Responses API's function tool: chat's `function` fields, flat beside `type`."""

    type: Literal["function"]

    @model_validator(mode="before")
    @classmethod
    def _a_function(cls, tool):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ValueError(
                f"expected a tool of type 'function' (the only kind served), type {kind!r}"
            )
        return tool


class NamedFunctionChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict | None = Field(None, alias="schema")  # the schema, with json_schema
    description: str | None = None
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted; changes nothing


class ResponsesRequest(SamplingFields):
    """The Responses API's request, beside the sampling fields chat takes (`n` must stay 1)."""

    input: str | list[dict]  # read as InputItems
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, choice):
        return named_or_listed_choice(choice, '{"type": "function", "name": ...}')

    store: bool = True
    text: TextConfig | None = None
    chat_template_kwargs: dict = {}
    # accepted, changing nothing (reasoning, metadata, truncation: answered back); the last two: 400
    reasoning: dict | None = None
    metadata: dict | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    background: bool = False


@dataclass(frozen=True)
class ResponsesInput:
    """A Responses request read: its body, what to generate, and the conversation so far as chat
    messages (the stored one of `previous_response_id`, then `input`; `instructions` left out)."""

    body: ResponsesRequest
    parsed: ParsedRequest
    conversation: list[dict]


def chat_messages(items: str | list) -> list[dict]:
    """`input` (a text, or InputItems) -> chat messages: a reasoning item goes with the assistant
    turn after it, and the function calls that follow an assistant message (or each other) join it
    as its `tool_calls`."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    reasoning = None  # a reasoning item's text, not yet given to an assistant turn
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning = item.text
            continue
        if isinstance(item, FunctionCallOutputItem):
            messages.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)}
            )
            continue
        if isinstance(item, MessageItem) and item.role != "assistant":
            messages.append({"role": item.role, "content": _text(item.content)})
            continue
        last = messages[-1] if messages else None
        if isinstance(item, MessageItem) or last is None or last["role"] != "assistant":
            text = _text(item.content) if isinstance(item, MessageItem) else None
            last = {"role": "assistant", "content": text, "tool_calls": []}
            messages.append(last)
        if reasoning:
            last["reasoning_content"] = reasoning
        reasoning = None
        if isinstance(item, FunctionCallItem):
            function = {"name": item.name, "arguments": item.arguments}
            last["tool_calls"].append(
                {"id": item.call_id, "type": "function", "function": function}
            )
    for message in messages:  # an assistant turn without calls leaves the field out
        if message.get("tool_calls") == []:
            del message["tool_calls"]
    return messages


def output_messages(output: list[dict]) -> list[dict]:
    """A response's output items -> the chat messages they are in a conversation."""
    return chat_messages(InputItems(input=output).input)


class ResponsesReader:
    """Reads `POST /v1/responses` bodies with the server's RequestReader (see the module
    docstring)."""

    def __init__(self, reader: RequestReader, store: ResponseStore):
        self.reader, self.store = reader, store

    async def read(self, raw, http: Request) -> ResponsesInput:
        body = self.reader.parse(ResponsesRequest, raw, http)
        for name, why in (
            ("n", body.n != 1 and "a response has one output; n must be 1"),
            ("response_format", body.response_format and "/v1/responses takes text.format"),
            ("background", body.background and "background responses are not served"),
            ("top_logprobs", body.top_logprobs and "logprobs are served by /v1/chat/completions"),
        ):
            if why:
                raise ApiError(400, f"{name}: {why}", name)
        history = []
        if body.previous_response_id is not None:
            history = (await self.store.get(body.previous_response_id, "previous_response_id"))[0]
        items = (
            body.input if isinstance(body.input, str) else parse(InputItems, raw, ITEM_TYPES).input
        )
        conversation = history + chat_messages(items)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        try:
            parsed = await self.reader.chat(self._chat_body(body, system + conversation), http)
        except ApiError as e:
            raise _renamed(e) from None
        return ResponsesInput(body=body, parsed=parsed, conversation=conversation)

    @staticmethod
    def _chat_body(body: ResponsesRequest, messages: list[dict]) -> dict:
        sampling = set(SamplingFields.model_fields) - {"n", "stream", "stream_options"}
        chat = body.model_dump(include=sampling, exclude_unset=True)
        chat |= {"messages": messages, "chat_template_kwargs": body.chat_template_kwargs}
        chat["max_tokens"] = body.max_output_tokens or body.max_tokens
        if body.tools:
            chat["tools"] = [
                {
                    "type": "function",
                    "function": tool.model_dump(exclude={"type"}, exclude_none=True),
                }
                for tool in body.tools
            ]
        choice = body.tool_choice
        if isinstance(choice, NamedFunctionChoice):
            choice = {"type": "function", "function": {"name": choice.name}}
        if choice is not None:
            chat["tool_choice"] = choice
        chat["parallel_tool_calls"] = body.parallel_tool_calls
        form = body.text.format if body.text else None
        if form is not None and form.type == "json_schema":
            schema = {"name": form.name, "schema": form.json_schema, "strict": form.strict}
            chat["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif form is not None:
            chat["response_format"] = {"type": form.type}
        return chat


def _renamed(error: ApiError) -> ApiError:
    """A chat request's error in the Responses request's names."""
    message, param = error.message, error.param
    for chat_name, name in RENAMED:
        message = message.replace(chat_name, name)
        if param is not None and param.startswith(chat_name):  # no index: chat's counts others
            param = name
    return ApiError(error.status, message, param)
