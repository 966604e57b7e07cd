"""Media URLs through the server (docs/multimodal.md §6, server/media_fetch.py), with the official `openai` client
and a loopback HTTP server of generated media: an image (or a video) fetched from an allowed host, through a
redirect on it, or read from the allowed directory answers as the same image sent as a data URI; every way a URL can fail (a host not
allowed, a redirect to one, a slow peer, a peer that sends too much, an HTTP error, bytes that are no image, a file
outside the directory by path, `..` or symlink) is a 400 naming the part; a client that leaves stops its fetch."""
from __future__ import annotations

import http.server
import io
import threading
import time

import httpx
import numpy as np
import pytest
from PIL import Image

import gem4
from gem4.server import ServerConfig, create_app
from gem4.server.media_fetch import MediaPolicy
from server_helpers import API_KEY, InProcessServer, assert_openai_error, client_for
from test_video import make_clip
from test_video_server import ask as ask_video, data_uri as video_data_uri, video_tokenizer_dir
from test_vision_server import MAX_MODEL_LEN, ask, data_uri
from vision_fixtures import build_vision_hf, sample_image

CAP = 300_000               # --max-media-bytes of the server under test
TIMEOUT_S = 4.0             # --media-fetch-timeout
IMAGE = sample_image(150, 200, seed=3)
CLIP = make_clip(frames=5, fps=2)
NOISE = Image.fromarray(np.random.default_rng(0).integers(0, 256, (400, 400, 3), dtype=np.uint8))   # ~480 KB PNG
MEDIUM = Image.fromarray(np.random.default_rng(1).integers(0, 256, (280, 280, 3), dtype=np.uint8))  # ~236 KB PNG
BODY = 1_000_000            # --max-request-body-mb: also what one request's URLs may bring together


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


class MediaHost(http.server.BaseHTTPRequestHandler):
    """The loopback peer: /cat.png, a redirect to it on this host and to another host name (localhost), a slow
    body, bodies past the cap with and without Content-Length, a 404, bytes that are no image, and /hang, which
    dribbles a byte every 50 ms and records when its reader goes away."""

    hang_closed: list[float] = []

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        port = self.server.server_address[1]
        if self.path == "/cat.png":
            self._send(png(IMAGE))
        elif self.path == "/clip.mp4":
            self._send(CLIP)
        elif self.path == "/redirect-here":
            self._redirect("/cat.png")
        elif self.path == "/redirect-away":
            self._redirect(f"http://localhost:{port}/cat.png")
        elif self.path == "/not-an-image":
            self._send(b"hello, not an image")
        elif self.path == "/medium.png":
            self._send(png(MEDIUM))
        elif self.path == "/huge":
            self._send(png(NOISE))
        elif self.path in ("/endless", "/slow", "/hang"):
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()           # no Content-Length: the body runs until the connection closes
            start = time.monotonic()
            try:
                while time.monotonic() - start < 30:
                    if self.path == "/endless":
                        self.wfile.write(b"\0" * 65536)
                    else:
                        self.wfile.write(b"\0")
                        self.wfile.flush()
                        time.sleep(0.05)
            except OSError:
                if self.path == "/hang":
                    MediaHost.hang_closed.append(time.monotonic())
        else:
            self.send_error(404)

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, where: str) -> None:
        self.send_response(302)
        self.send_header("Location", where)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture(scope="module")
def media_host():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), MediaHost)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def url_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("url-server") / "model"
    build_vision_hf("31b").save_pretrained(d)
    video_tokenizer_dir(d)              # the image tokens and the video one
    media = tmp_path_factory.mktemp("media")
    allowed = media / "allowed"
    allowed.mkdir()
    (allowed / "cat.png").write_bytes(png(IMAGE))
    (allowed / "noise.png").write_bytes(png(NOISE))
    (allowed / "clip.mp4").write_bytes(CLIP)
    (media / "secret.png").write_bytes(png(IMAGE))
    (allowed / "link.png").symlink_to(media / "secret.png")
    engine = gem4.Engine(gem4.load(d, dtype="float32"), gem4.Tokenizer.from_file(d), max_model_len=MAX_MODEL_LEN,
                         prefill_chunk=512, block_size=4)
    policy = MediaPolicy(allowed_local_media_path=str(allowed), allowed_media_domains=("127.0.0.1",),
                         fetch_timeout_s=TIMEOUT_S, max_media_bytes=CAP)
    app = create_app(ServerConfig(served_model_name="vision", api_key=API_KEY, media_policy=policy,
                                  max_request_body=BODY,
                                  default_chat_template_kwargs={"enable_thinking": False}), engine)
    with InProcessServer(app) as base:
        yield base, allowed


