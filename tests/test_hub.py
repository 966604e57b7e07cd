"""Models by name (gem4.weights.hub) against a fake hub on 127.0.0.1: never the network.

The fake hub serves what huggingface_hub 2.4 asks for (read from its file_download.py / hf_api.py):
  GET  /api/models/{repo}[/revision/{rev}]?blobs=true   model info: sha, siblings (size, blobId, lfs.sha256)
  HEAD /{repo}/resolve/{rev}/{file}   X-Repo-Commit, ETag (git blob id; SHA-256 for LFS files, which also
                                      get X-Linked-Etag / X-Linked-Size), Content-Length; no X-Xet-* headers,
                                      so huggingface_hub takes its plain HTTP path
  GET  /{repo}/resolve/{rev}/{file}   the bytes, honouring `Range: bytes=N-` (206 + Content-Range)
The models are the demo checkpoint (random weights, no transformers): as a sharded HF directory and
as a Q8_0 GGUF written by gem4's converter.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import gem4
import gem4.weights.hub as hub_module
from gem4.weights.hub import VERIFIED_DIR, HubError, ModelRef, checkpoint_files, parse_ref, pick_gguf, resolve

LFS_SUFFIXES = (".gguf", ".safetensors", ".bin", ".onnx")


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    """A hub with a few repos. `requests` records (method, path, headers by lower-case name); `cut_after[file] = n` makes the
    next GET of `file` send n bytes of the body and drop the connection; `advertise[file] = hex` makes
    the listing and the ETag claim that hash while the true bytes are served."""

    def __init__(self):
        self.repos: dict[str, dict] = {}
        self.requests: list[tuple[str, str, dict]] = []
        self.cut_after: dict[str, int] = {}
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub.handle(self, body=False)

            def do_GET(self):
                hub.handle(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, repo_id: str, files: dict[str, bytes], token: str | None = None,
            advertise: dict[str, str] | None = None, blob_ids: dict[str, str] | None = None) -> str:
        commit = hashlib.sha1(json.dumps(sorted((n, git_sha1(b)) for n, b in files.items())).encode()).hexdigest()
        self.repos[repo_id] = dict(files=files, commit=commit, token=token, advertise=advertise or {},
                                   blob_ids=blob_ids or {})
        return commit

    def stop(self):
        self.server.shutdown()
        self.server.server_close()

    def gets(self, name: str | None = None) -> list[tuple[str, str, dict]]:
        return [r for r in self.requests if r[0] == "GET" and "/resolve/" in r[1]
                and (name is None or r[1].endswith("/" + name))]

    # -- serving ----------------------------------------------------------------------------

    def _meta(self, repo: dict, name: str) -> dict:
        data = repo["files"][name]
        lfs = name.endswith(LFS_SUFFIXES)
        sha256 = repo["advertise"].get(name) or hashlib.sha256(data).hexdigest()
        return dict(size=len(data), blob_id=repo["blob_ids"].get(name) or git_sha1(data),
                    sha256=sha256 if lfs else None)

    def handle(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = h.path.split("?", 1)[0]
        self.requests.append((h.command, h.path, {k.lower(): v for k, v in h.headers.items()}))

        def error(status: int, code: str, headers: dict | None = None) -> None:
            h.send_response(status)
            h.send_header("X-Error-Code", code)
            for k, v in (headers or {}).items():
                h.send_header(k, v)
            h.send_header("Content-Length", "0")
            h.end_headers()

        parts = path.strip("/").split("/")
        api = parts[:2] == ["api", "models"]
        repo_id = "/".join(parts[2:4] if api else parts[0:2])
        repo = self.repos.get(repo_id)
        if repo is None or (repo["token"] and h.headers.get("Authorization") != f"Bearer {repo['token']}"):
            return error(404 if repo is None else 401, "RepoNotFound")
        if api:
            siblings = []
            for name in sorted(repo["files"]):
                m = self._meta(repo, name)
                s = {"rfilename": name, "size": m["size"], "blobId": m["blob_id"]}
                if m["sha256"]:
                    s["lfs"] = {"size": m["size"], "sha256": m["sha256"], "pointerSize": 134}
                siblings.append(s)
            return self._send(h, json.dumps({"id": repo_id, "modelId": repo_id, "sha": repo["commit"],
                                             "private": bool(repo["token"]), "siblings": siblings}).encode(),
                              {"Content-Type": "application/json"}, body)
        if len(parts) < 5 or parts[2] != "resolve":
            return error(404, "EntryNotFound")
        if parts[3] not in ("main", repo["commit"]):
            return error(404, "RevisionNotFound")
        name = "/".join(parts[4:])
        if name not in repo["files"]:
            return error(404, "EntryNotFound", {"X-Repo-Commit": repo["commit"]})
        data, m = repo["files"][name], self._meta(repo, name)
        headers = {"X-Repo-Commit": repo["commit"], "Accept-Ranges": "bytes"}
        if m["sha256"]:
            headers.update({"ETag": f'"{m["sha256"]}"', "X-Linked-Etag": f'"{m["sha256"]}"',
                            "X-Linked-Size": str(m["size"])})
        else:
            headers["ETag"] = f'"{m["blob_id"]}"'
        start = 0
        rng = h.headers.get("Range")
        if rng and body:
            assert rng.startswith("bytes=") and rng.endswith("-"), rng
            start = int(rng[6:-1])
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        cut = self.cut_after.pop(name, None) if body else None
        self._send(h, data[start:], headers, body, status=206 if start else 200, cut=cut)

    @staticmethod
    def _send(h, data: bytes, headers: dict, body: bool, status: int = 200, cut: int | None = None) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data if cut is None else data[:cut])
            h.wfile.flush()
        h.close_connection = True


# ---------------------------------------------------------------------------------------------
# fixtures: the demo model as a GGUF repo and as a sharded checkpoint repo
# ---------------------------------------------------------------------------------------------

GGUF_REPO = "gem4-test/tiny-GGUF"
CKPT_REPO = "gem4-test/tiny"
GGUF_NAME = "tiny-it-Q8_0.gguf"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    from gem4.demo import build_demo
    from gem4.weights.checkpoint import open_checkpoint
    from gem4.weights.gguf_model import write_gguf

    root = tmp_path_factory.mktemp("hub-models")
    demo = build_demo(root / "demo")
    write_gguf(open_checkpoint(demo), root / GGUF_NAME, "q8_0")
    gguf = {
        GGUF_NAME: (root / GGUF_NAME).read_bytes(),
        "tiny-it-Q4_0.gguf": b"not loaded by any test" * 50,
        "mmproj-tiny-it-f16.gguf": b"projector" * 100,
        "README.md": b"# tiny\n",
    }
    # the checkpoint in two shards with an index, and files of other formats that must not be fetched
    state = load_file(str(demo / "model.safetensors"))
    names = sorted(state)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    ckpt = {n: (demo / n).read_bytes() for n in ("config.json", "tokenizer.json", "tokenizer_config.json")}
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(root / shard), metadata={"format": "pt"})
        ckpt[shard] = (root / shard).read_bytes()
    ckpt["model.safetensors.index.json"] = json.dumps(
        {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}).encode()
    decoys = {"consolidated.safetensors": b"x" * 300, "pytorch_model.bin": b"y" * 300,
              "onnx/model.onnx": b"z" * 300, "original/model.safetensors": b"w" * 300,
              "tokenizer.model": b"v" * 300, "README.md": b"# tiny\n", ".gitattributes": b"*.gguf filter=lfs\n"}
    return {"demo": demo, "gguf": gguf, "ckpt": ckpt, "decoys": decoys}


@pytest.fixture
def hub(models, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)   # whatever the shell says
    monkeypatch.delenv("HF_TOKEN", raising=False)
    h = FakeHub()
    h.add(GGUF_REPO, models["gguf"])
    h.add(CKPT_REPO, {**models["ckpt"], **models["decoys"]})
    yield h
    h.stop()


def opts(hub: FakeHub, tmp_path: Path, **kw) -> dict:
    return dict(endpoint=hub.url, cache_dir=tmp_path / "hf", **kw)


def logits(path) -> torch.Tensor:
    return gem4.load(path, dtype="float32").logits([2, 105, 2364, 1000])


# ---------------------------------------------------------------------------------------------
# choosing files (no server)
# ---------------------------------------------------------------------------------------------

FILES = ["gemma-4-E2B-it-Q4_K_M.gguf", "gemma-4-E2B-it-Q8_0.gguf", "gemma-4-E2B-it-UD-Q4_K_XL.gguf",
         "gemma-4-E2B-it-q5_k_m.gguf", "mmproj-gemma-4-E2B-it-F16.gguf", "gemma-4-E2B-it.imatrix.gguf",
         "BF16/gemma-4-E2B-it-BF16-00001-of-00002.gguf", "BF16/gemma-4-E2B-it-BF16-00002-of-00002.gguf",
         "README.md"]


@pytest.mark.parametrize("tag, files, expected", [
    ("Q4_K_M", FILES, "gemma-4-E2B-it-Q4_K_M.gguf"),
    ("q8_0", FILES, "gemma-4-E2B-it-Q8_0.gguf"),                       # case-insensitive
    ("Q5_K_M", FILES, "gemma-4-E2B-it-q5_k_m.gguf"),
    ("UD-Q4_K_XL", FILES, "gemma-4-E2B-it-UD-Q4_K_XL.gguf"),
    ("Q4_K_XL", FILES, "gemma-4-E2B-it-UD-Q4_K_XL.gguf"),
    (None, FILES, "gemma-4-E2B-it-Q4_K_M.gguf"),                        # default: Q4_K_M ...
    (None, FILES[1:], "gemma-4-E2B-it-Q8_0.gguf"),                      # ... then Q8_0 ...
    (None, ["m-F16.gguf", "m-BF16.gguf", "mmproj-m-Q4_K_M.gguf"], "m-BF16.gguf"),   # ... then the first
    (None, ["model.gguf"], "model.gguf"),
])
def test_pick_gguf(tag, files, expected):
    assert pick_gguf(files, tag) == expected


@pytest.mark.parametrize("tag, files, message", [
    ("Q3_K_S", FILES, ("no GGUF file with tag 'Q3_K_S'; available:\n",              # lists the tags
                       "\n  Q4_K_M     gemma-4-E2B-it-Q4_K_M.gguf\n",
                       "\n  BF16       BF16/gemma-4-E2B-it-BF16-00001-of-00002.gguf (split in 2 files)\n")),
    ("BF16", FILES, "is a split GGUF (2 files)"),
    ("Q4_K_M", ["a-Q4_K_M.gguf", "b-Q4_K_M.gguf"], "tag 'Q4_K_M' fits 2 GGUF files"),
    (None, ["mmproj-x-F16.gguf"], "no GGUF model file"),
    ("F16", ["x-F16.gguf", "x.F16.gguf"], "fits 2"),
])
def test_pick_gguf_errors(tag, files, message):
    with pytest.raises(HubError) as e:
        pick_gguf(files, tag, "repo")
    assert str(e.value).startswith("repo: ")
    for part in (message,) if isinstance(message, str) else message:
        assert part in str(e.value)


def test_checkpoint_files():
    names = ["config.json", "tokenizer.json", "tokenizer.model", "model.safetensors", "pytorch_model.bin",
             "original/consolidated.safetensors", "chat_template.jinja", "README.md"]
    assert checkpoint_files(names, None) == ["config.json", "tokenizer.json", "chat_template.jinja",
                                             "model.safetensors"]
    index = {"weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors", "c": "m-1.safetensors"}}
    names = ["config.json", "model.safetensors.index.json", "m-1.safetensors", "m-2.safetensors", "old.safetensors"]
    assert checkpoint_files(names, index) == ["config.json", "model.safetensors.index.json", "m-1.safetensors",
                                              "m-2.safetensors"]
    with pytest.raises(HubError, match="does not have: m-2.safetensors"):
        checkpoint_files(names[:3], index, "r")
    with pytest.raises(HubError, match="no config.json"):
        checkpoint_files(["model.safetensors"], None, "r")
    with pytest.raises(HubError, match="no \\*.safetensors"):
        checkpoint_files(["config.json", "pytorch_model.bin"], None, "r")


def test_parse_ref_and_local_paths(tmp_path, monkeypatch):
    assert parse_ref("ggml-org/gemma-4-E2B-it-GGUF:Q4_K_M") == ModelRef("ggml-org/gemma-4-E2B-it-GGUF", "Q4_K_M")
    assert parse_ref("google/gemma-4-E2B-it").tag is None
    for path in ("./a/b", "/a/b", "a/b/c", "dir/model.gguf", "model.gguf", "a/b:"):
        assert parse_ref(path) is None, path
    # an existing path shaped like a repo id stays local: no hub is asked (none is configured here)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "owner" / "name").mkdir(parents=True)
    assert resolve("owner/name", endpoint="http://127.0.0.1:9") == Path("owner/name")
    assert resolve("missing.gguf") == Path("missing.gguf")          # not a repo id: the loader reports it


# ---------------------------------------------------------------------------------------------
# downloads through huggingface_hub against the fake hub
# ---------------------------------------------------------------------------------------------


def test_gguf_by_quant_tag(hub, models, tmp_path, monkeypatch):
    said = []
    path = resolve(f"{GGUF_REPO}:q8_0", said.append, **opts(hub, tmp_path))
    assert path.name == GGUF_NAME and path.read_bytes() == models["gguf"][GGUF_NAME]
    assert str(path).startswith(str(tmp_path / "hf"))
    assert [r[1].rsplit("/", 1)[-1] for r in hub.gets()] == [GGUF_NAME]       # no projector, no README
    assert any("downloading tiny-it-Q8_0.gguf" in s for s in said)
    # the path works for gem4: the same logits as the converted file, and the GGUF carries the tokenizer
    out = logits(path)
    assert torch.isfinite(out).all() and out.shape == (4, 4096)                # the demo vocabulary
    assert gem4.Tokenizer.from_file(path).encode("hello") == gem4.Tokenizer.from_file(models["demo"]).encode("hello")

    # a second call finds it in the cache: one listing, no download, no second hashing (the verification
    # is recorded); no tag picks Q8_0 (no Q4_K_M here)
    hub.requests.clear()
    said.clear()
    monkeypatch.setattr(hub_module, "file_hashes", lambda *a, **k: pytest.fail("hashed a verified file again"))
    assert resolve(GGUF_REPO, said.append, **opts(hub, tmp_path)) == path
    assert hub.gets() == [] and any("no :TAG given, using tiny-it-Q8_0.gguf" in s for s in said)


def test_checkpoint_directory(hub, models, tmp_path):
    path = resolve(CKPT_REPO, **opts(hub, tmp_path))
    got = sorted(r[1].split("/resolve/main/", 1)[1] for r in hub.gets())
    assert got == sorted(models["ckpt"])                    # config, tokenizer, index, both shards; no decoys
    assert sorted(p.name for p in path.iterdir()) == sorted(models["ckpt"])
    torch.testing.assert_close(logits(path), logits(models["demo"]), rtol=0, atol=0)
    assert gem4.Tokenizer.from_file(path).encode("hello world") == \
        gem4.Tokenizer.from_file(models["demo"]).encode("hello world")


def test_resumes_a_cut_download(hub, tmp_path):
    # huggingface_hub writes what it receives in 10 MiB pieces (DOWNLOAD_CHUNK_SIZE): cut after one piece
    data = random.Random(5).randbytes(12 << 20)
    hub.add("gem4-test/big-GGUF", {"big-F32.gguf": data})
    cut = (10 << 20) + 12345
    hub.cut_after["big-F32.gguf"] = cut
    path = resolve("gem4-test/big-GGUF", **opts(hub, tmp_path))
    assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(data).digest()
    ranges = [r[2].get("range") for r in hub.gets("big-F32.gguf")]
    assert ranges == [None, f"bytes={10 << 20}-"]        # the second request continued where the file stood


@pytest.mark.parametrize("repo, name, algorithm", [(GGUF_REPO, GGUF_NAME, "sha256"),
                                                   (CKPT_REPO, "config.json", "git-sha1")])
def test_refuses_a_file_whose_hash_differs(hub, models, tmp_path, repo, name, algorithm):
    files = models["gguf"] if repo == GGUF_REPO else {**models["ckpt"], **models["decoys"]}
    wrong = "0" * (64 if algorithm == "sha256" else 40)
    hub.add(repo, files, **({"advertise": {name: wrong}} if algorithm == "sha256" else {"blob_ids": {name: wrong}}))
    with pytest.raises(HubError) as e:
        resolve(repo, **opts(hub, tmp_path))
    message = str(e.value)
    assert f"{name} failed verification" in message and f"{algorithm} {wrong}" in message
    assert "the file was deleted" in message
    storage = tmp_path / "hf" / f"models--{repo.replace('/', '--')}"
    assert not list(storage.glob(f"snapshots/*/{name}"))     # no link left ...
    if algorithm == "sha256":
        assert not (storage / "blobs" / wrong).exists()      # ... and no blob under the advertised hash
    assert not list(storage.glob(f"{VERIFIED_DIR}/*/{name}"))
    # nothing a later call would trust: offline, the file is simply not there
    with pytest.raises(HubError):
        resolve(repo, **opts(hub, tmp_path, offline=True))


def test_offline_from_the_cache(hub, models, tmp_path):
    with pytest.raises(HubError, match="tiny-GGUF: no such local path, not in the hub cache .*, and offline mode is on"):
        resolve(f"{GGUF_REPO}:Q8_0", **opts(hub, tmp_path, offline=True))
    gguf = resolve(f"{GGUF_REPO}:Q8_0", **opts(hub, tmp_path))
    ckpt = resolve(CKPT_REPO, **opts(hub, tmp_path))
    hub.requests.clear()
    assert resolve(f"{GGUF_REPO}:Q8_0", **opts(hub, tmp_path, offline=True)) == gguf
    assert resolve(CKPT_REPO, **opts(hub, tmp_path, offline=True)) == ckpt
    assert hub.requests == []
    with pytest.raises(HubError, match="no GGUF file with tag 'Q4_0'; available:\n  Q8_0 "):
        resolve(f"{GGUF_REPO}:Q4_0", **opts(hub, tmp_path, offline=True))   # only what was downloaded

    # the hub goes away: the cache stands in, and says so
    hub.stop()
    said = []
    assert resolve(f"{GGUF_REPO}:Q8_0", said.append, **opts(hub, tmp_path)) == gguf
    assert resolve(CKPT_REPO, said.append, **opts(hub, tmp_path)) == ckpt
    assert any("cannot be reached" in s and "using the cached copy" in s for s in said)

    # a cached blob changed after it was verified is caught offline too, and removed
    blob = gguf.resolve()
    blob.chmod(0o644)
    with open(blob, "ab") as f:
        f.write(b"tampered")
    with pytest.raises(HubError, match="failed verification"):
        resolve(f"{GGUF_REPO}:Q8_0", **opts(hub, tmp_path, offline=True))
    assert not blob.exists()


def test_hub_errors_are_clear(hub, tmp_path):
    with pytest.raises(HubError, match="no-such/repo: no such local path, and no such model repo on http://127.0.0.1"):
        resolve("no-such/repo", **opts(hub, tmp_path))
    hub.add("gem4-test/private", {"config.json": b"{}"}, token="s3cret")
    with pytest.raises(HubError, match="a private one needs HF_TOKEN"):
        resolve("gem4-test/private", **opts(hub, tmp_path))
    with pytest.raises(HubError, match="a :TAG picks a GGUF file, and this repo has none"):
        resolve(f"{CKPT_REPO}:Q4_K_M", **opts(hub, tmp_path))
    hub.add("gem4-test/other", {"model.onnx": b"o" * 10, "README.md": b"hi"})
    with pytest.raises(HubError, match="neither a GGUF nor an HF checkpoint"):
        resolve("gem4-test/other", **opts(hub, tmp_path))


# ---------------------------------------------------------------------------------------------
# the command line, in subprocesses with huggingface_hub's environment variables
# ---------------------------------------------------------------------------------------------


def gem4_cli(args: list[str], env: dict) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("gem4")
    assert script.exists(), f"the gem4 console script is not installed next to {sys.executable}"
    return subprocess.run([str(script)] + args, capture_output=True, text=True, env=env, timeout=180)


def test_cli_run_and_pull_by_name(hub, models, tmp_path):
    hub.add("gem4-test/private-GGUF", models["gguf"], token="s3cret")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "home"), HF_TOKEN="s3cret",
               HF_HUB_DISABLE_PROGRESS_BARS="1")
    model = "gem4-test/private-GGUF:Q8_0"

    ran = gem4_cli(["run", model, "-p", "hi", "-n", "4", "--dtype", "float32", "--temperature", "0"], env)
    assert ran.returncode == 0, ran.stderr
    assert "downloading tiny-it-Q8_0.gguf" in ran.stderr
    assert "generated: 4 tokens" in ran.stderr or "finish: stop" in ran.stderr
    model_requests = [r for r in hub.requests if "private-GGUF" in r[1]]    # (huggingface_hub also asks for
    assert [r[0] for r in model_requests] == ["GET", "HEAD", "GET"]          # its agent registry)
    assert all(r[2].get("authorization") == "Bearer s3cret" for r in model_requests)   # HF_TOKEN is sent

    hub.stop()                                               # HF_HUB_OFFLINE: the cache alone
    env["HF_HUB_OFFLINE"] = "1"
    pulled = gem4_cli(["pull", model], env)
    assert pulled.returncode == 0, pulled.stderr
    path = Path(pulled.stdout.strip())
    assert path.name == GGUF_NAME and str(path).startswith(str(tmp_path / "home" / "hub"))
    assert path.read_bytes() == models["gguf"][GGUF_NAME]

    bad = gem4_cli(["pull", "gem4-test/absent"], env)
    assert bad.returncode == 2 and "gem4: error: gem4-test/absent: no such local path, not in the hub cache" in bad.stderr
