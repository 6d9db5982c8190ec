"""The Responses API's `store` / `previous_response_id`: a bounded in-memory LRU of finished responses.

Each entry keeps what a follow-up needs: the whole conversation as chat messages (its
input and its answer), the call ids it made (a later `function_call_output` must name
one), and the response object (for `GET /v1/responses/{id}`). Bounded twice: at most
`max_entries` responses and `max_bytes` bytes; the least recently used go first. Nothing
survives a restart. An unknown `previous_response_id` is a 400 (as OpenAI answers it); an
unknown id on GET is a 404.

Entries are kept as their compact JSON bytes, not as the Python objects: a dict or list
costs 50-200 bytes of memory for 2 bytes of JSON (`[]`), so a body of a million empty lists
echoed in the response was 1 MB by its JSON and 20 MB in memory. As bytes, what the bound
counts is what the process holds. A follow-up parses the messages back (they are ours,
bounded by the body they came from); a GET sends the response bytes as they are.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass

logger = logging.getLogger(__name__)

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_BYTES = 64 << 20  # of stored JSON: what the process holds for the store, give or take the per-entry bytes
ENTRY_OVERHEAD_BYTES = 512  # the entry, its key and the LRU's slot
CALL_ID_OVERHEAD_BYTES = 100  # a str object and its slot in the set


@dataclass(frozen=True)
class StoredResponse:
    messages_json: bytes  # the conversation through this response's answer
    call_ids: frozenset[str]
    response_json: bytes  # the response object, as GET answers it
    num_bytes: int

    @classmethod
    def of(cls, messages: list[dict], call_ids: set[str], response: dict) -> StoredResponse:
        messages_json, response_json = _compact(messages), _compact(response)
        num_bytes = (len(messages_json) + len(response_json) + ENTRY_OVERHEAD_BYTES
                     + sum(len(call_id) + CALL_ID_OVERHEAD_BYTES for call_id in call_ids))
        return cls(messages_json, frozenset(call_ids), response_json, num_bytes)

    def messages(self) -> list[dict]:
        """A fresh copy of the conversation (the caller may change it)."""
        return json.loads(self.messages_json)

    def response(self) -> dict:
        return json.loads(self.response_json)


def _compact(value) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if entry.num_bytes > self.max_bytes:
            logger.info("response %s not stored: %d bytes is over the store's %d", response_id, entry.num_bytes,
                        self.max_bytes)
            return
        old = self._entries.pop(response_id, None)
        if old is not None:
            self.num_bytes -= old.num_bytes
        self._entries[response_id] = entry
        self.num_bytes += entry.num_bytes
        while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= evicted.num_bytes
