"""gem4 on Ray Serve (gem4.server.ray_serve, the `gem4[ray]` extra): two demo replicas behind Ray Serve's
prefix-aware router and gem4's OpenAI-compatible ingress, on 127.0.0.1 only (Ray's own processes included).

CI installs the extra in a step of its own (.ci/run) and runs this file there; without it installed the
module is skipped (the plain test install does not carry Ray's ~250 MB).
"""
from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the gem4[ray] extra is not installed (CI runs this file in its own step)")
from ray import serve  # noqa: E402
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from server_helpers import HOST, accumulate, client_for  # noqa: E402

from gem4.server.ray_serve import build, routing_text  # noqa: E402

SYSTEM = {"A": "You are a careful assistant for a shipping company. " * 40,
          "B": "Tu es un poète qui répond toujours en alexandrins rimés. " * 40}
ROUNDS = 8


def test_routing_text():
    assert routing_text(b'{"messages": [{"role": "user", "content": "hi"}]}') == [{"role": "user", "content": "hi"}]
    assert routing_text(b'{"prompt": "Once"}') == "Once"
    assert routing_text(b'{"input": "Hello"}') == "Hello"
    for body in (b"", b"not json", b"[]", b'{"prompt": ""}', b'{"prompt": [1, 2]}', b'{"messages": []}'):
        assert routing_text(body) is None, body                 # nothing to read: routed by load


@pytest.fixture(scope="module")
def ray_app():
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address=HOST, log_to_driver=False)
    try:
        serve.start(http_options={"host": HOST, "port": port})
        # as `serve run gem4.server.ray_serve:build args="--demo --threads 1" num_replicas=2` calls the builder
        app = call_user_app_builder_with_args_if_necessary(build, {"args": "--demo --threads 1", "num_replicas": "2"})
        serve.run(app, name="gem4", route_prefix="/")
        yield f"http://{HOST}:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def chat(base: str, system: str, question: str, stream: bool):
    """One greedy chat request; -> (the replica that made it, prompt tokens, of which cached)."""
    kw = dict(model="gem4-demo", max_tokens=4, temperature=0,
              messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
    api = client_for(base, key="none").chat.completions.with_raw_response
    if stream:
        raw = api.create(**kw, stream=True, stream_options={"include_usage": True})
        chunks = list(raw.parse())
        assert accumulate(chunks)["finish_reason"] == "length"
        usage = chunks[-1].usage
    else:
        raw = api.create(**kw)
        reply = raw.parse()
        assert reply.choices[0].finish_reason == "length"
        usage = reply.usage
    return raw.headers["x-gem4-replica"], usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


def test_ray_serve_keeps_each_prompt_on_one_replica(ray_app):
    home: dict[str, str] = {}
    cache = {name: [0, 0] for name in SYSTEM}                  # (prompt tokens, cached ones) of its requests
    for r in range(ROUNDS):
        for name, system in SYSTEM.items():
            replica, prompt, cached = chat(ray_app, system, f"Question {r}?", stream=r % 2 == 1)
            home.setdefault(name, replica)
            assert replica == home[name], f"prompt {name}'s request {r} went to {replica}, not {home[name]}"
            cache[name][0] += prompt
            cache[name][1] += cached
    for name, (prompt, cached) in cache.items():
        assert cached / prompt >= 0.8, (name, cached, prompt)
    models = client_for(ray_app, key="none").models.list()                 # a request without text: by load
    assert [m.id for m in models.data] == ["gem4-demo"]
