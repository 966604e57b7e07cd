"""GET / and /web/...: the chat page (docs/web.md), static files shipped in the package (gem4/server/web).

The files are public: the page must load before it knows the API key (it asks for it, then sends it as a
bearer token on each API call), so `create_app` includes this router without the key check, unless
`--no-web-ui` (`ServerConfig.web_ui`) leaves it out and / answers 404.

Every response carries a Content-Security-Policy that lets the page run only its own files: no inline
script, no script or style from elsewhere, no eval, no plugin, no frame; `connect-src 'self'` keeps its
fetches on this server. Model output is untrusted text that the page renders as markdown; the sanitizer
(DOMPurify) is the first guard against script in it, this policy the second.

Only the files of the package are served: a path is looked up in the set read at import, never joined onto
the directory, so `..` and symlinks lead nowhere.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from gem4.server.protocol import APIError

WEB_DIR = Path(__file__).resolve().parent.parent / "web"

CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
                           "connect-src 'self'; manifest-src 'self'; base-uri 'none'; form-action 'none'; "
                           "frame-ancestors 'none'")

_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".mjs": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".txt": "text/plain; charset=utf-8"}

# the servable files: their path under web/ -> (bytes, content type). LICENSE files are served as text.
FILES: dict[str, tuple[bytes, str]] = {
    p.relative_to(WEB_DIR).as_posix(): (p.read_bytes(), _TYPES.get(p.suffix, "text/plain; charset=utf-8"))
    for p in sorted(WEB_DIR.rglob("*")) if p.is_file()
}

_HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}

router = APIRouter()


def _file(path: str) -> Response:
    found = FILES.get(path)
    if found is None:
        raise APIError(404, f"Unknown request URL: GET /web/{path}. Please check the URL for typos.",
                       code="unknown_url")
    body, media_type = found
    return Response(body, media_type=media_type, headers=_HEADERS)


@router.api_route("/", methods=["GET", "HEAD"])
async def index():
    return _file("index.html")


@router.api_route("/web/{path:path}", methods=["GET", "HEAD"])
async def static(path: str):
    return _file(path)
