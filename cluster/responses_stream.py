"""A streamed Responses API reply: the chat stream's chunks (cluster/completion_stream.py, one
choice) turned into the Responses API's semantic events, in OpenAI's order.

    response.created, response.in_progress
    per output item, in the order the model writes them:
      reasoning:     output_item.added, reasoning_text.delta..., reasoning_text.done,
                     output_item.done
      message:       output_item.added, content_part.added, output_text.delta...,
                     output_text.done, content_part.done, output_item.done
      function_call: output_item.added, function_call_arguments.delta...,
                     function_call_arguments.done, output_item.done
    response.completed (response.incomplete when cut by max_output_tokens)

An item opens with its first piece and closes when a piece of another item comes or the
reply ends. Every event carries `sequence_number`; the last one's response equals what the
same request answers unstreamed (cluster/responses_output.py builds both).
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.cluster.responses_output import (
    call_item,
    item_id,
    message_item,
    reasoning_item,
    response_object,
    status_of,
    text_part,
)


class ResponseEvents:
    """One response's events; `feed` each chat chunk's choice, then `finish`."""

    def __init__(self, body: dict, resp_id: str, created: int, model: str) -> None:
        self._body, self._id, self._created, self._model = body, resp_id, created, model
        self._seq = 0
        self.items: list[dict] = []  # closed items, then the open one
        self._open: str | None = None  # "reasoning" | "message" | "call:<index>"
        self._text = ""  # the open item's text or arguments so far
        self._logprobs: list = []  # the reply's logprobs so far (they go on the message)
        self._finish: str | None = None

    def start(self) -> list[dict]:
        shell = self._response("in_progress", [], None)
        return [self._event("response.created", response=shell),
                self._event("response.in_progress", response=shell)]  # fmt: skip

    def feed(self, choice: dict) -> list[dict]:
        """A chat chunk's choice: its reasoning, answer and tool-call pieces, in order."""
        out: list[dict] = []
        delta = choice.get("delta") or {}
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        self._logprobs += logprobs
        if delta.get("reasoning"):
            out += self._into("reasoning")
            out.append(self._piece("response.reasoning_text.delta", delta["reasoning"],
                                   content_index=0))  # fmt: skip
        if delta.get("content"):
            out += self._into("message")
            out.append(self._piece("response.output_text.delta", delta["content"],
                                   content_index=0, logprobs=logprobs))  # fmt: skip
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            out += self._into(f"call:{call['index']}", call.get("id"), fn.get("name"))
            if fn.get("arguments"):
                out.append(self._piece("response.function_call_arguments.delta", fn["arguments"]))
        if choice.get("finish_reason") is not None:
            self._finish = choice["finish_reason"]
        return out

    def finish(self, usage: dict | None) -> list[dict]:
        """The reply has ended: the open item closes and the response is whole."""
        status, why = status_of(self._finish)
        cut = why == "max_output_tokens"  # the open item is the one the limit cut
        out = self._close("incomplete" if cut else "completed")
        final = self._response(status, self.items, usage, why)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*out, self._event(kind, response=final)]

    def error(self, err: dict) -> dict:
        """An `error` event for a failure mid-stream (`err`: the API error's body)."""
        e = err.get("error", err)
        return self._event("error", code=e.get("code"), message=e.get("message"),
                           param=e.get("param"))  # fmt: skip

    # ---- items ---------------------------------------------------------------------------

    def _into(self, kind: str, call_id: str | None = None, name: str | None = None) -> list:
        """Open an item of `kind` unless it is the one open, closing the open one."""
        if self._open == kind:
            return []
        out = self._close()
        self._open, self._text = kind, ""
        if kind == "reasoning":
            item = reasoning_item("")
            item["content"], item["status"] = [], "in_progress"
        elif kind == "message":
            item = message_item("", None, "in_progress")
            item["content"] = []
        else:
            item = call_item(call_id or item_id("call"), name or "", "")
            item["status"] = "in_progress"
        self.items.append(item)
        out.append(self._event("response.output_item.added", output_index=len(self.items) - 1,
                               item=dict(item)))  # fmt: skip
        if kind == "message":
            out.append(self._piece_event("response.content_part.added", content_index=0,
                                         part=text_part("", None)))  # fmt: skip
        return out

    def _close(self, status: str = "completed") -> list[dict]:
        if self._open is None:
            return []
        item, text, out = self.items[-1], self._text, []
        if self._open == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            out.append(self._piece_event("response.reasoning_text.done", content_index=0,
                                         text=text))  # fmt: skip
        elif self._open == "message":
            part = text_part(text, self._logprobs)
            item["content"] = [part]
            out.append(self._piece_event("response.output_text.done", content_index=0,
                                         text=text, logprobs=part["logprobs"]))  # fmt: skip
            out.append(self._piece_event("response.content_part.done", content_index=0,
                                         part=part))  # fmt: skip
        else:
            item["arguments"] = text
            out.append(self._piece_event("response.function_call_arguments.done",
                                         arguments=text, name=item["name"]))  # fmt: skip
        item["status"] = status
        out.append(self._event("response.output_item.done", output_index=len(self.items) - 1,
                               item=json.loads(json.dumps(item))))  # fmt: skip
        self._open = None
        return out

    # ---- events --------------------------------------------------------------------------

    def _piece(self, kind: str, text: str, **fields: Any) -> dict:
        self._text += text
        return self._piece_event(kind, delta=text, **fields)

    def _piece_event(self, kind: str, **fields: Any) -> dict:
        return self._event(kind, item_id=self.items[-1]["id"],
                           output_index=len(self.items) - 1, **fields)  # fmt: skip

    def _event(self, kind: str, **fields: Any) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _response(
        self, status: str, output: list, usage: dict | None, why: str | None = None
    ) -> dict:
        return response_object(self._body, self._id, self._created, self._model, status,
                               output, usage, why)  # fmt: skip


def sse_event(event: dict) -> str:
    """One event as server-sent events write it: its type, then its JSON."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"
