"""The Responses API's response store: what `previous_response_id` and `GET /v1/responses/{id}` read.

A response generated with `store` true (OpenAI's default) is kept with the conversation it ended: the input
items it was generated from (those of its own `previous_response_id` first) followed by its output items. A
request naming it as `previous_response_id` continues that conversation (`instructions` are not carried
over, as OpenAI documents). Keeping the whole conversation per response, not a link to the previous one,
means an evicted ancestor never breaks a chain; a chain's conversations overlap, and the byte bound holds
that in check.

Bounded: the entries' sizes (their JSON, in bytes) add up to at most `max_bytes` (`--responses-store-mb`);
the least recently used (stored or read) go first, and an entry larger than the whole bound is not kept.
Nothing survives a restart. vLLM keeps its store unbounded and therefore off by default; a bounded one can
be on. Only the event loop thread uses it.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_RESPONSES_STORE_MB = 64           # --responses-store-mb


@dataclass(frozen=True)
class Stored:
    response: dict          # the response object, as the client got it
    items: list[dict]       # the conversation: the input items it was generated from, then its output items
    size: int               # bytes of JSON


class ResponseStore:
    """Responses by id, at most `max_bytes` of them (JSON), least recently used first out."""

    def __init__(self, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"a response store needs a positive size, got {max_bytes} bytes")
        self.max_bytes = max_bytes
        self.size = 0
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict, items: list[dict]) -> bool:
        """Keep `response` (its `id`) and its conversation; -> whether it was kept (not when larger than the
        whole store). Older entries are evicted until it fits."""
        size = len(json.dumps(response, separators=(",", ":"))) + len(json.dumps(items, separators=(",", ":")))
        self.delete(response["id"])
        if size > self.max_bytes:
            return False
        while self.size + size > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.size -= old.size
        self._entries[response["id"]] = Stored(response, items, size)
        self.size += size
        return True

    def get(self, response_id: str) -> Stored | None:
        """The stored response (now the most recently used), or None."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.size -= entry.size
        return entry is not None