def answer(base: str, url: str):
    return client_for(base).chat.completions.create(
        model="vision", messages=ask(url), temperature=0, max_tokens=8,
        extra_body={"mm_processor_kwargs": {"max_soft_tokens": 70}})


def test_an_image_by_url_answers_as_its_data_uri(url_server, media_host):
    base, allowed = url_server
    want = answer(base, data_uri(IMAGE))
    for url in (media_host + "/cat.png", media_host + "/redirect-here", (allowed / "cat.png").as_uri(),
                (allowed / ".." / "allowed" / "cat.png").as_uri()):
        got = answer(base, url)
        assert got.choices[0].message.content == want.choices[0].message.content, url
        assert got.usage.prompt_tokens == want.usage.prompt_tokens, url


def test_a_video_by_url_answers_as_its_data_uri(url_server, media_host):
    base, allowed = url_server
    client = client_for(base)
    want, *got = (client.chat.completions.create(model="vision", messages=ask_video(url), temperature=0, max_tokens=8)
                  for url in (video_data_uri(CLIP), media_host + "/clip.mp4", (allowed / "clip.mp4").as_uri()))
    for r in got:
        assert r.choices[0].message.content == want.choices[0].message.content
        assert r.usage.prompt_tokens == want.usage.prompt_tokens > 5 * 70 // 2


def post(base: str, url: str) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                      json={"model": "vision", "messages": ask(url), "max_tokens": 2,
                            "mm_processor_kwargs": {"max_soft_tokens": 70}})


@pytest.mark.parametrize("url, fragment", [
    ("{host}/redirect-away", "which is not allowed: the host 'localhost' is not one this server fetches"),
    ("http://localhost:{port}/cat.png", "the host 'localhost' is not one this server fetches"),
    ("{host}/slow", f"took longer than {TIMEOUT_S:g} s (--media-fetch-timeout)"),
    ("{host}/huge", f"bytes; this server takes at most {CAP} bytes a media part (--max-media-bytes)"),
    ("{host}/endless", "sent more; this server takes at most"),
    ("{host}/missing.png", "got HTTP 404"),
    ("{host}/not-an-image", "cannot be decoded"),
    ("http://127.0.0.1:1/cat.png", "failed: ConnectError"),
    ("{dir}/noise.png", "(--max-media-bytes)"),
    ("{dir}/../secret.png", "is not under the directory this server reads media from"),
    ("{dir}/link.png", "is not under the directory this server reads media from"),
    ("file:///etc/hostname", "is not under the directory"),
    ("{dir}/absent.png", "cannot be read"),
    ("file://example.com/cat.png", "not the host 'example.com'"),
    ("{noise}", "this server takes at most"),
])
def test_bad_media_urls_are_400s_naming_the_part(url_server, media_host, url, fragment):
    base, allowed = url_server
    url = url.format(host=media_host, port=media_host.rsplit(":", 1)[1], dir="file://" + str(allowed),
                     noise=data_uri(NOISE))
    r = post(base, url)
    err = assert_openai_error(r, 400, param="messages[0].content[1]")
    assert fragment in err["message"]
    assert httpx.get(base + "/health", timeout=10).status_code == 200


