"""The bytes behind a media part's URL: a base64 data URI, a `file://` URL under the operator's directory, or an
http(s) URL the operator allows, each held to one byte cap (docs/multimodal.md §6, docs/server.md).

A server must not fetch arbitrary addresses for anonymous clients (that would make it a proxy into whatever
network it sits in), nor read its own files for them. So by default only data URIs are taken, and each other
kind is the operator's choice, with vLLM's flags:

- `--allowed-local-media-path DIR`: `file://` URLs of files under DIR. The path is resolved (symlinks, `..`)
  before it is compared, so nothing outside DIR is read, whatever the URL says.
- `--allowed-media-domains HOST ...` (exact host names, as vLLM compares them) and `--allow-media-urls` (any
  host): http(s) URLs fetched. Redirects are followed (at most MAX_REDIRECTS) only to URLs the same rule
  allows: a redirect elsewhere is refused, not followed. The host name is what is checked: an allowed name
  whose DNS points into a private network is the operator's to avoid.
- `--media-fetch-timeout S` (default 10 s): the whole fetch, redirects and body included.
- `--max-media-bytes N` (default 20 MiB): the most bytes one part may bring, fetched, read or decoded from
  base64. A download is streamed and stopped as soon as it passes the cap (a Content-Length above it is
  refused before the body is read). The files and downloads of one request together bring no more than its
  body could have carried (`left`, kept by server/inputs.py `chat_media`): a URL is a few bytes of body, and
  must not let a client make the server take in more than it could have sent.

Fetches run on the event loop with httpx's async client (no thread is held while the peer is slow; no proxy
from the environment is used, so the allow-list is about the host actually reached) and are
cancelled with the request's task: a client that goes away stops its fetches. File reads and base64 decoding
run in the thread pool. Every failure is a MediaURLError with a cause a client can act on; the server answers
it with a 400 naming the part (server/inputs.py `chat_media`).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import os
import urllib.parse
import urllib.request
from pathlib import Path
from typing import NamedTuple

DEFAULT_MAX_MEDIA_BYTES = 20 * 2**20
DEFAULT_FETCH_TIMEOUT_S = 10.0
MAX_REDIRECTS = 5


class MediaURLError(Exception):
    """A media URL that cannot be used: not allowed, unreachable, too slow, too large, not base64."""


@dataclasses.dataclass(frozen=True)
class MediaPolicy:
    """Where media bytes may come from, and how many (the operator's flags; see the module docstring)."""

    allowed_local_media_path: str | None = None         # file:// URLs under this directory; None: none
    allowed_media_domains: tuple[str, ...] = ()          # http(s) hosts fetched
    allow_media_urls: bool = False                       # any http(s) host fetched
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES

    def check_http(self, url: str) -> None:
        """Refuse an http(s) URL this policy does not allow (MediaURLError)."""
        try:
            parts = urllib.parse.urlsplit(url)
            parts.port                      # noqa: B018 -- a port out of range raises here, not later
        except ValueError as e:
            raise MediaURLError(f"{_short(url)} is not a valid URL: {e}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise MediaURLError(f"{_short(url)} is not an http(s) URL with a host")
        if self.allow_media_urls:
            return
        if not self.allowed_media_domains:
            raise MediaURLError("this server does not fetch media URLs (its operator allows them with "
                                "--allowed-media-domains or --allow-media-urls); send the media as a base64 data URI")
        if parts.hostname.lower() not in {h.lower() for h in self.allowed_media_domains}:
            raise MediaURLError(f"the host {parts.hostname!r} is not one this server fetches media from "
                                f"(--allowed-media-domains)")


async def media_bytes(url: str, policy: MediaPolicy, left: int | None = None) -> bytes:
    """The bytes `url` stands for (a data URI's payload, a file's content, a download), at most
    `policy.max_media_bytes` of them, and for a file or a download at most `left` (what the request's URLs may
    still bring: `Cap`); MediaURLError when the policy refuses the URL or the bytes cannot be had."""
    scheme = url.partition(":")[0].lower()
    if scheme == "data":
        return await asyncio.to_thread(decode_base64, url.partition(",")[2], "the data URI", policy.max_media_bytes)
    cap = _Cap.of(policy.max_media_bytes, left)
    if scheme == "file":
        return await asyncio.to_thread(_read_file, url, policy, cap)
    if scheme in ("http", "https"):
        policy.check_http(url)
        try:
            return await asyncio.wait_for(_download(url, policy, cap), policy.fetch_timeout_s)
        except asyncio.TimeoutError:
            raise MediaURLError(f"fetching {_short(url)} took longer than {policy.fetch_timeout_s:g} s "
                                f"(--media-fetch-timeout)") from None
    raise MediaURLError(f"URLs of scheme {scheme!r} are not taken (data:, file:, http: and https: are)")


def decode_base64(text: str, what: str, max_bytes: int) -> bytes:
    """`text` as base64, refused before it is decoded when it would pass `max_bytes`."""
    if len(text) // 4 * 3 > max_bytes + 2:
        raise MediaURLError(f"{what} holds about {len(text) // 4 * 3} bytes; this server takes at most {max_bytes} "
                            f"bytes a media part (--max-media-bytes)")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise MediaURLError(f"{what} is not valid base64") from None
    if len(data) > max_bytes:
        raise _Cap.of(max_bytes, None).refuse(f"{what} holds {len(data)} bytes")
    return data


class _Cap(NamedTuple):
    """The most bytes one file or download may bring, and why (the end of the 400 that refuses more)."""

    bytes: int
    why: str

    @classmethod
    def of(cls, per_part: int, left: int | None) -> _Cap:
        """--max-media-bytes, or less when the request's earlier URLs have used up most of what its URLs may
        bring together (`left`)."""
        if left is None or left >= per_part:
            return cls(per_part, f"this server takes at most {per_part} bytes a media part (--max-media-bytes)")
        left = max(left, 0)
        return cls(left, f"this request's media URLs may bring {left} more bytes (a request's URLs bring at most "
                         f"what its body may carry)")

    def refuse(self, what: str) -> MediaURLError:
        return MediaURLError(f"{what}; {self.why}")


def _read_file(url: str, policy: MediaPolicy, cap: _Cap) -> bytes:
    if policy.allowed_local_media_path is None:
        raise MediaURLError("this server does not read local files (its operator allows a directory with "
                            "--allowed-local-media-path); send the media as a base64 data URI")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaURLError(f"file URLs name a local path (file:///...), not the host {parts.netloc!r}")
    root = Path(policy.allowed_local_media_path).resolve()
    try:
        path = Path(urllib.request.url2pathname(parts.path)).resolve()
    except (ValueError, OSError) as e:          # a NUL byte, a symlink loop
        raise MediaURLError(f"{parts.path!r} is not a usable path: {e}") from None
    if not path.is_relative_to(root):
        raise MediaURLError(f"{parts.path!r} is not under the directory this server reads media from "
                            f"(--allowed-local-media-path)")
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size > cap.bytes:
                raise cap.refuse(f"{parts.path!r} is {os.fstat(f.fileno()).st_size} bytes")
            data = f.read(cap.bytes + 1)
    except OSError as e:
        raise MediaURLError(f"{parts.path!r} cannot be read: {e.strerror or e}") from None
    if len(data) > cap.bytes:
        raise cap.refuse(f"{parts.path!r} holds more")
    return data


async def _download(url: str, policy: MediaPolicy, cap: _Cap) -> bytes:
    import httpx

    try:
        async with httpx.AsyncClient(follow_redirects=False, trust_env=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                async with client.stream("GET", url) as r:
                    if r.is_redirect:
                        target = str(r.url.join(r.headers["location"]))
                        try:
                            policy.check_http(target)
                        except MediaURLError as e:
                            raise MediaURLError(f"{_short(url)} redirects to {_short(target)}, which is not "
                                                f"allowed: {e}") from None
                        url = target
                        continue
                    if r.status_code != 200:
                        raise MediaURLError(f"fetching {_short(url)} got HTTP {r.status_code} {r.reason_phrase}")
                    declared = r.headers.get("content-length", "")
                    if declared.isdigit() and int(declared) > cap.bytes:
                        raise cap.refuse(f"{_short(url)} is {declared} bytes")
                    chunks, size = [], 0
                    async for chunk in r.aiter_bytes():
                        size += len(chunk)
                        if size > cap.bytes:
                            raise cap.refuse(f"{_short(url)} sent more")
                        chunks.append(chunk)
                    return b"".join(chunks)
    except (httpx.HTTPError, httpx.InvalidURL) as e:     # connection, TLS, protocol, decoding; a URL httpx refuses
        raise MediaURLError(f"fetching {_short(url)} failed: {type(e).__name__}: {e}") from None
    raise MediaURLError(f"{_short(url)} redirects more than {MAX_REDIRECTS} times")


def _short(url: str) -> str:
    return repr(url if len(url) <= 200 else url[:200] + "...")
