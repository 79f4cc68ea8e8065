"""`POST /v1/responses` answers: the Response object and its stream of events, built from the chat
choice deltas the chat path's parsers make (`ChatChoices`), so that reasoning, text and tool calls
are read as chat reads them.

Output items, in the order the text makes them: a `reasoning` item (the reasoning parser's text, as
one `reasoning_text` content part), a `message` item (the content, as one `output_text` part), a
`function_call` item per tool call. A completed response without content or calls still has a
message (empty text). A stream sends, in order: `response.created`, `response.in_progress`; per item
`response.output_item.added`, then for text `response.content_part.added`,
`response.output_text.delta` (reasoning: `response.reasoning_text.delta`) ...,
`response.output_text.done`, `response.content_part.done`, or for a call
`response.function_call_arguments.delta` ..., `response.function_call_arguments.done`; then
`response.output_item.done`; last `response.completed`, as vLLM sends it, also when
`max_output_tokens` cut the output (the response's and its last item's status are then `incomplete`;
OpenAI's API sends `response.incomplete` there, and the openai client's stream helper finds no final
response in that). An error after the stream started is an `error` event, and the stream ends. Every
event has a `sequence_number` from 0.

A whole response is the same builder fed the same deltas, its events not sent: streamed and whole
agree."""

import json
import time
import uuid
from collections.abc import AsyncIterator

from spmoe.entrypoints.serve.frontend.protocol import ApiError, internal_error
from spmoe.entrypoints.serve.frontend.response_store import ResponseStore
from spmoe.entrypoints.serve.frontend.responses_request import (
    ResponsesInput,
    ResponsesRequest,
    output_messages,
)
from spmoe.entrypoints.serve.frontend.streaming import Piece

ITEM_ID_PREFIXES = {"reasoning": "rs_", "message": "msg_", "function_call": "fc_"}


def response_head(response_id: str, model: str, body: ResponsesRequest) -> dict:
    """The fields of a Response that do not change as it is made: the request's settings, answered
    back."""
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
    text_format = body.text.format if body.text and body.text.format else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "instructions": body.instructions,
        "tools": tools,
        "tool_choice": _shown_choice(body.tool_choice, tools),
        "parallel_tool_calls": body.parallel_tool_calls,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "previous_response_id": body.previous_response_id,
        "reasoning": body.reasoning,
        "metadata": body.metadata,
        "store": body.store,
        "truncation": body.truncation or "disabled",
        "text": {
            "format": text_format.model_dump(by_alias=True, exclude_none=True)
            if text_format
            else {"type": "text"}
        },
        "background": False,
        "error": None,
    }


def _shown_choice(choice, tools: list) -> str | dict:
    if choice is None:
        return "auto" if tools else "none"
    return choice if isinstance(choice, str) else choice.model_dump()


