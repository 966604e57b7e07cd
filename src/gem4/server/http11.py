"""Connection guards for `gem4 serve`: header and body read timeouts, a connection cap, and no
draining of a body nobody will read. A subclass of uvicorn's h11 protocol (`guarded_protocol`).

uvicorn (0.54) has none of these: its only timer is the keep-alive one, armed after a response, so
a connection that never completes its first request's headers stays open for ever; its
`limit_concurrency` answers `503 Service Unavailable` in plain text (not an OpenAI error) to every
new request while over the limit, but keeps every connection; and after an early response (a 401 or
413 sent before the body was read) it reads and discards the rest of the body to keep the
connection alive. What this protocol does instead:

- **Header timeout** (`header_timeout` s): the request line and headers must arrive within that time
  of the connection opening, or of the first byte of the next request on a kept-alive connection.
  It counts from the start, not between bytes: a slow drip of header bytes (slowloris) is the
  attack it is for. Otherwise: `408` (an OpenAI error object) and the connection is closed.
- **Body timeout** (`body_timeout` s): while the request body is being read, at most that long may
  pass without a byte of it arriving (nginx's `client_body_timeout`). Time when reading is paused
  because the handler has not asked for more yet does not count, nor does time after the response
  has started. Otherwise `408` and close; the handler sees the client disconnect.
- **Early response**: a response that completes before the whole request body has arrived (401 for
  a missing key, 413, 404, 503 ...) closes the connection instead of reading and discarding the
  rest: a client without a valid key cannot make the server take a 50 MB upload.
- **Connection cap** (`max_connections`): a connection beyond that many open ones is answered
  `503` with `Retry-After: 1` (an OpenAI error object) and closed at once, before it can hold a
  file descriptor or buffer a body; connections already open are not affected.

Always h11, even where httptools is installed: the guards are written against h11's states and
H11Protocol's attributes (`conn`, `cycle`, `flow`, `timeout_keep_alive_task`, `connections`: the same
from uvicorn 0.29, the oldest pyproject allows, to 0.54).
Everything here runs on the event loop thread (asyncio protocol callbacks and timers).
"""
from __future__ import annotations

import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from gem4.server.protocol import APIError

log = logging.getLogger("gem4.server")


def _raw_error(err: APIError) -> bytes:
    """A complete `Connection: close` HTTP/1.1 response carrying `err` as an OpenAI error object,
    written straight to the socket (these answers come from outside any request cycle)."""
    body = json.dumps(err.body()).encode()
    head = [f"HTTP/1.1 {err.status} {STATUS_PHRASES[err.status].decode()}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close",
            *(f"{k}: {v}" for k, v in err.headers.items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's H11Protocol with the guards of the module docstring. Configure it through
    `guarded_protocol(...)`, which sets the three class attributes on a subclass."""

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._timer = None                       # asyncio.TimerHandle of the running guard timer
        self._timer_kind: str | None = None      # "header" | "body"

    # ---- asyncio.Protocol ----

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            self._refuse(APIError(503, f"The server has {self.max_connections} connections open, its limit "
                                       "(--max-connections). Retry shortly.", type="server_error",
                                  code="too_many_connections", headers={"Retry-After": "1"}), "over the cap")
            return
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            # answered before the body was all here: close rather than read the rest only to discard it
            self.transport.close()
        self._watch()

    # ---- the guard timers ----

    def _watch(self) -> None:
        """(Re)arm or cancel the guard timer for the state the connection is in now."""
        if self.transport.is_closing():
            self._cancel()
            return
        theirs = self.conn.their_state
        if theirs is h11.IDLE:
            if self.timeout_keep_alive_task is not None:
                self._cancel()                   # between requests: uvicorn's keep-alive timer governs
            elif self._timer_kind != "header":  # the first byte of a request (or a new connection)
                self._arm("header", self.header_timeout)
        elif theirs is h11.SEND_BODY and self.conn.our_state is h11.SEND_RESPONSE and self.cycle is not None \
                and not self.cycle.response_started:
            self._arm("body", self.body_timeout)   # each body byte restarts the clock
        else:
            self._cancel()

    def _arm(self, kind: str, seconds: float) -> None:
        self._cancel()
        self._timer_kind = kind
        self._timer = self.loop.call_later(seconds, self._expired)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_kind = None, None

    def _expired(self) -> None:
        kind, self._timer, self._timer_kind = self._timer_kind, None, None
        if self.transport.is_closing():
            return
        if kind == "header":
            if self.conn.their_state is h11.IDLE:
                self._refuse(APIError(408, f"The request headers did not arrive within {self.header_timeout:g} s "
                                           "(--header-timeout).", code="request_timeout"), "header timeout")
            return
        cycle = self.cycle
        if self.conn.their_state is not h11.SEND_BODY or cycle is None or cycle.response_started:
            return
        if self.flow.read_paused:                 # the handler is not reading: not the client's delay
            self._arm("body", self.body_timeout)
            return
        cycle.disconnected = True                 # the handler's receive() now answers http.disconnect
        cycle.message_event.set()
        self._refuse(APIError(408, f"No request body bytes arrived for {self.body_timeout:g} s (--body-timeout).",
                              code="request_timeout"), "body timeout")

    def _refuse(self, err: APIError, why: str) -> None:
        self._cancel()
        if self.client:
            log.info("closed the connection from %s:%d: %s", *self.client[:2], why)
        self.transport.write(_raw_error(err))
        self.transport.close()


def guarded_protocol(*, header_timeout: float, body_timeout: float, max_connections: int | None) -> type:
    """A GuardedH11Protocol subclass with these settings, for `uvicorn.Config(http=...)`."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {
        "header_timeout": header_timeout, "body_timeout": body_timeout, "max_connections": max_connections})