def test_a_requests_urls_bring_no_more_than_its_body_may_carry(url_server, media_host):
    """Each part is within --max-media-bytes, but five of them pass the body limit: the fifth is refused, so a
    short request cannot make the server take in more than a client could have sent it."""
    base, _ = url_server
    size = len(png(MEDIUM))
    assert size < CAP and 4 * size < BODY < 5 * size
    parts = [{"type": "text", "text": "Compare."}] + [{"type": "image_url", "image_url": {"url": media_host +
                                                                                          "/medium.png"}}] * 5
    r = httpx.post(base + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                   json={"model": "vision", "messages": [{"role": "user", "content": parts}], "max_tokens": 1,
                         "mm_processor_kwargs": {"max_soft_tokens": 70}})
    err = assert_openai_error(r, 400, param="messages[0].content[5]")
    assert f"may bring {BODY - 4 * size} more bytes" in err["message"]
    parts = parts[:5]
    r = httpx.post(base + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                   json={"model": "vision", "messages": [{"role": "user", "content": parts}], "max_tokens": 1,
                         "mm_processor_kwargs": {"max_soft_tokens": 70}})
    assert r.status_code == 200, r.text


def test_a_client_that_leaves_stops_its_fetch(url_server, media_host):
    base, _ = url_server
    MediaHost.hang_closed.clear()
    start = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        post_quickly = httpx.post(base + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                                  json={"model": "vision", "messages": ask(media_host + "/hang"), "max_tokens": 2},
                                  timeout=0.5)
        del post_quickly
    deadline = time.monotonic() + 10
    while not MediaHost.hang_closed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert MediaHost.hang_closed, "the peer never saw its reader go"
    # the fetch ended with the client, not with its timeout
    assert MediaHost.hang_closed[0] - start < TIMEOUT_S - 1.0
    assert httpx.get(base + "/health", timeout=10).status_code == 200


def test_the_serve_flags_make_the_policy_and_fetch_nothing_by_default():
    from gem4.argtypes import ArgParser
    from gem4.server.main import add_arguments, server_config

    parser = ArgParser()
    add_arguments(parser)
    assert server_config(parser.parse_args(["m"]), ["m"]).media_policy == MediaPolicy()
    assert MediaPolicy().allowed_local_media_path is None and not MediaPolicy().allowed_media_domains
    assert not MediaPolicy().allow_media_urls
    args = parser.parse_args(["m", "--allowed-local-media-path", "/srv/media", "--allowed-media-domains", "a.example",
                              "b.example", "--allow-media-urls", "--media-fetch-timeout", "2.5",
                              "--max-media-bytes", "1000"])
    assert server_config(args, ["m"]).media_policy == MediaPolicy(
        allowed_local_media_path="/srv/media", allowed_media_domains=("a.example", "b.example"),
        allow_media_urls=True, fetch_timeout_s=2.5, max_media_bytes=1000)


@pytest.mark.parametrize("url, fragment", [
    ("http://[::1/cat.png", "is not a valid URL"),
    ("http://127.0.0.1:99999/cat.png", "is not a valid URL"),
    ("http:///cat.png", "not an http(s) URL with a host"),
    ("file:///srv/a%00b.png", "is not a usable path"),
    ("gopher://127.0.0.1/x", "URLs of scheme 'gopher' are not taken"),
    ("data:image/png;base64,@@", "not valid base64"),
])
def test_malformed_urls_are_refused_with_their_cause(url, fragment):
    """What protocol.py lets through to `media_bytes` is a MediaURLError (a 400), never another exception."""
    import asyncio

    from gem4.server.media_fetch import MediaURLError, media_bytes

    policy = MediaPolicy(allowed_local_media_path="/srv", allow_media_urls=True, fetch_timeout_s=5)
    with pytest.raises(MediaURLError) as e:
        asyncio.run(media_bytes(url, policy))
    assert fragment in str(e.value)


def test_by_default_nothing_is_fetched_or_read(media_host, tmp_path):
    """The default policy takes data URIs only: no download (even of a host that answers) and no file."""
    import asyncio

    from gem4.server.media_fetch import MediaURLError, media_bytes

    (tmp_path / "cat.png").write_bytes(png(IMAGE))
    for url, fragment in ((media_host + "/cat.png", "does not fetch media URLs"),
                          ((tmp_path / "cat.png").as_uri(), "does not read local files")):
        with pytest.raises(MediaURLError) as e:
            asyncio.run(media_bytes(url, MediaPolicy()))
        assert fragment in str(e.value)
    assert asyncio.run(media_bytes(data_uri(IMAGE), MediaPolicy())) == png(IMAGE)
