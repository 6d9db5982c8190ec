"""The Responses API's `store` / `previous_response_id`: a bounded in-memory LRU of finished responses.

Each entry keeps what a follow-up needs: the whole conversation as chat messages (its
input and its answer), the call ids it made (a later `function_call_output` must name
one), and the response object (for `GET /v1/responses/{id}`). Bounded twice: at most
`max_entries` responses and about `max_chars` characters of messages; the least recently
used go first. Nothing survives a restart. An unknown `previous_response_id` is a 400
(as OpenAI answers it); an unknown id on GET is a 404.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass

logger = logging.getLogger(__name__)

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_CHARS = 64 << 20  # of stored messages and responses, roughly bytes of text


@dataclass
class StoredResponse:
    messages: list[dict]  # the conversation through this response's answer
    call_ids: set[str]
    response: dict
    num_chars: int = 0


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_chars: int = DEFAULT_MAX_CHARS):
        self.max_entries = max_entries
        self.max_chars = max_chars
        self.num_chars = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, response_id: str, entry: StoredResponse) -> None:
        entry.num_chars = len(json.dumps(entry.messages)) + len(json.dumps(entry.response))
        if entry.num_chars > self.max_chars:
            logger.info("response %s not stored: %d chars is over the store's %d", response_id, entry.num_chars,
                        self.max_chars)
            return
        old = self._entries.pop(response_id, None)
        if old is not None:
            self.num_chars -= old.num_chars
        self._entries[response_id] = entry
        self.num_chars += entry.num_chars
        while len(self._entries) > self.max_entries or self.num_chars > self.max_chars:
            _, evicted = self._entries.popitem(last=False)
            self.num_chars -= evicted.num_chars
