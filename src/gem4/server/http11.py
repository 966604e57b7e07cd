"""Connection guards for `gem4 serve`: header, body and write timeouts, a connection cap, no draining
of a body nobody will read, and OpenAI error objects for malformed HTTP. A subclass of uvicorn's h11
protocol (`guarded_protocol`).

uvicorn (0.55) has none of these: its only timer is the keep-alive one, armed after a response, so
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
- **Early response**: a response that starts before the whole request body has arrived (401 for a
  missing key, 413, 404, 503 ...) says `Connection: close` and closes the connection when done,
  instead of reading and discarding the rest: a client without a valid key cannot make the server
  take a 50 MB upload, and the client knows not to reuse the connection.
- **Write timeout** (`write_timeout` s): a connection whose response bytes wait in the transport's
  buffer (the kernel's socket buffer is full: the client does not read) and none of them could be
  sent for that long is aborted, nginx's `send_timeout`. Aborted, not closed: asyncio's `close()`
  first waits to flush a buffer that such a client never reads, so the connection (and its slot
  under the cap) would stay. The handler then sees the client disconnect, so a stream's engine
  request is aborted and its KV cache freed; a reply that was complete but unsent is dropped.
  Progress is sampled every quarter of the timeout. A client that reads, however slowly, lets the
  kernel take more each time a third of its send buffer is free (Linux: 4 MiB at most by default):
  it is cut only if it reads less than that in a whole timeout. uvicorn has no such timer: its flow
  control makes the handler wait for the buffer to drain for ever.
- **Connection cap** (`max_connections`): a connection beyond that many open ones is answered
  `503` with `Retry-After: 1` (an OpenAI error object) and closed at once, before it can hold a
  file descriptor or buffer a body; connections already open are not affected.
- **Malformed HTTP** (a bad request line or header, headers past h11's 16 KiB, an unsupported
  Transfer-Encoding): the status h11 suggests (400, 431, 501) with an OpenAI error object naming
  h11's reason, and close; uvicorn answers these in plain text.

Always h11, even where httptools is installed: the guards are written against h11's states and
H11Protocol's attributes and hooks (`conn`, `cycle`, `flow`, `transport`, `timeout_keep_alive_task`,
`connections`, `send_400_response`: the same from uvicorn 0.29, the oldest pyproject allows, to 0.55).
Everything here runs on the event loop thread (asyncio protocol callbacks and timers).
"""
from __future__ import annotations

import json
import logging

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
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


class _Connection(h11.Connection):
    """h11's connection, keeping the error that made the client's side fail (uvicorn catches it and
    passes on only its own message), so the answer can give h11's reason and status; and saying
    `Connection: close` on a response that starts before the request's body has all arrived (the early
    response the protocol closes after: a client must not send its next request on that connection)."""

    error: h11.RemoteProtocolError | None = None

    def send(self, event):
        if isinstance(event, h11.Response) and self.their_state is h11.SEND_BODY \
                and (b"connection", b"close") not in event.headers:
            event = h11.Response(status_code=event.status_code, reason=event.reason,
                                 headers=[*event.headers, (b"connection", b"close")])
        return super().send(event)

    def next_event(self):
        try:
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.error = self.error or e
            raise


class _CountingTransport:
    """The connection's transport as the protocol and its request cycles write to it: counts the bytes
    handed over, so the write timeout can tell a client that reads slowly (the bytes that left the
    buffer grow) from one that does not. Everything else is the transport's own."""

    def __init__(self, transport, on_write):
        self._transport = transport
        self._on_write = on_write
        self.written = 0

    def write(self, data: bytes) -> None:
        self.written += len(data)
        self._transport.write(data)
        self._on_write()

    def sent(self) -> int:
        """Bytes that left the transport's buffer for the kernel."""
        return self.written - self._transport.get_write_buffer_size()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's H11Protocol with the guards of the module docstring. Configure it through
    `guarded_protocol(...)`, which sets the four class attributes on a subclass."""

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    write_timeout: float = 30.0
    max_connections: int | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        size = self.config.h11_max_incomplete_event_size          # as uvicorn builds its connection
        self.conn = _Connection(h11.SERVER, DEFAULT_MAX_INCOMPLETE_EVENT_SIZE if size is None else size)
        self._timer = None                       # asyncio.TimerHandle of the running read guard timer
        self._timer_kind: str | None = None      # "header" | "body"
        self._write_timer = None                 # the write guard's, while response bytes wait to be sent
        self._sent_mark = 0                      # bytes sent when the write guard last saw progress ...
        self._stalled_since = 0.0                # ... and when (loop time)
        self._lost = False

    # ---- asyncio.Protocol ----

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.transport = _CountingTransport(transport, self._wrote)
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
        self._lost = True
        self._cancel()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse (RemoteProtocolError), as an error object."""
        e = self.conn.error
        status = e.error_status_hint if e is not None and e.error_status_hint in STATUS_PHRASES else 400
        said = "" if e is None else str(e)           # h11 may quote the bad line: at most 200 characters of it
        reason = f": {said[:200]}..." if len(said) > 200 else f": {said}." if said else "."
        self._refuse(APIError(status, f"Invalid HTTP request{reason}", code="invalid_http_request"),
                     f"invalid HTTP{reason}")

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

    # ---- the write guard ----

    def _wrote(self) -> None:
        """After each write: if bytes are left waiting in the transport's buffer, start watching them."""
        if self._write_timer is None and not self._lost and self.transport.get_write_buffer_size():
            self._sent_mark, self._stalled_since = self.transport.sent(), self.loop.time()
            self._write_timer = self.loop.call_later(self.write_timeout / 4, self._check_write)

    def _check_write(self) -> None:
        self._write_timer = None
        if self._lost or not self.transport.get_write_buffer_size():
            return                                # all handed to the kernel: nothing to watch
        sent, now = self.transport.sent(), self.loop.time()
        if sent != self._sent_mark:               # the client took bytes since the last look
            self._sent_mark, self._stalled_since = sent, now
        elif now - self._stalled_since >= self.write_timeout:
            if self.client:
                log.info("closed the connection from %s:%d: write timeout (nothing of the response could be "
                         "sent for %g s: the client does not read)", *self.client[:2], self.write_timeout)
            self._cancel()
            self.transport.abort()                # connection_lost follows: the handler sees a disconnect
            return
        self._write_timer = self.loop.call_later(self.write_timeout / 4, self._check_write)

    def _refuse(self, err: APIError, why: str) -> None:
        self._cancel()
        if self.client:
            log.info("closed the connection from %s:%d: %s", *self.client[:2], why)
        self.transport.write(_raw_error(err))
        self.transport.close()


def guarded_protocol(*, header_timeout: float, body_timeout: float, write_timeout: float = 30.0,
                     max_connections: int | None) -> type:
    """A GuardedH11Protocol subclass with these settings, for `uvicorn.Config(http=...)`."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {
        "header_timeout": header_timeout, "body_timeout": body_timeout, "write_timeout": write_timeout,
        "max_connections": max_connections})
