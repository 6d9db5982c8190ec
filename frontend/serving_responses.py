"""`POST /v1/responses` and `GET /v1/responses/{id}` (OpenAI's Responses API), an adapter over the chat path.

The body becomes a ChatCompletionRequest (frontend.protocol_responses) and runs through
frontend.chat_run like any chat request; this module only writes the answer in the
Responses shape: output items (`reasoning`, `message` with `output_text`, one
`function_call` per call), `usage`, and, streamed, the event sequence

    response.created, response.in_progress,
    per item: response.output_item.added,
        message: response.content_part.added, response.output_text.delta..., response.output_text.done,
                 response.content_part.done
        function_call: response.function_call_arguments.delta..., response.function_call_arguments.done
        reasoning: response.reasoning_text.delta..., response.reasoning_text.done
    response.output_item.done,
    response.completed (response.incomplete when max_output_tokens cut it)

each event with `type` and `sequence_number`. With `store` (the default), the finished
conversation is kept in a bounded LRU (frontend.response_store) for `previous_response_id`.

Reference: https://platform.openai.com/docs/api-reference/responses-streaming
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from frontend.chat_run import ChatAnswer, ChatRun, start_chat
from frontend.chat_tools import ToolOptions
from frontend.engine_client import AsyncEngineClient
from frontend.errors import FrontendError, InvalidRequestError, NotFoundError
from frontend.protocol_responses import ResponsesRequest
from frontend.reasoning_parsers import ReasoningPrompt
from frontend.response_store import ResponseStore, StoredResponse
from frontend.request_state import RequestDelta, relay
from frontend.serving_utils import Usage, collect_unless_disconnected, now_s
from frontend.tool_parsers import ToolCallDelta

logger = logging.getLogger(__name__)


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


async def create_response(body: ResponsesRequest, raw_request: Request, client: AsyncEngineClient,
                          tool_options: ToolOptions | None, reasoning: ReasoningPrompt | None,
                          store: ResponseStore) -> Response:
    body.check_supported()
    history, call_ids = [], set()
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise InvalidRequestError(f"previous_response_id {body.previous_response_id!r} is not a stored response "
                                      "(unknown, evicted, or made with store: false)")
        history, call_ids = previous.messages(), set(previous.call_ids)
    conversation = history + body.input_messages(call_ids)
    # Instructions are this request's alone: a follow-up does not inherit them (as OpenAI).
    instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
    run = await start_chat(body.to_chat_request(instructions + conversation), client, tool_options, reasoning, "resp")
    draft = _ResponseDraft(body, run, client.model_name, conversation, call_ids, store)
    if body.stream:
        return StreamingResponse(_stream_response(run, draft), media_type="text/event-stream")
    results, usage = await collect_unless_disconnected(raw_request, run.stream, 1)
    answer = run.answer(results[0].text, results[0].finish_reason)
    return JSONResponse(draft.finish(_answer_items(answer), answer.finish_reason, usage))


def get_response(response_id: str, store: ResponseStore) -> Response:
    entry = store.get(response_id)
    if entry is None:
        raise NotFoundError(f"no stored response with id {response_id!r}")
    return Response(entry.response_json, media_type="application/json")


class _ResponseDraft:
    """The response object around its output items, and what `store` keeps of it."""

    def __init__(self, body: ResponsesRequest, run: ChatRun, model: str, conversation: list[dict],
                 call_ids: set[str], store: ResponseStore):
        self.body, self.run, self.conversation, self.call_ids, self.store = body, run, conversation, call_ids, store
        self.header = {
            "id": run.request_id, "object": "response", "created_at": now_s(), "model": model,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata, "parallel_tool_calls": body.parallel_tool_calls
            is not False, "previous_response_id": body.previous_response_id, "store": body.store,
            "temperature": body.temperature, "top_p": body.top_p,
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)}
            if body.text is not None and body.text.format is not None else {"format": {"type": "text"}},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto", "tools": body.tools or [],
            "error": None, "incomplete_details": None, "user": None,
        }

    def in_progress(self) -> dict:
        return {**self.header, "status": "in_progress", "output": [], "usage": None}

    def finish(self, items: list[dict], finish_reason: str | None, usage: Usage) -> dict:
        is_cut = finish_reason == "length"
        if is_cut:  # max_output_tokens cut every item short: each says so, as the response does (both paths)
            for item in items:
                item["status"] = "incomplete"
        counts = usage.to_dict()
        response = {**self.header, "status": "incomplete" if is_cut else "completed", "output": items,
                    "incomplete_details": {"reason": "max_output_tokens"} if is_cut else None,
                    "usage": {"input_tokens": counts["prompt_tokens"],
                              "input_tokens_details": counts["prompt_tokens_details"],
                              "output_tokens": counts["completion_tokens"],
                              "output_tokens_details": {"reasoning_tokens": 0},
                              "total_tokens": counts["total_tokens"]}}
        if self.body.store:
            self._remember(items, response)
        return response

    def _remember(self, items: list[dict], response: dict) -> None:
        text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in items if item["type"] == "function_call"]
        turn = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
        call_ids = self.call_ids | {call["id"] for call in calls}
        self.store.put(self.run.request_id, StoredResponse.of(self.conversation + [turn], call_ids, response))


def _message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id("msg"), "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(text: str) -> dict:
    return {"type": "reasoning", "id": item_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _answer_items(answer: ChatAnswer) -> list[dict]:
    items = [_reasoning_item(answer.reasoning_content)] if answer.reasoning_content else []
    if answer.content or not answer.tool_calls:
        items.append(_message_item(answer.content or ""))
    items += [_call_item(call.id, call.name, call.arguments) for call in answer.tool_calls]
    return items


class _EventWriter:
    """Numbers the events and follows the item being streamed; each method returns SSE text."""

    def __init__(self):
        self.sequence_number = 0
        self.items: list[dict] = []
        self.open: dict | None = None  # the item being streamed

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _start(self, item: dict) -> list[str]:
        events = self.close()
        self.open = item
        self.items.append(item)
        events.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                 item={**item, "status": "in_progress"}))
        return events

    def text(self, kind: str, text: str, is_forced: bool = False) -> list[str]:
        """A piece of the answer's text (`kind` "message") or reasoning (`kind` "reasoning");
        `is_forced`: open the item even for no text."""
        if not text and not is_forced:
            return []
        events = []
        if self.open is None or self.open["type"] != kind:
            item = _message_item("") if kind == "message" else _reasoning_item("")
            events = self._start(item)
            if kind == "message":
                events.append(self.event("response.content_part.added", **self._where(), content_index=0,
                                         part={"type": "output_text", "text": "", "annotations": []}))
        if not text:
            return events
        self.open["content"][0]["text"] += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(self.event(name, **self._where(), content_index=0, delta=text, **extra))
        return events

    def call(self, delta: ToolCallDelta) -> list[str]:
        events = self._start(_call_item(delta.id, delta.name or "", "")) if delta.id is not None else []
        if delta.arguments and self.open is not None and self.open["type"] == "function_call":
            self.open["arguments"] += delta.arguments
            events.append(self.event("response.function_call_arguments.delta", **self._where(),
                                     delta=delta.arguments))
        return events

    def close(self) -> list[str]:
        item, events = self.open, []
        if item is None:
            return events
        if item["type"] == "message":
            part = item["content"][0]
            events.append(self.event("response.output_text.done", **self._where(), content_index=0,
                                     text=part["text"], logprobs=[]))
            events.append(self.event("response.content_part.done", **self._where(), content_index=0, part=part))
        elif item["type"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", **self._where(), content_index=0,
                                     text=item["content"][0]["text"]))
        else:
            events.append(self.event("response.function_call_arguments.done", **self._where(),
                                     name=item["name"], arguments=item["arguments"]))
        events.append(self.event("response.output_item.done", output_index=len(self.items) - 1, item=item))
        self.open = None
        return events


async def _stream_response(run: ChatRun, draft: _ResponseDraft) -> AsyncIterator[str]:
    writer = _EventWriter()
    parser = run.new_delta_parser()
    usage, finish_reason = Usage(1), None
    yield writer.event("response.created", response=draft.in_progress())
    yield writer.event("response.in_progress", response=draft.in_progress())

    def on_delta(delta: RequestDelta, reason: str | None) -> list[str]:
        nonlocal finish_reason
        usage.add(delta)
        parsed = parser.feed(delta.text, reason)
        finish_reason = parsed.finish_reason or finish_reason
        return (writer.text("reasoning", parsed.reasoning_content) + writer.text("message", parsed.content)
                + [e for call_delta in parsed.call_deltas for e in writer.call(call_delta)])

    def on_end() -> list[str]:
        events = []
        if not writer.items:  # an empty answer is still one message, as non-streamed
            events += writer.text("message", "", is_forced=True)
        if finish_reason == "length":  # before the last item's output_item.done, which carries its status
            for item in writer.items:
                item["status"] = "incomplete"
        events += writer.close()
        response = draft.finish(writer.items, finish_reason, usage)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return events + [writer.event(kind, response=response)]

    def on_error(e: FrontendError) -> str:
        error = e.to_dict()["error"]
        return writer.event("error", code=str(error["code"]), message=error["message"], param=None)

    async for event in relay(run.stream, on_delta, on_end, on_error):
        yield event