class ResponseBuilder:
    """One response's output items (and, when `stream`, its events as server-sent event texts), fed
    the chat choice deltas of its one choice: `start()`, `feed(choice)` per piece, `finish(...)`;
    then `response`."""

    def __init__(self, head: dict, stream: bool):
        self.head, self.stream = head, stream
        self.output: list[dict] = []
        self.open: dict | None = None  # the item being written: the last of `output`
        self.call_items: dict[int, dict] = {}  # a chat tool call's index -> its item
        self.sequence = 0  # the next event's sequence_number
        self.response = self._response("in_progress", None, None)

    def start(self) -> list[str]:
        return [
            self.event("response.created", response=self.response),
            self.event("response.in_progress", response=self.response),
        ]

    def feed(self, choice: dict) -> list[str]:
        """`choice`: a ChatChoices stream choice ({"delta": {reasoning_content, content,
        tool_calls}, ...})."""
        delta, events = choice["delta"], []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls", ()):
            events += self._call(call)
        return events

    def finish(self, finish_reason: str, usage: dict) -> list[str]:
        """Close the last item and the response: `completed` (with an empty message if it has no
        message or call), or `incomplete` when the length limit cut it (its last item too)."""
        events, incomplete = [], finish_reason == "length"
        if not incomplete and all(item["type"] == "reasoning" for item in self.output):
            events += self._open_item("message")
        events += self._close(incomplete)
        status, details = (
            ("incomplete", {"reason": "max_output_tokens"}) if incomplete else ("completed", None)
        )
        self.response = self._response(status, usage, details)
        return events + [self.event("response.completed", response=self.response)]

    def _response(self, status: str, usage: dict | None, details: dict | None) -> dict:
        return {
            **self.head,
            "status": status,
            "incomplete_details": details,
            "output": self.output,
            "usage": usage,
        }

    def _text(self, kind: str, text: str) -> list[str]:
        events = [] if self.open and self.open["type"] == kind else self._open_item(kind)
        part = self.open["content"][0]
        part["text"] += text
        delta = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        extra = {"logprobs": []} if kind == "message" else {}
        return events + [self.event(delta, **self._where(), content_index=0, delta=text, **extra)]

    def _call(self, call: dict) -> list[str]:
        function, events = call["function"], []
        if function.get("name") is not None:  # a new call
            events = self._open_item("function_call", call_id=call["id"], name=function["name"])
            self.call_items[call["index"]] = self.open
        item = self.call_items[call["index"]]
        if item is not self.open:  # chat's parser writes one call at a time
            raise ValueError(f"tool call {call['index']}'s arguments came after a later call's")
        arguments = function.get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            events.append(
                self.event(
                    "response.function_call_arguments.delta", **self._where(), delta=arguments
                )
            )
        return events

    def _open_item(self, kind: str, **fields) -> list[str]:
        events = self._close(incomplete=False)
        item = {"id": ITEM_ID_PREFIXES[kind] + uuid.uuid4().hex, "type": kind}
        if kind == "message":
            item |= {"role": "assistant", "status": "in_progress", "content": []}
        elif kind == "reasoning":
            item |= {"summary": [], "content": [], "status": "in_progress"}
        else:
            item |= {**fields, "arguments": "", "status": "in_progress"}
        self.output.append(item)
        self.open = item
        events.append(
            self.event("response.output_item.added", output_index=len(self.output) - 1, item=item)
        )
        if kind != "function_call":
            part = (
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                if kind == "message"
                else {"type": "reasoning_text", "text": ""}
            )
            events.append(
                self.event(
                    "response.content_part.added", **self._where(), content_index=0, part=part
                )
            )
            item["content"].append(dict(part))
        return events

    def _close(self, incomplete: bool) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = "incomplete" if incomplete else "completed"
        where, events = {"item_id": item["id"], "output_index": self.output.index(item)}, []
        if item["type"] == "function_call":
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        else:
            part = item["content"][0]
            done = (
                "response.output_text.done"
                if item["type"] == "message"
                else "response.reasoning_text.done"
            )
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events.append(self.event(done, **where, content_index=0, text=part["text"], **extra))
            events.append(
                self.event("response.content_part.done", **where, content_index=0, part=part)
            )
        events.append(
            self.event("response.output_item.done", output_index=where["output_index"], item=item)
        )
        return events

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}

    def event(self, kind: str, **fields) -> str:
        """The event as server-sent event text (serialized now: the items change after), when
        streaming."""
        if not self.stream:
            return ""
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def response_usage(prompt_tokens: int, output_tokens: int) -> dict:
    """The Responses API's usage. Cached prompt tokens and reasoning tokens are not counted per
    request here: both are reported as 0."""
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


class ResponseAnswer:
    """The answer to a Responses request (`ResponsesInput`) the engine took (`app.Started`, one
    choice): its pieces through the choice's chat parser into a ResponseBuilder, whole (`whole`) or
    streamed (`events`); the finished response goes into `store` when the request asks to store
    it."""

    def __init__(self, read: ResponsesInput, started, model: str, store: ResponseStore):
        self.read, self.started, self.store = read, started, store
        head = response_head(started.request_id, model, read.body)
        self.builder = ResponseBuilder(head, read.body.stream)
        self.parser = read.parsed.parsers[0]

    async def whole(self, pieces: list[Piece]) -> dict:
        for piece in pieces:
            self.builder.feed(self.parser(piece.text, piece.finish_reason, True))
        return (await self._finish(pieces[-1].finish_reason))[1]

    async def events(self) -> AsyncIterator[str]:
        """The stream's events; leaving them (the end, or a client that went away) closes the
        engine's request."""
        pieces = self.started.pieces[0]
        async with self.started.streams:
            for event in self.builder.start():
                yield event
            piece = self.started.firsts[0]
            try:
                while True:
                    for event in self.builder.feed(
                        self.parser(piece.text, piece.finish_reason, True)
                    ):
                        yield event
                    if piece.finish_reason is not None:
                        break
                    piece = await anext(pieces)
            except ApiError as e:
                yield self._error(e)
                return
            except Exception:  # noqa: BLE001 - the client gets the error event, the log the details
                yield self._error(internal_error(f"the stream of {self.started.request_id}"))
                return
        for event in (await self._finish(piece.finish_reason))[0]:
            yield event

    async def _finish(self, finish_reason: str) -> tuple[list[str], dict]:
        output_tokens = self.started.generations[0].completion_tokens
        events = self.builder.finish(
            finish_reason, response_usage(self.started.prompt_tokens, output_tokens)
        )
        if self.read.body.store:
            response = self.builder.response
            conversation = self.read.conversation + output_messages(response["output"])
            await self.store.put(response, conversation)
        return events, self.builder.response

    def _error(self, error: ApiError) -> str:
        body = error.body()["error"]
        return self.builder.event(
            "error", code=body["type"], message=body["message"], param=body["param"]
        )
